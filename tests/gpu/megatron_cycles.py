"""20 sleep/wake cycles of the slime-shaped Megatron trainer in the recommended configuration.

    python tests/gpu/megatron_cycles.py WORKDIR [CYCLES]

Each cycle is one `train()` from PAUSED (wake → a real Megatron step plus one collective on every
process group → sleep), as slime's offload_train does. Recorded per cycle, awake (inside the
step, every communicator created) and asleep: the process groups torch has registered, the GPU
memory in use, open fds and OS threads, and every hook's time. Megatron-LM #6897/#7029 report
`destroy_model_parallel` leaking ~20 groups per cycle; here nothing may grow. Writes
WORKDIR/result.json; test_megatron_cycles_gpu.py checks it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from actor_integration import ClearMemory, LifecycleMixin, ModelTagSwitch
from actor_integration.backends.memory_saver import MemorySaverConfigError
from lifecycle import Hooks, LifecyclePolicy, State, capture_events
from lifecycle.logs import Event
from tests.gpu.megatron_trainer import MegatronTrainer, free_gib

MIB = 1 << 20


def used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / MIB, 1)


def os_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line in /proc/self/status")


def resources() -> dict[str, Any]:
    return {
        "groups": len(dist.distributed_c10d._world.pg_map),
        "used_mib": used_mib(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": os_threads(),
    }


def warm_groups() -> int:
    """One collective on every registered group: every communicator exists (and holds its memory)."""
    groups = list(dist.distributed_c10d._world.pg_map)
    for pg in groups:
        on_gpu = "nccl" in str(dist.get_backend(pg))
        dist.all_reduce(torch.ones(1, device="cuda" if on_gpu else "cpu"), group=pg)
    torch.cuda.synchronize()
    return len(groups)


class CyclingTrainer(LifecycleMixin, MegatronTrainer):
    def init(self, workdir: Path) -> None:
        super().init(workdir)
        warm_groups()
        self.memory.retain_cpu_backup = True
        try:
            self.prepared = self.memory.prepare_cpu_backup(ranks_per_node=1)
        except MemorySaverConfigError as exc:  # the region pools could not be read: say so, go on
            reserved = torch.cuda.memory_reserved()
            self.prepared = self.memory.prepare_cpu_backup(ranks_per_node=1, nbytes=reserved)
            self.prepared["backup_bytes_error"] = str(exc)
        self.clear = ClearMemory(host=True)
        self.configure_lifecycle(
            LifecyclePolicy(offload_train=True, memory_tags=("model",)),
            Hooks(
                memory=self.memory,
                process_groups=self.parallel,
                clear_memory=self.clear,
                switch_model=ModelTagSwitch(self.backup, lambda: self.model),
            ),
            rank=0,
            role="actor",
        )
        self.sleep()  # slime's init ends asleep
        self.awake: dict[str, Any] = {}

    def _step(self) -> float:  # MegatronTrainer.train's body: runs awake, inside the mixin's train
        loss = super()._step()
        warm_groups()
        self.awake = resources()
        return loss


def hook_ms(events: list[dict[str, Any]], phase: str) -> dict[str, float]:
    """The hooks of the train edge `phase` ("enter": wake, "exit": sleep), and the edge itself."""
    for event in events:
        if (
            event.get("event") == Event.TRANSITION
            and event.get("operation") == "train"
            and event.get("phase") == phase
        ):
            out = {h["name"]: round(h["ms"], 1) for h in event["hooks"]}
            out["edge"] = round(event["duration_ms"], 1)
            return out
    return {}


def run(workdir: Path, cycles: int) -> dict[str, Any]:
    trainer = CyclingTrainer()
    with capture_events("info") as events:
        trainer.init(workdir)
        paths = [e for e in events if e.get("event") == Event.GROUPS_DESTROYED]
        result: dict[str, Any] = {
            "prepared": trainer.prepared,
            "teardown": {
                k: paths[0].get(k) for k in ("way", "why", "communicator_count", "bytes", "measured_by")
            }
            if paths
            else None,
            "free_gib_asleep": free_gib(),
            "cycles": [],
        }
        for cycle in range(cycles):
            mark = len(events)
            t0 = time.perf_counter()
            loss = trainer.train(cycle + 1)
            seconds = time.perf_counter() - t0
            assert trainer.lifecycle.state is State.PAUSED
            step_events = events[mark:]
            result["cycles"].append(
                {
                    "loss": loss,
                    "train_s": round(seconds, 3),
                    "wake": hook_ms(step_events, "enter"),
                    "sleep": hook_ms(step_events, "exit"),
                    "awake": trainer.awake,
                    "asleep": resources(),
                    "clear_memory_ms": dict(trainer.clear.timings_ms),
                }
            )
            c = result["cycles"][-1]
            print(
                f"cycle {cycle + 1:2d}: train {seconds:.3f} s, wake {c['wake'].get('edge')} ms, sleep "
                f"{c['sleep'].get('edge')} ms (destroy {c['sleep'].get('process_groups.destroy')}, pause "
                f"{c['sleep'].get('memory.pause')}, clear {c['sleep'].get('clear_memory')}), groups "
                f"{c['awake']['groups']}/{c['asleep']['groups']}, used MiB {c['awake']['used_mib']}/"
                f"{c['asleep']['used_mib']}, fds {c['asleep']['fds']}, threads {c['asleep']['threads']}",
                flush=True,
            )
    return result


if __name__ == "__main__":
    workdir = Path(sys.argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    outcome = run(workdir, int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    (workdir / "result.json").write_text(json.dumps(outcome, indent=2))
    print("RESULT written", flush=True)

"""Phase switch: one colocated step's lifecycle, slime's way against this library's, on one GPU.

    python benchmarks/bench_phase_switch.py --out out/bench_phase_switch.json
    python benchmarks/bench_phase_switch.py --nccl-lib /path/to/nvidia/nccl/lib/libnccl.so.2
    python benchmarks/bench_phase_switch.py --cpu-smoke     # tiny sizes, gloo, no-op memory (CI)

Every column runs the same state in the same process layout, one column after the other:

- a trainer process: the 0.6B-shaped training state (Qwen3-0.6B's 254 parameters as bf16 weights,
  fp32 main copies, Adam m and v, bf16 grads: 1270 tensors, 8.9 GiB) in a torch_memory_saver
  region with CPU backup, and the process groups of a Megatron model (megatron-core's
  `initialize_model_parallel`, or `--groups subgroups`: WORLD + 16 NCCL subgroups);
- a rollout process on the same GPU: the 1.2 GB of bf16 weights and a KV cache under
  torch_memory_saver tags `weights` and `kv_cache`, no backup (discarded on release, as SGLang);
- one step: rollout sleep -> trainer wake -> training body -> trainer sleep -> rollout wake
  weights -> sync -> rollout wake KV cache. The training body runs one collective on every
  process group, as the first step after a rebuild does (it creates the communicators a wake
  rebuilt lazily); it is timed apart and left out of the lifecycle figure. The sync sends the
  weights from a pinned CPU copy, since the trainer sleeps by then (slime's weights backup).

slime-style: slime's order and settings. `clear_memory` as slime has it (synchronize, a full
`gc.collect()`, `empty_cache`, `_host_emptyCache` on sleep), groups destroyed by torch's serial
`destroy_process_group()` and rebuilt by replaying `init_process_group` + `new_group`, the sync
with groups reloaded around it, torch_memory_saver's default pinned backup without retain, a
fresh flattened bucket and CUDA IPC handle per 512 MiB, `ipc_collect()` after each.
ours: `LifecycleMixin` + `TorchMemorySaverBackend` (retained backup, prepared at configuration),
`MegatronParallelState` over `ReloadableProcessGroups` (concurrent teardown), `ClearMemory`, the
hooks a plan declares independent run together, `RolloutActor`, `actor_integration.weight_sync`.
ours-suspend and ours-keep: the same with `communicators="suspend"` (ncclCommSuspend, skipped with
the reason where NCCL 2.29.7+ is not loaded and reachable) and `communicators="keep"`.

budget-fits, budget-part, budget-all (issue 31): ours under `LifecyclePolicy(memory_budget=...)`, the
state in two tags (`params`: bf16 weights and grads; `optimizer`: fp32 main, Adam m and v), a
`DeviceMemoryProbe`; two full-sleep calibration steps, then the rollout's KV cache is sized so its
declared wake need (`RolloutActor.wake_need_bytes`) leaves the trainer's sleep nothing to release,
part of it, or all of it. Their section prints each one's trainer lifecycle per step, the bytes
it moved, and its target next to the PCIe figure of the same run: fits <= 0.05 s; part <= bytes
moved / PCIe + 0.1 s; all no slower than ours (the full sleep). `--sm-restore` adds budget-part-sm:
budget-part with `params` kept by the backend's own pinned copy and restored by the SMs
(`device_restore`), against the same target.

Printed: each hook's time in every column (steady = median of the steps after the first), the
per-step totals, the PCIe and D2D ceilings measured in the same run, a section per way of
treating the communicators on WORLD + 16 warmed subgroups (time to free, memory freed, time to
bring back, first collectives after), and a teardown/rebuild section (serial vs concurrent
destroy; lazy vs concurrent connect). `--nccl-lib` re-runs the script with that libnccl.so.2 in
LD_PRELOAD (every child inherits it), e.g. the `nvidia-nccl-cu13` 2.30.7 wheel's, for suspend.
Targets (issue 11): ours <= 1.2 s of lifecycle per step and >= 10x faster than slime-style.
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from benchmarks.phase_switch_common import (  # noqa: E402
    BUDGET_COLUMNS,
    BUDGET_TAGS,
    BUDGETS,
    CALIBRATION_STEPS,
    COLUMNS,
    GIB,
    SM_COLUMNS,
    SMOKE,
    SMOKE_DEVICE,
    SMOKE_GROUPS,
    WAY_COLUMNS,
    WAYS,
    Config,
    Sizes,
    _numel,
    allocate_split,
    allocate_state,
    buckets_of,
    budget_margin,
    ceilings,
    init_megatron,
    new_store,
    pinned_copy,
    raw_saver,
    run_spawned,
    state_intact,
    sync,
    timed,
    used_gib,
    warm_groups,
)
from benchmarks.phase_switch_report import (  # noqa: E402
    budget_of,
    budget_verdict,
    print_report,
    summarize,
    verdict,
)
from benchmarks.phase_switch_ways import run_teardown, run_way, suspend_unreachable  # noqa: E402

# ---------------------------------------------------------------------------------------------- rollout


class BenchEngine:
    """A rollout engine with SGLang's memory behaviour: weights and KV cache in saver tags, no backup."""

    stages_weights = False

    def __init__(self, cfg: Config, kv: bool = True) -> None:
        self.saver = raw_saver(cfg.gpu)
        self.device = cfg.device
        self.weight_version = 0
        self._resident = {"weights": True, "kv_cache": True}
        with self.saver.region("weights"):
            self.weights = {
                n: torch.zeros(s, dtype=torch.bfloat16, device=cfg.device) for n, s in cfg.sizes.parameters()
            }
        self.kv: torch.Tensor | None = None
        if kv:
            self.allocate_kv(cfg.sizes.kv_cache_bytes)
        sync()

    def allocate_kv(self, nbytes: int) -> int:
        """The KV cache pool (once), sized by the budget columns after their calibration steps."""
        assert self.kv is None and self._resident["kv_cache"], "allocate_kv: once, while awake"
        with self.saver.region("kv_cache"):
            self.kv = torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16, device=self.device)
        sync()
        return self.kv.numel() * 2

    def memory_bytes(self, tag: str | None) -> int:
        """What a tag (None: every tag) holds while resident: the wake's need (RolloutActor.wake_need_bytes)."""
        held = {
            "weights": sum(w.numel() * 2 for w in self.weights.values()),
            "kv_cache": 0 if self.kv is None else self.kv.numel() * 2,
        }
        return sum(held.values()) if tag is None else held[tag]

    @property
    def residency(self) -> dict[str, bool]:
        return dict(self._resident)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            if tag != "kv_cache" or self.kv is not None:  # no pool yet: nothing to release
                self.saver.pause(tag)
            self._resident[tag] = False

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            if tag != "kv_cache" or self.kv is not None:
                self.saver.resume(tag)
            self._resident[tag] = True

    def pause_generation(self, mode: str = "abort") -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def flush_cache(self) -> bool:
        return True

    def generate(self, prompts: Any, *, max_new_tokens: int) -> list[list[int]]:
        return [[] for _ in prompts]

    def load_weights(self, version: int, shards: Any, *, round_index: int, final: bool) -> None:
        for name, tensor in shards[0]:
            self.weights[name].copy_(tensor.view(self.weights[name].shape))
        sync()
        if final:
            self.weight_version = version

    def load_bucket(self, names: list[str], bucket: torch.Tensor) -> int:
        """slime's engine side of one flattened bucket: the handle was opened by unpickling it."""
        offset = 0
        for name in names:
            target = self.weights[name]
            target.copy_(bucket[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
        sync()
        del bucket
        return offset

    def weights_checksum(self) -> str:
        firsts = torch.stack([w.reshape(-1)[0].float() for w in self.weights.values()]).cpu()
        return str(float(firsts.sum()))


def rollout_main(column: str, cfg: Config, conn: Any) -> None:
    import lifecycle

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    if cfg.gpu:
        torch.cuda.set_device(0)
    engine = BenchEngine(cfg, kv=budget_of(column) is None)
    actor = None
    if column != "slime":
        from actor_integration.rollout import RolloutActor

        actor = RolloutActor(engine)
    with lifecycle.capture_events("info") as events:
        conn.send(("ok", "ready"))
        while True:
            message = conn.recv()
            if message is None:
                break
            method, args = message
            del message
            try:
                if method == "events":
                    result: Any = list(events)
                    events.clear()
                elif method in ("load_bucket", "allocate_kv"):
                    result = getattr(engine, method)(*args)
                elif actor is not None and hasattr(actor, method):
                    result = getattr(actor, method)(*args)
                else:
                    result = getattr(engine, method)(*args)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
            del args  # a slime bucket's IPC mapping closes now, not at the next message
    conn.close()
    os._exit(0)  # torch_memory_saver's torch hook mode may exit(1) at teardown: nothing left to do


class Rollout:
    """The trainer's handle on the rollout process (what `ray.get(actor.method.remote(...))` is)."""

    def __init__(self, column: str, cfg: Config) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=rollout_main, args=(column, cfg, theirs), daemon=True)
        self.process.start()
        assert self.call("__ready__") == "ready"

    def call(self, method: str, *args: Any) -> Any:
        if method != "__ready__":
            self.conn.send((method, args))
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"rollout.{method} failed: {value}")
        return value

    def __call__(self, version: int, payloads: list[Any]) -> Any:  # WeightSender's engine_call
        return self.call("update_weights", version, payloads)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


# ---------------------------------------------------------------------------------------------- slime-style


class SlimeTrainer:
    """slime's actor as it sleeps, wakes and syncs in colocated mode, on the same state."""

    def __init__(self, cfg: Config, rollout: Rollout) -> None:
        import torch.distributed as dist

        self.cfg, self.rollout, self.dist = cfg, rollout, dist
        self.saver = raw_saver(cfg.gpu)  # TMS default: pinned backup, no retain
        self.store = new_store()
        self.worlds = 0
        self.ps: Any = None
        self.reload_groups()
        with self.saver.region("model", enable_cpu_backup=True):
            self.weights, self.others = allocate_state(cfg.sizes, cfg.device)
        self.cpu_weights = pinned_copy(self.weights, cfg.gpu)
        self.buckets = buckets_of(cfg.sizes, list(self.weights))
        self.registered = warm_groups()
        self.sleep_parts()  # slime's init ends asleep

    def clear_memory(self, host: bool) -> None:
        # slime/utils/memory_utils.py clear_memory
        sync()
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            if host:
                torch._C._host_emptyCache()

    def reload_groups(self) -> None:
        """slime's reload_process_groups: init_process_group again, then replay every new_group."""
        from torch.distributed.distributed_c10d import PrefixStore

        self.dist.init_process_group(
            self.cfg.backend,
            store=PrefixStore(f"slime/world{self.worlds}", self.store),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=300),
        )
        self.worlds += 1
        if self.cfg.groups == "megatron":
            if self.ps is not None:
                self.ps.destroy_model_parallel()  # its globals name the destroyed groups
            self.ps = init_megatron()
        else:
            for _ in range(16):
                self.dist.new_group([0])

    def destroy_groups(self) -> None:
        self.dist.destroy_process_group()  # torch's order, one communicator after another

    def sleep_parts(self) -> dict[str, float]:
        return {
            "sleep.clear_memory": timed(lambda: self.clear_memory(host=True)),
            "sleep.process_groups.destroy": timed(self.destroy_groups),
            "sleep.memory.pause": timed(self.saver.pause),
        }

    def step(self, version: int) -> dict[str, float]:
        rows: dict[str, float] = {}
        start = time.perf_counter()
        rows["rollout.sleep"] = timed(lambda: self.rollout.call("release_memory_occupation"))
        wake = {
            "wake.memory.resume": timed(self.saver.resume),
            "wake.clear_memory": timed(lambda: self.clear_memory(host=False)),
            "wake.process_groups.reload": timed(self.reload_groups),
        }
        rows.update(wake, **{"wake": sum(wake.values())})
        rows["body"] = timed(lambda: (state_intact(self.weights), warm_groups()))
        rows["intact"] = float(state_intact(self.weights))
        sleep = self.sleep_parts()
        rows.update(sleep, sleep=sum(sleep.values()))
        rows["rollout.wake_weights"] = timed(
            lambda: self.rollout.call("resume_memory_occupation", ["weights"])
        )
        up = timed(self.reload_groups)
        transfer = timed(self.send_buckets)
        down = timed(self.destroy_groups)
        rows.update({"sync.groups_up": up, "sync.transfer": transfer, "sync.groups_down": down})
        rows["sync"] = up + transfer + down
        rows["rollout.wake_kv"] = timed(lambda: self.rollout.call("resume_memory_occupation", ["kv_cache"]))
        rows["step"] = time.perf_counter() - start
        rows["asleep_used_gib"] = used_gib() or 0.0
        return rows

    def send_buckets(self) -> None:
        """slime's colocated update: a fresh flattened bucket per 512 MiB, shared with a fresh IPC handle.

        slime wraps it in `torch_memory_saver.disable()`, which its preload mode (TMS_INIT_ENABLE)
        needs; in torch hook mode memory outside regions is plain already (and disable() asserts).
        """
        for names in self.buckets:
            parts = [self.cpu_weights[n].to(self.cfg.device, non_blocking=True).view(-1) for n in names]
            bucket = torch.cat(parts)
            del parts
            sync()
            self.rollout.call("load_bucket", names, bucket)  # pickled by torch: a new CUDA IPC handle
            del bucket
            if self.cfg.gpu:
                torch.cuda.ipc_collect()


# ---------------------------------------------------------------------------------------------- ours


class _TrainerBody:
    """The existing actor's bodies, wrapped by LifecycleMixin below (no training: one collective per group)."""

    sender: Any
    cpu_weights: dict[str, torch.Tensor]

    weights: dict[str, torch.Tensor]
    intact: bool = False

    free_bytes: Callable[[], int | None] | None = None
    free_at_end: int | None = None

    def train(self, step: int) -> int:
        self.intact = state_intact(self.weights)  # the state came back (read while awake)
        registered = warm_groups()
        if self.free_bytes is not None:  # the free memory the trainer's sleep starts from
            self.free_at_end = self.free_bytes()
        return registered

    def update_weights(self, version: int) -> Any:
        return self.sender.send(version, self.cpu_weights)


def ours_trainer_class() -> type:
    from actor_integration import LifecycleMixin

    class OursTrainer(LifecycleMixin, _TrainerBody):
        pass

    return OursTrainer


class Ours:
    """This library's recommended configuration, driven the way a slime-shaped driver calls it."""

    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        communicators: str = "destroy",
        budget: str | None = None,
        sm_restore: bool = False,
    ) -> None:
        from actor_integration import (
            ClearMemory,
            DeviceMemoryProbe,
            MegatronParallelState,
            ReloadableProcessGroups,
            select_memory_backend,
        )
        from actor_integration.backends.release_audit import cuda_free_bytes
        from actor_integration.weight_sync import RankSlot, WeightSender, configure_sender
        from lifecycle import Hooks, LifecyclePolicy, MemoryBudget

        self.cfg, self.rollout, self.budget = cfg, rollout, budget
        self.plans: list[dict[str, Any]] = []  # per step, the train exit sleep's budget plan
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend,
            rank=0,
            world_size=1,
            store=new_store(),
            timeout=timedelta(seconds=300),
            communicators=communicators,
        )
        process_groups: Any = groups
        if cfg.groups == "megatron":
            process_groups = MegatronParallelState(
                groups, tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )
        else:
            for i in range(16):
                groups.new_group([0], name=f"g{i}")
        self.groups = groups
        # After megatron.core is imported: it sets torch_memory_saver.hook_mode on import, which TMS
        # refuses once the backend below has initialised it.
        tags = BUDGET_TAGS if budget else ("model",)
        memory = select_memory_backend(
            "tms" if cfg.gpu else "noop",
            tags=tags,
            cpu_backup=True,
            device_restore=["params"] if sm_restore else False,
            retain_cpu_backup=True,
            hook_mode="torch",
        )
        if budget:
            self.weights, self.others, self.tag_bytes = allocate_split(cfg.sizes, cfg.device, memory)
        else:
            with memory.region("model"):
                self.weights, self.others = allocate_state(cfg.sizes, cfg.device)
            self.tag_bytes = {
                "model": sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.others])
            }
        # The budget's free memory: the device's (CUDA), or on CPU a device of SMOKE_DEVICE bytes
        # holding the trainer's resident tags and, while alive, SMOKE_GROUPS bytes of communicators.
        self.free_bytes: Callable[[], int | None] = cuda_free_bytes if cfg.gpu else self._smoke_free
        self.memory = memory
        trainer = ours_trainer_class()()
        trainer.free_bytes = self.free_bytes if budget else None
        trainer.weights = self.weights
        trainer.cpu_weights = pinned_copy(self.weights, cfg.gpu)
        transport = configure_sender("auto", colocated=True, memory=memory)
        trainer.sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=rollout,
            bucket_bytes=cfg.sizes.bucket_bytes,
            deadline_s=cfg.timeout_s,
        )
        self.transport = type(transport).__name__
        self.registered = warm_groups()
        self.prepared: dict[str, Any] = {}
        if hasattr(memory, "prepare_cpu_backup"):
            try:  # read from torch_memory_saver's region pools, checked against the state allocated
                read: Any = memory.backup_bytes()
            except Exception as exc:
                read = repr(exc)
            known = sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.others])
            self.prepared = memory.prepare_cpu_backup(ranks_per_node=1, nbytes=known)
            self.prepared["backup_bytes_read"] = read
        self.clear = ClearMemory(host=True)
        probe = (
            DeviceMemoryProbe(
                free_bytes=self.free_bytes,
                expected_bytes=lambda tag: self.tag_bytes.get(tag) if tag else sum(self.tag_bytes.values()),
            )
            if budget and budget != "full"
            else None
        )
        trainer.configure_lifecycle(
            LifecyclePolicy(
                offload_train=True,
                memory_tags=tags,
                model_tag=None,
                memory_budget=MemoryBudget(margin_bytes=budget_margin(cfg)) if probe else None,
            ),
            Hooks(memory=memory, process_groups=process_groups, clear_memory=self.clear, budget=probe),
            rank=0,
            role="actor",
        )
        self.trainer = trainer
        trainer.sleep()  # as slime's init ends asleep
        self.version = 0

    def _smoke_free(self) -> int:
        held = sum(b for t, b in self.tag_bytes.items() if not self.memory.is_paused(t))
        return SMOKE_DEVICE - held - (SMOKE_GROUPS if self.groups.is_alive() else 0)

    def step(self, version: int, events: list[dict[str, Any]]) -> dict[str, float]:
        from lifecycle.logs import Event

        rows: dict[str, float] = {}
        mark = len(events)
        start = time.perf_counter()
        rows["rollout.sleep"] = timed(lambda: self.rollout.call("sleep"))
        rows["train"] = timed(lambda: self.trainer.train(version))
        rows["intact"] = float(self.trainer.intact)
        if self.budget:  # what the trainer's sleep left free (the rollout asleep): calibration
            free_at_sleep, freed = self.trainer.free_at_end, self.free_bytes()
            if free_at_sleep is not None and freed is not None:
                rows["budget.free_at_sleep"] = float(free_at_sleep)
                rows["budget.freed"] = float(freed - free_at_sleep)
        rows["rollout.wake_weights"] = timed(lambda: self.rollout.call("wake_up", ["weights"]))
        rows["sync"] = timed(lambda: self.trainer.update_weights(version))
        rows["rollout.wake_kv"] = timed(lambda: self.rollout.call("wake_up", ["kv_cache"]))
        rows["step"] = time.perf_counter() - start
        rows["asleep_used_gib"] = used_gib() or 0.0
        edges = {
            ("train", "enter"): "wake",
            ("train", "exit"): "sleep",
            ("sync", "enter"): "sync.groups_up",
            ("sync", "exit"): "sync.groups_down",
        }
        for event in events[mark:]:
            name, op = event.get("event"), event.get("operation")
            where = edges.get((op, event.get("phase")))
            if name == Event.TRANSITION and where is not None:
                rows[where] = event["duration_ms"] / 1e3
                for hook in event["hooks"] if where in ("wake", "sleep") else ():
                    key = f"{where}.{hook['name']}"
                    rows[key] = rows.get(key, 0.0) + hook["ms"] / 1e3
            elif name == Event.BODY:
                rows["body" if op == "train" else "sync.transfer"] = event["duration_ms"] / 1e3
        plans = [e for e in events[mark:] if e.get("event") == Event.BUDGET]
        checks = [e for e in events[mark:] if e.get("event") == Event.BUDGET_CHECKED]
        if self.budget or plans:
            released = plans[0].get("released", list(self.tag_bytes)) if plans else list(self.tag_bytes)
            self.plans.append(
                {
                    "need_bytes": plans[0].get("need_bytes") if plans else None,
                    "released": released,
                    "kept": plans[0].get("kept") if plans else [],
                    "feasible": plans[0].get("feasible") if plans else None,
                    "met": checks[0].get("met") if checks else None,
                    "free_bytes": plans[0].get("free_bytes") if plans else None,
                }
            )
        else:
            released = list(self.tag_bytes)
        # What the step moved over PCIe: each released tag down at the sleep, up at the next wake.
        rows["moved_bytes"] = float(sum(self.tag_bytes.get(t, 0) for t in released))
        # The trainer's lifecycle: its train call but the body (wake, the budget's plan, sleep, its
        # check), and the sync's groups up and down.
        rows["trainer"] = (
            rows["train"]
            - rows.get("body", 0.0)
            + rows.get("sync.groups_up", 0.0)
            + rows.get("sync.groups_down", 0.0)
        )
        destroyed = [e for e in events[mark:] if e.get("event") == Event.GROUPS_DESTROYED]
        if destroyed and destroyed[0].get("bytes") is not None:  # the first is the train exit's sleep
            rows["sleep.groups_freed_gib"] = destroyed[0]["bytes"] / GIB
        return rows


# ---------------------------------------------------------------------------------------------- columns


def column_main(column: str, cfg: Config, out: str) -> None:
    """One column in this process (the trainer), with its rollout process beside it."""
    import lifecycle

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {"column": column}
    rollout = None
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        t0 = time.perf_counter()
        rollout = Rollout(column, cfg)
        steps = cfg.slime_steps if column == "slime" else cfg.steps
        # debug: every process_groups.destroyed/reloaded event, not only the first (at info)
        with lifecycle.capture_events("debug") as events:
            budget = budget_of(column)
            trainer: Any = (
                SlimeTrainer(cfg, rollout)
                if column == "slime"
                else Ours(cfg, rollout, way_of(column), budget=budget, sm_restore=column in SM_COLUMNS)
            )
            first = 1
            if budget is not None:
                # Full sleeps first (no need declared): they teach the budget what each item frees
                # and costs, and measure the free memory the trainer's sleep starts from; then the
                # rollout's KV cache is sized so that its wake needs nothing, part, or all of it.
                result["calibration_steps"] = [
                    trainer.step(v, events) for v in range(1, CALIBRATION_STEPS + 1)
                ]
                result["need"] = set_need(trainer, rollout, cfg, budget, result["calibration_steps"][-1])
                trainer.plans.clear()
                first = CALIBRATION_STEPS + 1
                print(f"  {column}: {result['need']['summary']}", flush=True)
            result["setup_s"] = round(time.perf_counter() - t0, 2)
            import torch.distributed as dist

            result["registered_groups_awake"] = trainer.registered
            result["prepared"] = getattr(trainer, "prepared", None)
            result["transport"] = getattr(trainer, "transport", "fresh CUDA IPC handle per bucket")
            result["steps"] = []
            for version in range(first, first + steps):
                rows = trainer.step(version) if column == "slime" else trainer.step(version, events)
                result["steps"].append(rows)
                print(f"  {column} step {version}: {rows['step']:.3f} s", flush=True)
            if column != "slime":
                from actor_integration.backends.process_groups import loaded_nccl, nccl_suspend_support

                result["plans"] = trainer.plans
                result["tag_bytes"] = trainer.tag_bytes
                result["clear_memory_ms"] = trainer.clear.timings_ms
                result["communicators"] = trainer.groups.communicators
                result["suspend_probe"] = nccl_suspend_support(cfg.backend).reason
                loaded = loaded_nccl()
                result["nccl_loaded"] = None if loaded is None else ".".join(map(str, loaded.version))
                result["groups_events"] = [
                    {k: e.get(k) for k in ("event", "way", "bytes", "measured_by", "fell_back", "held_bytes")}
                    for e in events
                    if e.get("event") in ("process_groups.destroyed", "process_groups.reloaded")
                ][:4]
            result["registered_groups_asleep"] = len(dist.distributed_c10d._world.pg_map)
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
        print(result["error"], flush=True)
    finally:
        if rollout is not None:
            rollout.stop()
    Path(out).write_text(json.dumps(result, default=str))
    lifecycle.flush_logs()
    os._exit(0)  # torch_memory_saver's torch hook mode may exit(1) at teardown: the result is written


def planned_columns(ways: list[str], budgets: list[str], sm_restore: bool) -> list[str]:
    """The columns a run makes, in order: ours first (a run cut short still has it)."""
    return [
        *reversed(COLUMNS),
        *(WAY_COLUMNS[w] for w in ways if w in WAY_COLUMNS),
        *(BUDGET_COLUMNS[b] for b in budgets),
        *([BUDGET_COLUMNS["full"]] if "all" in budgets else []),
        *(c for c, b in SM_COLUMNS.items() if sm_restore and b in budgets),
    ]


def set_need(
    ours: Ours, rollout: Rollout, cfg: Config, budget: str, last: dict[str, float]
) -> dict[str, Any]:
    """Size the rollout's KV cache so the trainer's next sleeps must release nothing, part or all,
    from the last calibration step's figures; declare the rollout's wake need to the trainer.

    fits: the KV cache the bench runs with (--kv-gib); part: half the smaller tag beyond what is
    free (need + margin - free); all: what the full sleep freed, less a quarter of the smaller tag
    (more than any release but all of them frees)."""
    free_at_sleep, freed = int(last["budget.free_at_sleep"]), int(last["budget.freed"])
    margin = budget_margin(cfg)
    weights = int(rollout.call("wake_need_bytes"))  # weights only: no KV pool yet
    small = min(ours.tag_bytes.values())
    full = free_at_sleep - margin + freed - small // 4
    need = {
        "fits": weights + cfg.sizes.kv_cache_bytes,
        "part": free_at_sleep - margin + small // 2,
        "all": full,
        "full": full,
    }[budget]
    if need - weights <= 0:
        raise RuntimeError(f"budget {budget}: a need of {need} bytes leaves no room for a KV cache")
    kv = int(rollout.call("allocate_kv", need - weights))
    declared = int(rollout.call("wake_need_bytes"))  # RolloutActor.wake_need_bytes: weights + KV
    if budget != "full":  # the full sleep's column has no budget to declare it to
        ours.trainer.lifecycle_expect(declared)
    required = declared + margin - free_at_sleep
    return {
        "need_bytes": declared,
        "kv_bytes": kv,
        "weights_bytes": weights,
        "free_at_sleep_bytes": free_at_sleep,
        "full_sleep_freed_bytes": freed,
        "margin_bytes": margin,
        "required_bytes": required,
        "summary": (
            f"rollout need {declared / GIB:.2f} GiB (KV {kv / GIB:.2f} GiB); free at the trainer's sleep "
            f"{free_at_sleep / GIB:.2f} GiB, margin {margin / GIB:.2f} GiB: the sleep must free "
            f"{max(0, required) / GIB:.2f} GiB (the full sleep freed {freed / GIB:.2f} GiB)"
        ),
    }


def way_of(column: str) -> str:
    """The communicators= way a column of ours runs with ("ours" is the default, destroy)."""
    return next((way for way, name in WAY_COLUMNS.items() if name == column), "destroy")


def run_column(column: str, cfg: Config) -> dict[str, Any]:
    return run_spawned(column_main, (column, cfg), cfg.timeout_s, {"column": column})


def with_nccl_library(path: Path, argv: list[str]) -> None:
    """Run this script again with `path` first in LD_PRELOAD, so torch (and every child) uses it."""
    preload = os.environ.get("LD_PRELOAD", "")
    if str(path) in preload.split(":"):
        return
    if not path.exists():
        raise SystemExit(f"--nccl-lib {path}: no such file")
    env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (str(path), preload) if p)}
    print(f"re-running with LD_PRELOAD={env['LD_PRELOAD']}", flush=True)
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, gloo, no-op memory (CI)")
    parser.add_argument("--groups", choices=("megatron", "subgroups"), default=None)
    parser.add_argument("--steps", type=int, default=4, help="steps of ours (the first is reported apart)")
    parser.add_argument("--slime-steps", type=int, default=2, help="steps of slime-style (1: first only)")
    parser.add_argument("--kv-gib", type=float, default=4.0, help="the rollout's KV cache (GiB)")
    parser.add_argument("--no-teardown", action="store_true", help="skip the teardown/rebuild section")
    parser.add_argument(
        "--ways",
        default=",".join(WAYS),
        help="ways of treating the communicators on sleep, as columns and in their own section "
        "(comma-separated: destroy,suspend,keep; '' for none beyond ours)",
    )
    parser.add_argument(
        "--way-steps", type=int, default=3, help="steps of the ours-suspend and ours-keep columns"
    )
    parser.add_argument(
        "--budget",
        default=",".join(BUDGETS),
        help="memory-budget columns: the rollout's need set so the trainer's sleep releases nothing (fits), "
        "part, or all (comma-separated; '' for none)",
    )
    parser.add_argument(
        "--sm-restore",
        action="store_true",
        help="also budget-part-sm: budget-part with `params` restored by the SMs (device_restore)",
    )
    parser.add_argument(
        "--columns",
        default=None,
        help="run only these columns (comma-separated, e.g. ours,budget-fits; default: every column)",
    )
    parser.add_argument(
        "--nccl-lib",
        type=Path,
        help="a libnccl.so.2 to run with (LD_PRELOAD, every child too), e.g. nvidia-nccl-cu13 2.30.7's",
    )
    parser.add_argument("--timeout", type=float, default=400.0, help="per process, seconds")
    args = parser.parse_args(argv)
    if args.nccl_lib is not None:
        with_nccl_library(args.nccl_lib.resolve(), sys.argv[1:] if argv is None else argv)
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {unknown}; the ways are {list(WAYS)}")
    budgets = [b for b in args.budget.split(",") if b]
    if [b for b in budgets if b not in BUDGETS]:
        parser.error(
            f"--budget: unknown {[b for b in budgets if b not in BUDGETS]}; they are {list(BUDGETS)}"
        )
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_phase_switch needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    sizes = SMOKE if args.cpu_smoke else Sizes(kv_cache_bytes=int(args.kv_gib * GIB))
    cfg = Config(
        sizes=sizes,
        device="cpu" if args.cpu_smoke else "cuda",
        groups=args.groups or ("subgroups" if args.cpu_smoke else "megatron"),
        steps=max(args.steps, 2),
        slime_steps=max(args.slime_steps, 1),
        timeout_s=args.timeout,
    )
    started = time.perf_counter()
    params = sizes.parameters()
    state_bytes = sum(_numel(s) for _, s in params) * (2 + 4 + 4 + 4 + 2)
    from actor_integration.backends.process_groups import loaded_nccl

    loaded = loaded_nccl()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cfg.gpu else "cpu (smoke)",
        "torch": torch.__version__,
        "nccl_loaded": None
        if loaded is None
        else {"version": ".".join(map(str, loaded.version)), "path": loaded.path},
        "config": {**asdict(cfg), "sizes": asdict(sizes)},
        "state_gib": state_bytes / GIB,
        "state_tensors": 5 * len(params),
        "weights_gb": sum(_numel(s) for _, s in params) * 2 / 1e9,
        "ceilings": ceilings(cfg),
        "columns": {},
    }
    unreachable = suspend_unreachable(cfg)
    columns = planned_columns(ways, budgets, args.sm_restore)
    if args.columns is not None:
        chosen = [c for c in args.columns.split(",") if c]
        if [c for c in chosen if c not in columns]:
            missing = [c for c in chosen if c not in columns]
            hint = "; budget-part-sm needs --sm-restore" if any(c in SM_COLUMNS for c in missing) else ""
            parser.error(f"--columns: {missing} not among {columns}{hint}")
        columns = [c for c in columns if c in chosen]

    def save() -> None:  # what a run cut short leaves behind
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2, default=str))

    for column in columns:
        if way_of(column) == "suspend" and unreachable:
            print(f"{column} skipped: {unreachable}", flush=True)
            report["columns"][column] = {"column": column, "skipped": unreachable}
            continue
        print(f"running {column} ...", flush=True)
        column_cfg = cfg if column in COLUMNS else replace(cfg, steps=max(args.way_steps, 2))
        report["columns"][column] = run_column(column, column_cfg)
        save()
    report["ways"] = {}
    for way in ways:
        if way == "suspend" and unreachable:
            print(f"ways section, suspend skipped: {unreachable}", flush=True)
            report["ways"][way] = {"way": way, "skipped": unreachable}
            continue
        print(f"ways section: {way} on WORLD + 16 subgroups ...", flush=True)
        report["ways"][way] = run_way(cfg, way)
        save()
    report["teardown"] = {} if args.no_teardown else run_teardown(cfg)
    report["summary"] = {c: summarize(r) for c, r in report["columns"].items() if "skipped" not in r}
    report["verdict"] = verdict(report["summary"])
    report["budget"] = budget_verdict(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(report)
    print(f"total {report['wall_s']} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    failed = [c for c, r in report["columns"].items() if "error" in r]
    failed += [w for w, r in report["ways"].items() if "error" in r]
    return 1 if failed or "error" in report["teardown"] else 0


if __name__ == "__main__":
    sys.exit(main())

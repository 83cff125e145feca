"""slime's own trainer actor: its sleep and wake, plain against wrapped in SlimeLifecycleMixin, in one run.

    python benchmarks/bench_slime_actor.py --slime-source PATH --out out/bench_slime_actor.json
    python benchmarks/bench_slime_actor.py --slime-source PATH --cpu-smoke   # gloo, tiny state, fake TMS

Both columns run slime's real code from its source at the pinned commit (`tests/helpers/slime_source.py`:
`MegatronTrainRayActor`, `TrainRayActor`, the reloadable process groups and their monkey patch, the
gloo group, the tensor backuper, slime's accelerator and memory helpers) in one process each, started
the way slime's `RayTrainGroup` starts a colocated, offloaded actor: `LD_PRELOAD` of
torch_memory_saver's preload library, `TMS_INIT_ENABLE=1`, `TMS_INIT_ENABLE_CPU_BACKUP=1`, and no
`TMS_RETAIN_CPU_BACKUP`. Only Megatron's model is a stand-in: the 0.6B-shaped training state of
`bench_phase_switch.py` (Qwen3-0.6B's 254 parameters as bf16 weights, fp32 main, Adam m and v, bf16
grads: 8.9 GiB in 1,270 tensors), with megatron-core's process groups (`initialize_model_parallel`,
TP=PP=1, through slime's patched `new_group`, so every one is slime-wrapped).

- slime: `MegatronTrainRayActor` as slime ships it.
- wrapped: `class LifecycleTrainer(SlimeLifecycleMixin, MegatronTrainRayActor): pass`, the README's wrap.

Each column: `init(args, "actor")` (it ends with the sleep of an offloaded actor), then cycles of
`wake_up()` -> one collective on every group (the first step after a rebuild; timed apart, not
lifecycle) -> `sleep()`. Printed: each part of the sleep and wake (slime's own functions timed in
place in the slime column; the transitions' hooks in the wrapped one), the steady cycle (median of
the cycles after the first), the device memory each sleep freed, whether the state survived every
wake, and the ratio. Target (issue 21): wrapped sleep + wake >= 10x faster than slime's. Measured,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

GIB = 2**30
TARGET_RATIO = 10.0
COLUMNS = ("wrapped", "slime")  # wrapped first: a run cut short still has it
SLEEP_PARTS = ("clear_memory", "process_groups.destroy", "memory.pause")
WAKE_PARTS = ("memory.resume", "clear_memory", "process_groups.reload", "switch_model")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------- child


def _training_state(cpu_smoke: bool) -> Callable[[Any, str], tuple[Any, ...]]:
    """slime's `initialize_model_and_optimizer`, returning the 0.6B-shaped state (tiny on the CPU smoke)."""
    import torch

    from benchmarks.phase_switch_common import Sizes, allocate_state

    sizes = Sizes(layers=2, hidden=64, q_dim=64, kv_dim=32, ffn=128, vocab=256) if cpu_smoke else Sizes()

    def initialize_model_and_optimizer(args: Any, role: str) -> tuple[Any, ...]:
        device = "cpu" if cpu_smoke else "cuda"
        weights, others = allocate_state(sizes, device)
        model = torch.nn.Module()
        for name, tensor in weights.items():
            model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor, requires_grad=False))
        optimizer = argparse.Namespace(state=others)  # fp32 main, Adam m and v, grads
        return [model], optimizer, argparse.Namespace(), -1

    return initialize_model_and_optimizer


def _fingerprint(actor: Any) -> list[float]:
    """First element of every weight and state tensor: allocate_state fills them with exact values."""
    import torch

    tensors = [p for chunk in actor.model for p in chunk.parameters()] + list(actor.optimizer.state)
    return torch.stack([t.reshape(-1)[0].float() for t in tensors]).cpu().tolist()


def _collectives() -> int:
    """One collective on every group slime wrapped and on WORLD, as the first step after a wake does."""
    import torch
    import torch.distributed as dist

    registry = sys.modules["slime.utils.reloadable_process_group"].ReloadableProcessGroup.GROUPS
    groups = [*registry.get(os.getpid(), []), None]
    for group in groups:
        on_gpu = "nccl" in str(dist.get_backend(group))
        dist.all_reduce(torch.ones(1, device="cuda" if on_gpu else "cpu"), group=group)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return len(groups)


class _Parts:
    """slime's own sleep/wake functions, timed where slime's actor module calls them (the slime column)."""

    def __init__(self, actor_module: Any, actor: Any) -> None:
        self.seconds: dict[str, float] = {}
        names = {
            "clear_memory": "clear_memory",
            "destroy_process_groups": "process_groups.destroy",
            "reload_process_groups": "process_groups.reload",
        }
        for name, part in names.items():
            setattr(actor_module, name, self._timed(part, getattr(actor_module, name)))
        saver = actor_module.torch_memory_saver
        parts = self

        class TimedSaver:
            def pause(self, tag: str | None = None) -> None:
                parts._timed("memory.pause", saver.pause)(tag)

            def resume(self, tag: str | None = None) -> None:
                parts._timed("memory.resume", saver.resume)(tag)

            def __getattr__(self, name: str) -> Any:
                return getattr(saver, name)

        actor_module.torch_memory_saver = TimedSaver()
        switch = actor._switch_model
        actor._switch_model = self._timed("switch_model", switch)

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start

        return run

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def _hook_seconds(events: list[dict[str, Any]]) -> dict[str, float]:
    """The hooks of the transitions logged since the last call, summed by name (the wrapped column)."""
    seconds: dict[str, float] = {}
    for event in events:
        if event.get("event") == "lifecycle.transition":
            for hook in event.get("hooks", []):
                seconds[hook["name"]] = seconds.get(hook["name"], 0.0) + hook["ms"] / 1e3
    events.clear()
    return seconds


def child_main(column: str, location: str, commit: str, cycles: int, cpu_smoke: bool, out: str) -> None:
    import torch

    import lifecycle
    from tests.helpers.slime_source import SlimeSource, install, slime_args

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {"column": column, "cycles": [], "notes": []}
    try:
        source = SlimeSource(Path(location), commit)
        actor_module = install(
            source, device="cpu" if cpu_smoke else "cuda", model_and_optimizer=_training_state(cpu_smoke)
        )
        result["slime_commit"] = source.resolved_commit()
        if cpu_smoke:  # the launcher's environment, read by the adapter (the fake TMS ignores it)
            from actor_integration.backends.tms_env import preload_library

            os.environ.update(
                {"LD_PRELOAD": preload_library(13), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
            )
        elif column == "slime":  # the adapter does this itself (its memory backend), and says so
            from torch_memory_saver import torch_memory_saver

            pending = getattr(torch_memory_saver, "_impl_ctor_kwargs", None) or {}
            if pending.get("hook_mode") == "torch":
                # megatron-core's import asks for torch mode; slime's launcher preloads TMS, so its
                # deployments run preload (else its pause releases none of the preload's memory).
                torch_memory_saver.hook_mode = "preload"
                result["notes"].append(
                    "megatron-core had set hook_mode='torch'; preload restored (slime's mode)"
                )
        cls = actor_module.MegatronTrainRayActor
        if column == "wrapped":
            from actor_integration.frameworks.slime import SlimeLifecycleMixin, slime_memory_backend

            namespace: dict[str, Any] = {}
            if cpu_smoke:  # a CPU torch has no CUDA major to pick the preload library by
                namespace["lifecycle_memory"] = lambda self: slime_memory_backend(cuda_major=13)
            cls = type("LifecycleTrainer", (SlimeLifecycleMixin, cls), namespace)
        actor = cls(1, 0, "127.0.0.1", int(os.environ["BENCH_MASTER_PORT"]))
        args = slime_args(1, distributed_backend="gloo" if cpu_smoke else "nccl")
        parts = _Parts(actor_module, actor) if column == "slime" else None
        with lifecycle.events.capture_events() as events:
            start = time.perf_counter()
            actor.init(args, "actor")  # ends with the offloaded actor's first sleep
            result["init_s"] = round(time.perf_counter() - start, 3)
            expected = None
            if column == "wrapped":
                result["memory"] = actor.lifecycle.hooks.memory.describe()
                result["notes"] += actor.lifecycle.hooks.memory.notes
            for cycle in range(cycles):
                if parts is not None:
                    parts.take()
                _hook_seconds(events)
                free = _free_bytes()
                wake = _timed(actor.wake_up)
                wake_parts = parts.take() if parts is not None else _hook_seconds(events)
                taken = None if free is None else free - (_free_bytes() or 0)
                fingerprint = _fingerprint(actor)
                expected = expected or fingerprint
                body = _timed(_collectives)
                free = _free_bytes()
                sleep = _timed(actor.sleep)
                sleep_parts = parts.take() if parts is not None else _hook_seconds(events)
                freed = None if free is None else (_free_bytes() or 0) - free
                result["cycles"].append(
                    {
                        "wake_s": wake,
                        "sleep_s": sleep,
                        "body_s": body,
                        "wake_parts": wake_parts,
                        "sleep_parts": sleep_parts,
                        "taken_gib": None if taken is None else round(taken / GIB, 2),
                        "freed_gib": None if freed is None else round(freed / GIB, 2),
                        "intact": fingerprint == expected,
                    }
                )
                print(f"[{column}] cycle {cycle}: wake {wake:.3f} s, sleep {sleep:.3f} s", flush=True)
        if torch.cuda.is_initialized():
            result["state_gib"] = round(
                sum(t.numel() * t.element_size() for t in _state_tensors(actor)) / GIB, 2
            )
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # skip interpreter teardown (torch_memory_saver's frees at exit are not what is measured)


def _state_tensors(actor: Any) -> list[Any]:
    return [p for chunk in actor.model for p in chunk.parameters()] + list(actor.optimizer.state)


def _timed(fn: Callable[[], Any]) -> float:
    import torch

    start = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return round(time.perf_counter() - start, 4)


def _free_bytes() -> int | None:
    import torch

    if not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.mem_get_info()[0])


# ---------------------------------------------------------------------------------------------- parent


def run_column(column: str, location: str, commit: str, cycles: int, cpu_smoke: bool) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "BENCH_MASTER_PORT": str(_free_port())}
    if not cpu_smoke:
        from actor_integration.backends.tms_env import preload_library

        # What slime's RayTrainGroup puts in the actor's environment (no TMS_RETAIN_CPU_BACKUP).
        env.update(
            {"LD_PRELOAD": preload_library(), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
        )
        env.pop("TMS_RETAIN_CPU_BACKUP", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            __file__,
            "--child",
            column,
            "--slime-source",
            location,
            "--commit",
            commit,
        ]
        command += ["--cycles", str(cycles), "--result", str(out)] + (["--cpu-smoke"] if cpu_smoke else [])
        proc = subprocess.run(command, env=env, timeout=900, capture_output=True, text=True)
        if not out.exists():
            return {
                "column": column,
                "error": f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
            }
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def steady(result: dict[str, Any], key: str) -> float | None:
    cycles = result.get("cycles", [])[1:] or result.get("cycles", [])
    values = [c[key] for c in cycles if c[key] is not None]
    return statistics.median(values) if values else None


def steady_part(result: dict[str, Any], phase: str, part: str) -> float | None:
    cycles = result.get("cycles", [])[1:] or result.get("cycles", [])
    values = [c[f"{phase}_parts"].get(part, 0.0) for c in cycles]
    return statistics.median(values) if values else None


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows: list[tuple[str, str, str]] = []
    for phase, parts in (("wake", WAKE_PARTS), ("sleep", SLEEP_PARTS)):
        rows.append((f"{phase}", *(cell(steady(results[c], f"{phase}_s")) for c in ("slime", "wrapped"))))
        for part in parts:
            rows.append(
                (f"  {part}", *(cell(steady_part(results[c], phase, part)) for c in ("slime", "wrapped")))
            )
    totals = {}
    for column in ("slime", "wrapped"):
        wake, sleep = steady(results[column], "wake_s"), steady(results[column], "sleep_s")
        totals[column] = None if wake is None or sleep is None else wake + sleep
    rows.append(("sleep + wake (steady)", cell(totals["slime"]), cell(totals["wrapped"])))
    for label, key in (("first cycle: sleep + wake", None), ("init (ends asleep)", "init_s")):
        values = []
        for column in ("slime", "wrapped"):
            result = results[column]
            if key is not None:
                values.append(cell(result.get(key)))
            elif result.get("cycles"):
                first = result["cycles"][0]
                values.append(cell(first["wake_s"] + first["sleep_s"]))
            else:
                values.append("-")
        rows.append((label, *values))
    rows.append(
        (
            "one collective per group after a wake (not lifecycle)",
            *(cell(steady(results[c], "body_s")) for c in ("slime", "wrapped")),
        )
    )
    rows.append(
        (
            "device memory freed by a sleep, GiB",
            *(str(steady(results[c], "freed_gib")) for c in ("slime", "wrapped")),
        )
    )
    rows.append(
        (
            "state intact after every wake",
            *(
                str(
                    all(x["intact"] for x in results[c].get("cycles", []))
                    if results[c].get("cycles")
                    else "-"
                )
                for c in ("slime", "wrapped")
            ),
        )
    )
    width = max(len(r[0]) for r in rows)
    print(f"\n{'seconds (steady: median of cycles 2..n)':<{width}}  {'slime':>10}  {'wrapped':>10}")
    for label, a, b in rows:
        print(f"{label:<{width}}  {a:>10}  {b:>10}")
    ratio = None
    if totals["slime"] and totals["wrapped"]:
        ratio = round(totals["slime"] / totals["wrapped"], 1)
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(
            f"\nwrapped sleep + wake is {ratio}x faster than slime's own (target >= {TARGET_RATIO:.0f}x: {verdict})"
        )
    for column in ("slime", "wrapped"):
        result = results[column]
        for note in result.get("notes", []):
            print(f"[{column}] {note}")
        if "error" in result:
            print(f"[{column}] FAILED:\n{result['error']}")
    return {"ratio": ratio, "steady_sleep_wake_s": totals}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slime-source", default=os.environ.get("RL_LIFECYCLE_SLIME_SOURCE"))
    parser.add_argument("--commit", default=None, help="slime commit (default: the adapter's pinned one)")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo, a tiny state, the fake TMS")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=COLUMNS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from actor_integration.frameworks.slime import SLIME_COMMIT

    commit = args.commit or SLIME_COMMIT
    if not args.slime_source:
        parser.error(
            "--slime-source (or RL_LIFECYCLE_SLIME_SOURCE): a slime checkout, git dir or exported tree"
        )
    if args.cycles < 2:
        parser.error("--cycles must be at least 2 (the first cycle is reported apart)")
    if args.child:
        child_main(args.child, args.slime_source, commit, args.cycles, args.cpu_smoke, args.result)
        return
    results = {}
    for column in COLUMNS:
        started = time.perf_counter()
        results[column] = run_column(column, args.slime_source, commit, args.cycles, args.cpu_smoke)
        print(f"column {column}: {time.perf_counter() - started:.1f} s", flush=True)
    summary = report(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "columns": results}, indent=1))
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""`lifecycle demo`: a colocated RL loop on Ray, trainer and rollout on the same devices.

Each step: generate → rollout sleeps (pause generation, flush, release tags) → trainer wakes and
trains (and sleeps again: offload_train) → checkpoint every k steps, from PAUSED → trainer sleep
(a logged no-op) → rollout wakes its weights → weight sync through the transport → rollout wakes
its KV cache → the rollout's weights are checked equal to the trainer's. On a GPU host every
trainer rank has its own GPU (NCCL refuses two ranks on one GPU) and shares it with a rollout
engine, fractional GPUs each, real torch_memory_saver and CUDA IPC; on a CPU machine gloo, a no-op
memory backend and shared memory. Per-rank JSON-lines logs, a Perfetto trace, a PNG timeline and
the `lifecycle check` verdict land in the output directory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from actor_integration.ray_group import LifecycleGroup
from lifecycle.errors import GroupCallError

PROMPTS, PROMPT_LEN, VOCAB = 8, 8, 97


class _Progress:
    """A live display (rich) or plain lines; either way every phase is reported."""

    def __init__(self, console: Console, steps: int, plain: bool) -> None:
        self.console, self.plain = console, plain
        self._progress: Any = None
        if not plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("starting", total=steps)

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def phase(self, step: int, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)
        else:
            self.console.print(f"step {step}: {text}")

    def done(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def note(self, text: str) -> None:
        self.console.print(text)


def _start_ray(args: argparse.Namespace, console: Console) -> Any:
    import ray

    if args.address:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
        console.print(f"joined Ray cluster at {args.address}: {ray.cluster_resources()}")  # type: ignore[no-untyped-call]
    else:
        ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    return ray


def _device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "lifecycle demo: --device cuda asked for, but torch sees no GPU (see `lifecycle doctor`)"
        )
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def _phase(
    name: str,
    group: LifecycleGroup,
    call: Callable[[], Any],
    recover_to: str,
    log: _Progress,
    faults: list[dict[str, Any]],
    step: int,
) -> Any:
    """Run one phase; if ranks went FAILED, show it, recover them to `recover_to`, and retry once
    (unless the failure came after the body: then the work is done and the result is None)."""
    try:
        return call()
    except GroupCallError:
        states = group.states()
        failed = {r: s for r, s in states.items() if s["state"] == "FAILED"}
        if not failed:
            raise
        first = next(iter(failed.values()))["failure"]
        log.note(
            f"[bold red]step {step}: {name}: {first['hook']} raised on ranks {sorted(failed)} "
            f"({first['error']}) → FAILED[/]"
        )
        recovered = group.recover(recover_to)
        log.note(
            f"[yellow]step {step}: recover(target={recover_to}) on ranks {sorted(recovered)} → "
            f"{sorted({s['state'] for s in recovered.values()})}[/]"
        )
        # A failure after the body (leaving AWAKE/SAVING/SYNCING) needs no retry: the work was done.
        redo = first["phase"] != "exit"
        faults.append(
            {
                "step": step,
                "phase": name,
                "hook": first["hook"],
                "ranks": sorted(failed),
                "recovered_to": recover_to,
                "retried": redo,
            }
        )
        return call() if redo else None


def run_demo(args: argparse.Namespace) -> int:
    # Wide enough for the per-rank table even when the output is a pipe (CI logs, `| tee`).
    console = Console(width=max(Console().width, 150))
    out = Path(args.out).resolve()
    for sub in ("logs", "checkpoints", "transfer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    device = _device(args.device)
    ray = _start_ray(args, console)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actor_integration.demo.report import per_rank_rows, render_table
    from actor_integration.demo.rollout import DemoRollout
    from actor_integration.demo.trainer import DemoTrainer

    gpus = int(ray.cluster_resources().get("GPU", 0))
    trainers = args.trainers or (max(gpus, 1) if device == "cuda" else 2)
    if device == "cuda" and args.engines not in (None, trainers):
        raise SystemExit(
            f"lifecycle demo: on a GPU host every GPU has its own 1-GPU engine ({trainers}); --engines "
            f"{args.engines} is for CPU runs"
        )
    if device == "cuda" and trainers > gpus:
        raise SystemExit(
            f"lifecycle demo: {trainers} trainer ranks need {trainers} GPUs (one rank per GPU: NCCL refuses two "
            f"ranks on one GPU, 'Duplicate GPU detected'); this cluster has {gpus}"
        )
    model = {
        "vocab_size": VOCAB,
        "dim": args.hidden,
        "n_layers": args.layers,
        "n_heads": 4,
        "max_seq_len": 64,
        "seed": args.seed,
    }
    # GPU: one 1-GPU engine per trainer GPU, each sharing it (0.5 + 0.5). CPU: one engine over
    # `trainers` virtual devices, so the slot has several ranks and one coordinator.
    if device == "cuda":
        engine_gpu_counts = [1] * trainers
        pg = placement_group([{"GPU": 1, "CPU": 1}] * trainers, strategy="PACK")
        ray.get(pg.ready(), timeout=args.timeout_s)

        def place(i: int) -> dict[str, Any]:
            return {
                "num_gpus": 0.5,
                "num_cpus": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            }

        rollout_options = [place(i) for i in range(trainers)]
        rollout_devices = [["cuda:0"] for _ in range(trainers)]
    else:
        engines = args.engines or 1
        if trainers % engines:
            raise SystemExit(
                f"lifecycle demo: --engines {engines} must divide the {trainers} trainer ranks into equal slots"
            )
        engine_gpu_counts = [trainers // engines] * engines

        def place(i: int) -> dict[str, Any]:
            return {"num_cpus": 0}

        rollout_options = [place(i) for i in range(engines)]
        rollout_devices = [["cpu"] * count for count in engine_gpu_counts]
    console.print(
        f"[bold]lifecycle demo[/]: {trainers} trainer rank(s) on {device}, {len(engine_gpu_counts)} rollout "
        f"engine(s) of {engine_gpu_counts} device(s), {args.steps} steps, checkpoint every {args.save_every}, "
        f"transport {args.transport}, output {out}"
    )
    t_start = time.monotonic()
    rollout_cls = ray.remote(DemoRollout)
    trainer_cls = ray.remote(DemoTrainer)
    rollouts = [
        rollout_cls.options(**opts).remote(model=model, devices=devs, rank=i, out=str(out))
        for i, (opts, devs) in enumerate(zip(rollout_options, rollout_devices, strict=True))
    ]
    actors = [trainer_cls.options(**place(i)).remote() for i in range(trainers)]
    init_method = ray.get(actors[0].rendezvous.remote(), timeout=args.timeout_s)
    infos = ray.get(
        [
            a.init.remote(
                rank=i,
                world_size=trainers,
                init_method=init_method,
                device=device,
                model=model,
                engine_gpu_counts=engine_gpu_counts,
                rollouts=rollouts,
                transport=args.transport,
                bucket_mb=args.bucket_mb,
                out=str(out),
                timeout_s=args.timeout_s,
            )
            for i, a in enumerate(actors)
        ],
        timeout=args.timeout_s * 2,
    )
    transport = infos[0]["transport"]
    console.print(
        f"trainer memory: {infos[0]['memory']}; weight transport: [bold]{transport}[/]; "
        f"slot coordinators: {[i['rank'] for i in infos if i['coordinator']]}"
    )
    trainer_group = LifecycleGroup(actors, timeout_s=args.timeout_s)
    rollout_group = LifecycleGroup(rollouts, timeout_s=args.timeout_s)
    trainer_group.assert_consistent()

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    faults_by_step: dict[int, list[tuple[str, str]]] = {}
    for role, hook, step in args.inject_fault:
        faults_by_step.setdefault(step, []).append((role, hook))
    faults: list[dict[str, Any]] = []
    checksums: dict[tuple[str, int], list[bool]] = {}
    steps: list[dict[str, Any]] = []
    version = 0
    exit_code = 0

    with _Progress(console, args.steps, args.no_progress) as log:
        for step in range(1, args.steps + 1):
            record: dict[str, Any] = {"step": step}
            trainer_group.call("lifecycle_step", step)
            rollout_group.call("lifecycle_step", step)
            for role, hook in faults_by_step.get(step, []):
                (trainer_group if role == "trainer" else rollout_group).call("arm_fault", hook)
                log.note(f"[yellow]step {step}: armed a fault in {hook} on every {role} rank[/]")

            log.phase(step, "rollout generates")
            samples = rollout_group.call("generate", prompts)
            batch = [p + s for p, s in zip(prompts, samples[0], strict=True)]
            log.phase(step, "rollout sleeps (pause generation, flush, release weights + kv_cache)")
            _phase("rollout sleep", rollout_group, rollout_group.sleep, "PAUSED", log, faults, step)
            log.phase(step, "trainer wakes, trains, sleeps")
            # Data parallel: each rank trains on its share of the batch.
            shares = [batch[r::trainers] or batch for r in range(trainers)]
            results = _phase(
                "train",
                trainer_group,
                functools.partial(
                    trainer_group.call_each, "train", {r: (step, shares[r]) for r in range(trainers)}
                ),
                "PAUSED",
                log,
                faults,
                step,
            )
            record["loss"] = sum(r["loss"] for r in results.values()) / len(results) if results else None
            if step % args.save_every == 0:
                log.phase(step, "checkpoint from PAUSED (resume, save, re-pause)")
                saved = _phase(
                    "save",
                    trainer_group,
                    functools.partial(trainer_group.call, "save_model", step),
                    "PAUSED",
                    log,
                    faults,
                    step,
                )
                record["checkpoint_reload_ok"] = saved is None or all(s["reload_ok"] for s in saved.values())
                if not record["checkpoint_reload_ok"]:
                    exit_code = 1
            log.phase(step, "trainer sleeps (already asleep: a logged no-op)")
            _phase("trainer sleep", trainer_group, trainer_group.sleep, "PAUSED", log, faults, step)
            log.phase(step, "rollout wakes its weights")
            _phase(
                "rollout wake weights",
                rollout_group,
                lambda: rollout_group.wake_up(["weights"]),
                "PAUSED",
                log,
                faults,
                step,
            )

            def sync() -> dict[int, Any]:
                nonlocal version
                version += 1  # a failed version is never reused: the engine's gate refuses repeats
                return trainer_group.call("update_weights", version)

            log.phase(step, f"weight sync through {transport}")
            synced = _phase("sync", trainer_group, sync, "PAUSED", log, faults, step)
            record["version"] = version
            record["bytes"] = sum(s["bytes"] for s in synced.values()) if synced else None
            record["peak_rss_growth_mib"] = (
                {rank: s["peak_rss_growth_mib"] for rank, s in synced.items()} if synced else None
            )
            log.phase(step, "rollout wakes its kv cache")
            _phase(
                "rollout wake kv_cache",
                rollout_group,
                lambda: rollout_group.wake_up(["kv_cache"]),
                "AWAKE",
                log,
                faults,
                step,
            )
            trainer_sums = trainer_group.call("weights_checksum")
            engine_sums = rollout_group.call("weights_checksum")
            trainer_sum = trainer_sums[0]
            for role, sums in (("trainer", trainer_sums), ("rollout", engine_sums)):
                for rank, value in sums.items():
                    checksums.setdefault((role, rank), []).append(value == trainer_sum)
            record["checksum_ok"] = all(v == trainer_sum for v in engine_sums.values())
            if not record["checksum_ok"]:
                exit_code = 1
                log.note(f"[bold red]step {step}: rollout weights differ from the trainer's[/]")
            trainer_group.assert_consistent()
            rollout_group.assert_consistent()
            steps.append(record)
            log.done(step)

    ray.get([a.flush_logs.remote() for a in [*actors, *rollouts]], timeout=args.timeout_s)
    ray.get([a.close.remote() for a in actors], timeout=args.timeout_s)
    wall = time.monotonic() - t_start
    logs = sorted((out / "logs").glob("*.jsonl"))

    from lifecycle import checker, timeline

    findings = checker.check_files(logs)
    rows = per_rank_rows(logs, checksums)
    render_table(rows, console)
    timeline.write_trace(logs, out / "timeline.json")
    picture = timeline.render_png(logs, out / "timeline.png")
    losses = [s["loss"] for s in steps if s["loss"] is not None]
    growth = [g for s in steps for g in (s.get("peak_rss_growth_mib") or {}).values() if g is not None]
    if growth:
        console.print(
            f"peak host RSS growth during a sync, any trainer rank: {max(growth):.1f} MiB "
            f"(bucket {args.bucket_mb} MiB; weights {steps[-1]['bytes'] / trainers / 2**20:.1f} MiB per rank)"
        )
    console.print(
        f"steps {len(steps)}, loss {losses[0]:.3f} → {losses[-1]:.3f}, "
        f"checkpoints {sum(1 for s in steps if 'checkpoint_reload_ok' in s)}, "
        f"faults recovered {len(faults)}, wall {wall:.1f} s"
    )
    if findings:
        exit_code = 1
        console.print(f"[bold red]lifecycle check: {len(findings)} finding(s)[/]")
        for finding in findings[:20]:
            console.print(f"  {finding}")
    else:
        console.print(f"lifecycle check: [green]clean[/] ({len(logs)} logs)")
    console.print(f"logs: {out / 'logs'}  timeline: {out / 'timeline.json'}, {picture.path}")
    expected_faults = len(args.inject_fault)
    if len(faults) != expected_faults:
        exit_code = 1
        console.print(
            f"[bold red]{expected_faults} fault(s) injected but {len(faults)} seen and recovered[/]"
        )
    summary = {
        "device": device,
        "trainers": trainers,
        "engine_gpu_counts": engine_gpu_counts,
        "transport": transport,
        "steps": steps,
        "faults": faults,
        "ranks": rows,
        "findings": [str(f) for f in findings],
        "wall_s": round(wall, 2),
        "ok": exit_code == 0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with contextlib.suppress(Exception):
        ray.shutdown()
    console.print("[bold green]demo OK[/]" if exit_code == 0 else "[bold red]demo FAILED[/]")
    return exit_code

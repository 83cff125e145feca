"""`run_demo`: place the actors, run the steps, report (`placement`, `step`, `report`, in that order).

A node lost mid-run ends the steps with its `NodeLostError` (the survivors were told and report
their state); the survivors then flush and close (no teardown waits on a lost peer), the logs of
every live node are gathered into `--out/logs`, and the report names the ranks that were lost.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from actor_integration.errors import NodeLostError
from actor_integration.tools.demo.options import ENGINE_NAMES
from actor_integration.tools.demo.placement import place, resolve_device, start_ray
from actor_integration.tools.demo.progress import Progress
from actor_integration.tools.demo.report import finish
from actor_integration.tools.demo.step import StepDriver


def run_demo(args: argparse.Namespace) -> int:
    """Run `lifecycle demo` with parsed options (`actor_integration.tools.demo.options`); the exit code."""
    # Wide enough for the per-rank table even when the output is a pipe (CI logs, `| tee`).
    console = Console(width=max(Console().width, 184))  # the per-rank table on one line a row
    out = Path(args.out).resolve()
    device = resolve_device(
        args.device, args.transport, getattr(args, "engine", "reference")
    )  # refuses before anything is written
    for sub in ("logs", "checkpoints", "transfer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ray = start_ray(args, console)
    try:
        started = time.monotonic()
        placed = place(ray, args, device, out, console)
        with Progress(console, args.steps, args.no_progress) as log:
            driver = StepDriver(placed, args, log)
            step = 0
            try:
                driver.prepare()
                for step in range(1, args.steps + 1):
                    driver.run(step)
                    if driver.killed is not None:
                        break  # --kill-engine: the typed error was the point; nothing runs after it
            except NodeLostError as exc:
                driver.lost_node(step, exc)
        trainers = [a for r, a in enumerate(placed.trainer_actors) if r not in placed.trainer_group.dead]
        rollouts = [a for r, a in enumerate(placed.rollout_actors) if r not in placed.rollout_group.dead]
        _settle(ray, [a.flush_logs.remote() for a in [*trainers, *rollouts]], args.timeout_s, console)
        closing = trainers + (rollouts if placed.engine in ENGINE_NAMES else [])
        _settle(
            ray, [a.close.remote() for a in closing], args.timeout_s, console
        )  # the engines' processes too
        if len(placed.nodes) > 1:  # each rank wrote on its own node: one directory for the report
            from actor_integration.actors.cluster import gather_logs

            gathered = gather_logs(out / "logs", directory=str(out / "logs"), timeout_s=args.timeout_s)
            console.print(f"logs gathered through Ray: {gathered}")
        exit_code = finish(out, console, args, placed, driver, time.monotonic() - started)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
    console.print("[bold green]demo OK[/]" if exit_code == 0 else "[bold red]demo FAILED[/]")
    return exit_code


def _settle(ray: Any, refs: list[Any], timeout_s: float, console: Console) -> None:
    """Wait for `refs` within the deadline; after a lost node, a failure here is said, not raised."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    failed = 0
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            failed += 1
    if failed or len(ready) != len(refs):
        console.print(
            f"[yellow]{failed} call(s) failed, {len(refs) - len(ready)} did not answer in {timeout_s:.0f} s[/]"
        )

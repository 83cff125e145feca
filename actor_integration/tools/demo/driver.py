"""`run_demo`: place the actors, run the steps, report (`placement`, `step`, `report`, in that order)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path

from rich.console import Console

from actor_integration.tools.demo.placement import place, resolve_device, start_ray
from actor_integration.tools.demo.progress import Progress
from actor_integration.tools.demo.report import finish
from actor_integration.tools.demo.step import StepDriver


def run_demo(args: argparse.Namespace) -> int:
    """Run `lifecycle demo` with parsed options (`actor_integration.tools.demo.options`); the exit code."""
    # Wide enough for the per-rank table even when the output is a pipe (CI logs, `| tee`).
    console = Console(width=max(Console().width, 170))
    out = Path(args.out).resolve()
    device = resolve_device(args.device, args.transport)  # refuses before anything is written
    for sub in ("logs", "checkpoints", "transfer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ray = start_ray(args, console)
    try:
        started = time.monotonic()
        placed = place(ray, args, device, out, console)
        with Progress(console, args.steps, args.no_progress) as log:
            driver = StepDriver(placed, args, log)
            driver.prepare()
            for step in range(1, args.steps + 1):
                driver.run(step)
                if driver.killed is not None:
                    break  # --kill-engine: the typed error was the point; nothing runs after it
        actors = [*placed.trainer_actors, *placed.rollout_actors]
        ray.get([a.flush_logs.remote() for a in actors], timeout=args.timeout_s)
        closing = placed.trainer_actors + (placed.rollout_actors if placed.engine == "sglang" else [])
        ray.get([a.close.remote() for a in closing], timeout=args.timeout_s)  # SGLang's processes too
        exit_code = finish(out, console, args, placed, driver, time.monotonic() - started)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
    console.print("[bold green]demo OK[/]" if exit_code == 0 else "[bold red]demo FAILED[/]")
    return exit_code

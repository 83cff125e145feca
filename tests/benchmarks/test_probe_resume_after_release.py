"""probe_resume_after_release.py: its summary and verdict on given timings, and a clear refusal without a GPU.

The probe itself needs a GPU and torch_memory_saver; on the H200 it runs from scripts/gpu_sglang.sh
(`probe`), and docs/measurements.md (Memory budget) has what it printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "probe_resume_after_release.py"
NBYTES = 2 << 30


def _probe() -> Any:
    return load_benchmark("probe_resume_after_release")


def trials(times: dict[str, dict[tuple[float, float], float]]) -> list[dict[str, Any]]:
    """{kind: {(released GiB, wait s): seconds}} -> the probe's trial rows, each twice (median of equal values)."""
    rows = []
    for kind, cells in times.items():
        for (released, wait), seconds in cells.items():
            rows += [{"kind": kind, "released_gib": released, "wait_s": wait, "seconds": seconds}] * 2
    return rows


def test_a_copy_engine_slowdown_that_fades_with_the_wait_reads_as_the_scrub() -> None:
    probe = _probe()
    fast = {(0, 0): 0.04, (119, 0): 0.041, (119, 0.4): 0.04}
    summary = probe.summarize(
        trials(
            {
                "resume": {(0, 0): 0.05, (119, 0): 0.15, (119, 0.15): 0.09, (119, 0.4): 0.055},
                "map": {(0, 0): 0.002, (119, 0): 0.002, (119, 0.4): 0.002},
                "h2d": {(0, 0): 0.04, (119, 0): 0.13, (119, 0.15): 0.07, (119, 0.4): 0.041},
                "h2d_sm": fast,
                "d2d": {(0, 0): 0.002, (119, 0): 0.0021, (119, 0.4): 0.002},
            }
        ),
        NBYTES,
    )
    resume = summary["resume"]
    assert resume["baseline_s"] == 0.05 and resume["released"]["119"]["waits"]["0"]["x_baseline"] == 3.0
    assert resume["released"]["119"]["recovered_after_s"] == 0.4
    assert summary["h2d_sm"]["released"]["119"]["recovered_after_s"] == 0
    text = probe.verdict(summary)
    assert text.startswith("slowed right after the release: resume, h2d; not: map, h2d_sm, d2d;")
    assert "scrubbing the freed memory with the copy engines" in text


def test_other_patterns_name_other_causes() -> None:
    probe = _probe()
    slow_map = {(0, 0): 0.002, (119, 0): 0.02}
    summary = probe.summarize(trials({"map": slow_map, "h2d": {(0, 0): 0.04, (119, 0): 0.12}}), NBYTES)
    assert "the allocation itself" in probe.verdict(summary)
    calm = probe.summarize(trials({"h2d": {(0, 0): 0.04, (119, 0): 0.041}}), NBYTES)
    assert probe.verdict(calm).startswith("nothing was slowed")


def test_without_a_gpu_it_says_what_it_needs() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    import torch

    if torch.cuda.is_available():
        return  # a GPU host runs the real probe instead: not here
    assert proc.returncode == 2 and "needs a CUDA GPU, torch and torch_memory_saver" in proc.stderr


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--release-gib", "lots"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "expected comma-separated numbers, got 'lots'" in proc.stderr

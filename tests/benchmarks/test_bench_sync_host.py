"""bench_sync_host.py runs through on CPU (its figures are host time only; they are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_sync_host.py"


def test_it_times_both_paths_and_the_ray_driver_variant() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--layout", "dense", "--gib", "0.25", "--updates", "3", "--ray-driver"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ": default, sender host pack" in out and ": arena, sender host pack" in out, out
    line = next(line for line in out.splitlines() if "in a Ray driver" in line)
    assert "ms plain" in line and "while an actor logged" in line, line
    logged = int(line.split("while an actor logged ")[1].split()[0])
    assert logged > 0, line

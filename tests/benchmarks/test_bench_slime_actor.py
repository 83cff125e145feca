"""bench_slime_actor.py runs end to end on CPU (gloo, a tiny state, the fake TMS) over slime's source.

The figures mean nothing on CPU; what is checked is that both columns ran slime's own actor through
init and every cycle, that the slime column's parts are slime's own functions and the wrapped
column's are the plans' hooks, and that the state survived every wake. Needs slime's source, which
CI cannot fetch (skipped there, as test_slime_source.py is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_slime_actor.py"
SOURCE = os.environ.get("RL_LIFECYCLE_SLIME_SOURCE")

pytestmark = pytest.mark.skipif(
    SOURCE is None, reason="slime's source is not available (RL_LIFECYCLE_SLIME_SOURCE)"
)


def test_cpu_smoke_runs_slimes_actor_plain_and_wrapped(tmp_path: Path) -> None:
    out = tmp_path / "slime_actor.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(SCRIPT), "--slime-source", str(SOURCE), "--cpu-smoke", "--cycles", "3"]
    proc = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "faster than slime's own (target >= 10x" in proc.stdout
    columns = json.loads(out.read_text())["columns"]
    for name in ("slime", "wrapped"):
        cycles = columns[name]["cycles"]
        assert len(cycles) == 3 and all(c["intact"] for c in cycles)
        assert {"process_groups.destroy", "memory.pause", "clear_memory"} <= set(cycles[-1]["sleep_parts"])
        assert {"process_groups.reload", "memory.resume", "switch_model"} <= set(cycles[-1]["wake_parts"])
    assert any("the adapter's default" in note for note in columns["wrapped"]["notes"])

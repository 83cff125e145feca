"""probe_nccl_suspend.py: its reading of NCCL's suspend log, and a clear refusal without a GPU.

The probe itself needs a GPU and NCCL 2.29.7+; on the H200 the lead runs it (README, Phase switch).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "probe_nccl_suspend.py"


def _probe() -> Any:
    return load_benchmark("probe_nccl_suspend")


def test_nccls_suspend_lines_are_summed_into_released_and_backed_up_bytes() -> None:
    """The INFO line NCCL 2.30.7 writes at the end of each suspend (src/mem_manager.cc), twice."""
    line = (
        "host:1:2 [0] NCCL INFO MemManager: rank 0 suspended 12 local + 0 peer entries "
        "(scratch=0, offload=408944640, peerImport=0, cpuBackup=408944640)\n"
    )
    totals = _probe().parse_suspend_lines("NCCL INFO something else\n" + line * 2)  # type: ignore[attr-defined]
    assert totals == {
        "suspends": 2,
        "entries": 24,
        "scratch_bytes": 0,
        "offload_bytes": 2 * 408944640,
        "peer_import_bytes": 0,
    }


def test_without_a_gpu_it_says_what_it_needs() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    import torch

    if torch.cuda.is_available():
        return  # a GPU host runs the real probe instead (minutes): not here
    assert proc.returncode == 2 and "needs a CUDA GPU and NCCL 2.29.7+ (--nccl-lib)" in proc.stderr

"""probe_sender_pack.py: a clear refusal without a GPU and of bad arguments (the probe itself runs on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "probe_sender_pack.py"


def test_without_a_gpu_it_says_what_it_needs() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU host runs the real probe instead: not here
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_a_missing_model_config_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-config", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"no config.json in {tmp_path}" in proc.stderr

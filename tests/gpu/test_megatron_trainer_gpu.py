"""A real megatron-core GPTModel in a mixin-wrapped trainer on real torch_memory_saver (one GPU).

The #1886 sequence (train auto-sleeps, then save_model) succeeds through the mixin and the
checkpoint reloads to identical weights; the same sequence with raw TMS calls in slime's
pre-#1888 order fails on paused memory.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = Path(__file__).with_name("megatron_trainer.py")


def _run(mode: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(workdir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _record(name: str, data: dict) -> None:
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(data, indent=2))


def test_mixin_train_then_save_from_paused(tmp_path: Path) -> None:
    proc = _run("mixin", tmp_path)
    print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    _record("megatron_trainer_mixin.json", result)
    assert result["state_after_train"] == "PAUSED" and result["state_after_save"] == "PAUSED"
    assert result["reload"]["tensors"] > 0 and result["reload"]["mismatched"] == []
    assert result["live_equals_saved"]
    # Asleep, the ~1 GiB region is released; awake, it is back.
    assert result["free_gib_asleep_after_init"] - result["free_gib_awake"] > 0.9
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert result["losses"][-1] < result["losses"][0]


def test_raw_pre1888_order_fails_on_paused_memory(tmp_path: Path) -> None:
    proc = _run("raw_pre1888", tmp_path)
    output = proc.stdout + proc.stderr
    print(output[-4000:], flush=True)
    _record("megatron_trainer_raw_pre1888.json", {"returncode": proc.returncode, "tail": output[-2000:]})
    assert "saving on paused memory" in proc.stdout
    assert proc.returncode != 0
    assert not (tmp_path / "result.json").exists()
    assert "CUDA" in output or "cuda" in output

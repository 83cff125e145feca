"""slime's trainer environment on one GPU: preload TMS with TMS_INIT_ENABLE=1, after `import megatron.core`.

Run: python -m pytest -m gpu tests/gpu/test_slime_env_gpu.py -x -q -s

megatron-core sets `torch_memory_saver.hook_mode = "torch"` when `megatron.core` is imported. In a
process that LD_PRELOADs torch_memory_saver (slime's RayTrainGroup does for offloaded trainers)
every allocation belongs to the preload library, which a torch-mode TMS never sees. These cases
measure what `pause()` releases there, raw and through `slime_memory_backend()`, and that the
backend's nested `disable()` (slime's update_weights inside the sync plan's) does not assert.
Each runs in its own process: LD_PRELOAD must be set at process start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_memory_saver")
pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, torch
import megatron.core  # sets torch_memory_saver.hook_mode = "torch" (inference/contexts/dynamic_context.py)
from torch_memory_saver import torch_memory_saver

def free_gib():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30

out = {"configured": torch_memory_saver._impl_ctor_kwargs.get("hook_mode")}
if MODE == "adapter":
    from actor_integration.frameworks.slime import slime_memory_backend
    memory = slime_memory_backend()
    out["hook_mode"], out["notes"] = memory.hook_mode, memory.notes
else:
    memory = torch_memory_saver
x = torch.full((256 << 20,), 7.0, device="cuda")  # 1 GiB, outside any region: TMS_INIT_ENABLE makes it saver memory
before = free_gib()
memory.pause()
out["released_gib"] = free_gib() - before
memory.resume()
out["intact"] = bool((x == 7.0).all().item())
if MODE == "adapter":
    with memory.disable(), memory.disable():  # the sync plan's, then slime's own
        y = torch.ones(1 << 20, device="cuda")
        out["nested_disable_ok"] = True
print("RESULT " + json.dumps(out))
"""


def run(mode: str) -> dict[str, Any]:
    from actor_integration.backends.tms_env import preload_library

    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k != "LD_PRELOAD"}
    env.update(
        LD_PRELOAD=preload_library(),
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
        PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
    )
    code = f"MODE = {mode!r}\n" + textwrap.dedent(SCRIPT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"\n{mode}: {result}")
    return result


def test_raw_tms_after_megatron_import() -> None:
    """The figure for the report: what a torch-mode TMS releases of a preloaded process's 1 GiB."""
    result = run("raw")
    assert result["configured"] == "torch"
    assert result["intact"]


def test_slime_memory_backend_releases_the_memory() -> None:
    result = run("adapter")
    assert result["configured"] == "torch" and result["hook_mode"] == "preload"
    assert any("megatron-core does this" in note for note in result["notes"])
    assert result["released_gib"] >= 0.9 and result["intact"]
    assert result["nested_disable_ok"]

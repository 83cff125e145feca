"""No leak across 20 sleep/wake cycles of a real megatron-core trainer (one GPU, NCCL, torch_memory_saver).

Megatron-LM #6897/#7029: `destroy_model_parallel` leaks ~20 groups per cycle until NVLS memory
runs out. Through MegatronParallelState every communicator registered in torch goes down on each
sleep (at once, WORLD last) and comes back on each wake: the registered groups, the GPU memory
awake and asleep, fds and threads stay flat. Figures (every hook's time per cycle) are printed
and written to LIFECYCLE_GPU_OUT.
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
pytest.importorskip("torch_memory_saver")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = Path(__file__).with_name("megatron_cycles.py")
CYCLES = 20
# mem_get_info moves in 2 MiB pages; a communicator left behind per cycle holds hundreds of MiB.
FLAT_MIB = 32
FLAT_COUNT = 4  # fds and threads: one-off noise only; a per-cycle leak shows as 19


def test_twenty_cycles_keep_groups_memory_fds_and_threads_flat(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(CYCLES)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    print(proc.stdout[-6000:], proc.stderr[-3000:], flush=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "megatron_cycles.json").write_text(json.dumps(result, indent=2))
    cycles = result["cycles"]
    assert len(cycles) == CYCLES and all(math.isfinite(c["loss"]) for c in cycles)
    steady = cycles[1:]  # the first wake after configuration is the warm-up
    for where in ("awake", "asleep"):
        first = steady[0][where]
        for key, tolerance in (("used_mib", FLAT_MIB), ("fds", FLAT_COUNT), ("threads", FLAT_COUNT)):
            peak = max(c[where][key] for c in steady)
            assert peak - first[key] <= tolerance, f"{where} {key}: {first[key]} -> {peak}"
        assert {c[where]["groups"] for c in cycles} == {first["groups"]}, (
            f"{where}: registered groups changed"
        )
    # Asleep, only the gloo stand-in WORLD is registered and the communicators' memory is gone.
    assert steady[0]["asleep"]["groups"] == 1
    assert steady[0]["awake"]["groups"] > 10  # Megatron's groups, WORLD, the side channel
    freed = steady[0]["awake"]["used_mib"] - steady[0]["asleep"]["used_mib"]
    assert freed > 1024, f"sleep released only {freed} MiB"
    assert result["teardown"]["way"] == "destroy"  # the default: suspend and keep are opt-in

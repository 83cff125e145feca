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


STUBBED_RUN = """
import sys
import torch
sys.path.insert(0, {repo!r})
sys.path.insert(0, {repo!r} + "/benchmarks")
import bench_sync_host, probe_sender_pack
from actor_integration.models import qwen2
from actor_integration.weight_sync import cuda_ipc

bench_sync_host.stub_device_calls()
cuda_ipc.CudaIpcSender = lambda device=None: bench_sync_host.HostIpcSender()
cuda_ipc.IpcBuffer.release_grant = lambda self: None
real_lm = qwen2.QwenLM
qwen2.QwenLM = lambda config, seed, device: real_lm(config, seed=seed, device="cpu")
torch.cuda.set_device = lambda device: None
torch.cuda.synchronize = lambda *a: None
torch.cuda.get_device_name = lambda *a: "stubbed"
torch.cuda.is_available = lambda: True
sys.exit(probe_sender_pack.main(["--model-config", {config!r}, "--bucket-mib", "1", "--syncs", "3", "--top", "5",
                                 "--out", {out!r}]))
"""


def test_the_probe_runs_through_on_a_stubbed_transport(tmp_path: Path) -> None:
    """The probe's whole run on CPU: its transport's device calls stubbed (bench_sync_host's
    `HostIpcSender`), so a slip in the probe shows here and not in a GPU call."""
    import json

    out = tmp_path / "probe.json"
    code = STUBBED_RUN.format(repo=str(REPO), config=str(REPO / "configs" / "qwen2-tiny"), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "waiting for a CPU" in proc.stdout and "plans built" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    for label in ("same", "alternate", "busy", "rebuild"):
        row = report[label]
        assert len(row["host_ms"]) == len(row["host_cpu_ms"]) == 3, row
        sched = row["scheduling"]
        assert sched["blocks"] == 1 and sched["wall_ms"] >= sum(row["host_ms"]) * 0.9, sched
        assert set(sched) >= {"caller_cpu_ms", "caller_run_queue_ms", "caller_blocked_ms", "processes"}
    # 6 x 3 syncs (four variants, then two profiled), every bucket exported through its own storage;
    # two sets alternating: one plan per set and bucket position, not one per sync; the rebuild
    # variant and its profile (copies at other addresses, in turn): one per sync and position
    positions, rest = divmod(report["exports_through_own_storage"], 18)
    assert positions > 1 and rest == 0, report
    built = {label: report[label]["plans_built"] for label in ("same", "alternate", "busy", "rebuild")}
    assert built == {"same": positions, "alternate": positions, "busy": 0, "rebuild": 3 * positions}, built
    assert "ncalls" in report["profile"] and "ncalls" in report["rebuild_profile"]

"""The adapter over the real torch_memory_saver on one GPU: memory really released and restored.

Run: python -m pytest -m gpu tests/gpu/test_memory_saver_gpu.py -x -q -s
Figures are printed and, when LIFECYCLE_GPU_OUT is set, written to memory_saver_gpu.json there.
The in-process test uses hook_mode "torch"; preload cases run in subprocesses (LD_PRELOAD must be
set at process start), as do the raw-TMS reproductions that end the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_memory_saver")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
RESULTS: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def write_results() -> Iterator[None]:
    yield
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / "memory_saver_gpu.json"
        path.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **RESULTS}, indent=2
            )
        )
        print(f"wrote {path}", flush=True)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k != "LD_PRELOAD"}
    full_env.update(env)
    full_env["PYTHONPATH"] = f"{REPO}:{full_env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def test_sleep_releases_wake_restores_contents_bit_exact() -> None:
    from actor_integration.backends.clear_memory import ClearMemory
    from actor_integration.backends.memory_saver import MemoryStateError, TorchMemorySaverBackend
    from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State

    backend = TorchMemorySaverBackend(tags=("model",), cpu_backup=True, hook_mode="torch")
    print(backend.describe(), flush=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with backend.region("model"):
        model = torch.randint(
            -(2**31), 2**31 - 1, (GIB // 4,), dtype=torch.int32, device="cuda", generator=generator
        )
    reference = model.clone()  # plain memory, outside any region
    lifecycle = Lifecycle(
        LifecyclePolicy(memory_tags=("model",), model_tag=None),
        Hooks(memory=backend, clear_memory=ClearMemory()),
    )

    before = free_bytes()
    t0 = time.perf_counter()
    lifecycle.sleep()
    sleep_s = time.perf_counter() - t0
    asleep = free_bytes()
    released = (asleep - before) / GIB

    # While paused, a trainer's weight sync reads the CPU backup.
    backup = backend.cpu_backup(model, tag="model")
    assert backup is not None and torch.equal(backup, reference.cpu())

    lifecycle.sleep()  # TMS would exit(1) here; the machine logs a no-op
    with pytest.raises(MemoryStateError, match="already paused"):
        backend.pause("model")  # and the adapter refuses a direct second pause
    assert lifecycle.state is State.PAUSED

    t0 = time.perf_counter()
    lifecycle.wake_up()
    wake_s = time.perf_counter() - t0
    awake = free_bytes()
    restored = (asleep - awake) / GIB
    lifecycle.wake_up()

    intact = bool(torch.equal(model, reference))
    RESULTS["sleep_wake_1gib"] = {
        "released_gib": round(released, 3),
        "restored_gib": round(restored, 3),
        "sleep_s": round(sleep_s, 4),
        "wake_s": round(wake_s, 4),
        "contents_intact": intact,
    }
    print(f"sleep_wake_1gib: {RESULTS['sleep_wake_1gib']}", flush=True)
    assert released >= 0.95, f"sleep released only {released:.3f} GiB of the 1 GiB region"
    assert restored >= 0.95, f"wake restored only {restored:.3f} GiB"
    assert intact
    assert backend.cpu_backup(model, tag="model") is None  # retain_cpu_backup=False: released on resume


def test_device_restore_brings_a_tag_back_by_the_sms_bit_exact() -> None:
    """`device_restore=["dr_params"]`: the tag's live blocks (listed from torch_memory_saver's region
    pool, a freed block among them left out) copied to this process's pinned buffer before the
    pause and back by the copy kernel after the resume, over the real library; beside the same
    bytes under torch_memory_saver's own CPU backup (timed, not compared: docs/memory-budget.md)."""
    from actor_integration.backends.device_restore import live_extents
    from actor_integration.backends.memory_saver import TorchMemorySaverBackend

    backend = TorchMemorySaverBackend(
        tags=("dr_params", "dr_tms"), cpu_backup=["dr_tms"], device_restore=["dr_params"], hook_mode="torch"
    )
    print(backend.describe(), flush=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    sizes = [(256 << 20) // 4, (3 << 20) // 4 + 1, 1000, (512 << 20) // 4, 77]  # int32 elements

    def allocate(tag: str) -> list[Any]:
        with backend.region(tag):
            made = [
                torch.randint(
                    -(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=generator
                )
                for n in sizes
            ]
            dropped = torch.ones(1 << 20, dtype=torch.int32, device="cuda")
        del dropped  # a freed block of the pool: not copied
        return made

    ours, theirs = allocate("dr_params"), allocate("dr_tms")
    reference = [t.clone() for t in [*ours, *theirs]]  # plain memory, outside any region
    live = sum(size for _, size in live_extents(backend._segments("dr_params")))
    figures: dict[str, Any] = {"live_bytes": live, "tensor_bytes": sum(t.numel() * 4 for t in ours)}
    for cycle in range(3):
        for tag in ("dr_params", "dr_tms"):
            before = free_bytes()
            t0 = time.perf_counter()
            backend.pause(tag)
            pause_s = time.perf_counter() - t0
            released = free_bytes() - before
            t0 = time.perf_counter()
            backend.resume(tag)
            resume_s = time.perf_counter() - t0
            figures[f"{tag}_cycle{cycle}"] = {
                "released_gib": round(released / GIB, 3),
                "pause_s": round(pause_s, 4),
                "resume_s": round(resume_s, 4),
            }
    intact = all(torch.equal(t, r) for t, r in zip([*ours, *theirs], reference, strict=True))
    assert backend._restore is not None
    figures.update(
        contents_intact=intact,
        copies=backend._restore.copies,
        host_bytes=backend._restore.held_bytes("dr_params"),
    )
    RESULTS["device_restore"] = figures
    print(f"device_restore: {figures}", flush=True)
    assert intact and figures["copies"] == 6
    assert figures["tensor_bytes"] <= live < figures["tensor_bytes"] + (4 << 20) * len(sizes)
    assert figures["dr_params_cycle2"]["released_gib"] >= 0.95 * live / GIB


def test_raw_tms_second_pause_exits_the_process() -> None:
    result = run_python(
        """
        import torch
        from torch_memory_saver import torch_memory_saver
        torch_memory_saver.hook_mode = "torch"
        with torch_memory_saver.region("x"):
            x = torch.ones(1 << 20, device="cuda")
        torch_memory_saver.pause("x")
        print("first pause returned", flush=True)
        torch_memory_saver.pause("x")
        print("second pause returned", flush=True)
        """
    )
    RESULTS["raw_double_pause"] = {"returncode": result.returncode, "stderr_tail": result.stderr[-400:]}
    print(f"raw_double_pause: rc={result.returncode} stderr={result.stderr[-300:]!r}", flush=True)
    assert result.returncode == 1
    assert "Cannot pause allocation that is not active" in result.stderr
    assert "first pause returned" in result.stdout and "second pause returned" not in result.stdout


def test_preload_disable_makes_allocations_shareable_over_cuda_ipc() -> None:
    """slime #2188: under preload + TMS_INIT_ENABLE=1, only memory allocated inside disable() can be exported."""
    from actor_integration.backends.tms_env import preload_library

    result = run_python(
        """
        import torch
        from actor_integration.backends.memory_saver import TorchMemorySaverBackend
        from lifecycle import Hooks, Lifecycle, LifecyclePolicy

        backend = TorchMemorySaverBackend(tags=None, hook_mode="preload")
        print("backend:", backend.describe(), flush=True)
        outside = torch.ones(1 << 20, device="cuda")
        try:
            outside.untyped_storage()._share_cuda_()
            print("outside: shared", flush=True)
        except RuntimeError as exc:
            print("outside: error:", str(exc).splitlines()[0], flush=True)
        with backend.disable():
            inside = torch.ones(1 << 20, device="cuda")
            inside.untyped_storage()._share_cuda_()
            print("inside: shared", flush=True)

        def sync_body():
            received = torch.ones(1 << 20, device="cuda")
            received.untyped_storage()._share_cuda_()
            return "shared"

        lifecycle = Lifecycle(LifecyclePolicy(model_tag=None), Hooks(memory=backend))
        lifecycle.sleep()
        print("sync from PAUSED:", lifecycle.run("sync", sync_body), flush=True)
        lifecycle.wake_up()
        """,
        LD_PRELOAD=preload_library(),
        TMS_INIT_ENABLE="1",
    )
    RESULTS["preload_disable_ipc"] = {"returncode": result.returncode, "stdout": result.stdout[-800:]}
    print(result.stdout, result.stderr[-2000:], sep="\n", flush=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outside: error:" in result.stdout and "invalid argument" in result.stdout
    assert "inside: shared" in result.stdout
    assert "sync from PAUSED: shared" in result.stdout


def test_preload_adapter_refuses_where_raw_tms_exits() -> None:
    from actor_integration.backends.tms_env import preload_library

    result = run_python(
        """
        import torch
        from actor_integration.backends.memory_saver import MemoryStateError, TorchMemorySaverBackend
        from torch_memory_saver import torch_memory_saver

        backend = TorchMemorySaverBackend(tags=("weights",), hook_mode="preload")
        with backend.region("weights"):
            weights = torch.ones(1 << 20, device="cuda")
        backend.pause("weights")
        try:
            backend.pause("weights")
        except MemoryStateError:
            print("adapter refused", flush=True)
        backend.resume("weights")
        print("alive", flush=True)
        torch_memory_saver.resume("weights")
        print("raw resume of a resident tag returned", flush=True)
        """,
        LD_PRELOAD=preload_library(),
    )
    RESULTS["preload_refusal"] = {"returncode": result.returncode, "stdout": result.stdout[-400:]}
    print(result.stdout, result.stderr[-1000:], sep="\n", flush=True)
    assert "adapter refused" in result.stdout and "alive" in result.stdout
    assert result.returncode == 1
    assert "Cannot resume allocation that is not paused" in result.stderr
    assert "raw resume of a resident tag returned" not in result.stdout

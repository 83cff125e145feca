"""NCCL process groups across sleep/wake on a real GPU: communicator memory freed, Megatron still trains.

Run: python -m pytest -m gpu tests/gpu/test_process_groups_gpu.py -x -q -s
Figures are printed and, when LIFECYCLE_GPU_OUT is set, written there as JSON.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import Store

import lifecycle
from actor_integration.backends.process_groups import ReloadableProcessGroups
from lifecycle import Groups, Hooks, Lifecycle, LifecyclePolicy
from lifecycle.testing import FakeMemorySaver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch build with NCCL"),
]

CYCLES = 20
MIB = 1 << 20
# mem_get_info moves in 2 MiB pages and the CUDA context grows once (cuBLAS, NCCL setup) in the
# first cycle, which is left out; a communicator leaked every cycle would add up far past this.
FLAT_TOLERANCE = 16 * MIB
# One-off noise only (a socket closed a cycle late); a per-cycle leak would show as 19.
FD_THREAD_TOLERANCE = 4


def _used(device: int = 0) -> int:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _os_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line in /proc/self/status")


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"\n[{name}] {json.dumps(figures)}", flush=True)
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=1))


def _cycle_figures(rank: int, world_size: int, store: Store, bind_device: bool = False) -> dict[str, Any]:
    """20 NCCL destroy/reload cycles on cuda:rank; memory and timing per cycle."""
    torch.cuda.set_device(rank)
    before_init = _used(rank)
    groups = ReloadableProcessGroups.init(
        backend="nccl",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank) if bind_device else None,
    )
    sub = groups.new_group(list(range(world_size)), name="all")
    x = torch.empty(1 << 20, device="cuda")
    figures: dict[str, Any] = {"alive": [], "destroyed": [], "reserved": [], "sums": [], "destroy_ms": []}
    figures.update(reload_ms=[], fds=[], threads=[])
    for _ in range(CYCLES):
        sums = []
        for group in (None, sub.group):
            x.fill_(rank + 1)
            dist.all_reduce(x, group=group)
            sums.append(float(x[0].item()))
        figures["sums"].append(sums)
        figures["alive"].append(_used(rank))
        figures["reserved"].append(int(torch.cuda.memory_reserved(rank)))
        figures["fds"].append(len(os.listdir("/proc/self/fd")))
        figures["threads"].append(_os_threads())
        t0 = time.perf_counter()
        groups.destroy()
        figures["destroy_ms"].append((time.perf_counter() - t0) * 1e3)
        figures["destroyed"].append(_used(rank))
        t0 = time.perf_counter()
        groups.reload()
        figures["reload_ms"].append((time.perf_counter() - t0) * 1e3)
    groups.close()
    figures["after_close"] = _used(rank)
    figures["before_init"] = before_init
    return figures


def _check_cycles(figures: dict[str, Any], world_size: int) -> dict[str, Any]:
    expected = float(sum(range(1, world_size + 1)))
    assert figures["sums"] == [[expected, expected]] * CYCLES
    alive, destroyed = figures["alive"], figures["destroyed"]
    freed = [a - d for a, d in zip(alive, destroyed, strict=True)]
    summary = {
        "world_size": world_size,
        "freed_per_destroy_mib": [round(f / MIB, 1) for f in freed],
        "mean_freed_mib": round(statistics.mean(freed) / MIB, 1),
        "alive_used_mib_first_last": [round(alive[1] / MIB, 1), round(alive[-1] / MIB, 1)],
        "destroyed_used_mib_first_last": [round(destroyed[1] / MIB, 1), round(destroyed[-1] / MIB, 1)],
        "reserved_mib_first_last": [figures["reserved"][1] / MIB, figures["reserved"][-1] / MIB],
        "fds_first_max": [figures["fds"][1], max(figures["fds"][1:])],
        "os_threads_first_max": [figures["threads"][1], max(figures["threads"][1:])],
        "destroy_ms_median": round(statistics.median(figures["destroy_ms"]), 2),
        "reload_ms_median": round(statistics.median(figures["reload_ms"]), 2),
        "before_init_mib": round(figures["before_init"] / MIB, 1),
        "after_close_mib": round(figures["after_close"] / MIB, 1),
    }
    # Destroy never costs memory, and nothing grows from cycle to cycle (cycle 0 is warm-up).
    assert all(f >= -2 * MIB for f in freed), summary
    assert max(destroyed[1:]) - destroyed[1] <= FLAT_TOLERANCE, summary
    assert max(alive[1:]) - alive[1] <= FLAT_TOLERANCE, summary
    assert figures["reserved"][-1] - figures["reserved"][1] <= FLAT_TOLERANCE, summary
    # NCCL's watchdog and proxy threads and its sockets must go with each communicator.
    assert max(figures["fds"][1:]) - figures["fds"][1] <= FD_THREAD_TOLERANCE, summary
    assert max(figures["threads"][1:]) - figures["threads"][1] <= FD_THREAD_TOLERANCE, summary
    return summary


@pytest.fixture
def store() -> Iterator[Store]:
    assert not dist.is_initialized()
    yield dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("bind_device", [False, True], ids=["lazy", "device_id"])
def test_nccl_world_destroy_reload_frees_communicators(store: Store, bind_device: bool) -> None:
    # device_id makes NCCL connect at init and new_group split the WORLD communicator.
    figures = _cycle_figures(0, 1, store, bind_device)
    _report(f"process_groups_nccl_world1_{'device_id' if bind_device else 'lazy'}", _check_cycles(figures, 1))


# ---------------------------------------------------------------------------------- 2 GPUs


def _entry(rank: int, world_size: int, port: int, out: str) -> None:
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    try:
        result: dict[str, Any] = _cycle_figures(rank, world_size, store)
    except BaseException as exc:
        result = {"crash": f"{exc!r}\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_two_rank_nccl_destroy_reload_frees_communicators() -> None:
    world_size = 2
    master = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry, args=(world_size, master.port, out), nprocs=world_size, join=False, start_method="spawn"
        )
        end = time.monotonic() + 300
        while not context.join(timeout=1):
            if time.monotonic() > end:
                for process in context.processes:
                    process.kill()
                pytest.fail("ranks still running after 300 s")
        results = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
    crashes = [res["crash"] for res in results if "crash" in res]
    assert not crashes, crashes
    _report(
        "process_groups_nccl_world2", {f"rank{r}": _check_cycles(res, 2) for r, res in enumerate(results)}
    )


# ---------------------------------------------------------------------------------- Megatron


def test_megatron_gpt_trains_across_sleep_and_wake(store: Store) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core import parallel_state as ps

    from actor_integration.backends.megatron import MegatronParallelState
    from tests.helpers.models import tiny_gpt_model

    torch.cuda.set_device(0)
    groups = ReloadableProcessGroups.init(
        backend="nccl", rank=0, world_size=1, store=store, timeout=timedelta(seconds=120)
    )
    state = MegatronParallelState(groups, tensor_model_parallel_size=1)
    model = tiny_gpt_model(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    state.register(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    batch, seq = 4, 32
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (batch, seq), generator=generator).cuda()
    positions = torch.arange(seq, device="cuda").expand(batch, seq)
    # Explicit causal mask: megatron's default one is built on "cuda" by name.
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), diagonal=1).expand(
        batch, 1, seq, seq
    )

    def step() -> float:
        optimizer.zero_grad()
        loss = model(ids, positions, mask, labels=ids).float().mean()
        loss.backward()
        optimizer.step()
        return float(loss.item())

    losses = [step() for _ in range(3)]
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=state))
    awake_used = _used()
    t0 = time.perf_counter()
    machine.sleep()
    sleep_ms = (time.perf_counter() - t0) * 1e3
    asleep_used = _used()
    assert machine.groups is Groups.DESTROYED and not state.is_alive()
    t0 = time.perf_counter()
    machine.wake_up()
    wake_ms = (time.perf_counter() - t0) * 1e3
    assert machine.groups is Groups.ALIVE and state.is_alive()
    stale = [
        type(m).__name__
        for m in model.modules()
        if getattr(m, "tp_group", None) is not None and m.tp_group is not ps.get_tensor_model_parallel_group()
    ]
    losses += [step() for _ in range(3)]
    figures = {
        "losses": [round(v, 4) for v in losses],
        "awake_used_mib": round(awake_used / MIB, 1),
        "asleep_used_mib": round(asleep_used / MIB, 1),
        "sleep_ms": round(sleep_ms, 2),
        "wake_ms": round(wake_ms, 2),
        "stale_group_modules": stale,
    }
    _report("process_groups_megatron_gpt", figures)
    assert all(math.isfinite(v) for v in losses), figures
    assert losses[2] < losses[0] and losses[5] < losses[3] < losses[0], figures
    assert not stale, figures
    ps.destroy_model_parallel()
    groups.close()

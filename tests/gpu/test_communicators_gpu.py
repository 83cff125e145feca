"""The three ways of treating NCCL communicators on sleep, on a real GPU: destroy, suspend, keep.

Run (suspend needs NCCL 2.29.7+ loaded, e.g. the nvidia-nccl-cu13 2.30.7 wheel's library):
    LD_PRELOAD=/path/to/nvidia/nccl/lib/libnccl.so.2 python -m pytest -m gpu tests/gpu/test_communicators_gpu.py -x -q -s
Without it the suspend tests are skipped with the reason `nccl_suspend_support()` gives.
Figures are printed and, when LIFECYCLE_GPU_OUT is set, written there as JSON.
"""

from __future__ import annotations

import io
import json
import math
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
from actor_integration.backends.process_groups import (
    ProcessGroupsAsleepError,
    ReloadableProcessGroups,
    loaded_nccl,
    nccl_suspend_support,
)
from lifecycle import Groups, Hooks, Lifecycle, LifecyclePolicy, capture_events
from lifecycle.testing import FakeMemorySaver
from tests.helpers.gpu_results import record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch build with NCCL"),
]

MIB = 1 << 20
GIB = 1 << 30
SUBGROUPS = 16
CYCLES = 3


def _suspend_reason() -> str | None:
    support = nccl_suspend_support("nccl")
    return None if support.available else support.reason


requires_suspend = pytest.mark.skipif(
    torch.cuda.is_available() and dist.is_nccl_available() and _suspend_reason() is not None,
    reason=f"communicators='suspend' cannot run here: {_suspend_reason() if torch.cuda.is_available() else ''}",
)


def _used(device: int = 0) -> int:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _warm(groups: list[Any], device: int = 0) -> bool:
    """One all_reduce of ones on every group: True when each came back exact."""
    ok = True
    for group in groups:
        x = torch.ones(1 << 20, device=f"cuda:{device}")
        dist.all_reduce(x, group=group)
        ok = ok and bool(torch.all(x == float(dist.get_world_size(group))))
    torch.cuda.synchronize(device)
    return ok


@pytest.fixture
def store() -> Iterator[Store]:
    assert not dist.is_initialized()
    yield dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    if dist.is_initialized():
        dist.destroy_process_group()


def _cycles(way: str, store: Store, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """WORLD + 16 NCCL subgroups on cuda:rank, each warmed; CYCLES sleep/wake through the machine."""
    torch.cuda.set_device(rank)
    groups = ReloadableProcessGroups.init(
        backend="nccl",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=timedelta(seconds=300),
        communicators=way,
    )
    handles = [groups.new_group(list(range(world_size)), name=f"g{i}") for i in range(SUBGROUPS)]
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
    _warm([None, *(h.group for h in handles)], rank)
    out: dict[str, Any] = {"way": way, "cycles": [], "nccl": None}
    loaded = loaded_nccl()
    out["nccl"] = None if loaded is None else ".".join(map(str, loaded.version))
    out["held_bytes_awake"] = groups.held_bytes()
    with capture_events("debug") as events:
        for _ in range(CYCLES):
            before = [h.group for h in handles]
            awake = _used(rank)
            mark = len(events)
            t0 = time.perf_counter()
            machine.sleep()
            sleep_s = time.perf_counter() - t0
            asleep = _used(rank)
            asleep_state = machine.groups.value if machine.groups else None
            try:
                handles[0].group  # noqa: B018 - must refuse while asleep
                refused = None
            except ProcessGroupsAsleepError as exc:
                refused = exc.state
            t0 = time.perf_counter()
            machine.wake_up()
            wake_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ok = _warm([None, *(h.group for h in handles)], rank)
            first_s = time.perf_counter() - t0
            destroyed = next(e for e in events[mark:] if e.get("event") == "process_groups.destroyed")
            out["cycles"].append(
                {
                    "sleep_s": round(sleep_s, 4),
                    "wake_s": round(wake_s, 4),
                    "first_collectives_s": round(first_s, 4),
                    "freed_mib": round((awake - asleep) / MIB, 1),
                    "event_bytes_mib": None
                    if destroyed.get("bytes") is None
                    else round(destroyed["bytes"] / MIB, 1),
                    "measured_by": destroyed.get("measured_by"),
                    "held_mib": None
                    if destroyed.get("held_bytes") is None
                    else round(destroyed["held_bytes"] / MIB, 1),
                    "fell_back": destroyed.get("fell_back"),
                    "groups_state": asleep_state,
                    "refused_as": refused,
                    "same_groups": all(h.group is b for h, b in zip(handles, before, strict=True)),
                    "collectives_ok": ok,
                }
            )
    groups.close()
    return out


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    cycles = out["cycles"]

    def med(key: str) -> float:
        return float(statistics.median(c[key] for c in cycles))

    return {
        **{k: v for k, v in out.items() if k != "cycles"},
        "sleep_s_median": med("sleep_s"),
        "wake_s_median": med("wake_s"),
        "first_collectives_s_median": med("first_collectives_s"),
        "freed_mib_median": med("freed_mib"),
        "cycles": cycles,
    }


def test_destroy_frees_the_communicators_and_says_how_much(store: Store) -> None:
    out = _cycles("destroy", store)
    record("communicators_destroy", _summary(out))
    for cycle in out["cycles"]:
        assert (
            cycle["collectives_ok"]
            and cycle["groups_state"] == "destroyed"
            and cycle["refused_as"] == "destroyed"
        )
        assert cycle["freed_mib"] > 1024, cycle  # ~390 MiB per communicator on an H200
        assert cycle["event_bytes_mib"] is not None and cycle["event_bytes_mib"] > 1024, cycle
        assert not cycle["same_groups"]  # rebuilt


@requires_suspend
def test_suspend_frees_the_memory_and_resume_hands_back_working_groups(store: Store) -> None:
    out = _cycles("suspend", store)
    record("communicators_suspend", _summary(out))
    for cycle in out["cycles"]:
        assert cycle["collectives_ok"] and cycle["same_groups"], cycle
        assert cycle["groups_state"] == "suspended" and cycle["refused_as"] == "suspended"
        assert cycle["measured_by"] == "ncclCommMemStats" and not cycle["fell_back"], cycle
        # NCCL's count and the device's agree within what other allocations move (2 MiB pages).
        assert cycle["freed_mib"] > 0.9 * cycle["event_bytes_mib"] > 1024, cycle


def test_keep_holds_the_memory_and_costs_nothing(store: Store) -> None:
    out = _cycles("keep", store)
    record("communicators_keep", _summary(out))
    for cycle in out["cycles"]:
        assert cycle["collectives_ok"] and cycle["same_groups"] and cycle["groups_state"] == "kept"
        assert abs(cycle["freed_mib"]) < 64, cycle  # nothing released
        assert cycle["sleep_s"] < 0.2 and cycle["wake_s"] < 0.2, cycle
        if out["nccl"] and tuple(int(v) for v in out["nccl"].split(".")) >= (2, 29, 7):
            assert cycle["held_mib"] is not None and cycle["held_mib"] > 1024, cycle


# ---------------------------------------------------------------------------------- Megatron


@requires_suspend
def test_megatron_gpt_trains_across_suspended_sleeps(store: Store) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core import parallel_state as ps

    from actor_integration.backends.megatron import MegatronParallelState
    from tests.helpers.models import tiny_gpt_model

    torch.cuda.set_device(0)
    groups = ReloadableProcessGroups.init(
        backend="nccl",
        rank=0,
        world_size=1,
        store=store,
        timeout=timedelta(seconds=300),
        communicators="suspend",
    )
    state = MegatronParallelState(groups, tensor_model_parallel_size=1)
    model = tiny_gpt_model(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    state.register(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 32), generator=generator).cuda()
    positions = torch.arange(32, device="cuda").expand(4, 32)
    mask = torch.triu(torch.ones(32, 32, dtype=torch.bool, device="cuda"), diagonal=1).expand(4, 1, 32, 32)

    def step() -> float:
        optimizer.zero_grad()
        loss = model(ids, positions, mask, labels=ids).float().mean()
        loss.backward()
        optimizer.step()
        return float(loss.item())

    _warm([pg for pg in dist.distributed_c10d._world.pg_map if "nccl" in str(dist.get_backend(pg))])
    losses = [step() for _ in range(3)]
    tp_before = ps.get_tensor_model_parallel_group()
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=state))
    awake = _used()
    with capture_events("debug") as events:
        t0 = time.perf_counter()
        machine.sleep()
        sleep_s = time.perf_counter() - t0
        asleep = _used()
        t0 = time.perf_counter()
        machine.wake_up()
        wake_s = time.perf_counter() - t0
    destroyed = next(e for e in events if e.get("event") == "process_groups.destroyed")
    assert machine.groups is Groups.ALIVE
    losses += [step() for _ in range(3)]
    figures = {
        "losses": [round(v, 4) for v in losses],
        "freed_mib": round((awake - asleep) / MIB, 1),
        "event_bytes_mib": None if destroyed.get("bytes") is None else round(destroyed["bytes"] / MIB, 1),
        "communicator_count": destroyed.get("communicator_count"),
        "fell_back": destroyed.get("fell_back"),
        "sleep_s": round(sleep_s, 3),
        "wake_s": round(wake_s, 3),
        "same_tp_group": ps.get_tensor_model_parallel_group() is tp_before,
    }
    record("communicators_suspend_megatron", figures)
    assert all(math.isfinite(v) for v in losses), figures
    assert losses[5] < losses[3] < losses[0], figures
    assert figures["same_tp_group"] or figures["fell_back"], figures
    ps.destroy_model_parallel()
    groups.close()


# ---------------------------------------------------------------------------------- 2 GPUs


def _entry(rank: int, world_size: int, port: int, way: str, out: str) -> None:
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    try:
        result: dict[str, Any] = _summary(_cycles(way, store, rank, world_size))
    except BaseException as exc:
        result = {"crash": f"{exc!r}\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result, default=str))


@requires_suspend
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_two_ranks_suspend_the_same_communicators_and_say_which_fell_back() -> None:
    """Multi-GPU communicators may use NVLS on Hopper (NCCL #2337): those that cannot be suspended are
    torn down on both ranks and rebuilt; the figures say which, and what the rest freed."""
    world_size = 2
    master = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry,
            args=(world_size, master.port, "suspend", out),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        end = time.monotonic() + 420
        while not context.join(timeout=1):
            if time.monotonic() > end:
                for process in context.processes:
                    process.kill()
                pytest.fail("ranks still running after 420 s")
        results = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
    crashes = [res["crash"] for res in results if "crash" in res]
    assert not crashes, crashes
    record("communicators_suspend_world2", {f"rank{r}": res for r, res in enumerate(results)})
    for res in results:
        for cycle in res["cycles"]:
            assert cycle["collectives_ok"] and cycle["groups_state"] == "suspended", cycle
    # Both ranks tore down the same groups (fell back) in every cycle.
    fell = [[sorted(c["fell_back"] or {}) for c in res["cycles"]] for res in results]
    assert fell[0] == fell[1], fell

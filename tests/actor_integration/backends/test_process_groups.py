"""ReloadableProcessGroups on real torch.distributed (gloo), one spawned process per rank."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from actor_integration.backends.process_groups import (
    ReloadableProcessGroups,
    RendezvousMismatchError,
    RendezvousTimeoutError,
)
from lifecycle import Groups, Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.testing import FakeMemorySaver
from tests.actor_integration.forked_ranks import ranks_forked
from tests.helpers.spawn import no_crash, run_world

CYCLES = 50
WARMUP = 5
# A leak of one fd or thread per cycle would show as 45 over the measured cycles; the tolerance only
# absorbs one-off noise (a socket whose close lands a cycle late, a lazily started helper thread).
FD_TOLERANCE = 2
THREAD_TOLERANCE = 1

Worker = Callable[..., dict[str, Any]]


def _os_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line in /proc/self/status")


def _resources() -> dict[str, int]:
    gc.collect()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "py_threads": threading.active_count(),
        "os_threads": _os_threads(),
    }


def _sum(group: Any, value: float = 1.0) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=group)
    return float(tensor.item())


# ---------------------------------------------------------------------------------- workers


# 16 subgroups of 4 ranks, as many as a Megatron rank has: "pair" and "odd" first, then singles,
# the other pairs, triples and two of everyone (each destroyed in its own thread on every sleep).
SUBGROUPS: tuple[tuple[int, ...], ...] = (
    (0, 1),
    (1, 3),
    *((r,) for r in range(4)),
    (0, 2),
    (2, 3),
    (0, 3),
    (1, 2),
    (0, 1, 2),
    (1, 2, 3),
    (0, 2, 3),
    (0, 1, 3),
    (0, 1, 2, 3),
    (0, 1, 2, 3),
)


def _cycles_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    groups = ReloadableProcessGroups.init(
        backend="gloo", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=30)
    )
    names = ["pair", "odd", *(f"g{i}" for i in range(2, len(SUBGROUPS)))]
    handles = [groups.new_group(list(ranks), name=name) for name, ranks in zip(names, SUBGROUPS, strict=True)]
    pair, odd = handles[0], handles[1]
    out: dict[str, Any] = {"world": [], "pair": [], "odd": [], "asleep": [], "resources": [], "sums": []}
    out["registered_asleep"] = []
    for cycle in range(CYCLES):
        if cycle == 0:
            old_world = groups.world
        groups.destroy()
        if cycle == 0:
            out["backend_asleep"] = str(dist.get_backend())
            out["old_world_registered"] = dist.distributed_c10d._world.pg_map.get(old_world) is not None
            out["is_alive_asleep"] = groups.is_alive()
            try:
                pair.group  # noqa: B018 - the access itself must raise
                out["handle_error"] = None
            except RuntimeError as exc:
                out["handle_error"] = str(exc)
            groups.barrier(name="asleep")
        out["asleep"].append(_sum(groups.side_channel, rank + 1))
        out["registered_asleep"].append(len(dist.distributed_c10d._world.pg_map))
        groups.reload()
        out["world"].append(_sum(None, rank + 1))
        out["pair"].append(_sum(pair.group, rank + 1) if rank in pair.ranks else None)
        out["odd"].append(_sum(odd.group, rank + 1) if rank in odd.ranks else None)
        # A collective on every subgroup after every reload: the rank's own sum over its members.
        out["sums"].append([_sum(h.group, rank + 1) if rank in h.ranks else None for h in handles])
        if cycle >= WARMUP - 1:
            out["resources"].append(_resources())
    out["generation"] = groups.generation
    out["handle_generations"] = sorted({h.generation for h in handles})
    out["is_alive"] = groups.is_alive()
    # Last, as it leaves the ranks out of step: the bug of a new_group inside a rank branch.
    out["branch_error"] = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            groups.new_group([0, 1], name="tp", timeout=timedelta(seconds=2))
        except RendezvousTimeoutError as exc:
            out.update(branch_error=str(exc), branch_missing=list(exc.missing))
        out["branch_waited_s"] = time.monotonic() - t0
    groups.close()
    groups.close()
    out["closed_state"] = groups.state
    return out


def _lifecycle_worker(rank: int, world_size: int, store: Store, init_method: str) -> dict[str, Any]:
    del store  # this world rendezvouses through init_method (a FileStore) instead
    groups = ReloadableProcessGroups.init(
        backend="gloo",
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        timeout=timedelta(seconds=30),
    )
    both = groups.new_group([0, 1], name="both")
    # The real teardown runs on the hook pool beside the memory pause (the plan's shared stage).
    memory = FakeMemorySaver(may_overlap_process_groups=True)
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=memory, process_groups=groups), rank=rank)
    out: dict[str, Any] = {"steps": []}

    def record(step: str) -> None:
        out["steps"].append(
            {
                "step": step,
                "state": machine.state.value,
                "groups": machine.groups.value if machine.groups else None,
                "alive": groups.is_alive(),
                "paused": memory.is_paused(),
                "generation": groups.generation,
            }
        )

    def collective_body() -> dict[str, Any]:
        return {
            "alive": groups.is_alive(),
            "memory_disabled": memory.disabled,
            "world": _sum(None, rank + 1),
            "both": _sum(both.group, 10 * (rank + 1)),
        }

    out["train"] = machine.run("train", collective_body)
    record("train")
    machine.sleep()
    record("sleep")
    out["asleep_side_channel"] = _sum(groups.side_channel, rank + 1)
    out["sync_from_paused"] = machine.run("sync", collective_body)
    record("sync")
    machine.wake_up()
    record("wake_up")
    out["after_wake"] = collective_body()
    # Last, as it leaves the ranks out of step: a rank branch around a collective call.
    out["branch_error"] = None
    try:
        if rank == 0:
            groups.new_group([0, 1], name="tp")
        groups.barrier()
    except RendezvousMismatchError as exc:
        out.update(branch_error=str(exc), other_rank=exc.other_rank)
    groups.close()
    return out


# ---------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def cycles() -> list[dict[str, Any]]:
    # Spawned ranks, not `ranks_forked()`: a rank forked from the fork server holds megatron-core's
    # objects too, and the gc.collect() of each of these cycles would walk them (forked_ranks.py).
    results = run_world(_cycles_worker, 4, deadline_s=90)
    no_crash(results)
    return results


class TestDestroyReloadCycles:
    """4 ranks, 50 destroy/reload cycles, WORLD and 16 subgroups torn down concurrently."""

    def test_world_all_reduce_is_correct_after_every_reload(self, cycles: list[dict[str, Any]]) -> None:
        for res in cycles:
            assert res["world"] == [10.0] * CYCLES  # 1 + 2 + 3 + 4

    def test_subgroups_all_reduce_over_their_own_ranks_after_every_reload(
        self, cycles: list[dict[str, Any]]
    ) -> None:
        assert cycles[0]["pair"] == cycles[1]["pair"] == [3.0] * CYCLES  # ranks 0, 1
        assert cycles[1]["odd"] == cycles[3]["odd"] == [6.0] * CYCLES  # ranks 1, 3
        assert cycles[2]["pair"] == [None] * CYCLES

    def test_every_subgroup_all_reduces_over_its_own_ranks_after_every_reload(
        self, cycles: list[dict[str, Any]]
    ) -> None:
        for rank, res in enumerate(cycles):
            expected = [float(sum(r + 1 for r in ranks)) if rank in ranks else None for ranks in SUBGROUPS]
            assert res["sums"] == [expected] * CYCLES

    def test_asleep_only_the_gloo_stand_in_is_left(self, cycles: list[dict[str, Any]]) -> None:
        """Every subgroup went down with WORLD: the registry holds only the gloo WORLD."""
        for res in cycles:
            assert res["registered_asleep"] == [1] * CYCLES

    def test_every_reload_is_a_new_generation(self, cycles: list[dict[str, Any]]) -> None:
        for res in cycles:
            assert res["generation"] == CYCLES
            assert res["handle_generations"] == [CYCLES]
            assert res["is_alive"] is True

    def test_destroy_really_destroys_the_accelerator_world(self, cycles: list[dict[str, Any]]) -> None:
        for res in cycles:
            assert res["old_world_registered"] is False
            assert res["is_alive_asleep"] is False
            assert res["backend_asleep"] == "gloo"

    def test_file_descriptors_and_threads_stay_flat(self, cycles: list[dict[str, Any]]) -> None:
        for rank, res in enumerate(cycles):
            first, rest = res["resources"][0], res["resources"][1:]
            assert len(rest) == CYCLES - WARMUP
            for key, tolerance in (
                ("fds", FD_TOLERANCE),
                ("py_threads", THREAD_TOLERANCE),
                ("os_threads", THREAD_TOLERANCE),
            ):
                peak = max(r[key] for r in rest)
                assert peak <= first[key] + tolerance, f"rank {rank} {key}: {first[key]} -> peak {peak}"

    def test_close_is_idempotent(self, cycles: list[dict[str, Any]]) -> None:
        assert {res["closed_state"] for res in cycles} == {"closed"}


class TestWhileDestroyed:
    def test_side_channel_all_reduce_and_barrier_work(self, cycles: list[dict[str, Any]]) -> None:
        for res in cycles:
            assert res["asleep"] == [10.0] * CYCLES

    def test_handle_group_raises_a_clear_error(self, cycles: list[dict[str, Any]]) -> None:
        for res in cycles:
            assert res["handle_error"] is not None
            assert "process group pair was destroyed by sleep(); call wake_up() first" in res["handle_error"]


class TestRankBranch:
    def test_new_group_on_one_rank_names_the_ranks_that_never_arrived(
        self, cycles: list[dict[str, Any]]
    ) -> None:
        error = cycles[0]["branch_error"]
        assert error is not None, "rank 0 should have timed out"
        assert cycles[0]["branch_missing"] == [1, 2, 3]
        assert (
            "ranks [1, 2, 3]" in error and "rank branch" in error and f"new_group #{len(SUBGROUPS)}" in error
        )
        assert 1.5 < cycles[0]["branch_waited_s"] < 10

    def test_collective_in_a_rank_branch_fails_on_every_rank(self, steps: list[dict[str, Any]]) -> None:
        for rank, res in enumerate(steps):
            assert res["branch_error"] is not None, f"rank {rank} did not raise"
            assert "new_group #1" in res["branch_error"] and "barrier" in res["branch_error"]
            assert res["other_rank"] == 1 - rank


@pytest.fixture(scope="module")
def steps() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, ranks_forked():  # ranks forked from one torch import
        results = run_world(_lifecycle_worker, 2, f"file://{tmp}/rendezvous", deadline_s=60)
    no_crash(results)
    return results


class TestLifecycleDrivesGroups:
    """Two ranks, each with its own Lifecycle over FakeMemorySaver and real gloo groups."""

    def test_sleep_destroys_and_wake_reloads_in_lockstep(self, steps: list[dict[str, Any]]) -> None:
        for res in steps:
            by_step = [(s["step"], s["state"], s["groups"], s["alive"]) for s in res["steps"]]
            assert by_step == [
                ("train", State.AWAKE.value, Groups.ALIVE.value, True),
                ("sleep", State.PAUSED.value, Groups.DESTROYED.value, False),
                ("sync", State.PAUSED.value, Groups.DESTROYED.value, False),
                ("wake_up", State.AWAKE.value, Groups.ALIVE.value, True),
            ]
        assert steps[0]["steps"] == steps[1]["steps"]

    def test_sync_from_paused_reloads_groups_only_for_its_body(self, steps: list[dict[str, Any]]) -> None:
        for res in steps:
            body = res["sync_from_paused"]
            assert body == {"alive": True, "memory_disabled": True, "world": 3.0, "both": 30.0}
            sync = res["steps"][2]
            assert sync["paused"] is True  # model memory stayed paused
            assert sync["generation"] == 1  # one reload, for the sync

    def test_collectives_work_before_sleep_and_after_wake_up(self, steps: list[dict[str, Any]]) -> None:
        for res in steps:
            assert res["train"]["world"] == 3.0 and res["train"]["both"] == 30.0
            assert res["after_wake"]["world"] == 3.0 and res["after_wake"]["both"] == 30.0
            assert res["asleep_side_channel"] == 3.0


# ---------------------------------------------------------------------------------- single process


@pytest.fixture
def single() -> Any:
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    groups = ReloadableProcessGroups.init(
        backend="gloo", rank=0, world_size=1, store=store, timeout=timedelta(seconds=10)
    )
    yield groups
    groups.close()
    assert not dist.is_initialized()


class TestBadInput:
    """Errors raised before any collective, saying what is wrong and what to do."""

    @pytest.mark.parametrize(
        ("ranks", "message"),
        [
            ([], "ranks is empty"),
            ([0, 0], "repeat a rank"),
            ([0, 1], "outside the world of size 1"),
            ("01", "sequence of ints"),
            ([0.0], "sequence of ints"),
        ],
    )
    def test_new_group_rejects_bad_ranks(
        self, single: ReloadableProcessGroups, ranks: Any, message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            single.new_group(ranks)

    def test_new_group_names_are_unique(self, single: ReloadableProcessGroups) -> None:
        single.new_group([0], name="tp")
        with pytest.raises(ValueError, match="'tp' exists already"):
            single.new_group([0], name="tp")

    def test_new_group_refused_while_destroyed(self, single: ReloadableProcessGroups) -> None:
        single.destroy()
        with pytest.raises(RuntimeError, match=r"destroyed \(asleep\); call wake_up\(\)"):
            single.new_group([0])

    def test_destroy_twice_and_reload_when_alive_are_refused(self, single: ReloadableProcessGroups) -> None:
        with pytest.raises(RuntimeError, match="alive; destroy"):
            single.reload()
        single.destroy()
        with pytest.raises(RuntimeError, match="call wake_up"):
            single.destroy()

    def test_world_is_refused_while_destroyed(self, single: ReloadableProcessGroups) -> None:
        assert single.world is dist.group.WORLD
        single.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            single.world  # noqa: B018

    def test_closed_groups_refuse_everything(self, single: ReloadableProcessGroups) -> None:
        single.close()
        assert not dist.is_initialized()
        for call in (single.barrier, single.destroy, lambda: single.side_channel):
            with pytest.raises(RuntimeError, match="closed"):
                call()

    def test_init_checks_its_arguments(self) -> None:
        with pytest.raises(ValueError, match="rank must be an int in"):
            ReloadableProcessGroups.init(backend="gloo", rank=2, world_size=2)
        with pytest.raises(ValueError, match="not available"):
            ReloadableProcessGroups.init(backend="nosuch", rank=0, world_size=1)
        with pytest.raises(ValueError, match="either store= or init_method="):
            ReloadableProcessGroups.init(
                backend="gloo", rank=0, world_size=1, init_method="env://", store=dist.HashStore()
            )
        with pytest.raises(ValueError, match="positive timedelta"):
            ReloadableProcessGroups.init(backend="gloo", rank=0, world_size=1, timeout=timedelta(0))

    def test_init_twice_points_to_adopt(self, single: ReloadableProcessGroups) -> None:
        with pytest.raises(RuntimeError, match="adopt"):
            ReloadableProcessGroups.init(backend="gloo", rank=0, world_size=1, store=dist.HashStore())


class TestAdopt:
    def test_adopt_refuses_subgroups_it_did_not_create(self) -> None:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            dist.new_group([0])
            with pytest.raises(
                RuntimeError, match=r"1 process groups besides WORLD .*\(gloo \[0\]\).*SlimeLifecycleMixin"
            ):
                ReloadableProcessGroups.adopt()
            groups = ReloadableProcessGroups.adopt(untracked_subgroups=True)
            groups.destroy()
            groups.reload()
            assert _sum(None) == 1.0
            groups.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def test_adopt_needs_an_initialised_group(self) -> None:
        with pytest.raises(RuntimeError, match="init_process_group first"):
            ReloadableProcessGroups.adopt()


class TestRecovery:
    def test_reload_that_failed_half_way_is_finished_by_recover(
        self, single: ReloadableProcessGroups, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        handle = single.new_group([0], name="tp")
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=single))
        machine.sleep()
        real_new_group, calls = dist.new_group, []

        def new_group_failing_once(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("group_desc"))
            if len(calls) == 2:  # the subgroup, after the side channel came up
                raise RuntimeError("injected: communicator init failed")
            return real_new_group(*args, **kwargs)

        monkeypatch.setattr(dist, "new_group", new_group_failing_once)
        with pytest.raises(RuntimeError, match="injected"):
            machine.wake_up()
        assert machine.state is State.FAILED
        assert single.state == "broken" and not single.is_alive()
        machine.recover(State.AWAKE)
        assert machine.state is State.AWAKE and machine.groups is Groups.ALIVE
        assert single.is_alive() and handle.generation == single.generation == 2
        assert _sum(handle.group) == 1.0


# ---------------------------------------------------------------------------------- concurrent teardown


def _skipping_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    """Rank 3 never calls destroy(): the others' deadline names it."""
    groups = ReloadableProcessGroups.init(
        backend="gloo", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=3)
    )
    for i, ranks in enumerate(SUBGROUPS):
        groups.new_group(list(ranks), name=f"g{i}")
    out: dict[str, Any] = {"error": None}
    if rank == 3:
        time.sleep(4.5)  # busy elsewhere past the others' 3 s deadline (a long step, a hang)
    else:
        t0 = time.monotonic()
        try:
            groups.destroy()
        except RendezvousTimeoutError as exc:
            out.update(error=str(exc), missing=list(exc.missing), what=exc.what)
        out["waited_s"] = time.monotonic() - t0
        out["state"] = groups.state
        out["registered"] = len(dist.distributed_c10d._world.pg_map)
    groups.close()
    return out


class TestSkippedTeardown:
    def test_a_rank_that_skips_the_teardown_is_named_and_nothing_is_torn_down(self) -> None:
        with ranks_forked():  # ranks forked from one torch import (tests/actor_integration/forked_ranks.py)
            results = run_world(_skipping_worker, 4, deadline_s=60)
        no_crash(results)
        for rank in range(3):
            res = results[rank]
            assert res["missing"] == [3], res
            assert "destroy(generation 0)" in res["error"] and "ranks [3]" in res["error"]
            assert "sleep()/wake_up()" in res["error"]
            assert 2.5 < res["waited_s"] < 10
            # The rendezvous comes first: a rank that waited in vain still has all its groups.
            member_of = sum(rank in ranks for ranks in SUBGROUPS)
            assert res["state"] == "alive" and res["registered"] == member_of + 2  # + WORLD, side channel


class TestConcurrentTeardown:
    """One process, gloo: what the teardown does, observed through torch's own destroy call."""

    def test_subgroups_go_down_together_and_world_last(
        self, single: ReloadableProcessGroups, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for i in range(8):
            single.new_group([0], name=f"g{i}")
        untracked = dist.new_group([0])  # made by someone else (Megatron): it goes down too
        subgroups = len(dist.distributed_c10d._world.pg_map) - 1  # 8 + side channel + untracked
        together = threading.Barrier(subgroups, timeout=10)
        real_destroy, order = dist.destroy_process_group, []

        def destroy(group: Any = None) -> None:
            if group is not None:
                together.wait()  # passes only once every subgroup's teardown has started
            order.append("world" if group is None else "subgroup")
            real_destroy(group)

        monkeypatch.setattr(dist, "destroy_process_group", destroy)
        single.destroy()
        assert order == ["subgroup"] * subgroups + ["world"]
        assert dist.distributed_c10d._world.pg_map.get(untracked) is None
        monkeypatch.undo()
        single.reload()
        assert _sum(None) == 1.0 and all(_sum(h.group) == 1.0 for h in single.handles)

    def test_a_failing_subgroup_still_leaves_world_destroyed_and_recover_finishes(
        self, single: ReloadableProcessGroups, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        handle = single.new_group([0], name="tp")
        tp = handle.group
        real_destroy, calls = dist.destroy_process_group, []

        def destroy(group: Any = None) -> None:
            calls.append(group is None)
            if group is tp:
                real_destroy(group)
                raise RuntimeError("injected: communicator teardown failed")
            real_destroy(group)

        monkeypatch.setattr(dist, "destroy_process_group", destroy)
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=single))
        with pytest.raises(RuntimeError, match="injected"):
            machine.sleep()
        assert calls[-1] is True  # WORLD went down last, after the failed sibling
        assert single.state == "broken" and not dist.is_initialized()
        monkeypatch.undo()
        machine.recover(State.AWAKE)
        assert single.is_alive() and _sum(handle.group) == 1.0


class TestTeardownLog:
    def test_the_first_destroy_says_which_way_ran_and_why_once(self, single: ReloadableProcessGroups) -> None:
        from lifecycle import capture_events

        with capture_events("info") as events:
            single.destroy()
            single.reload()
            single.destroy()
        (logged,) = [e for e in events if e["event"] == "process_groups.destroyed"]
        assert (
            logged["way"] == "destroy"
            and logged["why"] == "no NCCL groups"
            and logged["communicator_count"] == 2
        )
        # Not a lifecycle machine's event: no rank/role keys for the checker and timeline to misread.
        assert "rank" not in logged and "role" not in logged and logged["group_rank"] == 0


class TestTeardownPieces:
    """The package's public teardown pieces, which other group registries (slime's) reuse."""

    def test_destroy_registered_groups_takes_every_group_down_and_counts_them(self) -> None:
        from actor_integration.backends.process_groups import destroy_registered_groups, registered_groups

        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        subgroups = [dist.new_group([0]) for _ in range(3)]
        assert len(registered_groups()) == 4
        del subgroups
        assert destroy_registered_groups() == 4
        assert not dist.is_initialized()
        assert destroy_registered_groups() == 0  # nothing left: a second call is harmless

    def test_meeting_names_the_rank_that_never_came(self) -> None:
        from actor_integration.backends.process_groups import LIFECYCLE_CAUSE, Meeting

        meeting = Meeting(dist.HashStore(), rank=0, world_size=2)
        with pytest.raises(RendezvousTimeoutError, match=r"ranks \[1\]") as caught:
            meeting.meet("destroy(generation 0)", timedelta(seconds=0.3), LIFECYCLE_CAUSE)
        assert caught.value.missing == (1,) and "sleep()/wake_up()" in str(caught.value)

"""The three ways of treating the communicators on sleep (destroy, suspend, keep), on real gloo groups.

Suspend needs NCCL 2.29.7+, which no CPU machine has: there, gloo groups stand in for NCCL ones
(`tests.helpers.fake_nccl`: the exact `_nccl.Communicator` interface, suspend/resume recorded,
failing where told); everything else (the rendezvous, the teardown of a group that cannot be
suspended, its rebuild, the handles) is the real code on real torch.distributed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from actor_integration.backends.memory_budget import DeviceMemoryProbe
from actor_integration.backends.process_groups import ReloadableProcessGroups, _nccl
from actor_integration.errors import ProcessGroupsAsleepError
from lifecycle import Communicators, Groups, Hooks, Lifecycle, LifecyclePolicy, MemoryBudget, capture_events
from lifecycle.budget import COMMUNICATORS
from lifecycle.checker import check_lines
from lifecycle.testing import FakeMemorySaver
from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers import fake_nccl
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)


def _sum(group: Any, value: float = 1.0) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=group)
    return float(tensor.item())


@pytest.fixture
def nccl_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Gloo groups look like NCCL ones for this test; the real probe comes back after it."""
    monkeypatch.setattr(_nccl, "communicator_of", _nccl.communicator_of)
    monkeypatch.setattr(_nccl, "nccl_suspend_support", _nccl.nccl_suspend_support)
    yield


def _single(communicators: str, store: Store | None = None) -> ReloadableProcessGroups:
    assert not dist.is_initialized()
    store = store or dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    return ReloadableProcessGroups.init(
        backend="gloo",
        rank=0,
        world_size=1,
        store=store,
        timeout=timedelta(seconds=10),
        communicators=communicators,
    )


@pytest.fixture
def closing() -> Iterator[list[ReloadableProcessGroups]]:
    made: list[ReloadableProcessGroups] = []
    yield made
    for groups in made:
        groups.close()
    assert not dist.is_initialized()


class TestChoosingAWay:
    def test_destroy_is_the_default(self, closing: list[ReloadableProcessGroups]) -> None:
        closing.append(groups := _single("destroy"))
        groups.close()
        closing.append(
            default := ReloadableProcessGroups.init(
                backend="gloo",
                rank=0,
                world_size=1,
                store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False),
            )
        )
        assert default.communicators == "destroy"

    def test_suspend_is_refused_where_nccl_cannot_suspend_and_the_call_can_be_retried(self) -> None:
        with pytest.raises(
            ValueError, match=r"communicators='suspend' cannot work here: backend 'gloo' has no NCCL"
        ):
            _single("suspend")
        assert not dist.is_initialized()  # refused before WORLD existed: nothing to clean up
        support = _nccl.nccl_suspend_support("nccl")
        if not dist.is_nccl_available():
            assert not support.available and "built without NCCL" in support.reason

    def test_the_old_suspend_argument_says_what_replaced_it(self) -> None:
        for value in ("auto", "never"):
            with pytest.raises(ValueError, match=r"suspend='?\w+'? was replaced by communicators=.*opt in"):
                ReloadableProcessGroups.init(backend="gloo", rank=0, world_size=1, suspend=value)
        assert not dist.is_initialized()

    def test_an_unknown_way_is_refused(self) -> None:
        with pytest.raises(
            ValueError, match=r"communicators must be one of \['destroy', 'suspend', 'keep'\]"
        ):
            _single("pause")
        assert not dist.is_initialized()

    def test_init_builds_the_way_once_so_the_suspend_probe_runs_once(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        fake_nccl.install()
        probes: list[str] = []
        probe = _nccl.nccl_suspend_support

        def counted(backend: str = "nccl") -> _nccl.NcclSuspendSupport:
            probes.append(backend)
            return probe(backend)

        monkeypatch.setattr(_nccl, "nccl_suspend_support", counted)
        closing.append(groups := _single("suspend"))
        assert probes == ["gloo"]
        with capture_events("info") as events:
            groups.destroy()
            groups.reload()
        assert probes == ["gloo"]  # the first sleep says why from what the one probe found
        (logged,) = [e for e in events if e["event"] == "process_groups.destroyed"]
        assert "fake NCCL 2.30.7 over gloo" in logged["why"]

    @pytest.mark.parametrize("way", ["destroy", "keep"])
    def test_the_lifecycle_machine_reads_the_way(
        self, closing: list[ReloadableProcessGroups], way: str
    ) -> None:
        closing.append(groups := _single(way))
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
        machine.sleep()
        assert machine.groups is {"destroy": Groups.DESTROYED, "keep": Groups.KEPT}[way]
        assert groups.state == machine.groups.value
        machine.wake_up()
        assert machine.groups is Groups.ALIVE and groups.is_alive()


class TestKeep:
    def test_keep_leaves_every_group_as_it_was_and_hands_the_same_groups_back(
        self, closing: list[ReloadableProcessGroups]
    ) -> None:
        closing.append(groups := _single("keep"))
        tp = groups.new_group([0], name="tp")
        before = (tp.group, dist.group.WORLD, len(dist.distributed_c10d._world.pg_map))
        groups.destroy()
        assert groups.state == "kept" and not groups.is_alive()
        assert len(dist.distributed_c10d._world.pg_map) == before[2]  # nothing torn down
        assert _sum(groups.side_channel) == 1.0 and dist.get_backend() == "gloo"
        groups.reload()
        assert (tp.group, dist.group.WORLD) == before[:2] and tp.generation == 1
        assert _sum(tp.group) == 1.0

    def test_kept_groups_refuse_collectives_until_wake(self, closing: list[ReloadableProcessGroups]) -> None:
        closing.append(groups := _single("keep"))
        tp = groups.new_group([0], name="tp")
        groups.destroy()
        with pytest.raises(ProcessGroupsAsleepError, match=r"process group tp is asleep .*'keep'") as caught:
            tp.group  # noqa: B018 - the access itself must refuse
        assert caught.value.state == "kept" and caught.value.group == "tp"
        for refused in (lambda: groups.world, lambda: groups.new_group([0]), groups.connect):
            with pytest.raises(ProcessGroupsAsleepError, match=r"the groups are kept \(asleep\)"):
                refused()
        groups.barrier(name="asleep")  # store-based: works asleep

    def test_the_configured_event_and_each_sleep_say_what_stays_held(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install()
        closing.append(groups := _single("keep"))
        groups.new_group([0], name="tp")
        held = 2 * (fake_nccl.SUSPENDABLE + fake_nccl.PERSISTENT)  # WORLD and tp; the side channel is gloo
        with capture_events("debug") as events:
            Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups)).sleep()
        configured = next(e for e in events if e["event"] == "lifecycle.configured")
        assert configured["communicators"] == "keep" and configured["communicators_held_bytes"] == held
        destroyed = next(e for e in events if e["event"] == "process_groups.destroyed")
        assert destroyed["way"] == "keep" and destroyed["bytes"] == 0 and destroyed["held_bytes"] == held
        assert fake_nccl.calls() == []  # nothing suspended


class TestSuspend:
    def test_suspend_keeps_the_groups_and_resume_hands_the_same_ones_back(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fakes = fake_nccl.install()
        closing.append(groups := _single("suspend"))
        handles = [groups.new_group([0], name=name) for name in ("tp", "dp", "pp")]
        before = [h.group for h in handles], dist.group.WORLD
        with capture_events("info") as events:
            groups.destroy()
        # WORLD first, then the rest in creation order: the same order on every rank.
        assert fake_nccl.calls("suspend") == ["WORLD", "tp", "dp", "pp"]
        assert groups.state == "suspended" and all(f.suspended for f in fakes.values())
        assert _sum(groups.side_channel) == 1.0  # gloo, never suspended
        (logged,) = [e for e in events if e["event"] == "process_groups.destroyed"]
        assert logged["way"] == "suspend" and logged["communicator_count"] == 4
        assert "communicators" not in logged  # a way's name, in lifecycle.configured; here the way is `way`
        assert logged["bytes"] == 4 * fake_nccl.SUSPENDABLE and logged["measured_by"] == "ncclCommMemStats"
        assert "communicators='suspend' (opt-in): fake NCCL" in logged["why"]
        groups.reload()
        assert fake_nccl.calls("resume") == ["WORLD", "tp", "dp", "pp"]
        assert ([h.group for h in handles], dist.group.WORLD) == before  # the same groups, not rebuilt
        assert all(h.generation == 1 for h in handles) and all(_sum(h.group) == 1.0 for h in handles)

    def test_a_collective_while_suspended_is_refused_with_a_typed_error(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install()
        closing.append(groups := _single("suspend"))
        tp = groups.new_group([0], name="tp")
        groups.destroy()
        with pytest.raises(
            ProcessGroupsAsleepError, match=r"process group tp is suspended by sleep.*unmapped"
        ):
            tp.group  # noqa: B018
        with pytest.raises(ProcessGroupsAsleepError, match=r"suspended \(asleep\)") as caught:
            groups.world  # noqa: B018
        assert caught.value.state == "suspended" and caught.value.operation == "world"

    def test_communicators_never_created_are_left_alone(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install(uncreated=["lazy"])
        closing.append(groups := _single("suspend"))
        lazy, used = groups.new_group([0], name="lazy"), groups.new_group([0], name="used")
        lazy_group = lazy.group
        groups.destroy()
        assert fake_nccl.calls("suspend") == ["WORLD", "used"]
        groups.reload()
        assert lazy.group is lazy_group and _sum(used.group) == 1.0

    def test_a_group_that_cannot_be_suspended_is_torn_down_rebuilt_and_said(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install(fail=["nvls"])
        closing.append(groups := _single("suspend"))
        tp, nvls = groups.new_group([0], name="tp"), groups.new_group([0], name="nvls")
        old_tp, old_nvls = tp.group, nvls.group
        with capture_events("warning") as events:
            groups.destroy()
        assert groups.state == "suspended"
        assert dist.distributed_c10d._world.pg_map.get(old_nvls) is None  # torn down
        (logged,) = [e for e in events if e["event"] == "process_groups.destroyed"]
        assert logged["level"] == "warning" and list(logged["fell_back"]) == ["nvls"]
        assert "injected for nvls" in logged["fell_back"]["nvls"]
        groups.reload()
        assert tp.group is old_tp and nvls.group is not old_nvls  # resumed; rebuilt
        assert _sum(nvls.group) == 1.0 and nvls.generation == tp.generation == 1
        assert groups.lost_groups == ()

    def test_where_world_cannot_be_suspended_the_whole_sleep_destroys(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install(fail=["WORLD"])
        closing.append(groups := _single("suspend"))
        tp = groups.new_group([0], name="tp")
        old_tp = tp.group
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
        with capture_events("warning") as events:
            machine.sleep()
        assert fake_nccl.calls("suspend") == ["WORLD"]  # nothing else was touched
        assert groups.state == "destroyed" and len(dist.distributed_c10d._world.pg_map) == 1  # gloo stand-in
        (logged,) = [e for e in events if e["event"] == "process_groups.destroyed"]
        assert logged["way"] == "destroy" and "rank 0: NcclError" in logged["fell_back"]["WORLD"]
        with pytest.raises(ProcessGroupsAsleepError, match="destroyed by sleep"):
            tp.group  # noqa: B018
        machine.wake_up()
        assert tp.group is not old_tp and _sum(tp.group) == 1.0 and groups.is_alive()

    def test_groups_of_others_that_fall_back_are_named_for_their_owner(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install(fail=["megatron_tp"])
        closing.append(groups := _single("suspend"))
        theirs = dist.new_group([0], group_desc="megatron_tp")  # made by someone else (Megatron)
        groups.destroy()
        assert groups.lost_groups == ("megatron_tp",)
        assert dist.distributed_c10d._world.pg_map.get(theirs) is None
        groups.reload()
        assert groups.lost_groups == ("megatron_tp",)  # until the next sleep: the owner rebuilds on wake

    def test_close_while_suspended_resumes_before_the_teardown(self, nccl_stand_in: None) -> None:
        fake_nccl.install()
        groups = _single("suspend")
        groups.new_group([0], name="tp")
        groups.destroy()
        groups.close()
        assert sorted(fake_nccl.calls("resume")) == ["WORLD", "tp"] and not dist.is_initialized()


# ---------------------------------------------------------------------------------- several ranks

CYCLES = 10
# name -> ranks; "pair" fails to suspend on rank 1 only, "lazy" has a communicator on rank 0 only.
GROUPS: dict[str, tuple[int, ...]] = {"pair": (0, 1), "odd": (1, 3), "lazy": (0, 2), "all": (0, 1, 2, 3)}


def _both(store: Store | None = None) -> ReloadableProcessGroups:
    """Configured to destroy, offering suspend too: a memory budget chooses per sleep."""
    assert not dist.is_initialized()
    return ReloadableProcessGroups.init(
        backend="gloo",
        rank=0,
        world_size=1,
        store=store or dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False),
        timeout=timedelta(seconds=10),
        communicators="destroy",
        ways=("destroy", "suspend"),
    )


class TestWaysPerSleep:
    def test_each_sleep_takes_the_way_it_is_told_and_its_wake_undoes_that_way(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install()
        closing.append(groups := _both())
        assert groups.communicators == "destroy" and groups.communicators_ways == ("destroy", "suspend")
        handles = [groups.new_group([0], name=name) for name in ("tp", "dp")]
        before = [h.group for h in handles]
        groups.use_communicators("suspend")
        groups.destroy()
        assert groups.state == "suspended" and fake_nccl.calls("suspend") == ["WORLD", "tp", "dp"]
        groups.reload()
        assert fake_nccl.calls("resume") == ["WORLD", "tp", "dp"]
        assert [h.group for h in handles] == before  # resumed, not rebuilt
        groups.use_communicators("destroy")
        groups.destroy()
        assert groups.state == "destroyed" and len(fake_nccl.calls("suspend")) == 3
        groups.reload()
        assert all(h.group is not old for h, old in zip(handles, before, strict=True))  # rebuilt
        assert all(_sum(h.group) == 1.0 for h in handles)

    def test_the_way_cannot_change_while_asleep_nor_to_one_not_offered(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        fake_nccl.install()
        closing.append(groups := _both())
        with pytest.raises(ValueError, match="offers"):
            groups.use_communicators("keep")
        groups.use_communicators("suspend")
        groups.destroy()
        with pytest.raises(ProcessGroupsAsleepError):
            groups.use_communicators("destroy")
        groups.use_communicators("suspend")  # the way it sleeps in: nothing to change
        groups.reload()
        assert fake_nccl.calls("resume") == ["WORLD"]

    def test_suspend_offered_where_nccl_cannot_suspend_is_refused_before_world_exists(self) -> None:
        with pytest.raises(ValueError, match=r"communicators='suspend' cannot work here"):
            _both()
        assert not dist.is_initialized()

    def test_one_way_offers_only_itself(self, closing: list[ReloadableProcessGroups]) -> None:
        closing.append(groups := _single("destroy"))
        assert groups.communicators_ways == ("destroy",)
        hooks = Hooks(memory=FakeMemorySaver(), process_groups=groups)
        assert hooks.communicators_ways == (Communicators.DESTROY,)

    def test_a_budgeted_sleep_that_chose_suspend_wakes_by_resume(
        self, closing: list[ReloadableProcessGroups], nccl_stand_in: None
    ) -> None:
        """The machine plans suspend (cheaper than destroy for the need), tells the groups, and the
        wake resumes the very communicators it suspended; `lifecycle check` finds nothing."""
        fake_nccl.install()
        closing.append(groups := _both())
        frees = iter([0, 6 << 30])  # free before the sleep; after it
        probe = DeviceMemoryProbe(free_bytes=lambda: next(frees))
        policy = LifecyclePolicy(memory_budget=MemoryBudget(margin_bytes=0))
        with capture_events() as events:
            machine = Lifecycle(policy, Hooks(memory=FakeMemorySaver(), process_groups=groups, budget=probe))
            assert machine._budget is not None
            est = machine._budget.estimates
            for way, freed, release_s, restore_s in (
                ("destroy", 8 << 30, 0.7, 0.5),
                ("suspend", 6 << 30, 0.2, 0.3),
            ):
                est.freed[(COMMUNICATORS, way)] = freed
                est.release_s[(COMMUNICATORS, way)], est.restore_s[(COMMUNICATORS, way)] = (
                    release_s,
                    restore_s,
                )
            machine.expect(5 << 30)
            machine.sleep()
            assert machine.groups is Groups.SUSPENDED and groups.state == "suspended"
            assert fake_nccl.calls("suspend") == ["WORLD"] and fake_nccl.calls("resume") == []
            machine.wake_up()
        assert fake_nccl.calls("resume") == ["WORLD"] and groups.is_alive() and machine.groups is Groups.ALIVE
        (plan,) = [e for e in events if e["event"] == "lifecycle.budget"]
        assert plan["plan"][COMMUNICATORS] == "suspend"
        lifecycle_lines = [json.dumps(e, default=str) for e in events if e["event"].startswith("lifecycle.")]
        assert list(check_lines(lifecycle_lines, "trainer.jsonl")) == []


def _ways_worker(rank: int, world_size: int, store: Store, way: str) -> dict[str, Any]:
    fakes = fake_nccl.install(fail=["pair"] if rank == 1 else [], uncreated=["lazy"] if rank == 2 else [])
    groups = ReloadableProcessGroups.init(
        backend="gloo",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=timedelta(seconds=30),
        communicators=way,
    )
    handles = {name: groups.new_group(list(ranks), name=name) for name, ranks in GROUPS.items()}
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
    out: dict[str, Any] = {"sums": [], "states": [], "same": [], "fell_back": None}
    with capture_events("info") as events:
        for _ in range(CYCLES):
            before = {name: h.group for name, h in handles.items()}
            machine.sleep()
            out["states"].append((machine.groups.value if machine.groups else None, groups.state))
            out["suspended"] = sorted(f.name for f in fakes.values() if f.suspended)
            machine.wake_up()
            out["same"].append(sorted(n for n, h in handles.items() if h.group is before[n]))
            out["sums"].append({n: _sum(h.group, rank + 1) for n, h in handles.items() if rank in h.ranks})
        destroyed = [e for e in events if e["event"] == "process_groups.destroyed"]
    out["fell_back"] = destroyed[0].get("fell_back") if destroyed else None
    out["suspend_calls"] = fake_nccl.calls("suspend")[: len(fake_nccl.calls("suspend")) // CYCLES]
    groups.close()
    return out


@pytest.fixture(scope="module")
def suspend_world() -> list[dict[str, Any]]:
    results = run_world(_ways_worker, 4, "suspend", deadline_s=120)
    no_crash(results)
    return results


class TestSuspendAcrossRanks:
    """4 ranks, 10 sleep/wake cycles through the machine, every rank suspending the same communicators."""

    def test_every_collective_is_correct_after_every_wake(self, suspend_world: list[dict[str, Any]]) -> None:
        for rank, res in enumerate(suspend_world):
            expected = {n: float(sum(r + 1 for r in ranks)) for n, ranks in GROUPS.items() if rank in ranks}
            assert res["sums"] == [expected] * CYCLES

    def test_the_machine_and_the_groups_say_suspended(self, suspend_world: list[dict[str, Any]]) -> None:
        for res in suspend_world:
            assert res["states"] == [["suspended", "suspended"]] * CYCLES

    def test_a_group_one_member_cannot_suspend_is_torn_down_on_every_member_and_rebuilt(
        self, suspend_world: list[dict[str, Any]]
    ) -> None:
        # "pair" failed on rank 1 only; rank 0 had suspended it, then tore it down too.
        assert "injected for pair" in suspend_world[1]["fell_back"]["pair"]
        assert suspend_world[0]["fell_back"]["pair"] == "torn down with its peers, which could not suspend it"
        for rank in GROUPS["pair"]:  # a new group; the others called new_group too (collective)
            assert all("pair" not in same for same in suspend_world[rank]["same"])

    def test_a_communicator_on_some_members_only_is_never_suspended(
        self, suspend_world: list[dict[str, Any]]
    ) -> None:
        # "lazy" exists on rank 0, not on rank 2: suspending it would wait on rank 2 forever.
        assert "lazy" not in suspend_world[0]["suspend_calls"]
        assert "not on the other members" in suspend_world[0]["fell_back"]["lazy"]
        assert all("lazy" not in same for same in suspend_world[0]["same"])

    def test_the_other_groups_come_back_as_the_same_objects(
        self, suspend_world: list[dict[str, Any]]
    ) -> None:
        for rank, res in enumerate(suspend_world):
            kept = {"odd", "all"} & {n for n, ranks in GROUPS.items() if rank in ranks}
            assert all(kept <= set(same) for same in res["same"]), (rank, res["same"])


def _keep_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    return _ways_worker(rank, world_size, store, "keep")


class TestKeepAcrossRanks:
    def test_keep_cycles_hand_back_every_group_and_collectives_stay_correct(self) -> None:
        results = run_world(_keep_worker, 4, deadline_s=90)
        no_crash(results)
        for rank, res in enumerate(results):
            mine = sorted(n for n, ranks in GROUPS.items() if rank in ranks)
            assert res["states"] == [["kept", "kept"]] * CYCLES
            assert res["same"] == [sorted(GROUPS)] * CYCLES  # non-members keep their sentinel too
            assert [sorted(s) for s in res["sums"]] == [mine] * CYCLES
            assert res["suspend_calls"] == []


def test_communicators_is_exported_from_the_core() -> None:
    assert Communicators("suspend") is Communicators.SUSPEND

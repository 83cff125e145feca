"""RegistryProcessGroups on real gloo ranks: a framework's registry torn down at once, in lockstep.

slime went serial because with pure PP=4, ranks destroying overlapping groups one at a time let rank
0 start the collective rebuild while another rank was still shutting down. Here four spawned gloo
ranks hold megatron-core's pure PP=4 groups (the embedding group shares ranks 0 and 3 with the
pipeline group) wrapped in a registry the way slime and miles wrap them, and cycle sleep/wake with
one rank arriving late to every teardown and every rebuild: no rank starts rebuilding before every
rank has torn down. gloo's teardown is not collective, so NCCL's hang itself cannot happen here;
slime's own module runs the same case in test_slime_source.py (outside CI).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)

CYCLES = 3


def _worker(rank: int, world_size: int, store: Any, late_rank: int, world: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.distributed.distributed_c10d import PrefixStore

    import actor_integration.frameworks.registry_groups as registry_groups
    from actor_integration.frameworks.registry_groups import RegistryProcessGroups

    worlds = [0]

    def new_world() -> None:
        worlds[0] += 1
        dist.init_process_group(
            "gloo", store=PrefixStore(f"world{worlds[0]}", store), rank=rank, world_size=world_size
        )

    class Wrapper:
        """A framework's reloadable wrapper: Megatron caches it, the reload puts a new group inside.

        As slime's and miles' patched `new_group` do, every call on every rank is wrapped (a rank
        outside a group holds torch's NON_GROUP_MEMBER), so every rank's registry has the same size.
        """

        def __init__(self, group: Any) -> None:
            self.group = group

    def build() -> list[Wrapper]:
        made: list[Any] = []
        new_group = dist.new_group

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            made.append(new_group(*args, **kwargs))
            return made[-1]

        dist.new_group = wrapped  # megatron-core's create_group calls torch.distributed.new_group
        try:
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=world_size
            )
        finally:
            dist.new_group = new_group
        return [Wrapper(group) for group in made]

    class FrameworkGroups(RegistryProcessGroups):
        framework = "test-framework"

        def wrappers(self) -> list[Any]:
            return registry

        def _tears_down_world(self) -> bool:
            return world  # slime: the accelerator WORLD goes down with the subgroups; miles: it stays

        def _after_world_destroyed(self) -> None:
            torn.append(time.time())
            new_world()  # the framework's stand-in WORLD while asleep

        def _reload(self) -> None:
            rebuilt.append(time.time())
            if world:
                dist.destroy_process_group()
                new_world()
            mpu.destroy_model_parallel()
            fresh = build()
            for wrapper, new in zip(registry, fresh, strict=True):
                wrapper.group = new.group

    torn: list[float] = []  # when this rank's teardown ended, per cycle
    rebuilt: list[float] = []  # when its rebuild began
    each_at_once = registry_groups.each_at_once

    def timed_teardown(fn: Any, items: list[Any]) -> None:  # the wrapped groups only (WORLD stays)
        each_at_once(fn, items)
        torn.append(time.time())

    registry_groups.each_at_once = timed_teardown
    new_world()
    registry = build()
    groups = FrameworkGroups(store=PrefixStore("meet", store), timeout=timedelta(seconds=30))
    embedding = dist.get_process_group_ranks(mpu._EMBEDDING_GROUP) if mpu._EMBEDDING_GROUP else None
    counts, sums = [], []
    for _ in range(CYCLES):
        if rank == late_rank:
            time.sleep(0.5)  # the others reach the teardown first, as in slime's report
        groups.destroy()
        alive_asleep = groups.is_alive()
        if rank == late_rank:
            time.sleep(0.5)  # ...and the rebuild first
        groups.reload()
        total = torch.ones(1)
        for wrapper in registry:  # a collective on every wrapped group after the wake
            if wrapper.group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.all_reduce(total, group=wrapper.group)
        sums.append(float(total))
        counts.append(len(dist.distributed_c10d._world.pg_map))
        assert not alive_asleep and groups.is_alive()
    return {"embedding": embedding, "counts": counts, "sums": sums, "torn": torn, "rebuilt": rebuilt}


class TestConcurrentRegistryTeardown:
    @pytest.mark.parametrize("world", [True, False], ids=["world-too", "subgroups-only"])
    def test_pure_pp4_with_a_late_rank_cycles_in_lockstep(self, world: bool) -> None:
        """Four ranks, overlapping PP=4 groups, one rank late to every teardown and rebuild: every cycle
        completes, no rebuild starts before every teardown ended, the group count stays flat, and every
        wrapped group carries a collective after the wake. With WORLD too (slime) or without (miles)."""
        results = run_world(_worker, 4, 3, world, deadline_s=120)
        no_crash(results)
        assert results[0]["embedding"] == [0, 3] and results[3]["embedding"] == [0, 3]
        for result in results:
            assert len(set(result["counts"])) == 1
            assert len(set(result["sums"])) == 1
        for cycle in range(CYCLES):  # every rank's teardown ended before any rank's rebuild began
            assert max(r["torn"][cycle] for r in results) <= min(r["rebuilt"][cycle] for r in results)

    def test_a_rank_that_never_comes_is_named(self) -> None:
        """A rank that skips the teardown: the others fail at the deadline naming it, not hang."""
        results = run_world(_missing_worker, 2, deadline_s=60)
        assert "crash" not in results[0], results[0]
        assert results[0]["missing"] == [1] and "rank 0 waited" in results[0]["message"]


def _missing_worker(rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from actor_integration.errors import RendezvousTimeoutError
    from actor_integration.frameworks.registry_groups import RegistryProcessGroups

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

    class FrameworkGroups(RegistryProcessGroups):
        def wrappers(self) -> list[Any]:
            return []

    groups = FrameworkGroups(timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)  # never reaches the teardown in time
        return {}
    try:
        groups.destroy()
    except RendezvousTimeoutError as exc:
        return {"missing": exc.missing, "message": str(exc)}
    pytest.fail("the teardown returned without rank 1")


# ---------------------------------------------------------------------------------- suspend and keep

FAILS = "EMBEDDING_GROUP"  # ranks 0 and 3 with PP=4; NCCL refuses to suspend it on rank 3 only


def _ways_worker(rank: int, world_size: int, store: Any, way: str, world: bool) -> dict[str, Any]:
    """A framework's registry (miles' shape: each wrapper keeps its new_group arguments, the reload
    rebuilds the wrappers that hold no group) over megatron-core's PP=4 groups, cycled through the
    machine with `communicators=way`; gloo groups stand in for NCCL ones (tests.helpers.fake_nccl)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.distributed.distributed_c10d import PrefixStore

    from actor_integration.frameworks.registry_groups import RegistryProcessGroups
    from lifecycle import Hooks, Lifecycle, LifecyclePolicy, capture_events
    from lifecycle.testing import FakeMemorySaver
    from tests.helpers import fake_nccl

    fakes = fake_nccl.install(fail=[FAILS] if rank == 3 else [])
    dist.init_process_group("gloo", store=PrefixStore("world", store), rank=rank, world_size=world_size)

    class Wrapper:
        def __init__(self, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.group, self.args, self.kwargs = group, args, kwargs

    registry: list[Wrapper] = []
    new_group = dist.new_group

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        registry.append(Wrapper(new_group(*args, **kwargs), args, kwargs))
        return registry[-1].group

    dist.new_group = wrapped  # megatron-core's create_group calls torch.distributed.new_group
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world_size)
    finally:
        dist.new_group = new_group
    reloads: list[int] = []  # per framework reload: how many wrappers it rebuilt

    class FrameworkGroups(RegistryProcessGroups):
        framework = "test-framework"

        def wrappers(self) -> list[Any]:
            return registry

        def _tears_down_world(self) -> bool:
            return world

        def _reload(self) -> None:
            empty = [w for w in registry if w.group is None]
            reloads.append(len(empty))
            for wrapper in empty:
                wrapper.group = new_group(*wrapper.args, **wrapper.kwargs)

    groups = FrameworkGroups(
        store=PrefixStore("meet", store), timeout=timedelta(seconds=30), communicators=way
    )
    machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
    out: dict[str, Any] = {
        "states": [],
        "hidden": [],
        "world_asleep": [],
        "same": [],
        "sums": [],
        "counts": [],
    }
    with capture_events("debug") as events:
        for _ in range(CYCLES):
            before = [w.group for w in registry]
            machine.sleep()
            out["states"].append(machine.groups.value if machine.groups else None)
            out["hidden"].append(all(w.group is None for w in registry) and not groups.is_alive())
            out["world_asleep"].append(any(f.name == "WORLD" and f.suspended for f in fakes.values()))
            machine.wake_up()
            out["same"].append([w.group is old for w, old in zip(registry, before, strict=True)])
            total = torch.ones(1)
            for wrapper in registry:
                if wrapper.group is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.all_reduce(total, group=wrapper.group)
            out["sums"].append(float(total))
            out["counts"].append(len(dist.distributed_c10d._world.pg_map))
    logged = [e for e in events if e["event"] in ("process_groups.destroyed", "process_groups.reloaded")]
    out["events"] = [
        {k: e.get(k) for k in ("event", "way", "communicator_count", "fell_back")} for e in logged
    ]
    out["descs"] = [
        str(w.group.group_desc) if w.group is not dist.GroupMember.NON_GROUP_MEMBER else None
        for w in registry
    ]
    out["reloads"] = reloads
    out["suspend_calls"] = fake_nccl.calls("suspend")
    out["alive"] = groups.is_alive()
    return out


class TestSuspendAndKeep:
    """communicators="suspend" and "keep" on a registry: four gloo ranks, megatron-core's PP=4 groups
    wrapped as miles wraps them, CYCLES sleep/wake cycles through the machine."""

    @pytest.mark.parametrize("world", [True, False], ids=["world-too", "subgroups-only"])
    def test_keep_hands_every_wrapper_its_own_group_back(self, world: bool) -> None:
        results = run_world(_ways_worker, 4, "keep", world, deadline_s=120)
        no_crash(results)
        for result in results:
            assert result["states"] == ["kept"] * CYCLES and result["hidden"] == [True] * CYCLES
            assert all(all(same) for same in result["same"]) and result["reloads"] == []
            assert len(set(result["counts"])) == 1 and len(set(result["sums"])) == 1 and result["alive"]
            assert result["suspend_calls"] == [] and result["world_asleep"] == [False] * CYCLES
            assert {e["way"] for e in result["events"]} == {"keep"}

    @pytest.mark.parametrize("world", [True, False], ids=["world-too", "subgroups-only"])
    def test_suspend_resumes_the_same_groups_and_rebuilds_the_one_that_fell_back(self, world: bool) -> None:
        results = run_world(_ways_worker, 4, "suspend", world, deadline_s=120)
        no_crash(results)
        for rank, result in enumerate(results):
            assert result["states"] == ["suspended"] * CYCLES and result["hidden"] == [True] * CYCLES
            # The members get a new group for the one that fell back and the same ones for the rest; the
            # others keep torch's NON_GROUP_MEMBER, but rebuild it too (new_group is collective).
            failed = [i for i, desc in enumerate(result["descs"]) if desc == FAILS]
            assert len(failed) == (1 if rank in (0, 3) else 0)
            assert [[i for i, kept in enumerate(same) if not kept] for same in result["same"]] == [
                failed
            ] * CYCLES
            assert result["reloads"] == [1] * CYCLES  # the framework's reload rebuilt only that one
            assert len(set(result["counts"])) == 1 and len(set(result["sums"])) == 1 and result["alive"]
            # WORLD goes to sleep too where the framework's teardown takes it (slime), first on every rank.
            assert (result["suspend_calls"][0] == "WORLD") is world
            assert result["world_asleep"] == [world] * CYCLES
            destroyed = [e for e in result["events"] if e["event"] == "process_groups.destroyed"]
            assert {e["way"] for e in destroyed} == {"suspend"} and destroyed[0]["communicator_count"] > 0
        assert "injected for EMBEDDING_GROUP" in results[3]["events"][0]["fell_back"][FAILS]
        assert (
            results[0]["events"][0]["fell_back"][FAILS]
            == "torn down with its peers, which could not suspend it"
        )

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

from tests.helpers.spawn import no_crash, run_world

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

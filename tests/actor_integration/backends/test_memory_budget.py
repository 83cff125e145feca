"""`DeviceMemoryProbe`: the budget's inputs agreed over ranks through a torch.distributed store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import HashStore

from actor_integration.backends.memory_budget import DeviceMemoryProbe
from actor_integration.errors import RendezvousTimeoutError
from lifecycle.budget import BudgetInputs, Releasable, plan_releases

GIB = 1 << 30


def inputs(free: int) -> BudgetInputs:
    items = (Releasable.tag("weights", 2 * GIB, 0.1), Releasable.tag("optimizer", 6 * GIB, 0.3))
    return BudgetInputs(need_bytes=6 * GIB, free_bytes=free, margin_bytes=0, items=items)


class TestDeviceMemoryProbe:
    def test_ranks_with_different_free_memory_agree_on_one_plan(self) -> None:
        """Three ranks, one with less free memory, over three rounds: every rank gets the same reduced
        inputs each round, so each plan is the one the least free rank needs."""
        store = HashStore()
        probes = [DeviceMemoryProbe(store=store, rank=r, world_size=3) for r in range(3)]
        frees = [5 * GIB, 1 * GIB, 5 * GIB]
        results: dict[int, list[BudgetInputs]] = {r: [] for r in range(3)}

        def rank(r: int) -> None:
            for _ in range(3):
                results[r].append(probes[r].agree(inputs(frees[r])))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert all(len(v) == 3 for v in results.values())
        assert results[0] == results[1] == results[2]
        assert {a.free_bytes for a in results[0]} == {1 * GIB}
        assert plan_releases(results[0][0]).released == ("optimizer",)

    def test_one_rank_plans_alone(self) -> None:
        """world_size 1: the inputs as given, no store needed."""
        probe = DeviceMemoryProbe(free_bytes=lambda: 7)
        assert probe.agree(inputs(GIB)) == inputs(GIB) and probe.free_bytes() == 7

    def test_several_ranks_without_a_store_are_refused(self) -> None:
        """Ranks that cannot agree could tear down communicators the others keep."""
        with pytest.raises(ValueError, match="needs a store"):
            DeviceMemoryProbe(world_size=2)

    def test_a_rank_that_never_posts_is_named_in_a_typed_timeout(self) -> None:
        """Rank 1 never reaches the agreement: rank 0 gives up at its deadline naming rank 1."""
        probe = DeviceMemoryProbe(store=HashStore(), rank=0, world_size=2, timeout=timedelta(seconds=0.5))
        with pytest.raises(RendezvousTimeoutError, match=r"for ranks \[1\]") as caught:
            probe.agree(inputs(GIB))
        assert caught.value.missing == (1,) and caught.value.what == "memory budget round 0"

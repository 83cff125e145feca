"""`RL_LIFECYCLE_MEMORY_BUDGET=rollout`: a slime trainer's sleep frees only what the colocated engines need.

The parsing and the need here; the ranks agreeing over the default group's store, across a re-created
WORLD as slime's reloadable WORLD re-creates it, on two real gloo ranks. The whole actor under the
budget, on slime's own source: tests/actor_integration/frameworks/slime/test_slime_source.py
(`TestMemoryBudget`).
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.slime.budget import (
    BUDGET_VARIABLE,
    budget_mode,
    check_budget,
    rollout_need_bytes,
)
from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)

GIB = 1 << 30


class TestTheVariable:
    def test_unset_or_empty_is_off(self) -> None:
        assert budget_mode({}) == "off"
        assert budget_mode({BUDGET_VARIABLE: " "}) == "off"

    def test_rollout_and_off_in_any_case(self) -> None:
        assert budget_mode({BUDGET_VARIABLE: " Rollout "}) == "rollout"
        assert budget_mode({BUDGET_VARIABLE: "OFF"}) == "off"

    def test_another_value_is_refused_saying_what_to_use(self) -> None:
        with pytest.raises(
            LaunchConfigError, match=r"RL_LIFECYCLE_MEMORY_BUDGET='on': use 'rollout'"
        ) as caught:
            budget_mode({BUDGET_VARIABLE: "on"})
        assert caught.value.fields == {"variable": BUDGET_VARIABLE}


class TestTheLaunchCheck:
    """What the launch switch runs before any GPU work (`FrameworkLaunch.memory_budget`)."""

    def test_off_says_nothing(self) -> None:
        assert (
            check_budget({}) is None and check_budget({BUDGET_VARIABLE: "off"}, argparse.Namespace()) is None
        )

    def test_the_value_alone_at_install(self) -> None:
        assert check_budget({BUDGET_VARIABLE: "rollout"}) == f"{BUDGET_VARIABLE}=rollout"
        with pytest.raises(LaunchConfigError, match="use 'rollout'"):
            check_budget({BUDGET_VARIABLE: "yes"})

    def test_the_flags_before_the_engines(self) -> None:
        args = argparse.Namespace(colocate=True, sglang_mem_fraction_static=0.4)
        assert "leaves 0.4 of its GPU free" in (check_budget({BUDGET_VARIABLE: "rollout"}, args) or "")
        with pytest.raises(LaunchConfigError, match="no --colocate"):
            check_budget({BUDGET_VARIABLE: "rollout"}, argparse.Namespace(sglang_mem_fraction_static=0.4))


class TestTheNeed:
    def test_the_engines_fraction_of_the_device(self) -> None:
        args = argparse.Namespace(colocate=True, sglang_mem_fraction_static=0.4)
        assert rollout_need_bytes(args, 80 * GIB) == int(0.4 * 80 * GIB)

    def test_refused_without_colocate(self) -> None:
        args = argparse.Namespace(colocate=False, sglang_mem_fraction_static=0.4)
        with pytest.raises(LaunchConfigError, match="no --colocate"):
            rollout_need_bytes(args, 80 * GIB)

    def test_refused_without_the_engines_fraction(self) -> None:
        args = argparse.Namespace(colocate=True, sglang_mem_fraction_static=None)
        with pytest.raises(LaunchConfigError, match="pass --sglang-mem-fraction-static"):
            rollout_need_bytes(args, 80 * GIB)

    @pytest.mark.parametrize("fraction", [0, 1.5, -0.1])
    def test_refused_outside_zero_to_one(self, fraction: float) -> None:
        args = argparse.Namespace(colocate=True, sglang_mem_fraction_static=fraction)
        with pytest.raises(LaunchConfigError, match=r"must be in \(0, 1\]"):
            rollout_need_bytes(args, 80 * GIB)


def _agree_across_generations(rank: int, world_size: int, store: Any) -> dict[str, Any]:
    """Two budget rounds, WORLD destroyed and re-created in between over a new prefix of the same
    rendezvous store (what slime's reloadable WORLD does); the probe looks the store up each time."""
    from datetime import timedelta

    import torch.distributed as dist

    from actor_integration.backends.memory_budget import DefaultStore, DeviceMemoryProbe
    from lifecycle.budget import BudgetInputs, Releasable

    def world(generation: int) -> None:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"world-{generation}", store), rank=rank, world_size=world_size
        )

    free = (10 + rank) * GIB  # rank 0 has the least free
    probe = DeviceMemoryProbe(
        free_bytes=lambda: free,
        store=DefaultStore(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    inputs = BudgetInputs(
        need_bytes=(4 + rank) * GIB,
        free_bytes=free,
        margin_bytes=GIB,
        items=(Releasable.tag("*", (1 + rank) * GIB, 0.1),),
    )
    agreed = []
    for generation in (1, 2):
        world(generation)
        agreed.append(probe.agree(inputs).to_dict())
        dist.destroy_process_group()
    return {"agreed": agreed}


def test_ranks_agree_over_the_default_store_across_a_recreated_world() -> None:
    results = run_world(_agree_across_generations, 2, deadline_s=60)
    no_crash(results)
    rank0, rank1 = (r["agreed"] for r in results)
    assert rank0 == rank1  # one plan's inputs on every rank, in both generations
    for agreed in rank0:
        assert agreed["free_bytes"] == 10 * GIB  # the least free
        assert agreed["need_bytes"] == 5 * GIB  # the largest need

"""The transition table is consistent data: guards never overlap, every edge is reachable."""

import itertools
from typing import ClassVar

import pytest

from lifecycle.policy import LifecyclePolicy
from lifecycle.table import (
    EDGES,
    OPERATIONS,
    PLANS,
    SLEEP,
    TABLE,
    Call,
    Groups,
    Hook,
    Residency,
    State,
    deferred_tags,
    plan_calls,
    row_applies,
    row_edges,
    rows_for,
    select_row,
    unheld_residency,
)

R, X = Residency.RESIDENT, Residency.RELEASED


def policies():
    for offload, auto_wake, sync_req in itertools.product((False, True), (False, True), ((), ("weights",))):
        if offload and not auto_wake:
            continue
        yield LifecyclePolicy(
            offload_train=offload,
            auto_wake=auto_wake,
            memory_tags=("weights", "kv_cache"),
            sync_requires=sync_req,
        ).view()


MEMORIES = [{"weights": a, "kv_cache": b} for a in (R, X) for b in (R, X)]
TARGETS = [("weights", "kv_cache"), ("weights",), ("kv_cache",)]


class TestRows:
    def test_at_most_one_row_matches(self):
        """For every operation, state, policy, residency, targets and number of holds, at most one row applies."""
        for op, state, policy, memory, targets, recover, holds in itertools.product(
            OPERATIONS, State, list(policies()), MEMORIES, TARGETS, (State.AWAKE, State.PAUSED), (0, 1, 2)
        ):
            matching = [
                r
                for r in rows_for(op, state)
                if row_applies(r, policy, memory, targets, recover, None, holds)
            ]
            assert len(matching) <= 1, (op, state, policy, memory, targets, holds, matching)

    def test_sleep_and_wake_are_total_from_awake_and_paused(self):
        """sleep, wake_up and hold are accepted from AWAKE and PAUSED whatever the residency, held or not."""
        for op, policy, memory, targets, holds in itertools.product(
            ("sleep", "wake_up", "hold"), policies(), MEMORIES, TARGETS, (0, 1)
        ):
            for state in (State.AWAKE, State.PAUSED):
                if state is State.AWAKE and memory != {"weights": R, "kv_cache": R}:
                    continue  # AWAKE means everything resident
                assert select_row(op, state, policy, memory, targets, holds=holds) is not None, (
                    op,
                    state,
                    memory,
                    targets,
                    holds,
                )

    def test_nothing_but_recover_leaves_failed(self):
        """FAILED has rows for recover and for giving a hold back only; SAVING and SYNCING have none."""
        assert {r.operation for r in TABLE if r.source is State.FAILED} == {"recover", "release"}
        assert all(
            r.dest is State.FAILED for r in TABLE if r.source is State.FAILED and r.operation != "recover"
        )
        assert not [r for r in TABLE if r.source in (State.SAVING, State.SYNCING)]

    def test_bodies_that_leave_their_state_come_back(self):
        """Every body row that enters SAVING or SYNCING returns to the state it came from, or stays
        AWAKE inside a held scope."""
        for row in TABLE:
            if row.body_state in (State.SAVING, State.SYNCING):
                assert row.dest is row.source or (row.held and row.dest is State.AWAKE), row

    def test_every_edge_is_derived_from_a_row(self):
        """EDGES is exactly the union of the rows' edges, and every state but SAVING/SYNCING is a source."""
        derived = {e for row in TABLE for e in row_edges(row)}
        assert derived == set(EDGES)
        assert {e.source for e in EDGES} | {e.dest for e in EDGES} >= set(State) - {State.FAILED}

    def test_no_held_row_pauses_memory_but_the_last_release(self):
        """Inside a held scope only the release of the last hold runs the sleep plan (recover aside)."""
        for row in TABLE:
            if row.held and row.operation != "release":
                assert SLEEP not in (row.enter, row.exit), row
        for op, state in {
            (r.operation, r.source) for r in TABLE if r.operation not in ("recover", "release")
        }:
            for policy, memory, targets in itertools.product(policies(), MEMORIES, TARGETS):
                row = select_row(op, state, policy, memory, targets, holds=1)
                assert row is None or SLEEP not in (row.enter, row.exit), (op, state, row)

    def test_a_release_needs_a_hold(self):
        view = next(policies())
        everything = {"weights": R, "kv_cache": R}
        assert select_row("release", State.AWAKE, view, everything, ("weights",), holds=0) is None
        assert select_row("release", State.AWAKE, view, everything, ("weights",), holds=2).noop
        assert select_row("release", State.AWAKE, view, everything, (), holds=1).noop
        assert select_row("release", State.AWAKE, view, everything, ("weights",), holds=1).enter is SLEEP

    def test_every_plan_is_used(self):
        used = {p for row in TABLE for p in (row.enter, row.exit) if p}
        assert used == set(PLANS)


class TestPlanCalls:
    view = LifecyclePolicy(use_routing_replay=True, memory_tags=("weights", "kv_cache")).view()
    everything = frozenset(Hook)

    def test_sleep_order(self):
        """sleep: generation pause, routing replay clear, clear memory, groups destroy, pause per tag in
        order, then the memory budget's check."""
        sleep = next(p for p in PLANS if p.name == "sleep")
        calls = plan_calls(
            sleep, self.view, {"weights": R, "kv_cache": R}, Groups.ALIVE, TARGETS[0], self.everything
        )
        assert calls == [
            Call(Hook.GENERATION_PAUSE),
            Call(Hook.ROUTING_REPLAY_CLEAR),
            Call(Hook.CLEAR_MEMORY),
            Call(Hook.PROCESS_GROUPS_DESTROY),
            Call(Hook.MEMORY_PAUSE, "weights"),
            Call(Hook.MEMORY_PAUSE, "kv_cache"),
            Call(Hook.BUDGET_CHECK),
        ]

    def test_wake_order_skips_resident_tags(self):
        """wake: resume only released targeted tags and reload groups (one stage), restore tag, resume generation."""
        wake = next(p for p in PLANS if p.name == "wake")
        calls = plan_calls(
            wake, self.view, {"weights": R, "kv_cache": X}, Groups.DESTROYED, TARGETS[0], self.everything
        )
        assert calls == [
            Call(Hook.MEMORY_RESUME, "kv_cache"),
            Call(Hook.PROCESS_GROUPS_RELOAD),
            Call(Hook.SWITCH_MODEL),
            Call(Hook.GENERATION_RESUME),
        ]

    @pytest.mark.parametrize(
        ("field", "hook"),
        [
            ("use_routing_replay", Hook.ROUTING_REPLAY_CLEAR),
            ("destroy_process_groups", Hook.PROCESS_GROUPS_DESTROY),
        ],
    )
    def test_policy_switches_steps_off(self, field, hook):
        sleep = next(p for p in PLANS if p.name == "sleep")
        view = LifecyclePolicy(**{field: False}, memory_tags=("weights",)).view()
        calls = plan_calls(sleep, view, {"weights": R}, Groups.ALIVE, ("weights",), self.everything)
        assert hook not in [c.hook for c in calls]

    def test_missing_hook_slots_are_skipped(self):
        """A slot the actor did not supply is never called; memory always is."""
        sleep = next(p for p in PLANS if p.name == "sleep")
        calls = plan_calls(sleep, self.view, {"weights": R, "kv_cache": R}, None, TARGETS[0], frozenset())
        assert [c.hook for c in calls] == [Hook.MEMORY_PAUSE, Hook.MEMORY_PAUSE]


class TestUnheldReplay:
    """`unheld_residency` replays a call on the rows outside a scope; `deferred_tags` is what the scope owes."""

    view = LifecyclePolicy(offload_train=True, memory_tags=("weights", "kv_cache")).view()
    awake: ClassVar[dict[str, Residency]] = {"weights": R, "kv_cache": R}

    def test_a_sleep_releases_its_targets(self):
        assert unheld_residency("sleep", ("kv_cache",), self.view, self.awake) == {
            "weights": R,
            "kv_cache": X,
        }

    def test_an_offloaded_train_step_ends_released(self):
        after = unheld_residency("train", ("weights", "kv_cache"), self.view, {"weights": R, "kv_cache": X})
        assert after == {"weights": X, "kv_cache": X}

    def test_a_wake_brings_its_targets_back(self):
        asleep = {"weights": X, "kv_cache": X}
        assert unheld_residency("wake_up", ("weights",), self.view, asleep) == {"weights": R, "kv_cache": X}

    def test_a_call_refused_outside_a_scope_changes_nothing(self):
        asleep = {"weights": X, "kv_cache": X}
        assert unheld_residency("generate", ("weights", "kv_cache"), self.view, asleep) == asleep

    def test_deferred_tags_are_resident_here_and_released_there(self):
        assert deferred_tags(self.awake, {"weights": X, "kv_cache": R}) == ("weights",)
        assert deferred_tags({"weights": X, "kv_cache": R}, {"weights": X, "kv_cache": X}) == ("kv_cache",)
        assert deferred_tags(self.awake, None) == ()

"""The transition table is consistent data: guards never overlap, every edge is reachable."""

import itertools

import pytest

from lifecycle.policy import LifecyclePolicy
from lifecycle.table import (
    EDGES,
    OPERATIONS,
    PLANS,
    TABLE,
    Call,
    Groups,
    Hook,
    Residency,
    State,
    guard_holds,
    plan_calls,
    row_edges,
    rows_for,
    select_row,
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
        """For every operation, state, policy, residency and targets, the guards pick at most one row."""
        for op, state, policy, memory, targets, recover in itertools.product(
            OPERATIONS, State, list(policies()), MEMORIES, TARGETS, (State.AWAKE, State.PAUSED)
        ):
            matching = [
                r for r in rows_for(op, state) if guard_holds(r.when, policy, memory, targets, recover)
            ]
            assert len(matching) <= 1, (op, state, policy, memory, targets, matching)

    def test_sleep_and_wake_are_total_from_awake_and_paused(self):
        """sleep and wake_up are accepted from AWAKE and PAUSED whatever the residency (idempotence)."""
        for op, policy, memory, targets in itertools.product(
            ("sleep", "wake_up"), policies(), MEMORIES, TARGETS
        ):
            for state in (State.AWAKE, State.PAUSED):
                if state is State.AWAKE and memory != {"weights": R, "kv_cache": R}:
                    continue  # AWAKE means everything resident
                assert select_row(op, state, policy, memory, targets) is not None, (
                    op,
                    state,
                    memory,
                    targets,
                )

    def test_nothing_but_recover_leaves_failed(self):
        """FAILED has rows for recover only; SAVING and SYNCING have none (their bodies own the lock)."""
        assert {r.operation for r in TABLE if r.source is State.FAILED} == {"recover"}
        assert not [r for r in TABLE if r.source in (State.SAVING, State.SYNCING)]

    def test_bodies_that_leave_their_state_come_back(self):
        """Every body row that enters SAVING or SYNCING returns to the state it came from."""
        for row in TABLE:
            if row.body_state in (State.SAVING, State.SYNCING):
                assert row.dest is row.source, row

    def test_every_edge_is_derived_from_a_row(self):
        """EDGES is exactly the union of the rows' edges, and every state but SAVING/SYNCING is a source."""
        derived = {e for row in TABLE for e in row_edges(row)}
        assert derived == set(EDGES)
        assert {e.source for e in EDGES} | {e.dest for e in EDGES} >= set(State) - {State.FAILED}

    def test_every_plan_is_used(self):
        used = {p for row in TABLE for p in (row.enter, row.exit) if p}
        assert used == set(PLANS)


class TestPlanCalls:
    view = LifecyclePolicy(use_routing_replay=True, memory_tags=("weights", "kv_cache")).view()
    everything = frozenset(Hook)

    def test_sleep_order(self):
        """sleep: generation pause, routing replay clear, clear memory, groups destroy, pause per tag in order."""
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

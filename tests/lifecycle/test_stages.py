"""Hooks a plan declares independent run together: each logged on its own, failures recorded."""

import threading

import pytest

from lifecycle import (
    Hooks,
    IllegalTransitionError,
    Lifecycle,
    LifecyclePolicy,
    Residency,
    State,
    capture_events,
)
from lifecycle.table import PLANS, Hook
from lifecycle.testing import FakeMemorySaver, FakeProcessGroups, InjectedFault, recording_lifecycle
from tests.helpers.tms import BatchMemory

PATIENCE_S = 10.0  # only a hang would use it up


def handshake_hooks(overlap: bool, *, patience_s: float | None = None) -> tuple[Lifecycle, threading.Event]:
    """A machine whose group teardown waits for the memory pause to start: it completes only when
    the two run together."""
    started = threading.Event()
    memory = FakeMemorySaver(may_overlap_process_groups=overlap)
    groups = FakeProcessGroups()
    pause, destroy = memory.pause, groups.destroy

    def pausing(tag=None):
        started.set()
        pause(tag)

    def destroying():
        if not started.wait(patience_s if patience_s is not None else PATIENCE_S if overlap else 0.05):
            raise TimeoutError("the memory pause never started while the groups were torn down")
        destroy()

    memory.pause, groups.destroy = pausing, destroying
    return Lifecycle(LifecyclePolicy(model_tag=None), Hooks(memory=memory, process_groups=groups)), started


class TestTogether:
    def test_the_table_declares_teardown_and_pause_together(self):
        """Sleep runs the group teardown with the memory pause; wake the rebuild with the resume."""
        stages = {p.name: p.stages for p in PLANS}
        assert (Hook.PROCESS_GROUPS_DESTROY, Hook.MEMORY_PAUSE) in stages["sleep"]
        assert (Hook.MEMORY_RESUME, Hook.PROCESS_GROUPS_RELOAD) in stages["wake"]

    def test_teardown_and_pause_run_at_the_same_time(self):
        """The teardown sees the pause start while it is still running: two threads, one stage."""
        lc, started = handshake_hooks(overlap=True)
        lc.sleep()
        assert started.is_set() and lc.state is State.PAUSED and lc.residency == {"*": Residency.RELEASED}

    def test_a_backend_that_may_not_overlap_runs_them_in_plan_order(self):
        """Without the memory backend's consent the teardown runs first and alone (TMS preload mode)."""
        lc, _ = handshake_hooks(overlap=False)
        with pytest.raises(TimeoutError, match="never started"):
            lc.sleep()
        assert lc.state is State.FAILED and lc.residency == {"*": Residency.RESIDENT}

    def test_the_policy_can_turn_it_off(self):
        """overlap_hooks=False runs every plan in order even where the backend allows more."""
        off, _ = handshake_hooks(overlap=True, patience_s=0.05)
        off = Lifecycle(LifecyclePolicy(model_tag=None, overlap_hooks=False), off.hooks)
        with pytest.raises(TimeoutError, match="never started"):
            off.sleep()

    def test_each_hook_logs_its_own_start_and_duration(self):
        """Hooks of one stage log where they started (at_ms) and took (ms); they overlap in time."""
        lc, _ = recording_lifecycle(LifecyclePolicy(use_routing_replay=True), overlap=True)
        with capture_events() as events:
            lc.sleep()
        (transition,) = [e for e in events if e["event"] == "lifecycle.transition"]
        hooks = {h["name"]: h for h in transition["hooks"]}
        assert list(hooks) == [
            "routing_replay.clear",
            "clear_memory",
            "process_groups.destroy",
            "memory.pause",
        ]
        assert all(h["ok"] and h["at_ms"] >= 0 and h["ms"] >= 0 for h in hooks.values())
        clear, destroy = hooks["clear_memory"], hooks["process_groups.destroy"]
        assert destroy["at_ms"] >= clear["at_ms"] + clear["ms"] - 1e-3  # stages run one after another

    def test_both_branches_failing_record_both(self):
        """Two hooks of one stage raise: both are unknown, the first in plan order is the failure."""
        lc, rec = recording_lifecycle(LifecyclePolicy(model_tag=None), overlap=True)
        rec.faults.arm(Hook.PROCESS_GROUPS_DESTROY)
        rec.faults.arm(Hook.MEMORY_PAUSE, after_effect=True)
        with pytest.raises(InjectedFault, match=r"process_groups\.destroy"):
            lc.sleep()
        assert lc.failure is not None and lc.failure.hook == "process_groups.destroy"
        assert [(h["name"], h["ok"]) for h in lc.failure.hooks] == [
            ("clear_memory", True),
            ("process_groups.destroy", False),
            ("memory.pause", False),
        ]
        assert lc.residency == {"*": Residency.UNKNOWN} and lc.groups is not None
        lc.recover(State.PAUSED)  # asks both backends, re-runs only the teardown
        assert rec.memory.pause_count == 1 and rec.process_groups.destroy_count == 1

    def test_a_hook_on_the_pool_calling_back_is_refused_not_deadlocked(self):
        """A hook running on the hook pool that calls the machine gets a refusal, never a hang."""
        memory = FakeMemorySaver(may_overlap_process_groups=True)
        groups = FakeProcessGroups()
        holder = {}
        refusals = []
        pause = memory.pause

        def calling_back(tag=None):
            try:
                holder["lc"].wake_up()
            except IllegalTransitionError as exc:
                refusals.append(exc)
            pause(tag)

        memory.pause = calling_back
        lc = holder["lc"] = Lifecycle(
            LifecyclePolicy(model_tag=None), Hooks(memory=memory, process_groups=groups)
        )
        done = threading.Thread(target=lc.sleep, daemon=True)
        done.start()
        done.join(PATIENCE_S)
        assert not done.is_alive(), "the machine deadlocked on a hook calling back from the hook pool"
        assert len(refusals) == 1 and lc.state is State.PAUSED


ROLLOUT_TAGS = ("weights", "kv_cache", "cuda_graph")


def rollout_policy() -> LifecyclePolicy:
    return LifecyclePolicy(
        memory_tags=ROLLOUT_TAGS,
        sync_requires=("weights",),
        discard_on_release=ROLLOUT_TAGS,
        model_tag=None,
        destroy_process_groups=False,
    )


class TestBatchedTags:
    def test_a_stage_s_tags_go_to_a_batch_backend_in_one_call_and_log_one_entry_each(self):
        """The sleep's three pauses are one `pause_tags`; the partial wake one tag (its own call,
        `pause`/`resume` of one tag); the rest of the wake one `resume_tags`. The log still has one
        hook entry per tag, and `lifecycle check` replays it clean."""
        from lifecycle import checker

        memory = BatchMemory()
        with capture_events() as events:
            lc = Lifecycle(rollout_policy(), Hooks(memory=memory), role="rollout", rank=0)
            lc.sleep()
            lc.wake_up(["weights"])
            lc.wake_up()
        assert memory.batches == [("pause", ROLLOUT_TAGS), ("resume", ("kv_cache", "cuda_graph"))]
        transitions = [e for e in events if e["event"] == "lifecycle.transition"]
        assert len(transitions) == 3
        assert [[(h["name"], h.get("tag")) for h in t["hooks"]] for t in transitions] == [
            [("memory.pause", tag) for tag in ROLLOUT_TAGS],
            [("memory.resume", "weights")],
            [("memory.resume", "kv_cache"), ("memory.resume", "cuda_graph")],
        ]
        first, *rest = transitions[0]["hooks"]
        assert all(h["ms"] == 0.0 and h["at_ms"] >= first["at_ms"] for h in rest)
        assert lc.residency == dict.fromkeys(ROLLOUT_TAGS, Residency.RESIDENT)
        import json

        lines = [
            json.dumps({k: (v.value if hasattr(v, "value") else v) for k, v in e.items()}, default=str)
            for e in events
        ]
        assert checker.check_lines(lines) == []

    def test_a_failed_batch_fails_at_its_first_tag(self):
        """As one call per tag would: the first tag failed, the later ones not reached."""
        memory = BatchMemory(fail=True)
        lc = Lifecycle(rollout_policy(), Hooks(memory=memory), role="rollout", rank=0)
        with pytest.raises(RuntimeError, match="refused the release"):
            lc.sleep()
        assert lc.failure is not None and lc.failure.tag == "weights"
        assert [(h["name"], h.get("tag"), h["ok"]) for h in lc.failure.hooks] == [
            ("memory.pause", "weights", False)
        ]

    def test_a_backend_without_batches_gets_one_call_per_tag(self):
        lc, rec = recording_lifecycle(rollout_policy())
        lc.sleep()
        assert rec.memory.pause_count == 3

"""Held scopes (`Lifecycle.held()`, `hold()`/`release()`): the sleeps inside are deferred to the release of
the last hold, which runs one sleep of the tags the same calls would have left released without the scope."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import (
    Hooks,
    IllegalTransitionError,
    Lifecycle,
    LifecycleFailedError,
    LifecyclePolicy,
    Residency,
    State,
    capture_events,
)
from lifecycle.table import Groups, Hook
from lifecycle.testing import FakeMemorySaver, InjectedFault, Recorders, recording_lifecycle
from tests.helpers.bodies import make_body

R, X = Residency.RESIDENT, Residency.RELEASED
TAGS = ("weights", "kv_cache")
OFFLOAD = LifecyclePolicy(offload_train=True, use_routing_replay=True)
ROLLOUT = LifecyclePolicy(memory_tags=TAGS, model_tag=None)


def run(lc: Lifecycle, rec: Recorders, operation: str) -> Any:
    return lc.run(operation, make_body(rec, lc, operation))


def cycles(rec: Recorders) -> dict[str, int]:
    """How many of each resource call the backends saw."""
    return {
        name: rec.log.count(name)
        for name in ("memory.resume", "memory.pause", "process_groups.reload", "process_groups.destroy")
    }


def reef_202_step(lc: Lifecycle, rec: Recorders) -> None:
    """reef #202's trainer step: slot restore (wake + load), train, LoRA save, publication."""
    lc.wake_up()
    rec.memory.touch()  # the slot's weights loaded into the model
    run(lc, rec, "train")
    run(lc, rec, "save")
    run(lc, rec, "sync")


class TestReef202:
    def test_one_scope_is_one_wake_and_one_sleep(self):
        """Slot restore, train, save and publish inside one scope resume and pause memory once each."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        with lc.held():
            reef_202_step(lc, rec)
            assert lc.state is State.AWAKE and lc.deferred == ("*",)
        assert lc.state is State.PAUSED and lc.holds == 0
        assert cycles(rec) == {
            "memory.resume": 1,
            "memory.pause": 1,
            "process_groups.reload": 1,
            "process_groups.destroy": 1,
        }
        assert rec.log.names()[-4:] == [
            "routing_replay.clear",
            "clear_memory",
            "process_groups.destroy",
            "memory.pause",
        ]

    def test_without_the_scope_the_same_step_cycles_more(self):
        """The same calls unscoped: train sleeps, the save wakes and sleeps again, the sync brings groups up."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        reef_202_step(lc, rec)
        assert lc.state is State.PAUSED
        assert cycles(rec) == {
            "memory.resume": 2,
            "memory.pause": 2,
            "process_groups.reload": 3,
            "process_groups.destroy": 3,
        }


class TestDeferral:
    def test_a_sleep_inside_is_deferred_and_logged(self):
        """A sleep inside the scope runs no hook, leaves the machine AWAKE, and says what it deferred."""
        lc, rec = recording_lifecycle(OFFLOAD)
        lc.hold()
        with capture_events() as events:
            lc.sleep()
        assert lc.state is State.AWAKE and rec.log.names() == [] and lc.deferred == ("*",)
        assert [(e["event"], e.get("reason"), e.get("deferred")) for e in events] == [
            ("lifecycle.noop", "held", None),
            ("lifecycle.deferred", None, ["*"]),
        ]
        with capture_events() as events:
            lc.release()
        assert lc.state is State.PAUSED and rec.log.count("memory.pause") == 1
        assert [(e["event"], e.get("operation")) for e in events] == [
            ("lifecycle.transition", "release"),
            ("lifecycle.release", None),
        ]
        assert events[-1]["holds"] == 0 and events[-1]["deferred"] == ["*"]

    def test_a_later_wake_cancels_a_deferred_sleep(self):
        """sleep then wake_up inside a scope: the release runs nothing, as the two calls alone would end awake."""
        lc, rec = recording_lifecycle(OFFLOAD)
        with lc.held():
            lc.sleep()
            lc.wake_up()
            assert lc.deferred == ()
        assert lc.state is State.AWAKE and rec.log.names() == []

    def test_a_hold_does_not_wake(self):
        """A hold taken while PAUSED leaves it PAUSED; the first wake inside the scope is the caller's, and real."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        with lc.held():
            assert lc.state is State.PAUSED and rec.log.names() == []
            run(lc, rec, "sync")  # from PAUSED: the sync's own groups up and down, memory stays paused
            assert rec.log.count("memory.resume") == 0
            lc.wake_up()
            lc.wake_up()
        assert rec.log.count("memory.resume") == 1 and lc.state is State.AWAKE

    def test_a_body_inside_a_scope_that_would_sleep_defers_it(self):
        """An offloaded train step from PAUSED wakes for real and stays AWAKE; a save from PAUSED likewise."""
        for operation, policy in (("train", OFFLOAD), ("save", LifecyclePolicy())):
            lc, rec = recording_lifecycle(policy, initial=State.PAUSED)
            lc.hold()
            run(lc, rec, operation)
            assert lc.state is State.AWAKE and lc.deferred == ("*",), operation
            assert rec.log.count("memory.pause") == 0
            lc.release()
            assert lc.state is State.PAUSED and rec.log.count("memory.pause") == 1

    def test_per_tag_sleeps_defer_their_tags(self):
        """sleep(tags) defers those tags; a wake of others does not cancel them; the release pauses only them."""
        lc, rec = recording_lifecycle(ROLLOUT, generation=True)
        with lc.held():
            lc.sleep(tags=["kv_cache"])
            lc.wake_up(tags=["weights"])
            assert lc.deferred == ("kv_cache",)
        assert lc.state is State.PAUSED and lc.residency == {"weights": R, "kv_cache": X}
        assert rec.log.names() == [
            "generation.pause",
            "clear_memory",
            "process_groups.destroy",
            "memory.pause[kv_cache]",
        ]

    def test_a_deferred_tag_left_resident_by_a_partial_wake_is_paused_from_paused(self):
        lc, rec = recording_lifecycle(ROLLOUT, initial=State.PAUSED)
        lc.wake_up(tags=["weights"])
        with lc.held():
            lc.sleep()
            assert lc.state is State.PAUSED and lc.deferred == ("weights",)
        assert lc.residency == {"weights": X, "kv_cache": X}
        assert rec.log.names() == ["memory.resume[weights]", "clear_memory", "memory.pause[weights]"]

    def test_nested_holds_sleep_at_the_last_release(self):
        lc, rec = recording_lifecycle(OFFLOAD)
        with lc.held():
            with lc.held():
                lc.sleep()
            assert lc.state is State.AWAKE and lc.holds == 1 and lc.deferred == ("*",)
        assert lc.state is State.PAUSED and lc.holds == 0 and rec.log.count("memory.pause") == 1

    def test_the_snapshot_says_holds_and_deferred_tags(self):
        lc, _ = recording_lifecycle(OFFLOAD)
        lc.hold()
        lc.sleep()
        snapshot = lc.snapshot()
        assert (snapshot["state"], snapshot["holds"], snapshot["deferred"]) == ("AWAKE", 1, ["*"])


POLICIES = [
    LifecyclePolicy(offload_train=True),
    LifecyclePolicy(offload_train=False),
    LifecyclePolicy(offload_train=True, memory_tags=TAGS),
    LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",)),
]
CALLS = st.sampled_from(
    [
        ("sleep", None),
        ("wake_up", None),
        ("sleep", ("kv_cache",)),
        ("sleep", ("weights",)),
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("train", None),
        ("save", None),
        ("sync", None),
    ]
)


def play(lc: Lifecycle, rec: Recorders, calls: list[tuple[str, tuple[str, ...] | None]]) -> list[int]:
    """Make the calls; return the indices of those the machine refused."""
    refused = []
    for i, (operation, tags) in enumerate(calls):
        try:
            if operation == "sleep":
                lc.sleep(tags)
            elif operation == "wake_up":
                lc.wake_up(tags)
            else:
                run(lc, rec, operation)
        except IllegalTransitionError:
            refused.append(i)
    return refused


class TestEndsWhereTheCallsWould:
    @settings(max_examples=300, deadline=None)
    @given(
        policy=st.sampled_from(POLICIES),
        initial=st.sampled_from([State.AWAKE, State.PAUSED]),
        calls=st.lists(CALLS, max_size=8),
    )
    def test_a_scope_ends_where_the_calls_alone_would_have(self, policy, initial, calls):
        """Any calls inside one scope end in the state, residency and groups the same calls reach without
        it, with no more resumes and at most one sleep."""
        if policy.memory_tags is None:
            calls = [(op, None) for op, _ in calls]
        plain, plain_rec = recording_lifecycle(policy, initial=initial)
        refused = play(plain, plain_rec, calls)
        calls = [c for i, c in enumerate(calls) if i not in refused]  # compare what both accept
        scoped, scoped_rec = recording_lifecycle(policy, initial=initial)
        with capture_events() as events, scoped.held():
            assert play(scoped, scoped_rec, calls) == []
        assert (scoped.state, scoped.residency, scoped.groups) == (plain.state, plain.residency, plain.groups)
        assert scoped_rec.log.count("memory.resume") <= plain_rec.log.count("memory.resume")
        sleeps = [
            e for e in events if e["event"] == "lifecycle.transition" and "memory.pause" in str(e["hooks"])
        ]
        assert [e["operation"] for e in sleeps] in ([], ["release"])


class TestThreads:
    def test_a_sleep_from_another_thread_is_deferred_and_the_releasing_thread_sleeps(self):
        """Holds are counted machine-wide: another thread's sleep waits for the release, which runs it."""
        sleepers: list[int] = []
        lc = Lifecycle(
            LifecyclePolicy(),
            Hooks(memory=FakeMemorySaver(), clear_memory=lambda: sleepers.append(threading.get_ident())),
        )
        lc.hold()
        other = threading.Thread(target=lc.sleep)
        other.start()
        other.join(5)
        assert lc.state is State.AWAKE and lc.deferred == ("*",) and sleepers == []
        lc.release()
        assert lc.state is State.PAUSED and sleepers == [threading.get_ident()]

    def test_many_threads_in_one_scope_wake_once_and_sleep_once(self):
        """Eight threads each hold, wake, train (offload) and sleep: one resume and one pause in all."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        threads = 8
        all_held, all_done = threading.Barrier(threads), threading.Barrier(threads)
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                lc.hold()
                all_held.wait(5)
                lc.wake_up()
                run(lc, rec, "train")
                lc.sleep()
                all_done.wait(5)
                lc.release()
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=worker) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(10)
        assert errors == []
        assert lc.state is State.PAUSED and lc.holds == 0
        assert rec.log.count("body.train") == threads
        assert (rec.log.count("memory.resume"), rec.log.count("memory.pause")) == (1, 1)


class TestMisuse:
    def test_a_release_without_a_hold_is_refused(self):
        lc, rec = recording_lifecycle(OFFLOAD)
        with pytest.raises(
            IllegalTransitionError, match=r"cannot release in AWAKE: no hold is taken"
        ) as info:
            lc.release()
        assert info.value.operation == "release" and lc.holds == 0 and rec.log.names() == []
        with lc.held():
            pass
        with pytest.raises(IllegalTransitionError, match="no hold is taken"):
            lc.release()  # one hold, given back once

    def test_a_hold_on_a_failed_machine_is_refused(self):
        lc, rec = recording_lifecycle(OFFLOAD)
        rec.faults.arm(Hook.MEMORY_PAUSE)
        with pytest.raises(InjectedFault):
            lc.sleep()
        with pytest.raises(LifecycleFailedError, match="hold is refused"):
            lc.hold()
        assert lc.holds == 0

    def test_a_hold_inside_a_body_is_refused(self):
        lc, _ = recording_lifecycle(OFFLOAD)

        def body() -> None:
            with pytest.raises(IllegalTransitionError, match="cannot hold while train is running"):
                lc.hold()

        lc.run("train", body)
        assert lc.holds == 0

    def test_may_says_whether_a_release_is_possible(self):
        lc, _ = recording_lifecycle(OFFLOAD)
        assert lc.may("hold") and not lc.may("release")
        lc.hold()
        assert lc.may("release") and lc.may("sleep")


class TestFaults:
    def test_a_hook_failing_in_the_final_sleep_leaves_failed(self):
        """The release's sleep fails like any sleep: FAILED with the recorded residency, the error at the `with`,
        and the hold given back."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        rec.faults.arm(Hook.MEMORY_PAUSE)
        with pytest.raises(InjectedFault), lc.held():
            reef_202_step(lc, rec)
        assert lc.state is State.FAILED and lc.holds == 0
        failure = lc.failure
        assert failure is not None and (failure.operation, failure.hook) == ("release", "memory.pause")
        assert failure.residency == {"*": Residency.UNKNOWN} and failure.groups is Groups.DESTROYED
        lc.recover(State.PAUSED)  # asks the backend: the pause had no effect, so it runs once more
        assert lc.state is State.PAUSED and rec.memory.paused == {"default": True}

    def test_a_block_error_still_runs_the_deferred_sleep(self):
        """An error raised inside the `with` propagates, after the scope's one sleep ran."""
        lc, rec = recording_lifecycle(OFFLOAD)
        with pytest.raises(ValueError, match="loss is nan"), lc.held():
            run(lc, rec, "train")
            raise ValueError("loss is nan")
        assert lc.state is State.PAUSED and lc.holds == 0 and rec.log.count("memory.pause") == 1

    def test_a_body_error_keeps_the_sleep_it_deferred(self):
        """A train body that raises inside a scope: the sleep it would have run after is still deferred."""
        lc, _ = recording_lifecycle(OFFLOAD)

        def broken() -> None:
            raise ValueError("loss is nan")

        with lc.held():
            with pytest.raises(ValueError):
                lc.run("train", broken)
            assert lc.state is State.AWAKE and lc.deferred == ("*",)
        assert lc.state is State.PAUSED

    def test_a_block_error_and_a_failing_final_sleep(self):
        """Both fail: the sleep's error reaches the caller, with the block's error as its context."""
        lc, rec = recording_lifecycle(OFFLOAD)
        rec.faults.arm(Hook.CLEAR_MEMORY)
        with pytest.raises(InjectedFault) as info, lc.held():
            lc.sleep()
            raise ValueError("loss is nan")
        assert isinstance(info.value.__context__, ValueError)
        assert lc.state is State.FAILED and lc.holds == 0

    def test_a_failure_inside_the_scope_drops_the_deferred_sleep(self):
        """A hook failing inside a scope leaves FAILED; the release gives the hold back and runs nothing;
        recover decides where the machine goes."""
        lc, rec = recording_lifecycle(LifecyclePolicy(memory_tags=TAGS), initial=State.PAUSED)
        lc.wake_up(tags=["weights"])
        with pytest.raises(InjectedFault), lc.held():
            lc.sleep()  # deferred: weights stay resident
            assert lc.deferred == ("weights",)
            rec.faults.arm(Hook.MEMORY_RESUME)
            lc.wake_up(tags=["kv_cache"])
        assert lc.state is State.FAILED and lc.holds == 0 and lc.deferred == ()
        assert rec.log.count("memory.pause") == 0  # nothing ran at the release
        lc.recover(State.AWAKE)
        assert lc.state is State.AWAKE and rec.log.count("memory.pause") == 0

    def test_a_scope_that_outlives_a_recover_defers_again(self):
        """Recovered inside a scope (another holder still holds): later sleeps are deferred again."""
        lc, rec = recording_lifecycle(OFFLOAD, initial=State.PAUSED)
        lc.hold()
        rec.faults.arm(Hook.SWITCH_MODEL)
        with pytest.raises(InjectedFault):
            lc.wake_up()
        lc.recover(State.AWAKE)
        assert lc.holds == 1 and lc.deferred == ()
        run(lc, rec, "train")
        assert lc.state is State.AWAKE and lc.deferred == ("*",)
        lc.release()
        assert lc.state is State.PAUSED and rec.log.count("memory.pause") == 1

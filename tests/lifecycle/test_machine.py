"""The machine against recording fakes: every table row, every refusal, nesting, FAILED and recover."""

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

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
from lifecycle.table import TABLE, Hook, row_edges
from lifecycle.testing import FakeMemorySaver, InjectedFault, Recorders, recording_lifecycle
from tests.helpers.bodies import make_body

SLEEP = ["routing_replay.clear", "clear_memory", "process_groups.destroy", "memory.pause"]
WAKE = ["memory.resume", "process_groups.reload", "switch_model[actor]"]
TAGS = ("weights", "kv_cache")


def body(op: str) -> Callable[[Lifecycle, Recorders], Any]:
    return lambda lc, rec: lc.run(op, make_body(rec, lc, op))


def fail_then(action: Callable[[Lifecycle, Recorders], Any]) -> Callable[[Lifecycle, Recorders], Any]:
    """Set-up that leaves the machine FAILED in process_groups.destroy during sleep."""

    def setup(lc: Lifecycle, rec: Recorders) -> None:
        rec.faults.arm(Hook.PROCESS_GROUPS_DESTROY)
        with pytest.raises(InjectedFault):
            lc.sleep()
        assert lc.state is State.FAILED

    return setup


@dataclass
class Scenario:
    policy: dict[str, Any]
    action: Callable[[Lifecycle, Recorders], Any]
    calls: list[str]
    final: State
    initial: State = State.AWAKE
    setup: Callable[[Lifecycle, Recorders], Any] | None = None
    residency: dict[str, Residency] = field(default_factory=dict)
    events: list[str] = field(default_factory=lambda: ["lifecycle.noop"])  # what a row without hooks logs


def held(*then: Callable[[Lifecycle, Recorders], Any]) -> Callable[[Lifecycle, Recorders], Any]:
    """Set-up that takes a hold, then does `then`."""

    def setup(lc: Lifecycle, rec: Recorders) -> None:
        lc.hold()
        for step in then:
            step(lc, rec)

    return setup


def wake_weights(lc: Lifecycle, rec: Recorders) -> None:
    lc.wake_up(tags=["weights"])


def held_then_failed(lc: Lifecycle, rec: Recorders) -> None:
    """Set-up: a hold, then the first wake inside it fails (memory.resume raised)."""
    lc.hold()
    rec.faults.arm(Hook.MEMORY_RESUME)
    with pytest.raises(InjectedFault):
        lc.wake_up()
    assert lc.state is State.FAILED


R, X = Residency.RESIDENT, Residency.RELEASED
OFF = {"offload_train": True, "use_routing_replay": True}
ON = {"use_routing_replay": True}
TAGGED = {"use_routing_replay": True, "memory_tags": TAGS, "sync_requires": ("weights",)}

# One scenario per row of the table, in table order: the test below fails when a row is added
# without a scenario, and each scenario asserts the exact backend calls of its row.
SCENARIOS: list[Scenario] = [
    Scenario(ON, lambda lc, rec: lc.sleep(), SLEEP, State.PAUSED),
    Scenario(
        TAGGED,
        lambda lc, rec: lc.sleep(),
        ["routing_replay.clear", "clear_memory", "memory.pause[weights]"],
        State.PAUSED,
        initial=State.PAUSED,
        setup=lambda lc, rec: lc.wake_up(tags=["weights"]),
        residency={"weights": X, "kv_cache": X},
    ),
    Scenario(ON, lambda lc, rec: lc.sleep(), [], State.PAUSED, initial=State.PAUSED),
    Scenario(ON, lambda lc, rec: lc.wake_up(), WAKE, State.AWAKE, initial=State.PAUSED),
    Scenario(
        TAGGED,
        lambda lc, rec: lc.wake_up(tags=["weights"]),
        ["memory.resume[weights]"],
        State.PAUSED,
        initial=State.PAUSED,
        residency={"weights": R, "kv_cache": X},
    ),
    Scenario(ON, lambda lc, rec: lc.wake_up(), [], State.AWAKE),
    Scenario(ON, body("train"), ["body.train"], State.AWAKE),
    Scenario(OFF, body("train"), ["body.train", *SLEEP], State.PAUSED),
    Scenario(ON, body("train"), [*WAKE, "body.train"], State.AWAKE, initial=State.PAUSED),
    Scenario(OFF, body("train"), [*WAKE, "body.train", *SLEEP], State.PAUSED, initial=State.PAUSED),
    Scenario(ON, body("generate"), ["body.generate"], State.AWAKE),
    Scenario(ON, body("save"), ["body.save"], State.AWAKE),
    Scenario(ON, body("save"), [*WAKE, "body.save", *SLEEP], State.PAUSED, initial=State.PAUSED),
    Scenario(ON, body("sync"), ["memory.disable", "body.sync"], State.AWAKE),
    Scenario(
        ON,
        body("sync"),
        ["process_groups.reload", "memory.disable", "body.sync", "process_groups.destroy"],
        State.PAUSED,
        initial=State.PAUSED,
    ),
    Scenario(
        ON,
        lambda lc, rec: lc.recover(State.AWAKE),
        ["switch_model[actor]"],  # memory still resident, groups found alive
        State.AWAKE,
        setup=fail_then(None),
    ),
    Scenario(
        ON,
        lambda lc, rec: lc.recover(State.PAUSED),
        SLEEP,  # the destroy that raised had no effect: it runs again, then the pause
        State.PAUSED,
        setup=fail_then(None),
    ),
    # held scopes
    Scenario(ON, lambda lc, rec: lc.hold(), [], State.AWAKE, events=["lifecycle.hold"]),
    Scenario(
        ON, lambda lc, rec: lc.hold(), [], State.PAUSED, initial=State.PAUSED, events=["lifecycle.hold"]
    ),
    Scenario(
        ON,
        lambda lc, rec: lc.sleep(),
        [],
        State.AWAKE,
        setup=held(),
        events=["lifecycle.noop", "lifecycle.deferred"],
    ),
    Scenario(
        TAGGED,
        lambda lc, rec: lc.sleep(),
        [],
        State.PAUSED,
        initial=State.PAUSED,
        setup=held(wake_weights),
        residency={"weights": R, "kv_cache": X},
        events=["lifecycle.noop", "lifecycle.deferred"],
    ),
    Scenario(OFF, body("train"), ["body.train"], State.AWAKE, setup=held()),
    Scenario(OFF, body("train"), [*WAKE, "body.train"], State.AWAKE, initial=State.PAUSED, setup=held()),
    Scenario(ON, body("save"), [*WAKE, "body.save"], State.AWAKE, initial=State.PAUSED, setup=held()),
    Scenario(ON, lambda lc, rec: lc.release(), SLEEP, State.PAUSED, setup=held(lambda lc, rec: lc.sleep())),
    Scenario(
        TAGGED,
        lambda lc, rec: lc.release(),
        ["routing_replay.clear", "clear_memory", "memory.pause[weights]"],
        State.PAUSED,
        initial=State.PAUSED,
        setup=held(wake_weights, lambda lc, rec: lc.sleep()),
        residency={"weights": X, "kv_cache": X},
    ),
    Scenario(ON, lambda lc, rec: lc.release(), [], State.AWAKE, setup=held(), events=["lifecycle.release"]),
    Scenario(
        ON,
        lambda lc, rec: lc.release(),
        [],
        State.PAUSED,
        initial=State.PAUSED,
        setup=held(),
        events=["lifecycle.release"],
    ),
    Scenario(
        ON,
        lambda lc, rec: lc.release(),
        [],
        State.FAILED,
        initial=State.PAUSED,
        setup=held_then_failed,
        events=["lifecycle.release"],
    ),
]


def test_every_row_has_a_scenario():
    assert len(SCENARIOS) == len(TABLE)


@pytest.mark.parametrize(
    ("index", "row"),
    list(enumerate(TABLE)),
    ids=[f"{r.operation}-{r.source}>{r.dest}-{r.when.name}" for r in TABLE],
)
def test_row(index, row):
    """The row's operation from its source makes exactly its hook calls, edges and destination."""
    sc = SCENARIOS[index]
    lc, rec = recording_lifecycle(LifecyclePolicy(**sc.policy), initial=sc.initial)
    if sc.setup:
        sc.setup(lc, rec)
    assert lc.state is row.source
    rec.log.clear()
    with capture_events() as events:
        sc.action(lc, rec)
    assert rec.log.names() == sc.calls
    assert lc.state is sc.final is row.dest
    transitions = [
        (e["src"], e["dst"], e["operation"], e["phase"])
        for e in events
        if e["event"] == "lifecycle.transition"
    ]
    assert transitions == [(e.source, e.dest, e.operation, e.phase) for e in row_edges(row)]
    if row.noop:
        assert [e["event"] for e in events] == sc.events
    if sc.residency:
        assert lc.residency == sc.residency
    if sc.final is State.AWAKE:
        assert all(r is R for r in lc.residency.values())
        assert not any(rec.memory.paused.values())


class TestRefusals:
    def test_train_from_paused_without_auto_wake(self):
        """With auto_wake=False, train from PAUSED is refused and says to call wake_up() first."""
        lc, rec = recording_lifecycle(LifecyclePolicy(auto_wake=False), initial=State.PAUSED)
        with pytest.raises(IllegalTransitionError, match=r"auto_wake=False; call wake_up\(\) first") as info:
            lc.run("train", make_body(rec, lc, "train"))
        assert info.value.state is State.PAUSED
        assert info.value.operation == "train"
        assert "wake_up" in info.value.allowed
        assert rec.log.names() == []

    def test_save_from_paused_without_auto_wake(self):
        lc, rec = recording_lifecycle(LifecyclePolicy(auto_wake=False), initial=State.PAUSED)
        with pytest.raises(IllegalTransitionError, match="call wake_up"):
            lc.run("save", make_body(rec, lc, "save"))
        assert rec.log.names() == []

    def test_generate_from_paused(self):
        lc, rec = recording_lifecycle(LifecyclePolicy(), initial=State.PAUSED)
        with pytest.raises(IllegalTransitionError, match="call wake_up"):
            lc.run("generate", make_body(rec, lc, "generate"))

    def test_sync_needs_its_tags_resident(self):
        """A rollout cannot receive weights into released memory: it names the tags to wake."""
        lc, rec = recording_lifecycle(
            LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",)), initial=State.PAUSED
        )
        with pytest.raises(IllegalTransitionError, match=r"wake_up\(tags=\['weights'\]\) first"):
            lc.run("sync", make_body(rec, lc, "sync"))
        assert rec.log.names() == []

    def test_recover_when_not_failed(self):
        lc, _ = recording_lifecycle(LifecyclePolicy())
        with pytest.raises(IllegalTransitionError, match="only legal from FAILED"):
            lc.recover()

    def test_unknown_operation_and_tags(self):
        lc, rec = recording_lifecycle(LifecyclePolicy(memory_tags=TAGS))
        with pytest.raises(ValueError, match="not a body operation"):
            lc.run("sleep", lambda: None)
        with pytest.raises(ValueError, match=r"unknown memory tags \['cuda_graph'\]"):
            lc.sleep(tags=["cuda_graph"])
        lc2, _ = recording_lifecycle(LifecyclePolicy())
        with pytest.raises(ValueError, match="one unit"):
            lc2.sleep(tags=["weights"])
        assert rec.log.names() == []

    def test_refusal_is_logged(self):
        lc, _ = recording_lifecycle(LifecyclePolicy(), initial=State.PAUSED)
        with capture_events() as events, pytest.raises(IllegalTransitionError):
            lc.run("generate", lambda: None)
        assert [e["event"] for e in events] == ["lifecycle.refused"]

    def test_errors_survive_pickling(self):
        """Ray ships exceptions by pickling; the attributes callers branch on must survive."""
        err = IllegalTransitionError("x", state=State.PAUSED, operation="train", allowed=("wake_up",))
        back = pickle.loads(pickle.dumps(err))
        assert (back.state, back.operation, back.allowed, str(back)) == (
            State.PAUSED,
            "train",
            ("wake_up",),
            "x",
        )
        failed = LifecycleFailedError(
            "y",
            hook="memory.pause",
            operation="sleep",
            residency={"*": Residency.UNKNOWN},
            groups=None,
            error="E",
        )
        back2 = pickle.loads(pickle.dumps(failed))
        assert (back2.hook, back2.residency, back2.error) == ("memory.pause", {"*": Residency.UNKNOWN}, "E")


class TestNesting:
    def test_slime_save_model_calls_wake_and_sleep_inside(self):
        """slime's save_model body calls wake_up()/sleep() itself: absorbed, and memory is resident for the save."""
        lc, rec = recording_lifecycle(LifecyclePolicy(offload_train=True), initial=State.PAUSED)

        def save_model():
            lc.wake_up()
            rec.check_body(lc, "save")
            rec.log.add("body", "save")
            lc.sleep()

        with capture_events() as events:
            lc.run("save", save_model)
        assert lc.state is State.PAUSED
        noops = [e for e in events if e["event"] == "lifecycle.noop"]
        assert [(e["operation"], e["reason"], e["state"]) for e in noops] == [
            ("wake_up", "nested in save", State.SAVING),
            ("sleep", "nested in save", State.SAVING),
        ]
        assert rec.log.names().count("memory.pause") == 1

    def test_other_operation_inside_a_body_is_refused(self):
        lc, _ = recording_lifecycle(LifecyclePolicy())
        seen = {}

        def save():
            with pytest.raises(IllegalTransitionError, match="cannot sync while save is running") as info:
                lc.run("sync", lambda: None)
            seen["state"] = info.value.state
            seen["may_sync"] = lc.may("sync")
            seen["may_sleep"] = lc.may("sleep")

        lc.run("save", save)
        assert seen == {"state": State.SAVING, "may_sync": False, "may_sleep": True}
        assert lc.state is State.AWAKE

    def test_hook_calling_back_into_the_machine_is_refused(self):
        """A hook is not a body: a lifecycle call from inside a hook is refused, and the machine FAILs."""
        holder: dict[str, Lifecycle] = {}
        memory = FakeMemorySaver()
        lc = Lifecycle(LifecyclePolicy(), Hooks(memory=memory, clear_memory=lambda: holder["lc"].wake_up()))
        holder["lc"] = lc
        with pytest.raises(IllegalTransitionError, match="inside its hooks"):
            lc.sleep()
        assert lc.state is State.FAILED
        assert lc.failure is not None and lc.failure.hook == "clear_memory"


class TestFailure:
    def test_failed_refuses_everything_but_recover(self):
        """After a hook raised, every operation raises LifecycleFailedError naming the hook and residency."""
        lc, rec = recording_lifecycle(LifecyclePolicy(memory_tags=TAGS))
        rec.faults.arm(Hook.MEMORY_PAUSE, at=2)
        with capture_events() as events, pytest.raises(InjectedFault):
            lc.sleep()
        assert lc.state is State.FAILED
        assert lc.residency == {"weights": X, "kv_cache": Residency.UNKNOWN}
        failure = lc.failure
        assert failure is not None
        assert (failure.hook, failure.tag, failure.operation, failure.state) == (
            "memory.pause",
            "kv_cache",
            "sleep",
            State.AWAKE,
        )
        assert [h["ok"] for h in failure.hooks][-2:] == [True, False]
        failed = [e for e in events if e["event"] == "lifecycle.failed"]
        assert (
            len(failed) == 1 and failed[0]["hook"] == "memory.pause" and "InjectedFault" in failed[0]["error"]
        )
        for call in (
            lc.sleep,
            lc.wake_up,
            lambda: lc.run("train", lambda: None),
            lambda: lc.run("sync", lambda: None),
        ):
            with pytest.raises(LifecycleFailedError, match=r"hook memory.pause\[kv_cache\] raised") as info:
                call()
            assert info.value.hook == "memory.pause"
            assert info.value.residency["kv_cache"] is Residency.UNKNOWN

    @pytest.mark.parametrize("after_effect", [False, True])
    def test_recover_asks_the_backend_about_unknown_tags(self, after_effect):
        """A pause that raised before or after its effect is resolved with is_paused(), never guessed."""
        lc, rec = recording_lifecycle(LifecyclePolicy(memory_tags=TAGS))
        rec.faults.arm(Hook.MEMORY_PAUSE, at=2, after_effect=after_effect)
        with pytest.raises(InjectedFault):
            lc.sleep()
        rec.log.clear()
        lc.recover(State.PAUSED)
        # clear_memory is stateless and part of the sleep plan; the pause re-runs only if it had no effect.
        expected = ["clear_memory"] if after_effect else ["clear_memory", "memory.pause[kv_cache]"]
        assert rec.log.names() == expected
        assert lc.state is State.PAUSED and lc.failure is None
        assert all(rec.memory.paused.values())

    def test_recover_without_a_query_refuses(self):
        """Without is_paused(), an unknown tag cannot be resolved safely: recover says restart."""

        class BareSaver(FakeMemorySaver):
            is_paused = None  # type: ignore[assignment]

        saver = BareSaver()
        lc = Lifecycle(LifecyclePolicy(), Hooks(memory=saver, clear_memory=lambda: None))

        def boom(tag=None):
            raise RuntimeError("cuMemUnmap failed")

        saver.pause = boom  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            lc.sleep()
        with pytest.raises(LifecycleFailedError, match="restart this actor"):
            lc.recover(State.AWAKE)
        assert lc.state is State.FAILED

    def test_failure_during_recover_stays_failed(self):
        lc, rec = recording_lifecycle(LifecyclePolicy())
        rec.faults.arm(Hook.CLEAR_MEMORY)
        with pytest.raises(InjectedFault):
            lc.sleep()
        rec.faults.arm(Hook.CLEAR_MEMORY)
        with pytest.raises(InjectedFault):
            lc.recover(State.PAUSED)
        assert lc.state is State.FAILED
        lc.recover(State.PAUSED)
        assert lc.state is State.PAUSED

    def test_body_error_still_leaves_saving(self):
        """A save that raises still re-pauses (the machine is not FAILED) and the error reaches the caller."""
        lc, rec = recording_lifecycle(LifecyclePolicy(), initial=State.PAUSED)

        def save():
            raise OSError("disk full")

        with capture_events() as events, pytest.raises(OSError, match="disk full"):
            lc.run("save", save)
        assert lc.state is State.PAUSED
        assert rec.memory.paused == {"default": True}
        body = next(e for e in events if e["event"] == "lifecycle.body")
        assert body["ok"] is False and "disk full" in body["error"]

    def test_exit_hook_failure_after_body_error(self):
        lc, rec = recording_lifecycle(LifecyclePolicy(), initial=State.PAUSED)
        rec.faults.arm(Hook.MEMORY_PAUSE)

        def save():
            raise OSError("disk full")

        with pytest.raises(InjectedFault) as info:
            lc.run("save", save)
        assert isinstance(info.value.__context__, OSError)
        assert lc.state is State.FAILED and lc.failure is not None and lc.failure.operation == "save"


class TestThreads:
    def test_other_threads_wait_for_a_running_body(self):
        """A sleep from another thread waits on the lock until the save returns; it is not absorbed."""
        lc, rec = recording_lifecycle(LifecyclePolicy())
        started, release = threading.Event(), threading.Event()

        def save():
            started.set()
            assert release.wait(5)
            rec.log.add("body", "save")

        worker = threading.Thread(target=lc.run, args=("save", save))
        worker.start()
        assert started.wait(5)
        sleeper = threading.Thread(target=lc.sleep)
        sleeper.start()
        time.sleep(0.05)
        assert lc.state is State.SAVING  # the sleeper is blocked
        release.set()
        worker.join(5)
        sleeper.join(5)
        assert lc.state is State.PAUSED
        assert rec.log.names()[0] == "body.save"
        assert "memory.pause" in rec.log.names()


class TestFaultWrappers:
    def test_with_faults_wraps_real_backends(self):
        """The injector fails a wrapped backend's call; the backend's own query still serves recover."""
        from lifecycle.faults import with_faults
        from lifecycle.testing import FakeProcessGroups, FaultInjector

        faults = FaultInjector()
        memory, groups, cleared = FakeMemorySaver(), FakeProcessGroups(), []
        lc = Lifecycle(
            LifecyclePolicy(),
            with_faults(
                faults, Hooks(memory=memory, process_groups=groups, clear_memory=lambda: cleared.append(1))
            ),
        )
        faults.arm("memory.pause", after_effect=True)
        with pytest.raises(InjectedFault):
            lc.sleep()
        assert lc.residency == {"*": Residency.UNKNOWN} and memory.paused == {"default": True}
        lc.recover(State.PAUSED)  # is_paused() reaches the wrapped fake: no second pause
        assert memory.pause_count == 1 and lc.state is State.PAUSED
        faults.arm("clear_memory")
        with pytest.raises(InjectedFault):
            lc.wake_up()
            lc.sleep()
        assert faults.fired == ["memory.pause", "clear_memory"]

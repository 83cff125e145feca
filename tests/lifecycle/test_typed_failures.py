"""The fault grammar both switches read (`parse_fault`), a backend's batch calls failing under the
injector, and a machine's `typed_failures`: a hook that raises fails the call with
`LifecycleFailedError` naming the machine, the transition and what is resident, the hook's error
its cause (what a framework job's driver, which never recovers, prints)."""

from __future__ import annotations

import pickle

import pytest

from lifecycle import Hooks, Lifecycle, LifecyclePolicy, Residency, State
from lifecycle.errors import InjectedFault, LifecycleFailedError
from lifecycle.faults import Fault, FaultInjector, parse_fault, with_faults
from lifecycle.testing import FakeMemorySaver, recording_lifecycle


class TestTheGrammar:
    @pytest.mark.parametrize(
        ("text", "fault"),
        [
            ("memory.pause@2", Fault("trainer", "memory.pause", 2)),
            ("trainer:process_groups.destroy@1", Fault("trainer", "process_groups.destroy", 1)),
            ("rollout:generation.pause@30", Fault("rollout", "generation.pause", 30)),
        ],
    )
    def test_role_hook_and_step(self, text: str, fault: Fault) -> None:
        assert parse_fault(text) == fault
        role, hook, step = parse_fault(text)  # the demo unpacks it as a tuple
        assert (role, hook, step) == tuple(fault)

    @pytest.mark.parametrize(
        "text",
        ["", "memory.pause", "memory.pause@", "critic:memory.pause@1", "memory.nap@2", "memory.pause@0"],
    )
    def test_anything_else_is_a_value_error_with_the_form_and_the_hooks(self, text: str) -> None:
        with pytest.raises(ValueError) as refused:
            parse_fault(text)
        message = str(refused.value)
        assert message.startswith(repr(text)) and "expected [trainer:|rollout:]HOOK@STEP" in message
        assert "'process_groups.destroy'" in message and "STEP from 1" in message


class _Batches(FakeMemorySaver):
    """A memory backend that also releases several tags in one call (an engine server's)."""

    def pause_tags(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            self.pause(tag)

    def resume_tags(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            self.resume(tag)


def test_a_backends_batch_call_fails_as_one_call_of_its_hook() -> None:
    faults = FaultInjector()
    memory = _Batches(("weights", "kv_cache"))
    lifecycle = Lifecycle(
        LifecyclePolicy(memory_tags=("weights", "kv_cache"), destroy_process_groups=False, model_tag=None),
        with_faults(faults, Hooks(memory=memory)),
    )
    faults.arm("memory.pause", at=2)
    lifecycle.sleep()  # the first pause: both tags in one call
    lifecycle.wake_up()
    with pytest.raises(InjectedFault, match=r"memory\.pause"):
        lifecycle.sleep()
    assert faults.fired == ["memory.pause"] and lifecycle.state is State.FAILED
    assert not memory.is_paused("weights")  # before its effect: nothing released


class TestTypedFailures:
    def test_the_hooks_error_becomes_lifecycle_failed_naming_rank_transition_and_residency(self) -> None:
        lc, rec = recording_lifecycle(LifecyclePolicy(offload_train=True, memory_tags=("model",)))
        lc.typed_failures = True
        lc.sleep()
        rec.faults.arm("memory.pause")
        with pytest.raises(LifecycleFailedError) as failed:
            lc.run("train", lambda: None)  # from PAUSED: wake, train, then the sleep that fails
        error = failed.value
        message = str(error)
        assert "is FAILED since hook memory.pause[model] raised InjectedFault(" in message
        assert "during train (exit) from AWAKE" in message and "residency {'model': " in message
        assert "a driver that does not recover must stop here" in message
        assert isinstance(error.__cause__, InjectedFault)
        assert (error.fields["hook"], error.fields["operation"]) == ("memory.pause", "train")
        assert lc.state is State.FAILED and lc.failure is not None and lc.failure.phase == "exit"
        again = pickle.loads(pickle.dumps(error))  # Ray ships it to the driver
        assert str(again) == message and again.fields["residency"] == error.fields["residency"]

    def test_who_names_the_role_and_the_rank(self) -> None:
        faults = FaultInjector()
        lc = Lifecycle(
            LifecyclePolicy(memory_tags=("model",)),
            with_faults(faults, Hooks(memory=FakeMemorySaver(("model",)))),
            rank=3,
            role="critic",
        )
        lc.typed_failures = True
        faults.arm("memory.pause", after_effect=True)
        with pytest.raises(LifecycleFailedError, match=r"^lifecycle of critic rank 3 is FAILED since hook"):
            lc.sleep()
        assert lc.residency == {"model": Residency.UNKNOWN}  # its effect may have happened: asked at recover

    def test_off_by_default_the_hooks_own_error_and_recover_as_before(self) -> None:
        lc, rec = recording_lifecycle(LifecyclePolicy(memory_tags=("model",)))
        rec.faults.arm("memory.pause")
        with pytest.raises(InjectedFault):
            lc.sleep()
        lc.recover(State.PAUSED)
        assert lc.state is State.PAUSED

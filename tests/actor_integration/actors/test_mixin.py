"""LifecycleMixin over a slime-shaped actor: the upstream failures happen without it and not with it."""

import pytest

from actor_integration import LifecycleMixin, LifecycleNotConfiguredError
from lifecycle import Hooks, LifecyclePolicy, State, capture_events
from lifecycle.testing import FakeMemorySaver, ProtocolViolation
from tests.helpers.slime_like import LifecycleSlimeActor, SlimeLikeActor, slime_lifecycle_config

SLEEP = ["routing_replay.clear", "clear_memory", "process_groups.destroy", "memory.pause"]
WAKE = ["memory.resume", "process_groups.reload", "switch_model[actor]"]


def wrapped(**kw):
    actor = LifecycleSlimeActor()
    actor.init(**kw)
    actor.calls.clear()
    return actor


class TestWithoutTheMixin:
    """The slime-shaped class reproduces the upstream bugs on the fakes (which raise where TMS would exit)."""

    def test_double_sleep_kills_the_actor(self):
        """slime #1895: a second sleep double-pauses (TMS prints the message and exits with code 1)."""
        actor = SlimeLikeActor()
        actor.init()
        with pytest.raises(ProtocolViolation, match="Cannot pause allocation that is not active"):
            actor.sleep()

    def test_save_after_train_runs_on_paused_memory(self):
        """slime #1886: train() ends asleep, the pre-#1888 save_model then reads paused memory."""
        actor = SlimeLikeActor()
        actor.init()
        actor.train(1)
        with pytest.raises(ProtocolViolation, match="while it is paused"):
            actor.save_model_before_1888(1)


class Pre1888(SlimeLikeActor):
    save_model = SlimeLikeActor.save_model_before_1888


class WrappedPre1888(LifecycleMixin, Pre1888):
    def lifecycle_config(self):
        return slime_lifecycle_config(self)


class TestWithTheMixin:
    def test_init_ends_asleep(self):
        actor = wrapped()
        assert actor.lifecycle.state is State.PAUSED
        assert actor.tms.paused == {"default": True} and not actor.groups.alive

    def test_1886_sequence(self):
        """train auto-sleeps; save_model then runs on resumed memory and groups, and re-pauses."""
        actor = wrapped()
        assert actor.train(1) == {"rollout_id": 1}
        assert actor.lifecycle.state is State.PAUSED
        actor.save_model(1)
        assert actor.lifecycle.state is State.PAUSED and actor.saved == [1]
        assert actor.calls.names() == [*WAKE, "body.train[1]", *SLEEP, *WAKE, "body.save[1]", *SLEEP]

    def test_1886_by_construction(self):
        """Even the pre-#1888 body (no wake_up inside) is safe: entering SAVING resumes memory."""
        actor = WrappedPre1888()
        actor.init()
        actor.train(1)
        actor.save_model(1)
        assert actor.saved == [1] and actor.lifecycle.state is State.PAUSED

    def test_double_sleep_and_double_wake(self):
        actor = wrapped()
        with capture_events() as events:
            actor.sleep()
            actor.wake_up()
            actor.wake_up()
        assert actor.calls.names() == WAKE
        assert [(e["event"], e.get("operation")) for e in events] == [
            ("lifecycle.noop", "sleep"),
            ("lifecycle.transition", "wake_up"),
            ("lifecycle.noop", "wake_up"),
        ]

    def test_update_weights_from_paused(self):
        """Memory stays paused; groups are reloaded around the body and destroyed after; body under disable()."""
        actor = wrapped()
        assert actor.update_weights() == 1
        assert actor.calls.names() == [
            "process_groups.reload",
            "memory.disable",
            "body.sync[1]",
            "process_groups.destroy",
        ]
        assert actor.tms.paused == {"default": True} and actor.tms.pause_count == 1
        assert actor.lifecycle.state is State.PAUSED

    def test_routing_replay_cleared_before_pause_and_tag_restored_after_resume(self):
        actor = wrapped()
        actor.wake_up()
        actor.sleep()
        names = actor.calls.names()
        assert names.index("switch_model[actor]") > names.index("memory.resume")
        assert names.index("routing_replay.clear") < names.index("memory.pause")

    def test_nested_lifecycle_calls_are_absorbed(self):
        actor = wrapped()
        with capture_events() as events:
            actor.save_model(3)
        nested = [(e["operation"], e["reason"]) for e in events if e["event"] == "lifecycle.noop"]
        assert nested == [("wake_up", "nested in save"), ("sleep", "nested in save")]

    def test_state_snapshot_is_plain_data(self):
        actor = wrapped(rank=5)
        snap = actor.lifecycle_state()
        assert snap == {
            "state": "PAUSED",
            "residency": {"*": "released"},
            "groups": "destroyed",
            "contents": {"*": "valid"},
            "weight_version": None,
            "weights_valid": True,
            "holds": 0,
            "deferred": [],
            "rank": 5,
            "role": "actor",
            "step": None,
            "failure": None,
        }


class TestHeldScope:
    """reef #202: a slime-based job woke and slept the trainer four times a step where once would do."""

    @staticmethod
    def step(actor: LifecycleSlimeActor, rollout_id: int) -> None:
        actor.wake_up()  # slot restore: wake, then load the slot's weights
        actor.tms.touch()
        actor.calls.add("body", "load", "slot")
        actor.train(rollout_id)  # offload_train: its own wake/sleep absorbed, the sleep after it deferred
        actor.save_model(rollout_id)  # the LoRA save, on resident memory
        actor.update_weights()  # publication

    def test_reef_202_step_in_one_scope_wakes_once_and_sleeps_once(self):
        """Slot restore, train, save and publish between lifecycle_hold() and lifecycle_release(): one
        memory.resume, one memory.pause, one reload and one destroy of the process groups."""
        actor = wrapped()
        assert actor.lifecycle_hold()["holds"] == 1
        self.step(actor, 1)
        assert actor.lifecycle.state is State.AWAKE and actor.lifecycle.deferred == ("*",)
        after = actor.lifecycle_release()
        assert (after["state"], after["holds"], after["deferred"]) == ("PAUSED", 0, [])
        names = actor.calls.names()
        assert [names.count(n) for n in WAKE + SLEEP] == [1] * len(WAKE + SLEEP)
        assert names == [
            *WAKE,
            "body.load[slot]",
            "body.train[1]",
            "body.save[1]",
            "memory.disable",
            "body.sync[1]",
            *SLEEP,
        ]
        assert actor.saved_weights == [1] and actor.pushed == [
            1
        ]  # the save and the sync saw the trained weights

    def test_the_same_step_without_a_scope_cycles_per_phase(self):
        actor = wrapped()
        self.step(actor, 1)
        names = actor.calls.names()
        assert (names.count("memory.resume"), names.count("memory.pause")) == (2, 2)
        assert (names.count("process_groups.reload"), names.count("process_groups.destroy")) == (3, 3)

    def test_the_scope_inside_the_actor(self):
        """Code running inside the actor uses the machine's context manager; the outcome is the same."""
        actor = wrapped()
        with actor.lifecycle.held():
            self.step(actor, 2)
        names = actor.calls.names()
        assert (names.count("memory.resume"), names.count("memory.pause")) == (1, 1)
        assert actor.lifecycle.state is State.PAUSED


class TestLazyConfiguration:
    def test_slime_init_unchanged(self):
        """SlimeLikeActor.init ends with self.sleep(): that call builds the lifecycle, then sleeps through it."""
        actor = LifecycleSlimeActor()
        actor.init()
        assert actor.lifecycle.state is State.PAUSED
        assert actor.calls.names() == [
            "switch_model[actor]",  # slime's init: "recover to actor in the end", then sleep
            "routing_replay.clear",
            "clear_memory",
            "process_groups.destroy",
            "memory.pause",
        ]
        actor.sleep()  # and a second sleep is now a no-op instead of slime #1895
        assert actor.tms.pause_count == 1


class TestMisuse:
    def test_not_configured(self):
        class Bare(LifecycleMixin, SlimeLikeActor):
            pass

        with pytest.raises(LifecycleNotConfiguredError, match="configure_lifecycle"):
            Bare().sleep()

    def test_configured_twice(self):
        actor = wrapped()
        with pytest.raises(RuntimeError, match="already called"):
            actor.configure_lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver()))

    def test_async_actor_refused(self):
        class AsyncActor(LifecycleMixin):
            async def generate(self):
                return None

        with pytest.raises(TypeError, match=r"async actors.*AsyncActor\.generate"):
            AsyncActor().configure_lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver()))

    def test_missing_body(self):
        class NoSync(LifecycleMixin):
            pass

        actor = NoSync()
        actor.configure_lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver()))
        with pytest.raises(NotImplementedError, match=r"NoSync.update_weights\(\) has no body"):
            actor.update_weights()

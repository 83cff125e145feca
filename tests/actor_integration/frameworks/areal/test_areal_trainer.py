"""AReaL's Megatron engine in AWEX colocate mode under `ArealTrainerMixin`.

The engine is AReaL-shaped (tests/helpers/areal_like.py: `MegatronEngineLike` and its
`AwexAdapterLike`, the order of AReaL cbff54d6's calls); test_areal_source.py runs AReaL's own
`AwexMegatronAdapter`. The machine's residency must always be the adapter's `_released_tags`.
"""

from __future__ import annotations

import json

import pytest

from actor_integration.frameworks.areal import (
    TRAINER_TAGS,
    ArealTrainerMixin,
    AwexMemory,
    GradBufferRelease,
    areal_trainer_policy,
)
from lifecycle import Residency, State, capture_events
from lifecycle.checker import check_lines
from lifecycle.errors import IllegalTransitionError
from lifecycle.faults import FaultInjector, with_faults
from lifecycle.testing import ProtocolViolation
from tests.helpers.areal_like import (
    LifecycleEngineLike,
    MegatronEngineLike,
    Meta,
    ServerModel,
    started,
)


def released(engine) -> set[str]:
    return set(engine._awex_adapter._released_tags)


def machine_released(engine) -> set[str]:
    return {t for t, r in engine.lifecycle.residency.items() if r is Residency.RELEASED}


def colocated(*, wrapped: bool = True):
    """A trainer whose writer publishes into a server paused in place with its weights released."""
    engine = (LifecycleEngineLike if wrapped else MegatronEngineLike)()
    server = ServerModel()
    server.handle("/pause_generation", {"mode": "in_place"})
    server.handle("/release_memory_occupation", {"tags": ["weights"]})
    engine.publish = lambda version, value: server.awex_transfer(version)
    engine.rollout_engine = None
    return engine, server


class NoRollout:
    """rank 0's rollout engine when the driver reports the transfer (AReaL's RolloutCallback has no such call)."""

    def onload(self, tags=None):
        pass

    def continue_generation(self):
        pass


class TestOffloadOnload:
    def test_offload_is_the_sleep_plan_over_areals_release(self):
        """Grad buffers first (the clear_memory hook), then AReaL's release of optimizer and weights."""
        engine = LifecycleEngineLike()
        engine.train_batch()
        assert engine.mem["grads"] == 0
        with capture_events() as events:
            engine.offload()
        assert engine.lifecycle.state is State.PAUSED and engine.is_offload
        assert released(engine) == set(TRAINER_TAGS) == machine_released(engine)
        assert engine.mem == {"weights": None, "optimizer": None, "grads": None}
        (sleep,) = [e for e in events if e["event"] == "lifecycle.transition"]
        assert [(h["name"], h.get("tag")) for h in sleep["hooks"]] == [
            ("clear_memory", None),
            ("memory.pause", "optimizer"),
            ("memory.pause", "weights"),
        ]

    def test_a_second_offload_is_a_logged_noop(self):
        engine = LifecycleEngineLike()
        engine.offload()
        with capture_events() as events:
            engine.offload()
        assert [e["event"] for e in events] == ["lifecycle.noop"]

    def test_onload_resumes_weights_then_optimizer(self):
        engine = LifecycleEngineLike()
        engine.offload()
        engine.onload()
        assert engine.lifecycle.state is State.AWAKE and not engine.is_offload
        assert released(engine) == set() and engine.mem["weights"] == 0

    def test_the_policy_keeps_groups_and_sleeps_after_no_train_step(self):
        policy = areal_trainer_policy()
        assert policy.memory_tags == TRAINER_TAGS and policy.sync_requires == ("weights",)
        assert (
            not policy.destroy_process_groups and not policy.offload_train and policy.discard_on_release == ()
        )


class TestWeightUpdate:
    def test_from_awake_the_optimizer_is_released_by_the_plan_and_the_writers_release_recorded(self):
        with capture_events() as events:
            engine, server = colocated()
            engine.rollout_engine = NoRollout()
            engine.onload()
            engine.train_batch()
            engine.update_weights(Meta(version=1))
        assert server.label == "v1"
        assert engine.lifecycle.state is State.PAUSED
        assert machine_released(engine) == released(engine) == set(TRAINER_TAGS)
        assert any(e["event"] == "rollout.absorbed" and "weights" in e["reason"] for e in events)
        trainer_lines = [json.dumps(e, default=str) for e in events if e.get("role") == "actor"]
        assert check_lines(trainer_lines) == []

    def test_from_paused_the_weights_are_woken_for_the_conversion(self):
        """The recover path reaches the transfer offloaded: the plan resumes the weights AReaL would."""
        engine, server = colocated()
        engine.rollout_engine = NoRollout()
        engine.offload()
        engine.update_weights(Meta(version=4))
        assert server.label == "v4"
        assert machine_released(engine) == released(engine) == set(TRAINER_TAGS)

    @pytest.mark.parametrize("then", ["save", "train"])
    def test_after_the_update_a_save_or_train_step_wakes_first(self, then):
        """AReaL leaves is_offload False after the transfer: its own save and train run on released storage."""
        for wrapped in (False, True):
            engine, _server = colocated(wrapped=wrapped)
            engine.rollout_engine = NoRollout()
            engine.onload()
            engine.update_weights(Meta(version=1))
            call = engine.save if then == "save" else engine.train_batch
            if not wrapped:
                with pytest.raises(ProtocolViolation, match="released"):
                    call(Meta(type="dcp"))
                continue
            call(Meta(type="dcp"))
            expected = set(TRAINER_TAGS) if then == "save" else set()
            assert machine_released(engine) == released(engine) == expected

    def test_a_failed_transfer_still_records_what_the_writer_released(self):
        engine, server = colocated()
        engine.rollout_engine = NoRollout()
        server.engine_paused = False  # the plugin never reads the queue
        engine.onload()
        with pytest.raises(ProtocolViolation, match="never processed"):
            engine.update_weights(Meta(version=1))
        assert machine_released(engine) == released(engine) == set(TRAINER_TAGS)

    def test_other_update_types_are_areals_own(self):
        """xccl and disk updates run AReaL's own update_weights (its _offload_aware_context), no machine."""

        class RecordingEngine(MegatronEngineLike):
            def update_weights(self, meta):
                self.updated = meta.type

        class Wrapped(ArealTrainerMixin, RecordingEngine):
            pass

        engine = Wrapped()
        engine.update_weights(Meta(type="disk"))
        assert engine.updated == "disk" and engine._lifecycle is None


class TestSaveLoad:
    def test_a_save_from_paused_wakes_saves_and_sleeps(self):
        engine = LifecycleEngineLike()
        engine.offload()
        engine.save(Meta(type="dcp"))
        assert (
            engine.saved == [0]
            and engine.lifecycle.state is State.PAUSED
            and released(engine) == set(TRAINER_TAGS)
        )

    def test_a_load_from_paused_is_asleep_again_after(self):
        engine = LifecycleEngineLike()
        engine.offload()
        engine.load(Meta(type="dcp"))
        assert engine.lifecycle.state is State.PAUSED and released(engine) == set(TRAINER_TAGS)

    def test_the_train_flag_call_is_not_a_train_step(self):
        """AReaL's train(mode) sets the modules' flag: no wake."""
        engine = LifecycleEngineLike()
        engine.offload()
        engine.train(True)
        assert engine.lifecycle.state is State.PAUSED


class TestFailures:
    def test_a_failed_release_leaves_failed_and_recover_asks_areals_set(self):
        engine = LifecycleEngineLike()
        engine.lifecycle  # noqa: B018 - configure
        faults = FaultInjector()
        engine.lifecycle.hooks = with_faults(faults, engine.lifecycle.hooks)
        engine.lifecycle._callables.clear()
        faults.arm("memory.pause", at=2)  # the weights' release: the optimizer's went through
        with pytest.raises(Exception, match=r"injected fault in memory\.pause"):
            engine.offload()
        assert engine.lifecycle.state is State.FAILED
        engine.lifecycle.recover(State.PAUSED)
        assert machine_released(engine) == released(engine) == set(TRAINER_TAGS)

    def test_no_adapter_means_areals_own_offload(self):
        engine = LifecycleEngineLike()
        engine._awex_adapter = None
        with pytest.raises(AttributeError):  # AReaL's TMS path: the adapter-less offload (here: none)
            engine.offload()
        assert engine._lifecycle is None

    def test_a_partly_released_adapter_is_refused_at_configuration(self):
        engine = LifecycleEngineLike()
        engine._awex_adapter.release_memory(["optimizer"])
        with pytest.raises(RuntimeError, match="configure the lifecycle before the first offload"):
            engine.offload()

    def test_a_lifecycle_call_before_the_adapter_exists_says_what_to_call(self):
        engine = LifecycleEngineLike()
        engine._awex_adapter = None
        with pytest.raises(RuntimeError, match="init_awex_adapter"):
            engine.lifecycle  # noqa: B018

    def test_awex_memory_refuses_other_objects_and_tags(self):
        with pytest.raises(TypeError, match="AwexMegatronAdapter"):
            AwexMemory(object())
        memory = AwexMemory(MegatronEngineLike()._awex_adapter)
        with pytest.raises(ValueError, match="not 'kv_cache'"):
            memory.pause("kv_cache")

    def test_the_grad_release_hook_is_areals_own_call(self):
        engine = MegatronEngineLike()
        engine._awex_adapter.ensure_grad_buffers()
        cleared = []
        GradBufferRelease(engine._awex_adapter, lambda: cleared.append(1))()
        assert engine.mem["grads"] is None and cleared == [1]


def test_the_colocated_world_starts_consistent():
    world = started(wrapped=True)
    assert world.trainer.lifecycle.state is State.PAUSED
    with pytest.raises(IllegalTransitionError):
        world.trainer.lifecycle.run("sync", lambda: None)  # the weights are released: sync needs them

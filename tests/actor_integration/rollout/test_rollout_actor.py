"""RolloutActor: the lifecycle drives the engine in SGLang's order, and syncs run in SYNCING."""

import os

import pytest

from actor_integration.models.tiny import TinyLMConfig, weights_checksum
from actor_integration.rollout import (
    ROLLOUT_POLICY,
    EngineGeneration,
    EngineMemory,
    ReferenceEngine,
    RolloutActor,
)
from actor_integration.weight_sync import (
    CorruptBucketError,
    RankSlot,
    StaleVersionError,
    WeightReceiver,
    WeightSender,
)
from actor_integration.weight_sync.shm import ShmReceiver, ShmSender
from lifecycle import IllegalTransitionError, State, capture_events
from tests.helpers.models import perturbed
from tests.helpers.weight_sync_doubles import shm_sender_into

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


def trained(seed):
    return perturbed(CONFIG, seed, scale=0.2)


class RecordingEngine:
    """The RolloutEngine surface, recording calls (for the adapters' contract)."""

    weight_version = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, *, max_new_tokens):
        self.calls.append("generate")
        return [[0] * max_new_tokens for _ in prompts]

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def pause_generation(self, mode="abort"):
        self.calls.append(("pause_generation", mode))

    def continue_generation(self):
        self.calls.append("continue_generation")

    def flush_cache(self):
        self.calls.append("flush_cache")

    def load_weights(self, version, shards, *, round_index, final):
        self.calls.append(("load_weights", version))

    def weights_checksum(self):
        return ""


@pytest.fixture
def actor():
    return RolloutActor(ReferenceEngine(CONFIG))


def sender_into(actor):
    return shm_sender_into(actor, bucket_bytes=1 << 20, deadline_s=5.0)


class TestAdapters:
    def test_memory_pause_and_resume_release_and_resume_one_tag(self):
        engine = RecordingEngine()
        memory = EngineMemory(engine)
        memory.pause("weights")
        memory.resume(None)
        with memory.disable():
            pass
        assert engine.calls == [("release", ["weights"]), ("resume", None)]

    def test_generation_pause_is_pause_flush_then_the_hook(self):
        engine, hooked = RecordingEngine(), []
        generation = EngineGeneration(
            engine, mode="retract", on_pause=lambda: hooked.append(list(engine.calls))
        )
        generation.pause()
        generation.resume()
        assert engine.calls == [("pause_generation", "retract"), "flush_cache", "continue_generation"]
        assert hooked == [[("pause_generation", "retract"), "flush_cache"]]

    def test_an_unknown_generation_mode_is_refused(self):
        with pytest.raises(ValueError, match="abort"):
            EngineGeneration(RecordingEngine(), mode="drop")

    def test_the_policy_is_the_rollout_one(self):
        assert ROLLOUT_POLICY.memory_tags == ("weights", "kv_cache")
        assert ROLLOUT_POLICY.sync_requires == ("weights",)
        assert ROLLOUT_POLICY.model_tag is None and ROLLOUT_POLICY.destroy_process_groups is False


class TestLifecycle:
    def test_sleep_pauses_flushes_then_releases_weights_then_kv(self):
        engine = RecordingEngine()
        actor = RolloutActor(engine)
        actor.sleep()
        assert engine.calls == [
            ("pause_generation", "abort"),
            "flush_cache",
            ("release", ["weights"]),
            ("release", ["kv_cache"]),
        ]
        assert _view(actor) == ("PAUSED", {"weights": "released", "kv_cache": "released"})
        actor.sleep()  # idempotent: nothing reaches the engine twice
        assert len(engine.calls) == 4

    def test_a_colocated_wake_is_weights_then_sync_then_kv(self, actor):
        actor.sleep()
        model = trained(5)
        actor.wake_up(["weights"])
        assert _view(actor) == ("PAUSED", {"weights": "resident", "kv_cache": "released"})
        sender_into(actor).send(1, model.named_weights())
        actor.wake_up(["kv_cache"])
        assert _view(actor) == ("AWAKE", {"weights": "resident", "kv_cache": "resident"})
        calls = actor.engine_calls()
        start = calls.index("resume_memory_occupation['weights']")
        assert calls[start:] == [
            "resume_memory_occupation['weights']",
            "load_weights(v1, round 0, final)",
            "resume_memory_occupation['kv_cache']",
            "continue_generation",
        ]
        assert actor.weights_checksum() == weights_checksum(model.named_weights())
        assert actor.generate([[3, 4]], 5) == model.generate([[3, 4]], max_new_tokens=5)

    def test_a_sync_into_released_weights_is_refused_by_the_lifecycle(self, actor):
        actor.sleep()
        with pytest.raises(IllegalTransitionError, match=r"wake_up\(tags=\['weights'\]\)"):
            actor.update_weights(1, [])
        assert actor.weight_version() == 0

    def test_generate_while_asleep_is_refused(self, actor):
        actor.sleep()
        with pytest.raises(IllegalTransitionError, match="wake_up"):
            actor.generate([[1]])

    def test_the_sync_body_runs_in_syncing(self, actor):
        with capture_events() as events:
            sender_into(actor).send(1, trained(1).named_weights())
        bodies = [e for e in events if e["event"] == "lifecycle.body" and e["operation"] == "sync"]
        assert bodies and all(e["state"] == State.SYNCING and e["ok"] for e in bodies)

    def test_cached_handles_are_dropped_when_the_rollout_sleeps(self, actor):
        sender = sender_into(actor)
        sender.send(1, trained(1).named_weights())
        sender.send(2, trained(2).named_weights())
        assert actor.open_handles() == 1  # one shm buffer, mapped once across both versions
        actor.sleep()
        assert actor.open_handles() == 0
        actor.wake_up(["weights"])
        sender.send(3, trained(3).named_weights())
        assert actor.open_handles() == 1
        sender.close()

    @pytest.mark.parametrize("goal", [State.AWAKE, State.PAUSED])
    def test_a_failed_release_is_recovered_by_asking_the_engine(self, actor, goal):
        """The reference engine reports its residency, so recover resolves the tag whose release raised."""
        release = actor.engine.release_memory_occupation

        def fail_on_kv(tags=None):
            if tags == ["kv_cache"]:
                raise RuntimeError("release failed")
            release(tags)

        actor.engine.release_memory_occupation = fail_on_kv
        with pytest.raises(RuntimeError, match="release failed"):
            actor.sleep()
        assert actor.lifecycle.residency["kv_cache"].value == "unknown"
        actor.engine.release_memory_occupation = release
        actor.lifecycle.recover(goal)
        expected = goal is State.AWAKE
        assert actor.lifecycle.state is goal and actor.engine.residency == {
            "weights": expected,
            "kv_cache": expected,
        }

    def test_an_engine_factory_is_built_inside_the_actor(self):
        actor = RolloutActor(lambda: ReferenceEngine(CONFIG))
        assert isinstance(actor.engine, ReferenceEngine)

    def test_an_object_that_is_no_engine_is_refused(self):
        with pytest.raises(TypeError, match="lacks"):
            RolloutActor(object())


class DiscardRecordingShm(ShmReceiver):
    """The real shm receiver, recording which descriptors were discarded unopened."""

    def __init__(self):
        super().__init__()
        self.discarded = []

    def discard(self, descriptor):
        self.discarded.append(descriptor)
        super().discard(descriptor)


class TestRefusedPayloadsAreAccountedFor:
    """cuda_ipc grants must be released even when the engine refuses: else the sender's buffers
    stay in torch's IPC limbo forever. The accounting is transport-independent; shm shows it."""

    def payloads(self, version):
        sender = ShmSender()
        captured = []
        WeightSender(
            RankSlot.single(0),
            None,
            sender,
            rank=0,
            engine_call=lambda v, p: captured.extend(p),
            bucket_bytes=4096,
            deadline_s=5.0,
            round_buckets=None,
        ).send(version, trained(version).named_weights())
        return sender, captured

    def test_a_sync_refused_by_the_lifecycle_discards_every_bucket(self):
        recording = DiscardRecordingShm()
        actor = RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(transports={"shm": recording}))
        actor.sleep()
        sender, payloads = self.payloads(1)
        with pytest.raises(IllegalTransitionError):
            actor.update_weights(1, payloads)
        assert recording.discarded == list(payloads[0].descriptors)
        sender.close()

    def test_a_stale_version_discards_every_bucket(self):
        recording = DiscardRecordingShm()
        actor = RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(transports={"shm": recording}))
        sender, payloads = self.payloads(0)
        with pytest.raises(StaleVersionError):
            actor.update_weights(0, payloads)
        assert recording.discarded == list(payloads[0].descriptors)
        sender.close()

    def test_a_bucket_that_fails_to_open_discards_only_the_ones_after_it(self):
        recording = DiscardRecordingShm()
        actor = RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(transports={"shm": recording}))
        sender, payloads = self.payloads(1)
        descriptors = payloads[0].descriptors
        assert len(descriptors) > 3
        os.truncate(descriptors[1].path, 3)
        with pytest.raises(CorruptBucketError, match="truncated"):
            actor.update_weights(1, payloads)
        assert recording.discarded == list(descriptors[2:])
        assert actor.weight_version() == 0
        sender.close()


def _view(actor):
    state = actor.lifecycle_state()
    return state["state"], state["residency"]


def _static_instancecheck(cls, instance):
    """Python 3.12's isinstance on a runtime protocol: members looked up statically, so a
    wrapper's `__getattr__` is not consulted."""
    import inspect

    members = [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]
    return all(inspect.getattr_static(instance, n, None) is not None for n in members)


class TestDelegatingWrappers:
    """An engine behind a delegating wrapper (the demo's fault injector, a user's tracing proxy)
    keeps its load path: RolloutActor asks for the methods as a call finds them."""

    def test_a_wrapped_in_place_engine_is_loaded_in_place_under_pythons_static_protocol_check(
        self, monkeypatch
    ):
        import typing

        from actor_integration.rollout.engine import LoadsInPlace, implements
        from actor_integration.tools.demo.rollout import FaultyEngine
        from lifecycle.faults import FaultInjector

        # Where isinstance is not static already (before 3.12), make it so, as 3.12 does it.
        monkeypatch.setattr(typing._ProtocolMeta, "__instancecheck__", _static_instancecheck)
        wrapped = FaultyEngine(ReferenceEngine(CONFIG), FaultInjector())
        assert not isinstance(wrapped, LoadsInPlace) and implements(wrapped, LoadsInPlace)
        actor = RolloutActor(wrapped)
        sender = shm_sender_into(actor, bucket_bytes=1 << 20, deadline_s=5.0)
        model = trained(1)
        sender.send(1, model.named_weights())
        assert actor.receiver.last_digest is True  # written by the receiver in place, and read back
        assert actor.weights_checksum() == weights_checksum(model.named_weights())
        sender.close()

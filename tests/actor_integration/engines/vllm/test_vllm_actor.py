"""vLLM under the rollout lifecycle (`VLLMRolloutActor`), weights through the lifecycle's sender into
the workers' receiver (a real one-rank shm sender, the real `LifecycleWorkerExtension` in the fake's
workers), or through vLLM's IPC weight transfer. What the lifecycle table refuses by itself is shown
here; the adapter's own refusals are in test_vllm_engine.py."""

import pytest
import torch

from actor_integration.engines.vllm import VLLMEngine, VLLMRolloutActor, make_engine
from actor_integration.errors import CorruptBucketError, MemoryStateError, SleepTagsError
from actor_integration.rollout.actor import RolloutActor
from lifecycle import IllegalTransitionError, State
from lifecycle.errors import InvalidWeightsError
from tests.helpers.vllm_fake import FakeLLM, weights
from tests.helpers.weight_sync_doubles import shm_sender_into, with_bad_checksum

PROMPTS = [[3, 1, 4], [1, 5]]


@pytest.fixture
def actor(make_engine, tmp_path):
    return VLLMRolloutActor(make_engine(sleep_level=2), log_dir=str(tmp_path))


def colocated_sync(actor, sender, version, tensors):
    """The colocated wake: the weights, the sync into them, then the KV cache."""
    actor.wake_up(["weights"])
    sender.send(version, tensors.items())
    actor.wake_up(["kv_cache"])


class TestCycles:
    def test_twenty_sleep_wake_sync_cycles_serve_identical_tokens_per_version(self, fake, actor):
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        tokens: dict[int, list[list[int]]] = {}
        for cycle in range(20):
            actor.sleep()
            assert fake.sleeping_tags == {"weights", "kv_cache"} and fake.level == 2
            version = cycle + 1
            colocated_sync(actor, sender, version, weights(version % 3))
            got = actor.generate(PROMPTS, max_new_tokens=6)
            tokens.setdefault(version % 3, got)
            assert got == tokens[version % 3], f"cycle {cycle}: the same weights served other tokens"
            assert actor.weight_version() == version
        assert len({str(t) for t in tokens.values()}) == 3
        assert not fake.warnings and fake.dead is None
        assert fake.sleeps.count(2) == 20  # one vLLM sleep per lifecycle sleep, both tags at once
        state = actor.lifecycle_state()
        assert state["state"] == "AWAKE"

    def test_a_sleep_asks_the_workers_to_release_only_after_a_round_reached_them(
        self, fake, actor, monkeypatch
    ):
        """Dropping the trainer's buffers is a call into every worker (1-3 ms on a GPU): the first sleep
        makes it (an engine built before may hold some), a later one only after a round reached them."""
        calls: list[str] = []
        rpc = fake.rpc
        monkeypatch.setattr(fake, "rpc", lambda method, args: (calls.append(method), rpc(method, args))[1])
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        assert calls.count("lifecycle_release") == 1
        colocated_sync(actor, sender, 1, weights(1))
        actor.sleep()
        assert calls.count("lifecycle_release") == 2  # the round opened the trainer's buffers
        actor.wake_up(["weights"])
        actor.wake_up(["kv_cache"])
        actor.sleep()
        assert calls.count("lifecycle_release") == 2  # nothing reached the workers since
        colocated_sync(actor, sender, 2, weights(2))
        assert actor.generate(PROMPTS, max_new_tokens=4)
        actor.sleep()
        assert calls.count("lifecycle_release") == 3

    def test_a_sleep_of_both_tags_is_one_vllm_sleep_through_the_audit(self, fake, actor):
        """The lifecycle's two pauses go over together (`VLLMMemory.pause_tags` through the release
        audit): vLLM is asked to sleep once, and the audit's first record carries what it freed (both
        tags, as vLLM reports them); a wake of both is one `wake_up`."""
        sizes = {"weights": 4096, "kv_cache": 256}  # what the fake's worker reports
        actor.memory_audit.free_bytes = lambda: (
            -sum(n for t, n in sizes.items() if t not in fake.sleeping_tags)
        )
        actor.sleep(["weights", "kv_cache"])
        # one sleep of both tags, in abort mode: vLLM's sleep pauses and clears the caches itself, so
        # no generation pause (a level-0 sleep) or prefix-cache reset goes before it
        assert fake.sleeps == [2] and fake.calls.count("reset_prefix_cache") == 0
        assert fake.calls.count("sleep") == 1 and fake.sleeping_tags == {"weights", "kv_cache"}
        assert [(m.tag, m.expected_bytes, m.measured_bytes) for m in actor.memory_audit.measurements] == [
            ("weights", 4096 + 256, 4096 + 256),
            ("kv_cache", 0, 0),
        ]
        calls = len(fake.calls)
        actor.wake_up()
        # both tags in one wake, which resumes vLLM's scheduling itself: no level-0 wake after it
        assert fake.calls[calls:] == ["wake_up"] and not fake.paused
        assert not fake.sleeping_tags and not fake.warnings and actor.lifecycle_state()["state"] == "AWAKE"

    def test_level_one_keeps_the_weights_and_wakes_without_a_sync(self, fake, make_engine, tmp_path):
        actor = VLLMRolloutActor(make_engine(sleep_level=1), log_dir=str(tmp_path))
        before = actor.generate(PROMPTS, max_new_tokens=4)
        actor.sleep()
        actor.wake_up()
        assert actor.generate(PROMPTS, max_new_tokens=4) == before
        assert fake.sleeps.count(1) == 1 and not fake.warnings

    def test_a_corrupt_round_is_refused_in_every_worker_and_nothing_loads(self, fake, actor):
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        actor.wake_up(["weights"])
        loads = fake.model.loads
        sender.corrupt_resends = 0
        call = sender.engine_call
        sender.engine_call = lambda version, payloads: call(version, [with_bad_checksum(p) for p in payloads])
        with pytest.raises(Exception, match="checksum") as info:
            sender.send(1, weights(1).items())
        assert isinstance(info.value, CorruptBucketError) or isinstance(
            info.value.__cause__, CorruptBucketError
        )
        assert fake.model.loads == loads
        assert actor.engine.guard.update_owner is None  # the claim is released with the refusal

    def test_the_workers_say_which_version_they_serve_and_their_checksum(self, fake, actor):
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        colocated_sync(actor, sender, 7, weights(7))
        assert [w.lifecycle_hello()["weight_version"] for w in fake.workers] == [7]
        assert actor.weights_checksum() == fake.workers[0].lifecycle_checksum()["sha256"]
        assert actor.wake_need_bytes() == 4096 + 256  # vLLM's own report: weights + KV cache

    def test_vllms_ipc_path_under_the_actor(self, fake, make_engine, tmp_path):
        """Without the worker extension, a round reaches vLLM through its own IPC weight transfer."""
        actor = VLLMRolloutActor(make_engine(worker_receiver=False), log_dir=str(tmp_path))
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        colocated_sync(actor, sender, 2, weights(2))
        assert torch.equal(fake.model.params["model.norm.weight"], weights(2)["model.norm.weight"])
        assert "update_weights" in fake.calls and actor.weight_version() == 2


class TestLifecycleRefusals:
    def test_level_two_without_a_reload_is_refused_by_the_table(self, fake, actor):
        actor.sleep()
        actor.wake_up()
        calls = list(fake.calls)
        with pytest.raises(InvalidWeightsError):
            actor.generate(PROMPTS)
        assert fake.calls == calls

    def test_generation_while_asleep_and_a_second_sleep_never_reach_vllm(self, fake, actor):
        actor.sleep()
        calls = list(fake.calls)
        with pytest.raises(IllegalTransitionError):
            actor.generate(PROMPTS)
        actor.sleep()  # the table absorbs a sleep of what already sleeps: nothing is called
        actor.sleep(["weights", "kv_cache"])
        assert fake.calls == calls and not fake.warnings

    def test_a_sync_while_the_weights_sleep_is_refused_by_the_table(self, fake, actor):
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        with pytest.raises(Exception) as info:
            sender.send(1, weights(1).items())
        chain = [info.value, info.value.__cause__]
        assert any(isinstance(e, IllegalTransitionError) for e in chain), chain
        assert "update_weights" not in fake.calls and fake.model.loads == 0

    def test_generating_after_waking_only_the_weights_is_refused_by_the_table(self, fake, actor, make_engine):
        sender = shm_sender_into(actor, bucket_bytes=1 << 10)
        actor.sleep()
        actor.wake_up(["weights"])
        sender.send(1, weights(1).items())
        calls = list(fake.calls)
        with pytest.raises(IllegalTransitionError):
            actor.generate(PROMPTS)
        assert fake.calls == calls and fake.sleeping_tags == {"kv_cache"}

    def test_a_sleep_of_one_tag_is_refused_before_the_lifecycle(self, fake, actor):
        for tags in (["weights"], ["kv_cache"]):
            with pytest.raises(SleepTagsError):
                actor.sleep(tags)
        assert "sleep" not in fake.calls and actor.lifecycle_state()["state"] == "AWAKE"

    def test_a_plain_rollout_actor_cannot_pair_the_tags_and_fails_before_vllm_sleeps(
        self, fake, make_engine, tmp_path
    ):
        """The generic actor releases one tag per call; the adapter refuses the first, vLLM untouched."""
        actor = RolloutActor(make_engine(), log_dir=str(tmp_path))
        with pytest.raises(SleepTagsError):
            actor.sleep()
        assert fake.sleeps == [0] and not fake.sleeping_tags  # paused (level 0), never released
        assert actor.lifecycle_state()["state"] == State.FAILED.value

    def test_an_engine_whose_memory_changed_behind_the_actor_is_refused_by_the_adapter(self, fake, actor):
        """vLLM put to sleep behind the lifecycle's back: the lifecycle allows the sleep, the adapter does not."""
        actor.engine.release_memory_occupation(None)
        with pytest.raises(MemoryStateError, match="36651"):
            actor.sleep()
        assert fake.sleeps.count(2) == 1 and not fake.warnings  # no second sleep reached vLLM


def test_make_engine_builds_the_offline_adapter(fake, vllm_tree):
    engine = make_engine(llm=FakeLLM(fake))
    assert isinstance(engine, VLLMEngine) and engine.describe()["engine"] == "vllm"
    assert engine.describe()["weights_via"] == "worker_extension"


class Delegating:
    """A wrapper that names the adapter it delegates to (`wrapped`) and records what went through it."""

    def __init__(self, engine):
        self.wrapped, self.seen = engine, []

    def __getattr__(self, name):
        self.seen.append(name)
        return getattr(self.wrapped, name)


def test_a_delegating_wrapper_is_driven_as_its_adapter_and_every_call_goes_through_it(
    fake, make_engine, tmp_path
):
    wrapper = Delegating(make_engine(sleep_level=1))
    actor = VLLMRolloutActor(wrapper, log_dir=str(tmp_path))
    actor.sleep()
    # one sleep, through it (vLLM's sleep pauses first: no level-0 pause before it)
    assert fake.sleeps == [1] and "release_memory_occupation" in wrapper.seen
    assert actor.lifecycle.policy.discard_on_release == ("kv_cache",)  # the wrapped engine's level 1
    with pytest.raises(TypeError, match="drives VLLMEngine or VLLMHTTPEngine, got Delegating"):
        VLLMRolloutActor(Delegating(object()), log_dir=str(tmp_path))

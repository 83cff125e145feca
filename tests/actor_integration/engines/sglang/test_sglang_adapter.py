"""SGLangEngine's behaviour on the flattened-bucket path and under the rollout's lifecycle, against
the source-shaped fake engine of each supported release (tests/helpers/sglang_fake.py)."""

import sys

import pytest
import structlog
import torch

from actor_integration.errors import EngineNotIdleError
from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout import RolloutActor, SGLangEngine
from actor_integration.rollout.engine import LoadsBuckets, LoadsPayloads
from actor_integration.weight_sync import WeightSyncError
from tests.helpers.models import perturbed
from tests.helpers.sglang_fake import FakeSGLang, flattened_bucket_codec
from tests.helpers.weight_sync_doubles import shm_sender_into

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)
KWARGS = {"model_path": "/models/tiny", "enable_memory_saver": True}


@pytest.fixture
def fake(sglang_tree):
    fake = FakeSGLang(sglang_tree, **KWARGS)
    with fake.installed():
        yield fake
    fake.close()


def bucket_engine(**kwargs):
    """An engine started without the scheduler-side receiver: verified flattened buckets."""
    return SGLangEngine(**KWARGS, scheduler_receiver=False, bucket_codec=flattened_bucket_codec, **kwargs)


def named_codec(named):
    """Stands in for SGLang's FlattenedTensorBucket over named tensors (the per-dtype path)."""
    from tests.helpers.sglang_fake import _Meta, _serialize

    flat, metadata, offset = [], [], 0
    for name, t in named:
        raw = t.contiguous().view(-1).view(torch.uint8)
        metadata.append(_Meta(name, tuple(t.shape), t.dtype, offset, offset + raw.numel()))
        flat.append(raw)
        offset += raw.numel()
    return _serialize({"flattened_tensor": torch.cat(flat), "metadata": metadata}, output_str=True)


def shards():
    rank0 = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16))]
    rank1 = [("w", torch.ones(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    return [rank0, rank1]


def send(actor, version, named, *, bucket_bytes=2048):
    sender = shm_sender_into(actor, bucket_bytes=bucket_bytes, deadline_s=5.0)
    try:
        return sender.send(version, named)
    finally:
        sender.close()


class TestBucketPath:
    def test_each_bucket_is_one_call_carrying_exactly_the_tensors_sent(self, fake):
        actor = RolloutActor(bucket_engine())
        assert isinstance(actor.engine, LoadsBuckets) and actor.engine.accepts_buckets
        assert not actor.engine.accepts_payloads("shm")
        actor.sleep()
        actor.wake_up(["weights"])
        model = perturbed(CONFIG, 1, scale=0.1)
        report = send(actor, 1, model.named_weights())
        calls = [u for u in fake.updates if u["load_format"] == "flattened_bucket"]
        assert len(calls) == report.buckets > 2
        received = {}
        for call in calls:
            assert len(call["ranks"]) == 1  # one payload per TP rank
            received.update(call["ranks"][0])
        # The KV cache is released during a colocated sync: nothing to flush until it is back.
        assert [c["flush_cache"] for c in calls] == [False] * report.buckets
        for name, tensor in model.named_weights().items():
            assert torch.equal(received[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
        assert actor.engine.weight_version == 1

    def test_the_last_call_of_a_version_flushes_when_the_kv_cache_is_resident(self, fake):
        engine = bucket_engine(multi_dtype_buckets=True, codec=named_codec)
        engine.load_weights(4, shards(), round_index=0, final=True)
        (call,) = fake.updates
        assert call["flush_cache"] is True and len(call["ranks"]) == 2  # one per TP rank, in slot order
        assert torch.equal(call["ranks"][1]["w"], torch.ones(2, 3))
        assert engine.weight_version == 4 and not fake.session_open

    def test_single_dtype_buckets_split_the_call_and_flush_once_at_the_end(self, fake):
        engine = bucket_engine(multi_dtype_buckets=False, codec=named_codec)
        assert not engine.accepts_buckets
        engine.load_weights(1, shards(), round_index=0, final=False)
        engine.load_weights(1, shards(), round_index=1, final=True)
        assert len(fake.updates) == 4
        assert [u["flush_cache"] for u in fake.updates] == [False, False, False, True]
        for update in fake.updates:
            for rank in update["ranks"]:
                assert len({t.dtype for t in rank.values()}) == 1
        assert not fake.session_open

    def test_a_refused_later_call_marks_the_weights_mixed_until_a_whole_version_loads(self, fake):
        engine = bucket_engine(multi_dtype_buckets=True, codec=named_codec)
        engine.load_weights(1, shards(), round_index=0, final=False)
        fake.refuse = "shape mismatch"
        with pytest.raises(WeightSyncError, match="shape mismatch"):
            engine.load_weights(1, shards(), round_index=1, final=True)
        with pytest.raises(RuntimeError, match="applied in part"):
            engine.generate([[1]])
        assert not fake.session_open  # closed on the failure, so the next version can open its own
        fake.refuse = None
        engine.load_weights(2, shards(), round_index=0, final=True)
        assert len(engine.generate([[1, 2]], max_new_tokens=3)[0]) == 3


class TestUnderTheLifecycle:
    def test_the_sleep_pauses_flushes_drops_handles_then_releases_each_tag(self, fake):
        actor = RolloutActor(SGLangEngine(**KWARGS), generation_mode="retract")
        assert isinstance(actor.engine, LoadsPayloads)
        fake.log.clear()
        actor.sleep()
        calls = [c for c, _ in fake.log]
        handles = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
        if not fake.sessions:
            handles = ["update_weights_from_tensor"]
        assert calls == ["pause_generation", "flush_cache", *handles, "release", "release", "release"]
        assert [v for c, v in fake.log if c == "release"] == [["weights"], ["kv_cache"], ["cuda_graph"]]

    def test_a_busy_engine_fails_the_sleep_before_any_release(self, fake):
        actor = RolloutActor(SGLangEngine(**KWARGS), generation_mode="in_place", flush_deadline_s=0)
        fake.queued = {"running": 2, "waiting": 1}
        with pytest.raises(EngineNotIdleError, match="still queued"):
            actor.sleep()
        assert not fake.released and fake.alive

    def test_the_engine_and_its_version_are_on_every_lifecycle_event(self, fake):
        """Each event of the rollout's machine says which engine and SGLang version it is about,
        and its three tags are released one by one."""
        actor = RolloutActor(SGLangEngine(**KWARGS))
        with structlog.testing.capture_logs() as logs:
            actor.sleep()
        (sleep,) = [e for e in logs if e["event"] == "lifecycle.transition"]
        released = [h["tag"] for h in sleep["hooks"] if h["name"] == "memory.pause"]
        assert released == ["weights", "kv_cache", "cuda_graph"]
        assert logs and all(e["engine"]["sglang"] == fake.version for e in logs)


def test_without_sglang_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r"rl-lifecycle\[sglang\]"):
        SGLangEngine(**KWARGS)

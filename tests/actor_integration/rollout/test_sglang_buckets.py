"""The SGLang adapter's bucket path: verified buckets go to `update_weights_from_tensor` whole, in
SGLang's flattened-bucket format, with no re-flattening; the codec binds to the pinned source."""

import pytest
import torch

from actor_integration.rollout import RolloutActor, SGLangEngine
from actor_integration.rollout.engine import LoadsBuckets
from actor_integration.rollout.sglang import sglang_bucket_codec
from actor_integration.tiny_model import TinyLMConfig
from actor_integration.weight_sync import RankSlot, WeightSender, WeightSyncError
from actor_integration.weight_sync.buckets import dtype_from_name
from actor_integration.weight_sync.shm import ShmSender
from tests.helpers.models import perturbed
from tests.helpers.sglang_source import SourceShapedSGLang

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


class RecordingSGLang:
    """`sglang.Engine.update_weights_from_tensor` with its real signature, recording each call."""

    def __init__(self, *, fail_at=None):
        self.calls = []
        self.fail_at = fail_at

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append((named_tensors, load_format, flush_cache))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            return False, "out of memory"
        return True, "Succeeded"

    def release_memory_occupation(self, tags=None): ...

    def resume_memory_occupation(self, tags=None): ...

    def flush_cache(self):
        return type("Flushed", (), {"success": True})()

    def generate(self, input_ids=None, sampling_params=None, **_):
        return [{"output_ids": [1] * sampling_params["max_new_tokens"]} for _ in input_ids]


def reconstruct(region, manifest):
    """What SGLang's FlattenedTensorBucket.reconstruct_tensors does with the metadata we send."""
    return {
        e.name: region[e.offset : e.offset + e.nbytes].view(dtype_from_name(e.dtype)).reshape(e.shape).clone()
        for e in manifest.entries
    }


def engine(fake):
    return SGLangEngine(
        fake,
        codec=lambda named: pytest.fail("the bucket path must not re-flatten tensors"),
        multi_dtype_buckets=True,
        bucket_codec=lambda region, manifest: reconstruct(region, manifest),
    )


def send(actor, version, named, *, bucket_bytes=2048):
    sender = WeightSender(
        RankSlot.single(0),
        None,
        ShmSender(),
        rank=0,
        engine_call=actor.update_weights,
        bucket_bytes=bucket_bytes,
        deadline_s=5.0,
    )
    try:
        return sender.send(version, named)
    finally:
        sender.close()


class TestBucketPath:
    def test_each_bucket_is_one_call_carrying_exactly_the_tensors_sent(self):
        fake = RecordingSGLang()
        actor = RolloutActor(engine(fake))
        assert isinstance(actor.engine, LoadsBuckets) and actor.engine.accepts_buckets
        model = perturbed(CONFIG, 1, scale=0.1)
        report = send(actor, 1, model.named_weights())
        assert len(fake.calls) == report.buckets > 2
        received = {}
        for payloads, load_format, _flush in fake.calls:
            assert load_format == "flattened_bucket" and len(payloads) == 1  # one payload per TP rank
            received.update(payloads[0])
        assert [flush for *_, flush in fake.calls] == [False] * (report.buckets - 1) + [True]
        for name, tensor in model.named_weights().items():
            assert torch.equal(received[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
        assert actor.engine.weight_version == 1

    def test_a_refused_later_bucket_marks_the_weights_mixed(self):
        fake = RecordingSGLang(fail_at=2)
        actor = RolloutActor(engine(fake))
        with pytest.raises(WeightSyncError, match="out of memory"):
            send(actor, 1, perturbed(CONFIG, 1, scale=0.1).named_weights())
        with pytest.raises(RuntimeError, match="applied in part"):
            actor.engine.generate([[1]], max_new_tokens=1)

    def test_without_multi_dtype_buckets_the_tensor_path_is_kept(self):
        plain = SGLangEngine(RecordingSGLang(), codec=lambda named: list(named), multi_dtype_buckets=False)
        assert not plain.accepts_buckets


@pytest.fixture
def shaped(sglang_tree):
    shaped = SourceShapedSGLang(sglang_tree)
    shaped.answers.update({"MultiprocessingSerializer.serialize": "base64-payload"})
    with shaped.installed():
        yield shaped


class TestAgainstTheSource:
    def test_the_bucket_codec_binds_to_sglang(self, shaped):
        """FlattenedTensorMetadata's fields, FlattenedTensorBucket's pre-flattened constructor and
        the serializer, as the pinned SGLang defines them."""
        from actor_integration.weight_sync import iter_buckets
        from actor_integration.weight_sync.buckets import ALIGN, WSUM64, pack_into, padded

        named = {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)}
        (bucket,) = iter_buckets(named, 1 << 20, align=ALIGN)
        region = torch.zeros(padded(bucket.nbytes, ALIGN), dtype=torch.uint8)
        pack_into(region, bucket)
        encode = sglang_bucket_codec()
        assert encode(region, bucket.manifest(0, WSUM64)) == "base64-payload"
        problems = shaped.problems()
        assert not problems, "\n".join(problems)
        assert {"FlattenedTensorMetadata()", "FlattenedTensorBucket()"} <= shaped.called()

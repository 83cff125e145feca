"""The workers' receiver (`LifecycleWorkerExtension`) across TP ranks: every rank verifies before
any loads, so one corrupt rank means no rank loads; a load that fails after verification leaves
the weights mixed, and the adapter refuses to serve them until a whole version loads."""

import pytest

from actor_integration.errors import CorruptBucketError, WeightsDiscardedError, WeightSyncError
from tests.helpers.vllm_fake import FakeLLM, FakeVLLM, sampling_params, weights
from tests.helpers.weight_sync_doubles import shm_sender, with_bad_checksum


@pytest.fixture
def tp2(vllm_tree):
    from actor_integration.engines.vllm import VLLMEngine

    fake = FakeVLLM(vllm_tree, weights(0), tp=2)
    return fake, VLLMEngine(FakeLLM(fake), sampling_params=sampling_params(vllm_tree))


def send_through(engine, version, tensors, change=lambda payloads: payloads):
    """A real one-rank shm sender whose round reaches both TP workers (each opens the same buffers)."""

    def call(v, payloads):
        both = change([payloads[0], payloads[0]])
        engine.check_payloads(both)
        return engine.load_payloads(v, both, round_index=payloads[0].round, final=payloads[0].final)

    sender = shm_sender(call, bucket_bytes=1 << 10)
    sender.corrupt_resends = 0
    try:
        sender.send(version, tensors.items())
    finally:
        sender.close()


def test_both_ranks_verify_then_load(tp2):
    fake, engine = tp2
    send_through(engine, 1, weights(1))
    assert fake.model.loads == 2 and engine.weight_version == 1  # each rank loaded its copy
    assert [w.lifecycle_hello()["weight_version"] for w in fake.workers] == [1, 1]
    assert [r["rank"] for r in engine.workers] == [0, 1]


def test_one_corrupt_rank_means_no_rank_loads(tp2):
    fake, engine = tp2
    with pytest.raises(Exception, match="checksum") as info:
        send_through(engine, 1, weights(1), lambda both: [both[0], with_bad_checksum(both[1])])
    assert isinstance(info.value, CorruptBucketError) or isinstance(info.value.__cause__, CorruptBucketError)
    assert fake.model.loads == 0 and engine.weight_version == 0
    assert engine.guard.update_owner is None and engine.release_payload_handles() >= 0


def test_a_load_that_fails_after_verification_leaves_the_weights_mixed(tp2, monkeypatch):
    fake, engine = tp2
    calls = []

    def flaky(weights):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("loader failed on rank 1")
        return set()

    monkeypatch.setattr(fake.model, "load_weights", flaky)
    with pytest.raises(Exception, match="after verification") as info:
        send_through(engine, 2, weights(2))
    error = info.value.__cause__ or info.value  # the sender wraps the engine's error
    assert isinstance(error, WeightSyncError) and error.fields["written"] is True
    with pytest.raises(WeightsDiscardedError, match="in part"):
        engine.generate([[1, 2]], max_new_tokens=2)
    monkeypatch.undo()
    send_through(engine, 3, weights(3))
    assert len(engine.generate([[1, 2]], max_new_tokens=2)[0]) == 2

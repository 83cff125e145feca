"""`SGLangHTTPEngine(scheduler_receiver=True)`: a round of the lifecycle's `WeightSender` reaches an
SGLang HTTP server's schedulers unopened, and the receiver there (`sglang_receiver.receive`, run by
the fake server as SGLang's scheduler runs a `custom_weight_loader`) opens the trainer's buffers
(shm on CPU), verifies and loads them; the rollout's process never maps them."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.engines.sglang.receiver import LOADER, PREFIX
from actor_integration.rollout import RolloutActor
from actor_integration.weight_sync import WeightSender
from actor_integration.weight_sync.wire import CorruptBucketError
from lifecycle import Contents
from tests.helpers.sglang_server import FakeSGLangServer, encode_names
from tests.helpers.weight_sync_doubles import shm_sender, with_bad_checksum


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
        "lm_head.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
    }


@pytest.fixture
def server():
    fake = FakeSGLangServer(custom_weight_loader=[LOADER])
    yield fake
    fake.close()


def client(server: FakeSGLangServer, **kwargs: Any) -> SGLangHTTPEngine:
    return SGLangHTTPEngine(
        server.url,
        scheduler_receiver=True,
        serialize_names=encode_names,
        timeout_s=10,
        codec=no_buckets,
        multi_dtype_buckets=False,
        **kwargs,
    )


def no_buckets(named: Any) -> Any:
    raise AssertionError("a flattened bucket was encoded: the round should have gone to the receiver")


def sender_for(engine_call: Any) -> WeightSender:
    return shm_sender(engine_call, bucket_bytes=1 << 11, deadline_s=10)  # several buckets per version


class TestSchedulerReceiverOverHTTP:
    def test_each_version_loads_exactly_what_the_trainer_sent_through_the_servers_receiver(self, server):
        engine = client(server)
        actor = RolloutActor(engine)
        sender = sender_for(actor.update_weights)
        rounds = 0
        try:
            for version, seed in ((1, 1), (2, 2)):
                sent = weights(seed)
                report = sender.send(version, sent.items())
                assert report.buckets > 1
                rounds += report.rounds
                loaded = server.model.loaded
                assert set(loaded) == set(sent)
                assert all(torch.equal(loaded[n], t) for n, t in sent.items())
                assert server.weight_version == str(version)
                assert actor.lifecycle.contents["weights"] is Contents.VALID
        finally:
            sender.close()
        formats = [b.get("load_format") for _, p, b in server.requests if p == "/update_weights_from_tensor"]
        assert len(formats) == 1 + rounds and set(formats) == {LOADER}  # hello, one call per round, no bucket
        assert engine.scheduler_pids
        assert actor.engine_timings()["scheduler_ms"] is not None  # the receiver's own reply came back

    def test_a_corrupt_bucket_is_refused_by_the_receiver_and_nothing_is_written(self, server):
        engine = client(server)
        captured: list[Any] = []
        sender = sender_for(lambda version, payloads: captured.extend(payloads) or {"version": version})
        try:
            sender.send(1, weights(1).items())
            good = captured[-1]
            engine.load_payloads(1, [good], round_index=0, final=True)
            before = {n: t.clone() for n, t in server.model.loaded.items()}
            sender.send(2, weights(2).items())
            payload = captured[-1]
            corrupt = with_bad_checksum(payload)
            with pytest.raises(CorruptBucketError) as refused:
                engine.load_payloads(2, [corrupt], round_index=0, final=True)
        finally:
            sender.close()
        assert refused.value.fields["written"] is False and refused.value.fields["version"] == 2
        assert all(torch.equal(server.model.loaded[n], t) for n, t in before.items())
        assert engine.weight_version == 1

    def test_a_server_without_the_receiver_is_refused_at_once_naming_the_flag(self):
        plain = FakeSGLangServer()
        try:
            with pytest.raises(
                ValueError,
                match=r"--custom-weight-loader actor_integration\.engines\.sglang\.receiver\.receive",
            ):
                client(plain)
            assert [p for _, p, _ in plain.requests] == ["/server_info"]  # nothing sent to the schedulers
        finally:
            plain.close()

    def test_a_client_without_the_flag_sends_flattened_buckets_as_before(self, server):
        engine = SGLangHTTPEngine(server.url, timeout_s=10, codec=no_buckets, multi_dtype_buckets=False)
        assert not engine.accepts_payloads("shm") and not engine.accepts_payloads("cuda_ipc")
        assert engine.release_payload_handles() == 0
        assert server.requests == []

    def test_the_sleep_closes_the_buffers_the_schedulers_hold_open(self, server):
        engine = client(server)
        actor = RolloutActor(engine)
        sender = sender_for(actor.update_weights)
        try:
            sender.send(1, weights(1).items())
            actor.sleep()
        finally:
            sender.close()
        paths = [p for _, p, _ in server.requests]
        ops = [op_of(b) for _, p, b in server.requests if p == "/update_weights_from_tensor"]
        assert ops[0] == "hello" and set(ops[1:-1]) == {"round"} and ops[-1] == "release"
        last = max(i for i, p in enumerate(paths) if p == "/update_weights_from_tensor")
        assert last < paths.index("/release_memory_occupation")  # closed before the memory goes


def op_of(body: dict[str, Any]) -> str:
    name = json.loads(base64.b64decode(body["serialized_named_tensors"][0]))[0]
    return str(json.loads(name[len(PREFIX) :])["op"])

"""The payload codec of `weight_sync.wire`: what a receiver inside an engine's processes (SGLang's
schedulers, vLLM's workers) gets through the engine's string-only calls."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from actor_integration.weight_sync.cuda_ipc import IpcBuffer
from actor_integration.weight_sync.wire import PAYLOAD_TRANSPORTS, decode_payload, encode_payload
from tests.helpers.weight_sync_doubles import shm_sender


@pytest.fixture
def payload() -> Any:
    """What a trainer rank's shm sender hands the engine for one round (the sender stays alive)."""
    captured: list[Any] = []

    def engine_call(version: int, payloads: list[Any]) -> dict[str, Any]:
        captured.extend(payloads)
        return {"version": version}

    sender = shm_sender(engine_call, bucket_bytes=1 << 12, deadline_s=10)
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(32, 8, generator=g), "a.bias": torch.randn(8, generator=g).bfloat16()}
    sender.send(1, tensors.items())
    yield captured[0]
    sender.close()


def through_json(payload: Any) -> Any:
    return decode_payload(json.loads(json.dumps(encode_payload(payload))))


class TestPayloadCodec:
    def test_payloads_cross_as_plain_json_and_come_back_equal(self, payload):
        """shm and cuda_ipc payloads, bytes fields included, survive the JSON unchanged."""
        assert through_json(payload) == payload
        ipc = dataclasses.replace(
            payload,
            transport="cuda_ipc",
            descriptors=(
                IpcBuffer("s:0:1", (0, b"\x00\xffhandle", 4096, 0, b"ref", 8, b"ev", True), 4096, b"e"),
            )
            * len(payload.descriptors),
        )
        assert through_json(ipc) == ipc

    @pytest.mark.parametrize("transport", ["nccl", "disk"])
    def test_a_transport_the_engines_processes_cannot_open_is_refused(self, payload, transport):
        assert transport not in PAYLOAD_TRANSPORTS
        with pytest.raises(ValueError, match=r"cuda_ipc.*shm"):
            encode_payload(dataclasses.replace(payload, transport=transport))

    def test_a_descriptor_of_another_transport_is_refused(self, payload):
        with pytest.raises(TypeError, match="cuda_ipc payload with a ShmRegion descriptor"):
            encode_payload(dataclasses.replace(payload, transport="cuda_ipc"))

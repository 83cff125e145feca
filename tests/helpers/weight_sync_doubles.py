"""Test doubles for weight sync: an engine of any checkpoint layout, and shm with device checksums.

`TensorsEngine` loads in place (`LoadsInPlace`): the receiver writes every round straight into
its tensors (it does not stage, so its weights are unknown from round 0 to the final round), and
`fingerprints` compares them with the trainer's tensor by tensor, bit for bit. `DeviceChecksumShm`
gives host buckets the checksum GPU buckets carry, so the receiver's two-pass path runs on CPU.
`one_rank_sender` is a real one-rank sender over any transport, `shm_sender` one over shm, into any engine call (`shm_sender_into`: a rollout
actor's `update_weights`); `with_bad_checksum` is a payload whose first bucket fails its checksum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from actor_integration.weight_sync import RankSlot, WeightSender, WeightTargets, kernels
from actor_integration.weight_sync.buckets import ALIGN, WSUM64, Bucket, BucketManifest, checksum, padded
from actor_integration.weight_sync.shm import ShmRegion, ShmSender
from actor_integration.weight_sync.wire import RankPayload


def fingerprints(named: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's WSUM64 over its bytes (position-weighted: moved or flipped words show)."""
    out = {}
    for name, tensor in named.items():
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[name] = checksum(data, data.numel(), WSUM64)
    return out


class TensorsEngine:
    """A `RolloutEngine` holding `specs` ((name, shape, dtype) triples) as tensors on `device`."""

    def __init__(self, specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]], device: str) -> None:
        self.weights = {n: torch.zeros(s, dtype=d, device=device) for n, s, d in specs}
        self.weight_version = 0
        self.stages_weights = False
        self.calls: list[str] = []
        self._one_round = WeightTargets([self.weights], complete=True)
        self._rounds = WeightTargets([self.weights])

    def weight_targets(self, version: int, *, round_index: int, final: bool) -> WeightTargets:
        return self._one_round if round_index == 0 and final else self._rounds

    def weights_written(self, version: int, names: Any, *, round_index: int, final: bool) -> None:
        self.calls.append(f"written(v{version}, round {round_index})")
        if final:
            self.weight_version = version

    def load_weights(self, version: int, shards: Any, *, round_index: int, final: bool) -> None:
        for name, view in shards[0]:
            self.weights[name].copy_(view)
        if final:
            self.weight_version = version

    def fingerprints(self) -> dict[str, int]:
        return fingerprints(self.weights)

    def generate(self, prompts: Any, *, max_new_tokens: int) -> list[list[int]]:
        return [[] for _ in prompts]

    def release_memory_occupation(self, tags: Any = None) -> None:
        self.calls.append("release")

    def resume_memory_occupation(self, tags: Any = None) -> None:
        self.calls.append("resume")

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> bool:
        return True

    def weights_checksum(self) -> str:
        return str(sorted(self.fingerprints().items()))


class DeviceChecksumShm(ShmSender):
    """shm whose host buckets carry WSUM64, the checksum GPU buckets carry (packed by the device
    packer's torch path), so the receiver's two-pass path runs here on CPU as it does on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.host_packer = kernels.DevicePacker(torch.device("cpu"))
        self.exported: list[Bucket] = []

    def export(self, position: int, bucket: Bucket) -> ShmRegion:
        mapped = self._file(position, padded(bucket.nbytes, ALIGN))
        assert mapped.tensor is not None
        self.host_packer.pack(position, mapped.tensor, bucket)
        self.exported.append(bucket)
        return ShmRegion(str(mapped.path), bucket.nbytes)

    def ready(self) -> list[BucketManifest]:
        exports, self.exported = self.exported, []
        return [b.manifest(v, WSUM64) for b, v in zip(exports, self.host_packer.seal(), strict=True)]


def one_rank_sender(
    engine_call: Callable[[int, list[RankPayload]], Any],
    transport: Any,
    *,
    bucket_bytes: int,
    deadline_s: float = 30.0,
    **options: Any,
) -> WeightSender:
    """A real one-rank sender over `transport` (ShmSender, CudaIpcSender) whose rounds go to
    `engine_call` (`options`: WeightSender's others)."""
    return WeightSender(
        RankSlot.single(0),
        None,
        transport,
        rank=0,
        engine_call=engine_call,
        bucket_bytes=bucket_bytes,
        deadline_s=deadline_s,
        **options,
    )


def shm_sender(
    engine_call: Callable[[int, list[RankPayload]], Any],
    *,
    bucket_bytes: int,
    deadline_s: float = 30.0,
    **options: Any,
) -> WeightSender:
    """A real one-rank shm sender whose rounds go to `engine_call` (`options`: WeightSender's others)."""
    return one_rank_sender(
        engine_call, ShmSender(), bucket_bytes=bucket_bytes, deadline_s=deadline_s, **options
    )


def shm_sender_into(actor: Any, *, bucket_bytes: int, deadline_s: float = 30.0) -> WeightSender:
    """A real one-rank shm sender whose engine call is a rollout actor's `update_weights`."""
    return shm_sender(actor.update_weights, bucket_bytes=bucket_bytes, deadline_s=deadline_s)


def with_bad_checksum(payload: RankPayload) -> RankPayload:
    """`payload` with its first bucket's checksum off by one bit (the bytes as sent)."""
    first = payload.buckets[0]
    return dataclasses.replace(
        payload, buckets=(dataclasses.replace(first, checksum=first.checksum ^ 1), *payload.buckets[1:])
    )

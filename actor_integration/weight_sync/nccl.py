"""Broadcast transport for engines that do not share the trainer's GPUs (`nccl`).

The trainer's source rank and the engine ranks join one process group (NCCL between GPUs;
any torch.distributed backend works, tests use gloo). The sender packs each bucket into a
reused buffer and broadcasts it in `push()`, which the protocol runs while the engine is inside
its weight-load call; the receiver posts the matching broadcasts in `open()`. Refused toward a
colocated engine by `select_transport`: NCCL cannot connect two ranks on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from actor_integration.weight_sync.buckets import (
    ALIGN,
    CRC32,
    NONE,
    WSUM64,
    Bucket,
    BucketManifest,
    checksum,
    pack_into,
    padded,
)
from actor_integration.weight_sync.kernels import DevicePacker
from actor_integration.weight_sync.transport import ReceiverTransport, SenderTransport


@dataclass(frozen=True)
class Broadcast:
    """Descriptor: the bucket arrives by the position-th broadcast of the round."""

    position: int
    length: int  # bytes broadcast (the bucket padded to whole words)


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


class _Buffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = []

    def get(self, position: int, need: int) -> torch.Tensor:
        while len(self._buffers) <= position:
            self._buffers.append(None)
        current = self._buffers[position]
        if current is None or current.numel() < need:
            self._buffers[position] = None
            current = torch.empty(max(need, 1), dtype=torch.uint8, device=self.device)
            self._buffers[position] = current
        return current

    def clear(self) -> None:
        self._buffers.clear()


class NcclSender(SenderTransport):
    name: ClassVar[str] = "nccl"
    default_round_buckets: ClassVar[int | None] = 1

    def __init__(self, group: Any, *, src: int, device: torch.device | str | int | None = None) -> None:
        super().__init__()
        if not isinstance(src, int):
            raise ValueError(f"NcclSender: src must be the sender's global rank (int), got {src!r}")
        self._group = group
        self._src = src
        self.device = _device(device)
        self._packer = DevicePacker(self.device) if self.device.type == "cuda" else None
        self._buffers = _Buffers(self.device)
        self._round: list[tuple[torch.Tensor, int]] = []
        self._exports: list[tuple[Bucket, int | None]] = []  # host CRC32, or None: on the device

    def begin_round(self, version: int, round_index: int) -> None:
        super().begin_round(version, round_index)
        self._round.clear()
        self._exports.clear()
        if self._packer is not None:
            self._packer.discard()

    def export(self, position: int, bucket: Bucket) -> Broadcast:
        length = padded(bucket.nbytes, ALIGN)
        region = self._buffers.get(position, length)
        if self._packer is not None:
            self._packer.pack(position, region, bucket)
            self._exports.append((bucket, None))
        else:
            pack_into(region, bucket)
            region[bucket.nbytes : length].zero_()
            self._exports.append((bucket, checksum(region, bucket.nbytes, CRC32)))
        self._round.append((region, length))
        return Broadcast(position, length)

    def ready(self) -> list[BucketManifest]:
        device_values = iter(self._packer.seal() if self._packer is not None else [])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        exports, self._exports = self._exports, []
        manifests = []
        for bucket, host_value in exports:
            kind, value = (WSUM64, next(device_values)) if host_value is None else (CRC32, host_value)
            manifests.append(bucket.manifest(value, kind) if self.checksums else bucket.manifest(0, NONE))
        return manifests

    def push(self) -> None:
        for region, length in self._round:
            dist.broadcast(region[:length], src=self._src, group=self._group)

    def end_round(self) -> None:
        self._round.clear()

    def release(self) -> None:
        self._round.clear()
        self._buffers.clear()
        if self._packer is not None:
            self._packer.clear()


class NcclReceiver(ReceiverTransport):
    """Receives the sender's broadcasts, in order, into reused buffers on `device`."""

    name: ClassVar[str] = "nccl"

    def __init__(self, group: Any, *, src: int, device: torch.device | str | int | None = None) -> None:
        self._group = group
        self._src = src
        self.device = _device(device)
        self._buffers = _Buffers(self.device)

    def open(self, manifest: BucketManifest, descriptor: Any, *, gpu: int | None) -> torch.Tensor:
        if not isinstance(descriptor, Broadcast):
            raise TypeError(f"nccl receiver got a {type(descriptor).__name__} descriptor")
        region = self._buffers.get(descriptor.position, descriptor.length)
        dist.broadcast(region[: descriptor.length], src=self._src, group=self._group)
        return region

    def close_round(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def discard(self, descriptor: Any) -> None:
        # The sender broadcasts regardless: receive and drop, or its push would never complete.
        if isinstance(descriptor, Broadcast):
            region = self._buffers.get(descriptor.position, descriptor.length)
            dist.broadcast(region[: descriptor.length], src=self._src, group=self._group)

    def release(self) -> None:
        self._buffers.clear()

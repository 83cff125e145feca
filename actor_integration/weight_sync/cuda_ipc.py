"""CUDA IPC transport: staging buffers kept across updates, handles opened once and reused.

Opening a handle costs far more than the copy behind it, the more so the smaller the bucket
(docs/measurements.md#cuda-ipc-handles-2026-11-29). So the sender keeps one staging buffer per
bucket position (and round parity) across updates, and the receiver caches the opened handle per
buffer identity. Packing is one fused kernel per bucket (kernels.py) that leaves the bucket's
checksum in a 16-byte trailer after it (`WSUM64_DEVICE`); the sender then records an IPC event and
hands the round over without waiting for the device: the receiver's stream waits on that event, so
the hand-over, the engine call and the receiver's set-up overlap the packing.
Staging buffers are allocated inside the memory backend's `disable()` and in a private pool:
torch_memory_saver memory is cuMem virtual memory and cannot be exported (slime #2188), and the
private pool keeps the caching allocator from handing back a block carved under the saver.

Reference counting follows torch's own rule (torch/multiprocessing/reductions.py): every export
is one `_share_cuda_()` grant (made on a storage created for that export, so that torch's record
of it goes when the grant is given back: `CudaIpcSender._share`) with a counter of 1 that the consumer releases exactly once, by
closing the mapping it opened with that grant, or at once when it already holds the buffer open
(a cache hit) or refuses the payload (`discard`). A buffer the sender frees while the rollout
still maps it waits in torch's IPC limbo; the rollout drops its handles when it sleeps, so no
cache pins trainer memory (slime #1731).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils.dlpack

from actor_integration.errors import CorruptBucketError
from actor_integration.weight_sync import kernels
from actor_integration.weight_sync.buckets import (
    ALIGN,
    CHECKSUM_TRAILER,
    NONE,
    WSUM64_DEVICE,
    ArenaBucket,
    Bucket,
    BucketManifest,
    checksum_trailer,
    padded,
)
from actor_integration.weight_sync.kernels import DevicePacker
from actor_integration.weight_sync.topology import local_device_index, physical_gpu_id
from actor_integration.weight_sync.transport import ReceiverTransport, SenderTransport
from lifecycle.hooks import MemoryDisable

_CAPACITY_STEP = 2 << 20  # round capacities up so small growth does not reallocate every update


@dataclass(frozen=True)
class IpcBuffer:
    """Descriptor of one exported staging buffer: its identity and this export's grant."""

    buffer_id: str  # "<sender>:<slot>:<generation>": a new id means a new allocation
    share: tuple[Any, ...]  # `UntypedStorage._share_cuda_()` of the buffer for this export
    capacity: int
    ready: bytes | None = None  # IPC handle of the sender's event recorded after the packing

    @property
    def slot_key(self) -> str:
        sender, position, _generation = self.buffer_id.split(":")
        return f"{sender}:{position}"

    def release_grant(self) -> None:
        """Tell the sender this export's grant is used up (torch's `_release_ipc_counter`)."""
        ref_counter_handle, ref_counter_offset = self.share[4], self.share[5]
        torch.UntypedStorage._release_ipc_counter_cuda(ref_counter_handle, ref_counter_offset)


@dataclass
class _Staging:
    tensor: torch.Tensor
    buffer_id: str
    capacity: int


class CudaIpcSender(SenderTransport):
    """Packs with the fused gather kernel (checksum in the same pass, no host sync per bucket) into
    staging buffers kept per position, and per round parity when pipelined (round r + 1 packs
    while round r loads)."""

    name: ClassVar[str] = "cuda_ipc"
    default_round_buckets: ClassVar[int | None] = None
    double_buffered: ClassVar[bool] = True

    def __init__(
        self,
        *,
        device: torch.device | str | int | None = None,
        memory: MemoryDisable | None = None,
    ) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise ValueError("weight transport 'cuda_ipc' needs CUDA; on a machine without GPUs use 'shm'")
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaIpcSender: device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._memory = memory
        self._pool: Any = None
        self._staging: dict[str, _Staging] = {}
        self._generation = 0
        self._packer = DevicePacker(self.device)
        self._exports: list[Bucket] = []
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}  # per round parity
        self.allocations = 0  # staging buffers allocated so far (tests check reuse)
        self._alias_exports = True  # export through a storage made per export (`_share`)
        self.alias_exports = 0  # exports made that way (tests check the path is taken)
        self._gpu = physical_gpu_id(os.environ.get("CUDA_VISIBLE_DEVICES"), self.device.index or 0)
        kernels.warm_up(self.device)  # at configuration, not in the first sync

    @property
    def gpu(self) -> int:
        return self._gpu

    @property
    def staging_bytes(self) -> int:
        """Device memory held by the staging buffers now (arenas included)."""
        return sum(s.capacity for s in self._staging.values())

    def begin_round(self, version: int, round_index: int) -> None:
        super().begin_round(version, round_index)
        self._exports.clear()
        self._packer.discard()

    def export(self, position: int, bucket: Bucket) -> IpcBuffer:
        if isinstance(bucket, ArenaBucket):
            staging = self._staging.get(bucket.slot)
            if staging is None or staging.tensor is not bucket.region:
                raise ValueError(
                    "cuda_ipc: this arena's buffers were released (sender.release() or a new arena); "
                    "make a new arena with sender.arena(...)"
                )
            if self.checksums:
                self._packer.checksum(
                    staging.tensor,
                    bucket.nbytes,
                    sums=checksum_trailer(staging.tensor, bucket.nbytes),
                    key=bucket.slot,
                )
        else:
            key = f"r{self._parity}p{position}"
            staging = self._buffer(key, padded(bucket.nbytes, ALIGN) + CHECKSUM_TRAILER)
            self._packer.pack(
                key, staging.tensor, bucket, sums=checksum_trailer(staging.tensor, bucket.nbytes)
            )
        try:
            share = self._share(staging.tensor)
        except RuntimeError as exc:
            raise RuntimeError(
                f"cuda_ipc: the staging buffer on {self.device} cannot be exported ({exc}). Under "
                "torch_memory_saver every allocation is cuMem virtual memory unless made inside "
                "disable(): pass memory=<the torch_memory_saver singleton> to the sender, or use "
                "transport 'shm'."
            ) from exc
        self._exports.append(bucket)
        return IpcBuffer(staging.buffer_id, share, staging.capacity, self._event()[1])

    def _share(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """torch's IPC export of the buffer (`_share_cuda_()`), made on a storage created for this
        export. `_share_cuda_()` wraps the storage it is called on in one more ref-counted record
        holding an interprocess CUDA event, for as long as that storage lives
        (torch/csrc/StorageSharing.cpp, CudaIPCTypes.cpp): on a staging buffer kept for the whole
        job the records pile up, one per update, and once the process holds 1,000 of those events
        torch synchronises the stream on every later export, so the host waits for each bucket's
        packing. The export's own storage (DLPack: the same memory, keeping the buffer alive)
        carries the record instead; dropped here, it waits in torch's IPC limbo until the receiver
        gives the grant back, and goes at the next export with its event. A torch that cannot
        make it gets the buffer's own storage shared, as before."""
        if self._alias_exports:
            try:
                alias = torch.utils.dlpack.from_dlpack(tensor)
                if alias.data_ptr() != tensor.data_ptr():
                    raise TypeError("DLPack gave a copy")
                share = tuple(alias.untyped_storage()._share_cuda_())  # type: ignore[no-untyped-call]
            except (RuntimeError, TypeError, BufferError):
                self._alias_exports = False  # this torch cannot: the buffer's own storage from now on
            else:
                self.alias_exports += 1
                return share
        return tuple(tensor.untyped_storage()._share_cuda_())  # type: ignore[no-untyped-call]

    def ready(self) -> list[BucketManifest]:
        # No wait: the receiver's stream waits on this event, and the checksums stay in each
        # buffer's trailer, so the hand-over overlaps the packing still running on the device.
        self._event()[0].record(torch.cuda.current_stream(self.device))
        buckets, self._exports = self._exports, []
        kind = WSUM64_DEVICE if self.checksums else NONE
        return [b.manifest(0, kind) for b in buckets]

    @property
    def _parity(self) -> int:
        return self.round_index % 2 if self.pipelined else 0

    def _event(self) -> tuple[torch.cuda.Event, bytes]:
        found = self._events.get(self._parity)
        if found is None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                event.record()  # an IPC handle needs a recorded event
                found = self._events[self._parity] = (event, event.ipc_handle())  # type: ignore[no-untyped-call]
        return found

    def abandon(self, descriptors: Sequence[Any]) -> None:
        for descriptor in descriptors:
            if isinstance(descriptor, IpcBuffer):
                descriptor.release_grant()

    def arena_regions(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Staging buffers for an arena: bucket i of the arena lives in region i."""
        for key in [k for k in self._staging if k.startswith("a")]:
            del self._staging[key]
        return [
            self._buffer(f"a{i}", padded(n, ALIGN) + CHECKSUM_TRAILER).tensor for i, n in enumerate(sizes)
        ]

    def _buffer(self, key: str, need: int) -> _Staging:
        current = self._staging.get(key)
        if current is not None and current.capacity >= need:
            return current
        self._staging.pop(key, None)  # free the old buffer before allocating a larger one
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        capacity = max(_CAPACITY_STEP, -(-need // _CAPACITY_STEP) * _CAPACITY_STEP)
        context = self._memory.disable() if self._memory is not None else contextlib.nullcontext()
        with context, torch.cuda.device(self.device):
            if self._pool is None and hasattr(torch.cuda, "MemPool"):
                self._pool = torch.cuda.MemPool()
            pool_context = (
                torch.cuda.use_mem_pool(self._pool) if self._pool is not None else contextlib.nullcontext()
            )
            with pool_context:
                tensor = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.allocations += 1
        staging = _Staging(tensor, f"{self.sender_id}:{key}:{self._generation}", capacity)
        self._staging[key] = staging
        self._generation += 1
        return staging

    def release(self) -> None:
        if not self._staging and self._pool is None:
            return
        torch.cuda.synchronize(self.device)
        self._staging.clear()
        self._packer.clear()
        self._events.clear()
        self._pool = None
        # Blocks a receiver still maps stay in torch's IPC limbo until it lets go; collect the rest.
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _release_grants(descriptors: list[IpcBuffer]) -> None:
    for descriptor in descriptors:
        descriptor.release_grant()


@dataclass
class _Opened:
    storage: Any
    tensor: torch.Tensor


class CudaIpcReceiver(ReceiverTransport):
    """Opens each sender buffer once; `release()` closes them all. A round's reads are ordered
    after the sender's packing by waiting (on the device) for the event its descriptors name."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self) -> None:
        self._opened: dict[str, _Opened] = {}
        self._devices: set[int] = set()
        self.handles_opened = 0  # IPC opens so far (tests check reuse)
        self._unneeded: list[IpcBuffer] = []  # grants of exports whose buffer was already mapped
        self._events: dict[bytes, torch.cuda.Event] = {}  # the senders' packing events, opened once
        self._waited: set[tuple[bytes, int]] = set()  # (event, device) waited on this round

    @property
    def open_handles(self) -> int:
        return len(self._opened)

    def open(self, manifest: BucketManifest, descriptor: Any, *, gpu: int | None) -> torch.Tensor:
        if not isinstance(descriptor, IpcBuffer):
            raise TypeError(f"cuda_ipc receiver got a {type(descriptor).__name__} descriptor")
        opened = self._opened.get(descriptor.buffer_id)
        if opened is not None:
            self._unneeded.append(descriptor)  # already mapped: this export's grant is not needed
        else:
            opened = self._open(descriptor, gpu)
        device = opened.tensor.device
        self._devices.add(device.index or 0)
        need = padded(manifest.nbytes, ALIGN) + (
            CHECKSUM_TRAILER if manifest.checksum_kind == WSUM64_DEVICE else 0
        )
        if opened.tensor.numel() < need or descriptor.capacity < manifest.nbytes:
            raise CorruptBucketError(
                f"cuda_ipc: buffer {descriptor.buffer_id} holds {opened.tensor.numel()} bytes but bucket "
                f"{manifest.index} needs {need}: truncated"
            )
        if descriptor.ready is not None and (descriptor.ready, device.index or 0) not in self._waited:
            event = self._events.get(descriptor.ready)
            if event is None:
                event = self._events[descriptor.ready] = torch.cuda.Event.from_ipc_handle(  # type: ignore[no-untyped-call]
                    device, descriptor.ready
                )
            torch.cuda.current_stream(device).wait_event(event)  # no host wait
            self._waited.add((descriptor.ready, device.index or 0))
        return opened.tensor

    def _open(self, descriptor: IpcBuffer, gpu: int | None) -> _Opened:
        # The sender reallocated this position: drop the stale mapping first.
        for key in [k for k in self._opened if k.rsplit(":", 1)[0] == descriptor.slot_key]:
            del self._opened[key]
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            device = local_device_index(gpu, visible) if gpu is not None else int(descriptor.share[0])
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(device, *descriptor.share[1:])
                tensor = torch.empty(0, dtype=torch.uint8, device=storage.device)
                tensor.set_(storage, 0, (storage.nbytes(),), (1,))
        except BaseException:
            descriptor.release_grant()  # never mapped: give the grant back so the buffer can be freed
            raise
        opened = _Opened(storage, tensor)  # closing the mapping releases this export's grant
        self._opened[descriptor.buffer_id] = opened
        self.handles_opened += 1
        return opened

    def discard(self, descriptor: Any) -> None:
        if isinstance(descriptor, IpcBuffer):
            descriptor.release_grant()

    def settle(self) -> None:
        # Releasing a grant maps torch's counter file (~7 µs on the H200 host): done inline while
        # the device copies. In a thread it cost more, by holding the GIL the reply needed.
        if self._unneeded:
            batch, self._unneeded = self._unneeded, []
            _release_grants(batch)

    def close_round(self) -> None:
        # The sender may overwrite its buffers once we acknowledge: finish our copies first.
        for device in self._devices:
            torch.cuda.synchronize(device)
        self.settle()
        self._waited.clear()

    def release(self) -> None:
        self.close_round()
        self._opened.clear()
        self._devices.clear()
        self._events.clear()

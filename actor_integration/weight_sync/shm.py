"""Shared-host-memory transport: buckets in files under /dev/shm, mapped by both sides.

Plain files with mmap rather than `multiprocessing.shared_memory`: its resource tracker
belongs to one process tree and unlinks or warns about segments that unrelated processes
(Ray workers) still use. The sender creates one file per bucket position and reuses it, so its
host memory stays at one bucket (one position per round by default); it unlinks the files on
`release()`/`close()` and when garbage-collected. The receiver keeps its mappings across rounds
and drops them on `release()`.

Tensors on a GPU are packed there by the fused kernel (checksum in the same pass) into one reused
device buffer and copied to the file in one DMA: both sides register their mapping with CUDA
(`cudaHostRegister`), so the copies run at pinned-memory speed. Host tensors are packed on the
host and checksummed with CRC32.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from actor_integration.errors import CorruptBucketError, WeightSyncError
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
from actor_integration.weight_sync.transport import (
    ReceiverTransport,
    SenderTransport,
    check_directory,
)

DEFAULT_DIRECTORY = "/dev/shm"
_CAPACITY_STEP = 1 << 20


@dataclass(frozen=True)
class ShmRegion:
    """Descriptor: a bucket at the start of a shared-memory file."""

    path: str
    nbytes: int


class _MappedFile:
    """A file in shared memory mapped read-write; unlinked when closed or collected."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve the pages now: a tmpfs that runs out under a live mapping kills the
                # process with SIGBUS on the next write (Docker's /dev/shm is 64 MiB by default).
                os.posix_fallocate(fd, 0, capacity)
            except OSError as exc:
                os.unlink(path)
                free = shutil.disk_usage(path.parent).free
                raise WeightSyncError(
                    f"shm: cannot reserve {capacity >> 20} MiB in {path.parent} ({free >> 20} MiB free: "
                    f"{exc.strerror}). Enlarge it (docker --shm-size), lower bucket_bytes, or use transport "
                    "'disk'."
                ) from exc
            self._map = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, str(path))
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        if not self.pinned and self.tensor is not None:
            self.pinned = host_register(self.tensor)

    def close(self) -> None:
        if self.pinned and self.tensor is not None:
            host_unregister(self.tensor)
            self.pinned = False
        self.tensor = None  # drop the buffer export before closing the map
        with contextlib.suppress(BufferError):  # a view is still alive; the map closes when it goes
            self._map.close()
        self._finalizer()


def host_register(tensor: torch.Tensor) -> bool:
    """Page-lock a mapped host buffer for CUDA (async DMA at pinned speed); False if refused.

    Only once this process uses CUDA: registering would create a context in one that does not."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized() or not tensor.numel():  # type: ignore[no-untyped-call]
        return False
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    return int(error) == 0


def host_unregister(tensor: torch.Tensor) -> None:
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(tensor.data_ptr())


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ShmSender(SenderTransport):
    name: ClassVar[str] = "shm"
    default_round_buckets: ClassVar[int | None] = 1

    def __init__(self, *, directory: str | os.PathLike[str] = DEFAULT_DIRECTORY) -> None:
        super().__init__()
        self.directory = check_directory(directory, what="shm transport", create=False)
        self._files: list[_MappedFile | None] = []
        self.allocations = 0
        self._staging: torch.Tensor | None = None  # device packing buffer (GPU tensors)
        self._packer: DevicePacker | None = None
        self._exports: list[tuple[Bucket, str, int | None]] = []  # kind, host value (None: on the device)

    def begin_round(self, version: int, round_index: int) -> None:
        super().begin_round(version, round_index)
        self._exports.clear()
        if self._packer is not None:
            self._packer.discard()

    def export(self, position: int, bucket: Bucket) -> ShmRegion:
        mapped = self._file(position, padded(bucket.nbytes, ALIGN))
        assert mapped.tensor is not None
        device = next((t.device for t in bucket.tensors if t.is_cuda), None)
        if device is None:
            pack_into(mapped.tensor, bucket)
            if self.checksums:
                self._exports.append((bucket, CRC32, checksum(mapped.tensor, bucket.nbytes, CRC32)))
            else:
                self._exports.append((bucket, NONE, 0))
        else:
            mapped.pin()
            staging = self._device_buffer(device, padded(bucket.nbytes, ALIGN))
            assert self._packer is not None
            self._packer.pack(position, staging, bucket)
            end = padded(bucket.nbytes, ALIGN)
            mapped.tensor[:end].copy_(staging[:end], non_blocking=mapped.pinned)
            self._exports.append((bucket, WSUM64 if self.checksums else NONE, None))
        return ShmRegion(str(mapped.path), bucket.nbytes)

    def ready(self) -> list[BucketManifest]:
        device_values = iter(self._packer.seal() if self._packer is not None else [])
        if self._packer is not None:
            torch.cuda.current_stream(self._packer.device).synchronize()  # the copies into the files
        exports, self._exports = self._exports, []
        manifests = []
        for bucket, kind, host_value in exports:
            value = next(device_values) if host_value is None else host_value
            manifests.append(bucket.manifest(value if kind != NONE else 0, kind))
        return manifests

    def _device_buffer(self, device: torch.device, need: int) -> torch.Tensor:
        if self._packer is None or self._packer.device != device:
            self._packer = DevicePacker(device)
            self._staging = None
        if self._staging is None or self._staging.numel() < need:
            self._staging = None
            self._staging = torch.empty(max(need, _CAPACITY_STEP), dtype=torch.uint8, device=device)
        return self._staging

    def _file(self, position: int, need: int) -> _MappedFile:
        while len(self._files) <= position:
            self._files.append(None)
        current = self._files[position]
        if current is not None and current.capacity >= need:
            return current
        if current is not None:
            current.close()
        capacity = max(_CAPACITY_STEP, -(-need // _CAPACITY_STEP) * _CAPACITY_STEP)
        path = (
            self.directory
            / f"lifecycle-weights-{os.getpid()}-{self.sender_id}-{position}-{uuid.uuid4().hex[:8]}"
        )
        mapped = _MappedFile(path, capacity)
        self._files[position] = mapped
        self.allocations += 1
        return mapped

    @property
    def paths(self) -> list[str]:
        return [str(f.path) for f in self._files if f is not None]

    def release(self) -> None:
        for mapped in self._files:
            if mapped is not None:
                mapped.close()
        self._files.clear()
        self._staging = None
        if self._packer is not None:
            self._packer.clear()


class _ReadMap:
    """The receiver's mapping of a sender's file. Mapped writable (it is never written) because
    CUDA registers only writable pages without the read-only flag; registered once CUDA is up."""

    def __init__(self, path: str) -> None:
        writable = os.access(path, os.W_OK)
        self.fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(self.fd, self.size, prot=prot)
        except BaseException:
            os.close(self.fd)
            raise
        with warnings.catch_warnings():
            # A read-only mapping: torch warns that writes to such a tensor are undefined.
            warnings.simplefilter("ignore", UserWarning)
            self.tensor: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = writable and host_register(self.tensor)

    def current_size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.pinned and self.tensor is not None:
            host_unregister(self.tensor)
        self.tensor = None
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)


class ShmReceiver(ReceiverTransport):
    name: ClassVar[str] = "shm"

    def __init__(self) -> None:
        self._maps: dict[str, _ReadMap] = {}
        self.files_opened = 0

    @property
    def open_handles(self) -> int:
        return len(self._maps)

    def open(self, manifest: BucketManifest, descriptor: Any, *, gpu: int | None) -> torch.Tensor:
        if not isinstance(descriptor, ShmRegion):
            raise TypeError(f"shm receiver got a {type(descriptor).__name__} descriptor")
        mapped = self._maps.get(descriptor.path)
        if mapped is None:
            # The sender replaced this position's file: let go of the old (unlinked) one.
            family = _family(descriptor.path)
            for path in [p for p in self._maps if _family(p) == family]:
                self._maps.pop(path).close()
            try:
                mapped = _ReadMap(descriptor.path)
            except FileNotFoundError as exc:
                raise WeightSyncError(
                    f"shm: bucket {manifest.index} file {descriptor.path} is gone: the sender released its "
                    "buffers before the engine read them"
                ) from exc
            except ValueError as exc:  # mmap refuses an empty file
                raise CorruptBucketError(
                    f"shm: bucket {manifest.index} file {descriptor.path} is empty, the manifest says "
                    f"{manifest.nbytes} bytes: truncated"
                ) from exc
            self._maps[descriptor.path] = mapped
            self.files_opened += 1
        # A file cut short under a live mapping raises SIGBUS on access: check before reading.
        size = mapped.current_size()
        if size < manifest.nbytes or mapped.size < manifest.nbytes:
            raise CorruptBucketError(
                f"shm: bucket {manifest.index} file {descriptor.path} holds {min(size, mapped.size)} bytes, "
                f"the manifest says {manifest.nbytes}: truncated"
            )
        assert mapped.tensor is not None
        return mapped.tensor

    def release(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()


def _family(path: str) -> str:
    """Files of one sender position share this prefix; the last part changes per allocation."""
    return path.rsplit("-", 1)[0]

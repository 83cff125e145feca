"""Disk transport, the last resort: one safetensors file per bucket in a shared directory.

The bucket layout (decreasing element size, no holes) is exactly a safetensors data section, so
the sender writes the header and then the packed bytes from one reused host buffer: host memory
stays at one bucket, and every file is a valid safetensors file any tool can open. Files are
written under a temporary name and renamed, so a reader never sees a half-written file; the
sender deletes them once the engine acknowledged the round.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from actor_integration.errors import CorruptBucketError, WeightSyncError
from actor_integration.weight_sync.buckets import (
    CRC32,
    NONE,
    SAFETENSORS_DTYPES,
    Bucket,
    BucketManifest,
    checksum,
    dtype_from_name,
    pack_into,
)
from actor_integration.weight_sync.transport import (
    ReceiverTransport,
    SenderTransport,
    check_directory,
)


@dataclass(frozen=True)
class DiskFile:
    """Descriptor: a bucket's safetensors file."""

    path: str
    nbytes: int


def safetensors_header(bucket: Bucket, metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus the JSON header (padded to 8 bytes) for a packed bucket."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for entry in bucket.entries:
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[dtype_from_name(entry.dtype)],
            "shape": list(entry.shape),
            "data_offsets": [entry.offset, entry.offset + entry.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class DiskSender(SenderTransport):
    name: ClassVar[str] = "disk"
    default_round_buckets: ClassVar[int | None] = None
    align: ClassVar[int] = 1  # safetensors allows no holes

    def __init__(self, directory: str | os.PathLike[str], *, keep_files: bool = False) -> None:
        super().__init__()
        self.directory = check_directory(directory, what="disk transport", create=True)
        self.keep_files = keep_files
        self._buffer: torch.Tensor | None = None
        self._written: list[Path] = []
        self._manifests: list[BucketManifest] = []

    def begin_round(self, version: int, round_index: int) -> None:
        super().begin_round(version, round_index)
        self._manifests.clear()

    def ready(self) -> list[BucketManifest]:
        manifests, self._manifests = self._manifests, []
        return manifests

    def export(self, position: int, bucket: Bucket) -> DiskFile:
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            self._buffer = None
            self._buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8)
        region = self._buffer
        pack_into(region, bucket)
        value = checksum(region, bucket.nbytes, CRC32)
        metadata = {
            "format": "pt",
            "version": str(self.version),
            "bucket": str(bucket.index),
            "crc32": str(value),
        }
        path = self.directory / f"weights-{self.sender_id}-v{self.version}-b{bucket.index:05d}.safetensors"
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as f:
            f.write(safetensors_header(bucket, metadata))
            f.write(region[: bucket.nbytes].numpy().data)
        os.replace(partial, path)
        self._written.append(path)
        self._manifests.append(bucket.manifest(value, CRC32) if self.checksums else bucket.manifest(0, NONE))
        return DiskFile(str(path), bucket.nbytes)

    def end_round(self) -> None:
        if not self.keep_files:
            for path in self._written:
                path.unlink(missing_ok=True)
        self._written.clear()

    def release(self) -> None:
        self.end_round()
        self._buffer = None


class DiskReceiver(ReceiverTransport):
    """Maps each file read-only (page cache, not process memory) and checks it against the manifest."""

    name: ClassVar[str] = "disk"

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._tensors: list[torch.Tensor] = []

    def open(self, manifest: BucketManifest, descriptor: Any, *, gpu: int | None) -> torch.Tensor:
        if not isinstance(descriptor, DiskFile):
            raise TypeError(f"disk receiver got a {type(descriptor).__name__} descriptor")
        try:
            f = open(descriptor.path, "rb")  # noqa: SIM115 - closed by the `with f` below
        except FileNotFoundError as exc:
            raise WeightSyncError(
                f"disk: bucket {manifest.index} file {descriptor.path} does not exist; the engine must see "
                "the sender's directory (a shared filesystem) and the sender must not delete files before the ack"
            ) from exc
        with f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CorruptBucketError(
                    f"disk: {descriptor.path} holds {size} bytes: truncated before its header"
                )
            (header_len,) = struct.unpack("<Q", head)
            raw = f.read(header_len)
            try:
                header = json.loads(raw)
            except ValueError as exc:
                raise CorruptBucketError(f"disk: {descriptor.path} has an unreadable header: {exc}") from exc
            _check_header(header, manifest, descriptor.path)
            start = 8 + header_len
            if size - start < manifest.nbytes:
                raise CorruptBucketError(
                    f"disk: {descriptor.path} holds {max(size - start, 0)} data bytes, the manifest says "
                    f"{manifest.nbytes}: truncated"
                )
            if manifest.nbytes == 0:
                return torch.empty(0, dtype=torch.uint8)
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping by design
            tensor = torch.frombuffer(mapped, dtype=torch.uint8, count=manifest.nbytes, offset=start)
        self._maps.append(mapped)
        self._tensors.append(tensor)
        return tensor

    def close_round(self) -> None:
        self._tensors.clear()
        maps, self._maps = self._maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):  # an engine kept a view; it closes when that goes
                mapped.close()

    def release(self) -> None:
        self.close_round()


def _check_header(header: Any, manifest: BucketManifest, path: str) -> None:
    if not isinstance(header, dict):
        raise CorruptBucketError(f"disk: {path} header is not a JSON object")
    names = [k for k in header if k != "__metadata__"]
    if sorted(names) != sorted(manifest.names):
        raise CorruptBucketError(
            f"disk: {path} holds tensors {sorted(names)[:5]}..., the manifest lists {sorted(manifest.names)[:5]}..."
        )
    for entry in manifest.entries:
        info = header[entry.name]
        expected = {
            "dtype": SAFETENSORS_DTYPES[dtype_from_name(entry.dtype)],
            "shape": list(entry.shape),
            "data_offsets": [entry.offset, entry.offset + entry.nbytes],
        }
        if info != expected:
            raise CorruptBucketError(
                f"disk: {path} describes {entry.name!r} as {info}, the manifest as {expected}"
            )

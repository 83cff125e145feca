"""Named tensors flattened into byte buckets, each described by a manifest.

Layout rule: inside a bucket, tensors sit back to back in order of decreasing element size
(stable in the given order). Every offset is then a multiple of its tensor's element size
without padding, so one layout serves all transports: a device view (`view(dtype)` needs
aligned offsets), a shared-memory region, and the data section of a safetensors file (which
allows no holes). A tensor larger than `bucket_bytes` gets a bucket of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

# Checksums: CRC32 for host bytes; on a GPU a CRC would need a custom kernel, so device buckets
# carry the sum of their int32 words (catches bit flips, truncation and zeroed or stale
# regions; not a permutation of whole words, which no transport here can produce).
CRC32 = "crc32"
SUM32 = "sum32"
WORD = 4  # device checksums read int32 words; device regions are padded with zeros to this

# safetensors dtype codes, which also bound the dtypes a bucket may carry.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"unknown or unsupported tensor dtype {name!r} in a bucket manifest")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """Where one named tensor lives inside its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketManifest:
    """What a receiver needs to check and unpack one bucket."""

    index: int  # position in the whole update, counted from 0
    nbytes: int
    entries: tuple[TensorEntry, ...]
    checksum: int
    checksum_kind: str  # CRC32 or SUM32

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


@dataclass(frozen=True)
class Bucket:
    """A planned bucket on the sending side: the tensors and their layout, not yet packed."""

    index: int
    tensors: tuple[torch.Tensor, ...]  # in entry order
    entries: tuple[TensorEntry, ...]
    nbytes: int

    def manifest(self, checksum: int, checksum_kind: str) -> BucketManifest:
        return BucketManifest(self.index, self.nbytes, self.entries, checksum, checksum_kind)


def iter_buckets(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[Bucket]:
    """Group tensors greedily, in the order given, into buckets of at most `bucket_bytes`.

    Lazy: a generator that yields tensors one at a time (a TP gather per parameter) is consumed
    one bucket ahead, never materialised whole.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: set[str] = set()
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    index = 0
    for item in items:
        name, tensor = _check_item(item, seen)
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > bucket_bytes:
            yield _layout(index, pending)
            index += 1
            pending, pending_bytes = [], 0
        pending.append((name, tensor))
        pending_bytes += size
    if pending:
        yield _layout(index, pending)


def _check_item(item: object, seen: set[str]) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TypeError(f"named tensors must be (name, tensor) pairs or a mapping, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.device.type == "meta":
        raise ValueError(f"{name!r} is on the meta device: it has no data to send")
    if tensor.dtype not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{name!r} has dtype {tensor.dtype}, which the weight transports do not carry; "
            f"supported: {sorted(dtype_name(d) for d in SAFETENSORS_DTYPES)}"
        )
    if name in seen:
        raise ValueError(f"tensor name {name!r} appears twice in one weight update")
    seen.add(name)
    return name, tensor


def _layout(index: int, pending: list[tuple[str, torch.Tensor]]) -> Bucket:
    ordered = sorted(pending, key=lambda item: -item[1].element_size())  # stable
    entries, tensors, offset = [], [], 0
    for name, tensor in ordered:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, tuple(tensor.shape), dtype_name(tensor.dtype), offset, nbytes))
        tensors.append(tensor)
        offset += nbytes
    return Bucket(index, tuple(tensors), tuple(entries), offset)


def padded(nbytes: int, to: int = WORD) -> int:
    return -(-nbytes // to) * to


def pack_into(region: torch.Tensor, bucket: Bucket) -> None:
    """Copy the bucket's tensors into `region` (a uint8 tensor of at least `bucket.nbytes`)."""
    for entry, tensor in zip(bucket.entries, bucket.tensors, strict=True):
        if entry.nbytes:
            slot = region[entry.offset : entry.offset + entry.nbytes]
            slot.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def unpack(region: torch.Tensor, manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
    """Views of the named tensors inside `region` (no copy)."""
    out = []
    for entry in manifest.entries:
        dtype = dtype_from_name(entry.dtype)
        view = region[entry.offset : entry.offset + entry.nbytes].view(dtype).reshape(entry.shape)
        out.append((entry.name, view))
    return out


def checksum(region: torch.Tensor, nbytes: int, kind: str) -> int:
    """Checksum of the first `nbytes` of a uint8 tensor (SUM32 reads the zero-padded word tail)."""
    if kind == CRC32:
        if region.device.type != "cpu":
            raise ValueError("crc32 checksums are computed on host buffers")
        return zlib.crc32(region[:nbytes].numpy().data)
    if kind == SUM32:
        words = region[: padded(nbytes)].view(torch.int32)
        return int(words.sum(dtype=torch.int64).item())
    raise ValueError(f"unknown checksum kind {kind!r}; use {CRC32!r} or {SUM32!r}")


def host_checksum(data: memoryview) -> int:
    return zlib.crc32(data)

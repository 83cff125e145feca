"""Named tensors flattened into byte buckets, each described by a manifest.

Layout rule: inside a bucket tensors sit back to back. Unaligned layouts (`align=1`, the disk
transport's) order them by decreasing element size (stable in the given order), so every offset is
a multiple of its element size without padding: the data section of a safetensors file, which
allows no holes. Aligned layouts (`align=16`, the device transports') keep the given order and
start every tensor on a 16-byte boundary, so the copy kernels move whole 16-byte words. A tensor
larger than `bucket_bytes` gets a bucket of its own.

Manifests carry their entries packed (`PackedEntries`: one string of names, one int64 array), so a
bucket of thousands of small tensors pickles in microseconds; `LayoutCache` lets a sender that
sends the same shapes every update skip the layout work.
"""

from __future__ import annotations

import array
import importlib
import operator
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

# Checksums. CRC32 for host bytes. WSUM64 for device buckets, computed in the same pass as the copy
# (kernels.py) and by a torch fallback that gives the same value: the little-endian int32 words
# w_i of the bucket zero-padded to 16 bytes give s1 = sum(w_i) and s2 = sum((i + 1) * w_i), both
# mod 2**32, and the checksum is s2 << 32 | s1 (a Fletcher-style pair: bit flips, truncation, zeroed
# or stale regions and moved words change it). SUM32, the plain word sum, is read for old senders.
CRC32 = "crc32"
SUM32 = "sum32"
WSUM64 = "wsum64"
# WSUM64 left in device memory by the sender: the (s1, s2) int64 pair in the 16 bytes after the
# bucket (at `padded(nbytes, 16)` in its region), written by the packing kernel and never read by
# the sender's host, so handing a round over waits for no device work (cuda_ipc).
WSUM64_DEVICE = "wsum64-device"
NONE = "none"  # the sender computed no checksum (WeightSender(checksums=False))
CHECKSUM_KINDS = (CRC32, SUM32, WSUM64, WSUM64_DEVICE, NONE)
CHECKSUM_TRAILER = 16  # bytes after a bucket holding its WSUM64_DEVICE sums
WORD = 4  # device checksums read int32 words
ALIGN = 16  # aligned layouts start every tensor on this boundary
_MASK32 = 0xFFFFFFFF

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

_DTYPES: tuple[torch.dtype, ...] = tuple(SAFETENSORS_DTYPES)
_DTYPE_INDEX: dict[torch.dtype, int] = {d: i for i, d in enumerate(_DTYPES)}


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


class PackedEntries(Sequence[TensorEntry]):
    """A bucket's entries in two compact fields: the names joined by NUL, and one int64 array
    (offsets, byte sizes, dtype indices, shape starts, then the dimensions). Equal layouts have
    equal `key`s, which receivers use to cache what they derive from a layout."""

    __slots__ = ("_count", "_meta", "_names", "_split")

    def __init__(self, names: str, meta: bytes) -> None:
        self._names = names
        self._meta = meta
        self._count = int.from_bytes(meta[:8], "little", signed=True) if meta else 0
        self._split: tuple[str, ...] | None = None

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[torch.dtype],
        offsets: Sequence[int],
        sizes: Sequence[int],
    ) -> PackedEntries:
        count = len(names)
        starts = [0] * (count + 1)
        dims: list[int] = []
        for i, shape in enumerate(shapes):
            dims.extend(shape)
            starts[i + 1] = len(dims)
        meta = array.array("q", [count])
        meta.extend(offsets)
        meta.extend(sizes)
        meta.extend(_DTYPE_INDEX[d] for d in dtypes)
        meta.extend(starts)
        meta.extend(dims)
        packed = cls("\0".join(names), meta.tobytes())
        packed._split = tuple(names)
        return packed

    @property
    def key(self) -> tuple[str, bytes]:
        return (self._names, self._meta)

    @property
    def names(self) -> tuple[str, ...]:
        if self._split is None:
            self._split = tuple(self._names.split("\0")) if self._count else ()
        return self._split

    def column(self, which: int) -> torch.Tensor:
        """0: offsets, 1: byte sizes, 2: dtype indices, as an int64 tensor (a view of the manifest)."""
        if not self._count:
            return torch.zeros(0, dtype=torch.int64)
        start = 8 + which * self._count * 8
        return torch.frombuffer(bytearray(self._meta[start : start + self._count * 8]), dtype=torch.int64)

    def _ints(self) -> array.array[int]:
        ints = array.array("q")
        ints.frombytes(self._meta)
        return ints

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> TensorEntry: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[TensorEntry]: ...

    def __getitem__(self, index: int | slice) -> TensorEntry | Sequence[TensorEntry]:
        entries = tuple(self)
        return entries[index]

    def __iter__(self) -> Iterator[TensorEntry]:
        n = self._count
        ints = self._ints()
        offsets, sizes, kinds = ints[1 : 1 + n], ints[1 + n : 1 + 2 * n], ints[1 + 2 * n : 1 + 3 * n]
        starts, dims = ints[1 + 3 * n : 2 + 4 * n], ints[2 + 4 * n :]
        for i, name in enumerate(self.names):
            shape = tuple(dims[starts[i] : starts[i + 1]])
            yield TensorEntry(name, shape, dtype_name(_DTYPES[kinds[i]]), offsets[i], sizes[i])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedEntries):
            return self.key == other.key
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"PackedEntries({len(self)} tensors)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedEntries, (self._names, self._meta))


@dataclass(frozen=True)
class BucketManifest:
    """What a receiver needs to check and unpack one bucket."""

    index: int  # position in the whole update, counted from 0
    nbytes: int
    entries: Sequence[TensorEntry]  # a PackedEntries from the senders; any sequence is accepted
    checksum: int
    checksum_kind: str  # one of CHECKSUM_KINDS

    @property
    def names(self) -> tuple[str, ...]:
        if isinstance(self.entries, PackedEntries):
            return self.entries.names
        return tuple(e.name for e in self.entries)

    @property
    def packed(self) -> PackedEntries:
        """The entries as `PackedEntries` (as they are when a sender made them)."""
        entries = self.entries
        if isinstance(entries, PackedEntries):
            return entries
        items = list(entries)
        return PackedEntries.build(
            [e.name for e in items],
            [e.shape for e in items],
            [dtype_from_name(e.dtype) for e in items],
            [e.offset for e in items],
            [e.nbytes for e in items],
        )

    @property
    def entries_key(self) -> Any:
        """A hashable key of the layout, equal for equal layouts (what receivers cache plans by)."""
        entries = self.entries
        return entries.key if isinstance(entries, PackedEntries) else tuple(entries)


@dataclass(frozen=True)
class Bucket:
    """A planned bucket on the sending side: the tensors and their layout, not yet packed.

    `token`, when set, vouches that the tensors have the dtypes, devices, shapes and strides
    they had when `LayoutCache` issued it (a `metadata_guard` they passed): the device packer
    then skips its own per-tensor contiguity check for a plan it built under the same token."""

    index: int
    tensors: tuple[torch.Tensor, ...]  # in entry order
    entries: PackedEntries
    nbytes: int
    token: object | None = field(default=None, kw_only=True, compare=False)

    def manifest(self, checksum: int, checksum_kind: str) -> BucketManifest:
        return BucketManifest(self.index, self.nbytes, self.entries, checksum, checksum_kind)


@dataclass(frozen=True)
class ArenaBucket(Bucket):
    """A bucket whose bytes are already in a sender's staging region: the trainer wrote the
    tensors (views of `region`) in place, so exporting it only checksums."""

    region: torch.Tensor
    slot: str  # the transport's name for the region


@dataclass
class _Planned:
    """One bucket of the previous update, as `LayoutCache` remembers it (no tensors kept)."""

    names: list[str]  # in the order given
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    order: list[int] | None  # entry order as indices into the given order (unaligned layouts)
    entries: PackedEntries
    nbytes: int
    closed_by_overflow: bool  # the next tensor did not fit (not the end of the update)
    guard: Any = None  # metadata_guard of the tensors last seen in this bucket (None: not available)


class LayoutCache:
    """The previous update's bucket layouts. A sender whose tensors arrive with the same names,
    dtypes and shapes reuses them: each tensor is then compared, not laid out again. Every tensor
    is still checked against the cache, so a stale cache costs speed, never correctness."""

    def __init__(self) -> None:
        self.bucket_bytes: int | None = None
        self.align: int | None = None
        self.planned: list[_Planned] = []
        self.hits = 0  # buckets reused (tests check the cache is used)
        self._flat: tuple[list[str], list[torch.dtype], list[torch.Size]] | None = None

    def clear(self) -> None:
        self.planned = []
        self._flat = None

    def flat(self) -> tuple[list[str], list[torch.dtype], list[torch.Size]]:
        """Names, dtypes and shapes of the whole cached update, in the order given."""
        if self._flat is None:
            self._flat = (
                [n for p in self.planned for n in p.names],
                [d for p in self.planned for d in p.dtypes],
                [s for p in self.planned for s in p.shapes],
            )
        return self._flat


_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_UNFOUND: Any = object()


def _tensor_guards_class(found: Any = _UNFOUND) -> Any:
    """torch's TensorGuards if it tells apart what the layout cache must (strides, dtypes, shapes),
    else None: a torch without it, or one whose guard answers differently, gets the Python checks."""
    if found is _UNFOUND:
        try:
            found = importlib.import_module("torch._C._dynamo.guards").TensorGuards
        except (ImportError, AttributeError):
            return None
    try:
        # Explicit device and dtype: never the user's defaults (no CUDA initialised at import).
        square = torch.zeros(2, 2, dtype=torch.float32, device="cpu")
        guard = found(square, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        same = guard.check(torch.ones(2, 2, dtype=torch.float32, device="cpu"))
        others = (square.t(), square.to(torch.float64), square.new_zeros(2, 3))  # strides, dtype, shape
        if not same or any(guard.check(other) for other in others):
            return None
    except Exception:  # an unexpected signature: not ours to fix, the Python checks still work
        return None
    return found


_TensorGuards = _tensor_guards_class()


def metadata_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check, in torch's C++, that tensors keep the dtypes, devices, shapes and strides (and
    autograd flags) these have now: `guard.check(*tensors)` is True only if they all do. torch's
    own guard for compiled graphs (`torch._C._dynamo.guards.TensorGuards`); None where this torch
    has none. A sender's cached layout checks thousands of small tensors with it in a fraction of
    the time of reading their shapes; a False answer only sends the caller to the exact checks."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (TypeError, RuntimeError, ValueError):
        return None


def _guard_passes(guard: Any, tensors: Sequence[Any]) -> bool:
    if guard is None:
        return False
    try:
        return bool(guard.check(*tensors))
    except (TypeError, RuntimeError, ValueError):  # not tensors, or another count: the exact checks decide
        return False


def _matches(tensors: list[Any], plan: _Planned) -> bool:
    """Whether one bucket's tensors repeat the cached bucket (dtypes, shapes), at C speed: with
    the packer's address check, the sender's main host cost for a bucket of small tensors. A
    pass of the bucket's metadata guard answers at once (and vouches for the strides too)."""
    if _guard_passes(plan.guard, tensors):
        return True
    if not all(issubclass(kind, torch.Tensor) for kind in set(map(type, tensors))):
        return False  # not tensors: the checking path says what is wrong
    # A tensor moved to the meta device since is refused where its bytes are copied
    # (`no_data_error`): checking it here would cost as much as the shapes.
    if list(map(_dtype_of, tensors)) == plan.dtypes and list(map(_shape_of, tensors)) == plan.shapes:
        plan.guard = metadata_guard(tensors)  # these tensors' strides, for the next update
        return True
    return False


def iter_buckets(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    align: int = 1,
    cache: LayoutCache | None = None,
    layout_only: bool = False,
) -> Iterator[Bucket]:
    """Group tensors greedily, in the order given, into buckets of at most `bucket_bytes`.

    Lazy: a generator that yields tensors one at a time (a TP gather per parameter) is consumed
    one bucket ahead, never materialised whole. `align` is 1 (safetensors layout) or a power of
    two >= 8 (every tensor starts on that boundary, in the given order). `layout_only`: only
    names, shapes and dtypes are read (meta tensors allowed), for planning a staging arena.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if align not in (1, 8, 16, 32, 64, 128, 256, 512):
        raise ValueError(f"align must be 1 or a power of two from 8 to 512, got {align!r}")
    if cache is not None and (cache.bucket_bytes, cache.align) != (bucket_bytes, align):
        cache.bucket_bytes, cache.align = bucket_bytes, align
        cache.clear()
    previous = cache.planned if cache is not None else []
    if previous and isinstance(named_tensors, Mapping) and not layout_only:
        # A mapping that repeats the cached update: checked bucket by bucket, list against list,
        # so the first bucket is out (and being copied) while the next ones are checked.
        names = list(named_tensors)
        assert cache is not None
        if names == cache.flat()[0]:
            tensors = list(named_tensors.values())
            start = 0
            for index, plan in enumerate(previous):
                part = tensors[start : start + len(plan.names)]
                if not _matches(part, plan):
                    rest = zip(names[start:], tensors[start:], strict=True)
                    yield from _buckets(rest, bucket_bytes, align, cache, previous, index, layout_only)
                    return
                cache.hits += 1
                yield _from_plan(index, plan, part, plan.guard)
                start += len(plan.names)
            return
    items: Iterable[Any] = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    yield from _buckets(items, bucket_bytes, align, cache, previous, 0, layout_only)


def _buckets(
    items: Iterable[Any],
    bucket_bytes: int,
    align: int,
    cache: LayoutCache | None,
    previous: list[_Planned],
    index: int,
    layout_only: bool,
) -> Iterator[Bucket]:
    """The planning loop from bucket `index` on, following `previous` while the tensors repeat it."""
    made: list[_Planned] = list(previous[:index])
    seen: set[str] | None = None  # filled when the update leaves the cached plan
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    pending = 0  # bytes of the open bucket, alignment included
    follow = bool(previous) and not layout_only
    for item in items:
        if follow:
            plan = previous[index] if index < len(previous) else None
            j = len(tensors)
            if plan is not None and j < len(plan.names) and _same(item, plan, j):
                tensors.append(item[1])
                if j + 1 == len(plan.names) and plan.closed_by_overflow:
                    yield _from_plan(index, plan, tensors)
                    made.append(plan)
                    index, tensors = index + 1, []
                continue
            # The update left the cached plan: check what came so far like any other update.
            follow = False
            seen = {name for done in previous[:index] for name in done.names}
            names = list(plan.names[:j]) if plan is not None else []
            seen.update(names)
            pending = sum(_span(t, align) for t in tensors)
        if seen is None:
            seen = set()
        name, tensor = _check_item(item, seen, layout_only)
        span = _span(tensor, align)
        if tensors and pending + span > bucket_bytes:
            planned = _plan(names, tensors, align, closed_by_overflow=True)
            yield _from_plan(index, planned, tensors, planned.guard)
            made.append(planned)
            index, names, tensors, pending = index + 1, [], [], 0
        names.append(name)
        tensors.append(tensor)
        pending += span
    if tensors:
        if follow and len(tensors) == len(previous[index].names):
            planned, token = previous[index], None  # checked one by one (`_same`), strides not
        else:
            if follow:
                names = list(previous[index].names[: len(tensors)])
            planned = _plan(names, tensors, align, closed_by_overflow=False)
            token = planned.guard
        yield _from_plan(index, planned, tensors, token)
        made.append(planned)
    if cache is not None and not layout_only:
        cache.hits += sum(1 for p in made if any(p is q for q in previous))
        cache.planned = made
        cache._flat = None


def _same(item: Any, plan: _Planned, j: int) -> bool:
    if type(item) is not tuple or len(item) != 2:
        return False
    name, tensor = item
    return (
        name == plan.names[j]
        and isinstance(tensor, torch.Tensor)
        and tensor.dtype is plan.dtypes[j]
        and tensor.shape == plan.shapes[j]
        and not tensor.is_meta
    )


def _span(tensor: torch.Tensor, align: int) -> int:
    nbytes: int = tensor.nbytes
    return -(-nbytes // align) * align


def _from_plan(index: int, plan: _Planned, tensors: list[torch.Tensor], token: object = None) -> Bucket:
    ordered = tuple(tensors) if plan.order is None else tuple(tensors[i] for i in plan.order)
    return Bucket(index, ordered, plan.entries, plan.nbytes, token=token)


def _check_item(item: object, seen: set[str], layout_only: bool = False) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TypeError(f"named tensors must be (name, tensor) pairs or a mapping, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if "\0" in name:
        raise ValueError(f"tensor name {name!r} contains a NUL character, which bucket manifests reserve")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_meta and not layout_only:
        raise no_data_error(name)
    if tensor.dtype not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{name!r} has dtype {tensor.dtype}, which the weight transports do not carry; "
            f"supported: {sorted(dtype_name(d) for d in SAFETENSORS_DTYPES)}"
        )
    if name in seen:
        raise ValueError(f"tensor name {name!r} appears twice in one weight update")
    seen.add(name)
    return name, tensor


def _plan(names: list[str], tensors: list[torch.Tensor], align: int, *, closed_by_overflow: bool) -> _Planned:
    order: list[int] | None = None
    if align < 8:
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())  # stable
    indices = order if order is not None else range(len(tensors))
    offsets, sizes, offset = [], [], 0
    for i in indices:
        offset = -(-offset // align) * align
        nbytes = tensors[i].nbytes
        offsets.append(offset)
        sizes.append(nbytes)
        offset += nbytes
    ordered_names = [names[i] for i in indices]
    entries = PackedEntries.build(
        ordered_names,
        [tuple(tensors[i].shape) for i in indices],
        [tensors[i].dtype for i in indices],
        offsets,
        sizes,
    )
    return _Planned(
        names=list(names),
        dtypes=[t.dtype for t in tensors],
        shapes=[t.shape for t in tensors],
        order=order if order != list(range(len(tensors))) else None,
        entries=entries,
        nbytes=offset,
        closed_by_overflow=closed_by_overflow,
        guard=metadata_guard(tensors),
    )


def padded(nbytes: int, to: int = WORD) -> int:
    return -(-nbytes // to) * to


def tiles_bucket(entries: Sequence[TensorEntry], nbytes: int) -> bool:
    """Whether the entries, each padded to 16 bytes, cover the bucket's `padded(nbytes, 16)` bytes
    once each, in order: then the checksums of the copies that read them (`kernels.scatter_checked`)
    add up to the bucket's WSUM64. Aligned layouts (this module's, `align=16`) always do."""
    if isinstance(entries, PackedEntries):
        offsets, sizes = entries.column(0).tolist(), entries.column(1).tolist()
    else:
        offsets, sizes = [e.offset for e in entries], [e.nbytes for e in entries]
    end = 0
    for offset, size in zip(offsets, sizes, strict=True):
        if offset != end:
            return False
        end = padded(offset + size, ALIGN)
    return end == padded(nbytes, ALIGN) and (not offsets or offsets[-1] + sizes[-1] == nbytes)


def checksum_trailer(region: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The WSUM64_DEVICE (s1, s2) int64 pair of a bucket of `nbytes` in `region`: a view of the
    16 bytes at `padded(nbytes, 16)`, where the sender's packing kernel adds them."""
    end = padded(nbytes, ALIGN)
    return region[end : end + CHECKSUM_TRAILER].view(torch.int64)


def no_data_error(name: str) -> ValueError:
    return ValueError(f"{name!r} is on the meta device: it has no data to send")


def pack_into(region: torch.Tensor, bucket: Bucket) -> None:
    """Copy the bucket's tensors into `region` (a uint8 tensor of at least `bucket.nbytes`), one
    copy per tensor: the host path and the fallback of the device kernels."""
    for entry, tensor in zip(bucket.entries, bucket.tensors, strict=True):
        if tensor.is_meta:
            raise no_data_error(entry.name)
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
    """Checksum of the first `nbytes` of a uint8 tensor, computed with torch (one host sync).

    SUM32 and WSUM64 read the word tail up to the padded length, as the senders wrote it."""
    if kind == CRC32:
        if region.device.type != "cpu":
            raise ValueError("crc32 checksums are computed on host buffers")
        return zlib.crc32(region[:nbytes].numpy().data)
    if kind == SUM32:
        words = region[: padded(nbytes)].view(torch.int32)
        return int(words.sum(dtype=torch.int64).item())
    if kind == WSUM64:
        return wsum64_value(wsum64_sums(region, nbytes))
    raise ValueError(f"unknown checksum kind {kind!r}; use one of {list(CHECKSUM_KINDS[:3])}")


_SLICE_WORDS = 1 << 24  # bounds the int64 temporaries of the torch fallback to 128 MiB


def wsum64_sums(region: torch.Tensor, nbytes: int, *, first_word: int = 0) -> torch.Tensor:
    """(s1, s2) of WSUM64 as an int64 tensor on the region's device, not yet reduced mod 2**32
    (no host sync): the torch fallback of the fused kernels. `first_word`: where the region's
    first word sits in its bucket (the sums of the bucket's parts add up to the bucket's)."""
    end = padded(nbytes, ALIGN)
    if region.numel() < end:  # a host region cut at the payload: the tail words read as zeros
        tail = torch.zeros(end, dtype=torch.uint8, device=region.device)
        tail[:nbytes] = region[:nbytes]
        region = tail
    words = region[:end].view(torch.int32)
    total = torch.zeros(2, dtype=torch.int64, device=region.device)
    for start in range(0, words.numel(), _SLICE_WORDS):
        w = words[start : start + _SLICE_WORDS].to(torch.int64)
        first = first_word + start + 1
        index = torch.arange(first, first + w.numel(), dtype=torch.int64, device=region.device)
        total[0] += w.sum()
        total[1] += ((w * index) & _MASK32).sum()
    return total


def wsum64_segment(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """(s1, s2) of `tensor`'s bytes as they would sit at byte `offset` of a bucket whose other bytes
    are zeros (any offset, any layout: a contiguous copy is taken where needed). Summed over the
    entries of a bucket, this is the bucket's WSUM64: what a receiver wrote can be checked against
    what the sender packed, wherever the bytes went."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    lead = offset % WORD
    if lead:  # a word shared with the bytes before: shift the segment onto word boundaries
        shifted = torch.zeros(lead + data.numel(), dtype=torch.uint8, device=data.device)
        shifted[lead:] = data
        data = shifted
    return wsum64_sums(data, data.numel(), first_word=offset // WORD)


def wsum64_value(sums: torch.Tensor | Sequence[int]) -> int:
    """The checksum from (s1, s2) sums in any integer width (reduced mod 2**32 here)."""
    s1, s2 = (int(v) for v in (sums.tolist() if isinstance(sums, torch.Tensor) else sums))
    return ((s2 & _MASK32) << 32) | (s1 & _MASK32)


def host_checksum(data: memoryview) -> int:
    return zlib.crc32(data)

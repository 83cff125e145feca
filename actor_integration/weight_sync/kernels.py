"""Bucket copies on the device with the checksum in the same pass, batched over many tensors.

Four operations, each one launch of the Triton kernel in `_triton.py` over a table of chunks
(up to `chunk` bytes of one tensor each), whatever the number of tensors:

- gather: tensors -> a bucket region, WSUM64 of what was written (the sender's pack);
- verify: WSUM64 of bucket regions (the receiver's check, before anything is written);
- scatter: a bucket region -> the engine's tensors, byte-exact (the receiver's copy), optionally
  gated by a verdict on the device (`verdict`): 0 and it writes nothing;
- checked scatter: the same copy adding the WSUM64 of every word it reads, so the copy is its
  own verification (the two-pass path: a corrupt bucket is found after it was written).

Checksums are summed with integer atomics into one (s1, s2) pair per bucket. Nothing here
synchronises with the host: checksums stay on the device until the caller reads them all at once
(`DevicePacker.seal`, `verify`) or compares them there (`verdict`); verification tables are
cached per set of buffers. Tensors the kernel cannot address in 16-byte
words (not contiguous, not 16-byte aligned, on another device or the host) are copied by torch,
one copy each, and checksummed by a verify pass over their extent. Without Triton (CPU builds)
everything takes the torch path, which gives the same checksums.

Tuning: `WEIGHT_SYNC_KERNEL="block=1024,iters=16,warps=4"` (read once, at import): a chunk is
`block * iters` int32 words (64 KiB by default).
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actor_integration.weight_sync.buckets import (
    ALIGN,
    WORD,
    Bucket,
    PackedEntries,
    no_data_error,
    pack_into,
    padded,
    wsum64_segment,
    wsum64_sums,
    wsum64_value,
)

GATHER, VERIFY, SCATTER, SCATTER_CHECKED, DIGEST = 0, 1, 2, 3, 4


def _tuning() -> dict[str, int]:
    tuning = {"block": 1024, "iters": 16, "warps": 4}
    for part in filter(None, os.environ.get("WEIGHT_SYNC_KERNEL", "").split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in tuning or not value.strip().isdigit():
            raise ValueError(
                f"WEIGHT_SYNC_KERNEL: cannot read {part!r}; expected e.g. 'block=1024,iters=16,warps=4'"
            )
        tuning[key.strip()] = int(value)
    return tuning


TUNING = _tuning()
CHUNK_BYTES = TUNING["block"] * TUNING["iters"] * 4
INTERPRET_ON_CPU = False  # tests run the kernel on CPU tensors under TRITON_INTERPRET=1


def set_tuning(*, block: int, iters: int, warps: int) -> None:
    """Change the kernel's shape (benchmarks sweep it). Tables built before keep their chunking and
    stay valid; verification tables are rebuilt."""
    global CHUNK_BYTES
    if block < 16 or block & (block - 1) or iters < 1 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"set_tuning: block must be a power of two >= 16, iters >= 1, warps 1-16; got {block}, {iters}, {warps}"
        )
    TUNING.update(block=block, iters=iters, warps=warps)
    CHUNK_BYTES = block * iters * 4
    _verify_tables.clear()


_module: Any = None
_module_error: str | None = None


def triton_module(device: torch.device) -> Any:
    """The kernel module for `device`, or None where the torch path must be taken."""
    global _module, _module_error
    if device.type != "cuda" and not (INTERPRET_ON_CPU and device.type == "cpu"):
        return None
    if _module is None and _module_error is None:
        try:
            _module = importlib.import_module("actor_integration.weight_sync._triton")
        except ImportError as exc:  # a torch build without Triton: the torch path still works
            _module_error = str(exc)
    return _module


def fused(device: torch.device) -> bool:
    """Whether copies and checksums on `device` take the fused kernel."""
    return triton_module(device) is not None


def normalized(device: torch.device | str) -> torch.device:
    """`cuda` as `cuda:<current>`: tensors report their index, and the checks compare devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_anchors: dict[torch.device, torch.Tensor] = {}
# Verification tables per (device, region addresses, sizes): a receiver verifies the same mapped
# staging buffers every update, so their chunk table is built once (bounded, oldest dropped).
_verify_tables: OrderedDict[Any, Table] = OrderedDict()
_VERIFY_TABLES_KEPT = 16


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _anchors.get(device)
    if anchor is None:
        anchor = _anchors[device] = torch.zeros(ALIGN // 4, dtype=torch.int32, device=device)
    return anchor


def _kernel_ready(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device == device and tensor.is_contiguous() and tensor.data_ptr() % ALIGN == 0


@dataclass
class Table:
    """Chunk rows on the device (int64: src word, dst word, bytes, group << 32 | word index in the
    bucket). A checksummed launch adds each chunk's sums into `sums[group]`."""

    rows: torch.Tensor
    count: int

    @classmethod
    def build(
        cls,
        device: torch.device,
        src: torch.Tensor,
        dst: torch.Tensor,
        nbytes: torch.Tensor,
        pos: torch.Tensor,
        groups: torch.Tensor | None = None,
    ) -> Table:
        """Rows from per-segment int64 tensors on the host (absolute byte addresses); `groups`:
        the sums pair each segment adds to (default: all to pair 0)."""
        chunk = CHUNK_BYTES
        counts = (nbytes + chunk - 1) // chunk
        total = int(counts.sum())
        segment = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        first = torch.cumsum(counts, 0) - counts
        done = (torch.arange(total) - first[segment]) * chunk
        base = _anchor(device).data_ptr()
        host = torch.empty((total, 4), dtype=torch.int64, pin_memory=device.type == "cuda")
        host[:, 0] = (src[segment] + done - base) // 4
        host[:, 1] = (dst[segment] + done - base) // 4
        host[:, 2] = torch.clamp(nbytes[segment] - done, max=chunk)
        host[:, 3] = ((pos[segment] + done) // 4) & 0xFFFFFFFF
        if groups is not None:
            host[:, 3] |= groups[segment] << 32
        return cls(host.to(device, non_blocking=True), total)

    def run(
        self,
        mode: int,
        device: torch.device,
        sums: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
    ) -> None:
        """Launch the kernel over the rows (no host sync). Checksummed modes add into `sums`
        (int64 pairs on the device, zeroed by the caller); a scatter with `gate` (an int32 0 or 1
        on the device) writes nothing when it is 0."""
        if not self.count:
            return
        anchor = _anchor(device)
        if mode != SCATTER and sums is None:
            raise ValueError("Table.run: a checksummed launch needs its sums buffer")
        triton_module(device).launch(
            anchor,
            self.rows,
            sums if sums is not None else anchor,
            self.count,
            mode,
            TUNING["block"],
            TUNING["iters"],
            TUNING["warps"],
            gate,
        )

    def reading_targets(self) -> Table:
        """The same rows reading where they write (a scatter's targets): run as DIGEST, the sums
        of what the targets hold, each word weighted by its place in its bucket."""
        rows = self.rows.clone()
        rows[:, 0] = rows[:, 1]
        return Table(rows, self.count)


_warmed: set[Any] = set()


def warm_up(device: torch.device | str | int | None = None) -> bool:
    """Compile the kernel's three modes for `device` (default: the current CUDA device) now, so
    that the first weight sync does not pay Triton's JIT (seconds on a cold cache). Cheap once
    compiled; a no-op where the torch path runs. Returns whether the kernel is ready."""
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.cuda.current_device()
    device = normalized(torch.device("cuda", device) if isinstance(device, int) else device)
    if not fused(device):
        return False
    key = (device, TUNING["block"], TUNING["iters"], TUNING["warps"])
    if key not in _warmed:
        scratch = torch.zeros(64, dtype=torch.uint8, device=device)
        where = torch.tensor([scratch.data_ptr()], dtype=torch.int64)
        one = torch.tensor([16], dtype=torch.int64)
        table = Table.build(device, where, where + 32, one, torch.zeros(1, dtype=torch.int64))
        sums = torch.zeros((1, 2), dtype=torch.int64, device=device)
        for mode in (GATHER, VERIFY, SCATTER, SCATTER_CHECKED, DIGEST):
            table.run(mode, device, sums)
        table.run(SCATTER, device, gate=torch.ones(1, dtype=torch.int32, device=device))  # the gated copy
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _warmed.add(key)
    return True


def _addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- gather


@dataclass
class _GatherPlan:
    entries: PackedEntries
    region_ptr: int
    pointers: list[int]
    contiguous: list[bool]
    fast: Table | None
    slow: list[int]  # tensor indices copied by torch
    slow_extents: Table | None  # verify rows over the slow tensors' places in the bucket
    token: object | None  # the bucket token (`Bucket.token`) the contiguity was last checked under


class DevicePacker:
    """Packs buckets into device regions with their WSUM64; `seal()` reads every checksum of the
    round with one host sync. Plans (chunk tables) are kept per `key` (a staging position) and
    reused while the layout, the region and the tensors' addresses stay the same."""

    def __init__(self, device: torch.device) -> None:
        self.device = normalized(device)
        self._plans: dict[Any, _GatherPlan] = {}  # per position: the plan used last
        # ... and the one before: a trainer whose export alternates between two sets of buffers
        # (two weight sets, or converted tensors the caching allocator places in one of two ways)
        # finds both kept instead of rebuilding the tables on every update.
        self._spare: dict[Any, _GatherPlan] = {}
        self._checksums: dict[Any, tuple[tuple[int, int, int], Table]] = {}  # arena regions' tables
        self._pending: list[torch.Tensor] = []  # the torch path: one (s1, s2) tensor per bucket
        self._sums: torch.Tensor | None = None  # the kernel path: (s1, s2) per bucket of the round
        self._count = 0  # buckets packed since the last seal
        self.plans_built = 0  # tests check reuse

    def pack(self, key: Any, region: torch.Tensor, bucket: Bucket, sums: torch.Tensor | None = None) -> None:
        """Enqueue the copy of `bucket` into `region` (a uint8 device tensor of at least
        `padded(bucket.nbytes, 16)` bytes) and its checksum: into `sums` (an int64 (2,) tensor on
        the device, left there for the receiver) if given, else for `seal()`."""
        if not fused(self.device):
            _copy_slow(region, bucket, list(range(len(bucket.tensors))))
            self._keep(wsum64_sums(region, bucket.nbytes), sums)
            return
        plan = self._plan(key, region, bucket)
        sums = self._zeroed(sums)
        if plan.fast is not None:
            plan.fast.run(GATHER, self.device, sums)
        if plan.slow:
            _copy_slow(region, bucket, plan.slow)
            assert plan.slow_extents is not None
            plan.slow_extents.run(VERIFY, self.device, sums)

    def checksum(
        self, region: torch.Tensor, nbytes: int, sums: torch.Tensor | None = None, *, key: Any = None
    ) -> None:
        """Enqueue the checksum of a region already filled (an arena the trainer wrote). With `key`
        (the region's staging position) its chunk table is kept here while the region and size
        stay the same, as the gather plans are."""
        if not fused(self.device):
            self._keep(wsum64_sums(region, nbytes), sums)
            return
        if key is None:
            table = _verify_table([region], [nbytes], self.device)
        else:
            # Kept per position, not in the shared table cache: an arena of 17 buckets (the
            # Qwen3-4B layout) cycled through its 16 entries and rebuilt every table on every
            # update, 12.2 ms of the sender's host time on the H200 (0.9 ms for 16 buckets).
            found = (region.data_ptr(), padded(nbytes, ALIGN), CHUNK_BYTES)
            kept = self._checksums.get(key)
            if kept is None or kept[0] != found:
                kept = self._checksums[key] = (found, _build_verify_table([region], [nbytes], self.device))
                self.plans_built += 1
            table = kept[1]
        table.run(VERIFY, self.device, self._zeroed(sums))

    def _zeroed(self, sums: torch.Tensor | None) -> torch.Tensor:
        """Where the kernel adds this bucket's checksum: the caller's pair, zeroed, or the next
        pair of the round (for `seal()`)."""
        if sums is None:
            return self._slot()
        return sums.zero_()

    def _keep(self, computed: torch.Tensor, sums: torch.Tensor | None) -> None:
        if sums is None:
            self._pending.append(computed)
        else:
            sums.copy_(computed)

    def seal(self) -> list[int]:
        """The WSUM64 of every bucket packed since the last seal, in order (one host sync)."""
        if self._count:
            assert self._sums is not None
            values = self._sums[: self._count].tolist()
            self._count = 0
        else:
            pending, self._pending = self._pending, []
            if not pending:
                return []
            values = torch.stack(pending).tolist()
        return [wsum64_value(v) for v in values]

    def discard(self) -> None:
        self._pending.clear()
        self._count = 0

    def clear(self) -> None:
        self.discard()
        self._plans.clear()
        self._spare.clear()
        self._checksums.clear()
        self._sums = None

    def _slot(self) -> torch.Tensor:
        """The zeroed (s1, s2) pair of the next bucket of the round, on the device."""
        if self._count == 0:
            if self._sums is None:
                self._sums = torch.empty((64, 2), dtype=torch.int64, device=self.device)
            self._sums.zero_()  # one memset per round
        elif self._count == self._sums.shape[0]:  # type: ignore[union-attr]
            assert self._sums is not None
            grown = torch.zeros((2 * self._count, 2), dtype=torch.int64, device=self.device)
            grown[: self._count] = self._sums
            self._sums = grown
        assert self._sums is not None
        self._count += 1
        return self._sums[self._count - 1]

    def _plan(self, key: Any, region: torch.Tensor, bucket: Bucket) -> _GatherPlan:
        # Checked on every update, at C speed: thousands of small tensors per bucket are common.
        # The addresses always; the contiguity unless the bucket's token vouches that the strides
        # are those the plan was checked with.
        pointers = list(map(torch.Tensor.data_ptr, bucket.tensors))
        region_ptr = region.data_ptr()
        contiguous: list[bool] | None = None
        for kept in (self._plans, self._spare):
            cached = kept.get(key)
            if (
                cached is None
                or cached.region_ptr != region_ptr
                or cached.pointers != pointers
                or not (cached.entries is bucket.entries or cached.entries.key == bucket.entries.key)
            ):
                continue
            if bucket.token is None or bucket.token is not cached.token:
                if contiguous is None:
                    contiguous = list(map(torch.Tensor.is_contiguous, bucket.tensors))
                if cached.contiguous != contiguous:
                    continue
                cached.token = bucket.token
            if kept is self._spare:  # the other of two alternating sets: it becomes the last used
                self._spare[key], self._plans[key] = self._plans[key], cached
            return cached
        if contiguous is None:
            contiguous = list(map(torch.Tensor.is_contiguous, bucket.tensors))
        device = self.device
        ready = [_kernel_ready(t, device) for t in bucket.tensors]
        offsets = bucket.entries.column(0)
        sizes = bucket.entries.column(1)
        src = torch.tensor(pointers, dtype=torch.int64)
        fast_index = torch.tensor([i for i, ok in enumerate(ready) if ok], dtype=torch.int64)
        slow = [i for i, ok in enumerate(ready) if not ok]
        fast = None
        if fast_index.numel():
            o, s = offsets[fast_index], sizes[fast_index]
            fast = Table.build(device, src[fast_index], region_ptr + o, s, o)
        slow_extents = None
        if slow:
            index = torch.tensor(slow, dtype=torch.int64)
            o, s = offsets[index], sizes[index]
            slow_extents = Table.build(
                device, region_ptr + o, region_ptr + o, (s + ALIGN - 1) // ALIGN * ALIGN, o
            )
        plan = _GatherPlan(
            bucket.entries, region_ptr, pointers, contiguous, fast, slow, slow_extents, bucket.token
        )
        last = self._plans.get(key)
        if last is not None:
            self._spare[key] = last
        self._plans[key] = plan
        self.plans_built += 1
        return plan


def _copy_slow(region: torch.Tensor, bucket: Bucket, indices: list[int]) -> None:
    entries = list(bucket.entries) if len(indices) > 1 else None
    for i in indices:
        entry = entries[i] if entries is not None else bucket.entries[i]
        tensor = bucket.tensors[i]
        if tensor.is_meta:
            raise no_data_error(entry.name)
        if entry.nbytes:
            view = region[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=True)
        end = padded(entry.offset + entry.nbytes, ALIGN)
        region[entry.offset + entry.nbytes : end].zero_()


# ---------------------------------------------------------------------------------------------- verify


def _build_verify_table(
    regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device
) -> Table:
    """Checksum rows over whole regions (padded to 16 bytes), region i adding into sums pair i."""
    where = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    return Table.build(
        device,
        where,
        where,
        torch.tensor([padded(n, ALIGN) for n in nbytes], dtype=torch.int64),
        torch.zeros(len(regions), dtype=torch.int64),
        groups=torch.arange(len(regions)),
    )


def _verify_table(regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device) -> Table:
    addresses = tuple(r.data_ptr() for r in regions)
    sizes = tuple(padded(n, ALIGN) for n in nbytes)
    return _cached_table(
        (device, CHUNK_BYTES, addresses, sizes), lambda: _build_verify_table(regions, nbytes, device)
    )


def _cached_table(key: Any, build: Callable[[], Table]) -> Table:
    """The table under `key`, built on first use; the oldest dropped past `_VERIFY_TABLES_KEPT`."""
    table = _verify_tables.get(key)
    if table is None:
        table = _verify_tables[key] = build()
        while len(_verify_tables) > _VERIFY_TABLES_KEPT:
            _verify_tables.popitem(last=False)
    else:
        _verify_tables.move_to_end(key)
    return table


def region_sums(regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device) -> torch.Tensor:
    """(s1, s2) per region, as an int64 (regions, 2) tensor on the device (no host sync). The
    chunk table is cached per (regions' addresses, sizes): receivers verify the same buffers."""
    if not fused(device):
        if not regions:
            return torch.zeros((0, 2), dtype=torch.int64, device=device)
        return torch.stack([wsum64_sums(r, n) for r, n in zip(regions, nbytes, strict=True)])
    sums = torch.zeros((len(regions), 2), dtype=torch.int64, device=device)
    _verify_table(regions, nbytes, device).run(VERIFY, device, sums)
    return sums


def verdict(sums: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """An int32 (1,) device tensor: 1 if every (s1, s2) of `sums` equals `expected` mod 2**32
    (both (n, 2) int64 on one device), else 0. No host sync: it gates the scatter."""
    same = ((sums - expected) & 0xFFFFFFFF).eq(0).all()
    return same.to(torch.int32).reshape(1)


def verify(regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device) -> list[int]:
    """WSUM64 of each region (one launch and one host sync for all of them)."""
    if not regions:
        return []
    return [wsum64_value(v) for v in region_sums(regions, nbytes, device).tolist()]


# ---------------------------------------------------------------------------------------------- scatter


@dataclass
class ScatterPlan:
    """The copies of one round into the engine's tensors: a device table for the tensors the
    kernel reaches, torch copies for the rest. Every row carries its word index in its bucket and
    the bucket's position in `pieces` (its sums pair), so the same table also runs checked."""

    fast: Table | None
    slow: list[tuple[int, int, int, torch.Tensor]]  # (piece, offset, nbytes, target)
    fast_bytes: int
    slow_bytes: int
    slow_extents: Table | None = None  # verify rows over the torch-copied targets' places in their buckets
    buckets: int = 0
    digest: Table | None = None  # the fast rows reading their targets (`scatter_digest`), made on first use


def plan_scatter(
    pieces: Sequence[tuple[torch.Tensor, PackedEntries, Sequence[torch.Tensor]]], device: torch.device
) -> ScatterPlan:
    """`pieces`: per bucket, its region, its entries and the target tensor of each entry (in entry
    order). Targets were checked for shape and dtype by the caller."""
    device = normalized(device)
    src_parts, dst_parts, size_parts, pos_parts, group_parts = [], [], [], [], []
    slow: list[tuple[int, int, int, torch.Tensor]] = []
    extents: list[tuple[int, int, int, int]] = []  # (address, padded bytes, offset, piece)
    fast_bytes = slow_bytes = 0
    use_kernel = fused(device)
    for k, (region, entries, targets) in enumerate(pieces):
        offsets = entries.column(0)
        sizes = entries.column(1)
        on_device = use_kernel and region.device == device
        ready = [on_device and _kernel_ready(t, device) for t in targets]
        if any(ready):
            index = torch.tensor([i for i, ok in enumerate(ready) if ok], dtype=torch.int64)
            src_parts.append(region.data_ptr() + offsets[index])
            dst_parts.append(_addresses([targets[i] for i in index.tolist()]))
            size_parts.append(sizes[index])
            pos_parts.append(offsets[index])
            group_parts.append(torch.full((index.numel(),), k, dtype=torch.int64))
            fast_bytes += int(sizes[index].sum())
        if all(ready):
            continue
        for i, offset, nbytes in zip(range(len(ready)), offsets.tolist(), sizes.tolist(), strict=True):
            if not ready[i]:
                slow.append((k, offset, nbytes, targets[i]))
                slow_bytes += nbytes
                if on_device and nbytes:
                    extents.append((region.data_ptr() + offset, padded(nbytes, ALIGN), offset, k))
    fast = None
    if src_parts:
        fast = Table.build(
            device,
            torch.cat(src_parts),
            torch.cat(dst_parts),
            torch.cat(size_parts),
            torch.cat(pos_parts),
            groups=torch.cat(group_parts),
        )
    slow_extents = None
    if extents:
        where, length, pos, group = torch.tensor(extents, dtype=torch.int64).unbind(1)
        slow_extents = Table.build(device, where, where, length, pos, groups=group)
    return ScatterPlan(fast, slow, fast_bytes, slow_bytes, slow_extents, len(pieces))


def scatter(plan: ScatterPlan, regions: Sequence[torch.Tensor], device: torch.device) -> None:
    """Enqueue the round's copies (no host sync)."""
    scatter_fast(plan, device)
    scatter_slow(plan, regions)


def scatter_fast(plan: ScatterPlan, device: torch.device, gate: torch.Tensor | None = None) -> None:
    """Enqueue the kernel's share of the copies; with `gate` (int32 0 or 1 on the device, from
    `verdict`) they write nothing unless it is 1. No host sync."""
    device = normalized(device)
    if plan.fast is not None:  # built only where the kernel runs
        plan.fast.run(SCATTER, device, gate=gate)


def scatter_slow(plan: ScatterPlan, regions: Sequence[torch.Tensor]) -> None:
    """Enqueue the torch copies of the targets the kernel cannot reach (run after the checks:
    they are not gated)."""
    for k, offset, nbytes, target in plan.slow:
        if nbytes:
            view = regions[k][offset : offset + nbytes].view(target.dtype).view(target.shape)
            target.copy_(view, non_blocking=view.is_pinned())


def scatter_checked(
    plan: ScatterPlan, regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Enqueue the round's copies with each bucket's (s1, s2) of what they read: an int64
    (buckets, 2) tensor on the device (no host sync). The sums equal the buckets' WSUM64 only if
    their entries tile them (`buckets.tiles_bucket`): the copies read the tensors and the padding
    to their 16-byte ends, nothing between. Targets the kernel cannot reach are copied by torch
    and their places checksummed by a read of their own; without the kernel (CPU builds) every
    bucket is copied by torch and checksummed whole."""
    device = normalized(device)
    if not fused(device):
        scatter_slow(plan, regions)
        return region_sums(regions, nbytes, device)
    sums = torch.zeros((plan.buckets, 2), dtype=torch.int64, device=device)
    if plan.fast is not None:
        plan.fast.run(SCATTER_CHECKED, device, sums)
    scatter_slow(plan, regions)
    if plan.slow_extents is not None:
        plan.slow_extents.run(VERIFY, device, sums)
    return sums


# ---------------------------------------------------------------------------------------------- written


def written_sums(
    segments: Sequence[tuple[torch.Tensor, int, int]], groups: int, device: torch.device | str
) -> torch.Tensor:
    """The digest of what a round wrote, computed where it was written: an int64 (groups, 2)
    tensor on `device` (no host sync) of each bucket's WSUM64 (s1, s2) over what the tensors hold
    now. `segments`: (tensor, bucket, byte offset of its bytes in that bucket), tiling the bucket's
    entries; a tensor that holds what was sent adds exactly what its bytes added to the sender's
    sums, so the totals equal the senders' values iff every written tensor holds the sent bytes."""
    device = normalized(device)
    sums = torch.zeros((groups, 2), dtype=torch.int64, device=device)
    use_kernel = fused(device)
    ready = [use_kernel and o % WORD == 0 and _kernel_ready(t, device) for t, _g, o in segments]
    fast = [
        (t.data_ptr(), t.numel() * t.element_size(), g, o)
        for (t, g, o), ok in zip(segments, ready, strict=True)
        if ok
    ]
    if fast:
        _digest_table(device, fast).run(DIGEST, device, sums)
    for (tensor, group, offset), ok in zip(segments, ready, strict=True):
        if not ok:
            sums[group] += wsum64_segment(tensor, offset).to(device)
    return sums


def _digest_table(device: torch.device, fast: list[tuple[int, int, int, int]]) -> Table:
    """The DIGEST rows over (address, bytes, bucket, offset) segments, cached like the verify
    tables: a receiver's copy plan writes the same parameters every update, and building the
    rows (pinned, chunked) cost more than the read itself (20 of 26 ms at 7B on an H100)."""

    def build() -> Table:
        where, nbytes, groups, offsets = (
            torch.tensor(column, dtype=torch.int64) for column in zip(*fast, strict=True)
        )
        return Table.build(device, where, where, nbytes, offsets, groups=groups)

    return _cached_table((device, CHUNK_BYTES, DIGEST, tuple(fast)), build)


def scatter_digest(plan: ScatterPlan, device: torch.device | str) -> torch.Tensor:
    """`written_sums` of a scatter's targets, per bucket of the plan (no host sync): the fast rows
    read back where they wrote, the torch-copied targets summed by torch."""
    device = normalized(device)
    sums = torch.zeros((plan.buckets, 2), dtype=torch.int64, device=device)
    if plan.fast is not None:
        if plan.digest is None:
            plan.digest = plan.fast.reading_targets()
        plan.digest.run(DIGEST, device, sums)
    for k, offset, nbytes, target in plan.slow:
        if nbytes:
            sums[k] += wsum64_segment(target, offset).to(device)
    return sums


# ---------------------------------------------------------------------------------------------- check


def self_check(device: torch.device | str, *, large: bool = True, seed: int = 0) -> list[str]:
    """Pack, verify and unpack awkward tensors (odd sizes, every dtype, strided, misaligned, host)
    with this device's path and compare with the torch path: the disagreements (empty: none).

    Where the fused kernel runs (CUDA with Triton) this checks it against torch bit for bit."""
    from actor_integration.weight_sync.buckets import iter_buckets

    device = normalized(device)
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 3, 7, 15, 16, 17, 33, 4097] + (
        [70_001, 1_048_583, 5 * CHUNK_BYTES + 13] if large else [1001]
    )
    dtypes = [
        torch.uint8,
        torch.bfloat16,
        torch.float32,
        torch.int8,
        torch.float16,
        torch.float64,
        torch.bool,
        torch.int64,
    ]
    named: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        count = max(n // torch.empty(0, dtype=dtype).element_size(), 0)
        named[f"t{i}.{str(dtype).removeprefix('torch.')}"] = _random(count, dtype, g).to(device)
    named["strided"] = _random(6 * 10, torch.float32, g).view(6, 10).t().to(device)
    named["misaligned"] = _random(1003, torch.uint8, g).to(device)[3:]
    if device.type != "cpu":
        named["host"] = _random(257, torch.bfloat16, g)
    problems: list[str] = []
    (bucket,) = list(iter_buckets(named, 1 << 40, align=ALIGN))
    end = padded(bucket.nbytes, ALIGN)
    fused_region = torch.full((end + 64,), 0x5A, dtype=torch.uint8, device=device)
    reference = torch.zeros(end + 64, dtype=torch.uint8, device=device)
    packer = DevicePacker(device)
    packer.pack("check", fused_region, bucket)
    (fused_sum,) = packer.seal()
    pack_into(reference, bucket)
    reference_sum = wsum64_value(wsum64_sums(reference, bucket.nbytes))
    if not torch.equal(fused_region[:end].cpu(), reference[:end].cpu()):
        bad = (fused_region[:end] != reference[:end]).nonzero()[:4].flatten().tolist()
        problems.append(f"gather: packed bytes differ from torch's at offsets {bad}")
    if fused_sum != reference_sum:
        problems.append(f"gather: checksum {fused_sum:#x}, torch's {reference_sum:#x}")
    (verified,) = verify([fused_region], [bucket.nbytes], device)
    if verified != reference_sum:
        problems.append(f"verify: checksum {verified:#x}, torch's {reference_sum:#x}")
    # Unpack into targets packed in one buffer, each followed by sentinel bytes the copy must not touch.
    arena = torch.full((2 * end + 64 * len(named) + 4096,), 0xC3, dtype=torch.uint8, device=device)
    targets, offset = [], 0
    for entry in bucket.entries:
        dtype = getattr(torch, entry.dtype)
        offset = padded(offset, ALIGN) + (3 if entry.name == "misaligned" else 0)
        targets.append(arena[offset : offset + entry.nbytes].view(dtype).view(entry.shape))
        offset += entry.nbytes + 5
    plan = plan_scatter([(fused_region, bucket.entries, targets)], device)
    before = arena.clone()
    scatter_fast(plan, device, torch.zeros(1, dtype=torch.int32, device=device))  # a failed verdict
    if not torch.equal(arena.cpu(), before.cpu()):
        problems.append("scatter: a copy gated by a failed verdict wrote to its targets")
    scatter_fast(plan, device, torch.ones(1, dtype=torch.int32, device=device))  # a passed verdict
    scatter_slow(plan, [fused_region])
    untouched = torch.ones_like(arena, dtype=torch.bool)
    for entry, target, (name, source) in zip(bucket.entries, targets, named.items(), strict=True):
        if entry.name != name:
            problems.append(f"layout: entry {entry.name!r} where {name!r} was expected")
        start = target.data_ptr() - arena.data_ptr()
        untouched[start : start + entry.nbytes] = False
        got = target.reshape(-1).view(torch.uint8).cpu()
        want = source.contiguous().reshape(-1).view(torch.uint8).cpu()
        if not torch.equal(got, want):
            problems.append(f"scatter: {name!r} ({entry.nbytes} bytes) differs from the source")
    if not bool((arena[untouched] == 0xC3).all()):
        problems.append("scatter: wrote outside its targets (sentinel bytes changed)")
    # The checked copy: the same bytes into fresh targets, and the bucket's checksum from what it read.
    arena.fill_(0xC3)
    (checked,) = scatter_checked(plan, [fused_region], [bucket.nbytes], device).tolist()
    if wsum64_value(checked) != reference_sum:
        problems.append(f"checked scatter: checksum {wsum64_value(checked):#x}, torch's {reference_sum:#x}")
    for entry, target, (name, source) in zip(bucket.entries, targets, named.items(), strict=True):
        got = target.reshape(-1).view(torch.uint8).cpu()
        if not torch.equal(got, source.contiguous().reshape(-1).view(torch.uint8).cpu()):
            problems.append(f"checked scatter: {name!r} ({entry.nbytes} bytes) differs from the source")
    if not bool((arena[untouched] == 0xC3).all()):
        problems.append("checked scatter: wrote outside its targets (sentinel bytes changed)")
    # The digest of what was written, read back from the targets: the sentinels after each target
    # must not count, and one changed byte in a target must show.
    (digest,) = scatter_digest(plan, device).tolist()
    if wsum64_value(digest) != reference_sum:
        problems.append(
            f"digest: the targets' sums {wsum64_value(digest):#x}, the sent bucket's {reference_sum:#x}"
        )
    segments = [(t, 0, e.offset) for e, t in zip(bucket.entries, targets, strict=True)]
    (listed,) = written_sums(segments, 1, device).tolist()
    if wsum64_value(listed) != reference_sum:
        problems.append(
            f"digest: written_sums gave {wsum64_value(listed):#x}, the sent bucket's {reference_sum:#x}"
        )
    largest = max(range(len(targets)), key=lambda i: bucket.entries[i].nbytes)
    flat = targets[largest].reshape(-1).view(torch.uint8)
    flat[7] ^= 0x01
    (changed,) = scatter_digest(plan, device).tolist()
    flat[7] ^= 0x01
    if wsum64_value(changed) == reference_sum:
        problems.append("digest: a changed byte in a written target left the digest unchanged")
    fused_region[5] ^= 0x10  # a flipped bit in the bucket: the checked copy must see it
    (flipped,) = scatter_checked(plan, [fused_region], [bucket.nbytes], device).tolist()
    fused_region[5] ^= 0x10
    if wsum64_value(flipped) == reference_sum:
        problems.append("checked scatter: a flipped bit in the bucket left its checksum unchanged")
    # A round of several buckets: one sums pair each, sealed at once; verified in one launch.
    several = list(iter_buckets(named, max(4096, bucket.nbytes // 5), align=ALIGN))
    regions = [torch.zeros(padded(b.nbytes, ALIGN), dtype=torch.uint8, device=device) for b in several]
    for k, (b, r) in enumerate(zip(several, regions, strict=True)):
        packer.pack(("round", k), r, b)
    sealed = packer.seal()
    expected = []
    for b in several:
        reference = torch.zeros(padded(b.nbytes, ALIGN), dtype=torch.uint8, device=device)
        pack_into(reference, b)
        expected.append(wsum64_value(wsum64_sums(reference, b.nbytes)))
    if sealed != expected:
        problems.append(f"gather: a round of {len(several)} buckets sealed {sealed}, torch's {expected}")
    verified_all = verify(regions, [b.nbytes for b in several], device)
    if verified_all != expected:
        problems.append(
            f"verify: {len(several)} regions in one launch gave {verified_all}, torch's {expected}"
        )
    outs = [[torch.empty_like(t.contiguous()) for t in b.tensors] for b in several]
    round_plan = plan_scatter(
        [(r, b.entries, out) for r, b, out in zip(regions, several, outs, strict=True)], device
    )
    sums = scatter_checked(round_plan, regions, [b.nbytes for b in several], device).tolist()
    if [wsum64_value(v) for v in sums] != expected:
        problems.append(f"checked scatter: a round of {len(several)} buckets gave {sums}, torch's {expected}")
    return problems


def _random(count: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (count * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8
    )
    if dtype == torch.bool:
        return (raw & 1).bool()
    return raw.view(dtype)

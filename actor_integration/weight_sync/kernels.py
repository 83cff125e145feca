"""Bucket copies on the device with the checksum in the same pass, batched over many tensors.

Three operations, each one launch of the Triton kernel in `_triton.py` over a table of chunks
(up to `chunk` bytes of one tensor each), whatever the number of tensors:

- gather: tensors -> a bucket region, WSUM64 of what was written (the sender's pack);
- verify: WSUM64 of bucket regions (the receiver's check, before anything is written);
- scatter: a bucket region -> the engine's tensors, byte-exact (the receiver's copy).

Nothing here synchronises with the host: checksums stay on the device until the caller reads
them all at once (`DevicePacker.seal`, `verify`). Tensors the kernel cannot address in 16-byte
words (not contiguous, not 16-byte aligned, on another device or the host) are copied by torch,
one copy each, and checksummed by a verify pass over their extent. Without Triton (CPU builds)
everything takes the torch path, which gives the same checksums.

Tuning: `WEIGHT_SYNC_KERNEL="block=1024,iters=16,warps=4"` (read once, at import): a chunk is
`block * iters` int32 words (64 KiB by default).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actor_integration.weight_sync.buckets import (
    ALIGN,
    Bucket,
    PackedEntries,
    pack_into,
    padded,
    wsum64_sums,
    wsum64_value,
)

GATHER, VERIFY, SCATTER = 0, 1, 2


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
_verify_tables: dict[Any, Table] = {}  # per (device, regions, sizes): receivers verify the same buffers


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _anchors.get(device)
    if anchor is None:
        anchor = _anchors[device] = torch.zeros(ALIGN // 4, dtype=torch.int32, device=device)
    return anchor


def _kernel_ready(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device == device and tensor.is_contiguous() and tensor.data_ptr() % ALIGN == 0


@dataclass
class Table:
    """Chunk rows on the device (int64: src word, dst word, bytes, word index in the bucket)."""

    rows: torch.Tensor
    count: int
    groups: torch.Tensor | None = None  # bucket of each row (verify over several buckets)

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
        """Rows from per-segment int64 tensors on the host (absolute byte addresses)."""
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
        host[:, 3] = (pos[segment] + done) // 4
        rows = host.to(device, non_blocking=True)
        row_groups = None
        if groups is not None:
            pinned = torch.empty(total, dtype=torch.int64, pin_memory=device.type == "cuda")
            pinned.copy_(groups[segment])
            row_groups = pinned.to(device, non_blocking=True)
        return cls(rows, total, row_groups)

    def run(self, mode: int, device: torch.device) -> torch.Tensor | None:
        """Launch the kernel over the rows; per-chunk (s1, s2) int64 pairs unless scattering."""
        module = triton_module(device)
        partials = None
        if mode != SCATTER:
            partials = torch.empty(max(self.count, 1) * 2, dtype=torch.int64, device=device)
            if not self.count:
                partials.zero_()
        if self.count:
            anchor = _anchor(device)
            out = partials if partials is not None else anchor
            module.launch(
                anchor, self.rows, out, self.count, mode, TUNING["block"], TUNING["iters"], TUNING["warps"]
            )
        return partials


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


class DevicePacker:
    """Packs buckets into device regions with their WSUM64; `seal()` reads every checksum of the
    round with one host sync. Plans (chunk tables) are kept per `key` (a staging position) and
    reused while the layout, the region and the tensors' addresses stay the same."""

    def __init__(self, device: torch.device) -> None:
        self.device = normalized(device)
        self._plans: dict[Any, _GatherPlan] = {}
        self._pending: list[torch.Tensor] = []
        self.plans_built = 0  # tests check reuse

    def pack(self, key: Any, region: torch.Tensor, bucket: Bucket) -> None:
        """Enqueue the copy of `bucket` into `region` (a uint8 device tensor of at least
        `padded(bucket.nbytes, 16)` bytes) and its checksum."""
        if not fused(self.device):
            _copy_slow(region, bucket, list(range(len(bucket.tensors))))
            self._pending.append(wsum64_sums(region, bucket.nbytes))
            return
        plan = self._plan(key, region, bucket)
        sums = torch.zeros(2, dtype=torch.int64, device=self.device)
        if plan.fast is not None:
            partials = plan.fast.run(GATHER, self.device)
            assert partials is not None
            sums += partials.view(-1, 2).sum(0)
        if plan.slow:
            _copy_slow(region, bucket, plan.slow)
            assert plan.slow_extents is not None
            partials = plan.slow_extents.run(VERIFY, self.device)
            assert partials is not None
            sums += partials.view(-1, 2).sum(0)
        self._pending.append(sums)

    def checksum(self, region: torch.Tensor, nbytes: int) -> None:
        """Enqueue the checksum of a region already filled (an arena the trainer wrote)."""
        self._pending.append(region_sums([region], [nbytes], self.device)[0])

    def seal(self) -> list[int]:
        """The WSUM64 of every bucket packed since the last seal, in order (one host sync)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        values = torch.stack(pending).tolist()
        return [wsum64_value(v) for v in values]

    def discard(self) -> None:
        self._pending.clear()

    def clear(self) -> None:
        self._pending.clear()
        self._plans.clear()

    def _plan(self, key: Any, region: torch.Tensor, bucket: Bucket) -> _GatherPlan:
        # Checked on every update, at C speed: thousands of small tensors per bucket are common.
        pointers = list(map(torch.Tensor.data_ptr, bucket.tensors))
        contiguous = list(map(torch.Tensor.is_contiguous, bucket.tensors))
        cached = self._plans.get(key)
        region_ptr = region.data_ptr()
        if (
            cached is not None
            and cached.region_ptr == region_ptr
            and cached.pointers == pointers
            and cached.contiguous == contiguous
            and (cached.entries is bucket.entries or cached.entries.key == bucket.entries.key)
        ):
            return cached
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
        plan = _GatherPlan(bucket.entries, region_ptr, pointers, contiguous, fast, slow, slow_extents)
        self._plans[key] = plan
        self.plans_built += 1
        return plan


def _copy_slow(region: torch.Tensor, bucket: Bucket, indices: list[int]) -> None:
    entries = list(bucket.entries) if len(indices) > 1 else None
    for i in indices:
        entry = entries[i] if entries is not None else bucket.entries[i]
        tensor = bucket.tensors[i]
        if entry.nbytes:
            view = region[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=True)
        end = padded(entry.offset + entry.nbytes, ALIGN)
        region[entry.offset + entry.nbytes : end].zero_()


# ---------------------------------------------------------------------------------------------- verify


def region_sums(
    regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device
) -> list[torch.Tensor]:
    """(s1, s2) per region, as device int64 pairs (no host sync)."""
    if not fused(device):
        return [wsum64_sums(r, n) for r, n in zip(regions, nbytes, strict=True)]
    addresses = _addresses(regions)
    sizes = torch.tensor([padded(n, ALIGN) for n in nbytes], dtype=torch.int64)
    zeros = torch.zeros(len(regions), dtype=torch.int64)
    table = Table.build(device, addresses, addresses, sizes, zeros, groups=torch.arange(len(regions)))
    partials = table.run(VERIFY, device)
    assert partials is not None and table.groups is not None
    sums = torch.zeros((len(regions), 2), dtype=torch.int64, device=device)
    if table.count:
        sums.index_add_(0, table.groups, partials.view(-1, 2))
    return list(sums.unbind(0))


def verify(regions: Sequence[torch.Tensor], nbytes: Sequence[int], device: torch.device) -> list[int]:
    """WSUM64 of each region (one launch and one host sync for all of them)."""
    if not regions:
        return []
    sums = region_sums(regions, nbytes, device)
    return [wsum64_value(v) for v in torch.stack(sums).tolist()]


# ---------------------------------------------------------------------------------------------- scatter


@dataclass
class ScatterPlan:
    """The copies of one round into the engine's tensors: a device table for the tensors the
    kernel reaches, torch copies for the rest."""

    fast: Table | None
    slow: list[tuple[int, int, int, torch.Tensor]]  # (piece, offset, nbytes, target)
    fast_bytes: int
    slow_bytes: int


def plan_scatter(
    pieces: Sequence[tuple[torch.Tensor, PackedEntries, Sequence[torch.Tensor]]], device: torch.device
) -> ScatterPlan:
    """`pieces`: per bucket, its region, its entries and the target tensor of each entry (in entry
    order). Targets were checked for shape and dtype by the caller."""
    device = normalized(device)
    src_parts, dst_parts, size_parts = [], [], []
    slow: list[tuple[int, int, int, torch.Tensor]] = []
    fast_bytes = slow_bytes = 0
    use_kernel = fused(device)
    for k, (region, entries, targets) in enumerate(pieces):
        offsets = entries.column(0)
        sizes = entries.column(1)
        ready = [use_kernel and region.device == device and _kernel_ready(t, device) for t in targets]
        if not any(ready):
            slow.extend((k, int(offsets[i]), int(sizes[i]), targets[i]) for i in range(len(targets)))
            slow_bytes += int(sizes.sum())
            continue
        index = torch.tensor([i for i, ok in enumerate(ready) if ok], dtype=torch.int64)
        src_parts.append(region.data_ptr() + offsets[index])
        dst_parts.append(_addresses([targets[i] for i in index.tolist()]))
        size_parts.append(sizes[index])
        fast_bytes += int(sizes[index].sum())
        for i, ok in enumerate(ready):
            if not ok:
                slow.append((k, int(offsets[i]), int(sizes[i]), targets[i]))
                slow_bytes += int(sizes[i])
    fast = None
    if src_parts:
        src = torch.cat(src_parts)
        fast = Table.build(device, src, torch.cat(dst_parts), torch.cat(size_parts), torch.zeros_like(src))
    return ScatterPlan(fast, slow, fast_bytes, slow_bytes)


def scatter(plan: ScatterPlan, regions: Sequence[torch.Tensor], device: torch.device) -> None:
    """Enqueue the round's copies (no host sync)."""
    device = normalized(device)
    if plan.fast is not None:
        plan.fast.run(SCATTER, device)
    for k, offset, nbytes, target in plan.slow:
        if nbytes:
            view = regions[k][offset : offset + nbytes].view(target.dtype).view(target.shape)
            target.copy_(view, non_blocking=view.is_pinned())


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
    scatter(plan_scatter([(fused_region, bucket.entries, targets)], device), [fused_region], device)
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
    return problems


def _random(count: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (count * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8
    )
    if dtype == torch.bool:
        return (raw & 1).bool()
    return raw.view(dtype)

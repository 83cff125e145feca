"""A tag's contents kept by this process and copied by the SMs, instead of torch_memory_saver's
CPU backup, for the tags a `TorchMemorySaverBackend(device_restore=[...])` names.

Why: right after another process on the GPU releases a large amount of memory (the rollout's KV
cache, in the memory budget's partial step), copies on the copy engines run at about half speed
for 0.15-0.4 s while the SMs read pinned host memory at full speed (measured on an H200:
`benchmarks/probe_resume_after_release.py`, docs/memory-budget.md). torch_memory_saver restores a
backed-up tag with `cudaMemcpy`, on the copy engines; this restores it with one launch of the
weight sync's copy kernel reading the pinned copy through its device-visible address.

What is copied: every block the tag's memory pool holds live, not only the tensors a caller would
name (a block left out would come back holding other bytes, and nothing would say so).
torch_memory_saver (0.0.10, entrypoint.py) allocates each `region()` in a `torch.cuda.MemPool` of
its own per (tag, CPU backup, disk backup, backup backend, device), in both hook modes, so the
pool's `snapshot()` lists exactly the tag's segments and their blocks. At the pause the active
blocks are copied into pinned host memory (kept across steps, grown when the tag grows) and
then the tag is paused with no backup of torch_memory_saver's own; at the resume the tag is mapped
back, then the blocks are copied back. Both copies are waited for, as torch_memory_saver's are.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actor_integration.weight_sync import kernels

ALIGN = 512  # the caching allocator's block alignment; host extents are laid out on it too


@dataclass(frozen=True)
class Extent:
    """A run of live device memory of the tag and where its copy sits in the host buffer."""

    address: int
    nbytes: int
    offset: int


def live_extents(segments: Iterable[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(address, bytes) of the live blocks in a memory pool's `snapshot()`, adjacent ones merged.

    A block is live unless its state is "inactive" (free in the allocator's cache); one freed
    while a stream still used it ("active_pending_free") is kept: copying it costs bytes, never
    correctness."""
    runs: list[tuple[int, int]] = []
    blocks = sorted(
        (int(block["address"]), int(block["size"]))
        for segment in segments
        for block in segment.get("blocks", ())
        if block.get("state") != "inactive" and int(block["size"]) > 0
    )
    for address, size in blocks:
        if runs and runs[-1][0] + runs[-1][1] == address:
            runs[-1] = (runs[-1][0], runs[-1][1] + size)
        else:
            runs.append((address, size))
    return runs


def layout(runs: Sequence[tuple[int, int]]) -> tuple[list[Extent], int]:
    """The runs placed one after another in a host buffer, each on an `ALIGN` boundary."""
    extents, offset = [], 0
    for address, size in runs:
        extents.append(Extent(address, size, offset))
        offset += -(-size // ALIGN) * ALIGN
    return extents, offset


HOST_CHUNK = 256 << 20  # the host copy is kept in pinned chunks of this size (a power of two)


class DeviceRestore:
    """The host copies of the tags restored by the SMs, on one device.

    `save(tag, segments)` before the tag's pause; `restore(tag)` after its resume. A tag's copy is
    kept across steps (grown when the tag grows) in pinned chunks of `host_chunk` bytes: torch's
    pinned allocator rounds every allocation up to a power of two (2.2 GiB would pin 4), and a
    pinned allocation costs about a second per 2 GiB, so `prepare(tag, segments)` makes them at
    configuration. A run of device memory that crosses a chunk boundary is copied in two pieces."""

    def __init__(self, device: torch.device, *, host_chunk: int | None = None) -> None:
        host_chunk = HOST_CHUNK if host_chunk is None else host_chunk
        if host_chunk < ALIGN or host_chunk & (host_chunk - 1):
            raise ValueError(f"host_chunk must be a power of two of at least {ALIGN}, got {host_chunk}")
        self.device = device
        self.host_chunk = host_chunk
        self._host: dict[str, list[torch.Tensor]] = {}
        self._saved: dict[str, list[Extent]] = {}
        self._tables: dict[tuple[str, str], tuple[tuple[Any, ...], Any]] = {}
        self.copies = 0  # launches made (tests check the path is taken)

    @staticmethod
    def supported(device: torch.device) -> str | None:
        """None if tags on `device` can be restored this way, else why not."""
        if device.type == "cpu":
            return None  # host memory: moved with memmove (the CPU tests' fake allocations)
        if device.type != "cuda":
            return f"device_restore works on CUDA devices, not {device.type}"
        if not kernels.fused(device):
            return "device_restore needs Triton (the CUDA builds of torch ship it) for its copy kernel"
        return None

    def held_bytes(self, tag: str | None = None) -> int:
        """Host memory held for `tag` (None: every tag)."""
        tags = [tag] if tag is not None else list(self._host)
        return sum(chunk.numel() for t in tags for chunk in self._host.get(t, ()))

    def is_saved(self, tag: str) -> bool:
        return tag in self._saved

    def prepare(self, tag: str, segments: Iterable[Mapping[str, Any]]) -> int:
        """Allocate the tag's host copy for what its pool holds live now; returns its bytes."""
        _, nbytes = layout(live_extents(segments))
        self._chunks(tag, nbytes)
        return self.held_bytes(tag)

    def save(self, tag: str, segments: Iterable[Mapping[str, Any]]) -> int:
        """Copy the tag's live blocks to the host, waiting for the copy; returns the bytes copied."""
        if tag in self._saved:
            raise RuntimeError(f"device_restore: tag {tag!r} is saved already and not restored")
        extents, nbytes = layout(live_extents(segments))
        self._chunks(tag, nbytes)
        self._copy(tag, "save", extents, to_host=True)
        self._saved[tag] = extents
        return sum(e.nbytes for e in extents)

    def restore(self, tag: str) -> int:
        """Copy the tag's saved blocks back to their addresses (mapped again by the resume), waiting
        for the copy. Returns the bytes copied."""
        extents = self._saved.pop(tag, None)
        if extents is None:
            raise RuntimeError(f"device_restore: tag {tag!r} has no saved copy to restore")
        self._copy(tag, "restore", extents, to_host=False)
        return sum(e.nbytes for e in extents)

    def forget(self, tag: str) -> None:
        """Drop a saved copy that will not be restored (the pause it was made for failed)."""
        self._saved.pop(tag, None)

    def copy_of(self, tag: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """A CPU copy of `tensor` from the tag's saved blocks; None when the tag is not saved."""
        extents = self._saved.get(tag)
        if extents is None:
            return None
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for extent in extents:
            if extent.address <= start and start + nbytes <= extent.address + extent.nbytes:
                out = torch.empty(nbytes, dtype=torch.uint8)
                begin = extent.offset + start - extent.address
                for piece, at, size in self._pieces(begin, nbytes):
                    out[piece : piece + size].copy_(self._host[tag][at[0]][at[1] : at[1] + size])
                return out.view(tensor.dtype).view(tensor.shape)
        raise ValueError(
            f"device_restore: no live block of tag {tag!r} holds the tensor at {start:#x} ({nbytes} bytes); "
            "pass a tensor allocated in that tag's region"
        )

    def release(self) -> None:
        """Free the host copies (nothing may be saved)."""
        if self._saved:
            raise RuntimeError(f"device_restore: tags {sorted(self._saved)} are saved and not restored")
        self._host.clear()
        self._tables.clear()

    def _chunks(self, tag: str, nbytes: int) -> list[torch.Tensor]:
        chunks = self._host.setdefault(tag, [])
        pinned = self.device.type == "cuda"
        while len(chunks) * self.host_chunk < nbytes:
            chunks.append(torch.empty(self.host_chunk, dtype=torch.uint8, pin_memory=pinned))
        return chunks

    def _pieces(self, offset: int, nbytes: int) -> Iterator[tuple[int, tuple[int, int], int]]:
        """(offset in the run, (chunk, offset in it), bytes) of a run of the tag's host copy."""
        done = 0
        while done < nbytes:
            chunk, within = divmod(offset + done, self.host_chunk)
            size = min(nbytes - done, self.host_chunk - within)
            yield done, (chunk, within), size
            done += size

    def _copy(self, tag: str, way: str, extents: list[Extent], *, to_host: bool) -> None:
        chunks = self._host[tag]
        pairs = []
        for extent in extents:
            for piece, (chunk, within), size in self._pieces(extent.offset, extent.nbytes):
                host, device = chunks[chunk].data_ptr() + within, extent.address + piece
                pairs.append((device, host, size) if to_host else (host, device, size))
        if not pairs:
            return
        self.copies += 1
        if self.device.type == "cpu":
            for src, dst, nbytes in pairs:
                ctypes.memmove(dst, src, nbytes)
            return
        key = tuple(pairs)
        kept = self._tables.get((tag, way))
        if kept is None or kept[0] != key:
            src_t, dst_t, size_t = (
                torch.tensor(column, dtype=torch.int64) for column in zip(*pairs, strict=True)
            )
            table = kernels.Table.build(self.device, src_t, dst_t, size_t, torch.zeros_like(size_t))
            kept = self._tables[(tag, way)] = (key, table)
        with torch.cuda.device(self.device):
            kept[1].run(kernels.SCATTER, self.device)
            # Waited for, as torch_memory_saver's own copies are: the pause unmaps the blocks right
            # after the save, and a resume returns with the contents in place.
            torch.cuda.current_stream(self.device).synchronize()

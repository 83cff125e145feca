"""Where an engine's weight loaders put each received tensor, recorded once per layout and replayed.

SGLang's `model.load_weights` maps checkpoint names onto its fused, sharded parameters in Python,
tensor by tensor: on the H200 it took 14.5 ms of a 0.5B model's sync whose bytes move in about
1 ms (benchmarks/bench_sglang_sync.py). The mapping depends only on the layout (names, shapes,
dtypes), so `LoadPlans` records it the first time a layout arrives: the loaders run as usual while
every `Tensor.copy_` from a received bucket into a parameter is noted (which parameter, which
strided view of it, which bytes of which bucket). A plan is kept only if it explains the whole
round: every copy goes from a bucket into a parameter with the same dtype and shape, and the
copies read exactly the round's bytes (a loader that transforms a tensor first, shards it over TP
ranks, or writes anything else makes the plan incomplete, and the loaders keep running).

The next arrival of the layout checks the plan once: it replays the copies, digests what they
wrote, runs the loaders over the same bytes and digests again; the plan is used from then on only
if the two digests are equal (a loader that also changes a parameter in place after its copy, for
one, fails this). Replay takes the round's current buckets, and the parameters' views where the
parameters are now: the views of the last replay are kept while every parameter the plan writes
stays at its address (torch_memory_saver's pause and resume keep it), and made again for a
parameter remapped since. The copies are one `torch._foreach_copy_`, not a Python `copy_` per
tensor: on an H100 a replay of a 0.5B model's 290 copies, each view made again and copied one by
one, took 6.4 ms in the offline engine and 11-12 ms in SGLang's server (2026-12-07).
Nothing of the buckets is kept between rounds: the trainer's buffers close when the round ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

RECORDED, CHECKED, REPLAYED, LOADERS = "recorded", "checked", "replayed", "loaders"


@dataclass(frozen=True)
class _Copy:
    param: str
    dst_offset: int
    shape: tuple[int, ...]
    dst_stride: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    src_offset: int  # in elements of `dtype`, from the start of the bucket's storage
    src_stride: tuple[int, ...]


@dataclass
class _Plan:
    copies: tuple[_Copy, ...]
    checked: bool = False
    # The parameters' views the copies write, and the parameters' addresses they were made at.
    _targets: list[torch.Tensor] = field(default_factory=list, repr=False)
    _at: tuple[int, ...] = ()

    def targets(self, model: Any) -> list[torch.Tensor]:
        """The view of its parameter each copy writes, in the plan's order: those of the last call
        while every parameter is where it was then, else made again from the model's parameters."""
        params = dict(model.named_parameters())
        at = tuple(params[c.param].data_ptr() for c in self.copies)
        if at != self._at:  # a plan has copies, so its first call always differs from ()
            self._targets = [
                params[c.param].data.as_strided(c.shape, c.dst_stride, c.dst_offset) for c in self.copies
            ]
            self._at = at
        return self._targets


class LoadPlans:
    """Per layout key: a recorded copy plan, or None where the loaders must run every time."""

    def __init__(self) -> None:
        self._plans: dict[Any, _Plan | None] = {}

    def load(
        self, model: Any, key: Any, named: Sequence[tuple[str, torch.Tensor]], regions: Sequence[torch.Tensor]
    ) -> str:
        """Load `named` (views into `regions`) into `model`; which way it went (RECORDED, CHECKED,
        REPLAYED, LOADERS)."""
        if key not in self._plans:
            with _recording(regions) as captured:
                model.load_weights(named)
            self._plans[key] = _plan(
                model, captured, regions, sum(t.numel() * t.element_size() for _, t in named)
            )
            return RECORDED if self._plans[key] is not None else LOADERS
        plan = self._plans[key]
        if plan is None:
            model.load_weights(named)
            return LOADERS
        views = _replay(model, plan, regions)
        if plan.checked:
            return REPLAYED
        replayed = _digest(views)
        model.load_weights(named)  # the loaders' result over the same bytes: the plan must match it
        if torch.equal(replayed, _digest(views)):
            plan.checked = True
            return CHECKED
        self._plans[key] = None
        return LOADERS

    def written(self, model: Any, key: Any) -> list[tuple[torch.Tensor, int, int]] | None:
        """Where the layout's last load put each received tensor: (the parameter's view, bucket,
        byte offset in the bucket), for the digest of what was written; None where the loaders
        transform or shard the tensors (no plan: what they wrote cannot be read back as sent)."""
        plan = self._plans.get(key)
        if plan is None:
            return None
        return [
            (view, c.bucket, c.src_offset * c.dtype.itemsize)
            for view, c in zip(plan.targets(model), plan.copies, strict=True)
        ]

    def forget(self) -> None:
        self._plans.clear()


@contextlib.contextmanager
def _recording(regions: Sequence[torch.Tensor]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Note every `Tensor.copy_` whose source lies in one of `regions` (dst, src, region index)."""
    spans = [(r.untyped_storage().data_ptr(), r.untyped_storage().nbytes(), i) for i, r in enumerate(regions)]
    captured: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    original = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and src.device == self.device:
            base = src.untyped_storage().data_ptr()
            for start, size, i in spans:
                if start <= base < start + size:
                    captured.append((self, src, i))
                    break
        return original(self, src, non_blocking)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign, assignment]
    try:
        yield captured
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]


def _plan(
    model: Any,
    captured: list[tuple[torch.Tensor, torch.Tensor, int]],
    regions: Sequence[torch.Tensor],
    nbytes: int,
) -> _Plan | None:
    params = {p.untyped_storage().data_ptr(): (name, p) for name, p in model.named_parameters()}
    copies = []
    read = 0
    for dst, src, bucket in captured:
        owner = params.get(dst.untyped_storage().data_ptr())
        if owner is None or dst.dtype != src.dtype or dst.shape != src.shape or owner[1].dtype != dst.dtype:
            return None
        if regions[bucket].storage_offset() != 0 or not src.is_contiguous():
            return None
        copies.append(
            _Copy(
                param=owner[0],
                dst_offset=int(dst.storage_offset()),
                shape=tuple(dst.shape),
                dst_stride=tuple(dst.stride()),
                dtype=dst.dtype,
                bucket=bucket,
                src_offset=int(src.storage_offset()),
                src_stride=tuple(src.stride()),
            )
        )
        read += src.numel() * src.element_size()
    # Every byte of the round read exactly once: anything else (a tensor transformed before its
    # copy, a shard of it on this TP rank, a copy made twice) is not this simple mapping.
    return _Plan(tuple(copies)) if copies and read == nbytes else None


def _replay(model: Any, plan: _Plan, regions: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    targets = plan.targets(model)
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    sources = []
    for c in plan.copies:
        source = typed.get((c.bucket, c.dtype))
        if source is None:
            source = typed[(c.bucket, c.dtype)] = regions[c.bucket].view(c.dtype)
        sources.append(source.as_strided(c.shape, c.src_stride, c.src_offset))
    with torch.no_grad():
        torch._foreach_copy_(targets, sources)
    return list(targets)


def _digest(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per written view, its float64 sum and sum of squares (one-time check, not a hot path)."""
    return torch.stack([torch.stack(((d := v.double()).sum(), (d * d).sum())) for v in views])


__all__ = ["CHECKED", "LOADERS", "RECORDED", "REPLAYED", "LoadPlans"]

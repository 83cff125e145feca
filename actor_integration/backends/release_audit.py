"""Release verification: how much device memory each sleep really freed and each wake took.

A release can return before its memory is free (a live reference, an allocator cache, an
asynchronous release), and the next phase runs out of memory (slime #579, miles #86).
`AuditedMemory` wraps a memory backend (torch_memory_saver's pause/resume/disable:
`TorchMemorySaverBackend`, a rollout's `EngineMemory`), reads the device's free memory before
and after each pause and resume, and logs `memory.released` / `memory.taken` with the numbers
through the actor's lifecycle (`sink`). A release that freed less than `warn_below` of what its
tags hold (`expected_bytes`) is logged at warning level, with `short: true` and both figures.
A backend that takes a plan stage's tags in one call (`MemoryBatches`: `pause_tags`,
`resume_tags`) keeps that call: it is measured once, and its records stay one per tag (the first
carries the call, the others follow it with nothing of their own), as the lifecycle's log keeps
one hook entry per tag.

`torch.cuda.mem_get_info` counts the whole device: another process allocating or freeing on the
same GPU during the pause moves the figure (the colocated loop runs one side's phase switch at a
time). Nothing is measured while CUDA is not initialised in this process (a CPU run, an actor
whose engine lives in another process before it touched CUDA). The audit never changes what the
hook does: a failed measurement is skipped, never raised.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifecycle.hooks import EventSink, MemoryBackend
from lifecycle.logs import Event

__all__ = ["AuditedMemory", "Measurement", "cuda_free_bytes"]

MIB = 1 << 20
BATCHES = {"pause_tags": "release", "resume_tags": "resume"}  # `MemoryBatches`, where the backend has them
# Below this a tag's size is within the CUDA caching allocator's granularity (2 MiB blocks, 20 MiB
# segments): what a release frees is then rounding, not evidence of a leak.
WARN_MIN_BYTES = 64 * MIB


def cuda_free_bytes() -> int | None:
    """Free bytes on the current CUDA device, or None where CUDA is not initialised in this process."""
    import torch

    # is_initialized() never creates a CUDA context: a CPU process stays CUDA-free.
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


@dataclass(frozen=True)
class Measurement:
    """One audited call: a release (`freed` bytes) or a resume (`taken` bytes) of `tag` (None: all)."""

    kind: str  # "release" or "resume"
    tag: str | None
    expected_bytes: int | None
    measured_bytes: int
    free_before_bytes: int
    free_after_bytes: int
    duration_ms: float
    short: bool


class AuditedMemory:
    """A `MemoryBackend` that measures the device memory each pause freed and each resume took.

    `expected_bytes(tag)` (tag None: every tag) says what a tag holds when resident, or None when
    unknown (then nothing is judged short). `pause_tags` / `resume_tags` exist where the wrapped
    backend has them, audited as one call (see the module docstring). Other attributes
    (`is_paused`, `region`, `describe`, ...) are the wrapped backend's.
    """

    # Measuring needs the pause alone on the device: a process-group teardown run beside it frees
    # NCCL memory that would be counted as released.
    may_overlap_process_groups = False

    def __init__(
        self,
        memory: MemoryBackend,
        *,
        expected_bytes: Callable[[str | None], int | None] | None = None,
        free_bytes: Callable[[], int | None] = cuda_free_bytes,
        warn_below: float = 0.5,
        warn_min_bytes: int = WARN_MIN_BYTES,
        sink: EventSink | None = None,
        keep: int = 256,
    ) -> None:
        missing = [m for m in ("pause", "resume", "disable") if not callable(getattr(memory, m, None))]
        if missing:
            raise TypeError(
                f"AuditedMemory wraps a memory backend (torch_memory_saver's pause/resume/disable); "
                f"{type(memory).__name__} lacks {missing}"
            )
        if not 0.0 < warn_below <= 1.0:
            raise ValueError(f"AuditedMemory: warn_below is a fraction in (0, 1], got {warn_below!r}")
        if warn_min_bytes < 0:
            raise ValueError(f"AuditedMemory: warn_min_bytes must be >= 0, got {warn_min_bytes!r}")
        self.memory = memory
        self.expected_bytes = expected_bytes
        self.free_bytes = free_bytes
        self.warn_below = warn_below
        self.warn_min_bytes = warn_min_bytes
        self.sink = sink  # the actor's Lifecycle, set once it exists (it is built with these hooks)
        self.measurements: collections.deque[Measurement] = collections.deque(maxlen=keep)

    def pause(self, tag: str | None = None) -> None:
        """Pause `tag` on the wrapped backend, measuring the device memory it freed."""
        self._audit("release", (tag,), functools.partial(self.memory.pause, tag))

    def resume(self, tag: str | None = None) -> None:
        """Resume `tag` on the wrapped backend, measuring the device memory it took."""
        self._audit("resume", (tag,), functools.partial(self.memory.resume, tag))

    def disable(self) -> contextlib.AbstractContextManager[Any]:
        """The wrapped backend's `disable()` (not measured)."""
        return self.memory.disable()

    def __getattr__(self, name: str) -> Any:
        if name == "memory":  # not set yet (unpickling): no wrapped backend to ask
            raise AttributeError(name)
        value = getattr(self.memory, name)  # an AttributeError where the backend lacks it
        if name in BATCHES:  # the backend's one call for a stage's tags, audited as one
            return functools.partial(self._audit_batch, BATCHES[name], value)
        return value

    def _audit_batch(self, kind: str, call: Callable[[tuple[str, ...]], None], tags: tuple[str, ...]) -> None:
        self._audit(kind, tuple(tags), functools.partial(call, tags))

    def _audit(self, kind: str, tags: tuple[str | None, ...], call: Callable[[], None]) -> None:
        """Measure one call releasing (or resuming) `tags`: its first tag's record carries what the
        call freed (or took) against what all of them hold; each other tag's record follows it with
        nothing of its own (0 bytes expected and measured)."""
        before = self._free()
        started = time.perf_counter()
        call()
        duration_ms = round((time.perf_counter() - started) * 1e3, 3)
        after = self._free() if before is not None else None
        if before is None or after is None:
            return
        expected = self._expected_of(tags)
        measured = after - before if kind == "release" else before - after
        short = (
            kind == "release"
            and expected is not None
            and expected >= self.warn_min_bytes
            and measured < self.warn_below * expected
        )
        first = Measurement(kind, tags[0], expected, measured, before, after, duration_ms, short)
        rest = [Measurement(kind, tag, 0, 0, after, after, 0.0, False) for tag in tags[1:]]
        for measurement in (first, *rest):
            self.measurements.append(measurement)
            self._log(measurement)

    def _free(self) -> int | None:
        try:
            return self.free_bytes()
        except Exception:  # a measurement must never turn a working hook into a failed one
            return None

    def _expected_of(self, tags: tuple[str | None, ...]) -> int | None:
        """What `tags` hold together, or None if any is unknown."""
        total = 0
        for tag in tags:
            value = self._expected(tag)
            if value is None:
                return None
            total += value
        return total

    def _expected(self, tag: str | None) -> int | None:
        if self.expected_bytes is None:
            return None
        try:
            value = self.expected_bytes(tag)
        except Exception:
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _log(self, m: Measurement) -> None:
        if self.sink is None:
            return
        fields: dict[str, Any] = {
            "tag": m.tag,
            "expected_bytes": m.expected_bytes,
            "free_before_bytes": m.free_before_bytes,
            "free_after_bytes": m.free_after_bytes,
            "duration_ms": m.duration_ms,
        }
        if m.kind == "resume":
            self.sink.event(Event.MEMORY_TAKEN, taken_bytes=m.measured_bytes, **fields)
            return
        fields.update(freed_bytes=m.measured_bytes, short=m.short)
        if not m.short:
            self.sink.event(Event.MEMORY_RELEASED, **fields)
            return
        assert m.expected_bytes is not None
        what = "every tag" if m.tag is None else f"tag {m.tag!r}"
        fields["reason"] = (
            f"the release of {what} freed {m.measured_bytes / MIB:.1f} MiB of the {m.expected_bytes / MIB:.1f} "
            f"MiB it holds ({m.measured_bytes / m.expected_bytes:.0%}, below {self.warn_below:.0%}): the memory "
            "is still held (a live reference to its tensors, an allocator cache not emptied, a release that "
            "returns before the memory is free) and the next phase on this GPU may run out of memory "
            "(slime #579, miles #86)"
        )
        self.sink.event(Event.MEMORY_RELEASED, "warning", **fields)

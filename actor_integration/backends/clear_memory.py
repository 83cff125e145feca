"""The clear-memory hook: drop garbage, hand cached CUDA blocks back, optionally trim the host heap.

It runs in the sleep plan, just before the process groups go down and memory is paused. Each part
is there for that point, and what it costs (measured):

- `gc.collect()`: garbage cycles holding device tensors are freed before the pause, not backed up
  with it. A full collection walks every tracked object: 220-290 ms per call with megatron-core and
  torch imported (~400k objects), which was the whole cost of this hook. So the first call
  collects and then `gc.freeze()`s what is left (the imports, the model, the optimizer: objects
  that live as long as the actor); later calls walk only what was created since: 0.11-0.27 ms in
  a Megatron trainer on an H200, the whole hook 0.8-2.8 ms (malloc_trim 0.6-2.5 ms of it). Frozen
  objects are still freed by reference counting, only a cycle among them is never collected
  (`freeze_heap=False` keeps full collections).
- `torch.cuda.synchronize()`: no kernel still writes memory that is about to be paused.
- `torch.cuda.empty_cache()`: cached blocks outside saver regions go back to the driver, so the
  engine that shares the GPU can use them (slime #579: a release that frees nothing); ~0.01 ms
  to 0.9 ms measured.
- `torch.cuda.ipc_collect()`: frees blocks a consumer process still maps over CUDA IPC (slime #1731).
- `host=True`: torch's cached pinned host blocks and, through glibc's `malloc_trim(0)`, free heap
  pages go back to the OS (slime clears host memory before sleep: host OOM during sync).

`timings_ms` holds what each part of the last call took.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable

import torch

__all__ = ["ClearMemory"]

_frozen = False  # gc.freeze() is process-wide: done by the first ClearMemory call of the process


class ClearMemory:
    """`clear_memory()` for a Lifecycle: gc, then CUDA cache release only where CUDA is initialised.

    `host=True` also returns freed host memory: torch's cached pinned blocks and, through glibc's
    `malloc_trim(0)`, free heap pages (slime clears host memory before sleep: host OOM during sync).
    `freeze_heap=True` (the default) freezes the heap that survives the first call, so later calls
    collect only younger objects (see the module docstring for the cost and the trade-off).
    """

    def __init__(self, *, host: bool = False, freeze_heap: bool = True) -> None:
        if not isinstance(host, bool):
            raise TypeError(f"ClearMemory(host=...) must be a bool, got {host!r}")
        if not isinstance(freeze_heap, bool):
            raise TypeError(f"ClearMemory(freeze_heap=...) must be a bool, got {freeze_heap!r}")
        self.host = host
        self.freeze_heap = freeze_heap
        self._malloc_trim = _malloc_trim() if host else None
        self.timings_ms: dict[str, float] = {}

    @property
    def trims_heap(self) -> bool:
        """Whether host heap pages are returned to the OS (glibc only)."""
        return self._malloc_trim is not None

    def __call__(self) -> None:
        global _frozen
        timings = self.timings_ms = {}
        t = time.perf_counter()
        gc.collect()
        if self.freeze_heap and not _frozen:
            gc.freeze()
            _frozen = True
        t = _lap(timings, "gc", t)
        # Checking is_initialized() never creates a CUDA context; a CPU process stays CUDA-free.
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            t = _lap(timings, "synchronize", t)
            torch.cuda.empty_cache()
            t = _lap(timings, "empty_cache", t)
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
            t = _lap(timings, "ipc_collect", t)
            if self.host:
                host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
                if host_empty_cache is not None:
                    host_empty_cache()
                    t = _lap(timings, "host_empty_cache", t)
        if self._malloc_trim is not None:
            self._malloc_trim(0)
            _lap(timings, "malloc_trim", t)

    def __repr__(self) -> str:
        return f"ClearMemory(host={self.host}, freeze_heap={self.freeze_heap})"


def _lap(timings: dict[str, float], part: str, since: float) -> float:
    now = time.perf_counter()
    timings[part] = round((now - since) * 1e3, 3)
    return now


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim

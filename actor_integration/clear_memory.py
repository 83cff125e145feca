"""The clear-memory hook: drop garbage, hand cached CUDA blocks back, optionally trim the host heap."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

import torch

__all__ = ["ClearMemory"]


class ClearMemory:
    """`clear_memory()` for a Lifecycle: gc, then CUDA cache release only where CUDA is initialised.

    `host=True` also returns freed host memory: torch's cached pinned blocks and, through glibc's
    `malloc_trim(0)`, free heap pages (slime clears host memory before sleep: host OOM during sync).
    """

    def __init__(self, *, host: bool = False) -> None:
        if not isinstance(host, bool):
            raise TypeError(f"ClearMemory(host=...) must be a bool, got {host!r}")
        self.host = host
        self._malloc_trim = _malloc_trim() if host else None

    @property
    def trims_heap(self) -> bool:
        """Whether host heap pages are returned to the OS (glibc only)."""
        return self._malloc_trim is not None

    def __call__(self) -> None:
        gc.collect()
        # Checking is_initialized() never creates a CUDA context; a CPU process stays CUDA-free.
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # Also frees blocks a consumer process still maps over CUDA IPC (slime #1731).
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
            if self.host:
                host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
                if host_empty_cache is not None:
                    host_empty_cache()
        if self._malloc_trim is not None:
            self._malloc_trim(0)

    def __repr__(self) -> str:
        return f"ClearMemory(host={self.host})"


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim

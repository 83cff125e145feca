"""What this process's NCCL can do: its version, and whether communicators can be suspended."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

SUSPEND_NCCL = (2, 29, 7)  # the first NCCL with ncclCommSuspend / ncclCommResume


@dataclass(frozen=True)
class NcclSuspendSupport:
    """Whether NCCL communicators can be suspended (memory released, communicator kept) here."""

    available: bool
    reason: str
    nccl_version: tuple[int, ...] | None = None
    symbol: bool | None = None  # libnccl exports ncclCommSuspend (None: not determinable)
    torch_api: bool = False  # torch exposes Backend.suspend()/resume()


def nccl_suspend_support() -> NcclSuspendSupport:
    """Probe what torch exposes: its NCCL's version, the `ncclCommSuspend` symbol, `Backend.suspend`."""
    if not dist.is_nccl_available():
        return NcclSuspendSupport(False, f"torch {torch.__version__} is built without NCCL")
    try:
        version = tuple(int(v) for v in cast(Any, torch.cuda).nccl.version())
    except Exception as exc:  # no CUDA driver, or a torch whose nccl module cannot load
        return NcclSuspendSupport(False, f"the NCCL version could not be read ({exc!r})")
    backend = getattr(torch._C, "_distributed_c10d", None)
    torch_api = callable(getattr(getattr(backend, "Backend", None), "suspend", None))
    symbol = _nccl_exports("ncclCommSuspend")
    shown = ".".join(map(str, version))
    if version < SUSPEND_NCCL:
        reason = (
            f"NCCL {shown} (torch {torch.__version__}) has no ncclCommSuspend (needs "
            f"{'.'.join(map(str, SUSPEND_NCCL))}+): communicators are destroyed and rebuilt"
        )
        return NcclSuspendSupport(False, reason, version, symbol, torch_api)
    if not torch_api or symbol is False:
        reason = (
            f"NCCL {shown} {'exports' if symbol else 'may export'} ncclCommSuspend, but torch "
            f"{torch.__version__} {'exposes no Backend.suspend()' if not torch_api else 'loads a libnccl without it'}: "
            "communicators are destroyed and rebuilt"
        )
        return NcclSuspendSupport(False, reason, version, symbol, torch_api)
    reason = f"NCCL {shown}: communicators are suspended (ncclCommSuspend), not destroyed"
    return NcclSuspendSupport(True, reason, version, symbol, torch_api)


def _nccl_exports(symbol: str) -> bool | None:
    """Whether the libnccl this process has loaded exports `symbol`; None when none is loaded."""
    try:
        library = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return None
    return hasattr(library, symbol)

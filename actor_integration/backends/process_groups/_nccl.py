"""The NCCL this process has loaded, and its communicators' suspend, resume and memory counters.

The version that matters is the loaded library's (`ncclGetVersion` on the `libnccl.so.2` already
mapped into the process), not the one torch was built against: a newer `nvidia-nccl-cu13` next
to torch, or one put first with `LD_PRELOAD`, replaces it at run time and keeps the ABI.
`ncclCommSuspend(comm, NCCL_SUSPEND_MEM)` / `ncclCommResume(comm)` / `ncclCommMemStats` exist
from NCCL 2.29.7 on (nccl.h). A communicator is reached through torch's `Backend.suspend()` /
`resume()` where torch has them, else through the loaded library with the pointer torch's
`ProcessGroupNCCL._comm_ptr()` returns (torch 2.11: how the H200 measurement ran,
docs/measurements.md#ncclcommsuspend-on-nccl-2307-2026-12-02).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import _teardown
from actor_integration.errors import NcclError

SUSPEND_NCCL = (2, 29, 7)  # the first NCCL with ncclCommSuspend / ncclCommResume / ncclCommMemStats
NCCL_SUSPEND_MEM = 0x01  # nccl.h: the only suspend flag, "release dynamic GPU memory allocations"
# ncclCommMemStat_t, nccl.h (2.29.7+)
_STAT_SUSPENDABLE, _STAT_SUSPENDED, _STAT_PERSISTENT, _STAT_TOTAL = 0, 1, 2, 3
UPGRADE = (
    "pip install 'nvidia-nccl-cu13>=2.29.7' (nvidia-nccl-cu12 for a CUDA 12 torch) next to torch; it keeps "
    "torch's ABI. Where torch still loads its own copy, start the processes with "
    "LD_PRELOAD=<site-packages>/nvidia/nccl/lib/libnccl.so.2 (`lifecycle doctor` shows the loaded version)"
)


def _shown(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


@dataclass(frozen=True)
class MemStats:
    """`ncclCommMemStats` of one communicator, in bytes."""

    suspendable: int  # what ncclCommSuspend releases
    persistent: int  # what it never releases
    total: int
    suspended: bool


@dataclass(frozen=True)
class LoadedNccl:
    """The `libnccl.so.2` mapped into this process (found without loading one)."""

    version: tuple[int, int, int]
    path: str | None
    lib: Any = field(repr=False, compare=False)

    def has(self, symbol: str) -> bool:
        return hasattr(self.lib, symbol)

    def suspend(self, comm: int) -> None:
        self._check(
            self.lib.ncclCommSuspend(ctypes.c_void_p(comm), NCCL_SUSPEND_MEM), "ncclCommSuspend", comm
        )

    def resume(self, comm: int) -> None:
        self._check(self.lib.ncclCommResume(ctypes.c_void_p(comm)), "ncclCommResume", comm)

    def mem_stats(self, comm: int) -> MemStats | None:
        """The communicator's counters; None where this NCCL has no ncclCommMemStats."""
        if not self.has("ncclCommMemStats"):
            return None

        def stat(which: int) -> int:
            value = ctypes.c_uint64(0)
            code = self.lib.ncclCommMemStats(ctypes.c_void_p(comm), which, ctypes.byref(value))
            self._check(code, "ncclCommMemStats", comm)
            return int(value.value)

        return MemStats(
            suspendable=stat(_STAT_SUSPENDABLE),
            persistent=stat(_STAT_PERSISTENT),
            total=stat(_STAT_TOTAL),
            suspended=bool(stat(_STAT_SUSPENDED)),
        )

    def _check(self, code: int, call: str, comm: int) -> None:
        if code == 0:
            return
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.lib.ncclGetLastError.restype = ctypes.c_char_p
        what = (self.lib.ncclGetErrorString(code) or b"").decode(errors="replace")
        last = (self.lib.ncclGetLastError(ctypes.c_void_p(comm)) or b"").decode(errors="replace")
        raise NcclError(
            f"{call} returned {code} ({what}){': ' + last if last else ''} (NCCL {_shown(self.version)})",
            call=call,
            code=code,
        )


@functools.lru_cache(maxsize=1)
def loaded_nccl() -> LoadedNccl | None:
    """The NCCL library torch's NCCL calls bind to (torch's own, or the one `LD_PRELOAD` put first).

    torch links `libnccl.so.2` dynamically and its python package may map a second copy by full
    path, so a process can hold two: torch's calls bind to the first in the global symbol scope,
    which `LD_PRELOAD` decides. That one's `ncclGetVersion` answers here (`dlsym(RTLD_DEFAULT)`),
    and `dladdr` says which file it is. None where none is mapped (a CPU build of torch).
    """
    try:
        scope = ctypes.CDLL(None)  # the global scope, in the order the dynamic linker searches it
        get_version = scope.ncclGetVersion
    except (OSError, AttributeError):
        return None
    code = ctypes.c_int(0)
    if get_version(ctypes.byref(code)) != 0:
        return None
    path = _file_of(ctypes.cast(get_version, ctypes.c_void_p).value) or _mapped_path("libnccl.so")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL) if path else scope
    except OSError:
        lib = scope
    return LoadedNccl(version=decode_version(code.value), path=path, lib=lib)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _file_of(address: int | None) -> str | None:
    """The file that holds `address` (dladdr), or None."""
    if not address:
        return None
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    info = _DlInfo()
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return str(os.path.realpath(info.dli_fname.decode()))


def decode_version(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before."""
    if code >= 10000:
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def _mapped_path(name: str) -> str | None:
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if name in Path(path).name:
                return path
    except OSError:
        pass
    return None


def torch_nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch was built against (torch/csrc/cuda/nccl.cpp returns its compile-time
    NCCL_VERSION_CODE), not the library it runs: that is `loaded_nccl()`."""
    try:
        return tuple(int(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except Exception:  # no CUDA build, or a torch whose nccl module cannot load
        return None


def comm_ptr_available() -> bool:
    """Whether torch's ProcessGroupNCCL hands out its communicator pointer (`_comm_ptr()`)."""
    nccl_class = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)
    return callable(getattr(nccl_class, "_comm_ptr", None))


def torch_suspend_api() -> bool:
    """Whether torch's backends have `suspend()`/`resume()` (torch's newer ProcessGroupNCCL)."""
    backend = getattr(torch._C._distributed_c10d, "Backend", None)
    return callable(getattr(backend, "suspend", None)) and callable(getattr(backend, "resume", None))


@dataclass(frozen=True)
class NcclSuspendSupport:
    """Whether NCCL communicators can be suspended here (memory released, communicator kept), and how.

    `route`: "torch" (Backend.suspend/resume) or "ctypes" (the loaded library and `_comm_ptr()`).
    """

    available: bool
    reason: str
    nccl_version: tuple[int, ...] | None = None  # the loaded library's
    torch_nccl_version: tuple[int, ...] | None = None  # what torch was built against
    route: str | None = None
    library: str | None = None  # the loaded library's path
    mem_stats: bool = False  # ncclCommMemStats can count the bytes


def nccl_suspend_support(backend: str = "nccl") -> NcclSuspendSupport:
    """Probe the loaded NCCL, torch's API and `_comm_ptr()`; say why not where suspend cannot work."""
    if "nccl" not in backend:
        return NcclSuspendSupport(
            False,
            f"backend {backend!r} has no NCCL communicators to suspend; use communicators='destroy' or 'keep'",
        )
    if not dist.is_nccl_available():
        return NcclSuspendSupport(False, f"torch {torch.__version__} is built without NCCL")
    loaded, torch_version = loaded_nccl(), torch_nccl_version()
    version = loaded.version if loaded else torch_version
    path = loaded.path if loaded else None
    found = NcclSuspendSupport(
        False,
        "",
        nccl_version=version,
        torch_nccl_version=torch_version,
        library=path,
        mem_stats=bool(loaded and loaded.has("ncclCommMemStats")),
    )
    where = f" ({path})" if path else ""
    if version is None:
        return replace(found, reason="the NCCL version could not be read (no libnccl.so.2 is loaded)")
    if version < SUSPEND_NCCL:
        reason = f"NCCL {_shown(version)} is loaded{where}; ncclCommSuspend needs {_shown(SUSPEND_NCCL)}+. {UPGRADE}"
        return replace(found, reason=reason)
    if torch_suspend_api():
        return replace(
            found,
            available=True,
            reason=f"NCCL {_shown(version)}{where}: suspended through torch's Backend.suspend()",
            route="torch",
        )
    if loaded is None or not (loaded.has("ncclCommSuspend") and loaded.has("ncclCommResume")):
        reason = (
            f"torch {torch.__version__} reports NCCL {_shown(version)} but has no Backend.suspend(), and no "
            "loaded libnccl.so.2 exports ncclCommSuspend to reach its communicators with"
        )
        return replace(found, reason=reason)
    if not comm_ptr_available():
        reason = (
            f"NCCL {_shown(version)} is loaded{where}, but torch {torch.__version__} neither has "
            "Backend.suspend() nor hands out ProcessGroupNCCL._comm_ptr(): the communicators cannot be reached"
        )
        return replace(found, reason=reason)
    reason = f"NCCL {_shown(version)}{where}: suspended through the loaded library and torch's _comm_ptr()"
    return replace(found, available=True, reason=reason, route="ctypes")


class Communicator(Protocol):
    """One process group's NCCL communicator, as the suspend and keep ways reach it."""

    @property
    def name(self) -> str: ...

    def created(self) -> bool:
        """Whether it exists: torch creates a communicator at its group's first collective."""
        ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> MemStats | None:
        """ncclCommMemStats, or None where this NCCL (or the route to it) cannot say."""
        ...


class NcclCommunicator:
    """A torch group's NCCL communicator: torch's Backend.suspend/resume where torch has them,
    else the loaded library called on the pointer `_comm_ptr()` returns."""

    def __init__(self, name: str, backend: Any, library: LoadedNccl | None) -> None:
        self._name = name
        self._backend = backend
        self._library = library

    @property
    def name(self) -> str:
        return self._name

    def _ptr(self) -> int | None:
        comm_ptr = getattr(self._backend, "_comm_ptr", None)
        return int(comm_ptr()) if callable(comm_ptr) else None

    def created(self) -> bool:
        ptr = self._ptr()
        return ptr is None or ptr != 0  # without _comm_ptr() torch's own suspend decides

    def suspend(self) -> None:
        if callable(getattr(self._backend, "suspend", None)):
            self._backend.suspend()
        else:
            self._library_call().suspend(self._require_ptr())

    def resume(self) -> None:
        if callable(getattr(self._backend, "resume", None)):
            self._backend.resume()
        else:
            self._library_call().resume(self._require_ptr())

    def stats(self) -> MemStats | None:
        ptr = self._ptr()
        if ptr and self._library is not None:
            return self._library.mem_stats(ptr)
        memory_stats = getattr(self._backend, "memory_stats", None)
        if callable(memory_stats):  # torch's newer ProcessGroupNCCL: ncclCommMemStats' counters by name
            return _from_torch(memory_stats())
        return None

    def _library_call(self) -> LoadedNccl:
        if self._library is None or not self._library.has("ncclCommSuspend"):
            raise NcclError(
                f"group {self._name}: torch has no Backend.suspend() and no loaded libnccl.so.2 exports "
                f"ncclCommSuspend. {UPGRADE}",
                call="ncclCommSuspend",
            )
        return self._library

    def _require_ptr(self) -> int:
        ptr = self._ptr()
        if not ptr:
            raise NcclError(
                f"group {self._name} has no NCCL communicator (never used, or _comm_ptr() is missing)",
                call="_comm_ptr",
            )
        return ptr


def _from_torch(counters: Any) -> MemStats | None:
    """torch's `Backend.memory_stats()` dict, read by the counters' names (suspend, suspended, persist, total)."""
    if not isinstance(counters, dict):
        return None

    def pick(*words: str, without: str = "") -> int | None:
        for key, value in counters.items():
            name = str(key).lower()
            if all(w in name for w in words) and not (without and without in name):
                return int(value)
        return None

    suspendable = pick("suspend", without="suspended")
    total = pick("total")
    if suspendable is None or total is None:
        return None
    persistent = pick("persist")
    return MemStats(
        suspendable=suspendable,
        persistent=persistent if persistent is not None else total - suspendable,
        total=total,
        suspended=bool(pick("suspended")),
    )


def communicator_of(pg: ProcessGroup) -> Communicator | None:
    """The group's NCCL communicator, or None for gloo (and other non-NCCL) groups."""
    backend = _teardown.nccl_backend(pg)
    if backend is None:
        return None
    return NcclCommunicator(str(pg.group_name), backend, loaded_nccl())

"""What the installed torch_memory_saver supports, read without initialising it (no CUDA touched).

Two lines of torch_memory_saver are in use: upstream (fzyzcjy/torch_memory_saver, 0.0.10 here) and
the fork slime's image builds (zhuzilin/torch_memory_saver at the Dockerfile's `TMS_COMMIT`,
8d30c59c for slime 624b824a). They differ in what the adapters rely on: the fork has no
`retain_cpu_backup` (neither the Python property nor `tms_set_retain_cpu_backup` in its library)
and no `cpu_backup_backend` on `region()`, so assigning `saver.retain_cpu_backup = True` there only
sets a Python attribute nothing reads. `saver_capabilities` reads the class and, where it is known,
the hook library's exported names, so an adapter asks before it relies on a feature, and `lifecycle
doctor` and the `lifecycle.configured` event name what this saver supports.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CAPABILITIES", "RETAIN_COST", "SaverCapabilities", "saver_capabilities"]

# Each capability: how the Python class shows it, and the library symbol it needs (None: Python only).
CAPABILITIES: Mapping[str, str] = {
    "retain_cpu_backup": "keep the pinned CPU backup between a resume and the next pause",
    "cpu_backup_backend": "region(cpu_backup_backend='pinned' | 'mmap')",
    "disk_backup": "region(enable_disk_backup=True): paused memory spilled to files",
    "get_cpu_backup": "read a tensor's CPU backup",
    "memory_margin_bytes": "refuse a resume that would leave less than a margin free",
    "cuda_graph": "pausable CUDA graphs",
}
_SYMBOLS: Mapping[str, bytes] = {
    "retain_cpu_backup": b"tms_set_retain_cpu_backup",
    "cpu_backup_backend": b"tms_set_cpu_backup_backend",
    "disk_backup": b"tms_set_enable_disk_backup",
    "get_cpu_backup": b"tms_get_cpu_backup_pointer",
}
# docs/measurements.md, 2026-12-01 (H200, 0.6B-shaped state of 8.9 GiB): what a missing retain costs.
RETAIN_COST = (
    "every pause allocates the pinned CPU backup again and every resume frees it: on an H200 a sleep + wake "
    "of an 8.9 GiB training state took 5.75 s this way against 0.39 s with the backup retained"
)


@dataclass(frozen=True)
class SaverCapabilities:
    """What one torch_memory_saver offers. `source` names it (distribution and version, or the class)."""

    source: str
    supported: frozenset[str]
    why_not: Mapping[str, str] = field(default_factory=dict)  # capability → why it is missing

    def supports(self, capability: str) -> bool:
        if capability not in CAPABILITIES:
            raise ValueError(
                f"unknown torch_memory_saver capability {capability!r}; known: {list(CAPABILITIES)}"
            )
        return capability in self.supported

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(name for name in CAPABILITIES if name not in self.supported)

    def describe(self) -> str:
        """One line: what it supports, then what it lacks and why."""
        has = (
            ", ".join(name for name in CAPABILITIES if name in self.supported)
            or "none of the optional features"
        )
        lacks = "; ".join(f"no {name} ({self.why_not.get(name, 'absent')})" for name in self.missing)
        return f"{self.source}: {has}" + (f"; {lacks}" if lacks else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "supported": [name for name in CAPABILITIES if name in self.supported],
            "missing": {name: self.why_not.get(name, "absent") for name in self.missing},
        }


def saver_capabilities(saver: Any = None, *, library: str | Path | None = None) -> SaverCapabilities:
    """The capabilities of `saver` (default: the installed `torch_memory_saver.torch_memory_saver`).

    Read from its class (never from the instance, where assigning an unknown attribute succeeds
    silently) and, when `library` (a hook-mode .so of that saver) is given, from the names that
    library exports: a Python feature whose symbol is missing is not supported.
    """
    if saver is None:
        from torch_memory_saver import torch_memory_saver

        saver = torch_memory_saver
    cls = type(saver)
    why_not: dict[str, str] = {}
    supported: set[str] = set()
    region = inspect.getattr_static(cls, "region", None)
    region_params = _parameters(region)
    python = {
        "retain_cpu_backup": _is_property(inspect.getattr_static(cls, "retain_cpu_backup", None)),
        "cpu_backup_backend": "cpu_backup_backend" in region_params,
        "disk_backup": "enable_disk_backup" in region_params,
        "get_cpu_backup": callable(inspect.getattr_static(cls, "get_cpu_backup", None)),
        "memory_margin_bytes": _is_property(inspect.getattr_static(cls, "memory_margin_bytes", None)),
        "cuda_graph": callable(inspect.getattr_static(cls, "cuda_graph", None)),
    }
    exported = _library_bytes(library)
    for name, present in python.items():
        symbol = _SYMBOLS.get(name)
        if not present:
            why_not[name] = f"{cls.__name__} has no {_python_form(name)}"
        elif exported is not None and symbol is not None and symbol not in exported:
            why_not[name] = f"{Path(str(library)).name} does not export {symbol.decode()}"
        else:
            supported.add(name)
    return SaverCapabilities(_source(saver), frozenset(supported), why_not)


def _python_form(name: str) -> str:
    return {
        "retain_cpu_backup": "retain_cpu_backup property",
        "cpu_backup_backend": "cpu_backup_backend argument to region()",
        "disk_backup": "enable_disk_backup argument to region()",
        "memory_margin_bytes": "memory_margin_bytes property",
    }.get(name, f"{name}()")


def _is_property(member: Any) -> bool:
    return isinstance(member, property) or hasattr(member, "__set__")


def _parameters(function: Any) -> frozenset[str]:
    target = getattr(function, "__func__", function)
    target = getattr(target, "__wrapped__", target)  # contextlib.contextmanager keeps the generator here
    try:
        return frozenset(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _library_bytes(library: str | Path | None) -> bytes | None:
    if library is None:
        return None
    try:
        return Path(library).read_bytes()
    except OSError:
        return None


def _source(saver: Any) -> str:
    module = type(saver).__module__
    if module.split(".")[0] == "torch_memory_saver":
        try:
            return f"torch_memory_saver {importlib.metadata.version('torch-memory-saver')}"
        except importlib.metadata.PackageNotFoundError:
            return "torch_memory_saver (version unknown)"
    return f"{module}.{type(saver).__qualname__}"

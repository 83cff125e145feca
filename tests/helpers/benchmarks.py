"""The benchmark and tool scripts as modules, for the tests of their host-side parts (tests only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SCRIPTS = REPO / "scripts"


def _load(folder: Path, name: str, keep: bool) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if not keep:
            del sys.modules[name]
    return module


def load_benchmark(name: str, *, keep: bool = False) -> ModuleType:
    """`benchmarks/<name>.py` (the scripts are no package) as a module. It is in `sys.modules`
    while it runs (dataclasses look their module up), and after only with `keep`."""
    return _load(BENCHMARKS, name, keep)


def load_script(name: str) -> ModuleType:
    """`scripts/<name>.py` as a module, kept in `sys.modules` (its dataclasses look it up when used)."""
    return _load(SCRIPTS, name, keep=True)

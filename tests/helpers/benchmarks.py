"""The benchmark scripts as modules, for the tests of their host-side parts (tests only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str, *, keep: bool = False) -> ModuleType:
    """`benchmarks/<name>.py` (the scripts are no package) as a module. It is in `sys.modules`
    while it runs (dataclasses look their module up), and after only with `keep`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if not keep:
            del sys.modules[name]
    return module

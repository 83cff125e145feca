"""Rollout engines by name, as weight transports are (`weight_sync/transport.py`).

An engine is a `RolloutEngine` class named by "module:attribute", imported only when it is asked
for: naming an engine costs nothing, and an engine whose package is not installed (sglang, vllm)
fails only where it is used. `reference`, `sglang` and `vllm` are registered here; another engine
registers itself with `register_engine` (or is added to `_BUILT_IN`).

    from actor_integration.rollout.registry import engine_class, engine_names
    engine_names()                    # ("reference", "sglang", ...)
    engine_class("sglang")            # actor_integration.engines.sglang.engine.SGLangEngine
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from actor_integration.errors import UnknownEngineError

__all__ = [
    "EngineEntry",
    "UnknownEngineError",
    "check_engine_name",
    "engine_class",
    "engine_entry",
    "engine_names",
    "register_engine",
]


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine: its name, where its `RolloutEngine` class is ("module:attribute")
    and one line saying what it is."""

    name: str
    path: str
    description: str = ""

    def load(self) -> Any:
        module, _, attribute = self.path.partition(":")
        return getattr(importlib.import_module(module), attribute)


_BUILT_IN = (
    EngineEntry(
        "reference",
        "actor_integration.rollout.reference:ReferenceEngine",
        "the reference torch engine (CPU or GPU): a tiny model that generates greedily",
    ),
    EngineEntry(
        "sglang",
        "actor_integration.engines.sglang.engine:SGLangEngine",
        "SGLang's offline engine (sglang.Engine), on CUDA",
    ),
    EngineEntry(
        "vllm",
        "actor_integration.engines.vllm.offline:VLLMEngine",
        "vLLM's offline engine (vllm.LLM, sleep mode on), on CUDA; under VLLMRolloutActor",
    ),
)
_ENGINES: dict[str, EngineEntry] = {entry.name: entry for entry in _BUILT_IN}
_LOCK = threading.Lock()


def register_engine(name: str, path: str, description: str = "", *, replace: bool = False) -> EngineEntry:
    """Register the engine `name` as the class at `path` ("module:attribute", imported on use).
    A name already registered to another path is refused unless `replace`."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_engine: the name must be a non-empty string, got {name!r}")
    module, sep, attribute = path.partition(":")
    if not (module and sep and attribute):
        raise ValueError(f"register_engine({name!r}): the path must be 'module:attribute', got {path!r}")
    entry = EngineEntry(name, path, description)
    with _LOCK:
        current = _ENGINES.get(name)
        if current is not None and current.path != path and not replace:
            raise ValueError(
                f"register_engine({name!r}): already registered as {current.path!r}; pass replace=True"
            )
        _ENGINES[name] = entry
    return entry


def engine_names() -> tuple[str, ...]:
    """The registered engines' names, in registration order."""
    with _LOCK:
        return tuple(_ENGINES)


def check_engine_name(name: object) -> str:
    """`name` if an engine is registered under it, else `UnknownEngineError` listing the known ones."""
    with _LOCK:
        if isinstance(name, str) and name in _ENGINES:
            return name
        known = tuple(_ENGINES)
    raise UnknownEngineError(
        f"unknown rollout engine {name!r}; the registered engines are {list(known)}", name=name, known=known
    )


def engine_entry(name: str) -> EngineEntry:
    check_engine_name(name)
    with _LOCK:
        return _ENGINES[name]


def engine_class(name: str) -> Any:
    """The engine's `RolloutEngine` class, imported now."""
    return engine_entry(name).load()

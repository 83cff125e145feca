"""Where an engine's node-0 actor publishes its lifecycle for the engine's followers.

A multi-node engine (SGLang's `nnodes > 1`) has one actor per node; only node 0's drives the
server. The others (followers) read what node 0's actor last published here: in a Ray worker,
Ray's internal key-value store; elsewhere one process's `LocalDirectory`.
"""

from __future__ import annotations

import json
import threading
from typing import Any, ClassVar

__all__ = ["EngineDirectory", "LocalDirectory", "engine_directory"]


class EngineDirectory:
    """Where an engine's node-0 actor publishes its lifecycle for the engine's followers."""

    def put(self, key: str, value: dict[str, Any]) -> None:
        raise NotImplementedError

    def get(self, key: str) -> dict[str, Any] | None:
        raise NotImplementedError


class LocalDirectory(EngineDirectory):
    """One process's directory (tests, and actors run in one process)."""

    entries: ClassVar[dict[str, dict[str, Any]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self.entries[key] = json.loads(json.dumps(value, default=str))

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self.entries.get(key)
            return None if entry is None else dict(entry)


class _RayDirectory(EngineDirectory):
    """Ray's internal key-value store: every actor of the job reads what node 0's actor wrote."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.kv._internal_kv_put(key, json.dumps(value, default=str).encode(), overwrite=True)

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self.kv._internal_kv_get(key)
        return None if raw is None else dict(json.loads(raw))


def engine_directory() -> EngineDirectory:
    """Ray's key-value store inside a Ray worker, else this process's `LocalDirectory`."""
    try:
        from ray.experimental import internal_kv
    except ImportError:
        return LocalDirectory()
    initialized = getattr(internal_kv, "_internal_kv_initialized", lambda: False)
    return _RayDirectory(internal_kv) if initialized() else LocalDirectory()

"""What the engine-agnostic server-actor lifecycle (`server_actor`) calls on an engine's server.

An engine server's client (SGLang's `SGLangHTTPEngine`) satisfies `ServerClient`: memory released
and resumed by tag (several tags in one request), generation paused and continued, the cache
flushed, the weight version the server reports, a liveness probe, a generation, its connections
closed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ServerClient"]


@runtime_checkable
class ServerClient(Protocol):
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Release the memory of `tags` (None: every tag) in one request."""
        ...

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Map the memory of `tags` (None: every tag) back in one request."""
        ...

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating (`mode`: the engine's pause mode, e.g. "abort")."""
        ...

    def continue_generation(self) -> None:
        """Generate again."""
        ...

    def flush_cache(self) -> bool:
        """Flush the engine's cache; False while the engine is busy (then retried)."""
        ...

    def served_weight_version(self) -> str | None:
        """The weight version the server reports serving."""
        ...

    def alive(self) -> None:
        """Raise unless the server answers (no generation: its memory may be released)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens for each prompt."""
        ...

    def close(self) -> None:
        """Close the kept-alive connections (a later call opens what it needs again)."""
        ...

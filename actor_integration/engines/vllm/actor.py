"""`VLLMRolloutActor`: `RolloutActor` with the memory hook vLLM's sleep needs.

The lifecycle releases memory one tag at a time (weights, then the KV cache); vLLM's sleep releases
both at once and cannot release either alone. `VLLMMemory` bridges the two honestly: the first
tag's release is vLLM's sleep of both, and the other tag's release, which follows in the same
sleep, is acknowledged as done by it. So that this pairing always completes, `VLLMRolloutActor`
refuses a sleep of one tag (`SleepTagsError`) before the lifecycle starts it. Wakes go tag by tag,
as vLLM's `wake_up(tags)` does (the colocated wake: weights, sync, then the KV cache).

A level-2 engine discards its weights on sleep: the lifecycle then counts them as discarded and
refuses generation until a sync's final round loads (`discard_on_release`); a level-1 engine keeps
them in host RAM and discards only the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from actor_integration.engines.vllm.base import VLLMAdapter
from actor_integration.engines.vllm.guards import VLLM_TAGS, chosen_tags
from actor_integration.errors import SleepTagsError
from actor_integration.rollout.actor import RolloutActor
from actor_integration.rollout.engine import QueryableEngineMemory


class VLLMMemory(QueryableEngineMemory):
    """The lifecycle's per-tag memory hook over vLLM's sleep of both tags (see the module docstring)."""

    def __init__(self, engine: VLLMAdapter) -> None:
        super().__init__(engine)
        self.together: set[str] = set()  # tags the last sleep released beside the one asked

    def pause(self, tag: str | None = None) -> None:
        if tag is not None and tag in self.together:
            self.together.discard(tag)  # released by the sleep that released its partner
            return
        self.together.clear()
        self.engine.release_memory_occupation(None)
        if tag is not None:
            self.together = set(VLLM_TAGS) - {tag}

    def resume(self, tag: str | None = None) -> None:
        self.together.clear()
        self.engine.resume_memory_occupation(None if tag is None else [tag])


class VLLMRolloutActor(RolloutActor):
    """A `RolloutActor` over `VLLMEngine` or `VLLMHTTPEngine` (or a factory of one). Takes
    `RolloutActor`'s keyword arguments; `discard_on_release` defaults to what the engine's sleep
    level discards."""

    def __init__(self, engine: VLLMAdapter | Callable[[], VLLMAdapter], **kwargs: Any) -> None:
        built = engine if isinstance(engine, VLLMAdapter) else engine()
        if not isinstance(built, VLLMAdapter):
            raise TypeError(
                f"VLLMRolloutActor drives VLLMEngine or VLLMHTTPEngine, got {type(built).__name__}; use "
                "RolloutActor for other engines"
            )
        discarded = VLLM_TAGS if built.sleep_level == 2 else ("kv_cache",)
        kwargs.setdefault("discard_on_release", discarded)
        super().__init__(built, **kwargs)
        self.memory_audit.memory = VLLMMemory(built)
        self.memory_audit.expected_bytes = self._expected_bytes

    def _expected_bytes(self, tag: str | None) -> int | None:
        """What a release of `tag` frees: the first tag's release is vLLM's sleep of both."""
        memory_bytes = getattr(self.engine, "memory_bytes", None)
        if memory_bytes is None:
            return None
        together = (
            self.memory_audit.memory.together if isinstance(self.memory_audit.memory, VLLMMemory) else set()
        )
        if tag is not None and tag in together:
            return 0
        value: int | None = memory_bytes(None)
        return value

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """Sleep every tag; a subset is refused before the lifecycle starts (vLLM cannot release one alone)."""
        chosen = chosen_tags(tags, "VLLMRolloutActor.sleep")
        if chosen != VLLM_TAGS:
            raise SleepTagsError(
                f"VLLMRolloutActor: vLLM cannot release {list(chosen)} alone (its sleep releases the weights "
                "and the KV cache together); sleep every tag (tags=None). Nothing was called.",
                tags=list(chosen),
                releasable=[list(VLLM_TAGS)],
                engine=type(self.engine).__name__,
            )
        super().sleep(tags)


__all__ = ["VLLMMemory", "VLLMRolloutActor"]

"""`VLLMRolloutActor`: `RolloutActor` with the memory hook vLLM's sleep needs.

vLLM's sleep releases the weights and the KV cache at once and cannot release either alone. The
lifecycle's sleep releases a stage's tags in one call where the memory hook takes tags together
(`MemoryBatches`): `VLLMMemory` does, so the sleep of both tags is vLLM's one sleep (through the
release audit, which keeps that call). So that a sleep always carries both, `VLLMRolloutActor`
refuses a sleep of one tag (`SleepTagsError`) before the lifecycle starts it. Wakes go tag by tag
where the caller asks one tag at a time, as vLLM's `wake_up(tags)` does (the colocated wake:
weights, sync, then the KV cache), and in one `wake_up` where one wake asks both.

A level-2 engine discards its weights on sleep: the lifecycle then counts them as discarded and
refuses generation until a sync's final round loads (`discard_on_release`); a level-1 engine keeps
them in host RAM and discards only the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actor_integration.engines.vllm.base import VLLMAdapter
from actor_integration.engines.vllm.guards import VLLM_TAGS, chosen_tags
from actor_integration.errors import SleepTagsError
from actor_integration.rollout.actor import RolloutActor
from actor_integration.rollout.engine import QueryableEngineMemory


class VLLMMemory(QueryableEngineMemory):
    """The lifecycle's memory hook over vLLM: a stage's tags in one call (see the module docstring);
    a pause of one tag alone is the adapter's refusal (`SleepTagsError`), vLLM untouched."""

    def pause_tags(self, tags: tuple[str, ...]) -> None:
        self.engine.release_memory_occupation(list(tags))

    def resume_tags(self, tags: tuple[str, ...]) -> None:
        self.engine.resume_memory_occupation(list(tags))


class VLLMRolloutActor(RolloutActor):
    """A `RolloutActor` over `VLLMEngine` or `VLLMHTTPEngine` (or a factory of one), or over a wrapper
    that delegates every call to one and names it as `wrapped` (the demo's fault injector). Takes
    `RolloutActor`'s keyword arguments; `discard_on_release` defaults to what the engine's sleep
    level discards."""

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        built = engine if _adapter(engine) is not None or not callable(engine) else engine()
        adapter = _adapter(built)
        if adapter is None:
            raise TypeError(
                f"VLLMRolloutActor drives VLLMEngine or VLLMHTTPEngine, got {type(built).__name__}; use "
                "RolloutActor for other engines"
            )
        discarded = VLLM_TAGS if adapter.sleep_level == 2 else ("kv_cache",)
        kwargs.setdefault("discard_on_release", discarded)
        # vLLM's sleep pauses its scheduler (abort) and clears its caches before it releases, and a
        # subset is refused here before the lifecycle starts: the sleep sends no pause or flush first.
        kwargs.setdefault(
            "pause_in_release",
            kwargs.get("generation_mode", "abort") == "abort"
            and callable(getattr(built, "pause_with_release", None)),
        )
        super().__init__(built, **kwargs)
        self.memory_audit.memory = VLLMMemory(built)

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


def _adapter(engine: Any) -> VLLMAdapter | None:
    """The vLLM adapter `engine` is, or the one a delegating wrapper names as `wrapped`."""
    for candidate in (engine, getattr(engine, "wrapped", None)):
        if isinstance(candidate, VLLMAdapter):
            return candidate
    return None


__all__ = ["VLLMMemory", "VLLMRolloutActor"]

"""The rollout engine interface (SGLang's names) and the adapters a `Lifecycle` drives it through."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

GENERATION_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes
ENGINE_TAGS = ("weights", "kv_cache")

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout actor needs from an engine; `sglang.Engine` is adapted in `rollout.sglang`.

    `load_weights` receives one round of a versioned update: `shards[i]` are the named tensors for
    engine rank i (the trainer rank on the same GPU sent them). Round 0 starts the version, the
    round with `final=True` completes it; an engine that can stage keeps its previous weights
    until then.
    """

    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> list[list[int]]: ...

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> None: ...

    def load_weights(
        self, version: int, shards: Sequence[NamedTensors], *, round_index: int, final: bool
    ) -> None: ...

    def weights_checksum(self) -> str: ...


class EngineMemory:
    """A `MemoryBackend` over an engine: pause/resume a tag = release/resume its memory occupation.

    `disable()` is a null context: the engine allocates its own memory; nothing the sync body
    allocates in the actor process is under a memory saver.
    """

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def pause(self, tag: str | None = None) -> None:
        self.engine.release_memory_occupation(None if tag is None else [tag])

    def resume(self, tag: str | None = None) -> None:
        self.engine.resume_memory_occupation(None if tag is None else [tag])

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield


class QueryableEngineMemory(EngineMemory):
    """`EngineMemory` for an engine that reports its residency (the reference engine does, SGLang does
    not): `recover()` can then ask what a failed release or resume left behind instead of refusing."""

    def is_paused(self, tag: str | None = None) -> bool:
        residency: dict[str, bool] = self.engine.residency  # type: ignore[attr-defined]
        return not all(residency.values()) if tag is None else not residency[tag]


class EngineGeneration:
    """A `GenerationBackend` over an engine: pause = pause generation, flush the cache, then run
    `on_pause` (the rollout drops its cached IPC handles there); resume = continue generation."""

    def __init__(
        self, engine: RolloutEngine, *, mode: str = "abort", on_pause: Callable[[], Any] | None = None
    ) -> None:
        if mode not in GENERATION_MODES:
            raise ValueError(f"EngineGeneration: mode must be one of {list(GENERATION_MODES)}, got {mode!r}")
        self.engine = engine
        self.mode = mode
        self.on_pause = on_pause

    def pause(self) -> None:
        self.engine.pause_generation(self.mode)
        self.engine.flush_cache()
        if self.on_pause is not None:
            self.on_pause()

    def resume(self) -> None:
        self.engine.continue_generation()

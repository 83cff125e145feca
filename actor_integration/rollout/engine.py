"""The rollout engine interface (SGLang's names) and the adapters a `Lifecycle` drives it through."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from actor_integration.errors import EngineNotIdleError
from actor_integration.weight_sync.buckets import BucketManifest
from actor_integration.weight_sync.receiver import WeightTargets
from actor_integration.weight_sync.wire import RankPayload

GENERATION_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes
# AReaL's pause before a release (76138cb3, sglang_remote.get_pause_requests): "abort" drains the
# requests (SGLang's release asserts an idle scheduler), then "in_place" raises the scheduler's
# paused flag (the abort never reaches the scheduler), which AReaL's AWEX plugin waits for.
ABORT_THEN_IN_PLACE = "abort_then_in_place"
PAUSE_MODES = (*GENERATION_MODES, ABORT_THEN_IN_PLACE)  # what `EngineGeneration` takes
ENGINE_TAGS = ("weights", "kv_cache")
FLUSH_DEADLINE_S = 30.0  # how long `EngineGeneration` retries a flush that reports the engine busy

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout actor needs from an engine; `sglang.Engine` is adapted in `engines.sglang.engine`.

    `load_weights` receives one round of a versioned update: `shards[i]` are the named tensors for
    engine rank i (the trainer rank on the same GPU sent them). Round 0 starts the version, the
    round with `final=True` completes it; an engine that can stage keeps its previous weights
    until then, and says so with a true `stages_weights` attribute (the lifecycle then counts its
    weights as valid until the final round; otherwise as unknown from round 0 until the final).

    `flush_cache` answers whether it flushed: False means the engine still had requests and
    flushed nothing (SGLang refuses then); an engine that returns None cannot tell and counts
    as flushed. Engines that can say what is still queued also implement `ReportsQueue`.
    """

    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> list[list[int]]: ...

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> bool | None: ...

    def load_weights(
        self, version: int, shards: Sequence[NamedTensors], *, round_index: int, final: bool
    ) -> None: ...

    def weights_checksum(self) -> str: ...


@runtime_checkable
class LoadsInPlace(Protocol):
    """An engine whose weights the receiver writes directly, with no intermediate tensor: it hands
    out its parameter tensors (or its own staging tensors) per round, and is told when they are
    written. The receiver checks every bucket and every name, shape and dtype before it writes.

    `weight_targets` returns, per engine rank, the tensors round `round_index` goes into: the
    served weights when the version comes in one round (round 0 and final), with
    `complete=True` so a version missing a tensor is refused before anything is written; staging
    tensors otherwise, if the engine keeps its previous weights until the final round (then
    `stages_weights` is true). `weights_written` follows every written round (the names per rank);
    at the final round the engine serves the new version. Only an engine whose parameters live in
    this process can opt in: SGLang's live in its scheduler processes (see `LoadsBuckets`)."""

    def weight_targets(self, version: int, *, round_index: int, final: bool) -> WeightTargets: ...

    def weights_written(
        self, version: int, names: Sequence[Sequence[str]], *, round_index: int, final: bool
    ) -> None: ...


@runtime_checkable
class LoadsBuckets(Protocol):
    """An engine that takes verified buckets whole: per engine rank, (uint8 region, manifest) pairs,
    valid during the call. SGLang's `update_weights_from_tensor(load_format="flattened_bucket")`
    takes exactly that shape, so the adapter passes a bucket without re-flattening its tensors."""

    def load_buckets(
        self,
        version: int,
        buckets: Sequence[Sequence[tuple[torch.Tensor, BucketManifest]]],
        *,
        round_index: int,
        final: bool,
    ) -> None: ...


@runtime_checkable
class LoadsPayloads(Protocol):
    """An engine whose own processes receive a round: it takes the payloads unopened, opens the
    trainer's buffers where its parameters live, verifies them and loads (SGLang's schedulers,
    through `engines.sglang.receiver`). `accepts_payloads(transport)` says for which transports;
    `load_payloads` raises `CorruptBucketError` when a bucket fails its checksum (nothing written)
    and any error with `written=True` in its fields when the parameters were touched;
    `release_payload_handles` closes the buffers it holds open (the rollout's sleep calls it).
    `check_payloads` refuses a round before anything is sent (its grants are still the caller's)."""

    def accepts_payloads(self, transport: str) -> bool: ...

    def check_payloads(self, payloads: Sequence[RankPayload]) -> None: ...

    def load_payloads(
        self, version: int, payloads: Sequence[RankPayload], *, round_index: int, final: bool
    ) -> dict[str, Any]: ...

    def release_payload_handles(self) -> int: ...


@runtime_checkable
class ReportsQueue(Protocol):
    """An engine that can say which requests it still holds: `{"running": n, "waiting": m}`."""

    def queued_requests(self) -> dict[str, int]: ...


def implements(engine: Any, protocol: type) -> bool:
    """Whether `engine` has every method of `protocol` (one of this module's), looked up as a call
    finds it: a delegating wrapper's `__getattr__` counts. `isinstance` on a runtime protocol does
    not consult `__getattr__` from Python 3.12 on, so a wrapped engine silently lost its load path
    there (the demo's fault-injecting wrapper over SGLang took the slow path on the GPU machine)."""
    members = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return all(callable(getattr(engine, name, None)) for name in members)


class Clock(Protocol):
    """What `EngineGeneration` waits with: the `time` module, or a fake one in tests."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float, /) -> None: ...


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
    `on_pause` (the rollout drops its cached IPC handles there); resume = continue generation.
    `mode` is one of SGLang's, or `ABORT_THEN_IN_PLACE`: two pauses, "abort" then "in_place".

    A flush that reports the engine busy is retried with a growing backoff until
    `flush_deadline_s` (None: `FLUSH_DEADLINE_S`; 0: one attempt), then `EngineNotIdleError`
    is raised. The sleep plan pauses generation before it releases memory, so that error leaves
    the machine FAILED with the memory still resident, never released under live requests.

    `pause_in_release`: the engine's release pauses generation (abort) and clears its caches in the
    same call, before it releases (vLLM's sleep), and every sleep that pauses releases or is refused
    before the engine is called: the pause then only tells the engine so (`pause_with_release`) and
    sends nothing. A release refused or failed leaves the memory resident under whatever runs.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        mode: str = "abort",
        on_pause: Callable[[], Any] | None = None,
        flush_deadline_s: float | None = None,
        flush_backoff_s: float = 0.05,
        clock: Clock = time,
        pause_in_release: bool = False,
    ) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"EngineGeneration: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        deadline = FLUSH_DEADLINE_S if flush_deadline_s is None else flush_deadline_s
        if deadline < 0 or flush_backoff_s <= 0:
            raise ValueError(
                f"EngineGeneration: flush_deadline_s must be >= 0 and flush_backoff_s > 0, got "
                f"{flush_deadline_s!r} and {flush_backoff_s!r}"
            )
        self.engine = engine
        self.mode = mode
        self.on_pause = on_pause
        self.flush_deadline_s = deadline
        self.flush_backoff_s = flush_backoff_s
        self.clock = clock
        if pause_in_release and (
            mode != "abort" or not callable(getattr(engine, "pause_with_release", None))
        ):
            raise ValueError(
                f"EngineGeneration: pause_in_release needs mode 'abort' and an engine with pause_with_release "
                f"(vLLM's adapters), got mode {mode!r} and {type(engine).__name__}"
            )
        self.pause_in_release = pause_in_release

    def pause(self) -> None:
        if self.pause_in_release:
            self.engine.pause_with_release()  # type: ignore[attr-defined]
        else:
            for mode in ("abort", "in_place") if self.mode == ABORT_THEN_IN_PLACE else (self.mode,):
                self.engine.pause_generation(mode)
            self._flush()
        if self.on_pause is not None:
            self.on_pause()

    def resume(self) -> None:
        self.engine.continue_generation()

    def _flush(self) -> None:
        # After a retract or in_place pause, requests can stay queued and SGLang refuses the flush
        # (sglang #31962): asserting on it kills the scheduler, retrying without a deadline spins.
        start = self.clock.monotonic()
        backoff = self.flush_backoff_s
        attempts = 0
        while True:
            attempts += 1
            if self.engine.flush_cache() is not False:
                return
            waited = self.clock.monotonic() - start
            if waited >= self.flush_deadline_s:
                break
            self.clock.sleep(min(backoff, self.flush_deadline_s - waited))
            backoff = min(backoff * 2, 1.0)
        queued: dict[str, int] | None = None
        what = "the engine cannot say what is queued"
        if implements(self.engine, ReportsQueue):
            try:
                queued = self.engine.queued_requests()  # type: ignore[attr-defined]
                what = f"still queued: {queued}"
            except Exception as exc:  # the report is a courtesy: never mask the not-idle error
                what = f"asking what is queued failed: {exc!r}"
        raise EngineNotIdleError(
            f"flush_cache reported the engine busy after pause_generation(mode={self.mode!r}), "
            f"{attempts} attempt(s) over {waited:.2f} s ({what}); the cache was not flushed and no "
            "memory was released. Drain or abort the requests (mode 'abort' aborts them; 'in_place' "
            "keeps running requests in the engine), then recover(target=State.PAUSED) to sleep again.",
            mode=self.mode,
            queued=queued,
            waited_s=waited,
            attempts=attempts,
        )

"""`RolloutActor`: an engine driven by the same lifecycle machine as the trainer.

Sleep = pause generation → flush the cache → drop cached IPC handles → release `weights` and
`kv_cache`. A colocated wake runs `wake_up(["weights"])`, `update_weights(...)`, then
`wake_up(["kv_cache"])`, so the KV cache is not allocated while the weights arrive. A plain class:
wrap it with `ray.remote` to make it an actor.

A release without a backup (SGLang's default) discards the weights: the machine then refuses
`generate` (InvalidWeightsError) until a sync's final round is loaded, and `generate` can require a
minimum weight version (the trainer's) so that a restarted engine cannot serve its old checkpoint.

A corrupt round is refused with `CorruptBucketError` and may be sent again (the sender does once).
With the receiver's default (`WeightReceiver(keep_previous=True)`) nothing was written and the
weights stay as they were; with `keep_previous=False` (two passes instead of three) the round was
written while checked, so the served weights are unknown (generation refused) until a round loads
whole; the weight version stays the last one loaded either way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from actor_integration.backends.release_audit import AuditedMemory
from actor_integration.errors import EngineDiedError
from actor_integration.rollout.engine import (
    EngineGeneration,
    EngineMemory,
    LoadsBuckets,
    LoadsInPlace,
    LoadsPayloads,
    QueryableEngineMemory,
    RolloutEngine,
    implements,
)
from actor_integration.rollout.machine import log_loaded, rollout_lifecycle
from actor_integration.weight_sync.receiver import VersionGate, WeightReceiver
from actor_integration.weight_sync.wire import CorruptBucketError, RankPayload, WrittenWeightsError
from lifecycle import Contents, Hooks, LifecyclePolicy, State
from lifecycle.errors import LifecycleError
from lifecycle.events import flush_logs, log_path
from lifecycle.logs import Event

ROLLOUT_TAGS = ("weights", "kv_cache")
ROLLOUT_POLICY = LifecyclePolicy(
    memory_tags=ROLLOUT_TAGS,
    sync_requires=("weights",),
    discard_on_release=ROLLOUT_TAGS,  # SGLang releases without a CPU backup unless told otherwise
    model_tag=None,
    destroy_process_groups=False,
)


T = TypeVar("T")


def _watched(method: Callable[..., T]) -> Callable[..., T]:
    """A call that reaches the engine: an engine whose process died (`EngineDiedError`) is logged
    once, as a server actor's is (`rollout.server_died`: what exited, which call found it), so that
    `lifecycle check` names it; the error goes on to the caller."""

    @functools.wraps(method)
    def call(self: RolloutActor, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except EngineDiedError as exc:
            self._log_engine_died(exc)
            raise

    return call


class RolloutActor:
    """Owns an engine, its lifecycle and the weight receiver."""

    def __init__(
        self,
        engine: RolloutEngine | Callable[[], RolloutEngine],
        *,
        rank: int = 0,
        generation_mode: str = "abort",
        receiver: WeightReceiver | None = None,
        max_new_tokens: int = 8,
        initial: State = State.AWAKE,
        discard_on_release: Sequence[str] | None = None,
        flush_deadline_s: float | None = None,
        log_dir: str | None = None,
        pause_in_release: bool = False,
    ) -> None:
        """The memory tags are the engine's `memory_tags` (SGLang with CUDA graphs: weights,
        kv_cache, cuda_graph), else `ROLLOUT_TAGS`, released in that order and resumed in it.
        `discard_on_release`: the tags whose contents a release loses (default: all of them, as
        SGLang's default; `("kv_cache", "cuda_graph")` for an engine started with a CPU backup of
        its weights). `flush_deadline_s`: how long a sleep retries a flush the engine refuses as busy.
        `log_dir`: where its `rollout-rank<rank>.jsonl` goes unless the process configured logging
        (else `$RL_LIFECYCLE_LOG_DIR`, else `./lifecycle-logs`; see `configure_rank_log`).
        `pause_in_release`: the sleep's pause sends nothing, the engine's release pausing itself
        (`EngineGeneration`; vLLM's sleep, which `VLLMRolloutActor` turns on)."""
        # A factory builds the engine inside the actor process (Ray ships the class, not a model).
        built: Any = engine() if not hasattr(engine, "load_weights") and callable(engine) else engine
        missing = [m for m in _ENGINE_METHODS if not callable(getattr(built, m, None))]
        if missing:
            raise TypeError(
                f"RolloutActor: the engine {type(built).__name__} lacks {missing} (see RolloutEngine)"
            )
        self.engine: RolloutEngine = built
        self._engine_died_logged = False
        self.receiver = receiver if receiver is not None else WeightReceiver()
        self.gate = VersionGate(committed=getattr(built, "weight_version", None))
        self.max_new_tokens = max_new_tokens
        tags = tuple(getattr(built, "memory_tags", ROLLOUT_TAGS))
        discarded = tags if discard_on_release is None else tuple(discard_on_release)
        policy = ROLLOUT_POLICY
        if tags != ROLLOUT_TAGS or discarded != ROLLOUT_TAGS:
            policy = dataclasses.replace(policy, memory_tags=tags, discard_on_release=discarded)
        generation_options: dict[str, Any] = {}
        if flush_deadline_s is not None:
            generation_options["flush_deadline_s"] = flush_deadline_s
        if pause_in_release:
            generation_options["pause_in_release"] = True
        memory = QueryableEngineMemory(built) if hasattr(built, "residency") else EngineMemory(built)
        expected = getattr(built, "memory_bytes", None)  # the reference engine knows its tags' sizes
        self.memory_audit = AuditedMemory(memory, expected_bytes=expected if callable(expected) else None)
        self.lifecycle = rollout_lifecycle(
            policy,
            Hooks(
                memory=self.memory_audit,
                generation=EngineGeneration(
                    built, mode=generation_mode, on_pause=self._release_handles, **generation_options
                ),
            ),
            rank=rank,
            log_dir=log_dir,
            initial=initial,
            weight_version=self.gate.committed,
        )
        self.memory_audit.sink = self.lifecycle
        describe = getattr(built, "describe", None)
        if callable(describe):
            self.lifecycle.bind(engine=describe())  # which engine and version every log line is about
        self._loaded_bytes = 0
        self._digests: list[bool | None] = []  # per round of the version being loaded
        self._engine_ms: dict[str, Any] = {}  # the engine's own phases of the last round (LoadsPayloads)
        self._unopened = False
        self._stages = bool(getattr(built, "stages_weights", False))
        # Whether the engine's processes may hold trainer buffers open: only a round they received
        # opens them. Unknown for an engine built before (a server another client synced): the
        # first sleep asks.
        self._engine_handles = True

    def _release_handles(self) -> None:
        """Drop every trainer buffer this rollout holds open, here and in the engine's processes. The
        call into those (an empty one into SGLang's schedulers took 2.7 ms on an H100) is made only
        when a round they received since the last one may have opened a buffer."""
        self.receiver.release()
        if implements(self.engine, LoadsPayloads) and self._engine_handles:
            self.engine.release_payload_handles()  # type: ignore[attr-defined]
            self._engine_handles = False

    # ------------------------------------------------------------------ lifecycle

    def _log_engine_died(self, exc: EngineDiedError) -> None:
        if self._engine_died_logged:
            return
        self._engine_died_logged = True
        fields = {k: exc.fields.get(k) for k in ("process", "pid", "exitcode", "call")}
        try:
            label = str(self.engine.describe().get("engine") or "")  # type: ignore[attr-defined]
        except Exception:  # the engine's description is a courtesy: the death is logged regardless
            label = type(self.engine).__name__
        self.lifecycle.event(Event.SERVER_DIED, "error", label=label, url=None, **fields)
        flush_logs(timeout=2.0)  # the job may stop on this: the event is on disk first

    @_watched
    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """Pause generation and release `tags` (None: every tag) through the machine."""
        self.lifecycle.sleep(tags)

    @_watched
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Resume `tags` (None: every tag) through the machine; generation resumes once all are back."""
        self.lifecycle.wake_up(tags)

    def lifecycle_state(self) -> dict[str, Any]:
        """The same snapshot as `LifecycleMixin.lifecycle_state`, so `LifecycleGroup` drives rollouts too."""
        return self.lifecycle.snapshot()

    def lifecycle_log_path(self) -> str | None:
        """The JSON-lines file this actor's lifecycle events go to (None: not to a file)."""
        path = log_path()
        return None if path is None else str(path)

    @_watched
    def lifecycle_recover(self, target: str = "AWAKE") -> dict[str, Any]:
        """Recover from FAILED to `target` ("AWAKE" or "PAUSED"); returns the snapshot after."""
        self.lifecycle.recover(State(target))
        return self.lifecycle.snapshot()

    def lifecycle_place(self) -> dict[str, Any]:
        """Where this actor runs (`LifecycleMixin.lifecycle_place`)."""
        from actor_integration.actors.cluster import here

        return here()

    def lifecycle_peers_lost(self, lost: Mapping[str, Sequence[int]], reason: str) -> dict[str, Any]:
        """The driver found `lost` (role → ranks) gone with their node (`LifecycleMixin.lifecycle_peers_lost`)."""
        from actor_integration.actors.cluster import lose_peers

        return lose_peers(self.lifecycle, lost, reason)

    # ------------------------------------------------------------------ serving

    @_watched
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        *,
        min_weight_version: int | None = None,
    ) -> list[list[int]]:
        """Serve `prompts`; refused (InvalidWeightsError) on discarded or unknown weights, or on weights
        older than `min_weight_version` (pass the trainer's current version)."""
        tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        result: list[list[int]] = self.lifecycle.run(
            "generate", self._generate, prompts, tokens, min_weight_version=min_weight_version
        )
        return result

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens=max_new_tokens)

    @_watched
    def update_weights(self, version: int, payloads: list[RankPayload]) -> dict[str, Any]:
        """Load one round of a versioned update (the coordinator's `engine_call` lands here)."""
        self._unopened = True
        try:
            ack: dict[str, Any] = self.lifecycle.run("sync", self._load, version, payloads)
        finally:
            if self._unopened:
                # Refused before the receiver saw the payloads (lifecycle, stale version): release
                # the senders' IPC grants and drain broadcasts, or their buffers could never be freed.
                self._unopened = False
                self.receiver.discard(payloads)
        return ack

    def _load(self, version: int, payloads: list[RankPayload]) -> dict[str, Any]:
        if not payloads:
            raise ValueError(f"update_weights(version={version}): no payloads")
        round_index = payloads[0].round
        if any(p.version != version for p in payloads):
            raise ValueError(
                f"update_weights(version={version}): payloads carry versions {sorted({p.version for p in payloads})}"
            )
        self.gate.admit(version, round_index)
        if round_index == 0:
            self._loaded_bytes = 0
            self._engine_ms = {}  # a version loaded another way reports no engine phases
            self._digests = []
        final = payloads[0].final
        overwriting = final if self._stages else round_index == 0

        def before_write() -> None:
            if overwriting:
                # From the first write into the served weights on, a failure leaves them part
                # old, part new. An engine that stages rounds writes them at the final one.
                self.lifecycle.note_weights(
                    Contents.UNKNOWN,
                    version,
                    reason=f"loading version {version}: weights being overwritten",
                )

        # How the round reaches the engine: received by the engine's own processes (unopened),
        # written into its tensors by the receiver (no intermediate tensor), handed over as whole
        # buckets, or as views it copies itself.
        unopened = implements(self.engine, LoadsPayloads) and self.engine.accepts_payloads(  # type: ignore[attr-defined]
            payloads[0].transport
        )
        in_place = not unopened and implements(self.engine, LoadsInPlace)
        whole_buckets = not unopened and not in_place and implements(self.engine, LoadsBuckets)
        whole_buckets = whole_buckets and bool(getattr(self.engine, "accepts_buckets", True))
        try:
            if unopened:
                self.engine.check_payloads(payloads)  # type: ignore[attr-defined]
                self._unopened = False  # the engine's processes account for every bucket from here
                self._engine_handles = True  # they open the trainer's buffers (kept until the sleep)
                try:
                    loaded = self.engine.load_payloads(  # type: ignore[attr-defined]
                        version, payloads, round_index=round_index, final=final
                    )
                    self._engine_ms = loaded.get("timings") or {}
                    self._digests.append(self._engine_ms.get("digest"))
                except CorruptBucketError:
                    raise  # verified before any write; accounted for below
                except BaseException as error:
                    # The engine says whether it wrote; an error that cannot say (a dead or
                    # silent engine) may have written part of the round.
                    if not isinstance(error, LifecycleError) or error.fields.get("written", True):
                        before_write()
                    raise
                if not final:
                    before_write()  # part of the new version is in: the weights are mixed until the final round
                nbytes, transport = sum(p.nbytes for p in payloads), payloads[0].transport
            elif in_place:
                targets = self.engine.weight_targets(version, round_index=round_index, final=final)  # type: ignore[attr-defined]
                self._unopened = False  # from here on the receiver accounts for every bucket
                loaded = self.receiver.load_into(payloads, targets, before_write=before_write)
                self._digests.append(self.receiver.last_digest)
                self.engine.weights_written(  # type: ignore[attr-defined]
                    version, loaded.names, round_index=round_index, final=final
                )
                nbytes, transport = loaded.nbytes, loaded.transport
            else:
                self._unopened = False  # from here on the receiver accounts for every bucket
                with self.receiver.open(payloads) as received:
                    before_write()
                    if whole_buckets:
                        self.engine.load_buckets(  # type: ignore[attr-defined]
                            version, received.buckets, round_index=received.round, final=received.final
                        )
                    else:
                        self.engine.load_weights(
                            version, received.shards, round_index=received.round, final=received.final
                        )
                    nbytes, transport = received.nbytes, received.transport
                self._digests.append(None)  # the engine copied the views itself: nothing read back
            self._loaded_bytes += nbytes
        except CorruptBucketError as error:
            elapsed = time.perf_counter() - self.gate.started
            self.gate.retry(version, round_index)  # the sender may send this round again
            if error.fields.get("written") and (overwriting or not self._stages):
                # Written while checked (the receiver's two-pass path): the weights hold part of
                # a corrupt round, whatever they held before. Unknown until a round loads whole.
                self.lifecycle.note_weights(
                    Contents.UNKNOWN,
                    version,
                    reason=(
                        f"round {round_index} of version {version} failed its checksum after it was "
                        "written (keep_previous=False): the weights hold part of a corrupt round"
                    ),
                )
            self._failed_load(
                version,
                payloads,
                checksum_ok=False,
                written=bool(error.fields.get("written")),
                duration_ms=round(elapsed * 1e3, 3),
            )
            raise
        except WrittenWeightsError as error:
            self.gate.abort()
            # Written, and not what was sent: unknown until a round loads whole, whatever wrote it.
            self.lifecycle.note_weights(
                Contents.UNKNOWN,
                version,
                reason=f"version {version}: the written weights differ from what was sent",
            )
            self._failed_load(
                version,
                payloads,
                checksum_ok=True,
                digest_ok=False,
                buckets=error.fields.get("buckets"),
                written=True,
            )
            raise
        except BaseException:
            self.gate.abort()
            raise
        if final:
            elapsed = self.gate.commit(version)
            self.lifecycle.note_weights(Contents.VALID, version, reason=f"version {version} loaded")
            extra: dict[str, Any] = {"engine_ms": self._engine_ms} if self._engine_ms else {}
            log_loaded(
                self.lifecycle.event,
                version=version,
                nbytes=self._loaded_bytes,
                transport=transport,
                ok=True,
                checksum_ok=self.receiver.verify,
                # What the engine holds, read back where it was written: True when every round was
                # checked, None where a round could not be (the engine copied it itself).
                digest_ok=None if None in self._digests else all(self._digests),
                duration_ms=round(elapsed * 1e3, 3),
                **extra,
            )
        return {"version": version, "round": round_index, "final": final, "bytes": self._loaded_bytes}

    def _failed_load(self, version: int, payloads: list[RankPayload], **fields: Any) -> None:
        """The `weight_sync.loaded` error event of a round the engine refused or found wrong."""
        log_loaded(
            self.lifecycle.event,
            version=version,
            nbytes=self._loaded_bytes,
            transport=payloads[0].transport,
            ok=False,
            **fields,
        )

    # ------------------------------------------------------------------ inspection

    def wake_need_bytes(self) -> int | None:
        """What this rollout's wake takes on its GPU (every tag: weights, KV cache pools, CUDA graphs),
        as the engine says (`memory_bytes`: SGLang's start-up memory usage, the reference engine's
        tensors); None where it cannot say. The trainer's memory budget plans from it."""
        memory_bytes = getattr(self.engine, "memory_bytes", None)
        value = None if memory_bytes is None else memory_bytes(None)
        return value if isinstance(value, int) else None

    def weights_checksum(self) -> str:
        """The engine's checksum of the weights it serves."""
        return self.engine.weights_checksum()

    def weight_version(self) -> int | None:
        """The last version the engine loaded completely (None: none yet)."""
        return self.gate.committed

    def engine_timings(self) -> dict[str, Any]:
        """The engine's own phases of the last round it received itself (ms; empty otherwise)."""
        return dict(self._engine_ms)

    def open_handles(self) -> int:
        """Cached handles or mappings the receiver holds (0 after a sleep)."""
        return self.receiver.open_handles()

    def engine_calls(self) -> list[str]:
        """The engine calls in order, when the engine records them (the reference engine does)."""
        return list(getattr(self.engine, "calls", []))

    def ping(self) -> float:
        """The actor's clock (epoch seconds): an answer that says the actor is alive."""
        return time.time()


_ENGINE_METHODS = (
    "generate",
    "release_memory_occupation",
    "resume_memory_occupation",
    "pause_generation",
    "continue_generation",
    "flush_cache",
    "load_weights",
    "weights_checksum",
)

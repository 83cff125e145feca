"""`RolloutEngine` over a real `sglang.Engine` (imported lazily: sglang is an optional extra).

Proven on sglang 0.5.17 (torch 2.11) through 0.5.23 (torch 2.14.1): CI checks every call this
module makes against both versions' source (tests/actor_integration/engines/sglang/test_sglang_source.py),
and the GPU suite runs it on a real 0.5.17 engine. What differs between them is handled here:
0.5.23 loads weights only inside a `begin_weight_update()` / `end_weight_update()` session;
0.5.17 asserts an idle scheduler on release, so a release that does not follow a flush this
adapter saw succeed asks SGLang for its queue first and refuses with `EngineNotIdleError`.

Every call goes to SGLang's tokenizer manager under a guard: the engine's processes are watched
while it waits, so a scheduler that died answers `EngineDiedError` (naming the process, its pid
and exit code) within `poll_s`, and one that hangs `SGLangServerTimeout`, instead of a wait
that never ends. SGLang's own reaction to a dead child (SIGQUIT, then killing its whole process
tree, the rollout actor included) is replaced by that error. Calls SGLang answers by killing its
scheduler (a second release of a tag, a resume of a resident one, a generation or a weight load
into released memory) are refused here with `MemoryStateError` before they are sent.

Weights, by default, go to SGLang's schedulers directly (`LoadsPayloads`): the engine is started
with the lifecycle's receiver as a `custom_weight_loader` (`receiver.py`), and a round
is one `update_weights_from_tensor` call carrying only the round's descriptors; each scheduler
opens its TP rank's buffers from the trainer, verifies them, agrees with the other ranks, and
loads through the model's own weight loaders. An engine started without that loader (or a
transport other than `cuda_ipc` and `shm`) takes verified buckets in SGLang's `flattened_bucket` format
(`LoadsBuckets`): one call per bucket, after one flat copy of it in the rollout's process.
SGLang loads in place, so a round that fails after its first write leaves mixed weights: the
adapter then refuses to generate until a version loads whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from actor_integration.engines.sglang.scheduler import (
    SCHEDULER_LOADER,
    SchedulerReceiverCalls,
    reply_directory,
)
from actor_integration.errors import (
    EngineDiedError,
    EngineNotIdleError,
    MemoryStateError,
    SGLangServerTimeout,
)
from actor_integration.rollout.engine import GENERATION_MODES, NamedTensors
from actor_integration.rollout.server_watch import pid_alive
from actor_integration.weight_sync.buckets import BucketManifest, dtype_from_name
from actor_integration.weight_sync.wire import WeightSyncError

Codec = Callable[[NamedTensors], Any]
BucketCodec = Callable[[torch.Tensor, BucketManifest], Any]
T = TypeVar("T")

SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")  # the oldest and newest release the adapter is checked on
_TMS_PRELOAD = "torch_memory_saver_hook_mode_preload"


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(
            "the SGLang rollout adapter needs sglang: `pip install 'rl-lifecycle[sglang]'` (or `pip install "
            "sglang`); without it use actor_integration.rollout.ReferenceEngine"
        ) from exc
    return sglang


def sglang_codec() -> tuple[Codec, bool]:
    """SGLang's flattened-bucket serializer, and whether one bucket may mix dtypes."""
    _import_sglang()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    def encode(named: NamedTensors) -> Any:
        bucket = FlattenedTensorBucket(named_tensors=list(named))
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return MultiprocessingSerializer.serialize(data, output_str=True)

    return encode, bool(getattr(FlattenedTensorBucket, "supports_multi_dtypes", False))


def sglang_bucket_codec() -> BucketCodec:
    """One verified bucket as SGLang's flattened bucket: its bytes (one flat copy: torch cannot
    re-export a CUDA buffer received from another process, nor share a mapped file) and metadata
    that points at each tensor's place in them."""
    _import_sglang()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    def encode(region: torch.Tensor, manifest: BucketManifest) -> Any:
        flat = region[: manifest.nbytes].clone()  # a buffer this process owns, so it can be shared
        metadata = [
            FlattenedTensorMetadata(
                name=e.name,
                shape=torch.Size(e.shape),
                dtype=dtype_from_name(e.dtype),
                start_idx=e.offset,
                end_idx=e.offset + e.nbytes,
                numel=e.nbytes,
            )
            for e in manifest.entries
        ]
        bucket = FlattenedTensorBucket(flattened_tensor=flat, metadata=metadata)
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return MultiprocessingSerializer.serialize(data, output_str=True)

    return encode


def scheduler_loader_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`engine_kwargs` with the lifecycle's receiver added to SGLang's `custom_weight_loader`."""
    loaders = list(engine_kwargs.get("custom_weight_loader") or [])
    if SCHEDULER_LOADER not in loaders:
        loaders.append(SCHEDULER_LOADER)
    return {**engine_kwargs, "custom_weight_loader": loaders}


class SGLangWeights:
    """Versioned weight loading in SGLang's flattened-bucket format, shared by the offline and the
    HTTP adapters: each subclass sends one call with `_update`. With SGLang's own codec (no
    `codec` given) and multi-dtype buckets, whole verified buckets go over (`load_buckets`)."""

    def __init__(
        self, codec: Codec | None, multi_dtype_buckets: bool | None, bucket_codec: BucketCodec | None = None
    ) -> None:
        if codec is None:
            codec, multi = sglang_codec()
            multi_dtype_buckets = multi if multi_dtype_buckets is None else multi_dtype_buckets
            if bucket_codec is None and multi_dtype_buckets:
                bucket_codec = sglang_bucket_codec()
        self._encode = codec
        self._multi_dtype = bool(multi_dtype_buckets)
        # Mixed-dtype buckets are the only kind our senders make: without them, per-dtype calls.
        self._encode_bucket = bucket_codec if self._multi_dtype else None
        self.weight_version = 0
        self._mixed: int | None = None  # version whose rounds were partly applied

    @property
    def accepts_buckets(self) -> bool:
        """Whether `load_buckets` may be used (the rollout actor asks)."""
        return self._encode_bucket is not None

    def load_buckets(
        self,
        version: int,
        buckets: Sequence[Sequence[tuple[torch.Tensor, BucketManifest]]],
        *,
        round_index: int,
        final: bool,
    ) -> None:
        """One call per bucket position, with that bucket of every TP rank."""
        if self._encode_bucket is None:
            raise RuntimeError(
                "SGLang adapter: whole buckets need SGLang's multi-dtype flattened buckets; use load_weights"
            )
        counts = sorted({len(per_rank) for per_rank in buckets})
        if len(counts) != 1:
            raise ValueError(
                f"SGLang adapter: the TP ranks received different numbers of buckets {counts}; every trainer "
                "rank of a slot must send the same tensors"
            )
        if round_index == 0:
            self._mixed = None
        for k in range(counts[0]):
            last = final and k == counts[0] - 1
            try:
                payloads = [self._encode_bucket(*per_rank[k]) for per_rank in buckets]
                self._update(payloads, version=version, last=last)
            except BaseException:
                if round_index > 0 or k > 0:
                    self._mixed = version
                raise
        if final:
            self.weight_version = version
            self._mixed = None

    def _update(self, payloads: list[Any], *, version: int, last: bool) -> None:
        """Send one update_weights_from_tensor call (one payload per TP rank); raise if refused.
        The `last` call of a version flushes the cache and carries the version."""
        raise NotImplementedError

    def load_weights(
        self, version: int, shards: Sequence[NamedTensors], *, round_index: int, final: bool
    ) -> None:
        groups = self._groups(shards)
        if round_index == 0:
            self._mixed = None
        for i, per_rank in enumerate(groups):
            last = final and i == len(groups) - 1
            try:
                self._update([self._encode(named) for named in per_rank], version=version, last=last)
            except BaseException:
                if round_index > 0 or i > 0:
                    self._mixed = version
                raise
        if final:
            self.weight_version = version
            self._mixed = None

    def _groups(self, shards: Sequence[NamedTensors]) -> list[list[NamedTensors]]:
        """Calls to make, each with one tensor list per TP rank (split by dtype if SGLang needs it)."""
        if self._multi_dtype:
            return [list(shards)]
        dtypes: list[torch.dtype] = []
        for _name, tensor in shards[0] if shards else ():
            if tensor.dtype not in dtypes:
                dtypes.append(tensor.dtype)
        return [[[(n, t) for n, t in named if t.dtype == dtype] for named in shards] for dtype in dtypes]

    def _refuse_mixed(self, who: str) -> None:
        if self._mixed is not None:
            raise RuntimeError(
                f"{who}: version {self._mixed} was applied in part (a later round failed); load a whole "
                "version before generating"
            )

    def weights_checksum(self) -> str:
        raise NotImplementedError(
            "this SGLang adapter offers no bit-exact readback of the engine's weights; compare greedy "
            "generations instead"
        )


class SGLangEngine(SchedulerReceiverCalls, SGLangWeights):
    """Adapts `sglang.Engine` to `RolloutEngine`. Pass an engine, or keyword arguments to build one
    (the scheduler-side receiver is then added to `custom_weight_loader`, unless
    `scheduler_receiver=False`).

    `call_timeout_s` bounds every call but weight loads, which `weights_timeout_s` bounds;
    `poll_s` is how often a waiting call looks at the engine's processes."""

    def __init__(
        self,
        engine: Any = None,
        *,
        codec: Codec | None = None,
        multi_dtype_buckets: bool | None = None,
        bucket_codec: BucketCodec | None = None,
        scheduler_receiver: bool = True,
        call_timeout_s: float = 120.0,
        weights_timeout_s: float = 600.0,
        poll_s: float = 0.1,
        **engine_kwargs: Any,
    ) -> None:
        if call_timeout_s <= 0 or weights_timeout_s <= 0 or poll_s <= 0:
            raise ValueError(
                f"SGLangEngine: call_timeout_s, weights_timeout_s and poll_s must be positive, got "
                f"{call_timeout_s!r}, {weights_timeout_s!r} and {poll_s!r}"
            )
        self.call_timeout_s, self.weights_timeout_s, self.poll_s = call_timeout_s, weights_timeout_s, poll_s
        sglang = _import_sglang()
        if engine is None:
            check_engine_arguments(engine_kwargs)
            if scheduler_receiver:
                engine_kwargs = scheduler_loader_kwargs(engine_kwargs)
            engine_kwargs.setdefault("custom_sigquit_handler", _on_sigquit)
            engine = sglang.Engine(**engine_kwargs)
        elif engine_kwargs:
            raise ValueError(
                f"SGLangEngine: got an engine and engine arguments {sorted(engine_kwargs)}; give one"
            )
        super().__init__(codec, multi_dtype_buckets, bucket_codec)
        self.engine = engine
        self.version = str(getattr(sglang, "__version__", "unknown"))
        args = engine.server_args
        self.tp_size = int(getattr(args, "tp_size", 1))
        self.cuda_graphs = not bool(getattr(args, "disable_cuda_graph", False))
        # Without the memory saver SGLang's release frees nothing: every tag then stays resident.
        self.memory_saver = bool(getattr(args, "enable_memory_saver", False))
        self.memory_tags: tuple[str, ...] = SGLANG_TAGS if self.cuda_graphs else SGLANG_TAGS[:2]
        self._resident = dict.fromkeys(self.memory_tags, True)
        self._sessions = callable(getattr(engine, "begin_weight_update", None))  # 0.5.23's API
        self._tolerates_paused_release = version_tuple(self.version) >= (0, 5, 23)
        self._idle_after_flush = False
        self._watched = self._watch_processes()
        self._died: EngineDiedError | None = None
        self._calls = itertools.count()
        self._reply_dir = reply_directory("rl-lifecycle-sglang-")
        self.scheduler_receiver = SCHEDULER_LOADER in list(getattr(args, "custom_weight_loader", None) or [])
        self.scheduler_pids: list[int] = []
        if self.scheduler_receiver:
            self.scheduler_pids = self.scheduler_hello()
        self._memory_gb = self._memory_usage()  # fixed at start-up: asked once, not in every release

    # ------------------------------------------------------------------ what the engine is

    def describe(self) -> dict[str, Any]:
        """The engine as the lifecycle log records it."""
        return {
            "engine": "sglang",
            "sglang": self.version,
            "supported": version_tuple(SUPPORTED_VERSIONS[0])
            <= version_tuple(self.version)
            <= version_tuple(SUPPORTED_VERSIONS[-1]),
            "tp_size": self.tp_size,
            "cuda_graphs": self.cuda_graphs,
            "memory_tags": list(self.memory_tags),
            "weights_via": "scheduler" if self.scheduler_receiver else "flattened_bucket",
            "weight_sessions": self._sessions,
            "processes": {name: pid for name, pid in self._process_pids().items()},
        }

    @property
    def residency(self) -> dict[str, bool]:
        """Which tags are resident, as this adapter's calls left them (`recover()` reads it)."""
        return dict(self._resident)

    def memory_bytes(self, tag: str | None = None) -> int | None:
        """What `tag` (None: every tag) holds on the engine's first GPU, as SGLang reported it at
        start-up (`get_server_info`'s memory usage: weights, KV cache, CUDA graphs): what a release
        should free. None where SGLang did not say."""
        if self._memory_gb is None:
            return None
        tags = self.memory_tags if tag is None else (tag,)
        return int(sum(self._memory_gb.get(t, 0.0) for t in tags) * (1 << 30))

    def _memory_usage(self) -> dict[str, float] | None:
        states = self._call("get_internal_state", lambda: self._manager.get_internal_state())
        usage = (states[0] if isinstance(states, list) and states else {}).get("memory_usage")
        if not isinstance(usage, dict):
            return None
        return {
            "weights": float(usage.get("weight") or 0.0),
            "kv_cache": float(usage.get("kvcache") or 0.0),
            "cuda_graph": sum(float(v) for v in (usage.get("graph") or {}).values()),
        }

    # ------------------------------------------------------------------ memory and generation

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Release `tags` (None: all) in SGLang's schedulers; a tag already released is refused first."""
        chosen = self._tags(tags)
        released = [t for t in chosen if not self._resident[t]]
        if released:
            raise MemoryStateError(
                f"SGLangEngine: {released} already released; SGLang's torch_memory_saver would end the "
                "scheduler on a second release (exit 1). Resume them first.",
                tags=released,
            )
        if not self._tolerates_paused_release and not self._idle_after_flush:
            queued = self.queued_requests()
            if queued["running"] or queued["waiting"]:
                raise EngineNotIdleError(
                    f"SGLangEngine: release of {chosen} with requests in the engine ({queued}); sglang "
                    f"{self.version} asserts an idle scheduler on release (the assertion ends it). Pause "
                    "generation and flush the cache first (the rollout's sleep does).",
                    queued=queued,
                )
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        request = ReleaseMemoryOccupationReqInput(tags=chosen)
        self._call(
            "release_memory_occupation", lambda: self._manager.release_memory_occupation(request, None)
        )
        for tag in chosen:
            self._resident[tag] = False

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Resume the released `tags` (None: all) in SGLang's schedulers; a resident tag is refused first."""
        chosen = self._tags(tags)
        resident = [t for t in chosen if self._resident[t]]
        if resident:
            raise MemoryStateError(
                f"SGLangEngine: {resident} not released; SGLang raises KeyError in its scheduler on such a "
                "resume, which ends it. Resume only what was released.",
                tags=resident,
            )
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        request = ResumeMemoryOccupationReqInput(tags=chosen)
        self._call("resume_memory_occupation", lambda: self._manager.resume_memory_occupation(request, None))
        for tag in chosen:
            self._resident[tag] = True

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause SGLang's generation (`mode`: abort, retract or in_place) through its tokenizer manager."""
        if mode not in GENERATION_MODES:
            raise ValueError(f"pause_generation: mode must be one of {list(GENERATION_MODES)}, got {mode!r}")
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # sglang.Engine has no pause_generation; its HTTP server calls the tokenizer manager too.
        request = PauseGenerationReqInput(mode=mode)
        self._call("pause_generation", lambda: self._manager.pause_generation(request))

    def continue_generation(self) -> None:
        """Let SGLang generate again after `pause_generation`."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        request = ContinueGenerationReqInput()
        self._idle_after_flush = False
        self._call("continue_generation", lambda: self._manager.continue_generation(request))

    def flush_cache(self) -> bool:
        """True when flushed; False when SGLang refused because requests remain (it flushes nothing then)."""
        result = self._call("flush_cache", lambda: self._manager.flush_cache())  # a FlushCacheReqOutput
        self._idle_after_flush = bool(result.success)
        return self._idle_after_flush

    def queued_requests(self) -> dict[str, int]:
        """Running and waiting requests over the data-parallel ranks, as the schedulers last published them."""
        loads = self._call("get_loads", lambda: self._manager.get_loads(include=["core"]))
        return {
            "running": sum(int(load.num_running_reqs) for load in loads),
            "waiting": sum(int(load.num_waiting_reqs) for load in loads),
        }

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens for each prompt from SGLang; refused while a memory tag is released."""
        self._refuse_mixed("SGLangEngine")
        self._require_resident("generate", self.memory_tags)  # a graph replay reads its pool too
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = GenerateReqInput(
            input_ids=[list(p) for p in prompts],
            sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
        )

        async def first() -> Any:
            return await self._manager.generate_request(request, None).__anext__()

        self._idle_after_flush = False
        outputs = self._call("generate", first)
        if isinstance(outputs, dict):  # a batch of one may come back unwrapped
            outputs = [outputs]
        return [list(out["output_ids"]) for out in outputs]

    def weights_checksum(self) -> str:
        """SGLang's own checksum of every parameter of the engine (its `check_weights`): equal
        across loads of the same weights, not comparable with the trainer's tensors (SGLang fuses
        and shards them)."""
        self._require_resident("weights_checksum", ["weights"])
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        request = CheckWeightsReqInput(action="checksum")
        answer = self._call("check_weights", lambda: self._manager.check_weights(request, None))
        success, message, _ranks, checksum = answer
        if not success or checksum is None:
            raise RuntimeError(f"SGLang could not checksum its weights: {message}")
        return str(checksum)

    # ------------------------------------------------------------------ weights

    def load_buckets(
        self,
        version: int,
        buckets: Sequence[Sequence[tuple[torch.Tensor, BucketManifest]]],
        *,
        round_index: int,
        final: bool,
    ) -> None:
        with self._weight_session(round_index=round_index, final=final):
            super().load_buckets(version, buckets, round_index=round_index, final=final)

    def load_weights(
        self, version: int, shards: Sequence[NamedTensors], *, round_index: int, final: bool
    ) -> None:
        """Send one round of `version` to SGLang's schedulers; round 0 opens the update, the final one ends it."""
        with self._weight_session(round_index=round_index, final=final):
            super().load_weights(version, shards, round_index=round_index, final=final)

    def _update(self, payloads: list[Any], *, version: int, last: bool) -> None:
        self._require_resident("update_weights", ["weights"])
        self._send_update(
            payloads,
            load_format="flattened_bucket",
            ends_version=version if last else None,
            timeout_s=self.weights_timeout_s,
            what=f"weight version {version}",
        )

    # ------------------------------------------------------------------ processes

    def shutdown(self) -> None:
        """Stop the engine's processes and remove the reply directory."""
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        with contextlib.suppress(OSError):
            for leftover in self._reply_dir.iterdir():
                leftover.unlink()
            self._reply_dir.rmdir()

    def _watch_processes(self) -> list[tuple[str, Any]]:
        """The engine's child processes to watch, and SGLang's own watchdog and SIGQUIT handling
        taken over: a dead child becomes an `EngineDiedError` here, not a killed process tree."""
        manager = self.engine.tokenizer_manager
        watchdog = getattr(manager, "_subprocess_watchdog", None)
        watched: list[tuple[str, Any]] = []
        if watchdog is not None:
            watched = list(
                zip(getattr(watchdog, "_names", []), getattr(watchdog, "_processes", []), strict=False)
            )
            watchdog.stop()  # it would SIGQUIT this process on a child's death
        if not watched:
            watched = [(f"child_{pid}", pid) for pid in self.engine.get_all_child_pids()]
        original = manager.signal_handler_class

        class LifecycleSignals(original):  # type: ignore[misc, valid-type]
            def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
                _on_sigquit(signum, frame)

        manager.signal_handler_class = LifecycleSignals
        loop = getattr(manager, "event_loop", None)
        if loop is not None:  # the handlers are installed already: replace SGLang's SIGQUIT one
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGQUIT)
                loop.add_signal_handler(signal.SIGQUIT, _on_sigquit)
        return watched

    def _process_pids(self) -> dict[str, int]:
        return {name: proc if isinstance(proc, int) else int(proc.pid) for name, proc in self._watched}

    def _dead_process(self) -> tuple[str, int, int | None] | None:
        for name, proc in self._watched:
            if isinstance(proc, int):
                if not pid_alive(proc):
                    return name, proc, None
            elif not proc.is_alive():
                return name, int(proc.pid), proc.exitcode
        return None

    def _call(self, what: str, make: Callable[[], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """Run one tokenizer-manager coroutine, watching the engine's processes while it waits."""
        if self._died is not None:
            raise EngineDiedError(str(self._died), **{**self._died.fields, "call": what})
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        result: T = self.engine.loop.run_until_complete(self._guarded(what, make(), timeout))
        return result

    async def _guarded(self, what: str, awaitable: Awaitable[T], timeout: float) -> T:
        task = asyncio.ensure_future(awaitable)
        started = time.monotonic()
        try:
            while True:
                done, _pending = await asyncio.wait({task}, timeout=self.poll_s)
                if task in done:
                    return task.result()
                waited = time.monotonic() - started
                dead = self._dead_process()
                if dead is not None:
                    name, pid, code = dead
                    self._died = EngineDiedError(
                        f"SGLang's {name} process (pid {pid}) exited with code {code} during {what}: the engine "
                        f"can neither serve nor release memory any more (noticed after {waited:.1f} s). Restart "
                        "the rollout actor and its engine; its lifecycle stays FAILED until then",
                        process=name,
                        pid=pid,
                        exitcode=code,
                        call=what,
                        waited_s=round(waited, 3),
                    )
                    raise self._died
                if waited >= timeout:
                    raise SGLangServerTimeout(
                        f"SGLang did not answer {what} within {timeout:.0f} s, though its processes are alive: "
                        "the scheduler may be hung (see its log) or the call slow; raise the timeout if so",
                        method="engine",
                        path=what,
                        timeout_s=timeout,
                        missing=[f"sglang:{pid}" for pid in self._process_pids().values()],
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)

    @property
    def _manager(self) -> Any:
        return self.engine.tokenizer_manager

    # ------------------------------------------------------------------ helpers

    def _tags(self, tags: Sequence[str] | None) -> list[str]:
        if tags is None:
            return list(self.memory_tags)
        if isinstance(tags, str):
            raise TypeError(f"tags must be a list of tag names, got the string {tags!r}")
        unknown = [t for t in tags if t not in self.memory_tags]
        if unknown:
            raise ValueError(
                f"SGLangEngine: unknown memory tags {unknown}; this engine's tags are {list(self.memory_tags)}"
                + ("" if self.cuda_graphs else " (cuda_graph only with CUDA graphs on)")
            )
        return list(tags)

    def _require_resident(self, what: str, tags: Sequence[str]) -> None:
        released = [t for t in tags if not self._resident.get(t, True)]
        if released:
            raise MemoryStateError(
                f"SGLangEngine: {what} with {released} released; SGLang would read unmapped memory (a Triton "
                "pointer error or a segfault ends the scheduler). Resume them first.",
                tags=released,
                operation=what,
            )

    def _send_update(
        self,
        payloads: list[Any],
        *,
        load_format: str,
        ends_version: int | None,
        timeout_s: float,
        what: str,
    ) -> None:
        """One `update_weights_from_tensor` call. The call that ends a version (`ends_version`)
        tags the engine with it and flushes the radix cache if the KV cache is resident."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        fields: dict[str, Any] = {
            "serialized_named_tensors": payloads,
            "load_format": load_format,
            "flush_cache": ends_version is not None and self._resident["kv_cache"],
        }
        if ends_version is not None:
            fields["weight_version"] = str(ends_version)
        request = UpdateWeightsFromTensorReqInput(**fields)
        answer = self._call(
            "update_weights_from_tensor",
            lambda: self._manager.update_weights_from_tensor(request, None),
            timeout_s=timeout_s,
        )
        _check(answer, what)

    def _serialize_names(self, names: Sequence[str]) -> Any:
        from sglang.srt.utils import MultiprocessingSerializer

        # An empty tensor pickles without shared memory, and SGLang calls .to(device) on each.
        return MultiprocessingSerializer.serialize([(name, torch.empty(0)) for name in names])

    def _receiver_gone(self) -> bool:
        return self._died is not None

    def _session(self, begin: bool) -> None:
        """0.5.23 loads weights only between begin_weight_update() and end_weight_update()."""
        from sglang.srt.managers import io_struct

        if begin:
            request: Any = io_struct.BeginWeightUpdateReqInput()
            answer = self._call(
                "begin_weight_update", lambda: self._manager.begin_weight_update(request, None)
            )
        else:
            request = io_struct.EndWeightUpdateReqInput()
            answer = self._call("end_weight_update", lambda: self._manager.end_weight_update(request, None))
        _check(answer, "begin_weight_update" if begin else "end_weight_update")

    @contextlib.contextmanager
    def _weight_session(self, *, round_index: int, final: bool) -> Iterator[None]:
        """The weight-update session around the calls of a version (sglang 0.5.23; a no-op before):
        opened at its first round, closed at its last (`final`), and closed at once when a call
        fails, so the next version can open its own."""
        if not self._sessions:
            yield
            return
        if round_index == 0:
            self._session(begin=True)
        try:
            yield
        except BaseException:
            if self._died is None:
                with contextlib.suppress(Exception):
                    self._session(begin=False)
            raise
        if final:
            self._session(begin=False)


def check_engine_arguments(kwargs: dict[str, Any]) -> None:
    """Refuse, before any GPU work, engine arguments the lifecycle cannot drive."""
    if not kwargs.get("enable_memory_saver", False):
        raise ValueError(
            "SGLangEngine: enable_memory_saver=True is needed: without torch_memory_saver SGLang's release "
            "frees nothing and the trainer on the same GPU gets no memory back"
        )
    preload = os.environ.get("LD_PRELOAD", "")
    if _TMS_PRELOAD in preload:
        raise ValueError(
            f"SGLangEngine: this process already preloads torch_memory_saver (LD_PRELOAD={preload}); SGLang "
            "preloads it into its scheduler itself and two copies trip its assertion. Build the engine in a "
            "process without it (a Ray actor with runtime_env={'env_vars': {'LD_PRELOAD': ''}})"
        )


def _check(result: Any, what: str) -> None:
    """SGLang answers (success, message), an object with `success`, or a dict with it; a failure must not pass."""
    success, message = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], str(result[1]) if len(result) > 1 else ""
    elif isinstance(result, dict) and "success" in result:
        success, message = bool(result["success"]), str(result.get("message", ""))
    elif hasattr(result, "success"):
        success, message = bool(result.success), str(getattr(result, "message", ""))
    if not success:
        raise WeightSyncError(f"SGLang refused {what}: {message}", answer=message)


def _on_sigquit(signum: Any = None, frame: Any = None) -> None:
    """SGLang's children SIGQUIT their parent when they fail, and SGLang's own handler then kills
    the whole process tree. This one does nothing: the adapter's guard finds the dead process
    itself (within `poll_s`) and raises `EngineDiedError`, and this process lives on."""


def version_tuple(version: str) -> tuple[int, ...]:
    """ "0.5.23rc1" -> (0, 5, 23): the leading digits of the first three parts."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


__all__ = [
    "SCHEDULER_LOADER",
    "SGLANG_TAGS",
    "SUPPORTED_VERSIONS",
    "SGLangEngine",
    "SGLangWeights",
    "check_engine_arguments",
    "scheduler_loader_kwargs",
    "sglang_bucket_codec",
    "sglang_codec",
]

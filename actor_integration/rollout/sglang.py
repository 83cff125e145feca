"""`RolloutEngine` over a real `sglang.Engine` (imported lazily: sglang is an optional extra).

Weights reach SGLang through its own `update_weights_from_tensor(load_format="flattened_bucket")`:
per engine TP rank, one call per verified bucket, serialized with its `MultiprocessingSerializer`,
so each TP rank loads what the trainer rank on its GPU sent. What SGLang's API allows: it takes
tensors, which its scheduler processes open (a fresh CUDA IPC handle per call) and copy into
their parameters through the model's weight loaders (name mapping, QKV fusion, TP sharding), so
no process outside SGLang can write its parameters directly (`LoadsInPlace` is for engines whose
parameters live in the rollout's process). Our bucket already has the flattened-bucket layout, so
the adapter hands it over as it is (`LoadsBuckets`): SGLang's metadata points into the bucket's
bytes, and the only copy on our side is one flat copy of the whole bucket (torch refuses to
re-export a CUDA tensor it received from another process) instead of re-flattening tensor by
tensor. SGLang loads each call in place, so a round that fails after an earlier call of the same
version leaves mixed weights: the adapter then refuses to generate until a version loads whole.

Written against the SGLang pinned in pyproject's `sglang` extra; CI checks every call this module
makes against that version's source (tests/actor_integration/rollout/test_sglang_source.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from actor_integration.rollout.engine import ENGINE_TAGS, GENERATION_MODES, NamedTensors
from actor_integration.weight_sync.buckets import BucketManifest, dtype_from_name

Codec = Callable[[NamedTensors], Any]
BucketCodec = Callable[[torch.Tensor, BucketManifest], Any]


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
            "SGLang offers no bit-exact readback of its weights (get_weights_by_name truncates and converts); "
            "compare greedy generations instead"
        )


class SGLangEngine(SGLangWeights):
    """Adapts `sglang.Engine` to `RolloutEngine`. Pass an engine, or keyword arguments to build one."""

    def __init__(
        self,
        engine: Any = None,
        *,
        codec: Codec | None = None,
        multi_dtype_buckets: bool | None = None,
        bucket_codec: BucketCodec | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if engine is None:
            engine = _import_sglang().Engine(**engine_kwargs)
        elif engine_kwargs:
            raise ValueError(
                f"SGLangEngine: got an engine and engine arguments {sorted(engine_kwargs)}; give one"
            )
        super().__init__(codec, multi_dtype_buckets, bucket_codec)
        self.engine = engine
        self._takes_version = (
            "weight_version" in inspect.signature(engine.update_weights_from_tensor).parameters
        )

    # ------------------------------------------------------------------ memory and generation

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.engine.release_memory_occupation(tags=None if tags is None else list(tags))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.engine.resume_memory_occupation(tags=None if tags is None else list(tags))

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in GENERATION_MODES:
            raise ValueError(f"pause_generation: mode must be one of {list(GENERATION_MODES)}, got {mode!r}")
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # sglang.Engine has no pause_generation (0.5.23); its HTTP server calls the tokenizer manager too.
        manager = self.engine.tokenizer_manager
        self.engine.loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        manager = self.engine.tokenizer_manager
        self.engine.loop.run_until_complete(manager.continue_generation(ContinueGenerationReqInput()))

    def flush_cache(self) -> bool:
        """True when flushed; False when SGLang refused because requests remain (it flushes nothing then)."""
        result = self.engine.flush_cache()  # a FlushCacheReqOutput(success, message)
        return bool(result.success)

    def queued_requests(self) -> dict[str, int]:
        """Running and waiting requests over the data-parallel ranks, as the schedulers last published them."""
        manager = self.engine.tokenizer_manager
        loads = self.engine.loop.run_until_complete(manager.get_loads(include=["core"]))
        return {
            "running": sum(int(load.num_running_reqs) for load in loads),
            "waiting": sum(int(load.num_waiting_reqs) for load in loads),
        }

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        self._refuse_mixed("SGLangEngine")
        outputs = self.engine.generate(
            input_ids=[list(p) for p in prompts],
            sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
        )
        return [list(out["output_ids"]) for out in outputs]

    # ------------------------------------------------------------------ weights

    def _update(self, payloads: list[Any], *, version: int, last: bool) -> None:
        kwargs: dict[str, Any] = {
            "named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": last,
        }
        if self._takes_version and last:
            kwargs["weight_version"] = str(version)
        _check(self.engine.update_weights_from_tensor(**kwargs), version)


def _check(result: Any, version: int) -> None:
    """SGLang answers (success, message) or a dict with `success`; a failure must not pass silently."""
    success, message = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], str(result[1]) if len(result) > 1 else ""
    elif isinstance(result, dict) and "success" in result:
        success, message = bool(result["success"]), str(result.get("message", ""))
    if not success:
        raise RuntimeError(f"SGLang refused weight version {version}: {message}")


__all__ = ["ENGINE_TAGS", "SGLangEngine", "SGLangWeights", "sglang_bucket_codec", "sglang_codec"]

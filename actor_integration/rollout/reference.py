"""A reference rollout engine on plain torch, serving `TinyLM` (`actor_integration.models.tiny`).

The engine behaves like SGLang where the lifecycle cares: `weights` and `kv_cache` memory are
released and resumed per tag (released weights lose their contents unless `weights_backup`;
resuming a resident tag raises KeyError as SGLang does), generation can be paused and the
cache flushed, and weight updates are versioned and staged: the previous weights stay loaded
until the final round of a new version has arrived complete. It loads in place
(`LoadsInPlace`): a version that comes in one round is written by the receiver straight into the
served parameters, after every bucket was verified; a version in several rounds goes into staging
tensors first and into the parameters at the final round. One engine rank per GPU of its
slot; each rank holds a full replica (as each SGLang TP rank receives the full tensors from the
trainer rank on its GPU, minus the sharding).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from actor_integration.models.tiny import TinyLM, TinyLMConfig, weights_checksum
from actor_integration.rollout.engine import ENGINE_TAGS, GENERATION_MODES, NamedTensors
from actor_integration.weight_sync.receiver import WeightTargets


class ReferenceEngine:
    """A `RolloutEngine` serving `TinyLM` replicas, one per device in `devices`."""

    def __init__(
        self,
        config: TinyLMConfig | None = None,
        *,
        devices: Sequence[str | torch.device] = ("cpu",),
        kv_cache_tokens: int | None = None,
        weights_backup: bool = False,
    ) -> None:
        if isinstance(devices, (str, torch.device)) or not devices:
            raise ValueError(
                f"ReferenceEngine: devices must be a non-empty list, one per engine rank, got {devices!r}"
            )
        self.config = config or TinyLMConfig()
        self.devices = [torch.device(d) for d in devices]
        self.models = [TinyLM(self.config).to(d).eval() for d in self.devices]
        self._shapes = {name: (p.shape, p.dtype) for name, p in self.models[0].named_parameters()}
        self.kv_cache_tokens = kv_cache_tokens or self.config.max_seq_len
        self._kv: list[torch.Tensor | None] = [m.new_cache(self.kv_cache_tokens) for m in self.models]
        self.weights_backup = weights_backup
        self._backup: list[dict[str, torch.Tensor]] | None = None
        self._resident = dict.fromkeys(ENGINE_TAGS, True)
        self._weights_valid = True
        self._paused = False
        self._running = 0  # generate calls in progress: a flush refuses while any runs, as SGLang's does
        self._running_lock = threading.Lock()
        self._staged: list[dict[str, torch.Tensor]] | None = None
        self._staged_version: int | None = None
        self._live: WeightTargets | None = None  # the parameters as load targets (until reallocated)
        self._staging: WeightTargets | None = None  # staging tensors for versions in several rounds
        self._staged_names: list[set[str]] = []
        self.weight_version = 0
        self.stages_weights = True  # rounds are staged; the served weights change at the final one
        self.calls: list[str] = []  # engine calls in order, for tests and the demo's log

    @property
    def num_ranks(self) -> int:
        """How many engine ranks (one model copy each) the engine serves with."""
        return len(self.models)

    # ------------------------------------------------------------------ memory

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Release `tags` (None: all); a tag already released is refused, as torch_memory_saver would."""
        tags = self._tags(tags)
        self.calls.append(f"release_memory_occupation{tags}")
        for tag in tags:
            if not self._resident[tag]:
                raise RuntimeError(
                    f"ReferenceEngine: {tag!r} is already released (torch_memory_saver would exit the process)"
                )
        for tag in tags:
            if tag == "weights":
                if self.weights_backup and self._weights_valid:
                    self._backup = [
                        {n: p.detach().to("cpu", copy=True) for n, p in m.named_parameters()}
                        for m in self.models
                    ]
                for model, device in zip(self.models, self.devices, strict=True):
                    for p in model.parameters():
                        p.data = torch.empty(0, dtype=p.dtype, device=device)
                self._staged = None
                self._live = self._staging = None
                self._weights_valid = False
            else:
                self._kv = [None] * self.num_ranks
            self._resident[tag] = False
        if any(d.type == "cuda" for d in self.devices):
            # Plain torch keeps freed blocks in its cache: hand them back so the trainer on this GPU can use them.
            torch.cuda.empty_cache()

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Resume the released `tags` (None: all); a resident tag is refused, as SGLang does."""
        tags = self._tags(tags)
        self.calls.append(f"resume_memory_occupation{tags}")
        for tag in tags:
            if self._resident[tag]:
                raise KeyError(
                    f"ReferenceEngine: resume of {tag!r}, which was not released (SGLang raises too)"
                )
        for tag in tags:
            if tag == "weights":
                for rank, (model, device) in enumerate(zip(self.models, self.devices, strict=True)):
                    for name, p in model.named_parameters():
                        shape, dtype = self._shapes[name]
                        p.data = torch.empty(shape, dtype=dtype, device=device)
                        if self._backup is not None:
                            p.data.copy_(self._backup[rank][name])
                self._weights_valid = self._backup is not None
                self._backup = None
                self._live = None
            else:
                self._kv = [m.new_cache(self.kv_cache_tokens) for m in self.models]
            self._resident[tag] = True

    def _tags(self, tags: Sequence[str] | None) -> list[str]:
        if tags is None:
            return list(ENGINE_TAGS)
        if isinstance(tags, str):
            raise TypeError(f"tags must be a list of tag names, got the string {tags!r}")
        unknown = [t for t in tags if t not in ENGINE_TAGS]
        if unknown:
            raise ValueError(f"ReferenceEngine: unknown memory tags {unknown}; tags are {list(ENGINE_TAGS)}")
        return list(tags)

    @property
    def residency(self) -> dict[str, bool]:
        """Tag → whether it is resident."""
        return dict(self._resident)

    def memory_bytes(self, tag: str | None = None) -> int:
        """CUDA memory `tag` (None: every tag) holds when resident, over all engine ranks: what a
        release should free (`AuditedMemory`'s expected bytes). 0 for CPU ranks."""
        total = 0
        for tag_name in self._tags(None if tag is None else [tag]):
            for device in self.devices:
                if device.type != "cuda":
                    continue
                if tag_name == "weights":
                    total += sum(shape.numel() * dtype.itemsize for shape, dtype in self._shapes.values())
                else:
                    cfg = self.config
                    total += cfg.n_layers * 2 * self.kv_cache_tokens * cfg.dim * cfg.torch_dtype.itemsize
        return total

    # ------------------------------------------------------------------ generation

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop taking generations (`mode` as SGLang's: abort, retract or in_place) until `continue_generation`."""
        if mode not in GENERATION_MODES:
            raise ValueError(f"pause_generation: mode must be one of {list(GENERATION_MODES)}, got {mode!r}")
        self.calls.append(f"pause_generation({mode})")
        self._paused = True

    def continue_generation(self) -> None:
        """Take generations again after `pause_generation`."""
        self.calls.append("continue_generation")
        self._paused = False

    def flush_cache(self) -> bool:
        """Zero the KV cache; False (nothing flushed) while a generation is running."""
        self.calls.append("flush_cache")
        if self._running:
            return False
        for kv in self._kv:
            if kv is not None:
                kv.zero_()
        return True

    def queued_requests(self) -> dict[str, int]:
        """Requests still in the engine: running and waiting."""
        return {"running": self._running, "waiting": 0}

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens for each prompt; refused while paused or with weights or KV cache released."""
        if self._paused:
            raise RuntimeError("ReferenceEngine: generation is paused; continue_generation() first")
        if not self._resident["weights"] or not self._resident["kv_cache"]:
            released = [t for t, r in self._resident.items() if not r]
            raise RuntimeError(
                f"ReferenceEngine: cannot generate with {released} released; resume them first"
            )
        if not self._weights_valid:
            raise RuntimeError(
                "ReferenceEngine: the weights were released without a backup and no update was loaded since; "
                "sync weights before generating"
            )
        self.calls.append("generate")
        kv = self._kv[0]
        assert kv is not None
        with self._running_lock:
            self._running += 1
        try:
            return self.models[0].generate(prompts, max_new_tokens=max_new_tokens, cache=kv)
        finally:
            with self._running_lock:
                self._running -= 1

    # ------------------------------------------------------------------ weights

    def load_weights(
        self, version: int, shards: Sequence[NamedTensors], *, round_index: int, final: bool
    ) -> None:
        """Load one round of `version` (`shards[i]` for engine rank i); the final round serves it."""
        if len(shards) != self.num_ranks:
            raise ValueError(
                f"ReferenceEngine has {self.num_ranks} ranks but the update carries {len(shards)} shards: the "
                "trainer's slot and the engine disagree on the number of GPUs"
            )
        if not self._resident["weights"]:
            raise RuntimeError(
                "ReferenceEngine: weights are released; resume_memory_occupation(['weights']) first"
            )
        if round_index == 0:
            self._staged, self._staged_version = [{} for _ in self.models], version
        elif self._staged is None or self._staged_version != version:
            raise RuntimeError(
                f"ReferenceEngine: round {round_index} of version {version} without its round 0; resend the version"
            )
        self.calls.append(f"load_weights(v{version}, round {round_index}{', final' if final else ''})")
        for rank, named in enumerate(shards):
            staged = self._staged[rank]
            for name, tensor in named:
                if name not in self._shapes:
                    known = sorted(self._shapes)
                    self._staged = None
                    raise ValueError(
                        f"ReferenceEngine: unknown tensor {name!r}; the model has {known[:6]}..."
                    )
                shape, dtype = self._shapes[name]
                if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    self._staged = None
                    raise ValueError(
                        f"ReferenceEngine: {name!r} arrived as {tuple(tensor.shape)} {tensor.dtype}, the model "
                        f"has {tuple(shape)} {dtype}"
                    )
                staged[name] = torch.empty(shape, dtype=dtype, device=self.devices[rank]).copy_(tensor)
        if not final:
            return
        staged_all, self._staged = self._staged, None
        for rank, staged in enumerate(staged_all):
            missing = sorted(set(self._shapes) - set(staged))
            if missing:
                raise ValueError(
                    f"ReferenceEngine: version {version} is incomplete on rank {rank}: missing {missing[:6]}; "
                    "the previous weights stay loaded"
                )
        with torch.no_grad():
            for model, staged in zip(self.models, staged_all, strict=True):
                for name, p in model.named_parameters():
                    p.copy_(staged[name])
        self._weights_valid = True
        self.weight_version = version

    def weight_targets(self, version: int, *, round_index: int, final: bool) -> WeightTargets:
        """The parameters for a version in one round; staging tensors for a round of several."""
        if not self._resident["weights"]:
            raise RuntimeError(
                "ReferenceEngine: weights are released; resume_memory_occupation(['weights']) first"
            )
        if round_index == 0:
            self._staged_version = version
            self._staged_names = [set() for _ in self.models]
        elif self._staged_version != version:
            raise RuntimeError(
                f"ReferenceEngine: round {round_index} of version {version} without its round 0; resend the version"
            )
        if round_index == 0 and final:
            if self._live is None:
                self._live = WeightTargets(
                    [{n: p.data for n, p in m.named_parameters()} for m in self.models], complete=True
                )
            return self._live
        if self._staging is None:
            self._staging = WeightTargets(
                [
                    {
                        n: torch.empty(shape, dtype=dtype, device=d)
                        for n, (shape, dtype) in self._shapes.items()
                    }
                    for d in self.devices
                ]
            )
        return self._staging

    def weights_written(
        self, version: int, names: Sequence[Sequence[str]], *, round_index: int, final: bool
    ) -> None:
        """The receiver wrote round `round_index` of `version` into `weight_targets` (the names per rank)."""
        self.calls.append(f"load_weights(v{version}, round {round_index}{', final' if final else ''})")
        if round_index == 0 and final:
            self._weights_valid = True
            self.weight_version = version
            return
        if self._staged_version != version or self._staging is None:
            raise RuntimeError(f"ReferenceEngine: round {round_index} of version {version} was not staged")
        for staged, written in zip(self._staged_names, names, strict=True):
            staged.update(written)
        if not final:
            return
        for rank, staged in enumerate(self._staged_names):
            missing = sorted(set(self._shapes) - staged)
            if missing:
                raise ValueError(
                    f"ReferenceEngine: version {version} is incomplete on rank {rank}: missing {missing[:6]}; "
                    "the previous weights stay loaded"
                )
        with torch.no_grad():
            for model, staging in zip(self.models, self._staging.tensors, strict=True):
                for name, p in model.named_parameters():
                    p.copy_(staging[name])
        self._weights_valid = True
        self.weight_version = version

    def weights_checksum(self) -> str:
        """The checksum of the served weights, the same on every engine rank (else RuntimeError)."""
        if not self._resident["weights"] or not self._weights_valid:
            raise RuntimeError("ReferenceEngine: no valid weights to checksum (released or never loaded)")
        sums = [weights_checksum(m.named_weights()) for m in self.models]
        if len(set(sums)) != 1:
            raise RuntimeError(f"ReferenceEngine: engine ranks hold different weights: {sums}")
        return sums[0]

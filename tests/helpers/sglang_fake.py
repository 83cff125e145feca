"""A fake `sglang` that behaves as a real engine does where the adapters depend on it, shaped by the
real source of one release (`SourceShapedSGLang`: every call binds to SGLang's own signature).

What it models, from SGLang's source (0.5.17 and 0.5.23) and the H200 runs
(docs/measurements.md#sglang-rollout-engine-2026-12-03):
- memory tags released and resumed by name; a second release of a tag, a resume of a resident
  one, a generation with a tag released, or a weight load into released weights end the
  scheduler (torch_memory_saver's exit(1), the KeyError, the Triton pointer error): the fake
  kills its stand-in scheduler process, and the call never answers, as SGLang's does not;
- 0.5.17 asserts an idle scheduler on release (the assertion ends it); 0.5.23 loads weights only
  inside a begin/end weight-update session and refuses otherwise;
- `update_weights_from_tensor(load_format=<a custom loader>)` runs the loader as SGLang's
  scheduler does: the payload deserialized, each tensor moved with `.to(device)`, then
  `loader(model, named_tensors)`; `flattened_bucket` payloads are rebuilt into named tensors;
- the scheduler is a real child process, so its death is observable the way the adapter watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import io
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch

from tests.helpers.sglang_source import SourceShapedSGLang, SourceTree

ENGINE = "sglang.srt.entrypoints.engine.Engine"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
IO = "sglang.srt.managers.io_struct"
WATCHDOG = "sglang.srt.utils.watchdog.SubprocessWatchdog"
GROUP = "sglang.srt.distributed.parallel_state.GroupCoordinator"
LOAD_SNAPSHOT = "sglang.srt.managers.load_snapshot.LoadSnapshot"
ALL_TAGS = ("weights", "kv_cache", "cuda_graph")


class RecordingModel(torch.nn.Module):
    """SGLang's model (an nn.Module) as its weight loaders see it: `load_weights` copies each named tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load_weights(self, weights: Any) -> None:
        self.loads += 1
        for name, tensor in weights:
            self.params[name] = tensor.detach().to("cpu", copy=True)

    def checksum(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.params):
            digest.update(name.encode())
            digest.update(self.params[name].contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


# SGLang's defaults of the ServerArgs fields the adapter reads.
_SERVER_ARG_DEFAULTS: dict[str, Any] = {
    "tp_size": 1,
    "disable_cuda_graph": False,
    "enable_memory_saver": False,
    "custom_weight_loader": None,
    "custom_sigquit_handler": None,
}


class _ServerArgs:
    """The Engine's `server_args`: what the adapter's `Engine(**kwargs)` call passed, else SGLang's default."""

    def __init__(self, fake: FakeSGLang) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name not in self._fake.tree.server_args_fields():
            raise AttributeError(f"sglang {self._fake.tree.version}: ServerArgs has no field {name!r}")
        built = [c for c in self._fake.shaped.calls if c.qualname == "Engine()"]
        kwargs = built[-1].kwargs if built else self._fake.engine_kwargs
        return kwargs.get(name, _SERVER_ARG_DEFAULTS.get(name))


class FakeSGLang:
    """Install with `installed()`; the engine the adapter builds then runs against this state."""

    def __init__(self, tree: SourceTree, **engine_kwargs: Any) -> None:
        self.tree = tree
        self.version = tree.version
        self.sessions = tree.cls(ENGINE).method("begin_weight_update") is not None
        self.engine_kwargs = engine_kwargs  # for an engine the test builds itself (`sglang.Engine()`)
        self.shaped = SourceShapedSGLang(tree)
        self.loop = asyncio.new_event_loop()
        self.model = RecordingModel()
        self.released: set[str] = set()
        self.paused = False
        self.queued = {"running": 0, "waiting": 0}
        self.session_open = False
        self.weight_version: str | None = None
        self.hang: set[str] = set()  # tokenizer-manager calls that never answer (a hung scheduler)
        self.refuse: str | None = None  # the message of weight updates refused from now on
        self.updates: list[dict[str, Any]] = []  # per update call: load_format, flush_cache, per-rank tensors
        self.deaths: list[str] = []
        self.log: list[tuple[str, Any]] = []
        self.scheduler = multiprocessing.get_context("fork").Process(
            target=time.sleep, args=(600,), daemon=True
        )
        self.scheduler.start()
        self._wire()

    # ------------------------------------------------------------------ set-up

    def _wire(self) -> None:
        shaped = self.shaped
        manager = shaped.make(TOKENIZER_MANAGER)
        watchdog = shaped.make(WATCHDOG)
        group = shaped.make(GROUP)
        shaped.instance_values.update(
            {
                "Engine.loop": self.loop,
                "Engine.tokenizer_manager": manager,
                "Engine.server_args": _ServerArgs(self),
                "TokenizerManager._subprocess_watchdog": watchdog,
                "TokenizerManager.signal_handler_class": shaped.fake_class(
                    "sglang.srt.managers.tokenizer_manager.SignalHandler"
                ),
                "TokenizerManager.event_loop": None,
                "SubprocessWatchdog._processes": [self.scheduler],
                "SubprocessWatchdog._names": ["scheduler_0"],
                "GroupCoordinator.rank_in_group": 0,
                "GroupCoordinator.world_size": 1,
                "GroupCoordinator.cpu_group": None,
                # sglang/version.py reads the installed distribution's version at import time
                "sglang:__version__": self.version,
            }
        )
        serializer = "MultiprocessingSerializer"
        shaped.answers.update(
            {
                "Engine.get_all_child_pids": lambda: [self.scheduler.pid],
                "get_tp_group": group,
                f"{serializer}.serialize": _serialize,
                f"{serializer}.deserialize": _deserialize,
                "TokenizerManager.release_memory_occupation": self._release,
                "TokenizerManager.resume_memory_occupation": self._resume,
                "TokenizerManager.pause_generation": self._pause,
                "TokenizerManager.continue_generation": self._continue,
                "TokenizerManager.flush_cache": self._flush,
                "TokenizerManager.get_loads": self._loads,
                "TokenizerManager.generate_request": self._generate,
                "TokenizerManager.update_weights_from_tensor": self._update,
                "TokenizerManager.check_weights": self._check_weights,
                "TokenizerManager.get_internal_state": self._internal_state,
                "TokenizerManager.begin_weight_update": self._begin,
                "TokenizerManager.end_weight_update": self._end,
                "FlattenedTensorBucket.get_flattened_tensor": lambda: None,
            }
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeSGLang]:
        with self.shaped.installed():
            yield self

    def close(self) -> None:
        self.kill_scheduler("test over")
        self.loop.close()

    # ------------------------------------------------------------------ the scheduler

    def kill_scheduler(self, why: str) -> None:
        if self.scheduler.is_alive():
            self.deaths.append(why)
            os.kill(self.scheduler.pid, signal.SIGKILL)
            self.scheduler.join(5)

    @property
    def alive(self) -> bool:
        return self.scheduler.is_alive()

    async def _answer(self, call: str, value: Any = None) -> Any:
        """What the scheduler answers; nothing, ever, once it is dead or told to hang."""
        self.log.append((call, value))
        if not self.alive or call in self.hang:
            await asyncio.sleep(3600)
        return value

    async def _dies(self, call: str, why: str) -> Any:
        self.kill_scheduler(why)
        return await self._answer(call)

    # ------------------------------------------------------------------ memory and generation

    def _tags(self, obj: Any) -> list[str]:
        tags = obj.tags
        return list(ALL_TAGS) if not tags else list(tags)

    def _release(self, obj: Any, request: Any = None) -> Any:
        tags = self._tags(obj)
        if set(tags) & self.released:
            return self._dies(
                "release",
                f"torch_memory_saver: cannot pause a paused tag {sorted(set(tags) & self.released)}",
            )
        idle = not (self.queued["running"] or self.queued["waiting"])
        if not idle and not (self.version >= "0.5.23" and self.paused):
            return self._dies("release", "assert is_fully_idle(): release with requests in the scheduler")
        self.released |= set(tags)
        return self._answer("release", tags)

    def _resume(self, obj: Any, request: Any = None) -> Any:
        tags = self._tags(obj)
        resident = [t for t in tags if t not in self.released]
        if resident:
            return self._dies("resume", f"KeyError: {resident[0]!r}")
        self.released -= set(tags)
        return self._answer("resume", tags)

    def _pause(self, obj: Any) -> Any:
        self.paused = True
        if obj.mode == "abort":
            self.queued = {"running": 0, "waiting": 0}
        return self._answer("pause_generation", obj.mode)

    def _continue(self, obj: Any) -> Any:
        self.paused = False
        return self._answer("continue_generation")

    def _flush(self, timeout_s: Any = None) -> Any:
        ok = not (self.queued["running"] or self.queued["waiting"])
        return self._answer("flush_cache", self.shaped.make(f"{IO}.FlushCacheReqOutput", success=ok))

    def _loads(self, include: Any = None, dp_rank: Any = None) -> Any:
        snapshot = self.shaped.make(
            LOAD_SNAPSHOT,
            dp_rank=0,
            num_running_reqs=self.queued["running"],
            num_waiting_reqs=self.queued["waiting"],
        )
        return self._answer("get_loads", [snapshot])

    def _generate(self, obj: Any, request: Any = None) -> Any:
        if self.released:
            return self._dies(
                "generate", f"Triton: pointer argument cannot be accessed ({sorted(self.released)} released)"
            )
        seed = self.model.checksum()
        outputs = [
            {
                "output_ids": [
                    int(hashlib.sha256(f"{seed}{p}{i}".encode()).hexdigest(), 16) % 97
                    for i in range(obj.sampling_params["max_new_tokens"])
                ]
            }
            for p in obj.input_ids
        ]
        return self._answer("generate", outputs)

    def _check_weights(self, obj: Any, request: Any = None) -> Any:
        return self._answer("check_weights", (True, "Success.", [], self.model.checksum()))

    def _internal_state(self) -> Any:
        usage = {"weight": 1.5, "kvcache": 20.0, "graph": {"decode": 0.25}}
        return self._answer("get_internal_state", [{"memory_usage": usage}])

    # ------------------------------------------------------------------ weights

    def _begin(self, obj: Any, request: Any = None) -> Any:
        if self.session_open:
            return self._answer("begin_weight_update", (False, "a weight-update session is already open"))
        self.session_open = True
        return self._answer("begin_weight_update", (True, "Success"))

    def _end(self, obj: Any, request: Any = None) -> Any:
        if not self.session_open:
            return self._answer("end_weight_update", (False, "no weight-update session is open"))
        self.session_open = False
        return self._answer("end_weight_update", (True, "Success"))

    def _update(self, obj: Any, request: Any = None) -> Any:
        if "weights" in self.released:
            return self._dies("update_weights_from_tensor", "segfault: weights written while released")
        if self.sessions and not self.session_open:
            return self._answer(
                "update_weights_from_tensor",
                (
                    False,
                    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
                ),
            )
        if self.refuse is not None:
            return self._answer("update_weights_from_tensor", (False, self.refuse))
        custom = list(self.engine_loaders())
        record: dict[str, Any] = {"load_format": obj.load_format, "flush_cache": obj.flush_cache, "ranks": []}
        if obj.load_format == "flattened_bucket":
            for rank, payload in enumerate(obj.serialized_named_tensors):  # each TP rank reads its own
                data = _deserialize(payload)
                flat, metadata = data["flattened_tensor"], data["metadata"]
                named = [
                    (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata
                ]
                record["ranks"].append({name: t.clone() for name, t in named})
                if rank == 0:
                    self.model.load_weights(named)
        elif obj.load_format in custom:
            data = _deserialize(obj.serialized_named_tensors[0])  # the fake has one scheduler: TP rank 0
            module, _, func = obj.load_format.rpartition(".")
            loader = getattr(importlib.import_module(module), func)
            loader(self.model, [(name, tensor.to("cpu")) for name, tensor in data])
        else:
            return self._dies(
                "update_weights_from_tensor", f"NotImplementedError: load_format={obj.load_format}"
            )
        self.updates.append(record)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return self._answer("update_weights_from_tensor", (True, "Success"))

    def engine_loaders(self) -> list[str]:
        built = [c for c in self.shaped.calls if c.qualname == "Engine()"]
        kwargs = built[-1].kwargs if built else self.engine_kwargs
        return list(kwargs.get("custom_weight_loader") or [])


class _Meta:
    """SGLang's FlattenedTensorMetadata: where one tensor sits in a flattened bucket."""

    def __init__(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, start_idx: int, end_idx: int
    ) -> None:
        self.name, self.shape, self.dtype, self.start_idx, self.end_idx = (
            name,
            shape,
            dtype,
            start_idx,
            end_idx,
        )


def flattened_bucket_codec(region: torch.Tensor, manifest: Any) -> Any:
    """What `sglang_bucket_codec` sends, made without SGLang's classes: one flat copy of the bucket
    and metadata pointing into it, serialized as SGLang's MultiprocessingSerializer does."""
    from actor_integration.weight_sync.buckets import dtype_from_name

    flat = region[: manifest.nbytes].clone()
    metadata = [
        _Meta(e.name, tuple(e.shape), dtype_from_name(e.dtype), e.offset, e.offset + e.nbytes)
        for e in manifest.entries
    ]
    return _serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)


def _serialize(obj: Any, output_str: bool = False) -> Any:
    """SGLang's MultiprocessingSerializer.serialize: ForkingPickler bytes (base64 text with output_str)."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    raw = buffer.getvalue()
    return base64.b64encode(raw).decode() if output_str else raw


def _deserialize(data: Any) -> Any:
    import base64

    if isinstance(data, str):
        data = base64.b64decode(data)
    return pickle.loads(data)

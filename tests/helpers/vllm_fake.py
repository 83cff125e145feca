"""A fake vLLM 0.26.0 that behaves as the real one does where the adapters depend on it, every call
bound to the signature the pinned wheel declares (`vllm_source`).

What it models, from vLLM's source (vllm/v1/executor/abstract.py, v1/engine/core.py,
v1/worker/gpu_worker.py) and the field's reports (docs/frameworks/vllm.md):
- `sleep(level)` puts both tags to sleep (level 1 keeps the weights, level 2 discards them: the
  parameters then hold garbage, and generation answers gibberish without an error); a second sleep
  while any tag sleeps is ignored with a warning, as vLLM's executor does; `wake_up(tags)` wakes a
  subset, and a tag not asleep is a warning; scheduling resumes once every tag is awake; level 0
  pauses scheduling only, `wake_up(["scheduling"])` resumes it;
- the killers end the engine (`dead`): generating with any tag asleep (illegal memory access),
  a weight update into sleeping weights (EngineCore segfault), a sleep with requests running;
  a dead engine answers every call with an error, as a dead EngineCore does;
- the weight-transfer session: start while active, update or finish without start are refused;
  `update_weights` parses `update_info` with vLLM's field names and loads through `load_weights`;
- `collective_rpc(method, args=...)` runs the method on each worker (the real
  `LifecycleWorkerExtension` mixed into a stand-in worker);
- `llm_engine.engine_core`, vLLM's client of its EngineCore: with `engine_core_process()` a
  multiprocess client (`resources.engine_manager.processes`) whose EngineCore is a real child
  process; once it exited, every call raises `EngineDeadError` as vLLM's client does after its
  monitor saw the death. Without it, an in-process client (no process of its own).
"""

from __future__ import annotations

import ast
import hashlib
import logging
import multiprocessing
import os
import time
import types
from typing import Any

import torch

from actor_integration.engines.vllm.worker import LifecycleWorkerExtension
from tests.helpers.sglang_source import SourceTree
from tests.helpers.vllm_source import (
    IPC_UPDATE_INFO,
    LLM,
    LLM_ENGINE,
    MP_CLIENT,
    SAMPLING_PARAMS,
    binds,
    construct,
    field_names,
    literal_choices,
)

VOCAB = 97
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

# The executor's lines, as vLLM 0.26.0 logs them for each sleep and wake (vllm/v1/executor/abstract.py).
EXECUTOR_LOG = logging.getLogger("vllm.v1.executor.abstract")


class EngineDeadError(Exception):
    """vLLM's `vllm.v1.engine.exceptions.EngineDeadError` (its name and message): what its client
    raises once EngineCore died."""

    def __init__(self) -> None:
        super().__init__(ENGINE_DEAD_MESSAGE)


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A trainer's weight set: vLLM-style names, two dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),
    }


class Model(torch.nn.Module):
    """The served model as vLLM's loaders see it: `load_weights(weights)` copies each named tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = {name: t.clone() for name, t in tensors.items()}
        self.loads = 0

    def load_weights(self, weights: Any) -> set[str]:
        self.loads += 1
        loaded = set()
        for name, tensor in weights:
            self.params[name] = tensor.detach().to("cpu", copy=True)
            loaded.add(name)
        return loaded

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(sorted(self.params.items()))

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, t in sorted(self.params.items()):
            h.update(name.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


class Worker(LifecycleWorkerExtension):
    """vLLM's GPU worker with the lifecycle's extension mixed in (what `worker_extension_cls` does)."""

    def __init__(self, rank: int, model: Model) -> None:
        self.rank = rank
        self.model_runner = types.SimpleNamespace(
            model=model, model_memory_usage=4096, kv_caches=[torch.zeros(256, dtype=torch.uint8)]
        )


class FakeVLLM:
    """The engine behind `FakeLLM` and the fake server: its memory, scheduler, weights and death."""

    def __init__(self, tree: SourceTree, tensors: dict[str, torch.Tensor], *, tp: int = 1) -> None:
        self.tree = tree
        self.model = Model(tensors)
        self.workers = [Worker(rank, self.model) for rank in range(tp)]
        self.tp = tp
        self.sleeping_tags: set[str] = set()
        self.level = 0
        self.paused = False
        self.unfinished = 0  # requests someone else submitted
        self.dead: str | None = None
        self.warnings: list[str] = []
        self.calls: list[str] = []
        self.sleeps: list[int] = []  # the level of every sleep call (0: a pause)
        self.update_active = False
        # vLLM's IPC start_weight_update puts the model's layers on the meta device (layerwise
        # reload); only finish_weight_update puts back what no chunk loaded. A chunk that fails in
        # the worker ends the session and leaves them there. Modelled where it was seen (an H100):
        # a level-2 sleep fails on them; what a generation on them does was not seen, and the fake
        # keeps serving the weights it holds.
        self.layers_on_meta = False
        self.transfer_init: dict[str, Any] | None = None  # /init_weight_transfer_engine's init_info
        self.ipc: dict[int, torch.Tensor] = {}  # what the test's IPC sender "exported", by handle
        self.update_fields = field_names(tree, IPC_UPDATE_INFO)
        self.pause_modes = literal_choices(tree, "vllm.v1.engine.PauseMode")
        self.core: Any = None  # the child process standing for EngineCore (`engine_core_process`)
        self.reported_dead = False  # EngineCore told the client it died (vLLM's ENGINE_CORE_DEAD)

    def engine_core_process(self) -> Any:
        """Start a child process named as vLLM names its EngineCore, standing for it: kill it and the
        client answers `EngineDeadError`. The caller ends it (`shutdown`, or kill it)."""
        context = multiprocessing.get_context("fork")
        self.core = context.Process(target=time.sleep, args=(600,), name="EngineCore", daemon=True)
        self.core.start()
        return self.core

    # ------------------------------------------------------------------ engine semantics

    def call(self, name: str) -> None:
        self.calls.append(name)
        if self.reported_dead or (self.core is not None and not self.core.is_alive()):
            raise EngineDeadError()
        if self.dead is not None:
            raise RuntimeError(f"EngineCore died ({self.dead}): EngineDeadError")

    def die(self, why: str) -> None:
        self.dead = why
        raise RuntimeError(f"EngineCore died: {why}")

    def sleep(self, level: int, mode: str) -> None:
        if mode not in self.pause_modes:
            raise ValueError(f"Invalid pause mode: {mode}")
        self.sleeps.append(level)
        self.paused = True  # the sleep pauses the scheduler first (abort drops the requests)
        if mode == "abort":
            self.unfinished = 0
        if level < 1:
            return
        if level == 2 and self.layers_on_meta:  # the worker copies the buffers to host first
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")
        if self.unfinished and mode != "keep":
            self.die("illegal memory access: sleep with requests running")
        if self.sleeping_tags:
            self.warnings.append("Executor is already sleeping.")
            return
        started = time.perf_counter()
        self.sleeping_tags = {"weights", "kv_cache"}
        self.level = level
        if level == 2:  # discarded: what the wake maps back is whatever the memory held
            self.model.params = {n: torch.full_like(t, 7) for n, t in self.model.params.items()}
        EXECUTOR_LOG.info("It took %.6f seconds to fall asleep.", time.perf_counter() - started)

    def wake_up(self, tags: list[str] | None) -> None:
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            if not self.sleeping_tags:
                self.warnings.append("Executor is not sleeping.")
            elif tags and any(t not in self.sleeping_tags for t in tags):
                self.warnings.append(f"Tag {tags} is not in sleeping tags {self.sleeping_tags}")
            else:
                started, woken = time.perf_counter(), tags if tags is not None else set(self.sleeping_tags)
                self.sleeping_tags -= set(self.sleeping_tags if tags is None else tags)
                EXECUTOR_LOG.info(
                    "It took %.6f seconds to wake up tags %s.", time.perf_counter() - started, woken
                )
        if not self.sleeping_tags:
            self.paused = False

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if self.sleeping_tags:
            self.die(f"illegal memory access: generate with {sorted(self.sleeping_tags)} asleep")
        if self.paused:
            raise RuntimeError("the fake's offline generate would hang: the scheduler is paused")
        digest = self.model.digest()
        out = []
        for prompt in prompts:
            seed = hashlib.sha256(f"{digest}:{prompt}".encode()).digest()
            out.append([seed[i % len(seed)] % VOCAB for i in range(max_tokens)])
        return out

    def start_update(self) -> None:
        if self.update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.update_active = self.layers_on_meta = True

    def update(self, update_info: dict[str, Any]) -> None:
        if not self.update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if "weights" in self.sleeping_tags:
            self.die("segfault: weight update into sleeping weights (vllm #57853)")
        try:
            unknown = set(update_info) - self.update_fields
            if unknown:
                raise TypeError(f"IPCWeightTransferUpdateInfo got unexpected fields {sorted(unknown)}")
            handles = update_info["ipc_handles"]
            tensors = [self.ipc[h["fake-gpu"][0]] for h in handles]
            self.model.load_weights(zip(update_info["names"], tensors, strict=True))
        except BaseException:
            self.update_active = False  # vLLM's worker ends the session on a failed chunk
            raise

    def finish_update(self) -> None:
        if not self.update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.update_active = self.layers_on_meta = False

    def rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    # ------------------------------------------------------------------ the test's IPC sender

    def ipc_sender(self, iterator: Any, trainer_args: dict[str, Any]) -> None:
        """Stands in for `IPCWeightTransferEngine.trainer_send_weights` (needs CUDA): "exports" each
        tensor under a handle and sends vLLM's update_info fields through `send_mode`."""
        names, dtypes, shapes, handles = [], [], [], []
        for name, tensor in iterator:
            key = len(self.ipc)
            self.ipc[key] = tensor.detach().clone()
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
            # as torch's reduce_tensor: the rebuild function, then arguments that hold a class
            handles.append({"fake-gpu": (key, torch.Tensor)})
        info = {
            "names": names,
            "dtype_names": dtypes,
            "shapes": shapes,
            "ipc_handles": handles,
            "packed": False,
        }
        trainer_args["send_mode"](types.SimpleNamespace(**info).__dict__)


class FakeEngineCoreClient:
    """`LLMEngine.engine_core`: vLLM's `MPClient` where the fake has an EngineCore process (its
    `resources.engine_manager.processes`), else an in-process client with no `resources`."""

    def __init__(self, fake: FakeVLLM) -> None:
        self._fake = fake
        if fake.core is not None:
            self.resources = types.SimpleNamespace(
                engine_manager=types.SimpleNamespace(processes=[fake.core]), engine_dead=False
            )

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        binds(self._fake.tree, MP_CLIENT, "shutdown", args, kwargs)
        core = self._fake.core
        if core is not None and core.is_alive():
            core.kill()
            core.join(timeout=5)


class FakeLLMEngine:
    """`LLM.llm_engine`: the config the adapter reads, the unfinished-request count, the EngineCore client."""

    def __init__(self, fake: FakeVLLM, *, sleep_mode: bool) -> None:
        self._fake = fake
        self.engine_core = FakeEngineCoreClient(fake)
        self.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(enable_sleep_mode=sleep_mode),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=fake.tp),
        )

    def has_unfinished_requests(self, *args: Any, **kwargs: Any) -> bool:
        binds(self._fake.tree, LLM_ENGINE, "has_unfinished_requests", args, kwargs)
        return self._fake.unfinished > 0

    def get_num_unfinished_requests(self, *args: Any, **kwargs: Any) -> int:
        binds(self._fake.tree, LLM_ENGINE, "get_num_unfinished_requests", args, kwargs)
        return self._fake.unfinished


class FakeLLM:
    """`vllm.LLM` as the offline adapter calls it: each method bound to vLLM 0.26.0's signature."""

    def __init__(self, fake: FakeVLLM, *, sleep_mode: bool = True) -> None:
        self.fake = fake
        self.llm_engine = FakeLLMEngine(fake, sleep_mode=sleep_mode)

    def _bind(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        binds(self.fake.tree, LLM, name, args, kwargs)
        self.fake.call(name)
        return method_arguments(self.fake.tree, name, args, kwargs)

    def sleep(self, *args: Any, **kwargs: Any) -> None:
        a = self._bind("sleep", args, kwargs)
        self.fake.sleep(a["level"], a["mode"])

    def wake_up(self, *args: Any, **kwargs: Any) -> None:
        a = self._bind("wake_up", args, kwargs)
        self.fake.wake_up(a["tags"])

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._bind("reset_prefix_cache", args, kwargs)
        return self.fake.unfinished == 0

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        a = self._bind("generate", args, kwargs)
        params = a["sampling_params"]
        tokens = self.fake.generate([p["prompt_token_ids"] for p in a["prompts"]], params.max_tokens)
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=t)]) for t in tokens]

    def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
        a = self._bind("collective_rpc", args, kwargs)
        return self.fake.rpc(a["method"], tuple(a["args"]))

    def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        self._bind("start_weight_update", args, kwargs)
        self.fake.start_update()

    def update_weights(self, *args: Any, **kwargs: Any) -> None:
        a = self._bind("update_weights", args, kwargs)
        info = a["request"]["update_info"]
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") in ("", "0") and holds_a_class(info):
            # vLLM's msgpack client, before anything reaches EngineCore (seen on an H100)
            raise TypeError(
                "Object of type <class 'torch._C._TensorMeta'> is not serializableSet "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization."
            )
        self.fake.update(info)

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
        self._bind("finish_weight_update", args, kwargs)
        self.fake.finish_update()


def holds_a_class(value: Any) -> bool:
    """Whether `value` holds a class anywhere (what vLLM's msgpack encoder refuses without pickles)."""
    if isinstance(value, type):
        return True
    if isinstance(value, dict):
        return any(holds_a_class(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_a_class(v) for v in value)
    return False


def method_arguments(
    tree: SourceTree, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of `LLM.name` as vLLM's function sees them, its defaults applied."""
    from tests.helpers.vllm_source import method

    bound = method(tree, LLM, name).signature(bound=True).bind(*args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    for key, value in out.items():  # defaults come back as their source text
        if type(value).__name__ == "_SourceText":
            out[key] = ast.literal_eval(repr(value))
    return out


def sampling_params(tree: SourceTree) -> Any:
    """`SamplingParams(**kwargs)` bound to vLLM's struct fields."""

    def make(**kwargs: Any) -> Any:
        construct(tree, SAMPLING_PARAMS, kwargs)
        return types.SimpleNamespace(**kwargs)

    return make

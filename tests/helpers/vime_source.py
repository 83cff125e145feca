"""vime's real trainer actor, executed from its source files, on CPU (tests only).

`VimeSource.find()` locates the folder `RL_LIFECYCLE_VIME_SOURCE` names (vime's files at the commits
in tests/helpers/vime_manifest.json, checked file by file); nothing of vime is stored in this
repository. `install(source)` runs, in the calling process, vime's own modules that decide the
lifecycle (`MegatronTrainRayActor`, `TrainRayActor`, `RayTrainGroup`, the reloadable process
groups, the gloo group, the memory helpers with `reset_cuda_stack_size`, the tensor backuper and
the timers) and stands in for its heavy internals only: the accelerator (CPU plays the device and
gloo plays NCCL, so vime takes its production path of destroying WORLD), Megatron's model,
optimizer and training step, checkpoints, the weight sender, the rollout manager, Ray,
transformers and torch_memory_saver (`lifecycle.testing.FakeMemorySaver`). `RECORD` holds what
the stand-ins saw.

The weight sender is a stand-in of vime's colocated `UpdateWeightFromTensor`: its start / finish
bracket and its IPC-handle gather follow a rule it is given (`SENDER_RULES`): "slot" is vime's
since #57 (update_weight_from_tensor.py 01ea2336: the slot's first rank starts, handles gathered
over the slot's ranks), "tp" is the pre-#57 rule issue 49 describes (`tp_rank == 0` starts, handles
gathered over the TP group; no stored vime file has it), "tp_start" the pre-#57 start with the
handles over the slot.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lifecycle.testing import FakeMemorySaver, ProtocolViolation
from tests.helpers import vime_manifest
from tests.helpers.framework_source import (
    FrameworkSource,
    SourceUnavailable,
    initialize_megatron_groups,
    port_free,
    ray_stand_in,
    stand_in_module,
)
from tests.helpers.slime_source import slime_args

SOURCE_ENV = "RL_LIFECYCLE_VIME_SOURCE"
HOW_TO_RUN = (
    f"read vime's files listed by `python scripts/export_vime.py list` from the public file index into a "
    f"git-ignored folder (.vime-source/), check it with `python scripts/export_vime.py check .vime-source`, then "
    f"`{SOURCE_ENV}=.vime-source python -m pytest tests/actor_integration/frameworks/vime`"
)

# vime's modules run from its source, in dependency order.
REAL_MODULES = (
    "vime/utils/memory_utils.py",
    "vime/utils/distributed_utils.py",
    "vime/utils/reloadable_process_group.py",
    "vime/utils/tensor_backper.py",
    "vime/observability/timer.py",
    "vime/ray/train_actor.py",
    "vime/ray/actor_group.py",
    "vime/backends/megatron_utils/actor.py",
)
PACKAGES = (
    "vime",
    "vime.data",
    "vime.utils",
    "vime.ray",
    "vime.observability",
    "vime.backends",
    "vime.backends.megatron_utils",
)


class VimeSourceUnavailable(SourceUnavailable):
    """vime's source folder is not here (CI): the suites skip with HOW_TO_RUN."""


@dataclass(frozen=True)
class VimeSource(FrameworkSource):
    SOURCE_ENV = SOURCE_ENV
    COMMIT_ENV = "RL_LIFECYCLE_VIME_COMMIT"  # unused: each file has its own commit (the manifest)
    DEFAULT_COMMIT = "manifest"
    HOW_TO_RUN = HOW_TO_RUN
    PROBE = "vime/backends/megatron_utils/actor.py"
    UNAVAILABLE = VimeSourceUnavailable

    @classmethod
    def find(cls) -> VimeSource:
        given = os.environ.get(SOURCE_ENV)
        if not given:
            raise VimeSourceUnavailable(f"{SOURCE_ENV} is not set; {HOW_TO_RUN}")
        location = Path(given).expanduser()
        found = vime_manifest.problems(location)
        if found:
            raise VimeSourceUnavailable(f"{location} is not the manifest's vime files: {'; '.join(found)}")
        return cls(location, "manifest")

    def read(self, path: str) -> str:
        return (self.location / path).read_text(encoding="utf-8")

    def commit_of(self, path: str) -> str:
        return next(f.commit for f in vime_manifest.files() if f.path == path)

    def resolved_commit(self) -> str:
        return ", ".join(f"{f.path.rsplit('/', 1)[-1]}@{f.commit[:8]}" for f in vime_manifest.files())


# slime's flags vime's parser does not have (vime's actor asks `hasattr(args, "update_weight_start_version")`).
NOT_VIME_FLAGS = (
    "release_train",
    "keep_old_actor",
    "update_weights_interval",
    "update_weight_mode",
    "update_weight_transport",
    "update_weight_start_version",
    "ci_test",
    "wandb_always_use_train_step",
    "use_wandb",
    "use_tensorboard",
)


def vime_args(world_size: int, **overrides: Any) -> argparse.Namespace:
    """vime's parsed flags for a colocated, offloaded actor (only what the code paths read): slime's,
    with vime's differences."""
    vime = {
        "distributed_backend": "gloo",  # plays nccl here (install: vime's _uses_nccl)
        "actor_num_nodes": 1,
        "actor_num_gpus_per_node": world_size,
        "rollout_num_gpus_per_engine": world_size,
        "start_rollout_id": None,
        "use_routing_replay": False,
        "dspark_enabled": False,
        "allgather_cp": False,
        "sender_rule": "slot",
    }
    return slime_args(world_size, absent=NOT_VIME_FLAGS, **{**vime, **overrides})


# ---------------------------------------------------------------------------------------------- records

RECORD: dict[str, list[Any]] = {
    "trained": [],
    "saved": [],
    "engine": [],
    "engine_calls": [],
    "stack_resets": [],
}
SAVER = FakeMemorySaver(init_enable=True)  # vime's RayTrainGroup: preload + TMS_INIT_ENABLE=1


def checksum(tensors: Any) -> float:
    """A float that changes with every weight: sum of value x position over all tensors, in name order."""
    total = 0.0
    for _, t in sorted(dict(tensors).items()):
        flat = t.detach().float().flatten()
        total += float((flat * torch.arange(1, flat.numel() + 1)).sum())
    return round(total, 6)


def model_checksum(model: list[torch.nn.Module]) -> float:
    return checksum((f"{i}.{n}", p) for i, chunk in enumerate(model) for n, p in chunk.named_parameters())


def _live(group: Any, what: str) -> Any:
    """A vime-wrapped group's live torch group; a collective on a destroyed one is what the real one fails on."""
    if getattr(group, "group", group) is None:
        raise ProtocolViolation(f"{what}: collective on a destroyed process group")
    return group


# ---------------------------------------------------------------------------------------------- stand-ins

_module = stand_in_module


class _CpuC:
    """torch._C without the CUDA host allocator a CPU build lacks (vime's clear_memory empties it)."""

    @staticmethod
    def _host_emptyCache() -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch._C, name)


class CpuTorch:
    """torch for vime's modules on CPU: no pinned host memory, no CUDA device to select or host cache to empty."""

    cuda = types.SimpleNamespace(
        set_device=lambda device: None, is_initialized=lambda: False, synchronize=lambda: None
    )
    _C = _CpuC()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return torch.empty_like(tensor, **kwargs)


def _accelerator() -> dict[str, Any]:
    return {
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (64 << 30, 80 << 30),
        "memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
    }


class SingletonMeta(type):
    """vime.utils.misc.SingletonMeta's behaviour: one instance per class (vime's Timer)."""

    _instances: ClassVar[dict[type, Any]] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in SingletonMeta._instances:
            SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return SingletonMeta._instances[cls]

    @staticmethod
    def clear_all_instances() -> None:
        SingletonMeta._instances.clear()


class Box:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


class RayActor:
    """vime.ray.ray_actor.RayActor: the address rank 0 hands the others."""

    @staticmethod
    def _get_current_node_ip_and_free_port(start_port: int = 10000, consecutive: int = 1) -> tuple[str, int]:
        from tests.helpers.framework_source import free_port

        return "127.0.0.1", free_port()

    def get_master_addr_and_port(self) -> tuple[str, int]:
        return self.master_addr, self.master_port  # type: ignore[attr-defined]


class _LocalActorClass:
    """`ray.remote(**options)(cls)` run in this process; the runtime_env's env_vars go into os.environ."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self.cls, self.options_given = cls, options

    def options(self, **more: Any) -> _LocalActorClass:
        return _LocalActorClass(self.cls, {**self.options_given, **more})

    def remote(self, *args: Any, **kwargs: Any) -> _LocalActor:
        env = self.options_given.get("runtime_env", {}).get("env_vars", {})
        os.environ.update(env)
        RECORD.setdefault("ray_actors", []).append({"cls": self.cls.__name__, "env_vars": dict(env)})
        return _LocalActor(self.cls(*args, **kwargs))


class _LocalActor:
    def __init__(self, instance: Any) -> None:
        self.instance = instance

    def __getattr__(self, name: str) -> Any:
        return types.SimpleNamespace(remote=getattr(self.instance, name))


class RolloutManager:
    """The rollout manager's calls vime's update_weights makes: one colocated engine over the whole world."""

    def __init__(self, engines: list[Any] | None = None) -> None:
        self.engines = engines if engines is not None else [FakeVLLMEngine()]
        self.new_engines = 1
        for name in (
            "get_updatable_engines_and_lock",
            "clear_updatable_num_new_engines",
            "set_train_parallel_config",
        ):
            setattr(self, name, types.SimpleNamespace(remote=getattr(self, f"_{name}")))

    def _get_updatable_engines_and_lock(self) -> tuple[Any, ...]:
        counts = [dist.get_world_size()] * len(self.engines)
        return (
            self.engines,
            "lock",
            self.new_engines,
            counts,
            [0] * len(self.engines),
            [{}] * len(self.engines),
        )

    def _clear_updatable_num_new_engines(self) -> None:
        self.new_engines = 0

    def _set_train_parallel_config(self, config: dict[str, Any]) -> None:
        RECORD.setdefault("parallel_config", []).append(config)


class FakeVLLMEngine:
    """A colocated vLLM engine actor as this rank's sender reaches it: every call recorded (`engine_calls`)."""

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            handles = kwargs.get("ipc_handles")
            RECORD["engine_calls"].append(
                {"rank": dist.get_rank(), "call": name, "gpus": sorted(handles[0]) if handles else None}
            )

        return types.SimpleNamespace(remote=call)


class UpdateWeightFromTensor:
    """vime's colocated weight sender (update_weight_from_tensor.py), reduced to its lifecycle and #57 shape.

    The slot's engine is bracketed by start / finish and each chunk's handles (one per GPU, keyed by
    GPU) are gathered onto one rank and sent in one `update_weights_from_tensor`; who starts and
    over which ranks the handles are gathered is `args.sender_rule` (module doc).
    """

    def __init__(self, args: Any, model: Any, weights_getter: Any, **kwargs: Any) -> None:
        self.args = args
        self.weights_getter = weights_getter
        self.weight_version = 0
        self._ipc_engine: Any = None
        self._ipc_engine_coordinator = False
        self._gather_ranks: list[int] = []

    def connect_rollout_engines(self, engines: Any, lock: Any, **kwargs: Any) -> None:
        from megatron.core import parallel_state as mpu

        rank, size = dist.get_rank(), kwargs["engine_gpu_counts"][0]
        self._ipc_engine = engines[0]
        tp_rank = mpu.get_tensor_model_parallel_rank()
        rule = self.args.sender_rule
        tp = mpu.get_tensor_model_parallel_world_size()
        # pre-#57 ("tp", "tp_start"): every tp_rank 0 starts; vime since #57 ("slot"): the slot's first rank.
        self._ipc_engine_coordinator = tp_rank == 0 if rule in ("tp", "tp_start") else rank == 0
        # pre-#57 ("tp"): handles gathered over the TP group; otherwise over the slot.
        self._gather_ranks = (
            list(range(rank - tp_rank, rank - tp_rank + tp)) if rule == "tp" else list(range(size))
        )
        RECORD.setdefault("connected", []).append(list(map(str, engines)))

    def update_weights(self) -> None:
        import ray

        if SAVER.active:
            # slime #2188 / vime: buckets allocated as saver memory cannot be exported over CUDA IPC.
            raise ProtocolViolation("update_weights ran with the memory saver active: CUDA IPC export fails")
        from vime.utils.distributed_utils import get_gloo_group

        gloo = _live(get_gloo_group(), "sync")
        self.weight_version += 1
        if self._ipc_engine_coordinator:
            ray.get(self._ipc_engine.start_weight_update.remote(is_checkpoint_format=True))
        dist.barrier(group=gloo)
        own = {f"gpu{dist.get_rank()}": checksum(self.weights_getter())}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, own, group=gloo)
        handles: dict[str, float] = {}
        for r in self._gather_ranks:  # the ranks this rule gathers over
            handles.update(everyone[r])
        if self._ipc_engine_coordinator:
            ray.get(
                self._ipc_engine.update_weights_from_tensor.remote(
                    names=["w"], ipc_handles=[handles], weight_version=str(self.weight_version)
                )
            )
        dist.barrier(group=gloo)
        if self._ipc_engine_coordinator:
            ray.get(self._ipc_engine.finish_weight_update.remote())
        dist.barrier(group=gloo)
        RECORD["engine"].append({"version": self.weight_version, "checksum": own[f"gpu{dist.get_rank()}"]})

    def pop_metrics(self) -> dict[str, Any]:
        return {}


def _megatron_stand_ins() -> None:
    from megatron.core import parallel_state as mpu

    base = "vime.backends.megatron_utils"

    def is_megatron_main_rank() -> bool:
        return mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1

    def initialize_model_and_optimizer(args: Any, role: str) -> tuple[Any, ...]:
        model = [torch.nn.Linear(4, 4)]
        optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
        return model, optimizer, types.SimpleNamespace(), -1

    def train(
        rollout_id: int, model: Any, optimizer: Any, scheduler: Any, data_iterator: Any, *rest: Any
    ) -> None:
        SAVER.touch()  # forward and backward read the model's memory
        batch = data_iterator[0].data["tokens"][0].float().reshape(-1, 4)
        loss = model[0](batch).pow(2).mean()
        total = loss.detach().clone()
        dist.all_reduce(total, group=_live(mpu.get_pipeline_model_parallel_group(), "train"))
        loss.backward()
        for p in model[0].parameters():
            dist.all_reduce(p.grad, group=_live(mpu.get_data_parallel_group(), "train"))
        optimizer.step()
        optimizer.zero_grad()
        RECORD["trained"].append(model_checksum(model))

    def save(rollout_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
        SAVER.touch()
        dist.barrier(group=_live(mpu.get_pipeline_model_parallel_group(), "save"))
        RECORD["saved"].append(model_checksum(model))

    class DataIterator:
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def reset(self) -> None:
            pass

    def named_params_and_buffers(args: Any, model: Any, convert_to_global_name: bool = True) -> Iterator[Any]:
        for index, chunk in enumerate(model):
            for name, tensor in chunk.named_parameters():
                yield f"{index}.{name}", tensor

    def create_weight_updater(args: Any, model: Any, **kwargs: Any) -> UpdateWeightFromTensor:
        return UpdateWeightFromTensor(args, model, **kwargs)

    _module(
        f"{base}.initialize", init=initialize_megatron_groups, is_megatron_main_rank=is_megatron_main_rank
    )
    _module(
        f"{base}.model",
        initialize_model_and_optimizer=initialize_model_and_optimizer,
        train=train,
        save=save,
        forward_only=lambda *a, **k: {},
    )
    _module(f"{base}.checkpoint", load_checkpoint=lambda *a, **k: (0, 0))
    _module(
        f"{base}.cp_utils",
        prepare_routed_experts_for_routing_replay=lambda experts, *a, **k: experts,
        slice_log_prob_with_cp=lambda log_prob, *a, **k: log_prob,
    )
    _module(f"{base}.data", DataIterator=DataIterator, get_data_iterator=lambda data: [DataIterator(data)])
    _module(f"{base}.hf_checkpoint_saver", save_hf_model_to_path=lambda *a, **k: None)
    _module(
        f"{base}.loss",
        compute_advantages_and_returns=lambda args, data: None,
        drain_captured_log_probs=lambda: {},
        enable_log_prob_capture=lambda: None,
        get_log_probs_and_entropy=lambda *a, **k: {},
        get_values=lambda *a, **k: {},
    )
    weights = f"{base}.update_weight"
    _module(weights, __path__=[], create_weight_updater=create_weight_updater)
    _module(f"{weights}.common", named_params_and_buffers=named_params_and_buffers)


def _vime_stand_ins() -> None:
    class RoutingReplay:
        all_routing_replays: ClassVar[list[Any]] = []

        @staticmethod
        def clear_all() -> None:
            pass

    marker = type("Ref", (), {})
    _module("vime.data.tensor", TensorRef=marker, DiskTensorRef=type("DiskRef", (), {}))
    _module("vime.utils.accelerator", **_accelerator())
    _module("vime.utils.misc", Box=Box, SingletonMeta=SingletonMeta, load_function=lambda path: None)
    _module("vime.utils.eval_config", EvalDatasetConfig=type("EvalDatasetConfig", (), {}))
    _module("vime.utils.logging_utils", configure_logger=lambda *a, **k: None)
    _module("vime.utils.common", is_npu=lambda: False)
    _module("vime.utils.types", RolloutBatch=dict)
    _module("vime.utils.routing_replay", RoutingReplay=RoutingReplay)
    _module(
        "vime.utils.routed_experts",
        RoutedExpertsLayerRef=marker,
        RoutedExpertsMicrobatch=marker,
        RoutedExpertsMicrobatchPrefetcher=marker,
    )
    _module("vime.utils.http_utils", is_port_available=port_free)
    _module("vime.utils.data", process_rollout_data=lambda ref, rank, size: dict(ref.inner))
    _module("vime.ray.ray_actor", RayActor=RayActor)
    _module(
        "vime.ray.utils", NOSET_VISIBLE_DEVICES_ENV_VARS_LIST=["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
    )
    profiler = type(
        "TrainProfiler",
        (),
        {
            "__init__": lambda self, args: None,
            "on_init_end": lambda self: None,
            "step": lambda self, **k: None,
        },
    )
    _module("vime.observability.profile_utils", TrainProfiler=profiler)
    _module("vime.observability.logging_utils", init_tracking=lambda *a, **k: None)
    _module("vime.observability.train_data_utils", save_debug_train_data=lambda *a, **k: None)

    def log_perf_data(rollout_id: int, args: Any, extra_metrics: Any = None) -> None:
        from vime.observability.timer import Timer

        timers = dict(Timer().log_dict())
        RECORD.setdefault("tracked", []).append({f"perf/{k}_time": v for k, v in timers.items()})
        Timer().reset()

    _module(
        "vime.observability.train_metric_utils",
        log_rollout_data=lambda *a, **k: None,
        log_perf_data=log_perf_data,
    )
    for name in ("train_data_utils", "train_metric_utils"):
        setattr(sys.modules["vime.observability"], name, sys.modules[f"vime.observability.{name}"])
    sys.modules["vime.utils"].accelerator = sys.modules["vime.utils.accelerator"]


def install(source: VimeSource) -> types.ModuleType:
    """Make `import vime...` resolve to vime's source files (stand-ins for the heavy internals); returns the actor module."""
    tms_utils = importlib.import_module("torch_memory_saver.utils")  # the real one: it locates the .so files
    for name in PACKAGES:
        _module(name, __path__=[])
    _module(
        "torch_memory_saver",
        torch_memory_saver=SAVER,
        utils=tms_utils,
        __file__=str(Path(tms_utils.__file__).with_name("__init__.py")),
    )
    sys.modules["torch_memory_saver.utils"] = tms_utils
    config = types.SimpleNamespace(vocab_size=32, quantization_config=None)
    _module(
        "transformers",
        AutoConfig=types.SimpleNamespace(from_pretrained=lambda *a, **k: config),
        AutoTokenizer=types.SimpleNamespace(
            from_pretrained=lambda *a, **k: types.SimpleNamespace(vocab_size=32)
        ),
    )
    ray_stand_in(_LocalActorClass, kill=lambda actor, no_restart=True: None, is_initialized=lambda: False)
    _vime_stand_ins()
    _megatron_stand_ins()
    for path in REAL_MODULES:
        name = path.removesuffix(".py").replace("/", ".")
        module = _module(name, __package__=name.rpartition(".")[0])
        module.__file__ = f"<vime {source.commit_of(path)[:8]}>/{path}"
        exec(compile(source.read(path), module.__file__, "exec"), module.__dict__)
        if name == "vime.utils.memory_utils":
            _count_stack_resets(module)
        if name == "vime.utils.reloadable_process_group":
            # gloo plays NCCL on CPU: vime's rule for which WORLD goes down on sleep, for this backend.
            module._uses_nccl = lambda backend: "gloo" in backend.lower()
    for name in ("vime.utils.memory_utils", "vime.utils.tensor_backper", "vime.ray.train_actor"):
        sys.modules[name].torch = CpuTorch()
    return sys.modules["vime.backends.megatron_utils.actor"]


def _count_stack_resets(module: types.ModuleType) -> None:
    """vime's own `reset_cuda_stack_size` runs (it returns at once without CUDA); each call recorded."""
    own = module.reset_cuda_stack_size

    def reset_cuda_stack_size() -> None:
        RECORD["stack_resets"].append(SAVER.pause_count)
        own()

    module.reset_cuda_stack_size = reset_cuda_stack_size


def fresh_process_state() -> None:
    """Between two actors in one process: what a new Ray worker process would start without."""
    from megatron.core import parallel_state as mpu

    if dist.is_initialized():
        dist.destroy_process_group()
    mpu.destroy_model_parallel()
    groups = sys.modules["vime.utils.reloadable_process_group"]
    groups.ReloadableProcessGroup.GROUPS.clear()
    groups.default_process_group_states.clear()
    sys.modules["vime.utils.distributed_utils"].GLOO_GROUP = None
    SingletonMeta.clear_all_instances()
    SAVER.paused = dict.fromkeys(SAVER.tags, False)
    SAVER.pause_count = SAVER.resume_count = 0
    for values in RECORD.values():
        values.clear()


def rollout(step: int) -> Box:
    tokens = torch.arange(8) + step
    return Box(
        {
            "tokens": [tokens],
            "loss_masks": [torch.ones(8)],
            "total_lengths": [8],
            "response_lengths": [4],
            "num_microbatches": [1],
            "global_batch_sizes": [1],
        }
    )


def launcher_env() -> dict[str, str]:
    """What vime's RayTrainGroup puts in an offloaded megatron actor's environment."""
    from actor_integration.backends.tms_env import preload_library

    return {"LD_PRELOAD": preload_library(13), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}


def group_counts() -> dict[str, int]:
    from tests.helpers.framework_source import group_counts as counts

    return counts("vime")

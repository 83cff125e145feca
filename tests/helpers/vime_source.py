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
    port_free,
    ray_stand_in,
    stand_in_module,
)
from tests.helpers.slime_source import (
    LocalActorClass,
    NoPinnedTorch,
    checksum,
    cpu_device,
    live,
    megatron_stand_ins,
    rollout_data,
    saver_stand_in,
    slime_args,
    transformers_stand_in,
)
from tests.helpers.slime_source import RolloutManager as SlimeRolloutManager

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


# ---------------------------------------------------------------------------------------------- stand-ins

_module = stand_in_module


class _CpuC:
    """torch._C without the CUDA host allocator a CPU build lacks (vime's clear_memory empties it)."""

    @staticmethod
    def _host_emptyCache() -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch._C, name)


class CpuTorch(NoPinnedTorch):
    """torch for vime's modules on CPU: no pinned host memory, no CUDA device to select or host cache to empty."""

    cuda = types.SimpleNamespace(
        set_device=lambda device: None, is_initialized=lambda: False, synchronize=lambda: None
    )
    _C = _CpuC()


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


class _LocalActorClass(LocalActorClass):
    """slime's local Ray actors, recorded in vime's RECORD."""

    record = RECORD


class RolloutManager(SlimeRolloutManager):
    """The rollout manager's calls vime's update_weights makes: one colocated engine over the whole world."""

    record = RECORD

    @staticmethod
    def colocated_engines() -> list[Any]:
        return [FakeVLLMEngine()]


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

        gloo = live(get_gloo_group(), "sync")
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
    def create_weight_updater(args: Any, model: Any, **kwargs: Any) -> UpdateWeightFromTensor:
        return UpdateWeightFromTensor(args, model, **kwargs)

    weights = "vime.backends.megatron_utils.update_weight"
    _module(weights, __path__=[], create_weight_updater=create_weight_updater)
    megatron_stand_ins("vime", SAVER, RECORD)


def _vime_stand_ins() -> None:
    class RoutingReplay:
        all_routing_replays: ClassVar[list[Any]] = []

        @staticmethod
        def clear_all() -> None:
            pass

    marker = type("Ref", (), {})
    _module("vime.data.tensor", TensorRef=marker, DiskTensorRef=type("DiskRef", (), {}))
    _module("vime.utils.accelerator", **cpu_device())
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
    saver_stand_in(SAVER, tms_utils)
    transformers_stand_in()
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
    return Box(rollout_data(step))


def group_counts() -> dict[str, int]:
    from tests.helpers.framework_source import group_counts as counts

    return counts("vime")

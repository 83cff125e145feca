"""miles' real trainer actor, executed from its source at a pinned commit, on CPU (tests only).

`MilesSource.find()` locates miles' source through `RL_LIFECYCLE_MILES_SOURCE` (a miles checkout
or git directory holding commit `RL_LIFECYCLE_MILES_COMMIT`, default `actor_integration.frameworks.miles.MILES_COMMIT`);
nothing of miles is stored in this repository. `install(source)` runs, in the calling process,
miles' own modules that decide the lifecycle (the actor, `TrainRayActor`, its launcher
`allocate_gpus_for_actor`, the reloadable process groups and their torch.distributed patch, the
gloo group, the tensor backuper with its rematerializing variant, replay managers, timers, LoRA
flags) from that source, and stands in for its heavy internals only: the accelerator (CPU, gloo),
Megatron's model, optimizer and training step (a linear layer with fp32 master weights and a
param-sync collective), checkpoint writing, the weight transport, the rollout manager, Ray,
tracking and torch_memory_saver (`MilesMemory`: its tags, `default` alone CPU-backed, a pause
without backup discarding the params, torch_memory_saver's exits raised as `ProtocolViolation`).
`RECORD` holds what the stand-ins saw.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import logging
import math
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from actor_integration.frameworks.miles import MILES_COMMIT
from lifecycle.testing import CallLog, ProtocolViolation
from tests.helpers.framework_source import (
    FrameworkSource,
    SourceUnavailable,
    initialize_megatron_groups,
    port_free,
    ray_stand_in,
    stand_in_module,
)
from tests.helpers.miles_like import MilesMemory
from tests.helpers.slime_source import checksum, model_checksum

SOURCE_ENV = "RL_LIFECYCLE_MILES_SOURCE"
COMMIT_ENV = "RL_LIFECYCLE_MILES_COMMIT"
HOW_TO_RUN = (
    f"set {SOURCE_ENV} to a miles checkout or git directory holding commit {MILES_COMMIT} "
    f"(git clone https://github.com/radixark/miles), e.g. `{SOURCE_ENV}=~/src/miles python -m pytest "
    "tests/actor_integration/frameworks/miles/test_miles_source.py`"
)

# miles' modules run from its source, in dependency order.
REAL_MODULES = (
    "miles/utils/lora.py",
    "miles/utils/misc.py",
    "miles/utils/timer.py",
    "miles/utils/context_utils.py",
    "miles/utils/tracking_utils/structured_log.py",
    "miles/utils/distributed_utils.py",
    "miles/utils/reloadable_process_group.py",
    "miles/utils/tensor_backper.py",
    "miles/utils/replay_base.py",
    "miles/utils/environ.py",
    "miles/ray/ray_actor.py",
    "miles/ray/utils.py",
    "miles/ray/train_actor.py",
    "miles/backends/megatron_utils/actor.py",
    "miles/ray/train/actor_factory.py",
)
PACKAGES = (
    "miles",
    "miles.utils",
    "miles.utils.tracking_utils",
    "miles.utils.audit_utils",
    "miles.utils.audit_utils.event_logger",
    "miles.utils.audit_utils.witness",
    "miles.utils.ft_utils",
    "miles.utils.test_utils",
    "miles.ray",
    "miles.ray.train",
    "miles.dashboard",
    "miles.backends",
    "miles.backends.training_utils",
    "miles.backends.megatron_utils",
    "miles.backends.megatron_utils.ft",
    "miles.backends.megatron_utils.update_weight",
    "miles.backends.megatron_utils.update_weight.update_weight_from_distributed",
)
ACTOR_MODULE = "miles.backends.megatron_utils.actor"


class MilesSourceUnavailable(SourceUnavailable):
    """miles' source is not reachable here (CI has no network): the suite skips with HOW_TO_RUN."""


@dataclass(frozen=True)
class MilesSource(FrameworkSource):
    SOURCE_ENV = SOURCE_ENV
    COMMIT_ENV = COMMIT_ENV
    DEFAULT_COMMIT = MILES_COMMIT
    HOW_TO_RUN = HOW_TO_RUN
    PROBE = ACTOR_MODULE.replace(".", "/") + ".py"
    UNAVAILABLE = MilesSourceUnavailable


# ---------------------------------------------------------------------------------------------- records

RECORD: dict[str, list[Any]] = {
    "trained": [],
    "saved": [],
    "engine": [],
    "connected": [],
    "ray_actors": [],
    "cpu_memory": [],  # (rollout_id, label) of each `log_cpu_memory` call: miles logs perf/cpu_memory_<label>_gb
}
CALLS = CallLog()
SAVER = MilesMemory(log=CALLS)  # miles' launcher: preload, TMS_INIT_ENABLE=1, default CPU-backed
_STATE: dict[str, Any] = {"params_tag": "param_buffer"}


def _live(group: Any, what: str) -> Any:
    """A miles-wrapped group's live torch group; a collective on a destroyed one is what the real one fails on."""
    if getattr(group, "group", group) is None:
        raise ProtocolViolation(f"{what}: collective on destroyed process groups")
    return group


def params_tag() -> str:
    """Where the params live: Megatron's param buffer; with LoRA rollout the base weights are "default"."""
    return str(_STATE["params_tag"])


# ---------------------------------------------------------------------------------------------- stand-ins


_module = stand_in_module


class _LocalActorClass:
    """`ray.remote(**options)(cls)` run in this process: `.options(...).remote(*args)` builds the actor here,
    with the runtime_env's env_vars put into os.environ first, as Ray does for an actor's process."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self.cls, self.options_given = cls, options

    def options(self, **more: Any) -> _LocalActorClass:
        return _LocalActorClass(self.cls, {**self.options_given, **more})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        env = self.options_given.get("runtime_env", {}).get("env_vars", {})
        os.environ.update(env)
        RECORD["ray_actors"].append({"cls": self.cls.__name__, "env_vars": dict(env)})
        instance = self.cls(*args, **kwargs)
        return types.SimpleNamespace(
            instance=instance,
            **{
                name: types.SimpleNamespace(remote=getattr(instance, name))
                for name in ("get_master_addr_and_port", "init")
            },
        )


def _ray() -> None:
    ray_stand_in(_LocalActorClass, put=lambda value: value)


class RolloutManager:
    """The rollout manager's calls miles' actor makes, answered in this process."""

    def __init__(self) -> None:
        for name in ("clear_updatable_has_new_engines", "set_weight_version", "set_train_parallel_config"):
            setattr(self, name, types.SimpleNamespace(remote=getattr(self, f"_{name}")))

    def _clear_updatable_has_new_engines(self) -> None:
        RECORD.setdefault("cleared_new_engines", []).append(True)

    def _set_weight_version(self, version: int) -> None:
        RECORD.setdefault("weight_versions", []).append(version)

    def _set_train_parallel_config(self, config: dict[str, Any]) -> None:
        RECORD.setdefault("parallel_config", []).append(config)


def engines_and_lock(new_engines: bool = True) -> types.SimpleNamespace:
    """What `RolloutManager.get_updatable_engines_and_lock` hands `update_weights(info)`."""
    return types.SimpleNamespace(
        rollout_engines=["engine0"],
        rollout_engine_lock="lock",
        has_new_engines=new_engines,
        engine_gpu_counts=[dist.get_world_size()],
        engine_gpu_offsets=[0],
    )


class UpdateWeightFromTensor:
    """miles' colocated weight sender, reduced to what the lifecycle must guarantee around it."""

    def __init__(self, args: Any, model: Any, weights_getter: Any, **kwargs: Any) -> None:
        self.weights_getter = weights_getter
        self.weight_version = 0
        self.fresh = False
        self.multi_lora_adapters: Any = None

    def is_rollout_engines_fresh(self) -> bool:
        return self.fresh

    def connect_rollout_engines(self, engines: Any, lock: Any, **kwargs: Any) -> None:
        RECORD["connected"].append(list(engines))
        self.fresh = True

    def mark_engine_connection_stale(self) -> None:
        self.fresh = False

    def update_weights(self) -> None:
        if SAVER.active:
            # slime #2188: buckets allocated as saver memory cannot be exported over CUDA IPC.
            raise ProtocolViolation("update_weights ran with the memory saver active: CUDA IPC export fails")
        from miles.utils.distributed_utils import get_gloo_group

        sums: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sums, checksum(self.weights_getter()), group=_live(get_gloo_group(), "sync"))
        self.weight_version += 1
        RECORD["engine"].append({"version": self.weight_version, "checksum": sums[dist.get_rank()]})

    def pop_metrics(self) -> dict[str, Any]:
        return {}


class ModelChunk(torch.nn.Module):
    """A DDP-wrapped model chunk as miles touches it: params in Megatron's param buffer, and the
    param sync (an all-gather over the data-parallel group) the rematerializing restore starts."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]

    def start_param_sync(self, force_sync: bool = False) -> None:
        from megatron.core import parallel_state as mpu

        SAVER.touch(params_tag())
        dist.barrier(group=_live(mpu.get_data_parallel_group(), "param sync"))


class MasterWeightOptimizer:
    """Megatron's distributed optimizer as the lifecycle sees it: fp32 master weights in "default"
    (CPU-backed), stepped, then cast into the params (`_copy_main_params_to_model_params`)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        self.params, self.lr = params, lr
        self.main = [p.detach().clone() for p in params]

    def step(self) -> None:
        SAVER.touch("default")
        for main, param in zip(self.main, self.params, strict=True):
            main -= self.lr * param.grad.detach()
        self.copy_main_to_params()

    def copy_main_to_params(self) -> None:
        SAVER.touch("default")
        SAVER.touch(params_tag())
        with torch.no_grad():
            for main, param in zip(self.main, self.params, strict=True):
                param.copy_(main)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


class TrainStepOutcome(enum.Enum):
    NORMAL = "normal"
    DISCARDED_SHOULD_RETRY = "discarded_should_retry"


def _megatron_stand_ins() -> None:
    from megatron.core import parallel_state as mpu

    base = "miles.backends.megatron_utils"

    def init(args: Any, **kwargs: Any) -> None:
        initialize_megatron_groups(args)

    def is_first_replica_megatron_main_rank() -> bool:
        return mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1

    def get_parallel_state() -> Any:
        return types.SimpleNamespace(
            intra_dp=types.SimpleNamespace(size=mpu.get_data_parallel_world_size()),
            cp=types.SimpleNamespace(size=1, group=None, rank=0),
            vpp_size=None,
            microbatch_group_size_per_vp_stage=None,
            is_pp_last_stage=is_first_replica_megatron_main_rank(),
            indep_dp=None,
        )

    def initialize_model_and_optimizer(args: Any, role: str, **kwargs: Any) -> tuple[Any, ...]:
        from miles.utils.lora import lora_rollout_enabled

        _STATE["params_tag"] = "default" if lora_rollout_enabled(args) else "param_buffer"
        model = [ModelChunk()]
        params = list(model[0].parameters())

        def discard(tag: str) -> None:  # a pause of a tag without CPU backup loses what it held
            if tag == params_tag():
                with torch.no_grad():
                    for param in params:
                        param.fill_(math.nan)

        SAVER.on_discard[:] = [discard]
        return model, MasterWeightOptimizer(params), types.SimpleNamespace(), -1

    def train(
        rollout_id: int, model: Any, optimizer: Any, scheduler: Any, data_iterator: Any, *rest: Any, **kw: Any
    ) -> Any:
        SAVER.touch()  # forward, backward and the optimizer step read every tag
        batch = data_iterator[0].data["tokens"][0].float().reshape(-1, 4)
        loss = model[0](batch).pow(2).mean()
        # The pipeline's activations and the gradient reduction: collectives on miles' wrapped groups.
        total = loss.detach().clone()
        dist.all_reduce(total, group=_live(mpu.get_pipeline_model_parallel_group(), "train"))
        loss.backward()
        for p in model[0].parameters():
            dist.all_reduce(p.grad, group=_live(mpu.get_data_parallel_group(), "train"))
        optimizer.step()
        optimizer.zero_grad()
        RECORD["trained"].append(model_checksum(model))
        return TrainStepOutcome.NORMAL

    def forward_only(*args: Any, **kwargs: Any) -> dict[str, Any]:
        SAVER.touch()  # the log-prob forward reads the model
        return {}

    def save(rollout_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
        SAVER.touch("default")  # the checkpoint reads the optimizer state...
        SAVER.touch(params_tag())  # ...and the params...
        dist.barrier(group=_live(mpu.get_pipeline_model_parallel_group(), "save"))  # ...and communicates
        RECORD["saved"].append(model_checksum(model))

    class DataIterator:
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def reset(self) -> None:
            pass

    def named_params_and_buffers(args: Any, model: Any, convert_to_global_name: bool = True) -> Iterator[Any]:
        SAVER.touch(params_tag())  # whoever iterates them reads or writes the params on the device
        for index, chunk in enumerate(model):
            for name, tensor in chunk.named_parameters():
                yield f"{index}.{name}", tensor

    def build_main_cast_context(args: Any, *, model: Any, optimizer: Any) -> Any:
        from miles.utils.tensor_backper import MainCastContext

        return MainCastContext(
            cast_main_to_params=optimizer.copy_main_to_params,
            model_chunks=model,
            extras_getter=lambda: iter(()),  # every param has a master weight
            rematerializable_ids={id(p) for chunk in model for p in chunk.parameters()},
            check=False,
        )

    noop = lambda *a, **k: None  # noqa: E731
    training = "miles.backends.training_utils"
    _module(
        f"{base}.initialize",
        init=init,
        is_first_replica_megatron_main_rank=is_first_replica_megatron_main_rank,
    )
    _module(f"{training}.parallel", get_parallel_state=get_parallel_state)
    _module(
        f"{base}.model",
        TrainStepOutcome=TrainStepOutcome,
        forward_only=forward_only,
        initialize_model_and_optimizer=initialize_model_and_optimizer,
        save=save,
        train=train,
    )
    _module(
        f"{training}.data",
        DataIterator=DataIterator,
        get_data_iterator=lambda args, model, data: ([DataIterator(data)], [1]),
        get_num_rollouts=lambda args, data, n: 1,
        get_rollout_data=lambda args, ref, witness_info=None: (dict(ref.inner), contextlib.nullcontext()),
    )

    def log_cpu_memory(rollout_id: int, args: Any, label: str) -> None:
        RECORD["cpu_memory"].append((rollout_id, label))

    _module(f"{training}.log_utils", log_cpu_memory=log_cpu_memory, log_perf_data=noop, log_rollout_data=noop)
    _module(
        f"{training}.loss",
        compute_advantages_and_returns=noop,
        get_log_probs_and_entropy=noop,
        get_values=noop,
        log_train_advantage_computation_event=noop,
    )
    _module(f"{training}.replay_data", fill_replay_data=noop, register_replay_list_sequential=noop)
    _module(f"{base}.rematerialize_utils", build_main_cast_context=build_main_cast_context)
    # miles' lora_utils re-exports miles.utils.lora's flags (run from miles' source below).
    _module(
        f"{base}.lora_utils",
        is_lora_enabled=lambda args: sys.modules["miles.utils.lora"].is_lora_enabled(args),
        lora_rollout_enabled=lambda args: sys.modules["miles.utils.lora"].lora_rollout_enabled(args),
    )
    _module(f"{base}.checkpoint", load_checkpoint=lambda *a, **k: (0, 0))
    _module(f"{base}.ft.checkpoint_transfer", recv_ckpt=noop, send_ckpt=noop)
    _module(
        f"{base}.ft.in_memory_checkpoint", InMemoryCheckpointManager=type("InMemoryCheckpointManager", (), {})
    )
    _module(f"{base}.ft.indep_dp", reconfigure_indep_dp_group=noop)
    _module(f"{base}.parallel", verify_megatron_parallel_state=noop)
    _module(f"{base}.replay_utils", register_replay_list_moe=noop)
    weights = f"{base}.update_weight"
    _module(f"{weights}.common", named_params_and_buffers=named_params_and_buffers)
    _module(f"{weights}.update_weight_from_tensor", UpdateWeightFromTensor=UpdateWeightFromTensor)
    _module(
        f"{weights}.update_weight_from_distributed.broadcast",
        UpdateWeightFromDistributed=type("UpdateWeightFromDistributed", (), {}),
    )
    _module(f"{weights}.update_weight_from_distributed.p2p", UpdateWeightP2P=type("UpdateWeightP2P", (), {}))


def _miles_stand_ins() -> None:
    noop = lambda *a, **k: None  # noqa: E731
    info = {"free_GB": 64.0, "total_GB": 80.0}

    class Box:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        @property
        def inner(self) -> Any:
            return self._inner

    class Heartbeat:
        def bump(self) -> None:
            pass

        def status(self) -> str:
            return "alive"

    @contextlib.contextmanager
    def inplace_modify_args(args: Any, overrides: dict[str, Any]) -> Iterator[None]:
        yield

    _module("miles.utils.http_utils", is_port_available=port_free)
    _module(
        "miles.utils.memory_utils",
        clear_memory=lambda clear_host_memory=False: None,
        available_memory=lambda: dict(info),
        print_memory=lambda msg, clear_before_print=False: dict(info),
    )
    _module("miles.utils.ft_utils.process_group_utils", GeneralPGUtil=type("GeneralPGUtil", (), {}))
    _module("miles.utils.ft_utils.heartbeat_utils", HeartbeatStatus=str, SimpleHeartbeat=Heartbeat)
    _module("miles.utils.ft_utils.indep_dp", IndepDPInfo=types.SimpleNamespace)
    _module("miles.utils.eval_config", EvalDatasetConfig=type("EvalDatasetConfig", (), {}))
    _module("miles.utils.object_store", init_instance=noop)
    _module("miles.utils.audit_utils.process_identity", TrainProcessIdentity=types.SimpleNamespace)
    _module("miles.utils.audit_utils.event_logger.logger", event_logger_context=lambda fields: lambda fn: fn)
    _module("miles.utils.audit_utils.witness.allocator", WitnessInfo=type("WitnessInfo", (), {}))
    _module("miles.utils.env_report", collect_and_print_node_env_report=noop)
    _module("miles.utils.logging_utils", configure_logger=noop)
    _module(
        "miles.utils.test_utils.det_process_group",
        DET_NCCL_BACKEND_NAME="det_nccl",
        register_det_nccl_backend=noop,
    )
    _module("miles.utils.test_utils.fault_injector", inject_fault=noop)
    _module(
        "miles.utils.test_utils.ft_test_actions",
        FTTestActionActorExecutor=types.SimpleNamespace(from_args=lambda args, **kw: None),
    )
    _module("miles.dashboard.hooks", register_train_actor=noop)
    _module("miles.utils.train_dump_utils", save_debug_train_data=noop)
    _module("miles.utils.argparse_utils", inplace_modify_args=inplace_modify_args)
    _module(
        "miles.utils.hf_config", load_hf_config=lambda path: types.SimpleNamespace(quantization_config=None)
    )
    _module("miles.utils.multi_lora", is_multi_lora_enabled=lambda args: False)
    _module(
        "miles.utils.processing_utils", load_tokenizer=lambda *a, **k: types.SimpleNamespace(vocab_size=32)
    )
    _module("miles.utils.ray_utils", Box=Box)
    _module("miles.utils.types", RolloutBatch=dict)
    _module("miles.utils.tracking_utils.tracking", init_tracking=noop)
    profiler = type(
        "TrainProfiler",
        (),
        {
            "__init__": lambda self, args: None,
            "on_init_end": lambda self: None,
            "step": lambda self, rollout_id=None: None,
        },
    )
    _module("miles.utils.profile_utils", TrainProfiler=profiler)


class _CpuTorch:
    """torch for miles' modules on CPU: no device to select or synchronise, no pinned host allocator."""

    cuda = types.SimpleNamespace(
        set_device=lambda device: None,
        synchronize=lambda *a, **k: None,
        current_device=lambda: torch.device("cpu"),
        is_available=lambda: False,
    )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return torch.empty_like(tensor, **kwargs)


def install(source: MilesSource) -> types.ModuleType:
    """Make `import miles...` resolve to miles' source (stand-ins for the heavy internals); returns the actor module."""
    tms_utils = importlib.import_module("torch_memory_saver.utils")  # the real one: it locates the .so files
    # miles logs every failing call with its traceback; the tests read the failures themselves.
    logging.getLogger("miles").setLevel(logging.CRITICAL)
    for name in PACKAGES:
        _module(name, __path__=[])
    _module("torch_memory_saver", torch_memory_saver=SAVER, utils=tms_utils)
    sys.modules["torch_memory_saver.utils"] = tms_utils
    _ray()
    _miles_stand_ins()
    _megatron_stand_ins()  # imports megatron.core, which sets hook_mode="torch" on the saver
    for path in REAL_MODULES:
        name = path.removesuffix(".py").replace("/", ".")
        module = _module(
            name, __file__=f"<miles {source.commit}>/{path}", __package__=name.rpartition(".")[0]
        )
        exec(compile(source.read(path), module.__file__, "exec"), module.__dict__)
    for name in ("miles.utils.tensor_backper", "miles.ray.train_actor", "miles.utils.environ"):
        sys.modules[name].torch = _CpuTorch()
    return sys.modules[ACTOR_MODULE]


def fresh_process_state() -> None:
    """Between two actors in one process: what a new Ray worker process would start without."""
    from megatron.core import parallel_state as mpu

    if dist.is_initialized():
        dist.destroy_process_group()
    mpu.destroy_model_parallel()
    sys.modules["miles.utils.distributed_utils"].GLOO_GROUP = None
    sys.modules["miles.utils.reloadable_process_group"].ReloadableProcessGroup.GROUPS.clear()
    sys.modules["miles.utils.misc"].SingletonMeta.clear_all_instances()  # miles' Timer
    SAVER.paused = dict.fromkeys(SAVER.tags, False)
    SAVER.pause_count = SAVER.resume_count = 0
    SAVER._impl = None
    SAVER.hook_mode = "torch"  # what importing megatron.core left pending
    CALLS.clear()
    for values in RECORD.values():
        values.clear()

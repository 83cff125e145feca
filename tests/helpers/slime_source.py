"""slime's real trainer actor, executed from its source at a pinned commit, on CPU (tests only).

`SlimeSource.find()` locates slime's source through `RL_LIFECYCLE_SLIME_SOURCE` (a slime checkout
or git directory holding commit `RL_LIFECYCLE_SLIME_COMMIT`, default `actor_integration.frameworks.slime.SLIME_COMMIT`);
nothing of slime is stored in this repository. `install(source)` runs, in the calling process,
slime's own modules that decide the lifecycle (the actor, `TrainRayActor`, `RayTrainGroup`, the
reloadable process groups, the gloo group, the tensor backuper, routing replay, timers) from that
source, and stands in for its heavy internals only: the accelerator (CPU plays the device and
gloo the accelerator backend, so slime takes its production path of destroying WORLD), Megatron's
model/optimizer/training step, checkpoint writing, the weight transport, the rollout manager,
Ray, transformers and torch_memory_saver (`lifecycle.testing.FakeMemorySaver`, which raises and
asserts where the real one exits or asserts). `RECORD` holds what the stand-ins saw.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from actor_integration.frameworks.slime import SLIME_COMMIT
from lifecycle.testing import FakeMemorySaver, ProtocolViolation
from tests.helpers.framework_source import (
    FrameworkSource,
    SourceUnavailable,
    initialize_megatron_groups,
    port_free,
    ray_stand_in,
    stand_in_module,
)

SOURCE_ENV = "RL_LIFECYCLE_SLIME_SOURCE"
COMMIT_ENV = "RL_LIFECYCLE_SLIME_COMMIT"
HOW_TO_RUN = (
    f"set {SOURCE_ENV} to a slime checkout or git directory holding commit {SLIME_COMMIT} "
    f"(git clone https://github.com/THUDM/slime), e.g. `{SOURCE_ENV}=~/src/slime python -m pytest "
    "tests/actor_integration/frameworks/slime/test_slime_source.py`"
)

# slime's modules run from its source, in dependency order.
REAL_MODULES = (
    "slime/utils/misc.py",
    "slime/utils/eval_config.py",
    "slime/utils/types.py",
    "slime/utils/distributed_utils.py",
    "slime/utils/reloadable_process_group.py",
    "slime/utils/tensor_backper.py",
    "slime/utils/routing_replay.py",
    "slime/observability/timer.py",
    "slime/observability/metric_utils.py",
    "slime/observability/train_metric_utils.py",
    "slime/ray/ray_actor.py",
    "slime/ray/utils.py",
    "slime/ray/train_actor.py",
    "slime/ray/actor_group.py",
    "slime/backends/megatron_utils/actor.py",
)
# On a CUDA machine slime's own accelerator and memory helpers run too (the package first, its
# submodules in dependency order, its __init__ last).
CUDA_MODULES = (
    "slime/utils/accelerator/base.py",
    "slime/utils/accelerator/torch_accelerator.py",
    "slime/utils/accelerator/cuda.py",
    "slime/utils/accelerator/musa.py",
    "slime/utils/accelerator/__init__.py",
    "slime/utils/memory_utils.py",
)
PACKAGES = (
    "slime",
    "slime.utils",
    "slime.ray",
    "slime.observability",
    "slime.backends",
    "slime.backends.megatron_utils",
    "slime.backends.megatron_utils.update_weight",
)


class SlimeSourceUnavailable(SourceUnavailable):
    """slime's source is not reachable here (CI has no network): the suite skips with HOW_TO_RUN."""


@dataclass(frozen=True)
class SlimeSource(FrameworkSource):
    SOURCE_ENV = SOURCE_ENV
    COMMIT_ENV = COMMIT_ENV
    DEFAULT_COMMIT = SLIME_COMMIT
    HOW_TO_RUN = HOW_TO_RUN
    PROBE = "slime/backends/megatron_utils/actor.py"
    UNAVAILABLE = SlimeSourceUnavailable

    def export_tree(self, destination: Path) -> SlimeSource:
        """The modules `install` runs, as plain files, for a machine without git or network."""
        exported: SlimeSource = self.export(destination, (*REAL_MODULES, *CUDA_MODULES))
        return exported


def slime_args(world_size: int, *, absent: Iterable[str] = (), **overrides: Any) -> argparse.Namespace:
    """slime's parsed flags for a colocated, offloaded actor (only what the code paths read).

    A fork's flags are slime's with its differences: `overrides` its own values and flags, `absent`
    slime's flags its parser lacks (a fork's code asks `hasattr(args, ...)`: one it lacks must be absent).
    """
    args = argparse.Namespace(
        debug_rollout_only=False,
        debug_train_only=False,
        distributed_backend="nccl",
        distributed_timeout_minutes=1,
        num_gpus_per_node=world_size,
        hf_checkpoint="unused",
        offload_train=True,
        colocate=True,
        use_critic=False,
        release_train=False,
        keep_old_actor=False,
        update_weights_interval=1,
        vocab_size=None,
        update_weight_mode="full",
        update_weight_transport="cuda_ipc",
        model_name=None,
        update_weight_start_version=0,
        rollout_data_postprocess_path=None,
        use_routing_replay=True,
        use_rollout_routing_replay=False,
        compute_advantages_and_returns=True,
        loss_type="policy_loss",
        kl_coef=0.0,
        use_rollout_logprobs=False,
        get_mismatch_metrics=False,
        use_opd=False,
        advantage_estimator="grpo",
        save_debug_train_data=None,
        ref_update_interval=None,
        async_save=False,
        save_hf=None,
        use_fault_tolerance=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=world_size,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        seed=1234,
        train_env_vars={},
        train_backend="megatron",
        ci_test=False,
        wandb_always_use_train_step=False,
        use_wandb=False,
        use_tensorboard=False,
    )
    vars(args).update(overrides)
    for name in absent:
        delattr(args, name)
    return args


# ---------------------------------------------------------------------------------------------- records

RECORD: dict[str, list[Any]] = {"trained": [], "saved": [], "engine": [], "connected": []}
SAVER = FakeMemorySaver(init_enable=True)  # slime's launcher: preload + TMS_INIT_ENABLE=1


def checksum(tensors: Any) -> float:
    """A float that changes with every weight: sum of value x position over all tensors, in name order."""
    items = sorted(dict(tensors).items())
    total = 0.0
    for _, t in items:
        flat = t.detach().float().flatten()
        total += float((flat * torch.arange(1, flat.numel() + 1)).sum())
    return round(total, 6)


def model_checksum(model: list[torch.nn.Module]) -> float:
    return checksum((f"{i}.{n}", p) for i, chunk in enumerate(model) for n, p in chunk.named_parameters())


def live(group: Any, what: str) -> Any:
    """A slime-wrapped group's live torch group; a collective on a destroyed one is what the real one fails on."""
    inner = getattr(group, "group", group)
    if inner is None:
        raise ProtocolViolation(f"{what}: collective on a destroyed process group")
    return group


def rollout_data(step: int) -> dict[str, Any]:
    """One step's rollout as slime's trainer reads it (`process_rollout_data`'s keys)."""
    return {
        "tokens": [torch.arange(8) + step],
        "loss_masks": [torch.ones(8)],
        "total_lengths": [8],
        "response_lengths": [4],
        "num_microbatches": [1],
        "global_batch_sizes": [1],
    }


def rollout(step: int) -> Any:
    """`rollout_data(step)` in slime's own Box (after `install`), as the rollout manager hands it over."""
    from slime.utils.misc import Box

    return Box(rollout_data(step))


# ---------------------------------------------------------------------------------------------- stand-ins


_module = stand_in_module


def cpu_device() -> dict[str, Any]:
    """What slime's accelerator module (and a fork's) answers about the device in a CPU process."""
    return {
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (64 << 30, 80 << 30),
        "memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
    }


def _accelerator() -> dict[str, Any]:
    # slime.utils.accelerator for a CPU process: gloo plays the accelerator backend.
    return {
        "process_group_backend": lambda backend=None: "gloo",
        "is_accelerator_backend": lambda backend: str(backend) == "gloo",
        "set_device": lambda index: None,
        "set_allocator_expandable_segments": lambda: False,
        **cpu_device(),
        "resolve_visible_device_id": lambda index: int(index),
        "device_type": lambda: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(uuid="cpu"),
    }


def _memory_utils() -> dict[str, Any]:
    info = {"free_GB": 64.0, "total_GB": 80.0}
    return {
        "clear_memory": lambda clear_host_memory=False: None,
        "available_memory": lambda: dict(info),
        "print_memory": lambda msg, clear_before_print=False: dict(info),
    }


class LocalActorClass:
    """`ray.remote(**options)(cls)` run in this process: `.options(...).remote(*args)` builds the actor here.

    The runtime_env's env_vars are put into os.environ first, as Ray does for an actor's process;
    each actor built is recorded in `record["ray_actors"]` (a fork's subclass names its own record).
    """

    record: ClassVar[dict[str, list[Any]]] = RECORD

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self.cls, self.options_given = cls, options
        self.record.setdefault("ray_actors", [])

    def options(self, **more: Any) -> LocalActorClass:
        return type(self)(self.cls, {**self.options_given, **more})

    def remote(self, *args: Any, **kwargs: Any) -> LocalActor:
        env = self.options_given.get("runtime_env", {}).get("env_vars", {})
        os.environ.update(env)
        self.record["ray_actors"].append({"cls": self.cls.__name__, "args": args, "env_vars": dict(env)})
        return LocalActor(self.cls(*args, **kwargs))


class LocalActor:
    def __init__(self, instance: Any) -> None:
        self.instance = instance

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.instance, name)
        return types.SimpleNamespace(remote=method)


def _ray() -> None:
    ray_stand_in(LocalActorClass, kill=lambda actor, no_restart=True: None)


class RolloutManager:
    """The rollout manager's calls slime's update_weights makes, answered in this process: its colocated
    engines (by default one, "engine0") each over the whole world (a fork's subclass names its record)."""

    record: ClassVar[dict[str, list[Any]]] = RECORD

    def __init__(self, engines: list[Any] | None = None) -> None:
        self.engines = engines if engines is not None else self.colocated_engines()
        self.new_engines = 1
        self.snapshot: Any = None
        for name in (
            "get_updatable_engines_and_lock",
            "clear_updatable_num_new_engines",
            "set_train_parallel_config",
            "check_weights",
        ):
            setattr(self, name, types.SimpleNamespace(remote=getattr(self, f"_{name}")))

    @staticmethod
    def colocated_engines() -> list[Any]:
        return ["engine0"]

    def _get_updatable_engines_and_lock(self) -> tuple[Any, ...]:
        # One manager in slime, one per rank here: rank 0 clears the count after the connect, so every
        # rank's next call sees none new.
        count, new, self.new_engines = len(self.engines), self.new_engines, 0
        return (
            self.engines,
            "lock",
            new,
            [dist.get_world_size()] * count,
            [0] * count,
            [{}] * count,
        )

    def _clear_updatable_num_new_engines(self) -> None:
        self.new_engines = 0

    def _set_train_parallel_config(self, config: dict[str, Any]) -> None:
        self.record.setdefault("parallel_config", []).append(config)

    def _check_weights(self, action: str) -> list[Any]:
        """slime's `check_weights(action)` over the engine's `/weights_checker`: the engine holds what the
        last push wrote (`record["engine"]`'s last checksum); a scramble leaves it random."""
        engine = self.record["engine"]
        self.record.setdefault("weights_checker", []).append(action)
        held = engine[-1]["checksum"] if engine else None
        if action == "snapshot":
            self.snapshot = held
        elif action == "reset_tensors":
            engine.append({"version": "reset", "checksum": "random"})
        elif action == "compare":
            if held != self.snapshot:  # SGLang answers 400; slime's _make_request raises with its text
                raise RuntimeError(f"400 Client Error: weights differ: {held!r} != {self.snapshot!r}")
        else:
            raise ValueError(f"Unsupported action={action!r}")
        return [None] * len(self.engines)


class UpdateWeightFromTensor:
    """slime's colocated weight sender, reduced to what the lifecycle must guarantee around it."""

    def __init__(self, args: Any, model: Any, weights_getter: Any, **kwargs: Any) -> None:
        self.weights_getter = weights_getter
        self.weight_version = 0

    def connect_rollout_engines(self, engines: Any, lock: Any, **kwargs: Any) -> None:
        RECORD["connected"].append(list(engines))

    def update_weights(self) -> None:
        if SAVER.active:
            # slime #2188: buckets allocated as saver memory cannot be exported over CUDA IPC.
            raise ProtocolViolation("update_weights ran with the memory saver active: CUDA IPC export fails")
        from slime.utils.distributed_utils import get_gloo_group

        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, checksum(self.weights_getter()), group=live(get_gloo_group(), "sync"))
        self.weight_version += 1
        RECORD["engine"].append({"version": self.weight_version, "checksum": sums[dist.get_rank()]})

    def pop_metrics(self) -> dict[str, Any]:
        return {}


def megatron_stand_ins(framework: str, saver: FakeMemorySaver, record: dict[str, list[Any]]) -> str:
    """Megatron's side of slime's trainer under `framework`'s package (slime's, or a fork's that kept
    slime's megatron_utils): Megatron's groups, a linear model trained and saved with collectives on
    the framework's wrapped groups (each reading `saver`'s memory, each model in `record`), and the
    rest of megatron_utils as no-ops. Returns the name of the package of the weight senders."""
    from megatron.core import parallel_state as mpu

    base = f"{framework}.backends.megatron_utils"

    def init(args: Any) -> None:
        initialize_megatron_groups(args)

    def is_megatron_main_rank() -> bool:
        return mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1

    def initialize_model_and_optimizer(args: Any, role: str) -> tuple[Any, ...]:
        model = [torch.nn.Linear(4, 4)]
        optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
        return model, optimizer, types.SimpleNamespace(), -1

    def train(
        rollout_id: int, model: Any, optimizer: Any, scheduler: Any, data_iterator: Any, *rest: Any
    ) -> None:
        saver.touch()  # forward and backward read the model's memory
        batch = data_iterator[0].data["tokens"][0].float().reshape(-1, 4)
        loss = model[0](batch).pow(2).mean()
        # The pipeline's activations and the gradient reduction: collectives on the wrapped groups.
        total = loss.detach().clone()
        dist.all_reduce(total, group=live(mpu.get_pipeline_model_parallel_group(), "train"))
        loss.backward()
        for p in model[0].parameters():
            dist.all_reduce(p.grad, group=live(mpu.get_data_parallel_group(), "train"))
        optimizer.step()
        optimizer.zero_grad()
        record["trained"].append(model_checksum(model))

    def save(rollout_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
        saver.touch()  # the checkpoint reads the parameters...
        dist.barrier(group=live(mpu.get_pipeline_model_parallel_group(), "save"))  # ...and communicates
        record["saved"].append(model_checksum(model))

    class DataIterator:
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def reset(self) -> None:
            pass

    def named_params_and_buffers(args: Any, model: Any, convert_to_global_name: bool = True) -> Iterator[Any]:
        for index, chunk in enumerate(model):
            for name, tensor in chunk.named_parameters():
                yield f"{index}.{name}", tensor

    _module(f"{base}.initialize", init=init, is_megatron_main_rank=is_megatron_main_rank)
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
    _module(f"{weights}.common", named_params_and_buffers=named_params_and_buffers)
    return weights


def _megatron_stand_ins() -> None:
    weights = megatron_stand_ins("slime", SAVER, RECORD)
    _module(f"{weights}.update_weight_from_tensor", UpdateWeightFromTensor=UpdateWeightFromTensor)
    _module(f"{weights}.update_weight_from_disk", UpdateWeightFromDisk=type("UpdateWeightFromDisk", (), {}))
    _module(
        f"{weights}.update_weight_from_distributed",
        UpdateWeightFromDistributed=type("UpdateWeightFromDistributed", (), {}),
    )


def _observability() -> None:
    profiler = type(
        "TrainProfiler",
        (),
        {
            "__init__": lambda self, args: None,
            "on_init_end": lambda self: None,
            "step": lambda self, rollout_id=None: None,
        },
    )

    def log(args: Any, metrics: dict[str, Any], step_key: str) -> None:
        # slime's tracking entry point (wandb / tensorboard as slime configures them): what reached it.
        RECORD.setdefault("tracked", []).append({"step_key": step_key, **metrics})

    _module(
        "slime.observability.logging_utils",
        init_tracking=lambda *a, **k: None,
        configure_logger=lambda: None,
        log=log,
    )
    _module("slime.observability.profile_utils", TrainProfiler=profiler)
    _module("slime.observability.train_data_utils", save_debug_train_data=lambda *a, **k: None)
    _module("slime.utils.flops_utils", calculate_fwd_flops=lambda seqlens, args: 0.0)


class NoPinnedTorch:
    """torch for slime's TensorBackuper on CPU: no pinned host allocator exists without a device."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return torch.empty_like(tensor, **kwargs)


def saver_stand_in(saver: Any, tms_utils: types.ModuleType) -> None:
    """torch_memory_saver as `saver`, beside its real utils (they locate the preload libraries)."""
    _module(
        "torch_memory_saver",
        torch_memory_saver=saver,
        utils=tms_utils,
        # slime's RayTrainGroup finds the preload library next to the installed package.
        __file__=str(Path(tms_utils.__file__).with_name("__init__.py")),
    )
    sys.modules["torch_memory_saver.utils"] = tms_utils


def transformers_stand_in() -> None:
    """transformers' AutoConfig and AutoTokenizer for the tiny model: 32 tokens, no quantization."""
    config = types.SimpleNamespace(vocab_size=32, quantization_config=None)
    tokenizer = types.SimpleNamespace(vocab_size=32)
    _module(
        "transformers",
        AutoConfig=types.SimpleNamespace(from_pretrained=lambda *a, **k: config),
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda *a, **k: tokenizer),
    )


def install(source: SlimeSource, *, device: str = "cpu", model_and_optimizer: Any = None) -> types.ModuleType:
    """Make `import slime...` resolve to slime's source (stand-ins for the heavy internals); returns the actor module.

    `device="cuda"`: slime's own accelerator and memory helpers and the real torch_memory_saver run
    too (the launcher's preload environment must be set before the process started);
    `model_and_optimizer(args, role)` replaces the tiny model's stand-in.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    cuda = device == "cuda"
    tms_utils = importlib.import_module("torch_memory_saver.utils")  # the real one: it locates the .so files
    for name in PACKAGES:
        _module(name, __path__=[])
    if not cuda:
        saver_stand_in(SAVER, tms_utils)
    transformers_stand_in()
    _ray()
    if not cuda:
        _module("slime.utils.accelerator", **_accelerator())
        _module("slime.utils.memory_utils", **_memory_utils())
    _module("slime.utils.http_utils", is_port_available=port_free)

    def process_rollout_data(args: Any, ref: Any, rank: int, size: int) -> dict[str, Any]:
        from slime.observability.timer import Timer

        Timer().seq_lens = ref.inner["total_lengths"]  # as slime's own does (slime/utils/data.py)
        return dict(ref.inner)

    _module("slime.utils.data", process_rollout_data=process_rollout_data)
    _observability()
    _megatron_stand_ins()
    if model_and_optimizer is not None:
        sys.modules[
            "slime.backends.megatron_utils.model"
        ].initialize_model_and_optimizer = model_and_optimizer
    if cuda:
        _module("slime.utils.accelerator", __path__=[])
    for path in (*CUDA_MODULES, *REAL_MODULES) if cuda else REAL_MODULES:
        name = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        module = sys.modules[name] if name in sys.modules and path.endswith("__init__.py") else None
        if module is None:
            module = _module(name, __package__=package)
        module.__file__ = f"<slime {source.commit}>/{path}"
        module.__package__ = package
        exec(compile(source.read(path), module.__file__, "exec"), module.__dict__)
    if not cuda:
        sys.modules["slime.utils.tensor_backper"].torch = NoPinnedTorch()
    # slime's summary of the Megatron-side rollout fields needs its CP helpers: a stand-in; its
    # log_perf_data (the Timer's entries as perf/<name>_time, through slime's tracking) is its own.
    sys.modules["slime.observability.train_metric_utils"].log_rollout_data = lambda *a, **k: None
    return sys.modules["slime.backends.megatron_utils.actor"]

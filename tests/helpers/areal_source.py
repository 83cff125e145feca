"""AReaL's own colocate code, executed from its source at a pinned commit, on CPU (tests only).

`ArealSource.find()` locates AReaL's source through `RL_LIFECYCLE_AREAL_SOURCE` (a checkout or git
directory, e.g. the mirror of github.com/areal-project/AReaL, holding commit
`RL_LIFECYCLE_AREAL_COMMIT`, default `actor_integration.frameworks.areal.AREAL_COMMIT`); nothing of
AReaL is stored here. What runs from that source, in this process:

- `colocate_writer.py`: `AwexMegatronAdapter` (release and resume by tag, the grad buffers, the
  writer's transfer), over megatron-core's own `_ParamAndGradBuffer.offload_to_cpu` /
  `reload_from_cpu` on CPU tensors in a real `DistributedDataParallel` instance. Stand-ins: AWEX
  (its meta server, converter and CUDA IPC helpers: the meta server hands the publish to an
  `awex_fake_server`), `torch.cuda`'s synchronize / empty_cache / ipc_collect (`cpu_cuda`).
- `sglang_remote.py`: `SGLangBackend`'s request builders (the class alone, from the file's syntax
  tree, with AReaL's own `HttpRequest` from `api/io_struct.py`).
- `recover.py`: `RecoverHandler` and `RecoverInfo` whole, with stand-ins for the modules it imports
  (`areal.api`, the saver's paths, the gateway controller it tests for).
- `sglang_plugin.py`: `AwexSchedulerPlugin`'s patched event loops and its `process_awex_queue`, at
  this commit (polling only while paused) and at `IDLE_POLL_COMMIT` (the idle-loop polling
  AReaL #1737 removed), over a scheduler stand-in whose requests are broadcast over gloo as
  SGLang's `broadcast_pyobj` does.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actor_integration.frameworks.areal import AREAL_COMMIT
from tests.helpers.framework_source import FrameworkSource, SourceUnavailable, stand_in_module

SOURCE_ENV = "RL_LIFECYCLE_AREAL_SOURCE"
COMMIT_ENV = "RL_LIFECYCLE_AREAL_COMMIT"
HOW_TO_RUN = (
    f"set {SOURCE_ENV} to an AReaL checkout or git directory holding commit {AREAL_COMMIT} "
    f"(git clone https://github.com/areal-project/AReaL), e.g. `{SOURCE_ENV}=~/src/AReaL python -m pytest "
    "tests/actor_integration/frameworks/areal/test_areal_source.py`"
)
# The plugin with `_maybe_process_awex_queue_when_idle` (feature/optimizer_offload, in PR #1613's
# merge ref 40018373): the polling of the weight queue in SGLang's idle loop that #1737 removed.
IDLE_POLL_COMMIT = "7cad29b63"

WRITER = "areal/engine/awex/colocate_writer.py"
BACKEND = "areal/engine/sglang_remote.py"
IO_STRUCT = "areal/api/io_struct.py"
RECOVER = "areal/utils/recover.py"
PLUGIN = "areal/engine/awex/sglang_plugin.py"


class ArealSourceUnavailable(SourceUnavailable):
    """AReaL's source is not reachable here (CI has no network): the suite skips with HOW_TO_RUN."""


@dataclass(frozen=True)
class ArealSource(FrameworkSource):
    SOURCE_ENV = SOURCE_ENV
    COMMIT_ENV = COMMIT_ENV
    DEFAULT_COMMIT = AREAL_COMMIT
    HOW_TO_RUN = HOW_TO_RUN
    PROBE = WRITER
    UNAVAILABLE = ArealSourceUnavailable

    def at(self, commit: str) -> ArealSource:
        """The same source at another commit (a git directory only)."""
        return type(self)(self.location, commit)

    def read(self, path: str) -> str:
        if self._exported():
            exported = (self.location / "COMMIT").read_text().strip()
            if not exported.startswith(self.commit) and not self.commit.startswith(
                exported[: len(self.commit)]
            ):
                raise self.UNAVAILABLE(
                    f"{self.location} is a tree exported at {exported[:8]}, not {self.commit}; point "
                    f"{SOURCE_ENV} at a git directory to run the tests of other commits"
                )
        return super().read(path)

    def export_tree(self, destination: Path) -> ArealSource:
        """The files these tests run, as plain files, for a machine without git."""
        exported: ArealSource = self.export(destination, (WRITER, BACKEND, IO_STRUCT, RECOVER, PLUGIN))
        return exported


def _packages(name: str) -> None:
    parts = name.split(".")
    for end in range(1, len(parts)):
        package = ".".join(parts[:end])
        if package not in sys.modules:
            stand_in_module(package, __path__=[])


def run_module(source: ArealSource, path: str, name: str) -> types.ModuleType:
    """AReaL's file `path` at the source's commit, executed as module `name` (its imports must resolve)."""
    _packages(name)
    module = types.ModuleType(name)
    module.__file__ = f"{path}@{source.commit}"
    sys.modules[name] = module
    code = compile(source.read(path), module.__file__, "exec")
    exec(code, module.__dict__)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def run_definitions(
    source: ArealSource, path: str, names: tuple[str, ...], namespace: dict[str, Any]
) -> dict[str, Any]:
    """Only the top-level classes and functions `names` of AReaL's file `path`, executed in `namespace`."""
    tree = ast.parse(source.read(path))
    nodes = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    if missing:
        raise ArealSourceUnavailable(f"{path}@{source.commit} has no {sorted(missing)}")
    module = ast.Module(
        body=[ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0), *nodes],
        type_ignores=[],
    )
    exec(compile(ast.fix_missing_locations(module), f"{path}@{source.commit}", "exec"), namespace)
    return {name: namespace[name] for name in names}


def logging_stand_ins() -> None:
    """`areal.utils.logging.getLogger` and `areal.utils.pkg_version` (their real modules import AReaL's config)."""
    _packages("areal.utils.logging")
    stand_in_module("areal.utils.logging", getLogger=lambda name, *a, **k: logging.getLogger(f"areal.{name}"))
    stand_in_module("areal.utils.pkg_version", get_version=lambda package: "0.5.10.post1")


@contextlib.contextmanager
def cpu_cuda() -> Iterator[None]:
    """`torch.cuda`'s calls AReaL's adapter makes, as no-ops on a machine without CUDA (restored after)."""
    import torch

    names = {"synchronize": None, "empty_cache": None, "ipc_collect": None, "current_device": 0}
    saved = {name: getattr(torch.cuda, name) for name in names}
    for name, value in names.items():
        setattr(torch.cuda, name, (lambda *a, _v=value, **k: _v))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


# ---------------------------------------------------------------------------------------------- the writer


@dataclass
class MetaServer:
    """AWEX's meta server as the writer uses it; the reader's side is `read(version)` (the plugin)."""

    read: Any = None
    objects: dict[str, Any] = field(default_factory=dict)

    def put_object(self, key: str, value: Any) -> None:
        self.objects[key] = value

    def get_object(self, key: str, timeout: float | None = None) -> Any:
        if key == "infer_conf":
            return {"infer_world_size": 1}
        if key == "num_infer_engines":
            return 1
        if key.startswith("weights_update_finished"):
            version = int(key.rsplit("_", 1)[1])
            self.read(version)  # raises when the plugin never reads the queue (the writer's timeout)
            return True
        return self.objects[key]

    def add_object_to_set(self, key: str, value: Any) -> None:
        self.objects.setdefault(key, set()).add(value)

    def delete_if_exists(self, key: str) -> None:
        self.objects.pop(key, None)

    def wait_set_until_size(self, key: str, size: int, timeout: float | None = None) -> None:
        pass


def install_writer(source: ArealSource, meta: MetaServer) -> types.ModuleType:
    """AReaL's `colocate_writer` from source, its AWEX imports stand-ins over `meta`."""
    import torch

    logging_stand_ins()

    def release_tensors(tensors: Any) -> None:
        for tensor in tensors:
            tensor.untyped_storage().resize_(0)

    stand_in_module("awex")
    stand_in_module("awex.meta")
    stand_in_module(
        "awex.meta.meta_server",
        MetaServerClient=lambda host, port: meta,
        start_meta_server=lambda: ("127.0.0.1", 1),
    )
    stand_in_module(
        "awex.meta.train_meta_resolver",
        McoreParamMetaResolver=lambda shim, hf_config, infer_conf: types.SimpleNamespace(
            get_parameters_meta=lambda: [], get_pp_stage_layer_id_map=lambda: {}
        ),
    )
    stand_in_module("awex.models")
    stand_in_module(
        "awex.models.registry",
        get_train_weights_converter=lambda *a, **k: types.SimpleNamespace(
            convert_param=lambda name, param, vp_stage=0: [(f"model.{name}", param.clone())]
        ),
    )
    stand_in_module("awex.sharding")
    stand_in_module(
        "awex.sharding.param_sharding",
        get_rank_info_extractor=lambda engine: (
            lambda: types.SimpleNamespace(world_size=1, global_rank=0, pp_rank=0, pp_size=1)
        ),
    )
    stand_in_module("awex.util")
    stand_in_module("awex.util.common", get_ip_address=lambda: "127.0.0.1")
    stand_in_module(
        "awex.util.tensor_util",
        cuda_ipc_serialize=lambda obj: b"handles",
        group_tensors_by_shape_and_dtype=lambda tensors: ([t.clone() for t in tensors], [len(tensors)]),
        release_tensors=release_tensors,
    )
    stand_in_module("awex.converter")
    stand_in_module(
        "awex.converter.mcore_converter",
        get_mcore_model_parameters=lambda chunk: dict(chunk.named_parameters()),
    )
    del torch  # imported to fail early where torch is missing
    return run_module(source, WRITER, "areal.engine.awex.colocate_writer")


def ddp_chunk(values: Any) -> Any:
    """A model chunk as AReaL's adapter sees Megatron's: a `DistributedDataParallel` instance whose one
    param-and-grad buffer runs megatron-core's own `offload_to_cpu` / `reload_from_cpu`, its
    parameter a view of the buffer."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    class Chunk(DistributedDataParallel):  # type: ignore[misc]
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            buffer = object.__new__(_ParamAndGradBuffer)
            buffer.param_data = torch.tensor(values, dtype=torch.float32)
            buffer.grad_data = torch.zeros(len(values))
            buffer.param_data_cpu = torch.empty(len(values))  # as after a first offload: no pinning on CPU
            buffer.grad_data_size = 0
            self.buffers = [buffer]
            self.expert_parallel_buffers = []
            self.weight = torch.nn.Parameter(buffer.param_data.view(-1), requires_grad=False)

    return Chunk()


def install_plugin(source: ArealSource) -> types.ModuleType:
    """AReaL's `sglang_plugin` at the source's commit (its SGLang and memory-saver imports stand-ins)."""
    logging_stand_ins()
    _packages("areal.engine.awex.memory_saver")
    stand_in_module("areal.engine.awex.memory_saver", patch_tms_hook_mode=lambda: None)
    _packages("sglang.srt.managers.io_struct")
    stand_in_module(
        "sglang.srt.managers.io_struct",
        ResumeMemoryOccupationReqInput=lambda tags=None: types.SimpleNamespace(tags=tags),
    )
    return run_module(source, PLUGIN, "areal.engine.awex.sglang_plugin")


class StopLoop(Exception):
    """Ends a scheduler loop (the real one runs until the server exits)."""


class TPScheduler:
    """A TP rank's SGLang scheduler as AReaL's patched loops drive it: `recv_requests` broadcasts rank 0's
    requests over the TP group with `broadcast_object_list` (SGLang's `broadcast_pyobj`); `script` is
    rank 0's requests per broadcast ("pause_in_place", "publish", "continue"); `skip_first` makes this
    rank's first loop iteration return without the broadcast (a loop that drifted by one iteration);
    the loop ends after `len(script)` broadcasts."""

    tp_size = 2
    is_generation = True

    def __init__(self, rank: int, group: Any, script: list[list[str]], *, skip_first: bool = False) -> None:
        self.rank, self.gpu_id, self.tp_cpu_group = rank, rank, group
        self.script, self.skip_first = script, skip_first
        self.broadcasts = self.iterations = 0
        self._engine_paused = False
        self.cur_batch = self.last_batch = None
        self.resumed: list[Any] = []
        self.plugin: Any = None

    def recv_requests(self) -> list[str]:
        import torch.distributed as dist

        self.iterations += 1
        if self.skip_first and self.iterations == 1:
            return []
        if self.broadcasts == len(self.script):
            raise StopLoop
        box = [self.script[self.broadcasts] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.tp_cpu_group)
        self.broadcasts += 1
        return list(box[0] or [])

    def process_input_requests(self, requests: list[str]) -> None:
        for request in requests:
            if request == "pause_in_place":
                self._engine_paused = True
            elif request == "continue":
                self._engine_paused = False
            elif request.startswith("publish"):  # the background thread saw the writer's handles
                self.plugin._weight_queue.put({"version": int(request.split(":")[1])})

    def get_next_batch_to_run(self) -> None:
        return None

    def self_check_during_idle(self) -> None:
        pass

    def is_fully_idle(self, for_health_check: bool = False) -> bool:
        return True

    def is_disable_overlap_for_batch(self, batch: Any) -> bool:
        return False

    def launch_batch_sample_if_needed(self, result: Any) -> None:
        pass

    def resume_memory_occupation(self, request: Any) -> None:
        self.resumed.append(list(request.tags))

    def event_loop_normal(self) -> None:
        raise AssertionError("the plugin replaces this loop")

    event_loop_overlap = event_loop_normal


class Receiver:
    """AWEX's colocate reader as the plugin's main loop calls it (the transfer itself is AWEX's)."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def wait_for_training_offloaded(self, version: int) -> None:
        pass

    def update_weights(self, version: int) -> None:
        self.loaded.append(version)

    def signal_finished_weights_update(self) -> None:
        pass


def plugin_rank(
    rank: int,
    world_size: int,
    store: Any,
    location: str,
    commit: str,
    script: list[list[str]],
    drift: bool,
    idle_poll: str,
) -> dict[str, Any]:
    """One TP rank (`tests.helpers.spawn.run_world`): AReaL's plugin at `commit` patches a scheduler's
    loops, which run `script`; what the rank saw, or the collective's error."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["AREAL_AWEX_PROCESS_QUEUE_WHEN_IDLE"] = idle_poll
    os.environ["AWEX_IDLE_POLL_LOOPS"] = "2"  # the same loop-count gate, with a short period
    os.environ["AWEX_PAUSED_POLL_INTERVAL_S"] = "0"
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=8)
    )
    module = install_plugin(ArealSource(Path(location), commit))
    scheduler = TPScheduler(rank, dist.group.WORLD, script, skip_first=drift and rank == 1)
    plugin = module.AwexSchedulerPlugin(scheduler)
    scheduler.plugin = plugin
    plugin._receiver = receiver = Receiver()
    plugin._patch_event_loop()
    try:
        scheduler.event_loop_normal()
    except StopLoop:
        pass
    except Exception as exc:  # the TP collectives met out of order: gloo's error or its timeout
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "loaded": receiver.loaded}
    return {"loaded": receiver.loaded, "resumed": scheduler.resumed, "iterations": scheduler.iterations}


# ---------------------------------------------------------------------------------------------- the writer's host


def source_engine(module: types.ModuleType, *, wrapped: bool, values: list[float]) -> Any:
    """An AReaL-shaped engine (`areal_like`) whose `_awex_adapter` is AReaL's own, over a real DDP chunk:
    reading released weights is reading a buffer whose storage AReaL resized to 0."""
    import torch

    from lifecycle.testing import ProtocolViolation
    from tests.helpers.areal_like import LifecycleEngineLike, MegatronEngineLike

    base = LifecycleEngineLike if wrapped else MegatronEngineLike

    class SourceEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model = [ddp_chunk(values)]
            self.optimizer = types.SimpleNamespace(
                shard_fp32_from_float16_groups=[[torch.zeros(4)]], optimizer=types.SimpleNamespace(state={})
            )
            self.hf_config = types.SimpleNamespace(
                architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False
            )
            self.device = torch.device("cpu")
            self._awex_adapter = module.AwexMegatronAdapter(self)

        @property
        def buffer(self) -> Any:
            return self.model[0].buffers[0]

        def read(self, tag: str, what: str) -> Any:
            if tag == "weights" and self.buffer.param_data.untyped_storage().size() == 0:
                raise ProtocolViolation(
                    f"body used memory: {what} read 'weights', whose storage AReaL released"
                )
            if tag == "optimizer" and "optimizer" in self._awex_adapter._released_tags:
                raise ProtocolViolation(f"body used memory: {what} read 'optimizer', which AReaL released")
            return self.buffer.param_data.tolist() if tag == "weights" else None

        def train_batch(self, *args: Any, **kwargs: Any) -> dict[str, float]:
            if self.is_offload:
                self.onload()
            self._awex_adapter.ensure_grad_buffers()
            self.read("weights", "train_batch")
            self.read("optimizer", "train_batch")
            with torch.no_grad():
                self.buffer.param_data.add_(1.0)
            return {"loss": 0.0}

    return SourceEngine()


def writer_rank(
    rank: int,
    world_size: int,
    store: Any,
    location: str,
    commit: str,
    server_url: str,
    wrapped: bool,
    then: str,
) -> dict[str, Any]:
    """One trainer rank (`run_world`, world 1) running AReaL's own writer: init offload, rl_trainer's
    rollout offload, onload, a train step, the AWEX update to `server_url`'s plugin, then `then`."""
    import torch.distributed as dist

    from lifecycle import Residency
    from lifecycle.errors import ProtocolViolation
    from tests.helpers.areal_like import http_rollout, http_send

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    meta = MetaServer(
        read=lambda version: http_send(server_url, "/_fake/awex_transfer", {"version": version})
    )
    server = types.SimpleNamespace(url=server_url)
    with cpu_cuda():
        module = install_writer(ArealSource(Path(location), commit), meta)
        engine = source_engine(module, wrapped=wrapped, values=[1.0, 2.0, 3.0, 4.0])
        engine._awex_adapter.init_colocate_weight_update(meta_server_addr="127.0.0.1:1")
        engine.rollout_engine = rollout = http_rollout(server, wrapped=wrapped)
        engine.offload()
        rollout.pause_generation()
        rollout.offload(tags=["kv_cache"])
        rollout.offload(tags=["weights"])
        engine.onload()
        engine.train_batch()
        from tests.helpers.areal_like import Meta

        engine.update_weights(Meta(version=1))
        after_update = {
            "released": sorted(engine._awex_adapter._released_tags),
            "storage": engine.buffer.param_data.untyped_storage().size(),
        }
        if wrapped:
            after_update["machine"] = sorted(
                t for t, r in engine.lifecycle.residency.items() if r is Residency.RELEASED
            )
        result: dict[str, Any] = {"after_update": after_update}
        try:
            if then == "save":
                engine.save(Meta(type="dcp"))
                result["saved"] = engine.saved[-1]
            elif then == "onload":
                engine.onload()
                result["weights"] = engine.buffer.param_data.tolist()
        except ProtocolViolation as exc:
            result["violation"] = str(exc)
    return result


# ---------------------------------------------------------------------------------------------- RecoverHandler


def recover_stand_ins() -> None:
    """The modules `recover.py` imports, as far as `RecoverHandler.load` reads them."""
    from dataclasses import asdict, dataclass
    from dataclasses import replace as dc_replace

    logging_stand_ins()

    @dataclass
    class StepInfo:
        epoch: int
        epoch_step: int
        global_step: int
        steps_per_epoch: int

        def next(self) -> StepInfo:
            return dc_replace(self, global_step=self.global_step + 1)

    @dataclass
    class FinetuneSpec:
        steps_per_epoch: int = 10

    @dataclass
    class SaveLoadMeta:
        path: str
        weight_format: str
        with_optim: bool
        tokenizer: Any = None
        processor: Any = None
        base_model_path: Any = None

    @dataclass
    class WeightUpdateMeta:
        type: str = "awex"
        version: int | None = None

        def with_version(self, version: int) -> WeightUpdateMeta:
            return dc_replace(self, version=version)

    @dataclass
    class RecoverConfig:
        mode: str = "auto"
        experiment_name: str = "exp"
        trial_name: str = "trial"
        fileroot: str = "/tmp"
        freq_epochs: Any = None
        freq_steps: Any = None
        freq_secs: Any = None
        no_save_optim: bool = False
        no_load_optim: bool = False

    class Stateful:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.state: Any = None

        def load_state_dict(self, state: Any) -> None:
            self.state = state

        def state_dict(self) -> Any:
            return self.state

    class Saver(Stateful):
        @staticmethod
        def get_save_root(experiment_name: str, trial_name: str, fileroot: str) -> str:
            return f"{fileroot}/{experiment_name}/{trial_name}"

        @staticmethod
        def get_recover_checkpoint_path(
            experiment_name: str, trial_name: str, fileroot: str, name: str
        ) -> str:
            return f"{fileroot}/{experiment_name}/{trial_name}/recover_checkpoint/{name}"

    _packages("areal.api.cli_args")
    stand_in_module(
        "areal.api",
        FinetuneSpec=FinetuneSpec,
        InferenceEngine=type("InferenceEngine", (), {}),
        SaveLoadMeta=SaveLoadMeta,
        StepInfo=StepInfo,
        TrainEngine=type("TrainEngine", (), {}),
        WeightUpdateMeta=WeightUpdateMeta,
        asdict=asdict,
    )
    stand_in_module("areal.api.cli_args", RecoverConfig=RecoverConfig)
    stand_in_module("areal.infra", TrainController=type("TrainController", (), {}))
    stand_in_module("areal.utils.timeutil", EpochStepTimeFreqCtl=Stateful)
    stand_in_module("areal.utils.evaluator", Evaluator=Stateful)
    stand_in_module("areal.utils.saver", Saver=Saver)
    _packages("areal.v2.training_service.controller.controller")
    stand_in_module(
        "areal.v2.training_service.controller.controller",
        GatewayTrainController=type("GatewayTrainController", (), {}),
    )


def recover_rank(
    rank: int,
    world_size: int,
    store: Any,
    location: str,
    commit: str,
    server_url: str,
    wrapped: bool,
    checkpoint: bool,
    root: str,
) -> dict[str, Any]:
    """AReaL's own `RecoverHandler.load` (AWEX colocate) over AReaL-shaped controllers and engines,
    plain or wrapped, the rollout's server at `server_url`; with or without the actor's checkpoint."""
    import os

    from tests.helpers import areal_like

    recover_stand_ins()
    module = run_module(ArealSource(Path(location), commit), RECOVER, "areal.utils.recover")
    api = sys.modules["areal.api"]
    config = sys.modules["areal.api.cli_args"].RecoverConfig(fileroot=root)
    info_path = module.RecoverHandler.recover_info_path(config.experiment_name, config.trial_name, root)
    module.RecoverInfo(
        last_step_info=api.StepInfo(epoch=0, epoch_step=3, global_step=3, steps_per_epoch=10),
        saver_info={},
        evaluator_info={},
        stats_logger_info={},
        dataloader_info={},
        checkpoint_info={},
    ).dump(info_path)
    if checkpoint:
        os.makedirs(
            sys.modules["areal.utils.saver"].Saver.get_recover_checkpoint_path(
                config.experiment_name, config.trial_name, root, "default"
            )
        )
    server = types.SimpleNamespace(url=server_url)
    engine = areal_like.http_rollout(server, wrapped=wrapped)
    trainer_engine = (areal_like.LifecycleEngineLike if wrapped else areal_like.MegatronEngineLike)()
    trainer_engine.publish = areal_like.publish_to(server_url)
    trainer_engine.offload()  # rl_trainer offloads the actor before the rollout starts
    if wrapped:
        rollout: Any = areal_like.LifecycleRolloutController([engine])
        trainer: Any = areal_like.LifecycleTrainController([trainer_engine])
    else:
        rollout = areal_like.RolloutControllerLike([engine])
        trainer = areal_like.TrainControllerLike([trainer_engine])
    stateful = sys.modules["areal.utils.evaluator"].Evaluator
    handler = module.RecoverHandler(config, api.FinetuneSpec())
    try:
        info = handler.load(
            trainer,
            saver=stateful(),
            evaluator=stateful(),
            stats_logger=stateful(),
            dataloader=stateful(),
            inference_engine=rollout,
            weight_update_meta=api.WeightUpdateMeta(type="awex"),
            colocated_rollout=True,
        )
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:400]}
    return {"returned": None if info is None else info.last_step_info.global_step}

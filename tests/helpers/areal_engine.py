"""AReaL's own `RemoteSGLangEngine`, imported from its source at the pinned commit (tests only).

`import_areal(source, scratch)` puts an importable tree of AReaL's files on `sys.path` (an exported
tree as it is, e.g. the GPU machine's `.gpuw/r33/areal`; a checkout or git directory is exported
first, `ENGINE_FILES` only) and imports `areal.engine.sglang_remote` the normal way: AReaL's engine
class, its `RemoteInfEngine`, `SGLangBackend`, `WorkflowExecutor`, `name_resolve` and every module
they import at load time run unchanged, and its HTTP calls are its own (aiohttp under uvloop).

What AReaL imports at load time and neither the GPU machine's image nor SGLang 0.5.17's wheel set
has (`scripts/slime_import_closure.py --root areal.engine.sglang_remote`, then an import) gets a
stand-in, and only where the real module is absent (`STAND_INS` says where each is used; none is
on the engine's path: the colocate calls, the disk weight update and `initialize` never reach them):

- `hydra`, `omegaconf` (`areal/api/cli_args.py`: its config loader; `MISSING` is omegaconf's "???";
  omegaconf needs antlr4-python3-runtime 4.9, which has no wheel);
- `lark` (`areal/api/alloc_mode.py`: the allocation-string parser, read only when
  `initialize` is not given the train data-parallel size);
- `flask` (`areal/infra/controller/rollout_controller.py`: the controller's callback server);
- `tenacity` (`areal/infra/utils/http.py` and the OpenAI proxy: retry decorators of other
  clients; `arequest_with_retry`, which the engine sends through, retries in its own loop);
- `colorlog` (`areal/utils/logging.py`: colours; records are formatted without them);
- `torchdata` (`StatefulDataLoader`, an annotation on the engine's batch methods: torch's
  `DataLoader` stands in).

The colocate path proper, AReaL's AWEX plugin in SGLang's scheduler, does not run on 0.5.17:
`plugin_loop_calls` checks the scheduler methods its patched event loops call against the
installed SGLang's `Scheduler` (tests/gpu/test_areal_rollout_gpu.py, with the plugin's version
guard widened in the test).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import types
from pathlib import Path
from typing import Any

from tests.helpers.areal_source import PLUGIN, ArealSource
from tests.helpers.framework_source import stand_in_module

ROOT_MODULE = "areal.engine.sglang_remote"
# Every file of AReaL (cbff54d6) that importing ROOT_MODULE and the plugin runs, with the stand-ins
# below for what is absent (read from sys.modules after the import): what .gpuw/r33/areal holds.
ENGINE_FILES = (
    "areal/__init__.py",
    "areal/api/__init__.py",
    "areal/api/alloc_mode.py",
    "areal/api/cli_args.py",
    "areal/api/engine_api.py",
    "areal/api/io_struct.py",
    "areal/api/scheduler_api.py",
    "areal/api/workflow_api.py",
    "areal/engine/__init__.py",
    "areal/engine/awex/__init__.py",
    PLUGIN,
    "areal/engine/fsdp_utils/__init__.py",
    "areal/engine/fsdp_utils/attn_impl.py",
    "areal/engine/fsdp_utils/optimizer.py",
    "areal/engine/sglang_remote.py",
    "areal/experimental/__init__.py",
    "areal/experimental/openai/__init__.py",
    "areal/experimental/openai/cache.py",
    "areal/experimental/openai/client.py",
    "areal/experimental/openai/proxy/__init__.py",
    "areal/experimental/openai/proxy/client_session.py",
    "areal/experimental/openai/proxy/server.py",
    "areal/experimental/openai/proxy/workflow.py",
    "areal/experimental/openai/tool_call_parser.py",
    "areal/experimental/openai/types.py",
    "areal/infra/__init__.py",
    "areal/infra/async_task_runner.py",
    "areal/infra/controller/__init__.py",
    "areal/infra/controller/rollout_callback.py",
    "areal/infra/controller/rollout_controller.py",
    "areal/infra/controller/train_controller.py",
    "areal/infra/launcher/__init__.py",
    "areal/infra/launcher/local.py",
    "areal/infra/launcher/ray.py",
    "areal/infra/launcher/sglang_server.py",
    "areal/infra/launcher/slurm.py",
    "areal/infra/launcher/vllm_server.py",
    "areal/infra/platforms/__init__.py",
    "areal/infra/platforms/cpu.py",
    "areal/infra/platforms/cuda.py",
    "areal/infra/platforms/npu.py",
    "areal/infra/platforms/platform.py",
    "areal/infra/platforms/unknown.py",
    "areal/infra/remote_inf_engine.py",
    "areal/infra/rpc/__init__.py",
    "areal/infra/rpc/rtensor.py",
    "areal/infra/rpc/serialization.py",
    "areal/infra/scheduler/__init__.py",
    "areal/infra/scheduler/exceptions.py",
    "areal/infra/scheduler/local.py",
    "areal/infra/scheduler/ray.py",
    "areal/infra/scheduler/slurm.py",
    "areal/infra/staleness_manager.py",
    "areal/infra/utils/__init__.py",
    "areal/infra/utils/concurrent.py",
    "areal/infra/utils/exp_metadata.py",
    "areal/infra/utils/http.py",
    "areal/infra/utils/launcher.py",
    "areal/infra/utils/proc.py",
    "areal/infra/utils/ray.py",
    "areal/infra/utils/slurm.py",
    "areal/infra/workflow_context.py",
    "areal/infra/workflow_executor.py",
    "areal/utils/__init__.py",
    "areal/utils/async_checkpoint.py",
    "areal/utils/constants.py",
    "areal/utils/data.py",
    "areal/utils/dynamic_import.py",
    "areal/utils/environ.py",
    "areal/utils/evaluator.py",
    "areal/utils/fs.py",
    "areal/utils/hf_utils.py",
    "areal/utils/logging.py",
    "areal/utils/math.py",
    "areal/utils/name_resolve.py",
    "areal/utils/names.py",
    "areal/utils/network.py",
    "areal/utils/offload.py",
    "areal/utils/perf_tracer.py",
    "areal/utils/pkg_version.py",
    "areal/utils/recover.py",
    "areal/utils/saver.py",
    "areal/utils/seqpack.py",
    "areal/utils/stats_tracker.py",
    "areal/utils/timeutil.py",
    "areal/version.py",
)
STAND_INS = {
    "hydra": "areal/api/cli_args.py: load_expr_config's hydra compose (config files; not called)",
    "omegaconf": "areal/api/cli_args.py: MISSING ('???') as a default, OmegaConf in the config loader",
    "lark": "areal/api/alloc_mode.py: the allocation-string parser (initialize is given the DP size)",
    "flask": "areal/infra/controller/rollout_controller.py: the controller's callback server (not built)",
    "tenacity": "areal/infra/utils/http.py, the OpenAI proxy: retry decorators of other clients",
    "colorlog": "areal/utils/logging.py: colours of AReaL's log lines",
    "torchdata": "StatefulDataLoader: annotations of the batch methods (torch's DataLoader)",
}


def absent(name: str) -> bool:
    """Whether module `name` cannot be imported here (one in sys.modules counts as present, unless
    it is None there: blocked)."""
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _refuse(what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{what} is a stand-in here (tests/helpers/areal_engine.py): {STAND_INS}")

    return call


def _colorlog() -> None:
    class ColoredRecord:
        def __init__(self, record: logging.LogRecord, escapes: dict[str, str]) -> None:
            self.__dict__.update(record.__dict__)
            self.__dict__.update(escapes)

    class ColoredFormatter(logging.Formatter):
        def __init__(
            self, fmt: str | None = None, datefmt: str | None = None, style: Any = "%", **_: Any
        ) -> None:
            super().__init__(fmt, datefmt, style, validate=False)

        def _escape_code_map(self, levelname: str) -> dict[str, str]:
            return {"log_color": "", "reset": ""}

        def _append_reset(self, message: str, escapes: dict[str, str]) -> str:
            return message

        def formatMessage(self, record: logging.LogRecord) -> str:
            escapes = self._escape_code_map(record.levelname)
            return logging.Formatter.formatMessage(self, ColoredRecord(record, escapes))  # type: ignore[arg-type]

    stand_in_module("colorlog", ColoredFormatter=ColoredFormatter, __path__=[])
    stand_in_module("colorlog.escape_codes", parse_colors=lambda colors: "")
    stand_in_module("colorlog.formatter", ColoredRecord=ColoredRecord)


def install_stand_ins() -> list[str]:
    """A stand-in for each module of `STAND_INS` that is absent; the names stood in."""
    done = []
    if absent("hydra"):

        class GlobalHydra:
            instance = staticmethod(_refuse("hydra.core.global_hydra.GlobalHydra"))

        stand_in_module(
            "hydra", compose=_refuse("hydra.compose"), initialize=_refuse("hydra.initialize"), __path__=[]
        )
        stand_in_module("hydra.core", __path__=[])
        stand_in_module("hydra.core.global_hydra", GlobalHydra=GlobalHydra)
        done.append("hydra")
    if absent("omegaconf"):

        class OmegaConf:
            structured = merge = to_object = to_container = is_missing = staticmethod(_refuse("OmegaConf"))

        stand_in_module(
            "omegaconf", MISSING="???", DictConfig=type("DictConfig", (dict,), {}), OmegaConf=OmegaConf
        )
        done.append("omegaconf")
    if absent("lark"):
        stand_in_module("lark", Lark=_refuse("lark.Lark"), Transformer=type("Transformer", (), {}))
        done.append("lark")
    if absent("flask"):
        stand_in_module(
            "flask",
            Flask=_refuse("flask.Flask"),
            Blueprint=_refuse("flask.Blueprint"),
            Response=type("Response", (), {}),
            jsonify=_refuse("flask.jsonify"),
            request=None,
            current_app=None,
        )
        done.append("flask")
    if absent("tenacity"):
        stand_in_module(
            "tenacity",
            RetryCallState=type("RetryCallState", (), {}),
            retry=lambda *args, **kwargs: lambda function: function,
            retry_if_exception=lambda *args: None,
            retry_if_exception_type=lambda *args: None,
            stop_after_attempt=lambda attempts: None,
            stop_never=None,
            wait_exponential=lambda **kwargs: None,
        )
        done.append("tenacity")
    if absent("colorlog"):
        _colorlog()
        done.append("colorlog")
    if absent("torchdata"):
        import torch.utils.data

        stand_in_module("torchdata", __path__=[])
        stand_in_module("torchdata.stateful_dataloader", StatefulDataLoader=torch.utils.data.DataLoader)
        done.append("torchdata")
    return done


def areal_tree(source: ArealSource, scratch: Path) -> Path:
    """A directory holding AReaL's `areal` package at the source's commit: an exported tree as it is;
    otherwise `ENGINE_FILES` exported under `scratch` (once per commit)."""
    if (source.location / "COMMIT").is_file():
        return source.location
    commit = source.resolved_commit()
    tree = scratch / f"areal-{commit[:12]}"
    if not (tree / "COMMIT").is_file():
        source.export(tree, ENGINE_FILES)
    return tree


def import_areal(source: ArealSource, scratch: Path) -> types.SimpleNamespace:
    """AReaL's modules the tests drive, imported from `areal_tree` (put first on sys.path)."""
    tree = str(areal_tree(source, scratch))
    loaded = sys.modules.get("areal")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(tree):
        raise RuntimeError(f"another `areal` is imported already ({loaded!r}); run this in a fresh process")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    stood_in = install_stand_ins()
    modules = {
        name.rsplit(".", 1)[1]: importlib.import_module(name)
        for name in (
            ROOT_MODULE,
            "areal.api.cli_args",
            "areal.api.io_struct",
            "areal.utils.name_resolve",
            "areal.utils.names",
        )
    }
    return types.SimpleNamespace(tree=tree, stood_in=stood_in, **modules)


def wrapped_class(areal: types.SimpleNamespace, **attributes: Any) -> type:
    """What an AReaL user writes for the rollout: `ArealRolloutMixin` first, then AReaL's engine."""
    from actor_integration.frameworks.areal import ArealRolloutMixin

    base = areal.sglang_remote.RemoteSGLangEngine
    return type("LifecycleRemoteSGLangEngine", (ArealRolloutMixin, base), dict(attributes))


# ---------------------------------------------------------------------------------------------- the plugin

# The scheduler calls of the AWEX plugin's patched loops at cbff54d6 (sglang_plugin.py
# `_patched_overlap` 365-427, `_patched_normal` 439-455, `process_awex_queue` 230) with the
# positional arguments it passes, as 0.5.9 / 0.5.10.post1 take them.
PLUGIN_LOOP_CALLS = (
    ("recv_requests", 0),
    ("process_input_requests", 1),
    ("get_next_batch_to_run", 0),
    ("is_disable_overlap_for_batch", 1),
    ("run_batch", 1),
    ("process_batch_result", 2),
    ("self_check_during_idle", 0),
    ("launch_batch_sample_if_needed", 1),
    ("resume_memory_occupation", 1),
)


def plugin_loop_calls(scheduler_class: type) -> dict[str, str]:
    """Each of `PLUGIN_LOOP_CALLS` that `scheduler_class` cannot take as the plugin makes it: the
    method missing, or its signature refusing the plugin's arguments (name -> why)."""
    problems = {}
    for name, count in PLUGIN_LOOP_CALLS:
        method = getattr(scheduler_class, name, None)
        if method is None:
            problems[name] = f"{scheduler_class.__name__} has no {name}"
            continue
        try:
            inspect.signature(method).bind(None, *([None] * count))
        except TypeError as exc:
            problems[name] = f"{name}{inspect.signature(method)} refuses {count} argument(s): {exc}"
        except ValueError:  # no signature to read (a builtin): assume it takes them
            continue
    return problems


def plugin_loop_error(plugin: types.ModuleType, scheduler_class: type, timeout_s: float = 5.0) -> str | None:
    """AReaL's own patched overlap loop run on a bare `scheduler_class` instance (no __init__: no
    model, no sockets): the first error it raises ("Type: message"), or None if it still runs
    after `timeout_s` (then its thread is left running, a daemon)."""
    import threading

    scheduler = object.__new__(scheduler_class)
    scheduler.gpu_id = 0
    scheduler._engine_paused = False
    raised: list[str] = []

    def run() -> None:
        try:
            plugin.AwexSchedulerPlugin(scheduler)._patch_event_loop()
            scheduler.event_loop_overlap()
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return raised[0] if raised else None

"""slime's `SGLangEngine` (the rollout half) under the lifecycle, created where slime creates it.

    # the job's runtime env (ray job submit --runtime-env-json): the launch switch, the rollout half
    {"worker_process_setup_hook": "actor_integration.frameworks.launch.slime",
     "env_vars": {"RL_LIFECYCLE_WRAP": "rollout"}}

    # or in slime/ray/rollout.py, ServerGroup.start_engines (was: ray.remote(SGLangEngine)):
    RolloutRayActor = ray.remote(lifecycle_engine(SGLangEngine))

`lifecycle_engine(SGLangEngine)` is `class LifecycleSGLangEngine(SlimeRolloutMixin, SGLangEngine)`.
The engines are created inside slime's rollout manager, a Ray actor of its own: assigning a class
in the driver's process does not reach it, so `install()` runs in every worker of the job (Ray's
setup hook) and replaces `SGLangEngine` in slime's rollout module, where `start_engines` reads it.

What each of slime's calls does (read from slime 624b824a, `slime/backends/sglang_utils/sglang_engine.py`
and `slime/ray/rollout.py`); the shared rules are in `engines.sglang.actor` and `rollout.server_actor`:

| slime's call | plain slime | under `SlimeRolloutMixin` |
|---|---|---|
| `init(...)` | launches the server, registers it with the router | the same; an offloaded server (memory saver) joins the router only once a pushed version is whole and awake |
| `release_memory_occupation()` (offload) | flush (60 tries), release every tag | the sleep: out of the router, pause (abort), flush with a deadline, release the resident tags in one request; a second one is a no-op |
| `resume_memory_occupation(tags)` (onload, onload_weights, onload_kv) | resume the tags | the wake of the released ones; a resume of a resident tag is a no-op; the last one continues generation and rejoins the router if the weights can be served |
| `pause_generation()` | pause (abort) | the same; the next bucket opens a version |
| `update_weights_from_tensor(...)`, `update_weights_from_distributed(...)` | push a bucket | the sync operation: refused while the weights are released; weights unknown from the first bucket |
| `continue_generation()` | continue | the version is whole; generation continues (and the server rejoins) if it is awake, else at the end of the wake: returns None then |
| `health_generate(timeout)` | `/health_generate` (a generation) | the same while servable; else `/model_info` (no generation); FAILED is unhealthy |
| `check_weights(action)` | `/weights_checker` | refused while the weights are released |
| `update_weights_from_disk(...)` | reload from disk | a whole version in one call |

Every other method is slime's own, unchanged. A follower (`node_rank != 0`) follows node 0's
actor instead of answering None (see `rollout.server_actor`).

A server that dies mid-rollout (its scheduler killed): slime's rollout sends its requests to the
router, not through the engine actor, and retries each a minute long (or waits with no deadline),
so the launch switch also watches the engines while a rollout runs, in the rollout manager's
process: `record_servers` keeps the servers `start_rollout_servers` started there, and
`watch_rollouts` runs slime's `call_rollout_fn` (through which `RolloutManager.generate` and `.eval`
call the rollout function) under `rollout.server_watch.watch_engines`: the engines are asked every
second whether their server lives, and a death ends the rollout with `EngineDiedError` naming the
engine and the process (unless slime's own `--use-fault-tolerance` is on: its health monitor
restarts dead engines then). Both are module functions: `RolloutManager` itself is a `ray.remote`
class, which Ray ships to its worker by value from the driver, where nothing is patched; the
functions its methods call are looked up in their modules there, as the preflight's is.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, ClassVar

from actor_integration.engines.sglang.actor import SGLangActorLifecycle, install_into, wrapped_engine
from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.job_output import say
from actor_integration.rollout.server_watch import ENGINE_POLL_S, watch_engines

__all__ = [
    "SLIME_COMMIT",
    "SlimeRolloutMixin",
    "install",
    "lifecycle_engine",
    "record_servers",
    "watch_rollouts",
]

SLIME_COMMIT = "624b824a"  # the slime this adapter is read from and tested against


class SlimeRolloutMixin(SGLangActorLifecycle):
    """slime's `SGLangEngine` methods through the rollout lifecycle; put it first in the bases."""

    lifecycle_framework: ClassVar[str] = "slime"

    def release_memory_occupation(self) -> None:
        self._lc_sleep(None, "release_memory_occupation")

    def pause_generation(self) -> Any:
        return self._lc_pause("pause_generation", self._own("pause_generation"))

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> Any:
        return self._lc_push(
            "update_weights_from_tensor",
            weight_version,
            lambda: self._own("update_weights_from_tensor")(
                serialized_named_tensors,
                load_format=load_format,
                flush_cache=flush_cache,
                weight_version=weight_version,
            ),
        )

    def update_weights_from_distributed(
        self, names: Any, dtypes: Any, shapes: Any, group_name: str, *args: Any, **kwargs: Any
    ) -> Any:
        version = kwargs.get("weight_version", args[1] if len(args) > 1 else None)
        return self._lc_push(
            "update_weights_from_distributed",
            version,
            lambda: self._own("update_weights_from_distributed")(
                names, dtypes, shapes, group_name, *args, **kwargs
            ),
        )

    def check_weights(self, action: str) -> Any:
        return self._lc_reads_weights("check_weights", lambda: self._own("check_weights")(action))


ROLLOUT_MODULE = "slime.ray.rollout"  # where slime's ServerGroup.start_engines reads SGLangEngine


def lifecycle_engine(engine_class: type) -> type:
    """`class LifecycleSGLangEngine(SlimeRolloutMixin, engine_class)`, once per class (Ray pickles it by value)."""
    return wrapped_engine(SlimeRolloutMixin, engine_class, __name__)


def install() -> type:
    """Make slime's rollout manager create `lifecycle_engine(SGLangEngine)`: its module's
    `SGLangEngine` is replaced (idempotent), importing it now. Run it in the rollout manager's process,
    e.g. as the `worker_process_setup_hook` of the job's runtime env (not with `ray.init` in train.py:
    slime's driver has started Ray by then). `actor_integration.frameworks.launch.slime` does the same
    when the module is imported, for both halves, and refuses a half left unwrapped."""
    return install_into(importlib.import_module(ROLLOUT_MODULE), lifecycle_engine)


# The rollout servers `start_rollout_servers` started in this process (the rollout manager's): one
# {model: RolloutServer} per call.
_STARTED: list[dict[str, Any]] = []


def record_servers(module: ModuleType) -> None:
    """slime's `start_rollout_servers` (in `module`, slime's `slime.ray.rollout`) keeps the servers it
    started, whose engines `watch_rollouts` asks. Idempotent."""
    original = getattr(module, "start_rollout_servers", None)
    if not callable(original):
        raise _moved(module, "start_rollout_servers")
    if getattr(original, "_rl_lifecycle_recorded", False):
        return

    @functools.wraps(original)
    def recording(*args: Any, **kwargs: Any) -> Any:
        started = original(*args, **kwargs)
        servers = started[0] if isinstance(started, tuple) and started else started
        if isinstance(servers, dict):
            _STARTED.append(servers)
        return started

    recording._rl_lifecycle_recorded = True  # type: ignore[attr-defined]
    module.start_rollout_servers = recording  # type: ignore[attr-defined]


def _engines() -> list[Any]:
    """The node-0 engines of every server started in this process (`RolloutManager.rollout_engines`)."""
    return [engine for servers in _STARTED for server in servers.values() for engine in server.engines]


def watch_rollouts(module: ModuleType) -> None:
    """slime's `call_rollout_fn` (in `module`, `slime.rollout.base_types`: `RolloutManager.generate`
    and `.eval` call the rollout function through it) runs while the engines `record_servers` kept are
    watched (`watch_engines`): a server that dies ends the rollout with `EngineDiedError` within about
    a second, instead of slime's retries. Not under `--use-fault-tolerance` (slime's health monitor
    restarts dead engines), nor where no server was started here. Idempotent."""
    original = getattr(module, "call_rollout_fn", None)
    if not callable(original):
        raise _moved(module, "call_rollout_fn")
    if getattr(original, "_rl_lifecycle_watched", False):
        return

    @functools.wraps(original)
    def watched(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
        def run() -> Any:
            return original(fn, *args, evaluation=evaluation, **kwargs)

        flags = args[0] if args else None
        engines = _engines()
        if not engines or getattr(flags, "use_fault_tolerance", False):
            return run()
        what = f"slime's rollout {args[1] if len(args) > 1 else '?'} ({'eval' if evaluation else 'generate'})"
        say(f"{what}: watching {len(engines)} engine(s) for a dead server, every {ENGINE_POLL_S:g} s")
        return watch_engines(
            run,
            _engines,
            what=what,
            advice=(
                "The job stops here: slime's driver cannot go on without the engine (--use-fault-tolerance "
                "restarts dead engines instead)."
            ),
        )

    watched._rl_lifecycle_watched = True  # type: ignore[attr-defined]
    module.call_rollout_fn = watched  # type: ignore[attr-defined]


def _moved(module: ModuleType, name: str) -> LaunchConfigError:
    return LaunchConfigError(
        f"slime: {module.__name__} has no {name}, where the lifecycle's launch switch watches the engines "
        f"during a rollout (slime {SLIME_COMMIT}); this slime is laid out differently: update rl-lifecycle, "
        "or leave 'rollout' out of RL_LIFECYCLE_WRAP",
        framework="slime",
        module=module.__name__,
    )

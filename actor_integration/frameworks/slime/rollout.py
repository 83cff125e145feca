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
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from actor_integration.engines.sglang.actor import SGLangActorLifecycle, install_into, wrapped_engine

__all__ = ["SLIME_COMMIT", "SlimeRolloutMixin", "install", "lifecycle_engine"]

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

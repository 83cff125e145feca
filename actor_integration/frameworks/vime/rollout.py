"""vime's `VLLMEngine` (the rollout half) under the lifecycle, created where vime creates it.

    # the job's runtime env (ray job submit --runtime-env-json): the launch switch, the rollout half
    {"worker_process_setup_hook": "actor_integration.frameworks.vime.launch.vime",
     "env_vars": {"RL_LIFECYCLE_WRAP": "rollout"}}

    # or in vime/backends/vllm_utils/engine_group.py, ServerGroup.start_engines (was: ray.remote(VLLMEngine)):
    RolloutRayActor = ray.remote(lifecycle_engine(VLLMEngine))

`lifecycle_engine(VLLMEngine)` is `class LifecycleVLLMEngine(VimeRolloutMixin, VLLMEngine)`. vime's
rollout manager creates its engines in `ServerGroup.start_engines`, which imports `VLLMEngine` from
`vime.backends.vllm_utils.vllm_engine` at each call: the launch switch replaces it in that module,
in every worker of the job.

What each of vime's calls does (read from vime 8c1c944b, `vime/backends/vllm_utils/vllm_engine.py`,
`engine_group.py` and the trainer's `update_weight/update_weight_from_tensor.py`, `common.py`); the
rules are `engines.vllm.server_actor`'s and `rollout.server_actor`'s, the requests the lifecycle
sends its own are `engines.vllm.http_engine`'s:

| vime's call | plain vime | under `VimeRolloutMixin` |
|---|---|---|
| `init(...)` | launches `vllm serve`, registers it with vllm-router (`POST /workers`) | the same; a server with sleep mode (offloaded) joins the router only once a pushed version is whole and awake |
| `release_memory_occupation(level)` (offload: level 2 when the trainer updates the model, else 1) | `POST /sleep?level=&mode=keep` | the sleep: out of the router (`DELETE /workers/{url}`), then `/sleep` at that level in abort mode (vLLM pauses, aborting what runs, and clears its caches first); a second one is a no-op; one while a tag still sleeps, or while a weight update is open, is refused |
| `resume_memory_occupation(tags)` (onload_weights, onload_kv) | `POST /wake_up` with the tags vLLM has (`cuda_graph` dropped) | the wake of the released ones; a resume of an awake tag is a no-op; a level-1 sleep's weights are valid again at the wake; the last wake continues generation and rejoins the router if a whole version is loaded |
| `pause_generation(mode)` | `POST /pause?mode=` (`in_place` is vLLM's `keep`) | the same, unless the sleep's pause holds (absorbed) |
| `start_weight_update()`, `start_draft_weight_update()` | `POST /start_weight_update` | opens the update: refused while another is open (`DuplicateWeightUpdateStartError`) or the weights are released (`IllegalTransitionError`); weights unknown from here |
| `update_weights(update_info)`, `update_weights_from_distributed(...)` | `POST /update_weights` | a chunk of the open update; refused with none open (`WeightUpdateNotStartedError`) |
| `finish_weight_update(weight_version)` | `POST /finish_weight_update` | closes the update; its version is whole if a chunk came; refused with none open |
| `continue_generation()` | `POST /resume` | generation continues (and the server rejoins) if a whole version is awake, else at the end of the wake: returns None then; while an update is open it stays paused |
| `update_weights_from_disk(...)` | `collective_rpc reload_weights` | a whole version in one call |
| `health_generate(timeout)` | `GET /health_generate` | the same while servable; else `GET /health` (no generation); FAILED is unhealthy |
| `shutdown()` | out of the router, the server killed | the same, then the wrap's thread and connections closed |

Every other method is vime's own, unchanged (`flush_cache`, `get_weight_version`,
`set_weight_version`, `pull_weights`, the profiler). A follower (`node_rank != 0`, a headless node
of a multi-node engine) follows node 0's actor on release and resume; a weight-update call on it is
a `FollowerCallError`. vime 8c1c944b also calls routes vLLM 0.26.0 does not serve
(`/health_generate`, `/weight_info`, `/update_weight_version`): those calls answer 404 there,
wrapped or not.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, ClassVar

from actor_integration.engines.vllm.guards import VLLM_TAGS
from actor_integration.engines.vllm.server_actor import VLLMServerActorLifecycle
from actor_integration.frameworks.launch import lifecycle_class

__all__ = [
    "ROLLOUT_MODULE",
    "VIME_ROLLOUT_COMMIT",
    "VimeRolloutMixin",
    "install",
    "lifecycle_engine",
    "vllm_wake_tags",
]

VIME_ROLLOUT_COMMIT = "8c1c944b"  # the vime this adapter is read from and tested against
ROLLOUT_MODULE = "vime.backends.vllm_utils.vllm_engine"  # where ServerGroup.start_engines reads VLLMEngine


def vllm_wake_tags(tags: Sequence[str] | None) -> list[str] | None:
    """vime's `_normalize_vllm_wake_tags`: the tags vLLM has (`cuda_graph` dropped); none left is every tag."""
    if not tags:
        return None
    return [t for t in tags if t in VLLM_TAGS] or None


class VimeRolloutMixin(VLLMServerActorLifecycle):
    """vime's `VLLMEngine` methods through the rollout lifecycle; put it first in the bases."""

    lifecycle_framework: ClassVar[str] = "vime"

    def _own(self, name: str) -> Any:
        """vime's own method `name`: the engine class after the lifecycle's in the bases."""
        return getattr(super(), name)

    def init(self, dist_init_addr: str, *args: Any, **kwargs: Any) -> Any:
        """vime's init (the server launched, registered unless held back), then the lifecycle."""
        result = self._own("init")(dist_init_addr, *args, **kwargs)
        bootstrap = kwargs.get("disaggregation_bootstrap_port", args[3] if len(args) > 3 else None)
        prefill = getattr(self, "worker_type", "regular") == "prefill"
        self._lc_vllm_start(dist_init_addr, bootstrap_port=bootstrap if prefill else None)
        return result

    def _register_to_router(self, server_args_dict: dict[str, Any]) -> Any:
        """vime's registration at launch, held back under "after_sync" (the wake puts the server in)."""
        self._lc_state.server_args = {k: v for k, v in server_args_dict.items() if not k.startswith("_")}
        if self._lc_admission() == "after_sync":
            self._lc_state.held_back = True
            return None
        return self._own("_register_to_router")(server_args_dict)

    def lifecycle_router_api(self) -> str:
        """vllm-router's: `POST /workers` to add, `DELETE /workers/{url}` to remove (vime's `unregister_worker`)."""
        return "workers_by_url"

    def release_memory_occupation(self, level: int = 2) -> None:
        self._lc_release(level, "release_memory_occupation")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._lc_resume(vllm_wake_tags(tags), "resume_memory_occupation")

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._lc_vllm_pause("pause_generation", lambda: self._own("pause_generation")(mode=mode))

    def continue_generation(self) -> Any:
        return self._lc_vllm_continue("continue_generation", self._own("continue_generation"))

    def start_weight_update(self) -> Any:
        return self._lc_update_start("start_weight_update", self._own("start_weight_update"))

    def start_draft_weight_update(self) -> Any:
        return self._lc_update_start("start_draft_weight_update", self._own("start_draft_weight_update"))

    def update_weights(self, update_info: Any) -> Any:
        return self._lc_update_chunk("update_weights", lambda: self._own("update_weights")(update_info))

    def update_weights_from_distributed(
        self, names: Any, dtypes: Any, shapes: Any, *, flush_cache: bool = False, weight_version: str
    ) -> Any:
        return self._lc_update_chunk(
            "update_weights_from_distributed",
            lambda: self._own("update_weights_from_distributed")(
                names, dtypes, shapes, flush_cache=flush_cache, weight_version=weight_version
            ),
        )

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        return self._lc_update_finish(
            "finish_weight_update",
            weight_version,
            lambda: self._own("finish_weight_update")(weight_version=weight_version),
        )

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Any:
        return self._lc_whole_version(
            "update_weights_from_disk",
            weight_version if weight_version is not None else f"disk:{model_path}",
            lambda: self._own("update_weights_from_disk")(
                model_path, load_format=load_format, weight_version=weight_version, flush_cache=flush_cache
            ),
        )

    def health_generate(self, timeout: float = 5.0) -> Any:
        return self._lc_health(timeout, lambda: self._own("health_generate")(timeout=timeout))

    def shutdown(self) -> Any:
        try:
            return self._own("shutdown")()
        finally:
            self._lc_close()


def lifecycle_engine(engine_class: type) -> type:
    """`class LifecycleVLLMEngine(VimeRolloutMixin, engine_class)`, built once per class (Ray pickles it by value)."""
    return lifecycle_class(VimeRolloutMixin, engine_class, __name__)


def install() -> type:
    """Make vime's rollout manager create `lifecycle_engine(VLLMEngine)`: the module's `VLLMEngine` is
    replaced (idempotent), importing it now. `actor_integration.frameworks.vime.launch.vime` does the
    same in every worker of the job, for both halves, and refuses a half left unwrapped."""
    module: Any = importlib.import_module(ROLLOUT_MODULE)
    current = module.VLLMEngine
    if not (isinstance(current, type) and issubclass(current, VimeRolloutMixin)):
        module.VLLMEngine = lifecycle_engine(current)
    wrapped: type = module.VLLMEngine
    return wrapped

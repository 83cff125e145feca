"""miles' `SGLangEngine` (the rollout half) under the lifecycle, created where miles creates it.

    # the job's runtime env (ray job submit --runtime-env-json), for train.py and train_async.py alike
    {"worker_process_setup_hook": "actor_integration.frameworks.launch.miles",
     "env_vars": {"RL_LIFECYCLE_WRAP": "rollout"}}

    # or in miles/ray/rollout/server_group.py, ServerGroup.start_engines (was: ray.remote(SGLangEngine)):
    RolloutRayActor = ray.remote(lifecycle_engine(SGLangEngine))

Both drivers create their engines through the same `ServerGroup.start_engines`, inside miles'
rollout manager (a Ray actor): `install()` replaces `SGLangEngine` in that module, in every worker
of the job. Read from miles 31f1ca96 (`miles/backends/sglang_utils/sglang_engine.py`,
`miles/ray/rollout/`); the shared rules are in `engines.sglang.actor` and `rollout.server_actor`. What differs from slime:

- `release_memory_occupation(tags)` takes tags: miles' driver offloads `cuda_graph` and, per
  `--offload-rollout-level`, `kv_cache` and `weights`. With the weights kept resident, plain miles'
  `onload_weights` resumes resident weights (SGLang's `KeyError`, the server exits); here it is a
  no-op and the weights stay valid.
- `pause_generation(mode)` (miles' default "retract") is sent as given, except while the sleep's
  pause holds (absorbed, as slime's); the sleep pauses with "abort" (retracted requests stay
  queued, and SGLang 0.5.17 asserts an idle scheduler on release).
- a version is whole at `end_weight_update()` (miles' weight-update session), else at
  `continue_generation()`; `begin_weight_update()` opens it. `update_weight_version(v)` relabels
  loaded weights.
- the router API is miles' own choice: the legacy `/add_worker` for sglang_router <= 0.2.1,
  `DELETE /workers/{url}` before 0.3, else `/workers` by id. With `--use-miles-router` the router is
  miles' own, which registers through `/add_worker` and cannot remove a worker at all: the server
  stays in it while it sleeps, and requests routed to it wait on SGLang's pause until the wake (see
  `rollout.server_actor`). miles' own `shutdown` then fails at its `POST /remove_worker` (404 through that
  router's proxy) before it kills the server; under the wrap the server is killed anyway and the
  call returns, so the rollout manager's `ray.kill` that follows it runs.
- a follower's `pause_generation` / `continue_generation` (which plain miles sends to the
  follower's own port, where no server listens) is a `FollowerCallError`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, ClassVar

from actor_integration.engines.sglang.actor import (
    SGLangActorLifecycle,
    engine_base,
    install_into,
    wrapped_engine,
)
from lifecycle import Contents

__all__ = ["MILES_COMMIT", "MilesRolloutMixin", "install", "lifecycle_engine"]

MILES_COMMIT = "31f1ca96"  # the miles this adapter is read from and tested against
ROLLOUT_MODULE = "miles.ray.rollout.server_group"  # where miles' ServerGroup.start_engines reads SGLangEngine


class MilesRolloutMixin(SGLangActorLifecycle):
    """miles' `SGLangEngine` methods through the rollout lifecycle; put it first in the bases."""

    lifecycle_framework: ClassVar[str] = "miles"

    def lifecycle_router_api(self) -> str:
        """miles' own choice, by sglang_router's version and `--use-miles-router`."""
        from packaging.version import parse

        if getattr(self.args, "use_miles_router", False):
            return "miles"  # registers as the legacy API does, but has no removal route
        owner = sys.modules[engine_base(type(self)).__module__]
        version = parse(owner.sglang_router.__version__)
        if version <= parse("0.2.1"):
            return "legacy"
        return "workers_by_url" if version < parse("0.3.0") else "workers"

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._lc_sleep(tags, "release_memory_occupation")

    def pause_generation(self, mode: str = "retract") -> Any:
        return self._lc_pause("pause_generation", lambda: self._own("pause_generation")(mode=mode))

    def _lc_pause_mode(self) -> str:
        return str(getattr(self.args, "pause_generation_mode", "abort") or "abort")

    def begin_weight_update(self, selector: str = "all") -> Any:
        return self._lc_push(
            "begin_weight_update",
            "(session)",
            lambda: self._own("begin_weight_update")(selector=selector),
        )

    def end_weight_update(self) -> Any:
        if self.node_rank != 0:
            raise self._lc_follower_error("end_weight_update", "the weight-update session is node 0's")
        result = self.lifecycle.run("sync", self._own("end_weight_update"))
        self._lc_version_end("end_weight_update")
        return result

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> Any:
        return self._lc_push(
            "update_weights_from_tensor",
            weight_version,
            lambda: self._own("update_weights_from_tensor")(
                serialized_named_tensors,
                load_format=load_format,
                flush_cache=flush_cache,
                weight_version=weight_version,
                selector=selector,
            ),
        )

    def update_weights_from_distributed(
        self,
        names: Any,
        dtypes: Any,
        shapes: Any,
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> Any:
        return self._lc_push(
            "update_weights_from_distributed",
            weight_version,
            lambda: self._own("update_weights_from_distributed")(
                names,
                dtypes,
                shapes,
                group_name,
                flush_cache=flush_cache,
                weight_version=weight_version,
                selector=selector,
            ),
        )

    def update_weight_version(self, weight_version: str) -> Any:
        """miles' relabel of the loaded weights (no bytes move): the served version follows it."""
        if self.node_rank != 0:
            raise self._lc_follower_error("update_weight_version", "the version label is node 0's server's")
        result = self._own("update_weight_version")(weight_version)
        lifecycle = self.lifecycle
        if lifecycle.contents.get("weights") is Contents.VALID and self._lc_state.loading is None:
            label = str(weight_version)

            def relabel() -> None:
                lifecycle.note_weights(
                    Contents.VALID, _int(label, lifecycle.weight_version), reason=f"relabelled {label}"
                )

            lifecycle.run("sync", relabel)
            self._lc_state.served = label
            self._lc_publish()
        return result

    def check_weights(
        self,
        action: str,
        allow_quant_error: bool = False,
        selector: str = "all",
        skip_list: list[str] | None = None,
    ) -> Any:
        return self._lc_reads_weights(
            "check_weights",
            lambda: self._own("check_weights")(
                action, allow_quant_error=allow_quant_error, selector=selector, skip_list=skip_list
            ),
        )


def _int(label: str, default: int | None) -> int:
    try:
        return int(label)
    except ValueError:
        return 0 if default is None else default


def lifecycle_engine(engine_class: type) -> type:
    """`class LifecycleSGLangEngine(MilesRolloutMixin, engine_class)`, once per class (Ray pickles it by value)."""
    return wrapped_engine(MilesRolloutMixin, engine_class, __name__)


def install() -> type:
    """Make miles' rollout manager create `lifecycle_engine(SGLangEngine)` (idempotent); see the module doc."""
    return install_into(importlib.import_module(ROLLOUT_MODULE), lifecycle_engine)

"""A vime job under the lifecycle, switched on where the job is launched, no edit of vime's source.

vime launches as slime does (its scripts, e.g. `scripts/run-qwen3-4B.sh` at d9b10e3b: `ray start
--head`, then `ray job submit --runtime-env-json=... -- python3 train.py ...`). The one change is a
key in that JSON:

    ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{
        "worker_process_setup_hook": "actor_integration.frameworks.vime.launch.vime",
        "env_vars": {"PYTHONPATH": "<vime>:/root/Megatron-LM/", "RL_LIFECYCLE_WRAP": "trainer,rollout"}
    }' -- python3 train.py --train-backend megatron --colocate ...

It is slime's launch switch (`actor_integration.frameworks.launch.install`: Ray runs the hook in
every worker of the job, never in the driver) with vime's table. `RL_LIFECYCLE_WRAP` names the
halves: `trainer`, `rollout`, or both (unset: both). Where vime resolves each class:

| class | where vime reads it | replaced |
|---|---|---|
| `MegatronTrainRayActor` (vime 20ad9630, `vime/ray/actor_group.py`) | `RayTrainGroup._allocate_gpus_for_actor` imports it from `vime.backends.megatron_utils.actor` in the driver and wraps it with `ray.remote`; Ray pickles the class it makes by value, its base by module and name | in `vime.backends.megatron_utils.actor`, where the actor's worker looks the base up: `LifecycleMegatronTrainRayActor` (`VimeLifecycleMixin` first) |
| `VLLMEngine` (vime 8c1c944b, `vime/backends/vllm_utils/engine_group.py`) | `ServerGroup.start_engines`, in the rollout manager's worker, imports it from `vime.backends.vllm_utils.vllm_engine` at each call (an older engine_group imports it at the top: that import runs after the replacement too) | in `vime.backends.vllm_utils.vllm_engine`: `LifecycleVLLMEngine` (`VimeRolloutMixin` first, `frameworks.vime.rollout`) |

vime's own class of a half asked for refuses to be created elsewhere in the job's workers
(`UnwrappedClassError`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from actor_integration.frameworks.launch import (
    SERVER_HOOKS,
    TRAINER_HOOKS,
    FrameworkLaunch,
    Replacement,
    install,
    lifecycle_class,
)

__all__ = ["VIME", "install_vime", "vime", "vime_trainer"]

VIME = FrameworkLaunch(
    framework="vime",
    commit="2b83ea20",
    replacements=(
        Replacement(
            half="trainer",
            module="vime.backends.megatron_utils.actor",
            name="MegatronTrainRayActor",
            defined_in="vime.backends.megatron_utils.actor",
            wrap="actor_integration.frameworks.vime.launch:vime_trainer",
            mixin="actor_integration.frameworks.vime:VimeLifecycleMixin",
            runs="actor and critic",
            hooks=TRAINER_HOOKS,
        ),
        Replacement(
            half="rollout",
            module="vime.backends.vllm_utils.vllm_engine",
            name="VLLMEngine",
            defined_in="vime.backends.vllm_utils.vllm_engine",
            wrap="actor_integration.frameworks.vime.rollout:lifecycle_engine",
            mixin="actor_integration.frameworks.vime.rollout:VimeRolloutMixin",
            runs="rollout engines",
            hooks=SERVER_HOOKS,
        ),
    ),
)


def vime_trainer(original: type) -> type:
    """`class LifecycleMegatronTrainRayActor(VimeLifecycleMixin, MegatronTrainRayActor)`, once."""
    from actor_integration.frameworks.vime import VimeLifecycleMixin

    return lifecycle_class(VimeLifecycleMixin, original, __name__)


def install_vime(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """`install(VIME)`: the halves `RL_LIFECYCLE_WRAP` asks for (unset: both) under the lifecycle. Returns the halves."""
    return install(VIME, os.environ if environ is None else environ)


def vime() -> None:
    """Ray's `worker_process_setup_hook` for a vime job: see the module's doc."""
    install_vime()

"""A vime job's trainer under the lifecycle, switched on where the job is launched, no edit of vime's source.

vime launches as slime does (its scripts, e.g. `scripts/run-qwen3-4B.sh` at d9b10e3b: `ray start
--head`, then `ray job submit --runtime-env-json=... -- python3 train.py ...`). The one change is a
key in that JSON:

    ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{
        "worker_process_setup_hook": "actor_integration.frameworks.vime.launch.vime",
        "env_vars": {"PYTHONPATH": "<vime>:/root/Megatron-LM/", "RL_LIFECYCLE_WRAP": "trainer"}
    }' -- python3 train.py --train-backend megatron --colocate ...

It is slime's launch switch (`actor_integration.frameworks.launch.install`: Ray runs the hook in
every worker of the job, never in the driver) with vime's table. Where vime resolves the trainer
(read from vime 20ad9630, `vime/ray/actor_group.py`): `RayTrainGroup._allocate_gpus_for_actor`
imports `MegatronTrainRayActor` from `vime.backends.megatron_utils.actor` in the driver and wraps it
with `ray.remote`; Ray pickles the class it makes by value and its base by module and name, so
the actor's worker looks the base up in `vime.backends.megatron_utils.actor`, where the hook has
replaced it by `LifecycleMegatronTrainRayActor` (`VimeLifecycleMixin` first). vime's own class
refuses to be created elsewhere in the job's workers (`UnwrappedClassError`).

Only the trainer half exists for vime so far: `RL_LIFECYCLE_WRAP` unset means the trainer, and a
job that asks for "rollout" is refused (`LaunchConfigError`) rather than run with vime's
`VLLMEngine` silently outside the lifecycle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.launch import (
    TRAINER_HOOKS,
    WRAP_VARIABLE,
    FrameworkLaunch,
    Replacement,
    install,
    parse_wrap,
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
    ),
)

_TRAINERS: dict[type, type] = {}


def vime_trainer(original: type) -> type:
    """`class LifecycleMegatronTrainRayActor(VimeLifecycleMixin, MegatronTrainRayActor)`, once."""
    from actor_integration.frameworks.vime import VimeLifecycleMixin

    built = _TRAINERS.get(original)
    if built is None:
        built = type(
            f"Lifecycle{original.__name__}", (VimeLifecycleMixin, original), {"__module__": __name__}
        )
        _TRAINERS[original] = built
    return built


def install_vime(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """`install(VIME)`, refusing the halves vime has no adapter for yet. Returns the halves."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    asked = parse_wrap(env.get(WRAP_VARIABLE), VIME)
    missing = [half for half in asked if half not in VIME.halves()]
    if missing:
        raise LaunchConfigError(
            f"vime: {WRAP_VARIABLE}={env.get(WRAP_VARIABLE)!r} asks for {missing}, but rl-lifecycle puts only vime's "
            "trainer under the lifecycle so far (its VLLMEngine actor is not covered yet); use "
            f"{WRAP_VARIABLE}=trainer",
            framework="vime",
            variable=WRAP_VARIABLE,
        )
    return install(VIME, env)


def vime() -> None:
    """Ray's `worker_process_setup_hook` for a vime job: see the module's doc."""
    install_vime()

"""slime's weight-update check at every update, not only the first (opt-in, for CI and staging jobs).

    ray job submit --runtime-env-json='{"worker_process_setup_hook": "actor_integration.frameworks.launch.slime",
        "env_vars": {..., "RL_LIFECYCLE_CHECK_WEIGHTS": "every"}}' -- python3 train.py --check-weight-update-equal ...

slime's `--check-weight-update-equal` checks the first push of a job: the rollout manager snapshots
the engines' weights as loaded from the checkpoint, scrambles them (`reset_tensors`), the trainer
pushes, and the engines compare with the snapshot (`/weights_checker`, slime 624b824a
`slime/ray/placement_group.py` and `train.py`). Every later push goes unchecked, so a push that
leaves a tensor unwritten (a stale bucket, a skipped expert, a load plan keyed to moved memory)
serves old weights with no error.

With `RL_LIFECYCLE_CHECK_WEIGHTS=every` the wrapped trainer checks each push the same way, with
slime's own calls: after the push, rank 0 has the engines snapshot what they hold and scramble it;
every rank pushes the same weights again (no training in between); the engines compare. A tensor
the push does not write is random after the scramble and differs from the snapshot; a push that
writes other values each time differs too. The first push is left to slime's own check where
`--check-weight-update-equal` is on (it compares with the checkpoint: the conversion itself).
A difference stops the job with `EngineWeightsCheckError` naming the weight version.

Cost: a second push, and a host copy of the engines' weights, per update; the figure reaches
slime's tracking as `perf/lifecycle_weights_check_time`, and what the second push added to slime's
own timers (`perf/update_weights_time`, the sync's `perf/lifecycle_sync_*`) is taken back from
them, so they stay the first push's. Not for production-size models.

Unset (or `off`): no check. Refused (`LaunchConfigError`) before any GPU work: any other value, a job
whose trainer is not wrapped, `--debug-train-only` or `--debug-rollout-only` (no push to check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from actor_integration.errors import EngineWeightsCheckError, LaunchConfigError
from actor_integration.frameworks.job_output import say
from actor_integration.frameworks.settings import choice

__all__ = [
    "CHECK_MODES",
    "CHECK_TIMER",
    "CHECK_VARIABLE",
    "check_mode",
    "check_setting",
    "checked_push",
]

CHECK_VARIABLE = "RL_LIFECYCLE_CHECK_WEIGHTS"
CHECK_MODES = ("off", "every")
CHECK_TIMER = "lifecycle_weights_check"  # slime reports it as perf/lifecycle_weights_check_time


def check_mode(environ: Mapping[str, str] | None = None) -> str:
    """`off` or `every`, from `RL_LIFECYCLE_CHECK_WEIGHTS` (unset or empty: `off`)."""
    use = "use 'every' (slime's weight-update check after each push) or 'off' (the default when unset)"
    return choice(CHECK_VARIABLE, CHECK_MODES, use, environ)


def check_setting(environ: Mapping[str, str], args: Any = None) -> str | None:
    """The job's check setting, refused before any GPU work: its value (always) and, given the job's
    parsed flags, whether the job pushes at all. Returns a line for the job's output, or None when off."""
    if check_mode(environ) == "off":
        return None
    if args is None:
        return f"{CHECK_VARIABLE}=every"
    for flag in ("debug_train_only", "debug_rollout_only"):
        if getattr(args, flag, False):
            raise LaunchConfigError(
                f"{CHECK_VARIABLE}=every checks each weight update, and --{flag.replace('_', '-')} pushes none: "
                f"unset {CHECK_VARIABLE}",
                variable=CHECK_VARIABLE,
            )
    first = (
        "the first by slime's own --check-weight-update-equal"
        if getattr(args, "check_weight_update_equal", False)
        else "the first one included"
    )
    return (
        f"{CHECK_VARIABLE}=every: each weight update is pushed twice and compared with slime's /weights_checker "
        f"({first})"
    )


def checked_push(
    push: Callable[[], Any],
    *,
    manager: Any,
    lead: bool,
    version: int,
    timer: Any = None,
) -> Any:
    """Push again what was just pushed, between a snapshot and a scramble of the engines' weights and
    their comparison, with slime's own `check_weights` on its rollout manager (`manager`, a Ray actor
    handle). `lead`: this rank makes the manager's calls (rank 0); every rank calls `push`, which meets
    the others inside slime's update. `timer`: slime's `Timer()` (None: no timers to keep straight).
    Raises `EngineWeightsCheckError` when the engines' weights differ."""
    import ray

    started = time.perf_counter()
    before = dict(timer.log_dict()) if timer is not None else {}
    if lead:
        ray.get(manager.check_weights.remote(action="snapshot"))
        ray.get(manager.check_weights.remote(action="reset_tensors"))
    result = push()
    if lead:
        try:
            ray.get(manager.check_weights.remote(action="compare"))
        except Exception as error:  # slime's request raises on the engine's answer; Ray wraps it (its cause)
            cause = getattr(error, "cause", None) or error
            raise EngineWeightsCheckError(
                f"weight update {version}: the engines' weights differ from what the same push writes again "
                f"(slime's /weights_checker compare after snapshot, reset_tensors and the push repeated): "
                f"{type(cause).__name__}: {cause}",
                version=version,
            ) from error
    seconds = time.perf_counter() - started
    if timer is not None:
        for name, value in timer.log_dict().items():
            added = value - before.get(name, 0.0)
            if added and name != CHECK_TIMER:
                timer.add(name, -added)  # the second push's share of slime's own timers, taken back
        timer.add(CHECK_TIMER, seconds)
    if lead:
        say(
            f"weights check, update {version}: equal ({seconds * 1e3:.1f} ms: snapshot, reset, push again, compare)"
        )
    return result

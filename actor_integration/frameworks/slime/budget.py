"""A slime trainer's sleep that frees only what the colocated rollout engines need (opt-in).

    ray job submit --runtime-env-json='{"worker_process_setup_hook": "actor_integration.frameworks.launch.slime",
        "env_vars": {..., "RL_LIFECYCLE_MEMORY_BUDGET": "rollout"}}' -- python3 train.py --colocate \\
        --sglang-mem-fraction-static 0.5 ...

slime's trainer sleep frees everything: its memory to host, and every NCCL communicator destroyed
(in slime's own job on one H100, 460 ms of each wrapped sleep after a train step was that teardown;
docs/measurements.md). Colocated, what must be free afterwards is what the engines on the same GPU
take back when they wake: SGLang's `mem_fraction_static` of the device (its weights and KV cache;
slime passes it as `--sglang-mem-fraction-static`). With `RL_LIFECYCLE_MEMORY_BUDGET=rollout` the
trainer declares that need (`Lifecycle.expect`) and runs under `LifecyclePolicy(memory_budget=...)`:
each sleep keeps what leaves the need free (plus the budget's margin), releases the cheapest rest
otherwise, checks the need is free after it (`MemoryBudgetShortError` before the engines wake), and
logs its plan (`lifecycle.budget`). The ranks agree on one plan over the default group's store.

Unset (or `off`): slime's full sleep, as without this module. Refused (`LaunchConfigError`): any
other value; `rollout` without `--colocate` (the engines have GPUs of their own: nothing to free for
them) or without `--sglang-mem-fraction-static` (SGLang's automatic fraction is not known here).
Under the launch switch these are refused before any GPU work (`check_budget`): the value when the
switch installs in each worker, the flags where the rollout manager is about to start the engines
(before the trainers are created).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.settings import choice

__all__ = ["BUDGET_MODES", "BUDGET_VARIABLE", "budget_mode", "check_budget", "rollout_need_bytes"]

BUDGET_VARIABLE = "RL_LIFECYCLE_MEMORY_BUDGET"
BUDGET_MODES = ("off", "rollout")


def budget_mode(environ: Mapping[str, str] | None = None) -> str:
    """`off` or `rollout`, from `RL_LIFECYCLE_MEMORY_BUDGET` (unset or empty: `off`)."""
    use = "use 'rollout' (each trainer sleep frees only what the colocated engines need) or 'off' (slime's full "
    return choice(BUDGET_VARIABLE, BUDGET_MODES, use + "sleep; the default when unset)", environ)


def rollout_need_bytes(args: Any, device_total_bytes: int) -> int:
    """What the colocated engines take back on this device when they wake: SGLang's
    `--sglang-mem-fraction-static` of it. Refused where the job gives no such need."""
    if not getattr(args, "colocate", False):
        raise LaunchConfigError(
            f"{BUDGET_VARIABLE}=rollout plans the trainer's sleep around the engines on the same GPUs, and this "
            f"job has no --colocate (its engines have GPUs of their own); unset {BUDGET_VARIABLE}",
            variable=BUDGET_VARIABLE,
        )
    fraction = getattr(args, "sglang_mem_fraction_static", None)
    if fraction is None:
        raise LaunchConfigError(
            f"{BUDGET_VARIABLE}=rollout needs the engines' share of the GPU, and SGLang's is chosen at its start "
            "when --sglang-mem-fraction-static is not given: pass --sglang-mem-fraction-static (e.g. 0.5), "
            f"or unset {BUDGET_VARIABLE}",
            variable=BUDGET_VARIABLE,
        )
    if not 0 < float(fraction) <= 1:
        raise LaunchConfigError(
            f"{BUDGET_VARIABLE}=rollout: --sglang-mem-fraction-static is {fraction!r}; it must be in (0, 1]",
            variable=BUDGET_VARIABLE,
        )
    return int(float(fraction) * device_total_bytes)


def check_budget(environ: Mapping[str, str], args: Any = None) -> str | None:
    """The job's budget setting, checked before any GPU work: its value (always) and, given the job's
    parsed flags, what `rollout` needs of them. Returns a line for the job's output, or None when off."""
    if budget_mode(environ) == "off":
        return None
    if args is None:
        return f"{BUDGET_VARIABLE}=rollout"
    rollout_need_bytes(args, 1)  # the flags only: the device's size is the trainer's to read
    fraction = float(args.sglang_mem_fraction_static)
    return (
        f"{BUDGET_VARIABLE}=rollout: each trainer sleep frees only what leaves {fraction:g} of its GPU free "
        "(--sglang-mem-fraction-static) for the colocated engines"
    )

"""The lifecycle's transitions into a framework's own timers, so its perf metrics keep their meaning.

slime times `sleep`, `wake_up`, `save_model` and `update_weights` with its `@timer` (a singleton
`Timer`, `slime/observability/timer.py`), and `log_perf_data` reports every entry as
`perf/<name>_time` through slime's tracking (wandb, tensorboard). Under the lifecycle a sleep or a
wake is a plan the machine runs, often inside another operation (the wake before `train`, the sleep
after `save_model`), where slime's decorators never see it. `TimerFeed` observes the machine
(`Lifecycle.observe`) and adds each transition where slime's timers would have counted it:

- a sleep plan to `sleep`, a wake plan to `wake_up` (`perf/sleep_time`, `perf/wake_up_time`);
- the plans that open and close a timed operation to that operation's timer as well (the groups a
  sync brings up and down to `update_weights`, the wake and sleep around a save to `save_model`),
  as slime's decorated methods include them;
- the lifecycle's own figures: `lifecycle_<plan>` per plan and `lifecycle_<plan>_<hook>` per hook
  (`perf/lifecycle_sleep_time`, `perf/lifecycle_sleep_process_groups_destroy_time`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lifecycle.logs import Event

__all__ = ["SLIME_OPERATION_TIMERS", "SLIME_PLAN_TIMERS", "TimerFeed"]

# slime's own timer names for the lifecycle's plans and operations (slime/backends/megatron_utils/actor.py).
SLIME_PLAN_TIMERS: Mapping[str, str] = {"sleep": "sleep", "wake": "wake_up", "partial_wake": "wake_up"}
SLIME_OPERATION_TIMERS: Mapping[str, str] = {"save": "save_model", "sync": "update_weights"}


class TimerFeed:
    """An observer (`Lifecycle.observe`) adding each transition's seconds to a framework's timer.

    `timer()` returns an object with `add(name, seconds)` (slime's `Timer()`); `plan_timers` and
    `operation_timers` name the framework's own entries; `after_plan(plan)` runs after each plan
    (slime's memory printout after a sleep or a wake). `prefix` names the lifecycle's own figures.
    """

    def __init__(
        self,
        timer: Callable[[], Any],
        *,
        plan_timers: Mapping[str, str] = SLIME_PLAN_TIMERS,
        operation_timers: Mapping[str, str] = SLIME_OPERATION_TIMERS,
        after_plan: Callable[[str], None] | None = None,
        prefix: str = "lifecycle",
    ) -> None:
        self.timer = timer
        self.plan_timers = dict(plan_timers)
        self.operation_timers = dict(operation_timers)
        self.after_plan = after_plan
        self.prefix = prefix

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        plan = fields.get("plan")
        if event != Event.TRANSITION.value or not plan:
            return
        seconds = float(fields.get("duration_ms", 0.0)) / 1e3
        timer = self.timer()
        own = self.plan_timers.get(plan)
        if own is not None:
            timer.add(own, seconds)
        operation = self.operation_timers.get(str(fields.get("operation")))
        if operation is not None and fields.get("phase") in ("enter", "exit"):
            timer.add(operation, seconds)  # the framework's decorated method covers its wake and sleep
        timer.add(f"{self.prefix}_{plan}", seconds)
        for hook in fields.get("hooks") or ():
            name = str(hook.get("name", "")).replace(".", "_")
            timer.add(f"{self.prefix}_{plan}_{name}", float(hook.get("ms", 0.0)) / 1e3)
        if self.after_plan is not None:
            self.after_plan(plan)

"""`lifecycle.budget` and `lifecycle.budget_checked`: a sleep's memory-budget plan, and whether the need was met.

The plan is recomputed from the inputs the event logs (`plan_releases` is deterministic), so a
plan the inputs do not give is a finding; the next sleep edge is replayed with it (`state.plan`).
A check that found the need not free must have raised (the sleep then fails, and is replayed so).
"""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.state import Key, Replay, ReplayedMachine
from lifecycle.budget import BudgetInputs, BudgetPlan, plan_releases
from lifecycle.errors import LogFieldError

MIB = 1 << 20


def budget(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A sleep's plan: the one its logged inputs give; the next sleep edge releases only it."""
    if "items" not in d:  # no plan made (no free-memory figure): the sleep releases everything
        m.budget = None
        return
    try:
        inputs = BudgetInputs.from_dict(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise LogFieldError(f"the budget's inputs cannot be read: {exc!r}") from None
    expected = plan_releases(inputs)
    logged = logs.get(d, "plan")
    if not isinstance(logged, dict):
        raise LogFieldError(f"plan={logged!r} is not a mapping of item to way")
    if logged != dict(expected.choices):
        replay.at(
            key,
            line,
            f"memory budget: the plan logged {logged} is not the plan its inputs give {dict(expected.choices)} "
            f"(need {inputs.need_bytes / MIB:.0f} MiB, free {inputs.free_bytes / MIB:.0f} MiB, margin "
            f"{inputs.margin_bytes / MIB:.0f} MiB)",
        )
    m.budget = BudgetPlan(tuple((str(k), str(v)) for k, v in logged.items()), expected.feasible, 0, 0.0, 0)


def budget_checked(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """After a budgeted sleep: the need is free, or the check raised (and the sleep failed)."""
    need, free = logs.get(d, "need_bytes"), logs.get(d, "free_bytes")
    if not isinstance(need, int) or not isinstance(free, int):
        raise LogFieldError(f"need_bytes={need!r}, free_bytes={free!r} are not byte counts")
    if free < need and d.get("raised") is not True:
        replay.at(
            key,
            line,
            f"memory budget: after the sleep {free / MIB:.0f} MiB were free, the next phase needs "
            f"{need / MIB:.0f} MiB ({(need - free) / MIB:.0f} MiB short), and nothing raised: the other "
            "phase's wake would run out of memory",
        )

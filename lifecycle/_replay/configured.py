"""`lifecycle.configured`: the machine a log starts, and what its first line must agree on."""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import fmt_residency
from lifecycle._replay.state import Key, Replay, ReplayedMachine
from lifecycle.errors import LogFieldError
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import ASLEEP, ASLEEP_GROUPS, Communicators, Contents, Groups, Hook, Residency, State


def configured(replay: Replay, key: Key, line: int, d: dict[str, Any]) -> ReplayedMachine | None:
    """The machine a `lifecycle.configured` line starts; None when its policy cannot be read (reported)."""
    try:
        policy = LifecyclePolicy.from_dict(logs.get(d, "policy"))
        hooks = logs.get(d, "hooks")
        if not isinstance(hooks, list):
            raise LogFieldError(f"hooks={hooks!r} is not a list of hook names")
        present = frozenset(logs.member(Hook, h, "hooks") for h in hooks)
        state = logs.enum_field(d, "state", State)
        residency = logs.residency(d)
        groups = logs.optional_enum(d, "groups", Groups)
        contents = logs.contents(d)
        # Logs written before the ways existed have none: their backends destroyed.
        communicators = logs.member(Communicators, d.get("communicators", "destroy"), "communicators")
    except (TypeError, ValueError, AttributeError) as exc:  # LogFieldError is a ValueError
        replay.at(key, line, f"lifecycle.configured cannot be read ({exc}); this machine is not replayed")
        return None
    m = ReplayedMachine(policy.view(), policy.tags, present, state, residency, groups, line)
    m.communicators = m.way = communicators
    m.budgeted = policy.memory_budget is not None
    if contents is not None:
        m.contents = {t: contents.get(t, Contents.UNKNOWN) for t in policy.tags}
        m.since = dict.fromkeys(policy.tags, line)
    if state not in (State.AWAKE, State.PAUSED):
        replay.at(key, line, f"a machine starts AWAKE or PAUSED, but this one is configured {state}")
    if set(residency) != set(policy.tags):
        replay.at(
            key,
            line,
            f"residency names tags {sorted(residency)}, but the policy's tags are {list(policy.tags)}",
        )
        m.residency = {t: residency.get(t, Residency.UNKNOWN) for t in policy.tags}
    if state is State.AWAKE and not all(r is Residency.RESIDENT for r in residency.values()):
        replay.at(
            key,
            line,
            f"configured AWAKE with residency {fmt_residency(residency)}; AWAKE starts all resident",
        )
    has_groups = Hook.PROCESS_GROUPS_DESTROY in present
    if has_groups != (groups is not None):
        replay.at(
            key,
            line,
            f"groups={groups and groups.value} but the process-group hooks are "
            f"{'present' if has_groups else 'absent'}",
        )
    if groups in ASLEEP_GROUPS and groups is not ASLEEP[communicators]:
        replay.at(
            key,
            line,
            f"configured with groups {groups and groups.value}, but the backend declares "
            f"communicators={communicators.value}, whose sleep leaves them {ASLEEP[communicators].value}",
        )
    return m

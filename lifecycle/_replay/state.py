"""What the replay knows of each machine, and what every rule shares: where findings go, how a
logged line is read and compared with the replay, and how a lost replay follows the log."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import fmt_res
from lifecycle.budget import COMMUNICATORS, BudgetPlan, narrow
from lifecycle.errors import LogFieldError
from lifecycle.logs import Event
from lifecycle.table import (
    ASLEEP_GROUPS,
    GROUPS_DOWN,
    GROUPS_UP,
    SLEEP,
    Call,
    Communicators,
    Contents,
    Edge,
    Groups,
    Hook,
    PolicyView,
    Residency,
    Row,
    State,
    deferred_tags,
    plan_calls,
    unheld_residency,
    update_contents,
)

Key = tuple[str, "int | None", "str | None"]  # (file, rank, role): one machine
Report = Callable[[str, int, "int | None", "str | None", str], None]  # (path, line, rank, role, message)
Rule = Callable[["Replay", Key, "ReplayedMachine", int, dict[str, Any]], None]  # one kind of event


@dataclass
class OpenOperation:
    """The body operation in progress: its row, where it started, whether its body was logged."""

    row: Row
    line: int
    body_done: bool = False


@dataclass
class ReplayedMachine:
    """What the replay knows about one actor's machine."""

    policy: PolicyView
    tags: tuple[str, ...]
    present: frozenset[Hook]
    state: State
    residency: dict[str, Residency]
    groups: Groups | None
    line: int
    op: OpenOperation | None = None
    lost: bool = False  # after a contradiction: follow the log until a transition says where it is
    last_t: tuple[float, int] | None = None
    failed: str | None = None  # "line N: hook raised" while FAILED
    contents: dict[str, Contents] | None = None  # None: the log predates contents
    since: dict[str, int] | None = None  # tag → line where its contents last changed
    holds: int = 0  # holds taken (held scopes)
    unheld: dict[str, Residency] | None = None  # the residency the scope's calls leave without it
    held_line: int | None = None  # where the first hold of the open scope was taken
    releasing: bool = False  # a release ran its sleep (or failed in it); its lifecycle.release follows
    communicators: Communicators = Communicators.DESTROY  # what a process_groups.destroy leaves
    way: Communicators = Communicators.DESTROY  # what the groups' last destroy did (a budget may choose)
    budget: BudgetPlan | None = None  # the memory budget's plan for the next sleep (lifecycle.budget)
    budgeted: bool = False  # the policy has a memory budget
    sync_reloaded: bool = True  # the open sync's groups_up reloaded the groups (the machine's rule)

    @property
    def deferred(self) -> tuple[str, ...]:
        return deferred_tags(self.residency, self.unheld)

    def replay_unheld(self, op: str, targets: tuple[str, ...]) -> None:
        """An operation finished inside a held scope: replay it on the rows outside one (the machine's rule)."""
        if not self.holds or self.state is State.FAILED:
            return
        if op == "recover" or self.unheld is None:
            self.unheld = dict(self.residency)
        else:
            self.unheld = unheld_residency(op, targets, self.policy, self.unheld)

    def apply(self, call: Call, ok: bool, line: int) -> None:
        """A memory hook's effect on contents (the table's rule), remembering where it changed."""
        if self.contents is None or self.since is None or call.tag not in self.contents:
            return
        before = self.contents[call.tag]
        update_contents(call, ok, self.policy, self.contents)
        if self.contents[call.tag] is not before:
            self.since[call.tag] = line

    def take_contents(self, d: Mapping[str, Any], line: int) -> None:
        """The log's word for the contents (after a contradiction)."""
        logged = logs.contents(d)
        if self.contents is not None and self.since is not None and logged is not None:
            for tag, value in logged.items():
                if tag in self.contents and self.contents[tag] is not value:
                    self.contents[tag], self.since[tag] = value, line


@dataclass(frozen=True)
class Replay:
    """What every rule reports to: findings through `report`, matched table rows in `rows_seen`."""

    report: Report
    rows_seen: collections.Counter[Row]

    def at(self, key: Key, line: int, message: str) -> None:
        """Report one finding at a line of the machine `key`."""
        self.report(key[0], line, key[1], key[2], message)

    def check_t(self, key: Key, m: ReplayedMachine, line: int, d: Mapping[str, Any]) -> None:
        """A line's time must increase along the machine's lines."""
        t = logs.number(d, "t", "a time in epoch seconds")
        if m.last_t is not None and t <= m.last_t[0]:
            self.at(
                key,
                line,
                f"t={t:.6f} does not increase: line {m.last_t[1]} has t={m.last_t[0]:.6f} "
                f"({(t - m.last_t[0]) * 1e3:+.3f} ms); lines are out of order or the clock stepped back",
            )
        m.last_t = (t, line)

    def compare_after(
        self,
        key: Key,
        m: ReplayedMachine,
        line: int,
        what: str,
        residency: dict[str, Residency],
        groups: Groups | None,
    ) -> None:
        """The residency and process groups a line logs must be the replay's."""
        if residency != m.residency:
            diffs = [
                f"{tag}: logged {fmt_res(residency.get(tag))}, replay {fmt_res(m.residency.get(tag))}"
                for tag in dict.fromkeys([*m.residency, *residency])
                if residency.get(tag) is not m.residency.get(tag)
            ]
            self.at(key, line, f"{what}: logged residency differs from the replay ({'; '.join(diffs)})")
        if groups is not m.groups:
            self.at(
                key,
                line,
                f"{what}: logged process groups {groups and groups.value}, replay says {m.groups and m.groups.value}",
            )

    def compare_contents(
        self, key: Key, m: ReplayedMachine, line: int, what: str, d: Mapping[str, Any]
    ) -> None:
        """The contents a line logs (if any) must be the replay's."""
        logged = logs.contents(d)
        if logged is None or m.contents is None or logged == m.contents:
            return
        diffs = [
            f"{tag}: logged {logged[tag].value if tag in logged else 'nothing'}, replay {m.contents[tag].value}"
            for tag in m.contents
            if logged.get(tag) is not m.contents[tag]
        ]
        self.at(key, line, f"{what}: logged contents differ from the replay ({'; '.join(diffs)})")


def plan(m: ReplayedMachine, edge: Edge, targets: tuple[str, ...]) -> list[Call]:
    """The hook calls the table plans for a logged edge, from the replayed residency and groups."""
    if edge.plan is None:
        return []
    view, present = m.policy, m.present
    if edge.plan is SLEEP and m.groups is Groups.ALIVE:
        # The machine's rule: the groups go down the plan's way for the communicators where it
        # chose a release way (the logged inputs offered it), else the configured one.
        narrowed = m.budget is not None and edge.operation != "recover"
        chosen = dict(m.budget.choices).get(COMMUNICATORS) if narrowed and m.budget is not None else None
        m.way = m.communicators
        if chosen in (Communicators.DESTROY.value, Communicators.SUSPEND.value):
            m.way = Communicators(chosen)
    if m.budget is not None and edge.plan is SLEEP and edge.operation != "recover":
        view, targets, present = narrow(m.budget, view, targets, present)
    elif m.budgeted and edge.plan is GROUPS_UP:
        m.sync_reloaded = m.groups in ASLEEP_GROUPS
    elif m.budgeted and edge.plan is GROUPS_DOWN and not m.sync_reloaded:
        view = dataclasses.replace(view, destroy_process_groups=False)  # the budget kept the groups
    return plan_calls(edge.plan, view, m.residency, m.groups, targets, present)


def read_targets(m: ReplayedMachine, d: Mapping[str, Any]) -> tuple[str, ...]:
    """The tags a line says its operation acted on: a non-empty list of the machine's tags."""
    targets = logs.get(d, "targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LogFieldError(f"targets={targets!r} is not a non-empty list of tags")
    unknown = [t for t in targets if t not in m.tags]
    if unknown:
        raise LogFieldError(f"targets {unknown} are not among this machine's tags {list(m.tags)}")
    return tuple(targets)


def unheld_from(m: ReplayedMachine, d: Mapping[str, Any]) -> dict[str, Residency]:
    """The log's word for a held scope's deferred tags, as the residency they leave without it."""
    logged = d.get("deferred")
    deferred = {t for t in logged if isinstance(t, str)} if isinstance(logged, list) else set()
    return {t: Residency.RELEASED if t in deferred else r for t, r in m.residency.items()}


def follow(replay: Replay, key: Key, m: ReplayedMachine, line: int, event: Event, d: dict[str, Any]) -> None:
    """Take the state from the log, unchecked, until a move or exit transition or a failure."""
    if event is Event.TRANSITION:
        m.state = logs.enum_field(d, "dst", State)
        m.lost = logs.text(d, "phase") == "enter"
    elif event is Event.FAILED:
        m.state, m.lost, m.failed = State.FAILED, False, f"line {line}: hook {d.get('hook')} raised"
    elif event in (Event.BODY, Event.NOOP, Event.REFUSED):
        m.state = logs.enum_field(d, "state", State)
    if event in (Event.TRANSITION, Event.FAILED, Event.CONTENTS, Event.RESOLVED):
        m.take_contents(d, line)
    if event in (Event.TRANSITION, Event.FAILED):
        residency = logs.residency(d)
        if set(residency) == set(m.tags):
            m.residency = residency
        m.groups = logs.optional_enum(d, "groups", Groups)
    if event is Event.RESOLVED and isinstance(d.get("resolved"), dict):
        for tag, value in d["resolved"].items():
            if tag in m.residency:
                m.residency[tag] = logs.member(Residency, value, "resolved")
            elif tag == "process_groups":
                m.groups = logs.member(Groups, value, "resolved")
    if event in (Event.TRANSITION, Event.BODY):
        replay.check_t(key, m, line, d)
    if event in (Event.HOLD, Event.RELEASE):
        m.holds = logs.integer(d, "holds")
        m.unheld = dict(m.residency) if m.holds else None
    if event is Event.DEFERRED:
        m.unheld = unheld_from(m, d)

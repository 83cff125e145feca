"""Replay lifecycle JSON-lines logs against the transition table and report what cannot have happened.

    findings = check_files(["logs/rank0.jsonl", "logs/rank1.jsonl"])
    for finding in findings:
        print(finding)  # rank0.jsonl:42 rank 0 trainer: sync from PAUSED did not reload the process groups: ...

Each machine (file + rank + role) is replayed from its `lifecycle.configured` event with the
table's own functions (`select_row`, `row_edges`, `plan_calls`, `apply_call`, `mark_unknown`,
`body_ready`); this module restates no rule of the table. Where the log contradicts the replay's
state, the replay takes the log's word until the next transition says where the machine is, so one
bad line gives one finding, not a cascade; a wrong hook list or residency is reported and the
table's residency kept. Weight-sync events are handed, with the replayed state, to
`lifecycle.sync_checks`, which also checks them across the ranks of a slot.

Nothing reads as clean by accident: a file with no lifecycle event at all (empty, or another
application's log) is a finding for the whole file (line 0), and each line that is not an event
(not JSON, or an event missing a field it needs) is a finding at its line; the rest of the file is
still replayed.

Contents are replayed too (`update_contents`, `resolve_contents`, the sync body's
`lifecycle.contents` declarations): a `generate` body on weights whose contents are discarded or
unknown is reported with the line where they became so. Logs written before contents existed
(no `contents` in `lifecycle.configured`) are replayed without them.

Held scopes are replayed from `lifecycle.hold` and `lifecycle.release`: rows are selected with the
replayed number of holds, each operation inside a scope is replayed on the rows outside one
(`unheld_residency`), and the deferred tags (`deferred_tags`) are compared with each
`lifecycle.deferred` and with what the release of the last hold slept. A pause inside a held scope,
or a last release that left deferred tags resident, is reported at its line.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle import logs
from lifecycle.errors import LogFieldError
from lifecycle.logs import Event, LogFile, LogLine, parse_lines, read_logs
from lifecycle.policy import LifecyclePolicy
from lifecycle.roster import Roster
from lifecycle.sync_checks import WeightSyncChecks
from lifecycle.table import (
    ALL_TAGS,
    ASLEEP,
    ASLEEP_GROUPS,
    EDGES,
    LIFECYCLE_CALLS,
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
    apply_call,
    body_ready,
    deferred_tags,
    failed_run,
    invalid_weights,
    mark_unknown,
    plan_calls,
    resolve_contents,
    row_edges,
    rows_for,
    select_row,
    unheld_residency,
    update_contents,
)

__all__ = ["Finding", "LogChecker", "check_files", "check_lines", "check_logs"]


@dataclass(frozen=True)
class Finding:
    """One thing in a log that the transition table says cannot have happened.

    `line` counts from 1; line 0 is the file as a whole (a file with no lifecycle events).
    """

    path: str
    line: int
    rank: int | None
    role: str | None
    message: str

    def __str__(self) -> str:
        who = " ".join(p for p in (None if self.rank is None else f"rank {self.rank}", self.role) if p)
        where = f"{self.path}:{self.line}" if self.line else self.path
        text = f"{where} {who}: {self.message}" if who else f"{where}: {self.message}"
        # A log's JSON can carry lone surrogates ("\udc80"), which no terminal encoding prints.
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_lines(lines: Iterable[str], path: str = "<lines>") -> list[Finding]:
    """Check the lines of one log held in memory; `path` names it in the findings."""
    checker = LogChecker()
    checker.feed(path, lines)
    return checker.finish()


def check_files(paths: Iterable[str | Path]) -> list[Finding]:
    """Check log files (or directories of `*.jsonl`) together; an empty list means the logs are clean."""
    return check_logs(read_logs(paths))


def check_logs(files: Iterable[LogFile]) -> list[Finding]:
    """Check logs already read with `lifecycle.logs.read_logs` (a caller that also draws them reads once)."""
    checker = LogChecker()
    for file in files:
        checker.feed_lines(file.path, file.lines)
    return checker.finish()


# ----------------------------------------------------------------------------------------------
# Replay state


_Key = tuple[str, "int | None", "str | None"]


@dataclass
class _Open:
    """The body operation in progress: its row, where it started, whether its body was logged."""

    row: Row
    line: int
    body_done: bool = False


@dataclass
class _Machine:
    """What the replay knows about one actor's machine."""

    policy: PolicyView
    tags: tuple[str, ...]
    present: frozenset[Hook]
    state: State
    residency: dict[str, Residency]
    groups: Groups | None
    line: int
    op: _Open | None = None
    lost: bool = False  # after a contradiction: follow the log until a transition says where it is
    last_t: tuple[float, int] | None = None
    failed: str | None = None  # "line N: hook raised" while FAILED
    contents: dict[str, Contents] | None = None  # None: the log predates contents
    since: dict[str, int] | None = None  # tag → line where its contents last changed
    holds: int = 0  # holds taken (held scopes)
    unheld: dict[str, Residency] | None = None  # the residency the scope's calls leave without it
    held_line: int | None = None  # where the first hold of the open scope was taken
    releasing: bool = False  # a release ran its sleep (or failed in it); its lifecycle.release follows

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

    communicators: Communicators = Communicators.DESTROY  # what a process_groups.destroy leaves

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


_SYNC_EVENTS = (Event.SYNC_UPDATE, Event.SYNC_LOADED)

# How a missing hook call reads in a finding.
_DID_NOT = {
    Hook.GENERATION_PAUSE: "pause generation",
    Hook.ROUTING_REPLAY_CLEAR: "clear the routing replay",
    Hook.CLEAR_MEMORY: "clear memory",
    Hook.PROCESS_GROUPS_DESTROY: "destroy the process groups",
    Hook.MEMORY_PAUSE: "pause tag {tag}",
    Hook.MEMORY_RESUME: "resume tag {tag}",
    Hook.PROCESS_GROUPS_RELOAD: "reload the process groups",
    Hook.SWITCH_MODEL: "restore the model tag",
    Hook.GENERATION_RESUME: "resume generation",
}


class LogChecker:
    """Replays any number of logs; `feed` each file, then `finish` for the sorted findings.

    `rows_seen` counts the table rows the replay matched, so a caller can see which rows a
    corpus exercised.
    """

    def __init__(self) -> None:
        self.rows_seen: collections.Counter[Row] = collections.Counter()
        self.events = 0
        self._findings: list[Finding] = []
        self._order: dict[str, int] = {}
        self._machines: dict[_Key, _Machine] = {}
        self._broken: set[_Key] = set()  # configured with a policy we cannot read: not replayed
        self._actors: set[tuple[int | None, str | None]] = set()  # (rank, role) of every event read
        self._sync = WeightSyncChecks(self._report)
        self._roster = Roster(self._report)  # the ranks a run had and which of them its logs lose

    @property
    def machines(self) -> int:
        """How many machines (file, rank, role) were configured."""
        return len(self._machines)

    def feed(self, path: str, lines: Iterable[str]) -> None:
        """Replay the lines of one file."""
        self.feed_lines(path, parse_lines(lines))

    def feed_lines(self, path: str, lines: Iterable[LogLine]) -> None:
        """Replay the parsed lines of one file; a file with no lifecycle event at all is a finding."""
        self._order.setdefault(path, len(self._order))
        orphans: dict[_Key, LogLine] = {}  # first lifecycle event of a machine not configured yet
        unreadable: list[int] = []  # lines that are not events
        events = lifecycle_events = 0
        for entry in lines:
            if entry.event is None:
                self._report(path, entry.line, None, None, entry.error or "unreadable line")
                unreadable.append(entry.line)
                continue
            self.events += 1
            events += 1
            data = entry.event
            self._roster.note(path, entry.line, data)
            name = data["event"]
            try:
                key = self._key(path, data)
            except LogFieldError as exc:
                self._report(path, entry.line, None, None, f"{name} {exc}")
                continue
            event = Event.of(name)
            if event is None or not (event.is_lifecycle or event in _SYNC_EVENTS):
                continue
            lifecycle_events += event.is_lifecycle
            self._actors.add(key[1:])
            try:
                if event is Event.CONFIGURED:
                    orphan = orphans.pop(key, None)
                    if orphan is not None and orphan.event is not None:
                        self._report(
                            path,
                            orphan.line,
                            key[1],
                            key[2],
                            f"{orphan.event['event']} comes before this machine's lifecycle.configured "
                            f"(line {entry.line}); a machine logs nothing before it is configured",
                        )
                    self._configured(key, entry.line, data)
                    continue
                if key in self._broken:
                    continue
                machine = self._machines.get(key)
                if machine is None:
                    if event.is_lifecycle:
                        orphans.setdefault(key, entry)
                    elif key in orphans:
                        # Its lifecycle.configured is missing (reported once, below): the sync
                        # events are still checked, in a state the replay does not know.
                        self._sync.event(event, key, None, entry.line, data)
                    elif key[1:] != (None, None):
                        # Without rank or role the event was not logged through Lifecycle.event: no
                        # actor to check it against. With them, its machine must be in this file.
                        self._report(
                            path,
                            entry.line,
                            key[1],
                            key[2],
                            f"{name} from an actor with no lifecycle machine in this file "
                            "(no lifecycle.configured with this rank and role before it)",
                        )
                    continue
                self._dispatch(event, key, machine, entry.line, data)
            except (LogFieldError, RecursionError) as exc:
                problem = exc if isinstance(exc, LogFieldError) else "nested too deep to read"
                self._report(path, entry.line, key[1], key[2], f"malformed {name}: {problem}")
                lost = self._machines.get(key)
                if lost is not None and event.is_lifecycle:
                    lost.op, lost.lost = None, True
        for key, orphan in orphans.items():
            before = [n for n in unreadable if n < orphan.line]
            why = (
                f"line {before[-1]} before it cannot be read: it may have been this machine's lifecycle.configured"
                if before
                else "its first lines are missing, or the log was written below level info"
            )
            self._report(
                path,
                orphan.line,
                key[1],
                key[2],
                f"lifecycle events but no lifecycle.configured for this machine (first here); {why}",
            )
        mine = [(k[1], k[2], m.op) for k, m in self._machines.items() if k[0] == path and m.op is not None]
        self._roster.end_file(path, [(rank, role, op.line, op.row.operation) for rank, role, op in mine])
        if not lifecycle_events:
            found = (
                "the file is empty"
                if not events and not unreadable
                else f"none of its {len(unreadable)} line(s) is a log event"
                if not events
                else f"none of its {events} event(s) is a lifecycle.* event"
            )
            self._report(
                path,
                0,
                None,
                None,
                f"no lifecycle events: {found}; is it a lifecycle log? per-rank logs are written by "
                "lifecycle.configure_logging(json_path=...) at level info",
            )

    def finish(self) -> list[Finding]:
        """Run the cross-rank checks and return every finding, by file then line."""
        self._sync.finish(present=self._actors)
        self._roster.finish()
        return sorted(
            self._findings,
            key=lambda f: (self._order.get(f.path, len(self._order)), f.path, f.line, f.message),
        )

    # ------------------------------------------------------------------ per event

    def _dispatch(self, event: Event, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        if m.lost and event.is_lifecycle:
            self._follow(key, m, line, event, d)
        elif event is Event.TRANSITION:
            self._transition(key, m, line, d)
        elif event is Event.FAILED:
            self._failed(key, m, line, d)
        elif event is Event.BODY:
            self._body(key, m, line, d)
        elif event is Event.NOOP:
            self._noop(key, m, line, d)
        elif event is Event.REFUSED:
            state = logs.enum_field(d, "state", State)
            if state is not m.state:
                self._at(
                    key,
                    line,
                    f"refusal of {d.get('operation')} logged in {state}, but the replay is in {m.state}",
                )
                m.state, m.op, m.lost = state, None, True
        elif event is Event.RESOLVED:
            self._resolved(key, m, line, d)
        elif event is Event.CONTENTS:
            self._contents(key, m, line, d)
        elif event is Event.HOLD:
            self._hold(key, m, line, d)
        elif event is Event.RELEASE:
            self._release(key, m, line, d)
        elif event is Event.DEFERRED:
            self._deferred(key, m, line, d)
        elif event in _SYNC_EVENTS:
            self._sync.event(event, key, None if m.lost else m.state, line, d)

    def _follow(self, key: _Key, m: _Machine, line: int, event: Event, d: dict[str, Any]) -> None:
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
            self._check_t(key, m, line, d)
        if event in (Event.HOLD, Event.RELEASE):
            m.holds = logs.integer(d, "holds")
            m.unheld = dict(m.residency) if m.holds else None
        if event is Event.DEFERRED:
            m.unheld = _unheld_from(m, d)

    def _configured(self, key: _Key, line: int, d: dict[str, Any]) -> None:
        self._broken.discard(key)
        self._machines.pop(key, None)
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
            self._broken.add(key)
            self._at(key, line, f"lifecycle.configured cannot be read ({exc}); this machine is not replayed")
            return
        m = _Machine(policy.view(), policy.tags, present, state, residency, groups, line)
        m.communicators = communicators
        if contents is not None:
            m.contents = {t: contents.get(t, Contents.UNKNOWN) for t in policy.tags}
            m.since = dict.fromkeys(policy.tags, line)
        self._machines[key] = m
        if state not in (State.AWAKE, State.PAUSED):
            self._at(key, line, f"a machine starts AWAKE or PAUSED, but this one is configured {state}")
        if set(residency) != set(policy.tags):
            self._at(
                key,
                line,
                f"residency names tags {sorted(residency)}, but the policy's tags are {list(policy.tags)}",
            )
            m.residency = {t: residency.get(t, Residency.UNKNOWN) for t in policy.tags}
        if state is State.AWAKE and not all(r is Residency.RESIDENT for r in residency.values()):
            self._at(
                key,
                line,
                f"configured AWAKE with residency {_fmt_residency(residency)}; AWAKE starts all resident",
            )
        has_groups = Hook.PROCESS_GROUPS_DESTROY in present
        if has_groups != (groups is not None):
            self._at(
                key,
                line,
                f"groups={groups and groups.value} but the process-group hooks are "
                f"{'present' if has_groups else 'absent'}",
            )
        if groups in ASLEEP_GROUPS and groups is not ASLEEP[communicators]:
            self._at(
                key,
                line,
                f"configured with groups {groups and groups.value}, but the backend declares "
                f"communicators={communicators.value}, whose sleep leaves them {ASLEEP[communicators].value}",
            )

    def _transition(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        op = logs.text(d, "operation")
        phase = logs.text(d, "phase")
        src, dst = logs.enum_field(d, "src", State), logs.enum_field(d, "dst", State)
        targets = self._targets(m, d)
        logged = logs.logged_calls(d)
        residency, groups = logs.residency(d), logs.optional_enum(d, "groups", Groups)
        self._check_t(key, m, line, d)
        edge = _EDGE_INDEX.get((src, dst, op, phase))

        def resync() -> None:
            # The replay is lost here: take the log's word for where the machine now is.
            m.state, m.op, m.lost = dst, None, phase == "enter"
            if set(residency) == set(m.tags):
                m.residency = dict(residency)
            m.groups = groups

        if edge is None:
            legal = [f"{e.source}→{e.dest} ({e.phase})" for e in EDGES if e.operation == op]
            self._at(
                key,
                line,
                f"{op} {phase} {src}→{dst} is not an edge of the transition table"
                + (f"; {op} moves {', '.join(legal)}" if legal else f"; {op!r} is not an operation"),
            )
            resync()
            return
        if m.state is State.FAILED and op != "recover":
            self._at(
                key,
                line,
                f"{op} on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
            )
            return  # a FAILED machine cannot have moved: keep replaying from FAILED
        if src is not m.state:
            self._at(key, line, f"{_edge_name(edge)}: log says src={src}, replay says {m.state}")
            resync()
            return
        deferred = m.deferred
        row = self._row_for(key, m, line, edge, targets, dst)
        if row is None:
            resync()
            return
        if op == "release":
            m.releasing = True
            if set(targets) != set(deferred):
                self._at(
                    key,
                    line,
                    f"the release slept {list(targets)}, but the replayed held scope deferred {list(deferred)}",
                )
        if op == "recover":
            unknown = [t for t, r in m.residency.items() if r is Residency.UNKNOWN]
            if unknown or m.groups is Groups.UNKNOWN:
                self._at(
                    key,
                    line,
                    f"recover ran with unknown {unknown or 'process groups'}; the machine must resolve them "
                    "from the backend first (no lifecycle.resolved before it)",
                )
        expected = self._plan(m, edge, targets)
        calls = [c for c, _ in logged]
        if calls != expected:
            self._at(key, line, _hooks_message(edge, expected, calls, m))
        failed_ok = [c for c, ok in logged if not ok]
        if failed_ok:
            self._at(
                key,
                line,
                f"{_edge_name(edge)} completed, yet hook {_fmt_call(failed_ok[0])} is logged ok=false",
            )
        for call in expected:
            m.groups = apply_call(call, m.residency, m.groups, m.communicators)
            m.apply(call, True, line)
        self._compare_after(key, m, line, _edge_name(edge), residency, groups)
        self._compare_contents(key, m, line, _edge_name(edge), d)
        m.state = dst
        if edge.phase == "enter":
            m.op = _Open(row, line)
        else:
            m.op = None
        if op == "recover":
            m.failed = None
        if edge.phase != "enter" and op != "release":
            m.replay_unheld(op, targets if edge.phase == "move" else m.tags)

    def _failed(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        op, phase = logs.text(d, "operation"), logs.text(d, "phase")
        src = logs.enum_field(d, "src", State)
        targets = self._targets(m, d)
        logged = logs.logged_calls(d)
        residency, groups = logs.residency(d), logs.optional_enum(d, "groups", Groups)
        hook = logs.member(Hook, logs.get(d, "hook"), "hook")
        where = f"hook {hook}{_tag(d.get('tag'))} raised during {op} from {src}"

        def enter_failed() -> None:
            m.state, m.op, m.failed = State.FAILED, None, f"line {line}: {where}"
            m.unheld, m.releasing = None, op == "release"
            if set(residency) == set(m.tags):
                m.residency = dict(residency)
            m.groups = groups
            m.take_contents(d, line)

        if m.state is State.FAILED and op != "recover":
            self._at(
                key,
                line,
                f"{op} on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
            )
            return
        if src is not m.state:
            self._at(key, line, f"{op} failure: log says src={src}, replay says {m.state}")
            enter_failed()
            return
        failed_calls = [c for c, ok in logged if not ok]
        if not failed_calls:
            self._at(key, line, f"{where}, but its hooks list has no failed call: {_fmt_logged(logged)}")
            enter_failed()
            return
        if failed_calls[0] != Call(hook, d.get("tag")):
            self._at(
                key,
                line,
                f"the failed hook is {hook}{_tag(d.get('tag'))}, but the first failed call logged is "
                f"{_fmt_call(failed_calls[0])}",
            )
        candidates = self._failed_rows(key, m, line, op, phase, targets)
        plans = [(row, edge, self._plan(m, edge, targets)) for row, edge in candidates]
        matching = [row for row, edge, plan in plans if edge.plan and failed_run(edge.plan, plan, logged)]
        if matching:
            self.rows_seen[matching[0]] += 1
        elif plans:
            self._at(
                key,
                line,
                f"{op} from {src} failed with hooks its plan cannot have run (the stages before the failure "
                "whole, then each branch of the failing stage up to its failure): expected from "
                f"{' or '.join(_fmt_calls(plan) for _, _, plan in plans)}, logged {_fmt_logged(logged)}",
            )
            enter_failed()
            return
        for call, ok in logged:
            if ok:
                m.groups = apply_call(call, m.residency, m.groups, m.communicators)
            else:
                m.groups = mark_unknown(call, m.residency, m.groups)
            m.apply(call, ok, line)
        self._compare_after(key, m, line, f"{op} failure", residency, groups)
        self._compare_contents(key, m, line, f"{op} failure", d)
        m.state, m.op, m.failed = State.FAILED, None, f"line {line}: {where}"
        m.unheld, m.releasing = None, op == "release"  # a failure drops what a held scope deferred

    def _failed_rows(
        self, key: _Key, m: _Machine, line: int, op: str, phase: str, targets: tuple[str, ...]
    ) -> list[tuple[Row, Edge]]:
        """The rows and edges a failure could have happened on (recover: either target)."""
        if m.op is not None:
            running = m.op.row
            if phase == "exit" and op == running.operation and m.op.body_done:
                return [(running, e) for e in row_edges(running) if e.phase == "exit"]
            self._at(
                key,
                line,
                f"{op} {phase} failed while {running.operation} (line {m.op.line}) has not finished",
            )
            m.op = None
        if phase == "exit":
            self._at(key, line, f"{op} exit failed, but no {op} body ran before it")
            return []
        out: list[tuple[Row, Edge]] = []
        for target in (State.AWAKE, State.PAUSED) if op == "recover" else (None,):
            row = select_row(op, m.state, m.policy, m.residency, targets, target, holds=m.holds)
            edges = row_edges(row) if row is not None else ()
            if row is not None and edges and edges[0].phase == phase:
                out.append((row, edges[0]))
        if not out:
            self._at(key, line, f"{op} {phase} failed from {m.state}, where the table has no such {op} step")
        return out

    def _body(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        op = logs.text(d, "operation")
        state = logs.enum_field(d, "state", State)
        self._check_t(key, m, line, d)
        if m.state is State.FAILED:
            self._at(
                key, line, f"{op} body on a FAILED actor ({m.failed}): only recover may follow a failure"
            )
            return
        ready = body_ready(op, m.policy, m.residency)
        if state is not m.state:
            released = (
                "" if ready else f", where {op} would run on released memory {_fmt_residency(m.residency)}"
            )
            running = m.op.row if m.op is not None and m.op.row.operation == op else None
            where = f" (the table runs {op} bodies in {running.body_state})" if running else ""
            self._at(
                key, line, f"{op} body logged in {state}, but the replay is in {m.state}{where}{released}"
            )
            m.state, m.op, m.lost = state, None, True
            return
        if not ready:
            self._at(
                key,
                line,
                f"{op} body ran on released memory: replayed residency {_fmt_residency(m.residency)}",
            )
        invalid = invalid_weights(m.policy, m.contents) if m.contents is not None and op == "generate" else {}
        if invalid and m.since is not None:
            self._at(
                key,
                line,
                "generate on invalid weights: "
                + "; ".join(f"tag {t!r} {c.value} since line {m.since[t]}" for t, c in invalid.items())
                + ", with no completed sync since (the engine served meaningless weights)",
            )
        row: Row | None = None
        if m.op is not None and m.op.row.operation == op and not m.op.body_done:
            row = m.op.row
        else:
            if m.op is not None:
                self._at(
                    key, line, f"{op} body while {m.op.row.operation} (line {m.op.line}) has not finished"
                )
                m.op = None
            candidate = select_row(op, m.state, m.policy, m.residency, m.tags, holds=m.holds)
            if candidate is None or candidate.body_state is None:
                self._at(
                    key,
                    line,
                    f"{op} body in {m.state}: the table has no {op} row with a body from {m.state} here",
                )
            elif row_edges(candidate) and row_edges(candidate)[0].phase == "enter":
                first = row_edges(candidate)[0]
                self._at(
                    key,
                    line,
                    f"{op} body without its enter transition: from {m.state} the table first moves {first.source}→{first.dest}",
                )
            else:
                row = candidate
                self.rows_seen[row] += 1
                m.op = _Open(row, line)
        if row is not None and row.body_state is not state:
            self._at(
                key, line, f"{op} body logged in {state}, but the table runs {op} bodies in {row.body_state}"
            )
        if row is None or m.op is None:
            return
        m.op.body_done = True
        if not any(e.phase == "exit" for e in row_edges(row)):
            m.op = None
            m.replay_unheld(op, m.tags)

    def _noop(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        op, reason = logs.text(d, "operation"), logs.text(d, "reason")
        state = logs.enum_field(d, "state", State)
        if state is not m.state:
            self._at(key, line, f"{op} no-op logged in {state}, but the replay is in {m.state}")
            m.state, m.op, m.lost = state, None, True
            return
        if reason.startswith("nested in "):
            running = reason.removeprefix("nested in ")
            if op not in LIFECYCLE_CALLS:
                self._at(
                    key,
                    line,
                    f"{op} absorbed as a nested no-op; only {list(LIFECYCLE_CALLS)} are absorbed inside a body",
                )
            if m.op is not None and m.op.row.operation == running and not m.op.body_done:
                return
            if m.op is None and m.state is not State.FAILED:
                row = select_row(running, m.state, m.policy, m.residency, m.tags, holds=m.holds)
                if (
                    row is not None
                    and row.body_state is not None
                    and not any(e.phase == "enter" for e in row_edges(row))
                ):
                    self.rows_seen[row] += 1
                    m.op = _Open(row, line)
                    return
            self._at(
                key,
                line,
                f"{op} no-op 'nested in {running}' outside a {running} body (replay is in {m.state})",
            )
            return
        if reason not in ("idempotent", "held"):
            self._at(
                key,
                line,
                f"{op} no-op with reason {reason!r}; a no-op is 'idempotent', 'held' or 'nested in <operation>'",
            )
            return
        if reason == "held" and not m.holds:
            self._at(key, line, f"{op} no-op 'held' outside a held scope (no lifecycle.hold open before it)")
            return
        if m.state is State.FAILED:
            self._at(
                key,
                line,
                f"{op} no-op on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
            )
            return
        if m.op is not None:
            self._at(key, line, f"{op} no-op while {m.op.row.operation} (line {m.op.line}) has not finished")
            m.op = None
        for targets in self._noop_targets(m, d):
            row = select_row(op, m.state, m.policy, m.residency, targets, holds=m.holds)
            if row is not None and row.noop and bool(row.held) == (reason == "held"):
                self.rows_seen[row] += 1
                m.replay_unheld(op, targets)
                return
        noop_rows = [r for r in rows_for(op, m.state) if r.noop and bool(r.held) == (reason == "held")]
        why = (
            f"the table makes it a no-op only when {' or '.join(r.when.value for r in noop_rows)}"
            if noop_rows
            else f"the table has no no-op row for {op} from {m.state}"
        )
        self._at(
            key,
            line,
            f"{op} from {m.state} is not a no-op here: {why}; replayed residency {_fmt_residency(m.residency)}",
        )

    def _hold(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        holds = logs.integer(d, "holds")
        if m.state is State.FAILED:
            self._at(
                key,
                line,
                f"hold on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
            )
        elif m.op is not None:
            self._at(key, line, f"hold while {m.op.row.operation} (line {m.op.line}) has not finished")
            m.op = None
        else:
            row = select_row("hold", m.state, m.policy, m.residency, m.tags, holds=m.holds)
            if row is not None:
                self.rows_seen[row] += 1
        m.holds += 1
        if m.holds == 1:
            m.unheld, m.held_line = dict(m.residency), line
        self._count_holds(key, m, line, "lifecycle.hold", holds)

    def _release(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        holds = logs.integer(d, "holds")
        deferred = m.deferred
        if not m.holds:
            self._at(key, line, "release with no hold taken (no lifecycle.hold open before it)")
        elif m.releasing:
            pass  # its sleep (or the failure in it) was checked at its own line
        elif m.op is not None:
            self._at(key, line, f"release while {m.op.row.operation} (line {m.op.line}) has not finished")
            m.op = None
        else:
            row = select_row("release", m.state, m.policy, m.residency, deferred, holds=m.holds)
            if row is not None and not row.noop:
                self._at(
                    key,
                    line,
                    f"the last hold (taken at line {m.held_line}) was released with the sleep of "
                    f"{list(deferred)} deferred, but no sleep ran: the scope left the actor {m.state}; the table "
                    "runs the deferred sleep at the release of the last hold",
                )
            elif row is not None:
                self.rows_seen[row] += 1
        m.releasing = False
        m.holds = max(m.holds - 1, 0)
        if not m.holds:
            m.unheld = m.held_line = None
        self._count_holds(key, m, line, "lifecycle.release", holds)

    def _count_holds(self, key: _Key, m: _Machine, line: int, what: str, holds: int) -> None:
        if holds != m.holds:
            self._at(key, line, f"{what} logs holds={holds}, but the replay counts {m.holds}")
            m.holds = max(holds, 0)
            if not m.holds:
                m.unheld = m.held_line = None
            elif m.unheld is None:
                m.unheld, m.held_line = dict(m.residency), line

    def _deferred(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        """An operation inside a held scope changed the deferred tags: the replay must agree."""
        logged = logs.get(d, "deferred")
        if not isinstance(logged, list) or not all(t in m.tags for t in logged):
            raise LogFieldError(f"deferred={logged!r} is not a list of this machine's tags {list(m.tags)}")
        if not m.holds:
            self._at(key, line, "lifecycle.deferred outside a held scope (no lifecycle.hold open before it)")
            return
        if logged != list(m.deferred):
            self._at(
                key,
                line,
                f"after {d.get('operation')} the log defers the sleep of {logged}, the replay {list(m.deferred)}",
            )
            m.unheld = _unheld_from(m, d)

    def _resolved(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        resolved = logs.get(d, "resolved")
        if not isinstance(resolved, dict):
            raise LogFieldError(f"resolved={resolved!r} is not a mapping")
        if m.state is not State.FAILED:
            self._at(
                key, line, f"lifecycle.resolved in {m.state}; only recover from FAILED resolves unknown state"
            )
        for name, value in resolved.items():
            if name == "process_groups":
                if m.groups is not Groups.UNKNOWN:
                    known = m.groups and m.groups.value
                    self._at(key, line, f"resolved the process groups, which the replay knows as {known}")
                m.groups = logs.member(Groups, value, "resolved")
            elif name in m.residency:
                if m.residency[name] is not Residency.UNKNOWN:
                    self._at(
                        key,
                        line,
                        f"resolved tag {name!r}, which the replay knows as {m.residency[name].value}",
                    )
                m.residency[name] = logs.member(Residency, value, "resolved")
                if m.contents is not None and m.since is not None and name in m.contents:
                    before = m.contents[name]
                    resolve_contents(name, m.residency[name], m.policy, m.contents)
                    if m.contents[name] is not before:
                        m.since[name] = line
            else:
                self._at(
                    key,
                    line,
                    f"resolved tag {name!r}, which is not one of this machine's tags {list(m.tags)}",
                )

    def _contents(self, key: _Key, m: _Machine, line: int, d: dict[str, Any]) -> None:
        """A sync body declared what it did to the weight tags."""
        declared = logs.member(Contents, logs.get(d, "declared"), "declared")
        if m.state is not State.SYNCING or m.op is None or m.op.row.operation != "sync" or m.op.body_done:
            self._at(
                key, line, f"weights declared {declared.value} outside a sync body (replay in {m.state})"
            )
        if m.contents is None or m.since is None:
            return
        for tag in m.policy.weight_tags:
            m.contents[tag], m.since[tag] = declared, line
        self._compare_contents(key, m, line, "lifecycle.contents", d)

    def _compare_contents(self, key: _Key, m: _Machine, line: int, what: str, d: Mapping[str, Any]) -> None:
        logged = logs.contents(d)
        if logged is None or m.contents is None or logged == m.contents:
            return
        diffs = [
            f"{tag}: logged {logged[tag].value if tag in logged else 'nothing'}, replay {m.contents[tag].value}"
            for tag in m.contents
            if logged.get(tag) is not m.contents[tag]
        ]
        self._at(key, line, f"{what}: logged contents differ from the replay ({'; '.join(diffs)})")

    def _row_for(
        self, key: _Key, m: _Machine, line: int, edge: Edge, targets: tuple[str, ...], dst: State
    ) -> Row | None:
        """The row a logged edge belongs to: the open operation's, or the one the table selects now."""
        op = edge.operation
        if m.op is not None:
            running = m.op.row
            if edge.phase == "exit" and op == running.operation:
                if not m.op.body_done:
                    self._at(key, line, f"{op} exit before its body ran (started line {m.op.line})")
                expected = [e for e in row_edges(running) if e.phase == "exit"]
                if expected and expected[0] == edge:
                    return running
                held = " (inside a held scope its sleep is deferred)" if running.held else ""
                self._at(
                    key,
                    line,
                    f"{op} exit {edge.source}→{edge.dest}, but the row selected at line {m.op.line} "
                    + (f"exits {expected[0].source}→{expected[0].dest}" if expected else "has no exit step")
                    + held,
                )
                return None
            self._at(
                key, line, f"{_edge_name(edge)} while {running.operation} (line {m.op.line}) has not finished"
            )
            m.op = None
        if edge.phase == "exit":
            self._at(key, line, f"{op} exit {edge.source}→{edge.dest} without its {op} body before it")
            return None
        row = select_row(
            op, m.state, m.policy, m.residency, targets, dst if op == "recover" else None, holds=m.holds
        )
        if row is None:
            guards = ", ".join(r.when.value for r in rows_for(op, m.state)) or "no row at all"
            self._at(
                key,
                line,
                f"{op} from {m.state} on {list(targets)} is refused by the table here (rows need: {guards}); "
                f"replayed residency {_fmt_residency(m.residency)}",
            )
            return None
        if row.noop and row.held:
            self._at(
                key,
                line,
                f"{op} from {m.state} on {list(targets)} ran hooks inside a held scope (held since line "
                f"{m.held_line}): the table defers it to the release of the last hold",
            )
            return None
        if row.noop:
            self._at(
                key,
                line,
                f"{op} from {m.state} on {list(targets)} is a no-op here ({row.when.value}), yet it ran hooks",
            )
            return None
        first = row_edges(row)[0]
        if first != edge:
            self._at(
                key,
                line,
                f"{op} from {m.state} on {list(targets)} takes the row '{row.doc}' ({row.when.value}), which moves "
                f"{first.source}→{first.dest} ({first.phase}); the log has {edge.source}→{edge.dest} ({edge.phase})",
            )
            return None
        if row.body_state is not None and targets != m.tags:
            self._at(
                key, line, f"{op} targets {list(targets)}; a body operation acts on all tags {list(m.tags)}"
            )
        self.rows_seen[row] += 1
        return row

    def _plan(self, m: _Machine, edge: Edge, targets: tuple[str, ...]) -> list[Call]:
        if edge.plan is None:
            return []
        return plan_calls(edge.plan, m.policy, m.residency, m.groups, targets, m.present)

    def _targets(self, m: _Machine, d: Mapping[str, Any]) -> tuple[str, ...]:
        targets = logs.get(d, "targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise LogFieldError(f"targets={targets!r} is not a non-empty list of tags")
        unknown = [t for t in targets if t not in m.tags]
        if unknown:
            raise LogFieldError(f"targets {unknown} are not among this machine's tags {list(m.tags)}")
        return tuple(targets)

    def _noop_targets(self, m: _Machine, d: Mapping[str, Any]) -> Iterator[tuple[str, ...]]:
        """The targets a no-op was called with; when not logged, every non-empty subset of the tags.

        Past 8 tags only the full set and single tags are tried, to bound the work per line.
        """
        if "targets" in d:
            yield self._targets(m, d)
            return
        if len(m.tags) > 8:
            yield m.tags
            yield from ((t,) for t in m.tags)
            return
        for size in range(len(m.tags), 0, -1):
            yield from itertools.combinations(m.tags, size)

    def _compare_after(
        self,
        key: _Key,
        m: _Machine,
        line: int,
        what: str,
        residency: dict[str, Residency],
        groups: Groups | None,
    ) -> None:
        if residency != m.residency:
            diffs = [
                f"{tag}: logged {_fmt_res(residency.get(tag))}, replay {_fmt_res(m.residency.get(tag))}"
                for tag in dict.fromkeys([*m.residency, *residency])
                if residency.get(tag) is not m.residency.get(tag)
            ]
            self._at(key, line, f"{what}: logged residency differs from the replay ({'; '.join(diffs)})")
        if groups is not m.groups:
            self._at(
                key,
                line,
                f"{what}: logged process groups {groups and groups.value}, replay says {m.groups and m.groups.value}",
            )

    def _check_t(self, key: _Key, m: _Machine, line: int, d: Mapping[str, Any]) -> None:
        t = logs.number(d, "t", "a time in epoch seconds")
        if m.last_t is not None and t <= m.last_t[0]:
            self._at(
                key,
                line,
                f"t={t:.6f} does not increase: line {m.last_t[1]} has t={m.last_t[0]:.6f} "
                f"({(t - m.last_t[0]) * 1e3:+.3f} ms); lines are out of order or the clock stepped back",
            )
        m.last_t = (t, line)

    def _key(self, path: str, data: Mapping[str, Any]) -> _Key:
        rank, role = data.get("rank"), data.get("role")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
            raise LogFieldError(f"has rank={rank!r}, which is not an integer")
        if role is not None and not isinstance(role, str):
            raise LogFieldError(f"has role={role!r}, which is not a string")
        return (path, rank, role)

    def _at(self, key: _Key, line: int, message: str) -> None:
        self._report(key[0], line, key[1], key[2], message)

    def _report(self, path: str, line: int, rank: int | None, role: str | None, message: str) -> None:
        self._findings.append(Finding(path, line, rank, role, message))


_EDGE_INDEX: dict[tuple[State, State, str, str], Edge] = {
    (e.source, e.dest, e.operation, e.phase): e for e in EDGES
}
assert len(_EDGE_INDEX) == len(EDGES), "two edges share (source, dest, operation, phase)"


def _unheld_from(m: _Machine, d: Mapping[str, Any]) -> dict[str, Residency]:
    """The log's word for a held scope's deferred tags, as the residency they leave without it."""
    logged = d.get("deferred")
    deferred = {t for t in logged if isinstance(t, str)} if isinstance(logged, list) else set()
    return {t: Residency.RELEASED if t in deferred else r for t, r in m.residency.items()}


# ----------------------------------------------------------------------------------------------
# Messages


def _tag(tag: Any) -> str:
    return f"[{tag}]" if tag is not None else ""


def _fmt_call(call: Call) -> str:
    return f"{call.hook.value}{_tag(call.tag)}"


def _fmt_calls(calls: Iterable[Call]) -> str:
    return "[" + ", ".join(_fmt_call(c) for c in calls) + "]"


def _fmt_logged(logged: Iterable[tuple[Call, bool]]) -> str:
    return "[" + ", ".join(f"{_fmt_call(c)}{'' if ok else ' (ok=false)'}" for c, ok in logged) + "]"


def _fmt_res(r: Residency | None) -> str:
    return "absent" if r is None else r.value


def _fmt_residency(residency: Mapping[str, Residency]) -> str:
    return "{" + ", ".join(f"{t}: {r.value}" for t, r in residency.items()) + "}"


def _edge_name(edge: Edge) -> str:
    if edge.phase == "exit":
        return f"{edge.operation} (exit {edge.source}→{edge.dest})"
    return f"{edge.operation} from {edge.source}"


def _hooks_message(edge: Edge, expected: list[Call], logged: list[Call], m: _Machine) -> str:
    """Say what a logged hook list got wrong against the plan, in words first."""
    parts: list[str] = []
    for call in expected:
        if call not in logged:
            parts.append("did not " + _DID_NOT[call.hook].format(tag=call.tag))
    extra = [c for c in logged if c not in expected]
    for call in extra:
        if call.hook is Hook.MEMORY_PAUSE and m.residency.get(call.tag or ALL_TAGS) is Residency.RELEASED:
            parts.append(
                f"paused tag {call.tag}, which was already released (torch_memory_saver exits on that)"
            )
        elif call.hook is Hook.MEMORY_RESUME and m.residency.get(call.tag or ALL_TAGS) is Residency.RESIDENT:
            parts.append(f"resumed tag {call.tag}, which was resident (torch_memory_saver exits on that)")
        else:
            parts.append(f"called {_fmt_call(call)}, which the plan does not call here")
    if not parts:
        same = collections.Counter(expected) == collections.Counter(logged)
        parts.append("ran its hooks in the wrong order" if same else "repeated a hook")
    lead = _edge_name(edge)
    if edge.operation == "recover" and extra:
        lead = f"recover to {edge.dest} re-ran hooks the residency did not need:"
    return f"{lead} {', '.join(parts)}: expected hooks {_fmt_calls(expected)}, logged {_fmt_calls(logged)}"

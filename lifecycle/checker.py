"""Replay lifecycle JSON-lines logs against the transition table and report what cannot have happened.

    findings = check_files(["logs/rank0.jsonl", "logs/rank1.jsonl"])
    for finding in findings:
        print(finding)  # rank0.jsonl:42 rank 0 trainer: sync from PAUSED did not reload the process groups: ...

Each machine (file + rank + role) is replayed from its `lifecycle.configured` event with the
table's own functions (`select_row`, `row_edges`, `plan_calls`, `apply_call`, `mark_unknown`,
`body_ready`); the checker restates no rule of the table. Where the log contradicts the replay's
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

The rules of each kind of event are in `lifecycle._replay`, one module per kind; `LogChecker`
reads the files, keeps the machines and hands each event to its rule (`_RULES`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle._replay import bodies, budget, edges, failures, holds, noops
from lifecycle._replay.configured import configured
from lifecycle._replay.state import Key, Replay, ReplayedMachine, Rule, follow
from lifecycle.errors import LogFieldError
from lifecycle.logs import Event, LogFile, LogLine, parse_lines, read_logs
from lifecycle.roster import Roster
from lifecycle.sync_checks import WeightSyncChecks
from lifecycle.table import Row, State

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


_SYNC_EVENTS = (Event.SYNC_UPDATE, Event.SYNC_LOADED)

# The rule each lifecycle event of a configured machine is checked by (lifecycle.configured starts one).
_RULES: dict[Event, Rule] = {
    Event.TRANSITION: edges.transition,
    Event.FAILED: failures.failed,
    Event.RESOLVED: failures.resolved,
    Event.BODY: bodies.body,
    Event.CONTENTS: bodies.contents,
    Event.NOOP: noops.noop,
    Event.REFUSED: noops.refused,
    Event.HOLD: holds.hold,
    Event.RELEASE: holds.release,
    Event.DEFERRED: holds.deferred,
    Event.BUDGET: budget.budget,
    Event.BUDGET_CHECKED: budget.budget_checked,
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
        self._machines: dict[Key, ReplayedMachine] = {}
        self._broken: set[Key] = set()  # configured with a policy we cannot read: not replayed
        self._actors: set[tuple[int | None, str | None]] = set()  # (rank, role) of every event read
        self._replay = Replay(self._report, self.rows_seen)
        self._sync = WeightSyncChecks(self._report)
        self._roster = Roster(self._report)  # the ranks a run had and which of them its logs lose
        # an engine's death (where, what) not followed by a restart of its machine
        self._died: dict[Key, tuple[int, Mapping[str, Any]]] = {}

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
        orphans: dict[Key, LogLine] = {}  # first lifecycle event of a machine not configured yet
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
            if event is Event.SERVER_DIED:
                self._died[key] = (entry.line, data)  # the machine stays where it was: no rule
                continue
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

    def ended_failed(self) -> list[str]:
        """The machines whose log ends in FAILED (a hook raised and nothing recovered it), one line
        each: no finding (the table allows it), but what a run that stopped on a failure reports."""
        out = []
        for (path, rank, role), m in sorted(
            self._machines.items(), key=lambda item: (self._order.get(item[0][0], 0), str(item[0]))
        ):
            if m.state is State.FAILED and not m.lost:
                who = " ".join(p for p in (None if rank is None else f"rank {rank}", role) if p)
                out.append(f"{path} {who}: ends FAILED ({m.failed}), not recovered")
        return out

    def engines_died(self) -> list[str]:
        """The actors whose engine died (`rollout.server_died`) with no restart after it in the log
        (a restart configures the machine again), one line each: what exited and during which call.
        No finding (the machine's table allows it: it stays where it was, every call refused), but
        what an engineer on call reads first."""
        out = []
        for (path, rank, role), (line, d) in sorted(
            self._died.items(), key=lambda item: (self._order.get(item[0][0], 0), str(item[0]))
        ):
            who = " ".join(p for p in (None if rank is None else f"rank {rank}", role) if p)
            facts = [
                f"{k} {d[f]}" for k, f in (("pid", "pid"), ("exit code", "exitcode")) if d.get(f) is not None
            ]
            what = str(d.get("process") or "a process") + (f" ({', '.join(facts)})" if facts else "")
            engine = " ".join(str(p) for p in (d.get("label"), d.get("url")) if p)
            during = f" during {d['call']}" if d.get("call") else ""
            out.append(
                f"{path}:{line} {who}: its engine{' ' + engine if engine else ''} died: {what}{during}; "
                "not restarted in this log"
            )
        return out

    def finish(self) -> list[Finding]:
        """Run the cross-rank checks and return every finding, by file then line."""
        self._sync.finish(present=self._actors)
        self._roster.finish()
        return sorted(
            self._findings,
            key=lambda f: (self._order.get(f.path, len(self._order)), f.path, f.line, f.message),
        )

    def _dispatch(self, event: Event, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
        if m.lost and event.is_lifecycle:
            follow(self._replay, key, m, line, event, d)
        elif event in _SYNC_EVENTS:
            self._sync.event(event, key, None if m.lost else m.state, line, d)
        elif event in _RULES:
            _RULES[event](self._replay, key, m, line, d)

    def _configured(self, key: Key, line: int, d: dict[str, Any]) -> None:
        self._died.pop(key, None)  # configured again: the engine was restarted
        self._broken.discard(key)
        self._machines.pop(key, None)
        machine = configured(self._replay, key, line, d)
        if machine is None:
            self._broken.add(key)  # configured with a policy we cannot read: not replayed
        else:
            self._machines[key] = machine

    def _key(self, path: str, data: Mapping[str, Any]) -> Key:
        rank, role = data.get("rank"), data.get("role")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
            raise LogFieldError(f"has rank={rank!r}, which is not an integer")
        if role is not None and not isinstance(role, str):
            raise LogFieldError(f"has role={role!r}, which is not a string")
        return (path, rank, role)

    def _report(self, path: str, line: int, rank: int | None, role: str | None, message: str) -> None:
        self._findings.append(Finding(path, line, rank, role, message))

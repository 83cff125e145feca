"""`lifecycle.hold`, `lifecycle.release` and `lifecycle.deferred`: held scopes and the sleep they defer."""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.state import Key, Replay, ReplayedMachine, unheld_from
from lifecycle.errors import LogFieldError
from lifecycle.table import State, select_row


def hold(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A hold was taken: the first opens a held scope."""
    holds = logs.integer(d, "holds")
    if m.state is State.FAILED:
        replay.at(
            key,
            line,
            f"hold on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
        )
    elif m.op is not None:
        replay.at(key, line, f"hold while {m.op.row.operation} (line {m.op.line}) has not finished")
        m.op = None
    else:
        row = select_row("hold", m.state, m.policy, m.residency, m.tags, holds=m.holds)
        if row is not None:
            replay.rows_seen[row] += 1
    m.holds += 1
    if m.holds == 1:
        m.unheld, m.held_line = dict(m.residency), line
    _count_holds(replay, key, m, line, "lifecycle.hold", holds)


def release(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A hold was given back: the last one's release runs the deferred sleep (checked at its line)."""
    holds = logs.integer(d, "holds")
    deferred = m.deferred
    if not m.holds:
        replay.at(key, line, "release with no hold taken (no lifecycle.hold open before it)")
    elif m.releasing:
        pass  # its sleep (or the failure in it) was checked at its own line
    elif m.op is not None:
        replay.at(key, line, f"release while {m.op.row.operation} (line {m.op.line}) has not finished")
        m.op = None
    else:
        row = select_row("release", m.state, m.policy, m.residency, deferred, holds=m.holds)
        if row is not None and not row.noop:
            replay.at(
                key,
                line,
                f"the last hold (taken at line {m.held_line}) was released with the sleep of "
                f"{list(deferred)} deferred, but no sleep ran: the scope left the actor {m.state}; the table "
                "runs the deferred sleep at the release of the last hold",
            )
        elif row is not None:
            replay.rows_seen[row] += 1
    m.releasing = False
    m.holds = max(m.holds - 1, 0)
    if not m.holds:
        m.unheld = m.held_line = None
    _count_holds(replay, key, m, line, "lifecycle.release", holds)


def _count_holds(replay: Replay, key: Key, m: ReplayedMachine, line: int, what: str, holds: int) -> None:
    if holds != m.holds:
        replay.at(key, line, f"{what} logs holds={holds}, but the replay counts {m.holds}")
        m.holds = max(holds, 0)
        if not m.holds:
            m.unheld = m.held_line = None
        elif m.unheld is None:
            m.unheld, m.held_line = dict(m.residency), line


def deferred(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """An operation inside a held scope changed the deferred tags: the replay must agree."""
    logged = logs.get(d, "deferred")
    if not isinstance(logged, list) or not all(t in m.tags for t in logged):
        raise LogFieldError(f"deferred={logged!r} is not a list of this machine's tags {list(m.tags)}")
    if not m.holds:
        replay.at(key, line, "lifecycle.deferred outside a held scope (no lifecycle.hold open before it)")
        return
    if logged != list(m.deferred):
        replay.at(
            key,
            line,
            f"after {d.get('operation')} the log defers the sleep of {logged}, the replay {list(m.deferred)}",
        )
        m.unheld = unheld_from(m, d)

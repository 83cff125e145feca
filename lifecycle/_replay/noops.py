"""`lifecycle.noop` and `lifecycle.refused`: calls that ran no hook, and where the table says they may."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import fmt_residency
from lifecycle._replay.state import Key, OpenOperation, Replay, ReplayedMachine, read_targets
from lifecycle.table import LIFECYCLE_CALLS, State, row_edges, rows_for, select_row


def noop(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A call that ran no hook: idempotent, held, or nested in a body, where the table says so."""
    op, reason = logs.text(d, "operation"), logs.text(d, "reason")
    state = logs.enum_field(d, "state", State)
    if state is not m.state:
        replay.at(key, line, f"{op} no-op logged in {state}, but the replay is in {m.state}")
        m.state, m.op, m.lost = state, None, True
        return
    if reason.startswith("nested in "):
        running = reason.removeprefix("nested in ")
        if op not in LIFECYCLE_CALLS:
            replay.at(
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
                replay.rows_seen[row] += 1
                m.op = OpenOperation(row, line)
                return
        replay.at(
            key,
            line,
            f"{op} no-op 'nested in {running}' outside a {running} body (replay is in {m.state})",
        )
        return
    if reason not in ("idempotent", "held"):
        replay.at(
            key,
            line,
            f"{op} no-op with reason {reason!r}; a no-op is 'idempotent', 'held' or 'nested in <operation>'",
        )
        return
    if reason == "held" and not m.holds:
        replay.at(key, line, f"{op} no-op 'held' outside a held scope (no lifecycle.hold open before it)")
        return
    if m.state is State.FAILED:
        replay.at(
            key,
            line,
            f"{op} no-op on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
        )
        return
    if m.op is not None:
        replay.at(key, line, f"{op} no-op while {m.op.row.operation} (line {m.op.line}) has not finished")
        m.op = None
    for targets in _noop_targets(m, d):
        row = select_row(op, m.state, m.policy, m.residency, targets, holds=m.holds)
        if row is not None and row.noop and bool(row.held) == (reason == "held"):
            replay.rows_seen[row] += 1
            m.replay_unheld(op, targets)
            return
    noop_rows = [r for r in rows_for(op, m.state) if r.noop and bool(r.held) == (reason == "held")]
    why = (
        f"the table makes it a no-op only when {' or '.join(r.when.value for r in noop_rows)}"
        if noop_rows
        else f"the table has no no-op row for {op} from {m.state}"
    )
    replay.at(
        key,
        line,
        f"{op} from {m.state} is not a no-op here: {why}; replayed residency {fmt_residency(m.residency)}",
    )


def refused(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A refusal moves nothing, so it must be logged in the replay's state."""
    state = logs.enum_field(d, "state", State)
    if state is not m.state:
        replay.at(
            key,
            line,
            f"refusal of {d.get('operation')} logged in {state}, but the replay is in {m.state}",
        )
        m.state, m.op, m.lost = state, None, True


def _noop_targets(m: ReplayedMachine, d: Mapping[str, Any]) -> Iterator[tuple[str, ...]]:
    """The targets a no-op was called with; when not logged, every non-empty subset of the tags.

    Past 8 tags only the full set and single tags are tried, to bound the work per line.
    """
    if "targets" in d:
        yield read_targets(m, d)
        return
    if len(m.tags) > 8:
        yield m.tags
        yield from ((t,) for t in m.tags)
        return
    for size in range(len(m.tags), 0, -1):
        yield from itertools.combinations(m.tags, size)

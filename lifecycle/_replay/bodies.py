"""`lifecycle.body` and `lifecycle.contents`: a body's state and memory, the weights generate reads,
and what a sync body declared it did to them."""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import fmt_residency
from lifecycle._replay.state import Key, OpenOperation, Replay, ReplayedMachine
from lifecycle.table import Contents, Row, State, body_ready, invalid_weights, row_edges, select_row


def body(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A body ran: in its row's body state, on resident memory, generate on valid weights."""
    op = logs.text(d, "operation")
    state = logs.enum_field(d, "state", State)
    replay.check_t(key, m, line, d)
    if m.state is State.FAILED:
        replay.at(key, line, f"{op} body on a FAILED actor ({m.failed}): only recover may follow a failure")
        return
    ready = body_ready(op, m.policy, m.residency)
    if state is not m.state:
        released = "" if ready else f", where {op} would run on released memory {fmt_residency(m.residency)}"
        running = m.op.row if m.op is not None and m.op.row.operation == op else None
        where = f" (the table runs {op} bodies in {running.body_state})" if running else ""
        replay.at(key, line, f"{op} body logged in {state}, but the replay is in {m.state}{where}{released}")
        m.state, m.op, m.lost = state, None, True
        return
    if not ready:
        replay.at(
            key,
            line,
            f"{op} body ran on released memory: replayed residency {fmt_residency(m.residency)}",
        )
    invalid = invalid_weights(m.policy, m.contents) if m.contents is not None and op == "generate" else {}
    if invalid and m.since is not None:
        replay.at(
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
            replay.at(key, line, f"{op} body while {m.op.row.operation} (line {m.op.line}) has not finished")
            m.op = None
        candidate = select_row(op, m.state, m.policy, m.residency, m.tags, holds=m.holds)
        if candidate is None or candidate.body_state is None:
            replay.at(
                key,
                line,
                f"{op} body in {m.state}: the table has no {op} row with a body from {m.state} here",
            )
        elif row_edges(candidate) and row_edges(candidate)[0].phase == "enter":
            first = row_edges(candidate)[0]
            replay.at(
                key,
                line,
                f"{op} body without its enter transition: from {m.state} the table first moves {first.source}→{first.dest}",
            )
        else:
            row = candidate
            replay.rows_seen[row] += 1
            m.op = OpenOperation(row, line)
    if row is not None and row.body_state is not state:
        replay.at(
            key, line, f"{op} body logged in {state}, but the table runs {op} bodies in {row.body_state}"
        )
    if row is None or m.op is None:
        return
    m.op.body_done = True
    if not any(e.phase == "exit" for e in row_edges(row)):
        m.op = None
        m.replay_unheld(op, m.tags)


def contents(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A sync body declared what it did to the weight tags."""
    declared = logs.member(Contents, logs.get(d, "declared"), "declared")
    if m.state is not State.SYNCING or m.op is None or m.op.row.operation != "sync" or m.op.body_done:
        replay.at(key, line, f"weights declared {declared.value} outside a sync body (replay in {m.state})")
    if m.contents is None or m.since is None:
        return
    for tag in m.policy.weight_tags:
        m.contents[tag], m.since[tag] = declared, line
    replay.compare_contents(key, m, line, "lifecycle.contents", d)

"""`lifecycle.transition`: each logged edge against the row the table selects, its hook plan and what it leaves."""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import edge_name, fmt_call, fmt_residency, hooks_message
from lifecycle._replay.state import Key, OpenOperation, Replay, ReplayedMachine, plan, read_targets
from lifecycle.table import (
    EDGES,
    Edge,
    Groups,
    Residency,
    Row,
    State,
    apply_call,
    row_edges,
    rows_for,
    select_row,
)

_EDGE_INDEX: dict[tuple[State, State, str, str], Edge] = {
    (e.source, e.dest, e.operation, e.phase): e for e in EDGES
}
assert len(_EDGE_INDEX) == len(EDGES), "two edges share (source, dest, operation, phase)"


def transition(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A logged edge: the row it belongs to, the hooks its plan calls, the state it leaves."""
    op = logs.text(d, "operation")
    phase = logs.text(d, "phase")
    src, dst = logs.enum_field(d, "src", State), logs.enum_field(d, "dst", State)
    targets = read_targets(m, d)
    logged = logs.logged_calls(d)
    residency, groups = logs.residency(d), logs.optional_enum(d, "groups", Groups)
    replay.check_t(key, m, line, d)
    edge = _EDGE_INDEX.get((src, dst, op, phase))

    def resync() -> None:
        # The replay is lost here: take the log's word for where the machine now is.
        m.state, m.op, m.lost = dst, None, phase == "enter"
        if set(residency) == set(m.tags):
            m.residency = dict(residency)
        m.groups = groups

    if edge is None:
        legal = [f"{e.source}→{e.dest} ({e.phase})" for e in EDGES if e.operation == op]
        replay.at(
            key,
            line,
            f"{op} {phase} {src}→{dst} is not an edge of the transition table"
            + (f"; {op} moves {', '.join(legal)}" if legal else f"; {op!r} is not an operation"),
        )
        resync()
        return
    if m.state is State.FAILED and op != "recover":
        replay.at(
            key,
            line,
            f"{op} on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
        )
        return  # a FAILED machine cannot have moved: keep replaying from FAILED
    if src is not m.state:
        replay.at(key, line, f"{edge_name(edge)}: log says src={src}, replay says {m.state}")
        resync()
        return
    deferred = m.deferred
    row = _row_for(replay, key, m, line, edge, targets, dst)
    if row is None:
        resync()
        return
    if op == "release":
        m.releasing = True
        if set(targets) != set(deferred):
            replay.at(
                key,
                line,
                f"the release slept {list(targets)}, but the replayed held scope deferred {list(deferred)}",
            )
    if op == "recover":
        unknown = [t for t, r in m.residency.items() if r is Residency.UNKNOWN]
        if unknown or m.groups is Groups.UNKNOWN:
            replay.at(
                key,
                line,
                f"recover ran with unknown {unknown or 'process groups'}; the machine must resolve them "
                "from the backend first (no lifecycle.resolved before it)",
            )
    expected = plan(m, edge, targets)
    m.budget = None  # a budget plan is for one sleep
    calls = [c for c, _ in logged]
    if calls != expected:
        replay.at(key, line, hooks_message(edge, expected, calls, m.residency))
    failed_ok = [c for c, ok in logged if not ok]
    if failed_ok:
        replay.at(
            key,
            line,
            f"{edge_name(edge)} completed, yet hook {fmt_call(failed_ok[0])} is logged ok=false",
        )
    for call in expected:
        m.groups = apply_call(call, m.residency, m.groups, m.way)
        m.apply(call, True, line)
    replay.compare_after(key, m, line, edge_name(edge), residency, groups)
    replay.compare_contents(key, m, line, edge_name(edge), d)
    m.state = dst
    if edge.phase == "enter":
        m.op = OpenOperation(row, line)
    else:
        m.op = None
    if op == "recover":
        m.failed = None
    if edge.phase != "enter" and op != "release":
        m.replay_unheld(op, targets if edge.phase == "move" else m.tags)


def _row_for(
    replay: Replay, key: Key, m: ReplayedMachine, line: int, edge: Edge, targets: tuple[str, ...], dst: State
) -> Row | None:
    """The row a logged edge belongs to: the open operation's, or the one the table selects now."""
    op = edge.operation
    if m.op is not None:
        running = m.op.row
        if edge.phase == "exit" and op == running.operation:
            if not m.op.body_done:
                replay.at(key, line, f"{op} exit before its body ran (started line {m.op.line})")
            expected = [e for e in row_edges(running) if e.phase == "exit"]
            if expected and expected[0] == edge:
                return running
            held = " (inside a held scope its sleep is deferred)" if running.held else ""
            replay.at(
                key,
                line,
                f"{op} exit {edge.source}→{edge.dest}, but the row selected at line {m.op.line} "
                + (f"exits {expected[0].source}→{expected[0].dest}" if expected else "has no exit step")
                + held,
            )
            return None
        replay.at(
            key, line, f"{edge_name(edge)} while {running.operation} (line {m.op.line}) has not finished"
        )
        m.op = None
    if edge.phase == "exit":
        replay.at(key, line, f"{op} exit {edge.source}→{edge.dest} without its {op} body before it")
        return None
    row = select_row(
        op, m.state, m.policy, m.residency, targets, dst if op == "recover" else None, holds=m.holds
    )
    if row is None:
        guards = ", ".join(r.when.value for r in rows_for(op, m.state)) or "no row at all"
        replay.at(
            key,
            line,
            f"{op} from {m.state} on {list(targets)} is refused by the table here (rows need: {guards}); "
            f"replayed residency {fmt_residency(m.residency)}",
        )
        return None
    if row.noop and row.held:
        replay.at(
            key,
            line,
            f"{op} from {m.state} on {list(targets)} ran hooks inside a held scope (held since line "
            f"{m.held_line}): the table defers it to the release of the last hold",
        )
        return None
    if row.noop:
        replay.at(
            key,
            line,
            f"{op} from {m.state} on {list(targets)} is a no-op here ({row.when.value}), yet it ran hooks",
        )
        return None
    first = row_edges(row)[0]
    if first != edge:
        replay.at(
            key,
            line,
            f"{op} from {m.state} on {list(targets)} takes the row '{row.doc}' ({row.when.value}), which moves "
            f"{first.source}→{first.dest} ({first.phase}); the log has {edge.source}→{edge.dest} ({edge.phase})",
        )
        return None
    if row.body_state is not None and targets != m.tags:
        replay.at(
            key, line, f"{op} targets {list(targets)}; a body operation acts on all tags {list(m.tags)}"
        )
    replay.rows_seen[row] += 1
    return row

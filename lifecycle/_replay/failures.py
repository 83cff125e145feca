"""`lifecycle.failed` and `lifecycle.resolved`: a hook that raised, and what recover asked the backends."""

from __future__ import annotations

from typing import Any

from lifecycle import logs
from lifecycle._replay.messages import fmt_call, fmt_calls, fmt_logged, fmt_tag
from lifecycle._replay.state import Key, Replay, ReplayedMachine, plan, read_targets
from lifecycle.errors import LogFieldError
from lifecycle.table import (
    Call,
    Edge,
    Groups,
    Hook,
    Residency,
    Row,
    State,
    apply_call,
    failed_run,
    mark_unknown,
    resolve_contents,
    row_edges,
    select_row,
)


def failed(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """A hook raised: its edge's plan must have run up to it; the machine is FAILED."""
    op, phase = logs.text(d, "operation"), logs.text(d, "phase")
    src = logs.enum_field(d, "src", State)
    targets = read_targets(m, d)
    logged = logs.logged_calls(d)
    residency, groups = logs.residency(d), logs.optional_enum(d, "groups", Groups)
    hook = logs.member(Hook, logs.get(d, "hook"), "hook")
    where = f"hook {hook}{fmt_tag(d.get('tag'))} raised during {op} from {src}"

    def enter_failed() -> None:
        m.state, m.op, m.failed = State.FAILED, None, f"line {line}: {where}"
        m.unheld, m.releasing = None, op == "release"
        if set(residency) == set(m.tags):
            m.residency = dict(residency)
        m.groups = groups
        m.take_contents(d, line)

    if m.state is State.FAILED and op != "recover":
        replay.at(
            key,
            line,
            f"{op} on a FAILED actor ({m.failed}): only recover, or a refusal, may follow a failure",
        )
        return
    if src is not m.state:
        replay.at(key, line, f"{op} failure: log says src={src}, replay says {m.state}")
        enter_failed()
        return
    failed_calls = [c for c, ok in logged if not ok]
    if not failed_calls:
        replay.at(key, line, f"{where}, but its hooks list has no failed call: {fmt_logged(logged)}")
        enter_failed()
        return
    if failed_calls[0] != Call(hook, d.get("tag")):
        replay.at(
            key,
            line,
            f"the failed hook is {hook}{fmt_tag(d.get('tag'))}, but the first failed call logged is "
            f"{fmt_call(failed_calls[0])}",
        )
    candidates = _failed_rows(replay, key, m, line, op, phase, targets)
    plans = [(row, edge, plan(m, edge, targets)) for row, edge in candidates]
    m.budget = None  # a budget plan is for one sleep
    matching = [row for row, edge, plan in plans if edge.plan and failed_run(edge.plan, plan, logged)]
    if matching:
        replay.rows_seen[matching[0]] += 1
    elif plans:
        replay.at(
            key,
            line,
            f"{op} from {src} failed with hooks its plan cannot have run (the stages before the failure "
            "whole, then each branch of the failing stage up to its failure): expected from "
            f"{' or '.join(fmt_calls(plan) for _, _, plan in plans)}, logged {fmt_logged(logged)}",
        )
        enter_failed()
        return
    for call, ok in logged:
        if ok:
            m.groups = apply_call(call, m.residency, m.groups, m.way)
        else:
            m.groups = mark_unknown(call, m.residency, m.groups)
        m.apply(call, ok, line)
    replay.compare_after(key, m, line, f"{op} failure", residency, groups)
    replay.compare_contents(key, m, line, f"{op} failure", d)
    m.state, m.op, m.failed = State.FAILED, None, f"line {line}: {where}"
    m.unheld, m.releasing = None, op == "release"  # a failure drops what a held scope deferred


def _failed_rows(
    replay: Replay, key: Key, m: ReplayedMachine, line: int, op: str, phase: str, targets: tuple[str, ...]
) -> list[tuple[Row, Edge]]:
    """The rows and edges a failure could have happened on (recover: either target)."""
    if m.op is not None:
        running = m.op.row
        if phase == "exit" and op == running.operation and m.op.body_done:
            return [(running, e) for e in row_edges(running) if e.phase == "exit"]
        replay.at(
            key,
            line,
            f"{op} {phase} failed while {running.operation} (line {m.op.line}) has not finished",
        )
        m.op = None
    if phase == "exit":
        replay.at(key, line, f"{op} exit failed, but no {op} body ran before it")
        return []
    out: list[tuple[Row, Edge]] = []
    for target in (State.AWAKE, State.PAUSED) if op == "recover" else (None,):
        row = select_row(op, m.state, m.policy, m.residency, targets, target, holds=m.holds)
        edges = row_edges(row) if row is not None else ()
        if row is not None and edges and edges[0].phase == phase:
            out.append((row, edges[0]))
    if not out:
        replay.at(key, line, f"{op} {phase} failed from {m.state}, where the table has no such {op} step")
    return out


def resolved(replay: Replay, key: Key, m: ReplayedMachine, line: int, d: dict[str, Any]) -> None:
    """Recover asked the backends what the failure left unknown."""
    resolved = logs.get(d, "resolved")
    if not isinstance(resolved, dict):
        raise LogFieldError(f"resolved={resolved!r} is not a mapping")
    if m.state is not State.FAILED:
        replay.at(
            key, line, f"lifecycle.resolved in {m.state}; only recover from FAILED resolves unknown state"
        )
    for name, value in resolved.items():
        if name == "process_groups":
            if m.groups is not Groups.UNKNOWN:
                known = m.groups and m.groups.value
                replay.at(key, line, f"resolved the process groups, which the replay knows as {known}")
            m.groups = logs.member(Groups, value, "resolved")
        elif name in m.residency:
            if m.residency[name] is not Residency.UNKNOWN:
                replay.at(
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
            replay.at(
                key,
                line,
                f"resolved tag {name!r}, which is not one of this machine's tags {list(m.tags)}",
            )

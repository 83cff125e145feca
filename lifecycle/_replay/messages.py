"""How the replay's findings name calls, residencies and edges, and say what a hook list got wrong."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

from lifecycle.table import ALL_TAGS, Call, Edge, Hook, Residency

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
    Hook.BUDGET_CHECK: "check the memory budget's need",
}


def fmt_tag(tag: Any) -> str:
    return f"[{tag}]" if tag is not None else ""


def fmt_call(call: Call) -> str:
    return f"{call.hook.value}{fmt_tag(call.tag)}"


def fmt_calls(calls: Iterable[Call]) -> str:
    return "[" + ", ".join(fmt_call(c) for c in calls) + "]"


def fmt_logged(logged: Iterable[tuple[Call, bool]]) -> str:
    return "[" + ", ".join(f"{fmt_call(c)}{'' if ok else ' (ok=false)'}" for c, ok in logged) + "]"


def fmt_res(r: Residency | None) -> str:
    return "absent" if r is None else r.value


def fmt_residency(residency: Mapping[str, Residency]) -> str:
    return "{" + ", ".join(f"{t}: {r.value}" for t, r in residency.items()) + "}"


def edge_name(edge: Edge) -> str:
    if edge.phase == "exit":
        return f"{edge.operation} (exit {edge.source}→{edge.dest})"
    return f"{edge.operation} from {edge.source}"


def hooks_message(
    edge: Edge, expected: list[Call], logged: list[Call], residency: Mapping[str, Residency]
) -> str:
    """Say what a logged hook list got wrong against the plan, in words first."""
    parts: list[str] = []
    for call in expected:
        if call not in logged:
            parts.append("did not " + _DID_NOT[call.hook].format(tag=call.tag))
    extra = [c for c in logged if c not in expected]
    for call in extra:
        if call.hook is Hook.MEMORY_PAUSE and residency.get(call.tag or ALL_TAGS) is Residency.RELEASED:
            parts.append(
                f"paused tag {call.tag}, which was already released (torch_memory_saver exits on that)"
            )
        elif call.hook is Hook.MEMORY_RESUME and residency.get(call.tag or ALL_TAGS) is Residency.RESIDENT:
            parts.append(f"resumed tag {call.tag}, which was resident (torch_memory_saver exits on that)")
        else:
            parts.append(f"called {fmt_call(call)}, which the plan does not call here")
    if not parts:
        same = collections.Counter(expected) == collections.Counter(logged)
        parts.append("ran its hooks in the wrong order" if same else "repeated a hook")
    lead = edge_name(edge)
    if edge.operation == "recover" and extra:
        lead = f"recover to {edge.dest} re-ran hooks the residency did not need:"
    return f"{lead} {', '.join(parts)}: expected hooks {fmt_calls(expected)}, logged {fmt_calls(logged)}"

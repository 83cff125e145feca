"""Every sequence of an actor's methods up to a length, each run on a fresh actor over the strict fakes.

The search is breadth-first: all sequences of length 1, then every clean one extended by each
method, and so on; a sequence that hit a violation is reported and not extended (on the real
backends the process is gone or the weights are wrong from there on). So the first sequence
found for a kind of violation is a shortest one. A refused call (`LifecycleError` that is not a
`ProtocolViolation`: the machine said no before any work) is not a violation: the actor is as it
was and the sequence goes on. Each sequence runs from a fresh actor, so no state leaks between them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lifecycle.errors import LifecycleError, ProtocolViolation

# What each violation is on the real backends, by the fakes' messages.
KINDS = {
    "Cannot pause allocation": "pauses a paused tag (torch_memory_saver exits)",
    "Cannot resume allocation": "resumes a resident tag (torch_memory_saver exits)",
    "body used memory": "runs a body on paused memory",
    "collective on destroyed": "runs a collective on destroyed process groups",
    # SGLang's server and AReaL's AWEX plugin (tests/helpers/areal_like.py's ServerModel)
    "KeyError": "resumes a tag not released (SGLang's KeyError kills the server)",
    "only when server is idle": "releases with requests running (SGLang's fully-idle assertion)",
    "Pointer argument cannot be accessed": "generates on released memory (the server dies)",
    "waits forever": "admits requests that wait forever (generation paused, memory released)",
    "AWEX queue never processed": "publishes weights the scheduler never reads (not paused in place)",
    "served discarded weights": "serves weights a release discarded",
    "illegal memory access": "writes weights into released memory",
}


@dataclass(frozen=True)
class Finding:
    kind: str
    sequence: tuple[str, ...]  # its last call is where the violation happened
    detail: str

    @property
    def key(self) -> tuple[str, str]:
        """(kind, method): one reproduction per way a violation happens."""
        return self.kind, self.sequence[-1]


@dataclass
class Search:
    """What one search saw: its size, and per (kind, method) of violation the shortest sequence and a count."""

    depth: int
    sequences: int = 0  # sequences run, every length
    calls: int = 0  # method calls made, init excluded
    refusals: int = 0  # calls the lifecycle refused with a typed error
    shortest: dict[tuple[str, str], Finding] = field(default_factory=dict)
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    @property
    def violations(self) -> int:
        return sum(self.counts.values())


def explore(
    fresh: Callable[[], Any],
    methods: Mapping[str, Callable[[Any], object]],
    depth: int,
    check: Callable[[Any], str | None] = lambda actor: None,
) -> Search:
    """Run every sequence of `methods` up to `depth` calls, each on `fresh()`; see the module doc.

    `check(actor)`, after each call that returned or was refused, names a violation the fakes do
    not raise for (the weights read were discarded; the machine's residency is not the saver's), or None.
    """
    search = Search(depth)
    frontier: list[tuple[str, ...]] = [()]
    for _ in range(depth):
        extended: list[tuple[str, ...]] = []
        for prefix in frontier:
            for name in methods:
                sequence = (*prefix, name)
                finding = _run(fresh, methods, sequence, check, search)
                search.sequences += 1
                if finding is None:
                    extended.append(sequence)
                    continue
                search.counts[finding.key] += 1
                search.shortest.setdefault(finding.key, finding)
        frontier = extended
    return search


def _run(
    fresh: Callable[[], Any],
    methods: Mapping[str, Callable[[Any], object]],
    sequence: tuple[str, ...],
    check: Callable[[Any], str | None],
    search: Search,
) -> Finding | None:
    actor = fresh()
    for position, name in enumerate(sequence):
        last = position == len(sequence) - 1
        if last:
            search.calls += 1
        try:
            methods[name](actor)
        except ProtocolViolation as exc:
            return Finding(_kind(str(exc)), sequence, str(exc))
        except LifecycleError:
            if last:
                search.refusals += 1
        if last and (kind := check(actor)) is not None:
            return Finding(kind, sequence, f"after {name}")
    return None


def _kind(message: str) -> str:
    for needle, kind in KINDS.items():
        if needle in message:
            return kind
    return f"other: {message}"


def render(config: str, search: Search) -> str:
    """The findings of one search as lines, for a report."""
    lines = [
        f"{config}: {search.sequences} sequences up to length {search.depth} ({search.calls} calls), "
        f"{search.violations} end in a violation, {search.refusals} calls refused with a typed error"
    ]
    for key, finding in sorted(search.shortest.items()):
        lines.append(
            f"  {finding.kind} in {finding.sequence[-1]}: {search.counts[key]} sequences; "
            f"shortest: init → {' → '.join(finding.sequence)}"
        )
    return "\n".join(lines)

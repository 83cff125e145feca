"""A hook that raised: what the machine records of it (`Failure`), and what recover asks the
backends before it plans (the state the failure left unknown)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lifecycle.hooks import Hooks
from lifecycle.table import (
    ALL_TAGS,
    ASLEEP,
    Communicators,
    Contents,
    Groups,
    PolicyView,
    Residency,
    State,
    resolve_contents,
)


@dataclass(frozen=True)
class Failure:
    """What the machine recorded when a hook raised."""

    operation: str
    state: State  # the state the failing edge left from
    phase: str  # "move", "enter" (before the body) or "exit" (the body had run)
    hook: str
    tag: str | None
    error: str
    hooks: tuple[dict[str, Any], ...]  # the calls of the failing edge, in order, with ok flags
    residency: Mapping[str, Residency]
    groups: Groups | None
    contents: Mapping[str, Contents] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def resolve_unknown(
    hooks: Hooks,
    view: PolicyView,
    residency: dict[str, Residency],
    contents: dict[str, Contents],
    groups: Groups | None,
    communicators: Communicators,
    cannot: Callable[[str], BaseException],
) -> tuple[Groups | None, dict[str, Any]]:
    """Ask the backends what a failed hook left behind; never guess (vLLM's rule).

    Resolves `residency` and `contents` in place and returns the groups and what was resolved; a
    backend that cannot be asked raises `cannot(why)`.
    """
    resolved: dict[str, Any] = {}
    for tag, known in residency.items():
        if known is not Residency.UNKNOWN:
            continue
        query = getattr(hooks.memory, "is_paused", None)
        if query is None:
            raise cannot(
                f"the residency of tag {tag!r} is unknown (its hook raised) and the memory backend has no "
                "is_paused(tag) to ask; resuming a resident tag or pausing a released one kills the "
                "process under torch_memory_saver, so restart this actor instead",
            )
        paused = query(None if tag == ALL_TAGS else tag)
        residency[tag] = Residency.RELEASED if paused else Residency.RESIDENT
        resolve_contents(tag, residency[tag], view, contents)
        resolved[tag] = residency[tag]
    if groups is Groups.UNKNOWN:
        query = getattr(hooks.process_groups, "is_alive", None)
        if query is None:
            raise cannot(
                "the process groups' state is unknown (their hook raised) and the process-group backend "
                "has no is_alive() to ask; restart this actor instead",
            )
        groups = Groups.ALIVE if query() else ASLEEP[communicators]
        resolved["process_groups"] = groups
    return groups, resolved

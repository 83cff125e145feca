"""The lifecycle log format: every event name, reading JSON-lines logs, and reading their fields.

Writers (the machine, the weight-sync sender and receiver, the process groups, the release audit)
name their events with `Event`; readers (`lifecycle.checker`, `lifecycle.sync_checks`,
`lifecycle.timeline`, the demo's report) read files with `read_logs` once and share the parsed lines.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from lifecycle.errors import LogFieldError
from lifecycle.table import Call, Communicators, Contents, Groups, Hook, Residency, State

__all__ = [
    "Event",
    "LogFile",
    "LogLine",
    "log_paths",
    "parse_lines",
    "read_log",
    "read_logs",
]


class Event(str, enum.Enum):
    """Every event name the library writes (torchtitan's `LogType`: written once, read everywhere)."""

    CONFIGURED = "lifecycle.configured"
    TRANSITION = "lifecycle.transition"
    BODY = "lifecycle.body"
    NOOP = "lifecycle.noop"
    REFUSED = "lifecycle.refused"
    FAILED = "lifecycle.failed"
    RESOLVED = "lifecycle.resolved"
    CONTENTS = "lifecycle.contents"  # a sync body declared what it did to the weights (note_weights)
    HOLD = "lifecycle.hold"  # a hold taken (held scope): `holds` after
    RELEASE = "lifecycle.release"  # a hold given back: `holds` after, `deferred` (what its sleep slept)
    DEFERRED = "lifecycle.deferred"  # an operation inside a held scope changed the deferred tags
    GROUPS_DESTROYED = "process_groups.destroyed"
    GROUPS_RELOADED = "process_groups.reloaded"
    SYNC_TRANSPORT = "weight_sync.transport"
    SYNC_UPDATE = "weight_sync.update"  # a trainer rank sent one version
    SYNC_LOADED = "weight_sync.loaded"  # a rollout engine loaded one version
    MEMORY_RELEASED = "memory.released"  # device memory one pause freed (warning: much less than its tags)
    MEMORY_TAKEN = "memory.taken"  # device memory one resume took
    BUDGET = "lifecycle.budget"  # a sleep's memory-budget plan: what it releases and keeps, and why
    BUDGET_CHECKED = "lifecycle.budget_checked"  # after that sleep: the need free, or how short
    RANKS_LOST = "ranks.lost"  # the driver told this actor that ranks were lost with their node
    ROUTER = "rollout.router"  # a framework's engine actor took its server out of the router, or put it back
    ABSORBED = "rollout.absorbed"  # a framework's call the engine actor answered without sending it (and why)
    SERVER_DIED = (
        # a rollout engine's process exited (a framework's engine server, or an in-process engine's
        # scheduler or EngineCore): which, during which call, and what was killed
        "rollout.server_died"
    )

    def __str__(self) -> str:
        return self.value

    @property
    def is_lifecycle(self) -> bool:
        """An event of the machine itself (replayed against the table by the checker)."""
        return self.value.startswith("lifecycle.")

    @property
    def is_weight_sync(self) -> bool:
        """An event of a weight sync (an update sent or a version loaded)."""
        return self.value.startswith("weight_sync.")

    @classmethod
    def of(cls, name: str) -> Event | None:
        """The event named `name`, or None for an event this library does not write."""
        return _BY_NAME.get(name)


_BY_NAME = {e.value: e for e in Event}


# ---------------------------------------------------------------------------------------------- files


class LogLine(NamedTuple):
    """One non-blank line of a log: its number, the event dict, or why it is not one."""

    line: int
    event: dict[str, Any] | None
    error: str | None


@dataclass(frozen=True)
class LogFile:
    """One log file, parsed once: shared by the checker, the timeline and reports."""

    path: str
    lines: tuple[LogLine, ...]


def parse_lines(lines: Iterable[str]) -> Iterator[LogLine]:
    """Parse JSON lines; blank lines are skipped, line numbers count from 1."""
    for number, text in enumerate(lines, 1):
        text = text.strip()
        if not text:
            continue
        try:
            data = json.loads(text)
        except ValueError as exc:
            yield LogLine(number, None, f"line is not JSON ({exc}): {text[:80]!r}")
            continue
        except RecursionError:
            yield LogLine(number, None, f"line is not JSON (nested too deep to read): {text[:80]!r}")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("event"), str):
            yield LogLine(
                number, None, f"line is not a log event (a JSON object with an 'event'): {text[:80]!r}"
            )
            continue
        yield LogLine(number, data, None)


def read_log(path: str | Path) -> Iterator[LogLine]:
    """The lines of one JSON-lines log file."""
    with Path(path).open(encoding="utf-8", errors="replace") as stream:
        yield from parse_lines(stream)


def log_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files to read: each path as given, or the `*.jsonl` files of a directory. Raises on a missing path."""
    out: list[Path] = []
    for given in dict.fromkeys(paths):  # a file named twice is read once
        path = Path(given)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise FileNotFoundError(
                    f"{path} is a directory with no *.jsonl files; pass the JSON-lines logs written by "
                    "lifecycle.configure_logging(json_path=...), or the directory that holds them"
                )
            out += [p for p in found if p not in out]
        elif path.is_file():
            if path not in out:
                out.append(path)
        else:
            raise FileNotFoundError(
                f"{path} does not exist; pass the JSON-lines logs written by "
                "lifecycle.configure_logging(json_path=...), or the directory that holds them"
            )
    if not out:
        raise ValueError("no log files given; pass one or more JSON-lines logs or directories")
    return out


def read_logs(logs: Iterable[str | Path | LogFile]) -> list[LogFile]:
    """Parse log files (or directories of `*.jsonl`) once; already parsed `LogFile`s pass through."""
    items = list(logs)
    parsed = [item for item in items if isinstance(item, LogFile)]
    paths = [item for item in items if not isinstance(item, LogFile)]
    if paths:
        parsed += [LogFile(str(path), tuple(read_log(path))) for path in log_paths(paths)]
    if not parsed:
        raise ValueError("no log files given; pass one or more JSON-lines logs or directories")
    return parsed


# ---------------------------------------------------------------------------------------------- fields
#
# A bad value is a finding for its line, never an exception out of a reader: readers raise
# `LogFieldError`, which the checker turns into a finding.

_E = TypeVar("_E", State, Residency, Groups, Hook, Contents, Communicators)


def get(d: Mapping[str, Any], name: str) -> Any:
    """The field `name`; raises `LogFieldError` when the line has none."""
    if name not in d:
        raise LogFieldError(f"has no {name!r} field")
    return d[name]


def text(d: Mapping[str, Any], name: str) -> str:
    """The string field `name`."""
    value = get(d, name)
    if not isinstance(value, str):
        raise LogFieldError(f"{name}={value!r} is not a string")
    return value


def integer(d: Mapping[str, Any], name: str) -> int:
    """The integer field `name` (a bool is not one)."""
    value = get(d, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise LogFieldError(f"{name}={value!r} is not an integer")
    return value


def number(d: Mapping[str, Any], name: str, what: str = "a finite number") -> float:
    """The numeric field `name` as a float: finite, not a bool (Python's JSON reads NaN, Infinity, 1e400)."""
    value = get(d, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            as_float = float(value)
        except OverflowError:  # an integer past the float range
            pass
        else:
            if math.isfinite(as_float):
                return as_float
    raise LogFieldError(f"{name}={_short(value)} is not {what}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def member(kind: type[_E], value: Any, name: str) -> _E:
    """`value` as a member of the enum `kind`; `name` says which field it came from."""
    try:
        return kind(value)
    except ValueError:
        raise LogFieldError(f"{name} has {value!r}, which is not one of {[e.value for e in kind]}") from None


def enum_field(d: Mapping[str, Any], name: str, kind: type[_E]) -> _E:
    """The field `name` as a member of the enum `kind`."""
    return member(kind, get(d, name), name)


def optional_enum(d: Mapping[str, Any], name: str, kind: type[_E]) -> _E | None:
    """The field `name` as a member of `kind`, or None where the line logs null."""
    value = get(d, name)
    return None if value is None else member(kind, value, name)


def residency(d: Mapping[str, Any]) -> dict[str, Residency]:
    """The `residency` field: tag → resident/released/unknown."""
    value = get(d, "residency")
    if not isinstance(value, dict):
        raise LogFieldError(f"residency={value!r} is not a mapping of tag to residency")
    return {str(tag): member(Residency, r, "residency") for tag, r in value.items()}


def contents(d: Mapping[str, Any]) -> dict[str, Contents] | None:
    """The `contents` field (tag → valid/discarded/unknown), or None in logs written before it existed."""
    value = d.get("contents")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise LogFieldError(f"contents={value!r} is not a mapping of tag to contents")
    return {str(tag): member(Contents, c, "contents") for tag, c in value.items()}


def logged_calls(d: Mapping[str, Any]) -> list[tuple[Call, bool]]:
    """The `hooks` list of a transition or failure: each call and whether it returned."""
    hooks = get(d, "hooks")
    if not isinstance(hooks, list):
        raise LogFieldError(f"hooks={hooks!r} is not a list")
    out = []
    for entry in hooks:
        if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
            raise LogFieldError(f"hook entry {entry!r} is not {{name, ms, ok[, tag]}}")
        tag = entry.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise LogFieldError(f"hook entry {entry!r} has a tag that is not a string")
        out.append((Call(member(Hook, entry.get("name"), "hooks"), tag), entry["ok"]))
    return out

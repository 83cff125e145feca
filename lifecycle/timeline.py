"""Timelines of lifecycle logs: a Chrome/Perfetto trace and a PNG, one lane per rank and role.

    write_trace(["logs/"], "timeline.json")  # open in ui.perfetto.dev or chrome://tracing
    render_png(["logs/"], "timeline.png")

Each machine's states tile its time from its `lifecycle.configured` event to the last timestamp
of its file; transitions, their hooks and bodies nest inside the state they ran in; no-ops,
refusals, failures, weight-sync and memory-audit events are instants; so are the changes of a
rollout's weight contents (discarded or unknown, then valid at a version), of a held scope's
deferred sleep, and the process groups going to sleep (destroyed, suspended or kept). A held
scope (first hold to last release) is a slice on a track of its own beside its machine's, since
it spans state changes. Every function takes log paths, files already read
(`lifecycle.logs.read_logs`) or, past `read_lanes`, the lanes themselves.

A line that cannot be drawn (not JSON, or an event missing a field it needs) is skipped, the rest
of its file still drawn, and it is kept as a problem (`path:line: why`): in `Lane.problems`,
`problems(lanes)`, the trace's `otherData.problems` and `TimelinePicture.problems`. A lane whose
`lifecycle.configured` line is lost starts at its first readable state. `lifecycle.checker`
judges the lines; this module only says which ones it could not draw.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifecycle import logs as fields
from lifecycle.errors import LogFieldError
from lifecycle.logs import Event, LogFile, read_logs
from lifecycle.table import ALL_TAGS, State

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "STATE_COLORS",
    "Lane",
    "Mark",
    "Span",
    "TimelinePicture",
    "build_trace",
    "draw_figure",
    "problems",
    "read_lanes",
    "render_png",
    "write_trace",
]

# One colour per state, the same in every picture.
STATE_COLORS: Mapping[State, str] = {
    State.AWAKE: "#43a047",
    State.PAUSED: "#b0bec5",
    State.SAVING: "#fbc02d",
    State.SYNCING: "#1e88e5",
    State.FAILED: "#e53935",
}
# Chrome's trace viewer only takes its reserved colour names; Perfetto picks its own colours.
_TRACE_COLORS: Mapping[State, str] = {
    State.AWAKE: "good",
    State.PAUSED: "grey",
    State.SAVING: "yellow",
    State.SYNCING: "rail_load",
    State.FAILED: "terrible",
}
# (marker, face colour, size, legend label) per kind of instant in the picture.
_MARKS: Mapping[str, tuple[str, str, float, str]] = {
    "failed": ("X", "#b71c1c", 70.0, "failure"),
    "noop": ("o", "white", 16.0, "no-op"),
    "refused": ("v", "#ef6c00", 24.0, "refused"),
    "weight_sync": ("d", "#0d47a1", 12.0, "weight sync"),
    "release_short": ("^", "#ff6f00", 50.0, "release freed too little"),
    "weights_valid": ("*", "#2e7d32", 60.0, "weights valid (version)"),
    "weights_invalid": ("*", "white", 60.0, "weights discarded/unknown"),
    "deferred": ("s", "#7e57c2", 22.0, "sleep deferred (held scope)"),
    "groups_destroyed": ("P", "#78909c", 30.0, "groups destroyed"),
    "groups_suspended": ("H", "#5e35b1", 30.0, "groups suspended"),
    "groups_kept": ("p", "#00897b", 34.0, "groups kept"),
}
_HELD_COLOR = "#7e57c2"


@dataclass
class Span:
    """A slice inside a lane: a transition, one of its hooks, or a body (times in epoch seconds)."""

    name: str
    cat: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    failed: bool = False


@dataclass
class Mark:
    """An instant: a no-op, a refusal, a failure, a resolution, a weight-sync or other event."""

    kind: str
    name: str
    time: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Lane:
    """One machine (file, rank, role): its states tile [start, end]; spans nest inside them."""

    path: str
    rank: int | None
    role: str | None
    states: list[tuple[float, float, State]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    held: list[tuple[float, float]] = field(default_factory=list)  # held scopes: first hold to last release
    # `path:line: why` for each line of its file it could not draw (the first lane also carries
    # the files that gave no lane at all)
    problems: list[str] = field(default_factory=list)
    name: str = ""  # the label, with the file name when two files hold the same rank and role
    _current: tuple[float, State] | None = None
    _weight_tags: tuple[str, ...] = ()  # the tags `generate` reads (from the configured policy)
    _weights: str | None = None  # "valid", or what the weight tags hold when they are not
    _held_since: float | None = None
    _groups: str | None = None  # the process groups' last logged state

    def note_groups(self, groups: Any, when: float) -> None:
        """Mark when the process groups go to sleep, and how: destroyed, suspended or kept."""
        if not isinstance(groups, str) or groups == self._groups:
            return
        self._groups = groups
        if f"groups_{groups}" in _MARKS:
            self.marks.append(Mark(f"groups_{groups}", f"groups {groups}", when, {"groups": groups}))

    def note_contents(self, d: Mapping[str, Any], when: float) -> None:
        """Mark when the weight tags' contents change: invalid (discarded/unknown) or valid at a version."""
        contents = d.get("contents")
        if not isinstance(contents, dict) or not self._weight_tags:
            return
        held = sorted({str(contents.get(t)) for t in self._weight_tags} - {"valid"})
        now = "valid" if not held else "/".join(held)
        if now == self._weights:
            return
        first = self._weights is None
        self._weights = now
        version = d.get("weight_version")
        if now == "valid":
            if not first:
                name = f"weights valid v{version}" if version is not None else "weights valid"
                self.marks.append(Mark("weights_valid", name, when, {"weight_version": version}))
        else:
            self.marks.append(Mark("weights_invalid", f"weights {now}", when, {"contents": contents}))

    @property
    def label(self) -> str:
        """The lane's name: its rank and role ("rank 0 trainer"), or its file's name without them."""
        parts = [p for p in (None if self.rank is None else f"rank {self.rank}", self.role) if p]
        return " ".join(parts) or Path(self.path).name

    def set_state(self, time: float, state: State) -> None:
        """The machine is in `state` from `time` on."""
        if self._current is not None and self._current[1] is state:
            return  # a self-loop (partial wake, sync from PAUSED's exit) keeps one slice
        if self._current is not None:
            start, previous = self._current
            time = max(time, start)  # a clock step back must not make a slice run backwards
            self.states.append((start, time, previous))
        self._current = (time, state)

    def begin(self, time: float, state: State) -> None:
        """Start the lane in `state` at `time` when no `lifecycle.configured` has started it."""
        if self._current is None and not self.states:
            self.set_state(time, state)

    def close(self, end: float) -> None:
        """End the last state slice and any held scope still open at `end`."""
        if self._current is not None:
            start, state = self._current
            self.states.append((start, max(end, start), state))
            self._current = None
        if self._held_since is not None:  # a scope still held when the log ends
            self.held.append((self._held_since, max(end, self._held_since)))
            self._held_since = None

    def note_holds(self, holds: int, when: float) -> None:
        """A hold taken or given back: the scope opens at the first hold and closes at the last release."""
        if holds > 0 and self._held_since is None:
            self._held_since = when
        elif holds == 0 and self._held_since is not None:
            self.held.append((self._held_since, max(when, self._held_since)))
            self._held_since = None


# ----------------------------------------------------------------------------------------------
# Reading logs into lanes


Logs = Iterable[str | Path | LogFile]  # paths, directories of *.jsonl, or files already read


def read_lanes(logs: Logs) -> list[Lane]:
    """One lane per machine in the logs, ordered by rank, then role, then file.

    Raises ValueError when no file has a lifecycle event with a rank or role to draw.
    """
    lanes: list[Lane] = []
    laneless: list[str] = []  # problems of the files that gave no lane
    for file in read_logs(logs):
        found, left = _read_file(file)
        lanes += found
        if not found:
            laneless += [
                *left,
                f"{file.path}: no lifecycle events with a rank or role: nothing drawn from it",
            ]
    if not lanes:
        first = f"; first: {laneless[0]}" if len(laneless) > 1 else ""
        raise ValueError(
            "no lifecycle events with a rank or role in the given logs; pass the JSON-lines files written by "
            f"lifecycle.configure_logging(json_path=...) at level info{first}"
        )
    lanes.sort(key=lambda lane: (lane.rank is None, lane.rank or 0, lane.role or "", lane.path))
    lanes[0].problems += laneless
    labels = collections.Counter(lane.label for lane in lanes)
    for lane in lanes:
        lane.name = lane.label if labels[lane.label] == 1 else f"{lane.label} ({Path(lane.path).name})"
        _nest(lane)
    return lanes


def problems(lanes: Iterable[Lane]) -> list[str]:
    """Every line the lanes' files could not draw, `path:line: why`, in lane order, each once."""
    return list(dict.fromkeys(p for lane in lanes for p in lane.problems))


def _read_file(file: LogFile) -> tuple[list[Lane], list[str]]:
    """The file's lanes, and the problems found before its first lane (all of them if it has none)."""
    lanes: dict[tuple[Any, Any], Lane] = {}
    now: float | None = None
    end = float("-inf")
    # A line that cannot be read goes to the lane of the event before it (in a per-rank log, its
    # own); lines before the first lane wait for it.
    waiting: list[str] = []
    last: Lane | None = None
    for entry in file.lines:
        where = f"{file.path}:{entry.line}"
        d = entry.event
        if d is None:
            (waiting if last is None else last.problems).append(f"{where}: {entry.error}")
            continue
        name = d["event"]
        key = (d.get("rank"), d.get("role"))
        if isinstance(key[0], bool) or not (
            isinstance(key[0], (int, type(None))) and isinstance(key[1], (str, type(None)))
        ):
            if Event.of(name) is not None:  # another layer's event may use rank and role its own way
                (waiting if last is None else last.problems).append(
                    f"{where}: {name} has rank={key[0]!r}, role={key[1]!r}, not an integer and a string: not drawn"
                )
            continue
        actor = key != (None, None) or name.startswith("lifecycle.")
        when = _timestamp(d.get("timestamp"))
        if when is None:
            when = _time(d.get("t"))  # logs captured without structlog's timestamps still have `t`
        if when is None:
            when = now
        if when is None:
            if actor:
                (waiting if last is None else last.problems).append(
                    f"{where}: {name} has no timestamp, and no line before it has one: not drawn"
                )
            continue
        now = when
        end = max(end, when)
        if not actor:
            continue  # not an actor's event
        lane = lanes.get(key)
        if lane is None:
            lane = lanes[key] = Lane(file.path, key[0], key[1])
            lane.problems += waiting
            waiting = []
        last = lane
        end = max(end, _add_event(lane, name, d, when, where))
    for lane in lanes.values():
        lane.close(end)
    return list(lanes.values()), waiting


def _add_event(lane: Lane, name: str, d: dict[str, Any], when: float, where: str) -> float:
    """Add one event to its lane; return the latest time it covers. `where` is its `path:line`."""
    try:
        event = Event.of(name)
        if event is Event.CONFIGURED:
            lane.set_state(when, fields.enum_field(d, "state", State))
            logged = d.get("policy")
            policy: dict[str, Any] = logged if isinstance(logged, dict) else {}
            tags = policy.get("memory_tags") or [ALL_TAGS]
            lane._weight_tags = tuple(str(t) for t in policy.get("sync_requires") or tags)
            lane.note_contents(d, when)
            lane.note_groups(d.get("groups"), when)
        elif event is Event.TRANSITION:
            start = fields.number(d, "t")
            stop = start + max(fields.number(d, "duration_ms"), 0.0) / 1e3
            src, dst = fields.enum_field(d, "src", State), fields.enum_field(d, "dst", State)
            lane.begin(start, src)
            lane.spans.append(
                Span(
                    f"{fields.get(d, 'operation')} {src.value}→{dst.value}",
                    "transition",
                    start,
                    stop,
                    _pick(d, "operation", "phase", "step", "duration_ms", "targets", "residency", "groups"),
                )
            )
            _hook_spans(lane, d.get("hooks") or [], start, stop)
            lane.set_state(stop, dst)
            lane.note_contents(d, stop)
            lane.note_groups(d.get("groups"), stop)
            return stop
        elif event is Event.FAILED:
            hooks = d.get("hooks") or []
            total = sum(_ms(h, "ms") for h in hooks if isinstance(h, dict)) / 1e3
            if d.get("src") is not None:
                lane.begin(when - total, fields.enum_field(d, "src", State))
            _hook_spans(lane, hooks, when - total, when)
            what = f"{d.get('hook')}{'[' + str(d['tag']) + ']' if d.get('tag') else ''}"
            lane.marks.append(
                Mark(
                    "failed",
                    f"FAILED: {what} raised in {d.get('operation')}",
                    when,
                    _pick(d, "operation", "src", "phase", "hook", "tag", "error", "residency", "groups"),
                )
            )
            lane.set_state(when, State.FAILED)
            lane.note_contents(d, when)
            lane.note_groups(d.get("groups"), when)
        elif event is Event.CONTENTS:
            lane.note_contents(d, when)
        elif event is Event.BODY:
            start = fields.number(d, "t")
            stop = start + max(fields.number(d, "duration_ms"), 0.0) / 1e3
            if "state" in d:
                lane.begin(start, fields.enum_field(d, "state", State))
            ok = bool(d.get("ok", True))
            args = _pick(d, "operation", "state", "ok", "error")
            lane.spans.append(
                Span(f"{fields.get(d, 'operation')} body", "body", start, stop, args, failed=not ok)
            )
            return stop
        elif event in (Event.NOOP, Event.REFUSED):
            if "state" in d:
                lane.begin(when, fields.enum_field(d, "state", State))
            kind = name.removeprefix("lifecycle.")
            lane.marks.append(
                Mark(kind, f"{kind} {d.get('operation')}", when, _pick(d, "operation", "state", "reason"))
            )
        elif event in (Event.HOLD, Event.RELEASE):
            lane.note_holds(fields.integer(d, "holds"), when)
            lane.marks.append(Mark("scope", name, when, _pick(d, "state", "holds", "deferred")))
        elif event is Event.DEFERRED:
            deferred = fields.get(d, "deferred")
            if not isinstance(deferred, list):
                raise LogFieldError(f"deferred={deferred!r} is not a list of tags")
            what = f"sleep deferred {deferred}" if deferred else "deferred sleep cancelled"
            lane.marks.append(Mark("deferred", what, when, _pick(d, "operation", "targets", "deferred")))
        elif event is Event.RESOLVED:
            lane.marks.append(Mark("resolved", "resolved", when, {"resolved": d.get("resolved")}))
            lane.note_contents(d, when)
            resolved = d.get("resolved")
            lane.note_groups(resolved.get("process_groups") if isinstance(resolved, dict) else None, when)
        elif event is Event.BUDGET:
            released = d.get("released")
            what = "keeps all" if released == [] else f"releases {', '.join(map(str, released or ['all']))}"
            lane.marks.append(Mark("event", f"budget: {what}", when, _fields(d)))
        elif event is Event.BUDGET_CHECKED:
            met = d.get("met") is not False
            label = (
                "budget: need free" if met else f"budget: {int(d.get('short_bytes') or 0) >> 20} MiB short"
            )
            # A need not free is a release that freed too little: drawn as one.
            lane.marks.append(Mark("event" if met else "release_short", label, when, _fields(d)))
        elif event in (Event.MEMORY_RELEASED, Event.MEMORY_TAKEN):
            short = event is Event.MEMORY_RELEASED and bool(d.get("short"))
            lane.marks.append(Mark("release_short" if short else "memory", name, when, _fields(d)))
        elif event is not None and event.is_weight_sync:
            version = f" v{d['version']}" if "version" in d else ""
            lane.marks.append(Mark("weight_sync", f"{name}{version}", when, _fields(d)))
        else:
            lane.marks.append(Mark("event", name, when, _fields(d)))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # LogFieldError is a ValueError
        lane.marks.append(Mark("event", f"unreadable {name}", when, {}))
        why = f"has no {exc.args[0]!r} field" if isinstance(exc, KeyError) and exc.args else str(exc)
        lane.problems.append(f"{where}: {name} cannot be drawn: {why}")
    return when


def _pick(d: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: d[k] for k in keys if k in d}


def _fields(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("event", "timestamp", "level", "log_level")}


def _hook_spans(lane: Lane, hooks: list[Any], start: float, stop: float) -> None:
    """Each hook logs its start (`at_ms` after the edge began) and duration; hooks of one stage overlap.

    Logs without `at_ms` (older ones) ran their hooks one after another from the edge's start.
    """
    at = start
    for hook in hooks:
        if not isinstance(hook, dict):
            continue
        ms = max(_ms(hook, "ms"), 0.0)
        if isinstance(hook.get("at_ms"), (int, float)):
            at = start + max(_ms(hook, "at_ms"), 0.0) / 1e3
        end = min(at + ms / 1e3, stop)
        name = f"{hook.get('name')}{'[' + str(hook['tag']) + ']' if hook.get('tag') else ''}"
        lane.spans.append(Span(name, "hook", min(at, stop), end, dict(hook), failed=hook.get("ok") is False))
        at = end


def _ms(hook: Mapping[str, Any], name: str) -> float:
    """A hook's `ms` or `at_ms` (0 when absent): a finite number, else LogFieldError."""
    return fields.number(hook, name) if name in hook else 0.0


def _time(value: Any) -> float | None:
    """`value` as epoch seconds, if it is a finite number."""
    try:
        return fields.number({"t": value}, "t")
    except ValueError:
        return None


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        # Python 3.10's fromisoformat does not read the "Z" that structlog writes.
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):  # not ISO 8601, or outside what a timestamp holds
        return None


def _nest(lane: Lane) -> None:
    """Clip spans so that on the lane's track every two slices are disjoint or nested."""
    if lane.states:
        first, last = lane.states[0][0], lane.states[-1][1]
        for span in lane.spans:
            span.start = min(max(span.start, first), last)
            span.end = min(max(span.end, span.start), last)
    roots: list[tuple[float, float, int, Span | None]] = [(s, e, 0, None) for s, e, _ in lane.states]
    items = roots + [(sp.start, sp.end, 1 + _DEPTH[sp.cat], sp) for sp in lane.spans]
    items.sort(key=lambda item: (item[0], -item[1], item[2]))
    stack: list[float] = []  # ends of the open slices
    for start, end, _, child in items:
        while stack and stack[-1] <= start:
            stack.pop()
        if child is not None and stack and end > stack[-1]:
            child.end = end = stack[-1]
        stack.append(end)


_DEPTH = {"transition": 0, "body": 0, "hook": 1}


# ----------------------------------------------------------------------------------------------
# Chrome / Perfetto trace


def _lanes(logs: Logs | Sequence[Lane]) -> list[Lane]:
    items = list(logs)
    if items and all(isinstance(item, Lane) for item in items):
        return items  # type: ignore[return-value]
    return read_lanes(items)  # type: ignore[arg-type]


def build_trace(logs: Logs | Sequence[Lane]) -> dict[str, Any]:
    """Chrome trace-event JSON: one process per rank, one thread per role, microseconds from the first event."""
    lanes = _lanes(logs)
    origin = _origin(lanes)

    def us(x: float) -> float:
        return round((x - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    pids: dict[Any, int] = {}
    tids: dict[int, int] = {}
    for lane in lanes:
        group = lane.rank if lane.rank is not None else f"file:{lane.path}"
        if group not in pids:
            pid = lane.rank if lane.rank is not None else 1_000_000 + len(pids)
            pids[group] = pid
            pname = f"rank {lane.rank}" if lane.rank is not None else Path(lane.path).name
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
        pid = pids[group]
        tid = tids[pid] = tids.get(pid, 0) + 1
        tname = (lane.role or "actor") + lane.name.removeprefix(lane.label)
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )

        slices: list[tuple[str, str, float, float, dict[str, Any], str | None]] = [
            (st.value, "state", s0, s1, {"state": st.value}, _TRACE_COLORS[st]) for s0, s1, st in lane.states
        ]
        slices += [
            (sp.name, sp.cat, sp.start, sp.end, sp.args, "bad" if sp.failed else None) for sp in lane.spans
        ]
        for name, cat, start, end, args, cname in slices:
            ts = us(start)
            event = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "args": args}
            event["dur"] = max(round(us(end) - ts, 3), 0.0)
            if cname:
                event["cname"] = cname
            events.append(event)
        if lane.held:
            held_tid = tids[pid] = tids[pid] + 1
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": held_tid,
                    "args": {"name": f"{tname} held"},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": held_tid,
                    "args": {"sort_index": held_tid},
                }
            )
            for start, end in lane.held:
                ts = us(start)
                held = {"ph": "X", "name": "held", "cat": "held", "pid": pid, "tid": held_tid, "ts": ts}
                events.append(held | {"dur": max(round(us(end) - ts, 3), 0.0), "args": {}})
        for mark in lane.marks:
            # A failure is drawn across the whole rank (scope "p") so it is seen when zoomed out.
            scope = "p" if mark.kind == "failed" else "t"
            instant = {"ph": "i", "name": mark.name, "cat": mark.kind, "pid": pid, "tid": tid, "s": scope}
            instant |= {"ts": us(mark.time), "args": mark.args}
            if mark.kind == "failed":
                instant["cname"] = "terrible"
            events.append(instant)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_epoch_s": origin,
            "lanes": [lane.name for lane in lanes],
            "problems": problems(lanes),  # the lines that could not be drawn
        },
    }


def write_trace(logs: Logs | Sequence[Lane], out_json: str | Path) -> Path:
    """Write `build_trace(logs)` to `out_json` (open it in ui.perfetto.dev or chrome://tracing)."""
    trace = build_trace(logs)
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, default=str), encoding="utf-8")
    return out


def _origin(lanes: list[Lane]) -> float:
    times = [s for lane in lanes for s, _, _ in lane.states[:1]]
    times += [sp.start for lane in lanes for sp in lane.spans] + [
        m.time for lane in lanes for m in lane.marks
    ]
    return min(times) if times else 0.0


# ----------------------------------------------------------------------------------------------
# Picture


@dataclass(frozen=True)
class TimelinePicture:
    """What `render_png` drew: the lane labels top to bottom, and how many bars and markers.

    `problems` holds each line of the logs that could not be drawn, as `path:line: why` (see
    `problems`); the picture is drawn from the other lines.
    """

    path: Path
    lanes: tuple[str, ...]
    bars: int
    markers: dict[str, int]
    seconds: float
    problems: tuple[str, ...] = ()


def draw_figure(logs: Logs | Sequence[Lane]) -> Figure:
    """A matplotlib figure of the logs: one horizontal lane per machine, a bar per state interval."""
    return _draw(_lanes(logs))[0]


def render_png(logs: Logs | Sequence[Lane], out_png: str | Path, *, dpi: int = 110) -> TimelinePicture:
    """Draw the logs (see `draw_figure`) into a PNG file with matplotlib's Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    read = _lanes(logs)
    figure, lanes, bars, markers, seconds = _draw(read)
    FigureCanvasAgg(figure)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=dpi)
    return TimelinePicture(out, lanes, bars, markers, seconds, tuple(problems(read)))


def _draw(lanes: list[Lane]) -> tuple[Figure, tuple[str, ...], int, dict[str, int], float]:
    # matplotlib is imported here only: the core stays importable without it.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    origin = _origin(lanes)
    count = len(lanes)
    # About a quarter inch per lane keeps 64 lanes readable without a giant image for two.
    height = max(3.0, 1.6 + 0.26 * count)
    figure = Figure(figsize=(13.0, height), layout="constrained")
    axes = figure.add_subplot()
    markers: dict[str, int] = dict.fromkeys(_MARKS, 0)
    bars = 0
    right = 0.0
    for index, lane in enumerate(lanes):
        y = count - 1 - index  # first lane at the top
        for state in State:
            ranges = [(s - origin, e - s) for s, e, st in lane.states if st is state]
            if ranges:
                axes.broken_barh(
                    ranges,
                    (y - 0.38, 0.76),
                    facecolors=STATE_COLORS[state],
                    edgecolors=STATE_COLORS[state],  # a hairline edge keeps sub-pixel intervals visible
                    linewidth=0.4,
                    gid=f"state {state} {index}",
                )
                bars += len(ranges)
        if lane.states:
            right = max(right, lane.states[-1][1] - origin)
        if lane.held:  # a thin band above the lane's states: the held scopes
            axes.broken_barh(
                [(s - origin, e - s) for s, e in lane.held],
                (y + 0.40, 0.12),
                facecolors=_HELD_COLOR,
                edgecolors=_HELD_COLOR,
                linewidth=0.4,
                gid=f"held {index}",
            )
        for kind, (marker, color, size, _) in _MARKS.items():
            xs = [m.time - origin for m in lane.marks if m.kind == kind]
            if xs:
                axes.scatter(
                    xs,
                    [y] * len(xs),
                    marker=marker,
                    s=size,
                    c=color,
                    edgecolors="black",
                    linewidths=0.5,
                    zorder=3,
                    gid=f"mark {kind} {index}",
                )
                markers[kind] += len(xs)
        for mark in lane.marks:
            version = mark.args.get("weight_version")
            if mark.kind == "weights_valid" and version is not None:
                label, color = f"v{version}", "#2e7d32"
            elif mark.kind == "refused" and mark.args.get("operation") == "generate":
                label, color = "generate refused", "#ef6c00"  # a driver that skipped a sync shows here
            else:
                continue
            axes.annotate(
                label,
                (mark.time - origin, y),
                xytext=(3, 5),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
    labels = [lane.name for lane in lanes]
    axes.set_yticks(range(count), labels[::-1], fontsize=9 if count <= 24 else 7 if count <= 48 else 6)
    axes.set_ylim(-0.7, count - 0.3)
    axes.set_xlim(0.0, max(right, 1e-6))
    axes.set_xlabel("seconds since the first event")
    axes.grid(axis="x", linewidth=0.4, alpha=0.5)
    axes.set_title(f"lifecycle timeline: {count} lane{'s' if count != 1 else ''}, {right:.3g} s")
    handles: list[Any] = [Patch(facecolor=STATE_COLORS[s], label=s.value) for s in State]
    handles.append(Patch(facecolor=_HELD_COLOR, label="held scope"))
    handles += [
        Line2D(
            [],
            [],
            linestyle="",
            marker=m,
            markersize=7,
            markerfacecolor=c,
            markeredgecolor="black",
            label=label,
        )
        for m, c, _, label in _MARKS.values()
    ]
    # As many columns as the legend needs to fit beside the axes' height (a row is about 13 pt at
    # font size 8; the title and the x axis take about an inch of the figure's height).
    rows = max(1, int(((height - 1.0) * 72 - 6) // 13))
    axes.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
        ncols=-(-len(handles) // rows),
    )
    return figure, tuple(labels), bars, markers, right

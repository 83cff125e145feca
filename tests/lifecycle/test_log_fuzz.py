"""A fuzz pass over the log readers: arbitrary lines, and real logs with any field broken.

The line parser (`lifecycle.logs.parse_lines`) turns every line into an event or a reason it is
not one; the checker turns everything it cannot replay into findings; the timeline draws what it
can and keeps the rest as problems, raising ValueError only when nothing at all can be drawn. None
of them raises anything else, and none takes long on one log.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle import LifecyclePolicy, State, capture_events
from lifecycle.checker import Finding, LogChecker, check_lines
from lifecycle.logs import Event, LogFile, parse_lines
from lifecycle.testing import recording_lifecycle
from lifecycle.timeline import build_trace, problems, read_lanes
from tests.helpers.bodies import make_body

# Generous: the checker replays a 40-line log in milliseconds; a hang or a blow-up is far past this.
FUZZ = settings(max_examples=300, deadline=5000, database=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def real_events() -> tuple[dict[str, Any], ...]:
    """The events of a few real machines: two trainer ranks sharing a slot, a held scope, a rollout."""
    events: list[dict[str, Any]] = []
    with capture_events("info") as captured:
        trainers = [
            recording_lifecycle(
                LifecyclePolicy(offload_train=True, use_routing_replay=True),
                initial=State.PAUSED,
                rank=rank,
                role="trainer",
            )
            for rank in (0, 1)
        ]
        for lc, rec in trainers:
            lc.run("train", make_body(rec, lc, "train"))

            def update(lc: Any = lc) -> None:
                rank = lc.context["rank"]
                lc.event(
                    "weight_sync.update",
                    slot=0,
                    version=1,
                    transport="shm",
                    coordinator=rank == 0,
                    ranks=[0, 1],
                    ok=True,
                )

            lc.run("sync", update)
            with lc.held():
                lc.run("train", make_body(rec, lc, "train"))
            lc.wake_up()
        policy = LifecyclePolicy(
            memory_tags=("weights", "kv_cache"), sync_requires=("weights",), model_tag=None
        )
        lc, rec = recording_lifecycle(policy, generation=True, rank=0, role="rollout")
        lc.run("generate", make_body(rec, lc, "generate"))
        lc.sleep()
        lc.wake_up(tags=["weights"])
        lc.run("sync", make_body(rec, lc, "sync"))
        lc.wake_up()
    for i, event in enumerate(captured):
        # As the JSON-lines sink writes them: with structlog's timestamp.
        events.append({**event, "timestamp": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}.000000Z"})
    return tuple(events)


FIELDS = sorted({key for event in real_events() for key in event} | {"declared", "resolved", "short"})
WORDS = [e.value for e in Event] + [
    *(s.value for s in State),
    *("resident", "released", "unknown", "valid", "discarded", "alive", "destroyed", "suspended"),
    *("*", "weights", "kv_cache", "memory.pause", "memory.resume", "train", "sync", "sleep"),
    *("enter", "exit", "move", "idempotent", "nested in train", "held"),
    *("2026-01-01T00:00:00Z", "0001-01-01T00:00:00", "9999-12-31T23:59:59-14:00", "yesterday"),
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),  # past the float range
    st.floats(),  # NaN and infinities: Python's JSON writes and reads them
    st.text(st.characters(exclude_categories=()), max_size=8),  # lone surrogates too
    st.sampled_from(WORDS),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)), inner, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def broken_field(draw: st.DrawFn, event: dict[str, Any]) -> dict[str, Any]:
    """The event with one field (or one entry inside it) replaced, added or removed."""
    event = dict(event)
    own = bool(event) and draw(st.booleans())  # one of its fields, or any field of the format
    key = draw(st.sampled_from(sorted(event) if own else FIELDS))
    old = event.get(key)
    if draw(st.integers(0, 4)) == 0:
        event.pop(key, None)
    elif isinstance(old, dict) and old and draw(st.booleans()):
        event[key] = {**old, draw(st.sampled_from(sorted(old))): draw(values)}
    elif isinstance(old, list) and old and draw(st.booleans()):
        i = draw(st.integers(0, len(old) - 1))
        entry = old[i]
        if isinstance(entry, dict) and entry:
            entry = {**entry, draw(st.sampled_from(sorted(entry))): draw(values)}
        else:
            entry = draw(values)
        event[key] = [*old[:i], entry, *old[i + 1 :]]
    else:
        event[key] = draw(values)
    return event


@st.composite
def broken_logs(draw: st.DrawFn) -> list[str]:
    """A real log with a few edits: a broken field, a dropped, moved or made-up event, a cut line."""
    events = list(real_events())
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(events) - 1))
        edit = draw(st.sampled_from(["field", "field", "field", "drop", "move", "invent"]))
        if edit == "field":
            events[i] = draw(broken_field(events[i]))
        elif edit == "drop" and len(events) > 1:
            del events[i]
        elif edit == "move":
            events.insert(draw(st.integers(0, len(events) - 1)), events.pop(i))
        else:
            name = draw(st.sampled_from([e.value for e in Event]))
            events.insert(
                i, {"event": name, **draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=8))}
            )
    lines = [json.dumps(event) for event in events]
    if draw(st.booleans()):
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]  # a write cut short
    return lines


junk_lines = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=40),
        values.map(json.dumps),
        st.sampled_from(["", "{", "[" * 5000, "NaN", '{"event": 1}', '{"event": "lifecycle.transition"}']),
    ),
    max_size=20,
)


def check_everything(lines: list[str]) -> None:
    """Parse, check and draw `lines`; fail on anything but findings, problems and the documented ValueError."""
    parsed = list(parse_lines(lines))
    for entry in parsed:
        assert (entry.event is None) != (entry.error is None)
        assert entry.event is None or isinstance(entry.event.get("event"), str)
    findings = check_lines(lines, "fuzz.jsonl")
    assert all(isinstance(f, Finding) for f in findings)
    for finding in findings:
        str(finding).encode("utf-8")  # printable on any terminal
    try:
        lanes = read_lanes([LogFile("fuzz.jsonl", tuple(parsed))])
    except ValueError as exc:
        assert "no lifecycle events" in str(exc)
        return
    json.dumps(build_trace(lanes), default=str)
    assert all(isinstance(p, str) for p in problems(lanes))


class TestFuzz:
    def test_the_real_log_is_clean(self) -> None:
        """The seed of the fuzz is a clean log, so every finding below comes from an edit."""
        lines = [json.dumps(event) for event in real_events()]
        checker = LogChecker()
        checker.feed("seed.jsonl", lines)
        assert checker.finish() == []
        assert checker.machines == 3

    @FUZZ
    @given(junk_lines)
    def test_arbitrary_lines_give_findings_not_exceptions(self, lines: list[str]) -> None:
        check_everything(lines)

    @FUZZ
    @given(broken_logs())
    def test_a_real_log_with_any_field_broken_gives_findings_not_exceptions(self, lines: list[str]) -> None:
        check_everything(lines)

    @FUZZ
    @given(st.lists(st.text(st.characters(exclude_categories=()), max_size=60), max_size=10))
    def test_every_line_is_an_event_or_says_why_not(self, lines: list[str]) -> None:
        """Blank lines are skipped; every other line keeps its number and is an event xor an error."""
        parsed = list(parse_lines(lines))
        assert [entry.line for entry in parsed] == [i for i, text in enumerate(lines, 1) if text.strip()]
        assert all(entry.error is None or "line is not" in entry.error for entry in parsed)

"""The timeline: a valid Chrome/Perfetto trace and a PNG, drawn from logs of real machines."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from lifecycle import (
    Contents,
    IllegalTransitionError,
    LifecycleFailedError,
    LifecyclePolicy,
    State,
    configure_logging,
    flush_logs,
)
from lifecycle.machine import Lifecycle
from lifecycle.testing import InjectedFault, Recorders, recording_lifecycle
from lifecycle.timeline import (
    STATE_COLORS,
    Lane,
    build_trace,
    draw_figure,
    problems,
    read_lanes,
    render_png,
    write_trace,
)
from tests.helpers.bodies import make_body

TAGS = ("weights", "kv_cache", "cuda_graph")
US = 1e-3  # tolerance in microseconds: the trace rounds times to nanoseconds


@contextlib.contextmanager
def json_log(path: Path) -> Iterator[None]:
    configure_logging(json_path=path)
    try:
        yield
    finally:
        flush_logs()
        configure_logging(stream=io.StringIO(), level="warning")  # quiet again, as tests/conftest.py


def sync_body(lc: Lifecycle, rec: Recorders, version: int, ranks: tuple[int, ...]) -> Any:
    def run() -> None:
        rec.check_body(lc, "sync")
        rank = lc.context["rank"]
        lc.event(
            "weight_sync.update",
            slot=0,
            version=version,
            transport="cuda_ipc",
            coordinator=rank == min(ranks),
            ranks=list(ranks),
            bytes=4 << 20,
            buckets=1,
            duration_ms=0.2,
            gbps=20.0,
            ok=True,
        )

    return run


def trainer(path: Path, rank: int, ranks: tuple[int, ...]) -> None:
    with json_log(path):
        policy = LifecyclePolicy(offload_train=True)
        lc, rec = recording_lifecycle(policy, initial=State.PAUSED, rank=rank, role="trainer")
        for version in (1, 2):
            if rank == 2 and version == 2:
                rec.faults.arm("memory.resume")
                with pytest.raises(InjectedFault):
                    lc.run("train", make_body(rec, lc, "train"))
                with pytest.raises(LifecycleFailedError):
                    lc.sleep()
                lc.recover(State.PAUSED)
                lc.sleep()  # no-op
            lc.run("train", make_body(rec, lc, "train"))
            lc.run("sync", sync_body(lc, rec, version, ranks))
        if rank == 3:
            with pytest.raises(IllegalTransitionError):
                lc.recover(State.AWAKE)
        lc.run("save", make_body(rec, lc, "save"))


def engine(path: Path, rank: int) -> None:
    with json_log(path):
        policy = LifecyclePolicy(
            memory_tags=TAGS, sync_requires=("weights",), discard_on_release=TAGS, model_tag=None
        )
        lc, rec = recording_lifecycle(policy, generation=True, rank=rank, role="rollout")
        for version in (1, 2):
            lc.sleep()
            lc.wake_up(tags=["weights"])

            def load(version: int = version) -> None:
                rec.check_body(lc, "sync")
                lc.note_weights(Contents.UNKNOWN, version, reason="writing")
                lc.note_weights(Contents.VALID, version, reason="loaded")
                lc.event(
                    "weight_sync.loaded", version=version, bytes=8 << 20, checksum_ok=True, duration_ms=0.3
                )

            lc.run("sync", load)
            lc.wake_up()
            lc.run("generate", make_body(rec, lc, "generate"))


def shared_file(path: Path) -> None:
    """Three critics logging into one file: three machines, three lanes."""
    with json_log(path):
        machines = [
            recording_lifecycle(LifecyclePolicy(offload_train=True), rank=rank, role="critic")
            for rank in (10, 11, 12)
        ]
        for _ in range(2):
            for lc, rec in machines:
                lc.run("train", make_body(rec, lc, "train"))
        lc, rec = machines[0]
        rec.faults.arm("process_groups.reload", after_effect=True)
        with pytest.raises(InjectedFault):
            lc.wake_up()
        lc.recover(State.AWAKE)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("timeline")
    paths = []
    for rank in range(4):
        paths.append(directory / f"trainer{rank}.jsonl")
        trainer(paths[-1], rank, (0, 1, 2, 3))
    for rank in range(2):
        paths.append(directory / f"engine{rank}.jsonl")
        engine(paths[-1], rank)
    paths.append(directory / "critics.jsonl")
    shared_file(paths[-1])
    return paths


@pytest.fixture(scope="module")
def trace(logs: list[Path]) -> dict[str, Any]:
    return build_trace(logs)


# ----------------------------------------------------------------------------------------------
# What the logs say, read independently of the timeline module


def raw_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def machines(logs: list[Path]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    out: dict[tuple[str, int, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for path in logs:
        for line in raw_lines(path):
            out[(path.name, line["rank"], line["role"])].append(line)
    return out


def expected_states(lines: list[dict[str, Any]]) -> list[str]:
    """The state after each change, with repeats merged: what the state slices must spell."""
    states: list[str] = []
    for line in lines:
        new = {
            "lifecycle.configured": line.get("state"),
            "lifecycle.transition": line.get("dst"),
            "lifecycle.failed": "FAILED",
        }.get(line["event"])
        if new is not None and (not states or states[-1] != new):
            states.append(new)
    return states


def tracks(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] in ("X", "i"):
            out[(event["pid"], event["tid"])].append(event)
    return out


def track_names(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    return {
        (e["pid"], e["tid"]): f"{processes[e['pid']]} {e['args']['name']}"
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }


def track_of(trace: dict[str, Any], rank: int, role: str) -> list[dict[str, Any]]:
    (key,) = [k for k, name in track_names(trace).items() if name == f"rank {rank} {role}"]
    return tracks(trace)[key]


# ----------------------------------------------------------------------------------------------


class TestTrace:
    def test_every_event_has_the_keys_of_its_phase(self, trace: dict[str, Any]) -> None:
        required = {
            "X": {"name", "ph", "ts", "dur", "pid", "tid", "cat"},
            "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "M": {"name", "ph", "pid", "args"},
        }
        assert trace["displayTimeUnit"] == "ms"
        phases = collections.Counter(e["ph"] for e in trace["traceEvents"])
        assert set(phases) == {"X", "i", "M"} and phases["X"] > 50
        for event in trace["traceEvents"]:
            assert required[event["ph"]] <= set(event), event
            if event["ph"] == "X":
                assert event["dur"] >= 0 and event["ts"] >= 0, event
            if event["ph"] == "i":
                assert event["s"] in ("t", "p", "g")
            if event["ph"] == "M":
                assert event["name"] in (
                    "process_name",
                    "thread_name",
                    "process_sort_index",
                    "thread_sort_index",
                )
        json.loads(json.dumps(trace))  # plain JSON all the way down

    def test_one_process_per_rank_and_one_thread_per_role(
        self, trace: dict[str, Any], logs: list[Path]
    ) -> None:
        processes = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
        assert sorted(e["args"]["name"] for e in processes) == [f"rank {r}" for r in (0, 1, 10, 11, 12, 2, 3)]
        assert sorted(track_names(trace).values()) == sorted(
            f"rank {r} {role}" for _, r, role in machines(logs)
        )
        assert set(tracks(trace)) == set(track_names(trace))  # every slice and instant sits on a named track

    def test_slices_on_a_track_are_disjoint_or_nested(self, trace: dict[str, Any]) -> None:
        for key, events in tracks(trace).items():
            slices = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
            open_ends: list[float] = []
            for event in slices:
                start, end = event["ts"], event["ts"] + event["dur"]
                while open_ends and open_ends[-1] <= start + US:
                    open_ends.pop()
                assert not open_ends or end <= open_ends[-1] + US, f"{key}: {event} overlaps its parent"
                open_ends.append(end)

    def test_state_slices_tile_each_machine(self, trace: dict[str, Any], logs: list[Path]) -> None:
        """From its configured event to its file's last timestamp, each machine is in exactly one state."""
        origin = trace["otherData"]["origin_epoch_s"]
        for (file, rank, role), lines in machines(logs).items():
            states = [e for e in track_of(trace, rank, role) if e.get("cat") == "state"]
            assert [e["name"] for e in states] == expected_states(lines)
            for before, after in itertools.pairwise(states):
                assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=US)
            first = (epoch(lines[0]["timestamp"]) - origin) * 1e6
            path = next(p for p in logs if p.name == file)
            last = max(epoch(line["timestamp"]) for line in raw_lines(path))
            assert states[0]["ts"] == pytest.approx(first, abs=1.0)
            assert states[-1]["ts"] + states[-1]["dur"] == pytest.approx((last - origin) * 1e6, abs=1.0)

    def test_transitions_hooks_and_bodies_are_slices(self, trace: dict[str, Any], logs: list[Path]) -> None:
        lines = [line for path in logs for line in raw_lines(path)]
        cats = collections.Counter(e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X")
        assert cats["transition"] == sum(line["event"] == "lifecycle.transition" for line in lines)
        assert cats["body"] == sum(line["event"] == "lifecycle.body" for line in lines)
        hooks = sum(
            len(line["hooks"])
            for line in lines
            if line["event"] in ("lifecycle.transition", "lifecycle.failed")
        )
        assert cats["hook"] == hooks
        failed_hooks = [e for e in trace["traceEvents"] if e.get("cat") == "hook" and e.get("cname") == "bad"]
        assert len(failed_hooks) == sum(line["event"] == "lifecycle.failed" for line in lines)

    def test_failures_noops_and_refusals_are_instants(self, trace: dict[str, Any], logs: list[Path]) -> None:
        lines = [line for path in logs for line in raw_lines(path)]
        instants = collections.Counter(e["cat"] for e in trace["traceEvents"] if e["ph"] == "i")
        failed = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == "failed"]
        assert len(failed) == sum(line["event"] == "lifecycle.failed" for line in lines) == 2
        assert all(e["cname"] == "terrible" and e["name"].startswith("FAILED: ") for e in failed)
        assert {e["args"]["hook"] for e in failed} == {"memory.resume", "process_groups.reload"}
        assert instants["noop"] == sum(line["event"] == "lifecycle.noop" for line in lines) > 0
        assert instants["refused"] == sum(line["event"] == "lifecycle.refused" for line in lines) > 0

    def test_weight_sync_events_carry_version_and_bytes(self, trace: dict[str, Any]) -> None:
        updates = [e for e in trace["traceEvents"] if e["name"].startswith("weight_sync.update")]
        assert len(updates) == 8  # 4 ranks x 2 versions
        assert {(e["args"]["version"], e["args"]["bytes"]) for e in updates} == {(1, 4 << 20), (2, 4 << 20)}
        assert all(e["cat"] == "weight_sync" for e in updates)

    def test_rollout_weights_validity_is_marked_with_its_version(self, trace: dict[str, Any]) -> None:
        """Each release marks the weights discarded, each first write unknown, each final round valid at its
        version; a trainer whose resume raised shows its memory's contents unknown."""
        names = track_names(trace)
        marks: dict[str, list[str]] = collections.defaultdict(list)
        for e in trace["traceEvents"]:
            if e["ph"] == "i" and e["cat"] in ("weights_valid", "weights_invalid"):
                marks[names[(e["pid"], e["tid"])]].append(e["name"])
        engines = {lane: seen for lane, seen in marks.items() if "rollout" in lane}
        assert engines and all(
            seen
            == [
                "weights discarded",
                "weights unknown",
                "weights valid v1",
                "weights discarded",
                "weights unknown",
                "weights valid v2",
            ]
            for seen in engines.values()
        ), engines
        others = [seen for lane, seen in marks.items() if "rollout" not in lane]
        assert others == [["weights unknown"]], marks

    def test_transition_slices_carry_their_step_and_logged_duration(
        self, trace: dict[str, Any], logs: list[Path]
    ) -> None:
        """The demo's report costs each step from these (duration_ms as logged, not the clipped slice)."""
        lines = [line for path in logs for line in raw_lines(path) if line["event"] == "lifecycle.transition"]
        slices = [e for e in trace["traceEvents"] if e.get("cat") == "transition"]
        logged = collections.Counter((x.get("step"), x["duration_ms"]) for x in lines)
        assert (
            collections.Counter((e["args"].get("step"), e["args"]["duration_ms"]) for e in slices) == logged
        )

    def test_memory_audit_events_are_instants_and_a_short_release_is_marked(self, tmp_path: Path) -> None:
        path = tmp_path / "rollout.jsonl"
        with json_log(path):
            lc, _ = recording_lifecycle(LifecyclePolicy(), rank=0, role="rollout")
            lc.event("memory.released", tag="weights", expected_bytes=100, freed_bytes=100, short=False)
            lc.event(
                "memory.released", "warning", tag="weights", expected_bytes=100, freed_bytes=1, short=True
            )
            lc.event("memory.taken", tag="weights", expected_bytes=100, taken_bytes=100)
        trace = build_trace([path])
        kinds = [(e["cat"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "i"]
        assert kinds == [
            ("memory", "memory.released"),
            ("release_short", "memory.released"),
            ("memory", "memory.taken"),
        ]
        assert render_png([path], tmp_path / "t.png").markers["release_short"] == 1

    def test_write_trace_writes_loadable_json(self, logs: list[Path], tmp_path: Path) -> None:
        out = write_trace(logs, tmp_path / "sub" / "trace.json")
        assert json.loads(out.read_text()) == json.loads(json.dumps(build_trace(logs)))

    def test_a_clock_step_back_still_gives_a_valid_trace(self, logs: list[Path], tmp_path: Path) -> None:
        """A transition whose t went back (NTP step, hand edit) is clipped, never drawn overlapping."""
        lines = raw_lines(logs[0])
        i = [n for n, line in enumerate(lines) if line["event"] == "lifecycle.transition"][3]
        lines[i]["t"] -= 5.0
        edited = tmp_path / "stepped.jsonl"
        edited.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.test_slices_on_a_track_are_disjoint_or_nested(build_trace([edited]))

    def test_a_machine_without_rank_or_role_is_named_after_its_file(self, tmp_path: Path) -> None:
        path = tmp_path / "solo.jsonl"
        with json_log(path):
            lc, _ = recording_lifecycle(LifecyclePolicy())
            lc.sleep()
            lc.wake_up()
        trace = build_trace([path])
        assert list(track_names(trace).values()) == ["solo.jsonl actor"]
        assert [e["name"] for e in trace["traceEvents"] if e.get("cat") == "state"] == [
            "AWAKE",
            "PAUSED",
            "AWAKE",
        ]

    def test_bad_input_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            build_trace([tmp_path / "nope.jsonl"])
        empty = tmp_path / "empty.jsonl"
        empty.write_text('{"event": "unrelated", "timestamp": "2026-01-01T00:00:00Z"}\nnot json\n')
        with pytest.raises(ValueError, match="no lifecycle events"):
            build_trace([empty])


class TestPicture:
    def test_png_is_written(self, logs: list[Path], tmp_path: Path) -> None:
        picture = render_png(logs, tmp_path / "timeline.png")
        data = picture.path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 20_000
        assert picture.markers["failed"] == 2 and picture.markers["noop"] > 0
        assert picture.markers["weights_valid"] > 0 and picture.markers["weights_invalid"] > 0

    def test_one_lane_per_machine(self, logs: list[Path], trace: dict[str, Any]) -> None:
        from matplotlib.colors import to_hex

        figure = draw_figure(logs)
        (axes,) = figure.axes
        labels = [t.get_text() for t in axes.get_yticklabels()]
        assert sorted(labels) == sorted(f"rank {r} {role}" for _, r, role in machines(logs))
        assert len(labels) == len(read_lanes(logs)) == 9
        # every lane has bars, each state in its fixed colour, one bar per state slice of the trace
        bars = [c for c in axes.collections if (c.get_gid() or "").startswith("state ")]
        lanes_with_bars = {int(c.get_gid().split()[2]) for c in bars}
        assert lanes_with_bars == set(range(len(labels)))
        for collection in bars:
            state = State(collection.get_gid().split()[1])
            assert to_hex(collection.get_facecolor()[0]) == STATE_COLORS[state]
        assert {c.get_gid().split()[1] for c in bars} == {s.value for s in State}
        states = sum(1 for e in trace["traceEvents"] if e.get("cat") == "state")
        assert sum(len(c.get_paths()) for c in bars) == states
        legend = [t.get_text() for t in axes.get_legend().get_texts()]
        assert legend[:5] == [s.value for s in State] and "failure" in legend and "no-op" in legend

    def test_sixty_four_lanes_stay_readable(self, tmp_path: Path) -> None:
        """A 64-rank job gets one lane each, at least ~20 pixels apart, with legible labels."""
        path = tmp_path / "job.jsonl"
        with json_log(path):
            job = [
                recording_lifecycle(LifecyclePolicy(offload_train=True), rank=r, role="trainer")
                for r in range(64)
            ]
            for lc, rec in job:
                lc.run("train", make_body(rec, lc, "train"))
        picture = render_png([path], tmp_path / "job.png", dpi=110)
        assert len(picture.lanes) == 64 and picture.lanes[0] == "rank 0 trainer"
        figure = draw_figure([path])
        height_px = figure.get_size_inches()[1] * 110
        assert height_px / 64 >= 20
        (axes,) = figure.axes
        assert min(t.get_fontsize() for t in axes.get_yticklabels()) >= 6
        from PIL import Image

        with Image.open(picture.path) as image:
            assert image.size[1] >= 64 * 20

    @pytest.mark.parametrize("count", [1, 3, 8, 12, 64])
    def test_the_legend_fits_inside_the_image(self, count: int) -> None:
        """Every legend entry is inside the figure, however few lanes give it height."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        lanes = []
        for rank in range(count):
            lane = Lane("x.jsonl", rank, "trainer", states=[(0.0, 1.0, State.AWAKE)])
            lane.name = lane.label
            lanes.append(lane)
        figure = draw_figure(lanes)
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        (axes,) = figure.axes
        legend = axes.get_legend()
        assert len(legend.get_texts()) == len(State) + 1 + 11  # states, held scope, every kind of marker
        box, image = legend.get_window_extent(canvas.get_renderer()), figure.bbox
        assert image.x0 <= box.x0 and box.x1 <= image.x1 and image.y0 <= box.y0 and box.y1 <= image.y1, (
            box,
            image,
        )

    def test_the_core_imports_neither_matplotlib_nor_torch(self) -> None:
        """matplotlib is imported only when a picture is drawn; torch and ray never."""
        code = (
            "import sys, lifecycle.timeline, lifecycle.checker; "
            "bad = [m for m in ('matplotlib', 'torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


class TestHeldScopes:
    def test_a_held_scope_is_a_slice_on_its_own_track_and_deferrals_are_instants(
        self, tmp_path: Path
    ) -> None:
        """Each held scope (first hold to last release) is one slice on the machine's "held" track; each
        change of its deferred sleep is an instant on the machine's own track."""
        path = tmp_path / "held.jsonl"
        with json_log(path):
            lc, rec = recording_lifecycle(
                LifecyclePolicy(offload_train=True), initial=State.PAUSED, rank=0, role="trainer"
            )
            for _ in range(2):
                with lc.held():
                    lc.wake_up()
                    with lc.held():  # nested: still one scope
                        lc.run("train", make_body(rec, lc, "train"))
                    lc.run("save", make_body(rec, lc, "save"))
        trace = build_trace([path])
        names = track_names(trace)
        assert sorted(names.values()) == ["rank 0 trainer", "rank 0 trainer held"]
        (held_track,) = [k for k, name in names.items() if name.endswith("held")]
        scopes = tracks(trace)[held_track]
        assert [(e["name"], e["cat"]) for e in scopes] == [("held", "held"), ("held", "held")]
        lines = raw_lines(path)
        origin = trace["otherData"]["origin_epoch_s"]
        holds = [epoch(x["timestamp"]) for x in lines if x["event"] == "lifecycle.hold" and x["holds"] == 1]
        releases = [
            epoch(x["timestamp"]) for x in lines if x["event"] == "lifecycle.release" and x["holds"] == 0
        ]
        for scope, start, end in zip(scopes, holds, releases, strict=True):
            assert scope["ts"] == pytest.approx((start - origin) * 1e6, abs=1.0)
            assert scope["ts"] + scope["dur"] == pytest.approx((end - origin) * 1e6, abs=1.0)
        deferred = [e["name"] for e in track_of(trace, 0, "trainer") if e.get("cat") == "deferred"]
        assert deferred == ["sleep deferred ['*']", "sleep deferred ['*']"]
        picture = render_png([path], tmp_path / "held.png")
        assert picture.markers["deferred"] == 2
        figure = draw_figure([path])
        (axes,) = figure.axes
        assert [c for c in axes.collections if c.get_gid() == "held 0"]
        assert "held scope" in [t.get_text() for t in axes.get_legend().get_texts()]


def garble(path: Path, line: int, text: str) -> None:
    """Replace line `line` (from 1) of `path` with `text`."""
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")


class TestUnreadableLines:
    @pytest.fixture
    def ranks(self, tmp_path: Path) -> list[Path]:
        paths = [tmp_path / f"trainer{rank}.jsonl" for rank in (0, 1)]
        for rank, path in enumerate(paths):
            trainer(path, rank, (0, 1))
        return paths

    def test_a_garbled_line_keeps_its_lane_and_is_reported(self, ranks: list[Path], tmp_path: Path) -> None:
        """A line cut in rank 1's file (here its lifecycle.configured) leaves rank 1's lane drawn from
        its other events, and the line is reported with its file and number."""
        path = ranks[1]
        clean = raw_lines(path)
        assert clean[0]["event"] == "lifecycle.configured"
        garble(path, 1, json.dumps(clean[0])[:100])
        lanes = read_lanes(ranks)
        assert [lane.name for lane in lanes] == ["rank 0 trainer", "rank 1 trainer"]
        lane = lanes[1]
        transition = next(x for x in clean if x["event"] == "lifecycle.transition")
        assert lane.states[0][0] == pytest.approx(transition["t"])  # from its first readable state
        assert [s.value for _, _, s in lane.states] == expected_states(clean)
        (problem,) = problems(lanes)
        assert problem.startswith(f"{path}:1: line is not JSON")
        assert build_trace(lanes)["otherData"]["problems"] == [problem]
        picture = render_png(ranks, tmp_path / "t.png")
        assert picture.lanes == ("rank 0 trainer", "rank 1 trainer") and picture.problems == (problem,)

    def test_an_event_missing_a_field_is_a_problem_at_its_line(self, ranks: list[Path]) -> None:
        """A transition without its `t` is not drawn and named; the lane goes on from the next one."""
        path = ranks[0]
        lines = raw_lines(path)
        i = [n for n, x in enumerate(lines) if x["event"] == "lifecycle.transition"][2]
        del lines[i]["t"]
        lines.insert(i + 1, {"event": "lifecycle.noop", "rank": 0, "role": "trainer"} | {"timestamp": 7})
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        (lane, _) = read_lanes(ranks)
        assert problems([lane]) == [f"{path}:{i + 1}: lifecycle.transition cannot be drawn: has no 't' field"]
        assert len(lane.states) > 3

    def test_a_number_json_reads_but_no_clock_has_is_a_problem(self, ranks: list[Path]) -> None:
        """NaN, Infinity and integers past the float range are not times: the line is named, not drawn."""
        path = ranks[0]
        lines = path.read_text().splitlines()
        at = [n for n, x in enumerate(lines) if json.loads(x)["event"] == "lifecycle.transition"]
        for n, field, bad in ((at[1], "t", "Infinity"), (at[2], "duration_ms", "1" + "0" * 400)):
            value = json.loads(lines[n])[field]
            garble(path, n + 1, lines[n].replace(f'"{field}": {value!r}', f'"{field}": {bad}'))
        assert problems(read_lanes(ranks)) == [
            f"{path}:{at[1] + 1}: lifecycle.transition cannot be drawn: t=inf is not a finite number",
            f"{path}:{at[2] + 1}: lifecycle.transition cannot be drawn: duration_ms=1000000000000000000000000000000000000... "
            "is not a finite number",
        ]
        json.dumps(build_trace(ranks))

    def test_a_file_that_gives_no_lane_is_a_problem(self, ranks: list[Path], tmp_path: Path) -> None:
        other = tmp_path / "web.jsonl"
        other.write_text('{"event": "request done", "timestamp": "2026-01-01T00:00:00Z"}\n{oops\n')
        found = problems(read_lanes([*ranks, other]))
        assert found == [
            f"{other}:2: line is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)): '{{oops'",
            f"{other}: no lifecycle events with a rank or role: nothing drawn from it",
        ]

    def test_clean_logs_have_no_problems(self, logs: list[Path], trace: dict[str, Any]) -> None:
        assert problems(read_lanes(logs)) == [] and trace["otherData"]["problems"] == []

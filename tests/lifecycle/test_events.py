"""Lifecycle events: through the application's structlog, and into the per-rank JSON-lines sink."""

import io
import json
import os

import pytest
import structlog
from structlog.testing import capture_logs

import lifecycle
from lifecycle import LifecyclePolicy, State, capture_events
from lifecycle import events as ev
from lifecycle.testing import recording_lifecycle

SLEEP = ["routing_replay.clear", "clear_memory", "process_groups.destroy", "memory.pause"]


@pytest.fixture
def quiet_after():
    """Each test may configure structlog and the sink; put both back as conftest left them."""
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")


@pytest.mark.usefixtures("quiet_after")
class TestSink:
    def test_transition_event_fields(self):
        """One lifecycle.transition per edge with src, dst, operation, duration and each hook's name, ms, ok."""
        lc, _ = recording_lifecycle(LifecyclePolicy(use_routing_replay=True), rank=3, role="actor")
        lc.step = 7
        with capture_events() as events:
            lc.sleep()
        (event,) = events
        assert event["event"] == "lifecycle.transition" and event["level"] == "info"
        assert (
            event["src"],
            event["dst"],
            event["operation"],
            event["rank"],
            event["role"],
            event["step"],
        ) == (State.AWAKE, State.PAUSED, "sleep", 3, "actor", 7)
        assert [h["name"] for h in event["hooks"]] == SLEEP
        assert all(h["ok"] and h["ms"] >= 0 for h in event["hooks"])
        assert (
            event["duration_ms"] >= 0
            and event["residency"] == {"*": "released"}
            and event["groups"] == "destroyed"
        )

    def test_json_lines_file(self, tmp_path):
        path = tmp_path / "rank0.jsonl"
        lifecycle.configure_logging(json_path=path)
        try:
            lc, _ = recording_lifecycle(LifecyclePolicy(), rank=0, role="actor")
            lc.sleep()
            lc.sleep()
            assert lifecycle.flush_logs()
            lines = [json.loads(line) for line in path.read_text().splitlines()]
        finally:
            lifecycle.configure_logging(stream=io.StringIO(), level="warning")
        assert [x["event"] for x in lines] == [
            "lifecycle.configured",
            "lifecycle.transition",
            "lifecycle.noop",
        ]
        assert lines[1]["src"] == "AWAKE" and lines[1]["rank"] == 0 and "timestamp" in lines[1]

    def test_logging_never_crashes_the_machine(self):
        """A broken stream counts errors; the machine keeps working."""
        broken = io.StringIO()
        broken.close()
        lifecycle.configure_logging(stream=broken, fmt="json")
        try:
            lc, _ = recording_lifecycle(LifecyclePolicy())
            lc.sleep()
            lc.wake_up()
            lifecycle.flush_logs()
            errors = ev._current().writer.errors  # type: ignore[union-attr]
        finally:
            lifecycle.configure_logging(stream=io.StringIO(), level="warning")
        assert lc.state is State.AWAKE
        assert errors >= 1

    def test_filtered_level_emits_nothing(self):
        lc, _ = recording_lifecycle(LifecyclePolicy())
        with capture_events(level="warning") as events:
            lc.sleep()
        assert events == []


class TestObservers:
    """`Lifecycle.observe`: a framework's metrics fed from the machine's own events."""

    def test_an_observer_sees_every_transition_with_its_plan_even_with_logging_filtered(self):
        lc, _ = recording_lifecycle(LifecyclePolicy(offload_train=True), rank=1, role="actor")
        seen: list[tuple[str, dict]] = []
        lc.observe(lambda event, fields: seen.append((event, fields)))
        with capture_events(level="warning") as logged:
            lc.sleep()
            lc.run("train", lambda: None)
        assert logged == []  # nothing logged at this level, every event observed
        transitions = [f for e, f in seen if e == "lifecycle.transition"]
        assert [(f["operation"], f["phase"], f["plan"]) for f in transitions] == [
            ("sleep", "move", "sleep"),
            ("train", "enter", "wake"),
            ("train", "exit", "sleep"),
        ]
        assert all(f["rank"] == 1 and f["duration_ms"] >= 0 and f["hooks"] for f in transitions)
        assert [e for e, _ in seen].count("lifecycle.body") == 1

    def test_a_failing_observer_is_counted_and_never_fails_the_machine(self):
        lc, _ = recording_lifecycle(LifecyclePolicy())

        def broken(event: str, fields: dict) -> None:
            raise RuntimeError("metrics backend down")

        lc.observe(broken)
        lc.sleep()
        lc.wake_up()
        assert lc.state is State.AWAKE
        assert lc.observer_errors == 2

    def test_an_observer_must_be_callable(self):
        lc, _ = recording_lifecycle(LifecyclePolicy())
        with pytest.raises(TypeError, match="needs a callable"):
            lc.observe("perf")  # type: ignore[arg-type]


@pytest.mark.usefixtures("quiet_after")
class TestApplicationStructlog:
    """Events flow through the application's structlog configuration when it has one."""

    def test_capture_logs_sees_the_events(self):
        """structlog.testing.capture_logs() catches lifecycle events once the application configured structlog."""
        structlog.configure(processors=[structlog.processors.JSONRenderer()])
        lc, _ = recording_lifecycle(LifecyclePolicy(), rank=2, role="actor")
        with capture_logs() as logs:
            lc.sleep()
        (event,) = logs
        assert event["event"] == "lifecycle.transition" and event["log_level"] == "info"
        assert (event["src"], event["dst"], event["rank"], event["role"]) == (
            State.AWAKE,
            State.PAUSED,
            2,
            "actor",
        )

    def test_context_variables_reach_the_application_and_the_sink(self, tmp_path):
        """Fields bound with bind_contextvars (a trial id, an RL iteration) appear in both destinations."""
        seen = []

        def keep(_logger, _name, event_dict):
            seen.append(dict(event_dict))
            raise structlog.DropEvent

        structlog.configure(processors=[structlog.contextvars.merge_contextvars, keep])
        path = tmp_path / "rank0.jsonl"
        lifecycle.configure_logging(json_path=path)
        lc, _ = recording_lifecycle(LifecyclePolicy(), rank=0, role="actor")
        structlog.contextvars.bind_contextvars(trial="t-17", iteration=4)
        lc.sleep()
        assert lifecycle.flush_logs()
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        transition = next(x for x in lines if x["event"] == "lifecycle.transition")
        assert (transition["trial"], transition["iteration"]) == ("t-17", 4)
        (app,) = [x for x in seen if x["event"] == "lifecycle.transition"]
        assert (app["trial"], app["iteration"], app["rank"]) == ("t-17", 4, 0)

    def test_capture_logs_and_the_per_rank_file_at_once(self, tmp_path):
        """The two modes together: capture_logs sees the events with the bound trial id while the
        per-rank JSON-lines file that `lifecycle check` reads still gets every line."""
        structlog.configure(processors=[structlog.processors.JSONRenderer()])
        path = tmp_path / "rank1.jsonl"
        lifecycle.configure_logging(json_path=path)
        lc, _ = recording_lifecycle(LifecyclePolicy(), rank=1, role="actor")
        structlog.contextvars.bind_contextvars(trial="t-3")
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            lc.sleep()
            lc.wake_up()
        assert lifecycle.flush_logs()
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [x["event"] for x in logs] == ["lifecycle.transition"] * 2
        assert all(x["trial"] == "t-3" and x["rank"] == 1 for x in logs)
        assert [x["event"] for x in lines] == ["lifecycle.configured"] + ["lifecycle.transition"] * 2
        assert all(x["trial"] == "t-3" for x in lines[1:])

    def test_the_application_renderer_applies(self):
        """The application's own processors and renderer format the events."""
        out = io.StringIO()
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.KeyValueRenderer()],
            logger_factory=structlog.PrintLoggerFactory(out),
        )
        lc, _ = recording_lifecycle(LifecyclePolicy(), role="actor")
        lc.sleep()
        assert "event='lifecycle.transition'" in out.getvalue() and "level='info'" in out.getvalue()

    def test_application_false_keeps_events_out_of_the_application(self, tmp_path):
        """configure_logging(application=False): only the per-rank sink gets them."""
        structlog.configure(processors=[structlog.processors.JSONRenderer()])
        lifecycle.configure_logging(json_path=tmp_path / "r.jsonl", application=False)
        lc, _ = recording_lifecycle(LifecyclePolicy())
        with capture_logs() as logs:
            lc.sleep()
        assert logs == []
        assert lifecycle.flush_logs() and "lifecycle.transition" in (tmp_path / "r.jsonl").read_text()

    def test_application_true_without_configuration_uses_structlog_defaults(self):
        """application=True routes through structlog even when the application never configured it."""
        lifecycle.configure_logging(stream=io.StringIO(), level="warning", application=True)
        lc, _ = recording_lifecycle(LifecyclePolicy())
        with capture_logs() as logs:
            lc.sleep()
        assert [x["event"] for x in logs] == ["lifecycle.transition"]

    def test_an_unconfigured_application_gets_console_lines_not_structlog_output(self, capsys):
        """Without structlog configured and without a sink, events are console lines on stderr only."""
        ev._install(None)
        lc, _ = recording_lifecycle(LifecyclePolicy(), role="actor")
        lc.sleep()
        assert lifecycle.flush_logs()
        captured = capsys.readouterr()
        assert "lifecycle.transition" in captured.err and captured.out == ""

    def test_a_failing_application_pipeline_never_reaches_the_machine(self):
        """An application processor that raises is swallowed; the machine keeps working."""

        def explode(*_):
            raise RuntimeError("processor bug")

        structlog.configure(processors=[explode])
        lc, _ = recording_lifecycle(LifecyclePolicy())
        lc.sleep()
        lc.wake_up()
        assert lc.state is State.AWAKE


@pytest.fixture
def unconfigured(monkeypatch):
    """A process that configured no logging (the suite's own sink restored after)."""
    monkeypatch.delenv(ev.LOG_DIR_ENV, raising=False)
    ev.reset_logging()
    yield
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")


class TestRankLogs:
    def test_an_unconfigured_actor_logs_to_its_role_and_rank_file(self, unconfigured, tmp_path):
        path = lifecycle.configure_rank_log("trainer", 3, log_dir=tmp_path)
        assert path == (tmp_path / "trainer-rank3.jsonl").resolve() and ev.log_path() == path
        recording_lifecycle(LifecyclePolicy(), rank=3, role="trainer")[0].sleep()
        lifecycle.flush_logs()
        events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
        assert events[:2] == ["lifecycle.configured", "lifecycle.transition"]

    def test_the_environment_names_the_directory_and_off_writes_nothing(
        self, unconfigured, tmp_path, monkeypatch
    ):
        monkeypatch.setenv(ev.LOG_DIR_ENV, str(tmp_path / "from-env"))
        assert lifecycle.configure_rank_log("rollout", None) == (tmp_path / "from-env").resolve() / (
            f"rollout-pid{os.getpid()}.jsonl"
        )
        ev.reset_logging()
        monkeypatch.setenv(ev.LOG_DIR_ENV, "off")
        assert lifecycle.configure_rank_log("rollout", 0) is None and ev.log_path() is None

    def test_a_process_that_configured_its_logging_keeps_it(self, unconfigured, tmp_path):
        mine = tmp_path / "mine.jsonl"
        lifecycle.configure_logging(json_path=mine)
        assert lifecycle.configure_rank_log("trainer", 0, log_dir=tmp_path / "other") == mine.resolve()
        assert not (tmp_path / "other").exists()

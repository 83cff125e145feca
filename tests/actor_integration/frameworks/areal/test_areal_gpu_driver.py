"""The GPU test's driver on CPU: tests/helpers/areal_protocol.py, as tests/gpu/test_areal_rollout_gpu.py
runs it on a real SGLang server, here on AReaL's own `RemoteSGLangEngine` (imported whole from its
source, tests/helpers/areal_engine.py) against `FakeSGLangServer` (0.5.17's routes and the
sequences that kill it), in a spawned process (AReaL's import installs uvloop's event loop policy
and stand-in modules process-wide). The same calls, requests and outcomes; the timings mean nothing
here. Needs AReaL's source (RL_LIFECYCLE_AREAL_SOURCE) and what AReaL imports at load time that the
GPU machine's image has and CI does not (`LOAD_TIME`): skipped where either is missing.

The check of the AWEX plugin's loop calls (`plugin_loop_calls`) runs everywhere, on scheduler
classes shaped as SGLang 0.5.10.post1's and 0.5.17's.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.areal_engine import absent, plugin_loop_calls
from tests.helpers.areal_source import ArealSource
from tests.helpers.framework_source import suite_source
from tests.helpers.sglang_server import FakeSGLangServer

SOURCE: ArealSource | None
SOURCE, _source_mark, _readable = suite_source(ArealSource, "AReaL's")
del _readable  # autouse, it would fail the checks below that need no source: `ran` fails instead
LOAD_TIME = ("aiohttp", "uvloop", "httpx", "numba", "openai", "einops", "aiofiles", "pybase64")
MISSING = [name for name in LOAD_TIME if absent(name)]
needs_areal = [
    _source_mark,
    pytest.mark.skipif(
        bool(MISSING), reason=f"AReaL imports {MISSING} at load time (the GPU image has them)"
    ),
]


class Scheduler0510:
    """The scheduler methods the plugin's loops call, with SGLang 0.5.10.post1's signatures."""

    def recv_requests(self) -> list[Any]: ...
    def process_input_requests(self, recv_reqs: list[Any]) -> None: ...
    def get_next_batch_to_run(self) -> Any: ...
    def is_disable_overlap_for_batch(self, batch: Any) -> bool: ...
    def run_batch(self, batch: Any) -> Any: ...
    def process_batch_result(self, batch: Any, result: Any) -> None: ...
    def self_check_during_idle(self) -> None: ...
    def launch_batch_sample_if_needed(self, batch_result: Any) -> None: ...
    def resume_memory_occupation(self, recv_req: Any) -> Any: ...
    def event_loop_overlap(self) -> None: ...
    def event_loop_normal(self) -> None: ...


class Scheduler0517:
    """The same methods as SGLang 0.5.17's `Scheduler` has them (scheduler.py: the requests come
    from `self.request_receiver`, `on_idle` replaced `self_check_during_idle`)."""

    def process_input_requests(self, recv_reqs: list[Any]) -> None: ...
    def get_next_batch_to_run(self, running_batch: Any, last_batch: Any) -> Any: ...
    def is_disable_overlap_for_batch(self, batch: Any, last_batch: Any) -> bool: ...
    def run_batch(self, batch: Any) -> Any: ...
    def process_batch_result(self, batch: Any, result: Any) -> None: ...
    def on_idle(self) -> None: ...
    def launch_batch_sample_if_needed(self, batch_result: Any, cur_batch: Any) -> None: ...
    def resume_memory_occupation(self, recv_req: Any) -> Any: ...
    def event_loop_overlap(self) -> None: ...
    def event_loop_normal(self) -> None: ...


def test_the_plugins_loop_calls_fit_the_scheduler_it_was_written_for():
    assert plugin_loop_calls(Scheduler0510) == {}


def test_on_0517s_scheduler_the_missing_and_changed_calls_are_named():
    problems = plugin_loop_calls(Scheduler0517)
    assert set(problems) == {
        "recv_requests",
        "self_check_during_idle",
        "get_next_batch_to_run",
        "is_disable_overlap_for_batch",
        "launch_batch_sample_if_needed",
    }
    assert "has no recv_requests" in problems["recv_requests"]
    assert "refuses 0 argument(s)" in problems["get_next_batch_to_run"]


class DiskLabelledServer(FakeSGLangServer):
    """The fake, its disk loads labelled by the checkpoint read (the directory the versioned path
    links to), so sets A and B give other tokens."""

    def _update(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/update_weights_from_disk":
            body = {**body, "weight_version": f"disk:{os.path.realpath(str(body.get('model_path')))}"}
        return super()._update(path, body)


class FakeLoad:
    """The rollout's requests in flight, as the fake counts them (`queued`); aborted by an abort pause."""

    def __init__(self, server: FakeSGLangServer) -> None:
        self.server = server
        server.queued = {"running": 2, "waiting": 0}

    def running(self) -> bool:
        return bool(self.server.queued["running"])

    def stop(self) -> dict[str, Any]:
        self.server.queued = {"running": 0, "waiting": 0}
        return {"requests": 0, "by_finish": {}, "errors": []}


def dry_run(
    rank: int, world_size: int, store: Any, location: str, commit: str, scratch: str
) -> dict[str, Any]:
    """What test_areal_rollout_gpu.py runs, in order, on the fake."""
    from lifecycle import flush_logs
    from lifecycle.events import reset_logging
    from tests.helpers import areal_protocol as protocol
    from tests.helpers.areal_engine import import_areal, plugin_loop_error

    reset_logging()  # run_world's rank logs to a buffer: the wrapped engine's own log, as on the GPU
    areal = import_areal(ArealSource(Path(location), commit), Path(scratch))
    server = DiskLabelledServer()
    logs = Path(scratch) / "logs"
    checkpoints = {name: Path(scratch) / "checkpoints" / name for name in ("A", "B")}
    for directory in checkpoints.values():
        directory.mkdir(parents=True)
    rig = protocol.build(
        areal,
        f"{server.host}:{server.port}",
        {name: str(directory) for name, directory in checkpoints.items()},
        log_dir=str(logs),
        scratch=scratch,
    )
    out: dict[str, Any] = {"stood_in": areal.stood_in}
    try:
        out["plain"] = protocol.cycles(rig, rig.plain, 3)
        out["wrapped"] = protocol.cycles(rig, rig.wrapped, 3)
        out["tokens_differ"] = rig.tokens["A"] != rig.tokens["B"]
        out["side_by_side"] = protocol.side_by_side(rig, 3)
        out["kv"] = protocol.kv_left_released(rig)
        out["recover"] = protocol.recover_without_checkpoint(rig)
        out["ordering"] = protocol.ordering(rig)
        out["continue_plain"] = protocol.missing_continue(rig, wrapped=False)
        out["continue_wrapped"] = protocol.missing_continue(rig, wrapped=True)
        out["drained"] = protocol.drain_before_release(rig, lambda _rig: FakeLoad(server))
        out["in_place"] = protocol.in_place_only(rig, lambda _rig: FakeLoad(server), deadline_s=0.3)
        out["deaths"], out["alive"] = list(server.deaths), server.alive
        plugin = importlib.import_module("areal.engine.awex.sglang_plugin")
        out["plugin_error_0517"] = plugin_loop_error(plugin, Scheduler0517)
    finally:
        rig.close()
        server.close()
    flush_logs()
    check = subprocess.run(
        [sys.executable, "-m", "actor_integration.tools.cli", "check", str(logs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out["check"] = {"rc": check.returncode, "out": check.stdout[-2000:] + check.stderr[-2000:]}
    return out


@pytest.fixture(scope="module")
def ran() -> dict[str, Any]:
    from tests.helpers.spawn import no_crash, run_world

    if SOURCE is None:
        pytest.fail(f"{ArealSource.SOURCE_ENV} is set but AReaL's source cannot be read")
    with tempfile.TemporaryDirectory(prefix="areal-dry-run-") as scratch:
        results = run_world(dry_run, 1, str(SOURCE.location), SOURCE.commit, scratch, deadline_s=600)
    no_crash(results)
    return results[0]


class TestTheDriverOnTheFake:
    pytestmark = needs_areal

    def test_both_engines_switch_and_serve_each_set(self, ran):
        for way in ("plain", "wrapped"):
            assert ran[way]["wrong"] == [] and ran[way]["cycles"] == 3, ran[way]
        assert ran["tokens_differ"]
        assert ran["plain"]["wrap_sent_first_cycle"] == []
        sent = ran["wrapped"]["wrap_sent_first_cycle"]
        assert sent[:3] == ["pause abort", "pause in_place", "flush"], sent
        assert sent.index("release kv_cache") < sent.index("release weights") < sent.index("resume weights")
        assert sent[-2:] == ["resume kv_cache", "continue"], sent

    def test_the_alternated_side_by_side_serves_each_set_on_both_sides_in_turn(self, ran):
        figures = ran["side_by_side"]
        assert figures["wrong"] == [], figures["wrong"]
        assert figures["order"] == ["own", "wrapped", "wrapped", "own", "own", "wrapped"], figures["order"]
        assert (
            set(figures["own"]) == set(figures["wrapped"]) >= {"switch_ms", "to_trainer_ms", "to_rollout_ms"}
        )
        assert figures["wrapped_minus_own_switch_ms"] == round(
            figures["wrapped"]["switch_ms"] - figures["own"]["switch_ms"], 3
        )

    def test_the_field_failures_are_absorbed_or_refused_and_the_server_lives(self, ran):
        kv, recover, ordering = ran["kv"], ran["recover"], ran["ordering"]
        assert not kv["continue_sent_while_released"] and kv["request_held"] and kv["same_tokens"], kv
        assert recover["refused"] == "InvalidWeightsError" and recover["same_tokens"], recover
        assert ordering["refusal_names_the_call"] and ordering["sent_by_refusal"] == [], ordering
        assert ordering["sent"].count("release weights") == 1 and ordering["same_tokens"], ordering
        plain, wrapped = ran["continue_plain"], ran["continue_wrapped"]
        assert plain["request_held"] and plain["same_tokens"], plain
        assert not wrapped["request_held"] and wrapped["same_tokens"], wrapped
        assert ran["drained"]["running_at_pause"] and ran["drained"]["same_tokens"], ran["drained"]
        ablation = ran["in_place"]
        assert ablation["refused"] == "EngineNotIdleError" and ablation["state"] == "FAILED", ablation
        assert set(ablation["residency"].values()) == {"resident"} and ablation["same_tokens"], ablation
        assert ran["deaths"] == [] and ran["alive"]

    def test_the_wrapped_engines_log_is_clean(self, ran):
        assert ran["check"]["rc"] == 0 and "clean" in ran["check"]["out"], ran["check"]

    def test_areals_plugin_loop_stops_at_once_on_0517s_scheduler(self, ran):
        assert (
            ran["plugin_error_0517"].startswith("AttributeError")
            and "recv_requests" in ran["plugin_error_0517"]
        )

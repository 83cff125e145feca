"""The engine's own times beside a side-by-side (`tests/helpers/engine_log.py`): vLLM's lines read as
vLLM 0.26.0 writes them, paired with the calls in their order, and the logging configuration that
sends an offline engine's lines to a file, against the wheel's own logger and executor source."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import engine_log
from tests.helpers.vllm_source import EXECUTOR

# Lines as an H100 run's server log holds them (2026-12-07).
LINES = (
    "(EngineCore pid=1594) INFO 12-07 13:11:37 [abstract.py:327] It took 0.015144 seconds to fall asleep.\n"
    '(APIServer pid=1530) INFO:     127.0.0.1:47444 - "POST /sleep?level=2&mode=abort HTTP/1.1" 200 OK\n'
    "(EngineCore pid=1594) INFO 12-07 13:11:37 [abstract.py:345] It took 0.001226 seconds to wake up "
    "tags ['weights'].\n"
    "(EngineCore pid=1594) INFO 12-07 13:11:37 [abstract.py:345] It took 0.071909 seconds to wake up "
    "tags ['kv_cache'].\n"
)


def test_the_lines_are_read_as_vllm_writes_them() -> None:
    assert engine_log.engine_reported(LINES) == [
        ("sleep", pytest.approx(15.144)),
        ("wake ['weights']", pytest.approx(1.226)),
        ("wake ['kv_cache']", pytest.approx(71.909)),
    ]
    whole = "INFO It took 0.020000 seconds to wake up tags {'weights', 'kv_cache'}.\n"
    assert engine_log.engine_reported(whole) == [("wake {'weights', 'kv_cache'}", pytest.approx(20.0))]


def _cycle(sleep: float, weights: float, kv: float) -> dict[str, float]:
    return {"sleep_ms": sleep, "wake_weights_ms": weights, "wake_kv_ms": kv}


def test_each_call_is_paired_with_its_line_in_the_cycles_order() -> None:
    """Two cycles a side, the second of each counted: the wrapped side's raw cycle is 31 ms slower
    (its KV wake drew a slow one in the engine) but only 2 ms of it is beyond the engine's time."""
    figures: dict[str, Any] = {
        "order": ["own", "wrapped", "wrapped", "own"],
        "rows": {
            "own": [_cycle(99, 99, 99), _cycle(50, 3, 23)],
            "wrapped": [_cycle(99, 99, 99), _cycle(50.5, 3.2, 53.3)],
        },
    }
    engine = [(90, 90, 90), (90, 90, 90), (20, 1, 50), (20, 1, 21)]  # own, wrapped, wrapped, own
    lines = [(kind, ms) for cycle in engine for kind, ms in zip(engine_log.KINDS, cycle, strict=True)]
    engine_log.with_engine_times(figures, lines)
    assert figures["engine_log"] == "12 sleep/wake lines, one per call"
    assert figures["engine_ms"] == {
        "own": {"sleep_ms": 20, "wake_weights_ms": 1, "wake_kv_ms": 21},
        "wrapped": {"sleep_ms": 20, "wake_weights_ms": 1, "wake_kv_ms": 50},
    }
    assert figures["net_ms"]["own"] == {
        "sleep_ms": 30,
        "wake_weights_ms": 2,
        "wake_kv_ms": 2,
        "sleep_wake_ms": 34,
    }
    assert figures["net_ms"]["wrapped"]["sleep_wake_ms"] == pytest.approx(36.0)
    assert figures["wrapped_minus_own_net_ms"] == pytest.approx(2.0)


def test_a_missing_or_foreign_line_leaves_no_engine_figures(tmp_path: Path) -> None:
    figures: dict[str, Any] = {"order": ["own", "wrapped"], "rows": {"own": [{}], "wrapped": [{}]}}
    (tmp_path / "serve.log").write_text(LINES)
    engine_log.with_engine_times(figures, engine_log.read_engine_lines(tmp_path / "serve.log", 0, 6, 0.2))
    assert figures["engine_log"] == "3 sleep/wake line(s) in the engine's log, 6 calls made"
    assert "net_ms" not in figures
    shuffled = engine_log.engine_reported(LINES)[::-1] * 2  # as many lines, another order
    engine_log.with_engine_times(figures, shuffled)
    assert figures["engine_log"] == "6 sleep/wake line(s) in the engine's log, 6 calls made"


def test_the_configuration_sends_the_executors_lines_to_the_file_and_keeps_the_stream(tmp_path: Path) -> None:
    """In a child interpreter (logging is process-wide), the configuration with vLLM's formatter
    class swapped for logging's own (vllm is not installed here): the executor's line reaches the
    file and the stream, another vLLM logger's only the stream."""
    config = engine_log.vllm_logging_config(tmp_path / "engine.log")
    config["formatters"]["vllm"] = {
        "format": config["formatters"]["vllm"]["format"].replace("%(fileinfo)s", "x")
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    child = (
        "import json, logging, logging.config, sys\n"
        f"logging.config.dictConfig(json.load(open({str(tmp_path / 'config.json')!r})))\n"
        f"logging.getLogger({engine_log.EXECUTOR_LOGGER!r}).info('It took %.6f seconds to fall asleep.', 0.0123)\n"
        "logging.getLogger('vllm.v1.engine.core').info('Successfully reset prefix cache')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
    )
    assert "It took 0.012300 seconds to fall asleep." in out.stdout
    assert "Successfully reset prefix cache" in out.stdout
    assert (tmp_path / "engine.log").read_text() == "It took 0.012300 seconds to fall asleep.\n"


def test_log_engine_times_to_points_vllm_at_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    assert engine_log.log_engine_times_to(tmp_path / "out" / "engine.log") == tmp_path / "out" / "engine.log"
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "1"
    assert config["handlers"]["engine_times"]["filename"] == str(tmp_path / "out" / "engine.log")
    assert engine_log.log_size(tmp_path / "out" / "engine.log") == 0


def test_the_configuration_is_vllms_default_and_the_lines_are_the_executors(vllm_tree: Any) -> None:
    """Against the wheel: the configuration keeps vLLM's default logging (the one its
    VLLM_LOGGING_CONFIG_PATH replaces: formatter, handler, logger), the environment variables it
    reads are vLLM's, and the executor (its module's logger) logs the two lines read here."""
    logger_module = vllm_tree.module("vllm.logger")
    defaults = {
        ast.unparse(target): node.value
        for node in logger_module.body
        if isinstance(node, ast.Assign)
        for target in node.targets
    }
    default = next(
        node.value
        for node in logger_module.body
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "DEFAULT_LOGGING_CONFIG"
    )
    source = ast.unparse(default) if default is not None else ""
    ours = engine_log.vllm_logging_config(Path("x.log"))
    assert "'class': 'vllm.logging_utils.NewLineFormatter'" in source
    assert ours["formatters"]["vllm"]["class"] == "vllm.logging_utils.NewLineFormatter"
    assert "'class': 'logging.StreamHandler'" in source and "'propagate': False" in source
    assert (
        ours["loggers"]["vllm"]["propagate"] is False
        and ours["handlers"]["vllm"]["class"] == "logging.StreamHandler"
    )
    assert ast.unparse(defaults["_DATE_FORMAT"]) == repr(ours["formatters"]["vllm"]["datefmt"])
    fmt = ast.unparse(defaults["_FORMAT"])
    assert "%(levelname)s %(asctime)s " in fmt and "[%(fileinfo)s:%(lineno)d] %(message)s" in fmt
    assert "VLLM_LOGGING_PREFIX" in fmt
    envs = vllm_tree.source("vllm.envs")
    for name in (
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOGGING_STREAM",
        "VLLM_LOGGING_LEVEL",
    ):
        assert f'"{name}"' in envs, name
    executor_module = EXECUTOR.rsplit(".", 1)[0]
    assert executor_module == engine_log.EXECUTOR_LOGGER
    executor = vllm_tree.source(executor_module)
    assert "logger = init_logger(__name__)" in executor
    assert '"It took %.6f seconds to fall asleep."' in executor
    assert '"It took %.6f seconds to wake up tags %s."' in executor


def test_the_offline_side_by_side_pairs_its_calls_with_the_executors_lines(
    make_engine: Any, tmp_path: Path
) -> None:
    """The GPU test's offline side-by-side (`vllm_gpu.own_and_wrapped_runs`) on the fake `LLM`, whose
    executor logs its lines as vLLM's does, to the file the logging configuration would name: both
    runs (the release audit on, then off) pair every call with its line, and the audit's reader is
    the actor's own again after."""
    from actor_integration.engines.vllm import VLLMRolloutActor
    from tests.helpers.vllm_fake import EXECUTOR_LOG
    from tests.helpers.vllm_gpu import own_and_wrapped_runs

    actor = VLLMRolloutActor(make_engine(sleep_level=2), log_dir=str(tmp_path / "logs"))
    llm = actor.engine.llm
    own = {
        "sleep": lambda: llm.sleep(level=2),
        "wake_weights": lambda: llm.wake_up(["weights"]),
        "wake_kv": lambda: llm.wake_up(["kv_cache"]),
    }
    reader = actor.memory_audit.free_bytes
    to_file = logging.FileHandler(tmp_path / "engine.log")
    to_file.setFormatter(logging.Formatter("%(message)s"))
    level = EXECUTOR_LOG.level
    EXECUTOR_LOG.addHandler(to_file)
    EXECUTOR_LOG.setLevel(logging.INFO)
    actor_sleeps: list[int] = []
    actor_sleep = actor.sleep
    actor.sleep = lambda: actor_sleeps.append(1) or actor_sleep()  # type: ignore[method-assign]
    try:
        figures = own_and_wrapped_runs(own, actor, tmp_path / "engine.log", cycles=3)
    finally:
        EXECUTOR_LOG.removeHandler(to_file)
        EXECUTOR_LOG.setLevel(level)
        to_file.close()
    for run in (figures, figures["audit_off"], figures["own_vs_own"]):
        assert run["engine_log"] == "18 sleep/wake lines, one per call", run["engine_log"]
        assert set(run["net_ms"]) == {"own", "wrapped"} and "outside_engine_ms" not in run
        assert isinstance(run["wrapped_minus_own_net_ms"], float)
    assert actor_sleeps == [1] * 6  # 3 cycles with the audit on, 3 off; the control not through the actor
    assert actor.memory_audit.free_bytes == reader
    assert actor.lifecycle_state()["state"] == "AWAKE"

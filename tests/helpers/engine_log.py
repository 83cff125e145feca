"""The engine's own time for each sleep and wake, read from vLLM's log, beside a side-by-side (tests only).

vLLM 0.26.0's executor logs the time its workers took for every sleep and wake
(`vllm/v1/executor/abstract.py`: `It took 0.014633 seconds to fall asleep.`, `It took 0.071909
seconds to wake up tags ['kv_cache'].`). Both sides of a side-by-side send the engine the same
calls, so that time is the engine's, not ours; it varies a lot from call to call (the KV cache's
wake is bimodal on an H100: 11-25 ms or 37-84 ms), and a side that draws more slow ones loses the
raw comparison whatever the wrapper costs. `with_engine_times` pairs each call of a side-by-side
(`side_by_side.alternate`'s figures) with its line and adds, per side, the engine's medians and
the medians of what each call took beyond the engine's own time (`net_ms`), and their difference.

Where the lines are: `vllm serve`'s log (the server's file), or, for an `LLM` in the test process,
the file `log_engine_times_to` routes the executor's logger to (through `VLLM_LOGGING_CONFIG_PATH`,
read by every vLLM process at import: set it before vllm is imported). Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = [
    "EXECUTOR_LOGGER",
    "PHASES",
    "engine_reported",
    "log_engine_times_to",
    "read_engine_lines",
    "vllm_logging_config",
    "with_engine_times",
]

ENGINE_TOOK = re.compile(
    r"It took ([0-9.]+) seconds (to fall asleep|to wake up tags (?:\[[^\]]*\]|\{[^}]*\}|None))"
)
EXECUTOR_LOGGER = "vllm.v1.executor.abstract"  # the logger of the lines above (vLLM 0.26.0)
PHASES = ("sleep_ms", "wake_weights_ms", "wake_kv_ms")  # a side-by-side cycle's calls, in order
KINDS = ("sleep", "wake ['weights']", "wake ['kv_cache']")  # the line each of them logs


def engine_reported(log_text: str) -> list[tuple[str, float]]:
    """Each sleep and wake an engine's executor logged, in order: ("sleep" or "wake <tags>", ms)."""
    out = []
    for seconds, what in ENGINE_TOOK.findall(log_text):
        kind = "sleep" if what == "to fall asleep" else "wake " + what.removeprefix("to wake up tags ")
        out.append((kind, float(seconds) * 1e3))
    return out


def read_engine_lines(
    log_path: Path, log_from: int, wanted: int, deadline_s: float = 5.0
) -> list[tuple[str, float]]:
    """`engine_reported` of `log_path` from byte `log_from`, waiting up to `deadline_s` for `wanted`
    lines (the log is written by the engine's own processes, a little after each call returns)."""
    deadline = time.monotonic() + deadline_s
    while True:
        with open(log_path, "rb") as log:
            log.seek(log_from)
            lines = engine_reported(log.read().decode(errors="replace"))
        if len(lines) >= wanted or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def log_size(log_path: Path) -> int:
    """Where the next side-by-side's lines will start (0 before the file exists)."""
    return log_path.stat().st_size if log_path.exists() else 0


def with_engine_times(figures: dict[str, Any], lines: list[tuple[str, float]]) -> None:
    """Add to a side-by-side's `figures` (each cycle's `PHASES` in `rows`, the cycles' `order`) the
    engine's own time of each of its calls (`lines`, one per call, in order): per side the medians of
    the engine's time (`engine_ms`) and of each phase's time beyond it (`net_ms`: the caller, and
    over HTTP the client and the API server), after each side's first cycle, and
    `wrapped_minus_own_net_ms`. Where `lines` are not one per call, only `engine_log` saying so."""
    wanted = len(figures["order"]) * len(PHASES)
    if [kind for kind, _ms in lines] != list(KINDS) * len(figures["order"]):
        figures["engine_log"] = f"{len(lines)} sleep/wake line(s) in the engine's log, {wanted} calls made"
        return
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in figures["rows"]}
    taken = {side: iter(figures["rows"][side]) for side in figures["rows"]}
    engine_ms = iter(ms for _kind, ms in lines)
    for side in figures["order"]:
        client = next(taken[side])
        row = {phase: next(engine_ms) for phase in PHASES}
        row.update({f"net_{phase}": client[phase] - row[phase] for phase in PHASES})
        row["net_sleep_wake_ms"] = sum(row[f"net_{phase}"] for phase in PHASES)
        rows[side].append(row)
    figures["engine_ms"], figures["net_ms"] = {}, {}
    for side, kept in rows.items():  # the first cycle of each side is not counted (alternate's rule)
        figures["engine_ms"][side] = {
            phase: round(statistics.median(r[phase] for r in kept[1:]), 3) for phase in PHASES
        }
        figures["net_ms"][side] = {
            key: round(statistics.median(r[f"net_{key}"] for r in kept[1:]), 3)
            for key in (*PHASES, "sleep_wake_ms")
        }
    figures["wrapped_minus_own_net_ms"] = round(
        figures["net_ms"]["wrapped"]["sleep_wake_ms"] - figures["net_ms"]["own"]["sleep_wake_ms"], 3
    )
    figures["engine_log"] = f"{len(lines)} sleep/wake lines, one per call"


def vllm_logging_config(log_path: Path) -> dict[str, Any]:
    """vLLM 0.26.0's default logging (`vllm.logger.DEFAULT_LOGGING_CONFIG`: the `vllm` logger to
    `VLLM_LOGGING_STREAM` at `VLLM_LOGGING_LEVEL`, its format), plus the executor's logger also to
    `log_path`, its message alone."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    prefix = os.environ.get("VLLM_LOGGING_PREFIX", "")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "class": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": f"{prefix}%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s",
            },
            "message": {"format": "%(message)s"},
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "stream": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout"),
            },
            "engine_times": {
                "class": "logging.FileHandler",
                "formatter": "message",
                "level": "INFO",
                "filename": str(log_path),
                "mode": "a",
            },
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": level, "propagate": False},
            EXECUTOR_LOGGER: {"handlers": ["engine_times"], "level": "INFO", "propagate": True},
        },
    }


def log_engine_times_to(log_path: Path) -> Path:
    """Route the executor's sleep and wake lines of every vLLM process started from here on (this
    one too, if vllm is imported after) to `log_path` as well; returns `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    config = log_path.with_suffix(".logging.json")
    config.write_text(json.dumps(vllm_logging_config(log_path), indent=1))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    return log_path

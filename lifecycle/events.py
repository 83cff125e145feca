"""Structured lifecycle events through structlog: JSON lines per rank, or readable console lines.

Events: `lifecycle.configured`, `lifecycle.transition`, `lifecycle.body`, `lifecycle.noop`,
`lifecycle.refused`, `lifecycle.failed`. The rule (from torchtitan's per-rank logger) is that
logging never blocks or crashes the machine: rendering happens in the caller, writing happens on a
background thread, a full queue drops lines (and counts them), and any logging error is swallowed.

The lifecycle logger is independent of the application's own structlog configuration.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class AsyncLineWriter:
    """Writes lines from a background thread; `write` never blocks and never raises.

    The hot path is a length check and a deque append (no locks, no events): the writer thread
    wakes every 20 ms, or at once on `flush()`, and writes what is pending as one batch.
    """

    def __init__(self, stream: IO[str], *, owns_stream: bool, max_pending: int = 100_000) -> None:
        self._stream = stream
        self._owns_stream = owns_stream
        self._pending: collections.deque[str] = collections.deque()
        self._max_pending = max_pending
        self._wakeup = threading.Event()
        self._busy = False
        self._closed = False
        self.dropped = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="lifecycle-log-writer", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        if self._closed or len(self._pending) >= self._max_pending:
            self.dropped += 1
            return
        self._pending.append(line)

    # structlog calls the wrapped logger's method named after the level.
    msg = debug = info = warning = warn = error = critical = exception = write

    def _run(self) -> None:
        while True:
            self._wakeup.wait(0.02)
            self._wakeup.clear()
            self._busy = True
            batch = []
            while self._pending:
                batch.append(self._pending.popleft())
            if batch:
                try:
                    self._stream.write("\n".join(batch) + "\n")
                    self._stream.flush()
                except Exception:
                    self.errors += 1
            self._busy = False
            if self._closed and not self._pending:
                return

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every line written so far reached the stream; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending or self._busy:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
            self._wakeup.set()
            time.sleep(0.0005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        self._closed = True
        self._wakeup.set()
        self._thread.join(timeout)
        if self._owns_stream:
            with contextlib.suppress(Exception):
                self._stream.close()


class _Capture:
    """structlog processor that keeps event dicts for tests instead of rendering them."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> Any:
        self.entries.append(event_dict)
        raise structlog.DropEvent


class _Sink:
    """The current destination: a structlog logger plus what it writes to."""

    def __init__(self, logger: Any, level: int, writer: AsyncLineWriter | None) -> None:
        self.logger = logger
        self.level = level
        self.writer = writer


def _make_sink(level: str, renderer: Any, writer: AsyncLineWriter | None, capture: _Capture | None) -> _Sink:
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(LEVELS)}")
    processors: list[Any] = [structlog.processors.add_log_level]
    if capture is not None:
        processors.append(capture)
    else:
        processors += [structlog.processors.TimeStamper(fmt="iso", utc=True), renderer]
    logger = structlog.wrap_logger(
        writer if writer is not None else structlog.ReturnLogger(),
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=True,
    )
    return _Sink(logger, LEVELS[level], writer)


_lock = threading.Lock()
_sink: _Sink | None = None


def configure_logging(
    *,
    json_path: str | Path | None = None,
    stream: IO[str] | None = None,
    level: str = "info",
    fmt: str | None = None,
) -> None:
    """Send lifecycle events to a JSON-lines file, or to a stream (console format unless fmt="json").

    Calling it again replaces the destination (the previous file is flushed and closed).
    """
    if json_path is not None and stream is not None:
        raise ValueError("configure_logging: give json_path or stream, not both")
    if fmt not in (None, "json", "console"):
        raise ValueError(f"configure_logging: fmt must be 'json' or 'console', got {fmt!r}")
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = AsyncLineWriter(path.open("a", encoding="utf-8", buffering=1), owns_stream=True)
        renderer: Any = structlog.processors.JSONRenderer(default=str)
    else:
        writer = AsyncLineWriter(stream if stream is not None else sys.stderr, owns_stream=False)
        renderer = (
            structlog.processors.JSONRenderer(default=str)
            if fmt == "json"
            else structlog.dev.ConsoleRenderer(colors=False)
        )
    _install(_make_sink(level, renderer, writer, None))


def _install(sink: _Sink | None, *, close_previous: bool = True) -> _Sink | None:
    global _sink
    with _lock:
        previous, _sink = _sink, sink
    if close_previous and previous is not None and previous.writer is not None:
        previous.writer.close()
    return previous


def _current() -> _Sink:
    global _sink
    sink = _sink
    if sink is None:
        with _lock:
            if _sink is None:
                writer = AsyncLineWriter(sys.stderr, owns_stream=False)
                _sink = _make_sink("info", structlog.dev.ConsoleRenderer(colors=False), writer, None)
            sink = _sink
    return sink


def enabled(level: int) -> bool:
    return level >= _current().level


def emit(level: str, event: str, fields: dict[str, Any]) -> None:
    """Log one event; never raises."""
    try:
        getattr(_current().logger, level)(event, **fields)
    except Exception:
        sink = _sink
        if sink is not None and sink.writer is not None:
            sink.writer.errors += 1


def flush_logs(timeout: float = 5.0) -> bool:
    """Block until the lifecycle events emitted so far are written (call before reading the file)."""
    sink = _sink
    if sink is None or sink.writer is None:
        return True
    return sink.writer.flush(timeout)


def dropped_events() -> int:
    sink = _sink
    return sink.writer.dropped if sink is not None and sink.writer is not None else 0


@contextlib.contextmanager
def capture_events(level: str = "debug") -> Iterator[list[dict[str, Any]]]:
    """Collect lifecycle events as dicts (with `event` and `level` keys) for the block's duration."""
    capture = _Capture()
    previous = _install(_make_sink(level, None, None, capture), close_previous=False)
    try:
        yield capture.entries
    finally:
        _install(previous, close_previous=False)


atexit.register(flush_logs)

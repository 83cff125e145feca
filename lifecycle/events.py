"""Structured lifecycle events through structlog: the application's pipeline, and a per-rank sink.

Two destinations, either or both:

- **The application's structlog.** When the application configured structlog (`structlog.configure`),
  every event goes through `structlog.get_logger("lifecycle")`: its processors, renderers and
  context variables apply (`bind_contextvars(trial=..., iteration=...)`), and
  `structlog.testing.capture_logs()` sees the events. `configure_logging(application=...)` forces it
  on or off.
- **The per-rank sink** of `configure_logging(json_path=...)` (or `stream=...`): JSON lines that
  `lifecycle check` and `lifecycle timeline` read, with the context variables merged in. Its rule
  (torchtitan's per-rank logger) is that logging never blocks or crashes the machine: rendering
  happens in the caller, writing on a background thread; a full queue drops lines and counts them;
  every logging error is swallowed. Without either, events are console lines on stderr.

Event names are `lifecycle.logs.Event`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_LOGGER_NAME = "lifecycle"


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
    """The library's own destination: a structlog logger plus what it writes to."""

    def __init__(self, logger: Any, level: int, writer: AsyncLineWriter | None, *, fallback: bool) -> None:
        self.logger = logger
        self.level = level
        self.writer = writer
        self.fallback = fallback  # the stderr console of an unconfigured process: yields to the app


def _make_sink(
    level: str, renderer: Any, writer: AsyncLineWriter | None, capture: _Capture | None, *, fallback: bool
) -> _Sink:
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(LEVELS)}")
    processors: list[Any] = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level]
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
    return _Sink(logger, LEVELS[level], writer, fallback=fallback)


_lock = threading.Lock()
_sink: _Sink | None = None
_json_path: Path | None = None  # the file configure_logging writes to, if any
_application: bool | None = None  # None: follow structlog.is_configured()
_app_logger: Any = structlog.get_logger(_LOGGER_NAME)


def configure_logging(
    *,
    json_path: str | Path | None = None,
    stream: IO[str] | None = None,
    level: str = "info",
    fmt: str | None = None,
    application: bool | None = None,
) -> None:
    """Send lifecycle events to a JSON-lines file, or to a stream (console format unless fmt="json").

    `application`: also send them through the application's structlog configuration (True), never
    (False), or when the application has configured structlog (None, the default). Calling it again
    replaces the destination (the previous file is flushed and closed).
    """
    if json_path is not None and stream is not None:
        raise ValueError("configure_logging: give json_path or stream, not both")
    if fmt not in (None, "json", "console"):
        raise ValueError(f"configure_logging: fmt must be 'json' or 'console', got {fmt!r}")
    if application not in (None, True, False):
        raise ValueError(f"configure_logging: application must be True, False or None, got {application!r}")
    if level not in LEVELS:
        raise ValueError(f"configure_logging: unknown log level {level!r}; use one of {sorted(LEVELS)}")
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
    global _application, _json_path
    _application = application
    _json_path = Path(json_path).resolve() if json_path is not None else None
    _install(_make_sink(level, renderer, writer, None, fallback=False))


LOG_DIR_ENV = "RL_LIFECYCLE_LOG_DIR"  # where actors write their per-rank logs; "off" for none
DEFAULT_LOG_DIR = "lifecycle-logs"
_OFF = ("off", "none", "0", "false")


def log_path() -> Path | None:
    """The JSON-lines file this process's lifecycle events go to, if `configure_logging` set one."""
    return _json_path


def configure_rank_log(role: str, rank: int | None, *, log_dir: str | Path | None = None) -> Path | None:
    """Write this process's lifecycle events to `<dir>/<role>-rank<rank>.jsonl`, the files
    `lifecycle check` and `lifecycle timeline` read, unless this process configured its logging
    already (that configuration wins; its file, if any, is returned).

    The directory is `log_dir`, else `$RL_LIFECYCLE_LOG_DIR` (set it in Ray's
    `runtime_env={"env_vars": ...}` so that every worker sees it), else `./lifecycle-logs`; "off"
    writes nothing. The file is appended to, so an actor restarted in place continues its log."""
    if _sink is not None and not _sink.fallback:
        return _json_path
    where = (
        str(log_dir) if log_dir is not None else os.environ.get(LOG_DIR_ENV, "").strip() or DEFAULT_LOG_DIR
    )
    if where.lower() in _OFF:
        return None
    name = f"{role}-rank{rank}.jsonl" if rank is not None else f"{role}-pid{os.getpid()}.jsonl"
    path = Path(where).expanduser().resolve() / name
    configure_logging(json_path=path)
    return path


def reset_logging() -> None:
    """Back to an unconfigured process: events go to stderr (or the application's structlog)
    until something configures logging, as in a fresh process (tests, forked workers)."""
    global _json_path, _application
    _json_path, _application = None, None
    _install(None)


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
                _sink = _make_sink(
                    "info", structlog.dev.ConsoleRenderer(colors=False), writer, None, fallback=True
                )
            sink = _sink
    return sink


def _to_application() -> bool:
    return structlog.is_configured() if _application is None else _application


def enabled(level: int) -> bool:
    """Whether an event at `level` goes anywhere (callers skip building its fields otherwise)."""
    return level >= _current().level or _to_application()


def emit(level: str, event: str, fields: dict[str, Any]) -> None:
    """Log one event; never raises."""
    name = str(event)
    sink = _current()
    to_app = _to_application()
    try:
        if not (to_app and sink.fallback):  # the stderr fallback yields to a configured application
            getattr(sink.logger, level)(name, **fields)
    except Exception:
        if sink.writer is not None:
            sink.writer.errors += 1
    if to_app:
        try:
            getattr(_app_logger, level)(name, **fields)
        except Exception:
            if sink.writer is not None:
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
    """Collect lifecycle events as dicts (with `event` and `level` keys) for the block's duration.

    Only the library's sink is replaced; with an application configured, events still reach it too.
    """
    capture = _Capture()
    previous = _install(_make_sink(level, None, None, capture, fallback=False), close_previous=False)
    try:
        yield capture.entries
    finally:
        _install(previous, close_previous=False)


atexit.register(flush_logs)

"""Kept-alive HTTP/1.1 connections to one server, for the lifecycle's own requests (standard library).

A sleep or a wake of a framework's engine actor sends several requests to the same SGLang server
and router within milliseconds. urllib opens a new connection for every one of them and closes it
after (it sends `Connection: close`): measured on localhost against uvicorn (SGLang's HTTP
server), 0.48 to 0.51 ms per request that way, 0.30 to 0.33 ms on a kept-alive connection.

`Connections` keeps the connections of finished requests and hands one to the next request, under
two rules that keep a reused connection from ever being one the server already closed:

- a connection is reused only within `idle_s` of its last answer (2 s by default; SGLang's
  uvicorn closes an idle one after 5 s, `SGLANG_TIMEOUT_KEEP_ALIVE`), and only if the server has
  not closed it meanwhile (its socket has nothing to read: a closed one reads end-of-file);
- a request is never sent twice: a connection that fails mid-request is closed and the error goes
  to the caller as it is, so a release or a resume cannot reach the server twice.

After sending a request the connection asks for quick acknowledgements (Linux's TCP_QUICKACK):
without it, a kept-alive connection meets delayed acknowledgements that a server writing its
answers in two pieces turns into a 40 ms wait per request (`_ack_at_once`).

Requests from several threads at once each get a connection of their own. Errors are the standard
library's: `TimeoutError`, `ConnectionRefusedError` and other `OSError`s (no connection),
`http.client.HTTPException`, `ConnectionResetError` and `BrokenPipeError` (the server closed the
connection without an answer); callers type them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["KEEP_ALIVE_S", "Connections", "answer_text", "decode_answer"]

KEEP_ALIVE_S = 2.0  # reuse a connection only this long after its last answer
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class Connections:
    """HTTP/1.1 requests to the origin of `url` (its path is the prefix of every request's)."""

    def __init__(self, url: str, *, idle_s: float = KEEP_ALIVE_S) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"Connections: url must be http(s)://host[:port][/prefix], got {url!r}")
        if idle_s < 0:
            raise ValueError(f"Connections: idle_s must be >= 0, got {idle_s!r}")
        self.scheme = parsed.scheme
        self.host = parsed.hostname
        self.port = parsed.port
        self.prefix = parsed.path.rstrip("/")
        self.idle_s = idle_s
        self._idle: list[tuple[float, http.client.HTTPConnection]] = []  # (answered at, connection)
        self._lock = threading.Lock()
        self.opened = 0  # connections opened so far (tests and logs read it)

    def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout: float
    ) -> tuple[int, bytes]:
        """(status, body) of one request; any status is returned, errors are raised as they come."""
        connection = self._take(timeout)
        try:
            connection.request(method, self.prefix + path, body=body, headers=dict(headers))
            _ack_at_once(connection)
            response = connection.getresponse()
            data = response.read()
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            with self._lock:
                self._idle.append((time.monotonic(), connection))
        return response.status, data

    def close(self) -> None:
        """Close every idle connection (one in use is closed when its request ends and it is reused no more)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _answered, connection in idle:
            connection.close()

    def _take(self, timeout: float) -> http.client.HTTPConnection:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    break
                answered, connection = self._idle.pop()  # the most recently answered first
            if now - answered <= self.idle_s and not _closed_by_peer(connection):
                connection.timeout = timeout
                if connection.sock is not None:
                    connection.sock.settimeout(timeout)
                return connection
            connection.close()
        with self._lock:
            self.opened += 1
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)


def _ack_at_once(connection: http.client.HTTPConnection) -> None:
    """Ask the kernel to acknowledge the answer's segments at once (Linux's TCP_QUICKACK; it lapses
    by itself, so it is set again for every request).

    On a kept-alive connection that sends its next request right after an answer, Linux delays its
    acknowledgements (up to 40 ms). A server that writes an answer's headers and body apart without
    TCP_NODELAY (Python's `http.server`, for one) holds the body until the headers are acknowledged:
    measured on localhost, every request took 44 ms that way, 0.13 ms with this. A fresh connection
    per request (urllib's) never meets it: a new connection acknowledges at once."""
    sock = connection.sock
    if sock is not None and _QUICKACK is not None:
        with contextlib.suppress(OSError):  # not a TCP socket (a test's stand-in): nothing to hurry
            sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)


def _closed_by_peer(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle connection's socket is gone or has something to read (end-of-file: the
    server closed it; anything else is unexpected on an idle HTTP/1.1 connection)."""
    sock = connection.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def decode_answer(raw: bytes) -> Any:
    """An engine server's answer body: its JSON, or its text where it is not JSON (None when empty)."""
    text = raw.decode(errors="replace")
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return text.strip()


def answer_text(answer: Any, keys: tuple[str, ...] = ("detail", "message")) -> str:
    """The error text of a decoded answer: {"error": {"message": ...}}, else the first of `keys`
    present (FastAPI's {"detail": ...}, ...), else the answer as text."""
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in keys:
            if key in answer:
                return str(answer[key])
    return str(answer)

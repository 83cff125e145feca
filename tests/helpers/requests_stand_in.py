"""The part of `requests` (and `urllib3.exceptions`) slime's and miles' engine actors use, over real
HTTP with the standard library (tests only: the project's environment has no `requests`).

What the frameworks rely on is kept as `requests` does it: `get/post/delete(url, json=, params=,
timeout=)` return a `Response` for every status (`raise_for_status()` raises `HTTPError` with the
response attached); a refused or dropped connection is `ConnectionError` (never urllib3's
`NewConnectionError` itself: requests wraps it, so slime's `except NewConnectionError` in
`flush_cache` never fires); a timeout is `ReadTimeout` / `ConnectTimeout`; no timeout blocks.
"""

from __future__ import annotations

import http.client
import json as json_module
import socket
import types
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tests.helpers.framework_source import stand_in_module


class RequestException(OSError):
    def __init__(self, *args: Any, response: Any = None, request: Any = None) -> None:
        super().__init__(*args)
        self.response = response
        self.request = request


class HTTPError(RequestException):
    pass


class ConnectionError(RequestException):
    pass


class Timeout(RequestException):
    pass


class ReadTimeout(Timeout):
    pass


class ConnectTimeout(ConnectionError, Timeout):
    pass


class NewConnectionError(Exception):
    """urllib3's; requests raises ConnectionError around it, never this class."""


class Response:
    def __init__(self, status_code: int, content: bytes, url: str, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.content = content
        self.url = url
        self.headers = headers

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    @property
    def ok(self) -> bool:
        return self.status_code < 400

    def json(self) -> Any:
        return json_module.loads(self.content)

    def raise_for_status(self) -> None:
        if 400 <= self.status_code < 600:
            kind = "Client" if self.status_code < 500 else "Server"
            raise HTTPError(f"{self.status_code} {kind} Error for url: {self.url}", response=self)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(
    method: str,
    url: str,
    params: Any = None,
    json: Any = None,
    data: Any = None,
    headers: dict[str, str] | None = None,
    timeout: Any = None,
    **_: Any,
) -> Response:
    if params:
        url = f"{url}{'&' if '?' in url else '?'}{urllib.parse.urlencode(params)}"
    body = None
    sent_headers = dict(headers or {})
    if json is not None:
        body = json_module.dumps(json).encode()
        sent_headers.setdefault("Content-Type", "application/json")
    elif data is not None:
        body = data if isinstance(data, bytes) else str(data).encode()
    elif method in ("POST", "PUT"):
        body = b""
    prepared = urllib.request.Request(url, data=body, method=method, headers=sent_headers)
    wait = timeout[1] if isinstance(timeout, tuple) else timeout
    try:
        # requests without a timeout waits forever (slime's calls give none)
        reply = _OPENER.open(prepared) if wait is None else _OPENER.open(prepared, timeout=wait)
        with reply:
            return Response(reply.status, reply.read(), url, dict(reply.headers))
    except urllib.error.HTTPError as exc:
        return Response(exc.code, exc.read(), url, dict(exc.headers or {}))
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError | socket.timeout):
            raise ConnectTimeout(f"connection to {url} timed out") from exc
        raise ConnectionError(
            f"HTTPConnectionPool: Max retries exceeded with url: {url} ({exc.reason!r})"
        ) from exc
    except TimeoutError as exc:
        raise ReadTimeout(f"HTTPConnectionPool: Read timed out. (read timeout={wait}) for {url}") from exc
    except (
        http.client.RemoteDisconnected,
        ConnectionResetError,
        http.client.IncompleteRead,
        BrokenPipeError,
    ) as exc:
        raise ConnectionError(f"('Connection aborted.', {exc!r}) for {url}") from exc


def get(url: str, **kwargs: Any) -> Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> Response:
    return request("POST", url, **kwargs)


def delete(url: str, **kwargs: Any) -> Response:
    return request("DELETE", url, **kwargs)


def put(url: str, **kwargs: Any) -> Response:
    return request("PUT", url, **kwargs)


class Session:
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def get(self, url: str, **kwargs: Any) -> Response:
        return request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> Response:
        return request("POST", url, **kwargs)


def install() -> types.ModuleType:
    """`requests`, `requests.exceptions`, `urllib3` and `urllib3.exceptions` as these stand-ins."""
    exceptions = types.SimpleNamespace(
        RequestException=RequestException,
        HTTPError=HTTPError,
        ConnectionError=ConnectionError,
        Timeout=Timeout,
        ReadTimeout=ReadTimeout,
        ConnectTimeout=ConnectTimeout,
    )
    module = stand_in_module(
        "requests",
        request=request,
        get=get,
        post=post,
        delete=delete,
        put=put,
        Session=Session,
        Response=Response,
        exceptions=exceptions,
        **vars(exceptions),
    )
    stand_in_module("requests.exceptions", **vars(exceptions))
    stand_in_module("urllib3")
    stand_in_module("urllib3.exceptions", NewConnectionError=NewConnectionError)
    return module

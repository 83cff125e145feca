"""What the GPU tests read from a framework's `SGLangEngine` actor from outside, and how they point
a plain one at a running server (tests only; slime's and miles' engine actor modules use both)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from tests.helpers.host_time import CallTimes


class RequestTimes(CallTimes):
    """Each HTTP request's times, named "<who> <METHOD> <path>", while a test runs."""

    def request_timed(
        self, who: str, send: Callable[..., Any], method_at: int = 0, path_at: int = 1
    ) -> Callable[..., Any]:
        """`send` timed; its `method_at`-th and `path_at`-th arguments (or its `method` and `url`
        keywords, as `requests.post` passes them to `Session.request`) name the request."""

        def name(*args: Any, **kwargs: Any) -> str:
            method = kwargs.get("method", args[method_at] if len(args) > method_at else "?")
            target = str(kwargs.get("url", args[path_at] if len(args) > path_at else "?"))
            path = urllib.parse.urlsplit(target).path if "://" in target else target.split("?")[0]
            path = "/workers/{id}" if path.startswith("/workers/") else path
            return f"{who} {str(method).upper()} {path}"

        return self.timed(send, name)


class ActorReads:
    """Reads a test needs from a wrapped engine actor (mixed in before the framework's class)."""

    process: Any
    server_host: Any
    server_port: Any
    lifecycle: Any

    def server_pid(self) -> int:
        return int(self.process.pid)

    def server_address(self) -> tuple[str, int]:
        return str(self.server_host), int(self.server_port)

    def lifecycle_state_name(self) -> str:
        return str(self.lifecycle.state.value)

    def time_lifecycle_requests(self) -> None:
        """From now on, time each request the lifecycle sends to the server and to the router."""
        times = self.__dict__.setdefault("_test_request_times", RequestTimes())
        for client, who in ((self._lc_state.client, "server"), (self._lc_state.router, "router")):
            if client is not None:
                client._http.request = times.request_timed(who, client._http.request)

    def lifecycle_request_times(self) -> dict[str, dict[str, float]]:
        times: RequestTimes = self.__dict__["_test_request_times"]
        return times.take()

    def set_request_timeout(self, seconds: float) -> float:
        """The deadline of the lifecycle's own requests to the server and to its schedulers'
        receiver (`lifecycle_timeout_s`, fixed when each client starts); the previous one."""
        state = self._lc_state
        clients = [c for c in (state.client, state.receiver_client) if c is not None]
        before = float(clients[0].timeout_s)
        for client in clients:
            client.timeout_s = client.call_timeout_s = seconds
        return before


class PointAt:
    """A plain engine actor sending its HTTP calls to a server another actor launched."""

    def time_http_requests(self) -> None:
        """From now on, time each request this actor's process sends with `requests` (slime's and
        miles' engines send every call that way)."""
        import requests.sessions

        times = self.__dict__.setdefault("_test_request_times", RequestTimes())
        session = requests.sessions.Session
        session.request = times.request_timed("server", session.request, method_at=1, path_at=2)  # type: ignore[method-assign]

    def http_request_times(self) -> dict[str, dict[str, float]]:
        times: RequestTimes = self.__dict__["_test_request_times"]
        return times.take()

    def point_at(self, host: str, port: int) -> None:
        self.node_rank, self.server_host, self.server_port = 0, host, port
        self.router_ip = None

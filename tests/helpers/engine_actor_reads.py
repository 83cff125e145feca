"""What the GPU tests read from a framework's `SGLangEngine` actor from outside, and how they point
a plain one at a running server (tests only; slime's and miles' engine actor modules use both)."""

from __future__ import annotations

from typing import Any


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

    def set_request_timeout(self, seconds: float) -> float:
        """The deadline of the lifecycle's own requests to the server and to its schedulers'
        receiver (`lifecycle_timeout_s`, fixed when each client starts); the previous one."""
        clients = [self.__dict__[k] for k in ("_lc_client", "_lc_receiver_client") if k in self.__dict__]
        before = float(clients[0].timeout_s)
        for client in clients:
            client.timeout_s = client.call_timeout_s = seconds
        return before


class PointAt:
    """A plain engine actor sending its HTTP calls to a server another actor launched."""

    def point_at(self, host: str, port: int) -> None:
        self.node_rank, self.server_host, self.server_port = 0, host, port
        self.router_ip = None

"""slime's `SGLangEngine` classes as the GPU tests' Ray actors create them (tests only).

Importing this module runs slime's `slime/backends/sglang_utils/sglang_engine.py` from its source
(`RL_LIFECYCLE_SLIME_SOURCE`, the commit the trainer suites use) against the installed SGLang, and
keeps it installed for the life of the process: the test's driver and every Ray worker that
unpickles one of the classes below import it the same way (Ray pickles a class of an importable
module by reference), as a worker of a slime job imports slime.

- `WrappedSlimeEngine`: `lifecycle_engine(SGLangEngine)`, what `slime_rollout.install()` makes slime's
  rollout manager create, plus two reads a test needs from outside the actor;
- `PlainSlimeEngine`: slime's class as it is, pointed at a running server (`point_at`), for
  slime's own calls on the same server.
"""

from __future__ import annotations

import contextlib

from actor_integration.frameworks.slime_rollout import lifecycle_engine
from tests.helpers.engine_source import installed
from tests.helpers.slime_source import SlimeSource

_kept = contextlib.ExitStack()
module, _launched = _kept.enter_context(installed("slime", SlimeSource.find(), server_fields=None))


class WrappedSlimeEngine(lifecycle_engine(module.SGLangEngine)):  # type: ignore[misc]
    """slime's engine under the rollout lifecycle (`SlimeRolloutMixin`), as a Ray actor."""

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


class PlainSlimeEngine(module.SGLangEngine):  # type: ignore[misc]
    """slime's engine, unwrapped, sending its HTTP calls to a server another actor launched."""

    def point_at(self, host: str, port: int) -> None:
        self.node_rank, self.server_host, self.server_port = 0, host, port
        self.router_ip = None

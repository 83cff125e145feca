"""One server's place at the router, added and removed through the router's own worker API.

slime and miles register each engine's server with the router at launch and remove it at
shutdown; rollout requests then go from the rollout function through the router, never through
the engine actor. An engine actor under the lifecycle takes its server out of the router while
its weights cannot be served (released, partly loaded, or not the version it saw loaded whole)
and puts it back after, with the calls the framework itself makes (read from slime 624b824a and
miles 31f1ca96, `backends/sglang_utils/sglang_engine.py`):

- `"workers"` (sglang_router 0.3 on; slime's and miles' default): `POST /workers` with the URL and
  worker type; removal finds the worker's id in `GET /workers` and sends `DELETE /workers/{id}`;
- `"workers_by_url"` (sglang_router before 0.3, miles): removal is `DELETE /workers/{quoted url}`;
- `"legacy"` (sglang_router 0.2.1 and older): `POST /add_worker?url=...` and
  `POST /remove_worker?url=...`;
- `"miles"` (miles' own router, `--use-miles-router`, `miles/router/router.py`): `POST
  /add_worker?url=...` and `GET /list_workers`. It has no route that removes a worker: a `POST
  /remove_worker` falls through to its catch-all proxy and reaches a server, which answers 404.
  `removable` is False, and `remove()` refuses before sending anything.

Standard library only, on kept-alive connections (`http_connections`); every request has a timeout and every failure is a `RouterError`.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

from actor_integration.errors import RouterError
from actor_integration.rollout.http_connections import Connections

__all__ = ["ROUTER_APIS", "RouterWorkers"]

ROUTER_APIS = ("workers", "workers_by_url", "legacy", "miles")
_HEADERS = {"Content-Type": "application/json"}


class RouterWorkers:
    """Adds and removes one server (`worker_url`) at one router (`router_url`)."""

    def __init__(
        self,
        router_url: str,
        worker_url: str,
        *,
        api: str = "workers",
        worker_type: str = "regular",
        bootstrap_port: int | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if api not in ROUTER_APIS:
            raise ValueError(f"RouterWorkers: api must be one of {list(ROUTER_APIS)}, got {api!r}")
        if timeout_s <= 0:
            raise ValueError(f"RouterWorkers: timeout_s must be positive, got {timeout_s!r}")
        self.router_url = router_url.rstrip("/")
        self.worker_url = worker_url.rstrip("/")
        self.api = api
        self.worker_type = worker_type
        self.bootstrap_port = bootstrap_port
        self.timeout_s = timeout_s
        self._http = Connections(self.router_url)  # kept alive, no proxies

    @property
    def removable(self) -> bool:
        """Whether this router's API can take a server out (miles' own router cannot)."""
        return self.api != "miles"

    def add(self) -> None:
        """Register the server, as the framework does at launch."""
        quoted = urllib.parse.quote(self.worker_url, safe=":/")
        if self.api in ("legacy", "miles"):
            self._call("add", "POST", f"/add_worker?url={quoted}", None)
            return
        payload: dict[str, Any] = {"url": self.worker_url, "worker_type": self.worker_type}
        if self.bootstrap_port is not None:
            payload["bootstrap_port"] = self.bootstrap_port
        self._call("add", "POST", "/workers", payload)

    def remove(self) -> bool:
        """Take the server out; False when the router did not list it (nothing to remove)."""
        if not self.removable:
            raise RouterError(
                f"the router at {self.router_url} ({self.api!r} API) has no route that removes a worker, so "
                f"{self.worker_url} cannot be taken out of it; check `removable` before calling remove()",
                status=None,
                answer="",
                router=self.router_url,
                worker=self.worker_url,
                operation="remove",
                path="",
            )
        if self.api == "legacy":
            quoted = urllib.parse.quote(self.worker_url, safe=":/")
            self._call("remove", "POST", f"/remove_worker?url={quoted}", None)
            return True
        if self.api == "workers_by_url":
            self._call("remove", "DELETE", f"/workers/{urllib.parse.quote(self.worker_url, safe='')}", None)
            return True
        worker_id = self._worker_id()
        if worker_id is None:
            return False
        self._call("remove", "DELETE", f"/workers/{urllib.parse.quote(str(worker_id), safe='')}", None)
        return True

    def listed(self) -> bool | None:
        """Whether the router lists the server (None: the legacy API cannot say)."""
        if self.api == "legacy":
            return None
        if self.api == "miles":
            answer = self._call("list", "GET", "/list_workers", None)
            urls = answer.get("urls", []) if isinstance(answer, dict) else []
            return any(str(u).rstrip("/") == self.worker_url for u in urls)
        return any(w.get("url", "").rstrip("/") == self.worker_url for w in self._workers("list"))

    def close(self) -> None:
        """Close the kept-alive connections to the router (a later request opens a new one)."""
        self._http.close()

    def _worker_id(self) -> Any:
        for worker in self._workers("remove"):
            if worker.get("url", "").rstrip("/") == self.worker_url:
                return worker.get("id", worker.get("worker_id"))
        return None

    def _workers(self, operation: str) -> list[dict[str, Any]]:
        answer = self._call(operation, "GET", "/workers", None)
        workers = answer.get("workers", []) if isinstance(answer, dict) else []
        return [w for w in workers if isinstance(w, dict)]

    def _call(self, operation: str, method: str, path: str, body: Any) -> Any:
        data = None if body is None else json.dumps(body).encode()
        fields = {"router": self.router_url, "worker": self.worker_url, "operation": operation, "path": path}
        try:
            status, answer_bytes = self._http.request(method, path, data, _HEADERS, self.timeout_s)
        except (http.client.HTTPException, TimeoutError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            raise RouterError(
                f"the router at {self.router_url} could not be reached for {method} {path} ({reason}) while "
                f"{'adding' if operation == 'add' else 'removing'} {self.worker_url}; is it up "
                "(args.sglang_router_ip / sglang_router_port)?",
                status=None,
                answer=str(reason),
                **fields,
            ) from exc
        raw = answer_bytes.decode(errors="replace")
        if not 200 <= status < 300:
            answer = raw.strip()
            raise RouterError(
                f"the router at {self.router_url} answered {method} {path} for {self.worker_url} with "
                f"{status}: {answer}; the server is {'still out of' if operation == 'add' else 'still in'} "
                "the router",
                status=status,
                answer=answer,
                **fields,
            )
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return raw

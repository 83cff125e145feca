"""The GPU rollout tests' request timers, on CPU against the fake SGLang server."""

from __future__ import annotations

from typing import Any

import pytest

from actor_integration.engines.sglang.actor import _no_codec
from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.rollout.router import RouterWorkers
from actor_integration.rollout.server_actor import ServerState
from tests.helpers.engine_actor_reads import ActorReads, PointAt
from tests.helpers.sglang_server import FakeRouter, FakeSGLangServer


@pytest.fixture
def servers() -> Any:
    server, router = FakeSGLangServer(), FakeRouter()
    yield server, router
    server.close(wait=True)
    router.close()


def test_the_lifecycles_requests_are_timed_per_path(servers: Any) -> None:
    server, router = servers
    actor = ActorReads()
    actor._lc_state = ServerState()  # on an engine actor, the wrap's own
    actor._lc_state.client = client = SGLangHTTPEngine(server.url, codec=_no_codec, multi_dtype_buckets=False)
    actor._lc_state.router = workers = RouterWorkers(router.url, server.url)
    actor.time_lifecycle_requests()
    client.flush_cache()
    client.flush_cache()
    workers.add()
    workers.remove()
    times = actor.lifecycle_request_times()
    assert set(times) == {
        "server POST /flush_cache",
        "router POST /workers",
        "router GET /workers",
        "router DELETE /workers/{id}",
    }
    assert times["server POST /flush_cache"]["calls"] == 2 and times["server POST /flush_cache"]["max_ms"] > 0
    assert actor.lifecycle_request_times() == {}  # taken


def test_the_frameworks_requests_are_timed_per_path(servers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import requests
    import requests.sessions

    server, _router = servers
    monkeypatch.setattr(
        requests.sessions.Session, "request", requests.sessions.Session.request
    )  # restored after
    actor = PointAt()
    actor.time_http_requests()
    requests.post(f"{server.url}/flush_cache", timeout=5)
    requests.get(f"{server.url}/model_info?x=1", timeout=5)
    assert set(actor.http_request_times()) == {"server POST /flush_cache", "server GET /model_info"}

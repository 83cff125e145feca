"""miles' own router (`miles/router/router.py` at the pinned commit, run from its source under
uvicorn) beside `FakeRouter(kind="miles")`, which the rollout suites use in its place: the same
script of requests, the wrap's and miles' engine's, gets the same answers from both.

Needs miles' source and the router's own dependencies (fastapi, uvicorn, httpx, setproctitle),
none of which CI has: there the file skips. Run it with

    pip install fastapi uvicorn httpx setproctitle
    RL_LIFECYCLE_MILES_SOURCE=/path/to/miles python -m pytest -s tests/actor_integration/frameworks/miles/test_miles_router_source.py
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from actor_integration.rollout.router import RouterWorkers
from tests.helpers.framework_source import free_port, stand_in_module, suite_source
from tests.helpers.miles_source import MilesSource
from tests.helpers.sglang_server import FakeRouter, FakeSGLangServer

SOURCE, pytestmark, _source_readable = suite_source(MilesSource, "miles'")
ROUTER_MODULE = "miles/router/router.py"
ROUTER_DEPENDENCIES = ("fastapi", "uvicorn", "httpx", "setproctitle")


def _router_dependencies() -> None:
    """Skip (not error) where one of the router's own dependencies is missing."""
    for name in ROUTER_DEPENDENCIES:
        pytest.importorskip(name, reason=f"miles' router needs {name} (pip install {name})")


def _miles_router_app() -> Any:
    """miles' `MilesRouter(args).app` from its source; its logging helper stood in."""
    _router_dependencies()
    saved = {name: sys.modules.get(name) for name in ("miles", "miles.utils", "miles.utils.logging_utils")}
    try:
        stand_in_module("miles", __path__=[])
        stand_in_module("miles.utils", __path__=[])
        stand_in_module("miles.utils.logging_utils", configure_logger_raw=lambda *a, **k: None)
        module = types.ModuleType("miles_router_from_source")
        code = compile(SOURCE.read(ROUTER_MODULE), f"miles@{SOURCE.commit}/{ROUTER_MODULE}", "exec")
        exec(code, module.__dict__)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    args = types.SimpleNamespace(
        sglang_server_concurrency=8,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        rollout_health_check_interval=3600,  # its background check stays asleep through the test
        miles_router_health_check_failure_threshold=3,
    )
    return module.MilesRouter(args, verbose=False).app


@pytest.fixture
def miles_own_router() -> Iterator[str]:
    _router_dependencies()  # before uvicorn's import: without it the test skips, not errors
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        _miles_router_app(), host="127.0.0.1", port=port, log_level="critical"
    )  # its 500 is expected
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "miles' router did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def fake_router() -> Iterator[str]:
    router = FakeRouter(kind="miles")
    yield router.url
    router.close()


def script(router_url: str) -> list[Any]:
    """What the wrap and miles' engine send miles' router over a server's life, and what it answers."""
    import requests

    server = FakeSGLangServer()
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}}
    workers = RouterWorkers(router_url, server.url, api="miles")
    seen: list[Any] = []
    try:
        reply = requests.post(f"{router_url}/generate", json=generate, timeout=10)
        seen.append(("generate, no worker", reply.status_code))
        workers.add()  # the wrap's join: POST /add_worker?url=...
        reply = requests.post(f"{router_url}/add_worker", json={"url": server.url}, timeout=10)
        seen.append(("add again, in the body", reply.status_code, reply.json()["status"]))
        reply = requests.get(f"{router_url}/list_workers", timeout=10)
        seen.append(("list", reply.status_code, reply.json()))
        seen.append(("listed", workers.listed(), workers.removable))
        reply = requests.post(f"{router_url}/generate", json=generate, timeout=10)
        seen.append(("generate", reply.status_code, sorted(reply.json()) if reply.ok else reply.text))
        # miles' own shutdown: POST /remove_worker?url=..., then raise_for_status()
        reply = requests.post(f"{router_url}/remove_worker?url={server.url}", timeout=10)
        seen.append(("remove_worker", reply.status_code))
        reply = requests.get(f"{router_url}/list_workers", timeout=10)
        seen.append(("list after", reply.json()))
    finally:
        server.close(wait=True)
    return [_without(server.url, entry) for entry in seen]


def _without(url: str, entry: Any) -> Any:
    """The entry with this run's server URL replaced by a name (the two runs' servers differ)."""
    if isinstance(entry, str):
        return entry.replace(url, "SERVER")
    if isinstance(entry, (list, tuple)):
        return type(entry)(_without(url, item) for item in entry)
    if isinstance(entry, dict):
        return {_without(url, k): _without(url, v) for k, v in entry.items()}
    return entry


def test_the_fake_answers_as_miles_own_router_does(miles_own_router: str, fake_router: str) -> None:
    real = script(miles_own_router)
    print("\nmiles' router from its source:", *real, sep="\n  ")
    assert real == script(fake_router)
    assert ("remove_worker", 404) in real  # no route: the request reached the server
    assert ("list after", {"urls": ["SERVER"]}) in real  # and the server is still in

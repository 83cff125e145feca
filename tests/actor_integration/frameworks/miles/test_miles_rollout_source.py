"""miles' real `SGLangEngine` (its source at the pinned commit) under `MilesRolloutMixin`, against
a local server that answers as SGLang 0.5.23's does: miles 31f1ca96's trainer opens a weight-update
session (`/begin_weight_update`), which 0.5.17 has no route for. The suite is `rollout_source_suite`.

Needs miles' source: CI has no network, so the suite skips there; run it with

    RL_LIFECYCLE_MILES_SOURCE=/path/to/miles python -m pytest -s tests/actor_integration/frameworks/miles/test_miles_rollout_source.py
"""

from __future__ import annotations

import pytest

from lifecycle.logs import Event
from tests.actor_integration.frameworks.rollout_source_suite import RolloutSourceSuite
from tests.helpers.framework_source import suite_source
from tests.helpers.miles_source import MilesSource
from tests.helpers.rollout_calls import GARBAGE, METHODS, check

SOURCE, pytestmark, _source_readable = suite_source(MilesSource, "miles'")

KILLS = "kills the server: "


class TestMilesRollout(RolloutSourceSuite):
    framework = "miles"
    version = "0.5.23"
    source = SOURCE
    reproductions = (
        (("onload",), KILLS + "a resume of a resident tag (KeyError)"),
        (("onload_weights",), KILLS + "a resume of a resident tag (KeyError)"),
        (("onload_kv",), KILLS + "a resume of a resident tag (KeyError)"),
        (("offload", "offload"), KILLS + "a second release (torch_memory_saver exits)"),
        (("offload", "offload_kv"), KILLS + "a second release (torch_memory_saver exits)"),
        (("offload", "generate"), KILLS + "a generation on released memory (Triton)"),
        (("offload", "health"), KILLS + "a generation on released memory (Triton)"),
        (("offload", "update_weights"), KILLS + "weights written into released memory"),
        (("offload", "onload", "generate"), GARBAGE),
    )

    def test_the_kv_only_offload_loop_of_miles_own_driver(self, env):
        """miles' train.py with `--offload-rollout-level kv_cache`: offload(cuda_graph, kv_cache) →
        onload_weights → push → onload_kv. Plain miles resumes resident weights (KeyError: the
        server exits) at the first step; under the wrap five steps run, the weights never released."""
        methods = METHODS["miles"]
        for wrapped in (False, True):
            world = env.world(wrapped)
            start = len(world.server.requests)
            step = ["generate", "offload_kv", "onload_weights", "update_weights", "onload_kv"]
            for name in step * 5:
                methods[name](world)
                if check(world) is not None:
                    break  # plain miles' next flush_cache would retry a dead server for 60 s
            found = check(world)
            world.close()
            if wrapped:
                assert found is None and world.server.labels == dict.fromkeys(world.server.labels, "6")
                releases = [
                    b["tags"]
                    for _, p, b in world.server.requests[start:]
                    if p == "/release_memory_occupation"
                ]
                assert len(releases) == 5 and all("weights" not in tags for tags in releases), releases
            else:
                assert found == KILLS + "a resume of a resident tag (KeyError)"

    def test_miles_own_shutdown_behind_its_router_fails_before_the_kill_and_the_wrap_kills(
        self, env, miles_router
    ):
        """With `--use-miles-router`, miles' `shutdown` asks its router `POST /remove_worker`, a route
        that router lacks: its proxy passes the request to a server, which answers 404, and miles
        raises before it kills the server (its `stop_engines` then logs the error and skips the
        `ray.kill`). Under the wrap the server is killed, the call logged as absorbed, and it returns."""
        import requests

        plain = env.world(wrapped=False, router=miles_router)
        with pytest.raises(requests.HTTPError, match="404"):
            plain.engine.shutdown()
        assert plain.server.alive  # left running, holding its GPU memory
        world = env.world(router=miles_router)
        events: list[tuple[Event, dict]] = []
        log_event = world.engine._lc_event

        def recording(name: Event, *args: object, **fields: object) -> None:
            events.append((name, fields))
            log_event(name, *args, **fields)

        world.engine._lc_event = recording
        assert world.engine.shutdown() is None and not world.server.alive
        absorbed = [fields for name, fields in events if name == Event.ABSORBED]
        assert len(absorbed) == 1 and absorbed[0]["call"] == "shutdown"
        assert "404" in str(absorbed[0]["reason"]) and "'miles' API" in str(absorbed[0]["reason"])

"""The tests slime's and miles' rollout halves share, run on each framework's own `SGLangEngine`
from its source (test_slime_rollout_source.py, test_miles_rollout_source.py set the framework).

Each engine launches a `FakeSGLangServer` (answering as the pinned SGLang does, dying where it
dies) and registers with a `FakeRouter`, all over real HTTP on localhost; the calls are the ones
the framework's own rollout manager, trainer, health monitor and rollout function make
(`tests/helpers/rollout_calls.py`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from actor_integration.engines.sglang.actor import LocalDirectory
from actor_integration.errors import EngineDiedError, FollowerCallError, SGLangServerError, StaleWeightsError
from lifecycle import Contents, Residency, State
from lifecycle.checker import check_files
from lifecycle.errors import IllegalTransitionError, LifecycleError
from lifecycle.logs import Event
from tests.helpers import rollout_calls
from tests.helpers.engine_source import engine_args, installed, start_engine
from tests.helpers.framework_source import free_port
from tests.helpers.method_sequences import explore, render
from tests.helpers.rollout_calls import METHODS, check, started
from tests.helpers.sglang_server import FakeRouter, encode_names
from tests.helpers.sglang_source import SourceTree, cached_wheel, fetch_wheel, request_problem

PLAIN_DEPTH = 3
WRAPPED_DEPTH = 2  # every wrapped call sends the lifecycle's own requests too
SLOW_WRAPPED_DEPTH = 3


@contextlib.contextmanager
def hung_schedulers(world: rollout_calls.World, paths: tuple[str, ...], clients: list[Any]):
    """The server's schedulers stop answering `paths` (on the H200: their processes stopped) while
    the lifecycle's `clients` wait 0.5 s; on exit they run again (answering what nobody waits for
    any more) and the clients' deadlines are back."""
    gate = threading.Event()
    world.server.stalled.update(dict.fromkeys(paths, gate))
    deadlines = [(c.timeout_s, c.call_timeout_s) for c in clients]
    for client in clients:
        client.timeout_s = client.call_timeout_s = 0.5
    try:
        yield
    finally:
        gate.set()
        for path in paths:
            del world.server.stalled[path]
        for client, (timeout_s, call_timeout_s) in zip(clients, deadlines, strict=True):
            client.timeout_s, client.call_timeout_s = timeout_s, call_timeout_s


def _eventually(condition: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _arrived(server: Any, path: str, *, since: int) -> list[str]:
    """The paths the server received from its `since`-th request on, once `path` is among them (5 s at most)."""

    def paths() -> list[str]:
        return [p for _, p, _ in server.requests[since:]]

    assert _eventually(lambda: path in paths()), f"no {path} came while the other request was held: {paths()}"
    return paths()


def generate_through_router(world: rollout_calls.World) -> Any:
    """One rollout request through the router, waited for (a paused server would hold it)."""
    import requests

    payload = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}}
    return requests.post(f"{world.router.url}/generate", json=payload, timeout=5)


def cycles_with_requests_all_along(
    world: rollout_calls.World, methods: dict[str, Any], cycles: int = 5
) -> list[Any]:
    """`cycles` of the driver's loop while a client sends the rollout's requests through the router
    without pause; each answer's status (or the exception's name)."""
    stop, answers = threading.Event(), []

    def client() -> None:
        import requests

        while not stop.is_set():
            payload = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            try:
                answers.append(
                    requests.post(f"{world.router.url}/generate", json=payload, timeout=30).status_code
                )
            except Exception as exc:
                answers.append(type(exc).__name__)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    for _ in range(cycles):
        time.sleep(0.02)
        weights_pushed(world, methods)
        methods["onload_kv"](world)
    time.sleep(0.05)
    stop.set()
    thread.join(30)
    return answers


def weights_pushed(world: rollout_calls.World, methods: dict[str, Any]) -> None:
    """The driver's sequence up to its onload_kv: offload, the weights' memory back, a version pushed."""
    methods["offload"](world)
    methods["onload_weights"](world)
    rollout_calls.update_weights(world)


class Env:
    def __init__(
        self, framework: str, module: Any, launched: Any, router: FakeRouter, tree: SourceTree
    ) -> None:
        self.framework, self.module, self.launched, self.router, self.tree = (
            framework,
            module,
            launched,
            router,
            tree,
        )
        self.plain = module.SGLangEngine
        self.wrapped = importlib.import_module(
            f"actor_integration.frameworks.{framework}.rollout"
        ).lifecycle_engine(module.SGLangEngine)
        self.worlds: list[rollout_calls.World] = []

    def world(self, wrapped: bool = True, *, router: FakeRouter | None = None) -> rollout_calls.World:
        """A started world; with `FakeRouter(kind="miles")`, behind a router that cannot remove a
        worker: miles' own (`--use-miles-router`), or, for slime (which has none), the wrapped class
        told that its router is one."""
        router = router if router is not None else self.router
        cls, overrides = self.wrapped if wrapped else self.plain, {}
        if router.kind == "miles" and self.framework == "miles":
            overrides["use_miles_router"] = True
        elif router.kind == "miles":
            assert wrapped, "slime has no router of its own: only the wrap can be told it has one"
            cls = type(cls.__name__, (cls,), {"lifecycle_router_api": lambda self: "miles"})
        world = started(self.framework, cls, self.launched, router, **overrides)
        self.worlds.append(world)
        return world

    def fresh(self, wrapped: bool, *, router: FakeRouter | None = None) -> Any:
        def make() -> rollout_calls.World:
            for world in self.worlds:
                world.close()
            self.worlds.clear()
            return self.world(wrapped, router=router)

        return make

    def close(self) -> None:
        for world in self.worlds:
            world.close()
        self.worlds.clear()


class RolloutSourceSuite:
    framework: ClassVar[str]
    version: ClassVar[str]  # the SGLang the framework's calls are written for
    source: ClassVar[Any]
    reproductions: ClassVar[tuple[tuple[tuple[str, ...], str], ...]]

    def installed(self, tree: SourceTree) -> Any:
        """The engine class's module and its servers: the framework's source (this suite's default)."""
        return installed(
            self.framework, self.source, server_fields=tree.server_args_fields(), version=self.version
        )

    @pytest.fixture(scope="class")
    def env(self):
        logging.getLogger(f"{self.framework}.backends.sglang_utils.sglang_engine").setLevel(logging.ERROR)
        tree = SourceTree(cached_wheel(self.version) or fetch_wheel(self.version), self.version)
        router = FakeRouter()
        with self.installed(tree) as (module, launched):
            env = Env(self.framework, module, launched, router, tree)
            yield env
            env.close()
        router.close()
        tree.close()

    @pytest.fixture
    def world(self, env):
        world = env.world()
        yield world
        world.close()

    @pytest.fixture
    def miles_router(self):
        router = FakeRouter(kind="miles")
        yield router
        router.close()

    # ------------------------------------------------------------------ the model check

    def test_plain_breaks_in_exactly_the_listed_ways(self, env):
        """Every sequence of the job's calls up to a length, on the framework's own class: the
        shortest way to each kind of damage is listed (a found one missing, or a listed one not found, fails)."""
        search = explore(env.fresh(wrapped=False), METHODS[self.framework], PLAIN_DEPTH, check)
        print(
            f"\nplain {self.framework}, every sequence of the job's calls after start-up up to length {PLAIN_DEPTH}:"
        )
        print(render(self.framework, search))
        found = {(finding.sequence, finding.kind) for finding in search.shortest.values()}
        assert found == set(self.reproductions)

    def test_each_reproduction_breaks_plain_and_runs_clean_wrapped(self, env):
        for sequence, kind in self.reproductions:
            for wrapped in (False, True):
                world = env.world(wrapped)
                refused = []
                for name in sequence:
                    try:
                        METHODS[self.framework][name](world)
                    except LifecycleError as exc:
                        refused.append(f"{name}: {type(exc).__name__}")
                found = check(world)
                alive = world.server.alive
                world.close()
                if wrapped:
                    assert found is None and alive, (sequence, found, refused)
                else:
                    assert found == kind, (sequence, found)

    def test_no_sequence_breaks_under_the_wrap(self, env):
        search = explore(env.fresh(wrapped=True), METHODS[self.framework], WRAPPED_DEPTH, check)
        print(f"\nunder the wrap, up to length {WRAPPED_DEPTH}:\n{render(self.framework, search)}")
        assert search.violations == 0, render(self.framework, search)

    @pytest.mark.slow
    def test_no_longer_sequence_breaks_under_the_wrap(self, env):
        search = explore(env.fresh(wrapped=True), METHODS[self.framework], SLOW_WRAPPED_DEPTH, check)
        assert search.violations == 0, render(self.framework, search)

    # ------------------------------------------------------------------ the driver's loop

    def test_the_drivers_loop_serves_every_step_on_its_version(self, world):
        """generate (requests through the router) → offload → onload_weights → push → onload_kv, 20
        steps: every request served on the step's version whole, the same tokens whenever it is the same."""
        methods = METHODS[self.framework]
        tokens: dict[str, list[Any]] = {}
        for _ in range(20):
            before = len(world.server.served)
            for _ in range(3):
                methods["generate"](world)
            assert len(world.server.served) == before + 3
            weights_pushed(world, methods)
            methods["onload_kv"](world)
        assert check(world) is None and not world.errors, world.errors
        for served in world.server.served:
            if served["path"] == "/generate":
                tokens.setdefault(served["current"], []).append(served["labels"])
        assert len(tokens) == 20
        assert world.engine.lifecycle_state()["served_version"] == "21"

    # ------------------------------------------------------------------ weight validity

    def test_out_of_the_router_from_the_release_until_a_whole_version_is_awake(self, world):
        methods, url = METHODS[self.framework], world.engine.lifecycle_state()["url"]
        assert world.router.urls() == [url]
        methods["offload"](world)
        assert world.router.urls() == []
        methods["onload_weights"](world)
        assert world.router.urls() == []
        rollout_calls.update_weights(world)
        assert world.router.urls() == [] and world.server.paused
        methods["onload_kv"](world)
        assert world.router.urls() == [url] and not world.server.paused
        state = world.engine.lifecycle_state()
        assert state["served_version"] == world.server.weight_version == "2"

    def test_requests_sent_all_along_are_never_served_on_released_or_stale_weights(self, world):
        """A client sending the rollout's requests through the router without pause, through sleeps,
        syncs and wakes: each is served on the current version whole, or refused (no worker)."""
        answers = cycles_with_requests_all_along(world, METHODS[self.framework])
        generated = [s for s in world.server.served if s["path"] == "/generate"]
        print(
            f"\n{len(answers)} requests: {answers.count(200)} served, {answers.count(503)} found no worker; "
            f"served on the current version whole: {sum(s['ok'] for s in generated)}/{len(generated)}"
        )
        assert check(world) is None and generated and all(s["ok"] for s in generated)
        assert set(answers) <= {200, 503}

    def test_the_lifecycles_sender_loads_through_the_servers_receiver_under_the_guard(self, world, tmp_path):
        """`WeightSender` (shm here, CUDA IPC on the GPU) → `lifecycle_update_weights`, the sender's
        engine call, for 3 steps of offload / onload_weights / sync / onload_kv: the server's receiver
        loads exactly the trainer's tensors; the server stays out of the router until the version is
        whole and awake; a sync into released weights is refused before anything reaches the server."""
        import torch

        from tests.helpers.weight_sync_doubles import shm_sender

        methods, engine, url = METHODS[self.framework], world.engine, world.engine.lifecycle_state()["url"]
        engine.lifecycle_serialize_names = lambda: encode_names  # no sglang here: the fake's encoding
        loaded_events: list[dict[str, Any]] = []
        log_event = engine._lc_event

        def recording(name: Any, *args: Any, **fields: Any) -> Any:
            if name == Event.SYNC_LOADED:
                loaded_events.append(fields)
            return log_event(name, *args, **fields)

        engine._lc_event = recording
        # One bucket per round: a version takes several rounds, and its event counts them all.
        sender = shm_sender(
            engine.lifecycle_update_weights, bucket_bytes=1 << 11, deadline_s=10, round_buckets=1
        )
        try:
            methods["offload"](world)
            before = len(world.server.requests)
            with pytest.raises(LifecycleError) as refused:
                sender.send(90, [("w", torch.ones(4))])
            assert "weights" in str(refused.value) and len(world.server.requests) == before
            assert engine.lifecycle.state is not State.FAILED
            for step in range(3):
                if step:
                    methods["offload"](world)
                methods["onload_weights"](world)
                version = 100 + step
                world.server.trainer_version = str(version)
                g = torch.Generator().manual_seed(step)
                sent = {"embed": torch.randn(48, 8, generator=g), "lm_head": torch.randn(48, 8, generator=g)}
                sender.send(version, sent.items())
                assert world.router.urls() == []  # awake weights, KV cache still released: not servable
                loaded = world.server.model.loaded
                assert all(torch.equal(loaded[n], t) for n, t in sent.items())
                methods["onload_kv"](world)
                assert world.router.urls() == [url] and not world.server.paused
                assert (
                    engine.lifecycle_state()["served_version"] == world.server.weight_version == str(version)
                )
                methods["generate"](world)
                assert world.server.served[-1]["ok"]
        finally:
            sender.close()
        assert check(world) is None and not world.errors, world.errors
        sent_bytes = sum(t.numel() * t.element_size() for t in sent.values())
        assert [(e["version"], e["bytes"], e["ok"]) for e in loaded_events] == [
            (100 + step, sent_bytes, True) for step in range(3)
        ]

    def test_a_corrupt_round_from_the_sender_is_refused_and_the_version_sent_again_is_served(self, world):
        """A round whose bucket fails its checksum in the server's receiver: `CorruptBucketError`,
        nothing written, the weights unknown and the server kept out of the router (no request is
        served on them) until the version is sent again whole."""
        import torch

        from actor_integration.weight_sync.wire import CorruptBucketError
        from tests.helpers.weight_sync_doubles import shm_sender, with_bad_checksum

        methods, engine, url = METHODS[self.framework], world.engine, world.engine.lifecycle_state()["url"]
        engine.lifecycle_serialize_names = lambda: encode_names

        def corrupting(version, payloads):
            return engine.lifecycle_update_weights(version, [with_bad_checksum(payloads[0]), *payloads[1:]])

        def sender(call):
            return shm_sender(call, bucket_bytes=1 << 11, deadline_s=10, corrupt_resends=0)

        good, bad = sender(engine.lifecycle_update_weights), sender(corrupting)
        sent = {"embed": torch.full((48, 8), 2.0), "lm_head": torch.full((48, 8), 3.0)}
        try:
            methods["offload"](world)
            methods["onload_weights"](world)
            world.server.trainer_version = "7"
            good.send(7, sent.items())
            methods["onload_kv"](world)
            assert world.router.urls() == [url]
            loaded = {n: t.clone() for n, t in world.server.model.loaded.items()}
            methods["offload"](world)
            methods["onload_weights"](world)
            world.server.trainer_version = "8"
            with pytest.raises(CorruptBucketError):
                bad.send(8, {n: t + 1 for n, t in sent.items()}.items())
            assert all(
                torch.equal(world.server.model.loaded[n], t) for n, t in loaded.items()
            )  # nothing written
            methods["onload_kv"](world)
            state = engine.lifecycle_state()
            assert state["state"] != State.FAILED.value, state  # a refused round is not a broken engine
            assert state["contents"]["weights"] != Contents.VALID.value and world.router.urls() == [], state
            good.send(8, {n: t + 1 for n, t in sent.items()}.items())  # the way out: the version again
            assert world.router.urls() == [url]
            assert engine.lifecycle_state()["served_version"] == "8"
            methods["generate"](world)
            assert world.server.served[-1]["ok"]
        finally:
            good.close()
            bad.close()

    def test_a_wake_without_a_push_keeps_the_server_out(self, world):
        methods = METHODS[self.framework]
        methods["offload"](world)
        methods["onload"](world)
        assert world.router.urls() == [] and world.server.paused
        methods["generate"](world)
        assert world.router.routed[-1] == (None, 503)
        assert world.engine.lifecycle.contents["weights"] is Contents.DISCARDED
        rollout_calls.update_weights(world)  # the push makes it servable: back in
        assert world.router.urls() and check(world) is None

    def test_a_server_reporting_another_version_stays_out(self, world):
        methods = METHODS[self.framework]
        weights_pushed(world, methods)
        world.server.weight_version = "someone-else's"
        with pytest.raises(LifecycleError) as refused:
            methods["onload_kv"](world)
        assert isinstance(refused.value, StaleWeightsError) or "StaleWeightsError" in str(refused.value)
        assert world.router.urls() == [] and world.server.paused

    def test_a_restarted_engine_joins_only_with_the_current_version(self, world):
        methods = METHODS[self.framework]
        methods["recover"](world)  # the old engine shut down, a new one launched on its checkpoint
        assert world.router.urls() == [] and world.server.labels["embed"] == "garbage"
        methods["generate"](world)
        assert world.router.routed[-1] == (None, 503)
        rollout_calls.update_weights(world)
        methods["onload_kv"](world)
        assert world.router.urls() == [world.engine.lifecycle_state()["url"]] and check(world) is None

    def test_a_push_without_the_trainers_pause_pauses_generation_first(self, world):
        engine = world.engine
        if self.framework == "miles":
            engine.begin_weight_update()  # SGLang 0.5.23 loads inside a session only
        engine.update_weights_from_tensor(
            [encode_names(["embed"])], load_format="flattened_bucket", weight_version="7"
        )
        assert world.server.paused and engine.lifecycle.contents["weights"] is Contents.UNKNOWN
        methods = METHODS[self.framework]
        methods["generate"](world)  # held by SGLang's pause, not served on the half-written model
        assert check(world) is None

    # ------------------------------------------------------------------ the router's requests alongside the server's

    def test_the_sleep_pauses_the_server_while_the_router_takes_it_out(self, world):
        """One round trip, not two: SGLang's pause and flush reach the server while the router's
        removal is still in flight; nothing is released until both have answered."""
        done, gate = [], threading.Event()
        world.router.stalled["remove"] = gate
        thread = threading.Thread(
            target=lambda: done.append(METHODS[self.framework]["offload"](world)), daemon=True
        )
        since = len(world.server.requests)
        try:
            thread.start()
            paths = _arrived(world.server, "/flush_cache", since=since)
            assert "/pause_generation" in paths and "/release_memory_occupation" not in paths, paths
            assert world.router.urls() == [world.engine.lifecycle_state()["url"]]  # still in: stalled
        finally:
            gate.set()
            thread.join(10)
            del world.router.stalled["remove"]
        assert done == [None] and not world.errors, world.errors
        assert world.router.urls() == [] and world.engine.lifecycle.state is State.PAUSED
        assert "/release_memory_occupation" in [p for _, p, _ in world.server.requests[since:]]

    def test_the_wake_asks_the_version_while_the_memory_comes_back(self, world):
        methods = METHODS[self.framework]
        weights_pushed(world, methods)
        since = len(world.server.requests)
        done, gate = [], threading.Event()
        world.server.stalled["/resume_memory_occupation"] = gate
        thread = threading.Thread(target=lambda: done.append(methods["onload_kv"](world)), daemon=True)
        try:
            thread.start()
            _arrived(world.server, "/model_info", since=since)  # while the resume is held
            assert world.router.urls() == [] and world.server.paused
        finally:
            gate.set()
            thread.join(10)
            del world.server.stalled["/resume_memory_occupation"]
        assert done == [None] and not world.errors, world.errors
        assert world.router.urls() == [world.engine.lifecycle_state()["url"]] and not world.server.paused

    def test_a_request_routed_before_the_continue_lands_waits_for_it_and_is_served_on_the_new_version(
        self, world
    ):
        """The router puts the server back while SGLang's continue is in flight: a request it
        routes in between is held by the paused server, then served on the version just checked."""
        methods = METHODS[self.framework]
        weights_pushed(world, methods)
        done, gate, url = [], threading.Event(), world.engine.lifecycle_state()["url"]
        world.server.stalled["/continue_generation"] = gate
        thread = threading.Thread(target=lambda: done.append(methods["onload_kv"](world)), daemon=True)
        try:
            thread.start()
            assert _eventually(lambda: world.router.urls() == [url]), "the router waited for the continue"
            assert world.server.paused
            methods["generate"](world)  # routed to the paused server: held there
        finally:
            gate.set()
            thread.join(10)
            del world.server.stalled["/continue_generation"]
        for held in world.threads:
            held.join(10)
        assert done == [None] and not world.errors, world.errors
        generated = [s for s in world.server.served if s["path"] == "/generate"]
        assert generated and all(s["ok"] for s in generated) and check(world) is None

    def test_a_continue_that_fails_leaves_the_server_out_of_the_router(self, world):
        methods = METHODS[self.framework]
        weights_pushed(world, methods)
        world.server.fail_next["/continue_generation"] = (500, {"error": {"message": "boom"}})
        with pytest.raises(LifecycleError):
            methods["onload_kv"](world)
        assert world.engine.lifecycle.state is State.FAILED and world.router.urls() == []
        assert world.engine.lifecycle_recover("AWAKE")["admitted"]
        assert world.router.urls() and check(world) is None

    def test_a_router_that_refuses_the_server_back_fails_the_wake_typed(self, world):
        from actor_integration.errors import RouterError

        methods = METHODS[self.framework]
        weights_pushed(world, methods)
        world.router.fail_next["add"] = (503, {"error": "router shutting down"})
        with pytest.raises(RouterError, match=r"answered POST /workers .* with 503"):
            world.engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
        state = world.engine.lifecycle_state()
        assert state["state"] == State.FAILED.value and not state["admitted"]

    def test_a_cycle_reuses_its_connections_and_a_single_node_engine_publishes_nothing(self, world):
        """Kept-alive connections: three cycles of the driver's loop open at most two to the server
        (the version query runs beside the resume) and one to the router, where urllib opened one
        per request; no follower, so nothing is written for followers to read."""
        methods = METHODS[self.framework]
        for _ in range(3):
            weights_pushed(world, methods)
            methods["onload_kv"](world)
        assert not world.errors and check(world) is None, world.errors
        engine = world.engine
        assert engine._lc_state.client._http.opened <= 2
        assert engine._lc_state.router._http.opened == 1
        assert engine._lc_state.key not in LocalDirectory.entries

    # ------------------------------------------------------------------ a router that cannot remove a worker

    def test_behind_a_router_that_cannot_remove_a_worker_requests_wait_on_the_pause(self, env, miles_router):
        """miles' own router has no route that removes a worker: the server joins it once the first
        version is whole and awake, and stays in it. A request routed to it while it sleeps waits on
        SGLang's pause and is served after the wake, on the new version; then five cycles with
        requests sent all along: every one served (none refused), each on the current version whole."""
        world = env.world(router=miles_router)
        methods, url = METHODS[self.framework], world.engine.lifecycle_state()["url"]
        assert miles_router.urls() == [url]
        methods["offload"](world)
        assert miles_router.urls() == [url] and world.server.paused
        assert world.engine.lifecycle.state is State.PAUSED
        served = len(world.server.served)
        methods["generate"](world)  # routed to the sleeping server: held by the pause
        assert world.threads and len(world.server.served) == served
        methods["onload_weights"](world)
        rollout_calls.update_weights(world)
        assert len(world.server.served) == served  # still held: the version is in, the KV cache is not
        methods["onload_kv"](world)
        for held in world.threads:
            held.join(10)
        generated = [s for s in world.server.served if s["path"] == "/generate"]
        assert len(world.server.served) == served + 1 and generated[-1]["current"] == "2"
        answers = cycles_with_requests_all_along(world, methods)
        generated = [s for s in world.server.served if s["path"] == "/generate"]
        print(
            f"\nbehind a router that cannot remove a worker: {len(answers)} requests, {answers.count(200)} served"
        )
        assert check(world) is None and not world.errors, world.errors
        assert answers and set(answers) == {200} and all(s["ok"] for s in generated)

    def test_no_sequence_breaks_behind_a_router_that_cannot_remove_a_worker(self, env, miles_router):
        """Every sequence up to the wrapped depth: no damage, and no call refused that sglang_router's
        worker API would let through (a sleep that failed at the router would be one)."""
        behind = explore(
            env.fresh(wrapped=True, router=miles_router), METHODS[self.framework], WRAPPED_DEPTH, check
        )
        usual = explore(env.fresh(wrapped=True), METHODS[self.framework], WRAPPED_DEPTH, check)
        print(f"\nbehind miles' router, up to length {WRAPPED_DEPTH}:\n{render(self.framework, behind)}")
        assert behind.violations == 0, render(self.framework, behind)
        assert (behind.sequences, behind.refusals) == (usual.sequences, usual.refusals)

    def test_a_shutdown_kills_the_server_and_closes_the_wraps_own_thread_and_connections(
        self, env, miles_router
    ):
        """The rollout manager's `shutdown` before its `ray.kill`: the server killed, out of the
        router, and the wrap's helper thread and kept-alive connections closed. Behind a router that
        cannot remove a worker too (the framework's own removal request goes nowhere there)."""
        for router in (env.router, miles_router):
            world = env.world(router=router)
            engine, server, url = world.engine, world.server, world.engine.lifecycle_state()["url"]
            connections = [engine._lc_state.client._http, engine._lc_state.router._http]
            helper = engine._lc_state.helper  # the wake's version query ran there
            assert engine.shutdown() is None and not server.alive
            if router is env.router:
                assert url not in router.urls()  # the framework's own removal
            with pytest.raises(RuntimeError, match="after shutdown"):
                helper.submit(print)
            assert engine._lc_state.helper is None and all(not c._idle for c in connections)

    # ------------------------------------------------------------------ refusals and idempotency

    def test_release_and_resume_are_idempotent(self, world):
        methods = METHODS[self.framework]
        for name in ("offload", "offload", "onload_weights", "onload_weights"):
            methods[name](world)
        assert world.server.alive and not world.errors
        calls = [p for _, p, _ in world.server.requests if "memory_occupation" in p]
        assert calls[-2:] == ["/release_memory_occupation", "/resume_memory_occupation"]

    def test_a_push_into_released_weights_is_refused_naming_the_state_and_the_way_out(self, world):
        METHODS[self.framework]["offload"](world)
        with pytest.raises(IllegalTransitionError) as refused:
            world.engine.update_weights_from_tensor([encode_names(["embed"])], weight_version="9")
        assert refused.value.fields["state"] is State.PAUSED
        assert "resume_memory_occupation(tags=['weights'])" in str(refused.value)
        assert world.server.alive and world.server.labels["embed"] == "garbage"

    # ------------------------------------------------------------------ faults

    def test_a_killed_server_is_a_typed_error_naming_it_within_the_deadline(self, world):
        world.server.close(wait=True)  # the server process killed
        url = world.engine.lifecycle_state()["url"]
        start = time.monotonic()
        with pytest.raises(SGLangServerError) as dead:
            world.engine.release_memory_occupation()
        assert time.monotonic() - start < 5 and url in str(dead.value)
        assert world.engine.lifecycle.state is State.FAILED
        assert world.router.urls() == []  # the router told
        with pytest.raises(LifecycleError):  # the health monitor is told: unhealthy, restart it
            world.engine.health_generate(timeout=1.0)

    def test_a_refused_update_leaves_the_weights_unknown_and_the_server_out(self, world):
        methods = METHODS[self.framework]
        methods["offload"](world)
        methods["onload_weights"](world)
        world.server.refuse_weights = "Failed to update weights: shape mismatch"
        rollout_calls.update_weights(world)  # the framework's own call raises; recorded
        assert any("update_weights_from_tensor" in e for e in world.errors)
        assert world.engine.lifecycle.contents["weights"] is Contents.UNKNOWN
        methods["onload_kv"](world)
        assert world.router.urls() == []
        world.server.refuse_weights = None
        rollout_calls.update_weights(world)
        assert world.router.urls() and check(world) is None

    def test_a_failing_release_leaves_the_engine_failed_and_unhealthy(self, world):
        world.server.fail_next["/release_memory_occupation"] = (500, {"error": {"message": "boom"}})
        with pytest.raises(SGLangServerError):
            world.engine.release_memory_occupation()
        lifecycle = world.engine.lifecycle
        assert lifecycle.state is State.FAILED and Residency.UNKNOWN in lifecycle.residency.values()
        with pytest.raises(LifecycleError):
            world.engine.health_generate(timeout=1.0)
        assert world.router.urls() == [] and world.server.alive

    def test_a_release_on_a_hung_server_times_out_typed_releases_nothing_and_recovers_in_place(self, world):
        """The server's schedulers hang (on the H200: their processes stopped) after a sync through
        the lifecycle's sender: the offload's first request to them (closing the trainer buffers
        they hold) gets no answer. One typed timeout naming the server, on that request, nothing
        more sent to the schedulers and nothing released; the server out of the router and
        unhealthy; once the schedulers run again, `lifecycle_recover()` puts it back in the router,
        generating, with no restart."""
        import torch

        from actor_integration.errors import SGLangServerTimeout
        from tests.helpers.weight_sync_doubles import shm_sender

        methods, engine = METHODS[self.framework], world.engine
        engine.lifecycle_serialize_names = lambda: encode_names  # no sglang here: the fake's encoding
        sender = shm_sender(engine.lifecycle_update_weights, bucket_bytes=1 << 11, deadline_s=10)
        try:
            methods["offload"](world)
            methods["onload_weights"](world)
            world.server.trainer_version = "7"
            sender.send(7, [("embed", torch.ones(48, 8)), ("lm_head", torch.ones(48, 8))])
            methods["onload_kv"](world)
        finally:
            sender.close()
        url = engine.lifecycle_state()["url"]
        assert world.router.urls() == [url]
        clients = [engine._lc_state.client, engine._lc_state.receiver_client]
        sent_before = len(world.server.requests)
        with hung_schedulers(world, ("/update_weights_from_tensor", "/flush_cache"), clients):
            with pytest.raises(SGLangServerTimeout) as timed_out:
                methods["offload"](world)
            lifecycle = engine.lifecycle
            assert lifecycle.state is State.FAILED and url in str(timed_out.value)
            assert timed_out.value.fields["path"] == "/update_weights_from_tensor"  # the close, not the flush
            assert set(lifecycle.residency.values()) == {Residency.RESIDENT} and not world.server.released
            assert world.router.urls() == []
            with pytest.raises(LifecycleError):
                engine.health_generate(timeout=1.0)
        sent = [path for _, path, _ in world.server.requests[sent_before:]]
        assert "/flush_cache" not in sent and "/pause_generation" not in sent, sent
        assert engine.lifecycle_recover("AWAKE")["state"] == State.AWAKE.value
        assert world.router.urls() == [url]
        reply = generate_through_router(world)
        assert reply.status_code == 200 and check(world) is None, reply.text

    def test_a_flush_that_hangs_after_the_pause_is_continued_by_the_recovering_wake(self, world):
        """SGLang took the sleep's pause, then its flush got no answer (no trainer buffers to close
        first): a typed timeout, nothing released; `lifecycle_recover()` must continue the paused
        generation before the server rejoins the router, or every request it is sent waits."""
        from actor_integration.errors import SGLangServerTimeout

        with hung_schedulers(world, ("/flush_cache",), [world.engine._lc_state.client]):
            with pytest.raises(SGLangServerTimeout) as timed_out:
                METHODS[self.framework]["offload"](world)
            assert timed_out.value.fields["path"] == "/flush_cache" and world.server.paused
            assert set(world.engine.lifecycle.residency.values()) == {Residency.RESIDENT}
        assert world.engine.lifecycle_recover("AWAKE")["state"] == State.AWAKE.value
        assert not world.server.paused and world.router.urls()
        reply = generate_through_router(world)
        assert reply.status_code == 200 and check(world) is None, reply.text

    # ------------------------------------------------------------------ followers and slots

    def test_a_follower_follows_node_0_instead_of_answering_none(self, env):
        args = engine_args(self.framework, router=env.router, rollout_num_gpus_per_engine=2)
        address = f"127.0.0.1:{free_port()}"
        LocalDirectory.entries.clear()
        leader = start_engine(env.wrapped, args, rank=0, router=env.router, dist_init_addr=address)
        follower = start_engine(env.wrapped, args, rank=1, router=env.router, dist_init_addr=address)
        plain = start_engine(
            env.plain, args, rank=1, router=env.router, dist_init_addr=f"127.0.0.1:{free_port()}"
        )
        assert (leader.node_rank, follower.node_rank) == (0, 1)
        assert plain.release_memory_occupation() is None  # plain: success for a request never sent
        done = []
        thread = threading.Thread(
            target=lambda: done.append(follower.release_memory_occupation()), daemon=True
        )
        thread.start()
        time.sleep(0.1)
        assert not done  # waits for node 0's release
        leader.release_memory_occupation()
        thread.join(10)
        assert done == [None] and follower.lifecycle_state()["state"] == State.PAUSED.value
        assert follower.health_generate(timeout=2.0) is True
        with pytest.raises(FollowerCallError):
            follower.update_weights_from_tensor([encode_names(["embed"])], weight_version="2")
        follower.lifecycle_follow_deadline_s = 0.2  # type: ignore[misc]
        with pytest.raises(FollowerCallError, match="did not show"):
            follower.resume_memory_occupation(tags=["weights"])  # node 0 never resumed

    # ------------------------------------------------------------------ the wire and the logs

    def test_every_request_matches_the_pinned_servers_routes_and_structs(self, env, world):
        methods = METHODS[self.framework]
        for name in methods:
            if name != "recover":
                with contextlib.suppress(LifecycleError):
                    methods[name](world)
        requests = [r for server in world.servers for r in server.requests]
        problems = [request_problem(env.tree, m, p, b) for m, p, b in requests]
        assert len(requests) > 20 and not [p for p in problems if p], problems

    def test_each_engine_writes_its_json_lifecycle_log(self, env, tmp_path, monkeypatch):
        """Unless the process configured its logging: the tests' conftest did, so it is reset here."""
        import io

        import lifecycle
        from lifecycle.events import reset_logging

        monkeypatch.setenv("RL_LIFECYCLE_LOG_DIR", str(tmp_path))
        reset_logging()
        try:
            world = env.world()
            methods = METHODS[self.framework]
            for name in ("offload", "offload", "onload_weights", "update_weights", "onload_kv", "health"):
                methods[name](world)
            path = Path(world.engine.lifecycle_log_path())
            world.close()
        finally:
            reset_logging()
            lifecycle.configure_logging(stream=io.StringIO(), level="warning")
        assert path.parent == tmp_path
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        names = [e["event"] for e in events]
        assert "lifecycle.noop" in names  # the second offload
        assert [e["action"] for e in events if e["event"] == "rollout.router"] == ["joined", "left", "joined"]
        assert check_files([path]) == []  # the log checker replays it against the table: clean
        assert path.name == "rollout-rank0.jsonl"
        events = [json.loads(line)["event"] for line in path.read_text().splitlines() if line.strip()]
        assert "lifecycle.transition" in events and "rollout.router" in events

    # ------------------------------------------------------------------ the framework's own launch

    def test_the_frameworks_own_launch_spawns_the_server_the_wrap_drives(self, env):
        """`launch="spawn"`: the framework's `launch_server_process` spawns SGLang's `launch_server`
        (the fake's) in a child process and waits for `/health_generate`; one cycle over HTTP to that
        process, then the process killed: a typed error naming the server process, at once (the wrap
        watches the process it launched: `EngineDiedError`, also what the rollout manager's watch hears)."""
        if self.source is None:
            pytest.skip("the shaped class has no launch_server_process of its own")
        import os
        import signal

        from tests.helpers.sglang_server import fake_state

        with installed(
            self.framework,
            self.source,
            server_fields=env.tree.server_args_fields(),
            version=self.version,
            launch="spawn",
        ) as (module, _launched):
            cls = importlib.import_module(
                f"actor_integration.frameworks.{self.framework}.rollout"
            ).lifecycle_engine(module.SGLangEngine)
            args = engine_args(self.framework, router=env.router)
            engine = start_engine(cls, args, router=env.router)
            url = engine.lifecycle_state()["url"]
            try:
                engine.release_memory_occupation()
                engine.release_memory_occupation()
                engine.resume_memory_occupation(tags=["weights"])
                world = rollout_calls.World(
                    self.framework, cls, None, env.router, args, version=0, engine=engine
                )
                rollout_calls.update_weights(world)
                engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
                state = fake_state(url)
                assert state["alive"] and not state["deaths"] and not world.errors, (
                    state["deaths"],
                    world.errors,
                )
                assert state["labels"] == dict.fromkeys(state["labels"], "1") and url in env.router.urls()
                pid = engine.process.pid
                os.kill(pid, signal.SIGKILL)
                engine.process.join(10)
                start = time.monotonic()
                with pytest.raises(EngineDiedError, match=url) as died:
                    engine.release_memory_occupation()
                assert time.monotonic() - start < 5
                assert (died.value.fields["process"], died.value.fields["pid"]) == ("server", pid)
                assert died.value.fields["exitcode"] == -signal.SIGKILL
                assert engine.lifecycle_check_server()["pid"] == pid  # what the rollout manager's watch hears
                assert url not in env.router.urls()  # taken out of the router
                state = engine.lifecycle_state()  # the death is in the snapshot the driver reads
                assert state["server_died"]["pid"] == pid and state["server_died"]["url"] == url
                with pytest.raises(EngineDiedError):  # nothing to recover on a dead server
                    engine.lifecycle_recover("AWAKE")
            finally:
                if engine.process.is_alive():
                    engine.process.kill()

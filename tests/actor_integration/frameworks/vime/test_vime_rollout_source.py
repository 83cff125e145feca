"""vime's own `VLLMEngine` (the rollout half), plain and under `VimeRolloutMixin`, from vime's source.

Each engine launches a `FakeVLLMServer` (vLLM 0.26.0's routes, answering and dying as it does) and
registers with a fake vllm-router, over real HTTP on localhost; the calls are the ones vime's own
rollout manager and trainer make (tests/helpers/vime_rollout.py). The model check runs every
sequence of those calls after start-up on a fresh engine: plain vime breaks in the listed ways,
the wrapped engine in none (a call the lifecycle refuses with a typed error is not a break).
vime #57's failures at the engine are tests here: a second start, and an update while asleep.
Needs vime's source folder (RL_LIFECYCLE_VIME_SOURCE, tests/helpers/vime_manifest.json); skips without it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from actor_integration.errors import (
    DuplicateWeightUpdateStartError,
    MemoryStateError,
    RouterError,
    VLLMServerError,
    WeightUpdateNotStartedError,
)
from lifecycle import Contents, Residency, State
from lifecycle.errors import IllegalTransitionError, LifecycleError
from tests.helpers import vime_rollout as calls
from tests.helpers.framework_source import suite_source
from tests.helpers.method_sequences import explore, render
from tests.helpers.sglang_server import FakeRouter
from tests.helpers.slime_source import LocalActor
from tests.helpers.spawn import no_crash, run_world
from tests.helpers.vime_rollout import GARBAGE, KILLERS, METHODS, STALE, check, installed
from tests.helpers.vime_source import VimeSource

SOURCE: VimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(VimeSource, "vime's")

PLAIN_DEPTH = 3
WRAPPED_DEPTH = 2
SLOW_WRAPPED_DEPTH = 3
SEGFAULT, ILLEGAL = KILLERS["segfault"], KILLERS["generate with"]

# What the search of the job's calls finds on plain vime: per kind of damage and call, the shortest
# sequence after start-up (test_plain_vime_breaks_in_exactly_the_listed_ways holds it exact).
REPRODUCTIONS = (
    (("offload", "generate"), ILLEGAL),  # vime leaves a sleeping server in the router
    (("offload", "start", "update"), SEGFAULT),  # vime #57's update while asleep; vLLM accepts the start
    (("start", "update", "generate"), STALE),  # a request served between the chunks and the finish
)


class Env:
    def __init__(self, module: Any, group: Any, launched: calls.Launched, router: FakeRouter) -> None:
        from actor_integration.frameworks.vime.rollout import lifecycle_engine

        self.module, self.group, self.launched, self.router = module, group, launched, router
        self.plain = module.VLLMEngine
        self.wrapped = lifecycle_engine(module.VLLMEngine)

    def reset(self) -> None:
        """The last job ended: its servers gone, the router empty."""
        self.launched.close()
        self.launched.server_args.clear()
        with self.router.lock:
            self.router.workers.clear()
            self.router.calls.clear()

    def world(self, wrapped: bool = True, **overrides: Any) -> calls.World:
        self.reset()
        return calls.started(self.wrapped if wrapped else self.plain, self.launched, self.router, **overrides)

    def fresh(self, wrapped: bool) -> Any:
        return lambda: self.world(wrapped)


@pytest.fixture(scope="module")
def env():
    from tests.helpers.vllm_source import open_tree

    assert SOURCE is not None
    tree = open_tree()
    router = FakeRouter()
    with installed(SOURCE, tree) as (module, group, launched):
        env = Env(module, group, launched, router)
        yield env
        env.reset()
    router.close()
    tree.close()


@pytest.fixture
def world(env):
    return env.world()


# ---------------------------------------------------------------------------------------------- the model check


def test_plain_vime_breaks_in_exactly_the_listed_ways(env):
    search = explore(env.fresh(wrapped=False), METHODS, PLAIN_DEPTH, check)
    print(f"\nplain vime, every sequence of the job's calls after start-up up to length {PLAIN_DEPTH}:")
    print(render("vime (VLLMEngine)", search))
    found = {(finding.sequence, finding.kind) for finding in search.shortest.values()}
    assert found == set(REPRODUCTIONS)
    # A sequence that broke is not extended. A level-2 offload after a start fails in vLLM itself (its
    # start put the layers on the meta device: seen on an H100), so start → offload → generate and
    # start → offload → update end there.
    assert (search.sequences, search.violations) == (810, 19)


def test_each_reproduction_breaks_plain_and_runs_clean_wrapped(env):
    for sequence, kind in REPRODUCTIONS:
        for wrapped in (False, True):
            world = env.world(wrapped)
            for name in sequence:
                with contextlib.suppress(LifecycleError):  # refused, typed: the engine is as it was
                    METHODS[name](world)
            found = check(world)
            if wrapped:
                assert found is None and world.fake.dead is None, (sequence, found)
            else:
                assert found == kind, (sequence, found)


def test_no_sequence_breaks_under_the_wrap(env):
    search = explore(env.fresh(wrapped=True), METHODS, WRAPPED_DEPTH, check)
    print(f"\nunder the wrap, up to length {WRAPPED_DEPTH}:\n{render('vime (LifecycleVLLMEngine)', search)}")
    assert search.violations == 0, render("wrapped", search)
    assert search.sequences == len(METHODS) + len(METHODS) ** 2


@pytest.mark.slow
def test_no_longer_sequence_breaks_under_the_wrap(env):
    search = explore(env.fresh(wrapped=True), METHODS, SLOW_WRAPPED_DEPTH, check)
    print(
        f"\nunder the wrap, up to length {SLOW_WRAPPED_DEPTH}:\n{render('vime (LifecycleVLLMEngine)', search)}"
    )
    assert search.violations == 0, render("wrapped", search)
    assert search.sequences == sum(len(METHODS) ** n for n in range(1, SLOW_WRAPPED_DEPTH + 1))


# ---------------------------------------------------------------------------------------------- sleep and wake


def _rollout_server(env: Env, world: calls.World, *, update_weights: bool) -> Any:
    """vime's own RolloutServer over this world's engine (one group, colocated: it offloads)."""
    group = env.group.ServerGroup(
        args=world.args,
        pg=None,
        all_engines=[LocalActor(world.engine)],
        num_gpus_per_engine=1,
        num_new_engines=0,
        needs_offload=True,
    )
    return env.group.RolloutServer(server_groups=[group], update_weights=update_weights)


def test_the_offload_sleeps_at_the_level_vimes_rollout_server_picks(env):
    """engine_group.py: level 2 when the trainer updates the model, 1 when it does not."""
    for update_weights, level in ((True, 2), (False, 1)):
        world = env.world()
        since = len(world.server.requests)
        _rollout_server(env, world, update_weights=update_weights).offload()
        assert f"POST /sleep?level={level}&mode=abort" in world.server.requests[since:]
        assert world.fake.level == level and world.fake.sleeping_tags == {"weights", "kv_cache"}
        assert world.engine.lifecycle.residency == dict.fromkeys(("weights", "kv_cache"), Residency.RELEASED)


def test_a_level_1_sleep_keeps_the_version_and_the_wake_serves_it_without_a_push(env):
    world = env.world()
    url = world.engine.lifecycle_state()["url"]
    server = _rollout_server(env, world, update_weights=False)
    server.offload()
    assert world.router.urls() == []
    server.onload_weights()
    assert world.engine.lifecycle.contents["weights"] is Contents.VALID and world.router.urls() == []
    server.onload_kv()
    assert world.router.urls() == [url] and world.engine.lifecycle_state()["served_version"] == "1"
    calls.generate(world)
    assert check(world) is None and world.fake.served


def test_a_level_2_wake_without_a_push_keeps_the_server_out_where_plain_vime_serves_discarded_weights(env):
    for wrapped in (False, True):
        world = env.world(wrapped)
        for name in ("offload", "onload_weights", "onload_kv", "generate"):
            METHODS[name](world)
        if wrapped:
            assert check(world) is None and world.router.urls() == [] and not world.fake.served
            assert world.engine.lifecycle.contents["weights"] is Contents.DISCARDED
        else:
            assert check(world) == GARBAGE


def test_the_wrapped_offload_is_one_sleep_request_that_aborts_what_runs(world):
    """vLLM's /sleep pauses its scheduler in the mode given and clears its caches before it releases:
    the wrap's sleep sends it alone, in abort mode (no /pause, which waits 20 ms by design, and no
    /reset_prefix_cache), even after the trainer paused in place, and what ran is aborted, not kept
    over the released KV cache."""
    world.engine.pause_generation(mode="in_place")
    world.engine.continue_generation()
    world.fake.unfinished = 2  # requests running on the server
    since = len(world.server.requests)
    METHODS["offload"](world)
    assert world.server.requests[since:] == ["POST /sleep?level=2&mode=abort"]
    assert world.fake.unfinished == 0 and world.fake.dead is None and world.router.urls() == []


def test_onload_kv_wakes_the_kv_cache_and_a_second_sleep_or_wake_sends_nothing(world):
    since = len(world.server.requests)
    METHODS["offload"](world)
    METHODS["offload"](world)
    assert [r for r in world.server.requests[since:] if r.startswith("POST /sleep")] == [
        "POST /sleep?level=2&mode=abort"
    ]
    METHODS["onload_kv"](world)
    assert world.server.requests[-1] == "POST /wake_up?tags=kv_cache"  # cuda_graph dropped, as vime does
    since = len(world.server.requests)
    METHODS["onload_kv"](world)  # awake already: a logged no-op
    assert world.server.requests[since:] == []
    assert world.fake.sleeping_tags == {"weights"} and not world.fake.warnings


def test_a_sleep_while_one_tag_sleeps_or_at_a_level_vllm_lacks_is_refused_before_anything_is_sent(world):
    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    since = len(world.server.requests)
    with pytest.raises(MemoryStateError, match="still asleep"):  # vLLM would ignore it: "already sleeping"
        world.engine.release_memory_occupation(level=2)
    with pytest.raises(ValueError, match="sleep_level must be 1"):
        world.engine.release_memory_occupation(level=0)
    assert world.server.requests[since:] == [] and world.engine.lifecycle.state is not State.FAILED


# ---------------------------------------------------------------------------------------------- pause and continue


def test_the_trainers_pause_and_continue_reach_vllm_as_vime_sends_them(world):
    since = len(world.server.requests)
    world.engine.pause_generation(mode="in_place")
    world.engine.pause_generation(mode="abort")
    assert world.server.requests[since:] == [
        "POST /pause?mode=keep&clear_cache=false",
        "POST /pause?mode=abort&clear_cache=false",
    ]
    assert world.fake.paused
    world.engine.continue_generation()
    assert world.server.requests[-1] == "POST /resume" and not world.fake.paused


def test_the_sleeps_pause_absorbs_the_trainers(world):
    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    since = len(world.server.requests)
    assert world.engine.pause_generation(mode="in_place") is None
    assert world.server.requests[since:] == []


# ---------------------------------------------------------------------------------------------- the weight update


def _on_plain(env: Env, *steps: Any) -> calls.World:
    """A plain vime world after `steps` (vime's own exceptions recorded in its `errors`)."""
    plain = env.world(wrapped=False)
    for step in steps:
        step(plain)
    return plain


def test_start_update_finish_is_one_sync_operation(world):
    engine, url = world.engine, world.engine.lifecycle_state()["url"]
    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    calls.pause(world)
    calls.start(world)
    assert engine.lifecycle.contents["weights"] is Contents.UNKNOWN
    assert engine.lifecycle_state()["weight_update"] == "start_weight_update"
    calls.update(world)
    assert engine.lifecycle.contents["weights"] is Contents.UNKNOWN
    calls.finish(world)
    state = engine.lifecycle_state()
    assert (state["contents"]["weights"], state["weight_version"], state["served_version"]) == (
        "valid",
        2,
        "2",
    )
    assert state["weight_update"] is None and world.router.urls() == []  # the KV cache still sleeps
    assert engine.continue_generation() is None and world.router.urls() == []
    METHODS["onload_kv"](world)
    assert world.router.urls() == [url]
    calls.generate(world)
    assert check(world) is None and world.fake.served and not world.errors


def test_a_second_start_is_refused_typed_before_vllm_where_plain_vime_gets_vllms_500(env):
    plain = _on_plain(env, calls.start, calls.start)
    assert plain.errors and "HTTPError: 500" in plain.errors[-1] and plain.fake.dead is None
    world = env.world()
    calls.start(world)
    since = len(world.server.requests)
    for second in (world.engine.start_weight_update, world.engine.start_draft_weight_update):
        with pytest.raises(DuplicateWeightUpdateStartError) as refused:
            second()
        assert refused.value.fields["open"] == "start_weight_update"
    assert world.server.requests[since:] == [] and world.fake.update_active and world.fake.dead is None
    calls.update(world)
    calls.finish(world)
    calls.resume(world)
    calls.generate(world)
    assert check(world) is None and world.fake.served and not world.errors


def test_an_update_or_a_finish_with_no_start_is_refused_typed_before_vllm(env):
    plain = _on_plain(env, calls.update, calls.finish)
    assert len(plain.errors) == 3 and all("HTTPError: 500" in e for e in plain.errors)
    world = env.world()
    since = len(world.server.requests)
    with pytest.raises(WeightUpdateNotStartedError):
        world.engine.update_weights(calls.update_info(world, calls.CHUNKS[0], 2))
    with pytest.raises(WeightUpdateNotStartedError):
        world.engine.finish_weight_update(weight_version="2")
    assert world.server.requests[since:] == [] and world.fake.dead is None
    assert world.engine.lifecycle.contents["weights"] is Contents.VALID and world.router.urls()


def test_an_update_into_sleeping_weights_is_refused_where_plain_vime_hangs_on_a_dead_engine(env):
    """vime #57's update while asleep: vLLM accepts the start, and the chunk segfaults its EngineCore;
    the server stays up and vime's request (no timeout) never returns (vllm #57853)."""
    env.launched.options["hangs_on_death"] = True
    try:
        plain = env.world(wrapped=False)
        METHODS["offload"](plain)
        calls.start(plain)
        sending = threading.Thread(target=calls.update, args=(plain,), daemon=True)
        sending.start()
        sending.join(1.0)
        assert sending.is_alive() and plain.fake.dead and plain.server.hung == ["POST /update_weights"]
        plain.server.close()  # the job gives up on it
        sending.join(10)
        assert not sending.is_alive() and check(plain) == SEGFAULT
        world = env.world()
        METHODS["offload"](world)
        since = len(world.server.requests)
        with pytest.raises(IllegalTransitionError) as refused:
            world.engine.start_weight_update()
        assert refused.value.fields["state"] is State.PAUSED
        assert "resume_memory_occupation(tags=['weights'])" in str(refused.value)
        with pytest.raises(WeightUpdateNotStartedError):
            world.engine.update_weights(calls.update_info(world, calls.CHUNKS[0], 2))
        assert world.server.requests[since:] == [] and world.fake.dead is None
    finally:
        env.launched.options.pop("hangs_on_death", None)


def test_a_sleep_while_an_update_is_open_is_refused_and_a_continue_keeps_generation_paused(world):
    calls.pause(world)
    calls.start(world)
    since = len(world.server.requests)
    with pytest.raises(MemoryStateError, match="has not finished"):
        world.engine.release_memory_occupation(level=2)
    assert world.engine.continue_generation() is None and world.fake.paused
    assert world.server.requests[since:] == []
    calls.update(world)
    calls.finish(world)
    calls.resume(world)
    assert not world.fake.paused and world.engine.lifecycle_state()["served_version"] == "2"


def test_a_finish_with_no_chunk_loads_no_version_and_the_server_stays_out(world):
    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    calls.start(world)
    calls.finish(world)
    METHODS["onload_kv"](world)
    assert world.engine.lifecycle.contents["weights"] is Contents.UNKNOWN and world.router.urls() == []
    calls.push(world)
    assert world.router.urls() and world.engine.lifecycle_state()["served_version"] == "3"


def test_a_chunk_vllm_refuses_leaves_the_version_unknown_and_the_server_out(world):
    import requests

    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    calls.pause(world)
    calls.start(world)
    unknown_handle = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[8]]}
    with pytest.raises(requests.HTTPError):  # vime's own error: vLLM answered 500 and ended its session
        world.engine.update_weights({**unknown_handle, "ipc_handles": [{"fake-gpu": (10_000,)}]})
    with pytest.raises(requests.HTTPError):
        world.engine.finish_weight_update(weight_version="2")
    METHODS["onload_kv"](world)
    assert world.engine.lifecycle.contents["weights"] is Contents.UNKNOWN and world.router.urls() == []
    calls.push(world)
    assert world.router.urls() and check(world) is None


# ---------------------------------------------------------------------------------------------- the router


def test_out_of_the_router_before_the_sleep_and_back_only_when_a_whole_version_is_awake(world):
    url = world.engine.lifecycle_state()["url"]
    gate, since = threading.Event(), len(world.server.requests)
    world.router.stalled["remove"] = gate
    try:
        sleeping = threading.Thread(target=METHODS["offload"], args=(world,), daemon=True)
        sleeping.start()
        time.sleep(0.3)
        sent = world.server.requests[since:]
        assert not any(r.startswith("POST /sleep") for r in sent), sent  # the release waits for the router
    finally:
        gate.set()
        del world.router.stalled["remove"]
    sleeping.join(10)
    removal = [c for c in world.router.calls if c[0] == "DELETE"]
    assert [c[1] for c in removal] == [f"/workers/{url.replace(':', '%3A').replace('/', '%2F')}"]
    assert world.router.urls() == [] and world.server.requests[-1] == "POST /sleep?level=2&mode=abort"
    for name in ("onload_weights", "pause", "start", "update", "finish", "continue"):
        METHODS[name](world)
        assert world.router.urls() == [], name
    METHODS["onload_kv"](world)
    assert world.router.urls() == [url]


def test_an_offloaded_engine_joins_the_router_only_with_a_whole_version(env):
    for wrapped, offload, listed in ((False, True, True), (True, True, False), (True, False, True)):
        env.reset()
        world = calls.World(
            env.wrapped if wrapped else env.plain,
            env.launched,
            env.router,
            calls.engine_args(offload=offload),
        )
        world.start()
        assert bool(env.router.urls()) is listed, (wrapped, offload)
    world.engine.release_memory_occupation(level=2)  # wrapped, no sleep mode: still a lifecycle sleep
    assert env.router.urls() == []


def test_a_router_that_refuses_the_server_back_fails_the_wake_typed(world):
    METHODS["offload"](world)
    METHODS["onload_weights"](world)
    calls.push(world)
    world.router.fail_next["add"] = (500, {"error": "router down"})
    with pytest.raises(RouterError):
        world.engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    assert world.router.urls() == []


# ---------------------------------------------------------------------------------------------- faults and routes


def test_a_killed_server_is_a_typed_error_naming_it_and_the_engine_reports_unhealthy(world):
    world.server.close()  # the vllm serve process killed
    url = world.engine.lifecycle_state()["url"]
    start = time.monotonic()
    with pytest.raises(VLLMServerError) as dead:
        world.engine.release_memory_occupation(level=2)
    assert time.monotonic() - start < 5 and url in str(dead.value)
    assert world.engine.lifecycle.state is State.FAILED and world.router.urls() == []
    with pytest.raises(LifecycleError):  # vime's health monitor is told: unhealthy, restart it
        world.engine.health_generate(timeout=1.0)
    with pytest.raises(LifecycleError):  # a FAILED engine sleeps no more until recovered
        world.engine.release_memory_occupation(level=2)


def test_the_lifecycles_requests_are_vllm_0_26_routes_and_vimes_own_missing_route_is_named(world):
    """Every request the wrap sends is one of vLLM 0.26.0's routes; vime 8c1c944b's health check asks
    `/health_generate`, which 0.26.0 does not serve (wrapped or not: vime's own call, where servable)."""
    for name in ("offload", "onload_weights", "pause", "start", "update", "finish", "continue", "onload_kv"):
        METHODS[name](world)
    assert world.server.problems == [] and not world.errors
    import requests

    with pytest.raises(requests.HTTPError, match="404"):
        world.engine.health_generate(timeout=1.0)
    assert world.server.problems == ["vllm 0.26.0 has no route /health_generate"]
    METHODS["offload"](world)
    assert world.engine.health_generate(timeout=1.0) is True  # asleep: GET /health only
    assert world.server.requests[-1] == "GET /health"


def test_a_shutdown_takes_the_server_out_kills_it_and_closes_the_wraps_thread(world):
    url = world.engine.lifecycle_state()["url"]
    helper = world.engine._lc_state.helper
    world.engine.shutdown()
    assert url not in world.router.urls() and not world.launched.servers
    assert helper is None or world.engine._lc_state.helper is None


# ---------------------------------------------------------------------------------------------- the launch switch


def _launched_jobs(rank: int, world_size: int, store: Any, location: str) -> dict[str, Any]:
    """One job per value of `RL_LIFECYCLE_WRAP`, each on vime's modules run afresh."""
    from tests.helpers.sglang_source import SourceTree
    from tests.helpers.vllm_source import VERSION, cached_wheel, fetch_wheel

    tree = SourceTree(cached_wheel() or fetch_wheel(), VERSION)
    try:
        return {wrap: _launched_job(location, tree, wrap) for wrap in ("rollout", "trainer")}
    finally:
        tree.close()


def _launched_job(location: str, tree: Any, wrap: str) -> dict[str, Any]:
    """vime's own ServerGroup and RolloutServer under the launch switch (`RL_LIFECYCLE_WRAP`), one engine."""
    from actor_integration.frameworks.vime.launch import install_vime

    router = FakeRouter()
    out: dict[str, Any] = {}
    with installed(VimeSource(Path(location), "manifest"), tree) as (_module, group, launched):
        out["halves"] = list(install_vime({"RL_LIFECYCLE_WRAP": wrap}))
        args = calls.engine_args()
        server_group = group.ServerGroup(
            args=args,
            pg=(None, [0], [0]),
            all_engines=[None],
            num_gpus_per_engine=1,
            num_new_engines=0,
            needs_offload=True,
            router_ip=router.host,
            router_port=router.port,
        )
        server_group.start_engines()  # the engines' init ran here (Ray in this process)
        engine = server_group.all_engines[0].instance
        out["class"] = [c.__name__ for c in type(engine).__mro__[:5]]
        out["listed_at_init"] = router.urls()
        server = group.RolloutServer(server_groups=[server_group], update_weights=True)
        world = calls.World(type(engine), launched, router, args, engine=engine)
        server.offload()
        server.onload_weights()
        calls.push(world)
        server.onload_kv()
        out["listed"] = router.urls() == [engine.get_url()]
        out["state"] = engine.lifecycle_state()["state"] if hasattr(engine, "lifecycle_state") else None
        own = next(c for c in type(engine).__mro__ if c.__name__ == "VLLMEngine")
        try:
            own(args, rank=1)
            out["unwrapped"] = None
        except Exception as exc:
            out["unwrapped"] = type(exc).__name__
    router.close()
    return out


def test_the_launch_switch_puts_the_engines_vimes_group_creates_under_the_lifecycle():
    assert SOURCE is not None
    (result,) = run_world(_launched_jobs, 1, str(SOURCE.location), deadline_s=120.0)
    no_crash([result])
    rollout, trainer = result["rollout"], result["trainer"]
    assert rollout["halves"] == ["rollout"]
    # the job's class (JobLifecycle first: typed failures, RL_LIFECYCLE_FAULT) over the lifecycle class
    assert rollout["class"] == [
        "LifecycleVLLMEngine",
        "JobLifecycle",
        "LifecycleVLLMEngine",
        "VimeRolloutMixin",
        "VLLMServerActorLifecycle",
    ]
    assert rollout["listed_at_init"] == [] and rollout["listed"] and rollout["state"] == "AWAKE"
    assert rollout["unwrapped"] == "UnwrappedClassError"
    assert trainer["halves"] == ["trainer"] and trainer["class"][0] == "VLLMEngine"
    assert trainer["listed_at_init"] and trainer["unwrapped"] is None

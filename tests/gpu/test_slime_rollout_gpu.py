"""slime's own `SGLangEngine` (its source at 624b824a) under `SlimeRolloutMixin`, as slime runs it: a
Ray actor (`ray.remote(cls).options(num_gpus=0.2, runtime_env=...)`, slime's engine environment)
that launches a real SGLang 0.5.17 HTTP server (`launch_server` through slime's own
`launch_server_process`) on the GPU, behind a local router (`FakeRouter`: sglang_router is not in
the GPU machine's wheel set). The test process plays slime's trainer on the same GPU: it holds two
weight sets and pushes them slime's way (FlattenedTensorBucket over CUDA IPC through the actor's
`update_weights_from_tensor`) and, in the same run, through the lifecycle's `WeightSender`
(`lifecycle_update_weights`: the server's schedulers open the trainer's buffers themselves).
slime's unwrapped class, a second actor pointed at the same server, gives the baseline.

Run (scripts/gpu_sglang.sh sets sglang and Ray up): RL_LIFECYCLE_SLIME_SOURCE=<slime tree> \
    python -m pytest -m gpu -q -s tests/gpu/test_slime_rollout_gpu.py
`test_miles_rollout_gpu.py` runs the same tests on miles' `SGLangEngine` (its module sets FRAMEWORK;
the figures are recorded as `<framework>_rollout_*`, `own_*` being the framework's own path).
The tests share one server and run in file order; the last one kills it. The wrapped actor's
lifecycle log goes to $LIFECYCLE_GPU_OUT/rollout-logs (`lifecycle check` reads it).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gpu_results import record

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "configs" / "qwen2-0.5b"
CYCLES = int(os.environ.get("SLIME_CYCLES", "20"))
SYNC_CYCLES = int(os.environ.get("SLIME_SYNC_CYCLES", "6"))  # per path
SIDE_BY_SIDE_CYCLES = 10  # per side, in turn
SLEEP_WAKE_TARGET_MS = 3.0  # issue 48: the wrapped sleep + wake within 3 ms of the framework's own
PROFILED_SYNCS = 3  # more of ours after the timed ones, under cProfile
PROMPTS = [[11, 12, 13, 14], [100, 2000, 30000], [7] * 9, [151, 152, 153, 154, 155, 156]]
NEW_TOKENS = 16
BUCKET = 512 << 20
GIB = 1 << 30
REST = ["kv_cache", "cuda_graph"]
FRAMEWORK = "slime"  # test_miles_rollout_gpu.py runs these tests with "miles"
# What slime's ServerGroup.start_engines puts in an engine actor's environment (miles' ServerGroup
# puts the same names, with the values it reads from its own environment: these by default).
ENGINE_ENV = {
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
}


def free_gib() -> float:
    free, _total = torch.cuda.mem_get_info()
    return free / GIB


def own_push(engine: Any, named: dict[str, Any], version: int) -> float:
    """The framework's colocated push (slime's `_send_to_colocated_engine`): one FlattenedTensorBucket
    per 512 MiB of tensors, serialized with SGLang's MultiprocessingSerializer, through the engine's
    own `update_weights_from_tensor`; ms. (miles' trainer wraps the same push in a weight-update
    session, `/begin_weight_update`, which SGLang 0.5.17 has no route for: its engine is pushed to
    without one here.)"""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    chunks: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > BUCKET:
            chunks.append([])
            size = 0
        chunks[-1].append((name, tensor))
        size += nbytes
    start = time.perf_counter()
    for chunk in chunks:
        bucket = FlattenedTensorBucket(named_tensors=chunk)
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        payload = MultiprocessingSerializer.serialize(data, output_str=True)
        engine.update_weights_from_tensor(
            [payload], load_format="flattened_bucket", weight_version=str(version)
        )
        del data, bucket
    torch.cuda.ipc_collect()
    return (time.perf_counter() - start) * 1e3


def router_generate(router_url: str) -> tuple[int, Any]:
    import requests

    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
    reply = requests.post(f"{router_url}/generate", json=body, timeout=120)
    return reply.status_code, reply.json() if reply.status_code == 200 else reply.text


def tokens_of(answer: Any) -> list[list[int]]:
    return [list(out["output_ids"]) for out in answer]


def cached_tokens(answer: Any) -> int | None:
    """The prompt tokens SGLang found in its radix cache for the batch (None: it does not say)."""
    counts = [out.get("meta_info", {}).get("cached_tokens") for out in answer]
    return None if any(c is None for c in counts) else sum(counts)


def set_tokens(rig: Any, name: str, answer: Any) -> bool:
    """Whether an answer carries set `name`'s greedy tokens. The first batch after a flush is
    prefilled whole and gives the reference; a repeat of the batch finds its prompts in the radix
    cache and is prefilled from there, which in bfloat16 can change greedy tokens: it is compared
    with the set's repeat, recorded the same way (test 2)."""
    out, cached = tokens_of(answer), cached_tokens(answer)
    references = [rig["tokens"].get(name), rig["tokens_cached"].get(name)]
    if cached == 0:
        references = references[:1]
    elif cached:
        references = references[1:]
    return any(out == reference for reference in references if reference is not None)


class Remote:
    """An actor handle called like the object: `engine.flush_cache()` is `ray.get(...remote())`; an
    exception raised in the actor is raised here as itself (Ray's `RayTaskError` unwrapped)."""

    def __init__(self, handle: Any, timeout_s: float = 300.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self.handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return ray.get(method.remote(*args, **kwargs), timeout=self.timeout_s)
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, Exception):
                    raise error.cause from None
                raise

        return call


@pytest.fixture(scope="module")
def rig(request: pytest.FixtureRequest) -> Any:
    import ray

    from actor_integration.models.qwen2 import QwenConfig, QwenLM
    from tests.helpers.engine_source import engine_args
    from tests.helpers.framework_source import SourceUnavailable, free_port
    from tests.helpers.sglang_server import FakeRouter

    framework = getattr(request.module, "FRAMEWORK", FRAMEWORK)
    source = importlib.import_module(f"tests.helpers.{framework}_source")
    try:
        getattr(source, f"{framework.capitalize()}Source").find()
    except SourceUnavailable as exc:
        pytest.skip(str(exc))
    actors = importlib.import_module(f"tests.helpers.{framework}_engine_actor")
    wrapped_class = getattr(actors, f"Wrapped{framework.capitalize()}Engine")
    plain_class = getattr(actors, f"Plain{framework.capitalize()}Engine")

    torch.cuda.set_device(0)
    logs = Path(os.environ.get("LIFECYCLE_GPU_OUT", "/tmp")) / (
        "rollout-logs" if framework == "slime" else f"{framework}-rollout-logs"
    )
    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"RL_LIFECYCLE_LOG_DIR": str(logs), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        },
    )
    router = FakeRouter()
    args = engine_args(
        framework,
        router=router,
        hf_checkpoint=str(MODEL),
        sglang_load_format="dummy",
        sglang_skip_tokenizer_init=True,
        sglang_mem_fraction_static=0.2,
        sglang_attention_backend="triton",
        sglang_sampling_backend="pytorch",
        sglang_disable_cuda_graph=True,
        sglang_context_length=4096,
        sglang_dtype="bfloat16",
    )
    env = {"runtime_env": {"env_vars": ENGINE_ENV}}  # what the framework's ServerGroup passes
    handle = (
        ray.remote(wrapped_class)
        .options(num_cpus=0.2, num_gpus=0.2, **env)
        .remote(
            args, rank=0, base_gpu_id=0, sglang_overrides={"enable_metrics": False}, num_gpus_per_engine=1
        )
    )
    engine = Remote(handle)
    free_before = free_gib()
    started = time.monotonic()
    engine.init(
        dist_init_addr=f"127.0.0.1:{free_port()}",
        port=free_port(),
        nccl_port=free_port(),
        host="127.0.0.1",
        router_ip=router.host,
        router_port=router.port,
    )
    config = QwenConfig.from_json(MODEL)
    sets = {n: QwenLM(config, seed=s, device="cuda").named_weights() for n, s in (("A", 1), ("B", 2))}
    plain_handle = ray.remote(plain_class).options(num_cpus=0.2, **env).remote(args, rank=0)
    plain = Remote(plain_handle)
    plain.point_at(*engine.server_address())
    rig = {
        "framework": framework,
        "engine": engine,
        "plain": plain,
        "router": router,
        "sets": sets,
        "url": engine.lifecycle_state()["url"],
        "pid": engine.server_pid(),
        "logs": logs,
        "version": 0,
        "figures": {
            "server_up_s": round(time.monotonic() - started, 1),
            "server_gib": round(free_before - free_gib(), 2),
        },
        "tokens": {},  # per set: the first batch after a flush (nothing cached)
        "tokens_cached": {},  # per set: the same batch again (its prompts in the radix cache)
    }
    yield rig
    import psutil

    if psutil.pid_exists(rig["pid"]):
        with contextlib.suppress(Exception):
            engine.shutdown()
    ray.shutdown()
    router.close()


def timed_cycle(actor: Any, named: dict[str, Any], version: int) -> dict[str, float]:
    """The rollout manager's and trainer's calls on `actor` (the plain class or the wrapped one),
    timed: offload, onload_weights, the trainer's pause, flush, push and continue (on the wrapped
    engine absorbed: the server continues at the end of onload_kv), onload_kv."""
    t0 = time.perf_counter()
    actor.release_memory_occupation()
    t1 = time.perf_counter()
    actor.resume_memory_occupation(tags=["weights"])
    t2 = time.perf_counter()
    actor.pause_generation()
    actor.flush_cache()
    push = own_push(actor, named, version)
    t25 = time.perf_counter()
    actor.continue_generation()
    t3 = time.perf_counter()
    actor.resume_memory_occupation(tags=REST)
    t4 = time.perf_counter()
    return {
        "release_ms": (t1 - t0) * 1e3,
        "resume_weights_ms": (t2 - t1) * 1e3,
        "resume_kv_ms": (t4 - t3) * 1e3,
        "push_ms": push,
        "continue_ms": (t3 - t25) * 1e3,
    }


def test_1_the_frameworks_own_calls_on_the_server(rig: Any) -> None:
    """The framework's class, plain, on the same server: offload → onload_weights → push → onload_kv,
    timed (the baseline)."""
    plain, sets = rig["plain"], rig["sets"]
    plain.time_http_requests()
    rows = [timed_cycle(plain, sets["A" if cycle % 2 else "B"], 1000 + cycle) for cycle in range(6)]
    figures: dict[str, Any] = {k: round(statistics.median(r[k] for r in rows[1:]), 2) for k in rows[0]}
    add_sleep_wake(figures)
    figures["requests"] = plain.http_request_times()  # the actor's own HTTP requests, all six cycles
    rig["figures"]["own"] = figures
    record(f"{rig['framework']}_rollout_plain", figures)


def one_cycle(rig: Any, name: str) -> dict[str, float]:
    """The rollout manager's and trainer's calls on the wrapped engine, timed, set `name` pushed as
    the next version."""
    rig["version"] += 1
    timing = timed_cycle(rig["engine"], rig["sets"][name], rig["version"])
    rig["version_set"] = {**rig.get("version_set", {}), str(rig["version"]): name}
    return timing


def add_sleep_wake(figures: dict[str, Any]) -> None:
    """The sleep + wake (release, resume of the weights, resume of the rest: the issue's measure)
    and the same with the trainer's continue_generation, which the framework sends to the server
    inside the push while the wrap sends it at the end of onload_kv."""
    figures["sleep_wake_ms"] = round(
        figures["release_ms"] + figures["resume_weights_ms"] + figures["resume_kv_ms"], 2
    )
    figures["sleep_wake_continue_ms"] = round(figures["sleep_wake_ms"] + figures["continue_ms"], 2)


def record_repeat(rig: Any, name: str, first: Any) -> None:
    """Right after the set's reference (the first batch after a flush), the same batch again: the
    set's tokens with its prompts in the radix cache."""
    assert cached_tokens(first) in (0, None), first[0].get("meta_info")
    status, again = router_generate(rig["router"].url)
    assert status == 200, again
    rig["tokens_cached"][name] = tokens_of(again)
    rig["figures"]["repeat_cached_tokens"] = cached_tokens(again)


def test_2_cycles_of_the_frameworks_sequence_under_the_wrap(rig: Any) -> None:
    """>= 20 cycles of the framework's offload / onload / update sequence, the two weight sets alternating:
    greedy tokens through the router identical whenever the same set is loaded; memory released."""
    engine, router = rig["engine"], rig["router"]
    started = time.monotonic()
    engine.time_lifecycle_requests()
    one_cycle(rig, "A")
    status, answer = router_generate(router.url)  # the first generation JIT-compiles SGLang's kernels
    assert status == 200, answer
    rig["figures"]["first_generate_s"] = round(time.monotonic() - started, 1)
    rig["tokens"]["A"] = tokens_of(answer)
    record_repeat(rig, "A", answer)
    phases, freed = [], []
    for cycle in range(CYCLES):
        name = "B" if cycle % 2 == 0 else "A"
        awake = free_gib()
        timing = one_cycle(rig, name)
        status, answer = router_generate(router.url)
        assert status == 200, (cycle, answer)
        out = tokens_of(answer)
        assert all(len(o) == NEW_TOKENS for o in out)
        assert answer[0]["meta_info"].get("weight_version", str(rig["version"])) == str(rig["version"])
        if name in rig["tokens"]:
            assert out == rig["tokens"][name], f"cycle {cycle}: set {name} generated other tokens"
        else:
            rig["tokens"][name] = out
            record_repeat(rig, name, answer)
        phases.append(timing)
        engine.release_memory_occupation()
        freed.append(free_gib() - awake)
        engine.resume_memory_occupation(tags=["weights"])
        engine.pause_generation()
        own_push(engine, rig["sets"][name], rig["version"] + 1000)  # the same set, a new version
        rig["version"] += 1000
        rig["version_set"][str(rig["version"])] = name
        engine.continue_generation()
        engine.resume_memory_occupation(tags=REST)
    assert rig["tokens"]["A"] != rig["tokens"]["B"]
    median: dict[str, Any] = {k: round(statistics.median(p[k] for p in phases), 2) for k in phases[0]}
    add_sleep_wake(median)
    figures = {
        **rig["figures"],
        "cycles": CYCLES,
        "wrapped_median": median,
        "freed_by_release_gib": round(statistics.median(freed), 2),
        "tokens_A": rig["tokens"]["A"][0],
        "tokens_B": rig["tokens"]["B"][0],
        "repeat_differs": {n: rig["tokens_cached"][n] != rig["tokens"][n] for n in rig["tokens"]},
        "repeat_cached_tokens": rig["figures"].get("repeat_cached_tokens"),
        "admitted": engine.lifecycle_state()["admitted"],
        "requests": engine.lifecycle_request_times(),  # the lifecycle's own, over every cycle of this test
    }
    own = rig["figures"].get("own")
    if own:
        for key in ("sleep_wake_ms", "sleep_wake_continue_ms"):
            figures[f"wrapped_minus_own_{key}"] = round(median[key] - own[key], 2)
    rig["figures"]["wrapped"] = median
    record(f"{rig['framework']}_rollout_cycles", figures)
    assert statistics.median(freed) > 1.0, figures


def test_2b_the_frameworks_own_cycle_and_the_wrapped_one_in_turn(rig: Any) -> None:
    """Issue 48's side-by-side: a cycle of the plain class and one of the wrapped, in turn on the same
    server (`side_by_side.alternate`), so that the machine's drift falls on both; the wrapped sleep +
    wake within 3 ms of the framework's own is a figure printed next to its target, not asserted.
    After it the wrapped engine, whose cycle ran last, serves the last set's tokens."""
    from tests.helpers.side_by_side import alternate

    sleep_wake = ("release_ms", "resume_weights_ms", "resume_kv_ms")
    names = [("A", "B")[i % 2] for i in range(SIDE_BY_SIDE_CYCLES)]
    figures = alternate(
        lambda i: timed_cycle(rig["plain"], rig["sets"][names[i]], 50_000 + i),
        lambda i: one_cycle(rig, names[i]),
        SIDE_BY_SIDE_CYCLES,
        totals={"sleep_wake_ms": sleep_wake, "sleep_wake_continue_ms": (*sleep_wake, "continue_ms")},
    )
    figures["target_ms"] = SLEEP_WAKE_TARGET_MS
    figures["target_met"] = figures["wrapped_minus_own_sleep_wake_ms"] <= SLEEP_WAKE_TARGET_MS
    status, answer = router_generate(rig["router"].url)
    assert status == 200, answer
    figures["same_tokens_after"] = tokens_of(answer) == rig["tokens"][names[-1]]
    record(f"{rig['framework']}_rollout_side_by_side", figures)
    assert figures["same_tokens_after"], (names[-1], tokens_of(answer))


def test_3_the_three_killing_sequences_are_absorbed_and_the_server_lives(rig: Any) -> None:
    """As a slime or miles job makes them: a second offload; the health monitor's check and a rollout request
    through the router while released; an onload_kv on an awake server."""
    from actor_integration.engines.sglang.http import SGLangHTTPEngine

    engine, router = rig["engine"], rig["router"]
    probe = SGLangHTTPEngine(rig["url"], codec=lambda named: None, multi_dtype_buckets=False, timeout_s=30)
    engine.release_memory_occupation()
    engine.release_memory_occupation()  # plain: torch_memory_saver exits the scheduler
    healthy = engine.health_generate(timeout=5.0)  # plain: /health_generate on released memory
    status, _ = router_generate(router.url)  # plain: routed to the released server
    probe.alive()
    name = rig["version_set"][str(rig["version"])]
    one_cycle(rig, name)
    engine.resume_memory_occupation(tags=REST)  # plain: KeyError in the scheduler
    engine.resume_memory_occupation(tags=["weights"])
    probe.alive()
    status_after, answer = router_generate(router.url)
    figures = {
        "health_while_released": healthy,
        "router_while_released": status,
        "router_after": status_after,
        "same_tokens": status_after == 200 and set_tokens(rig, name, answer),
    }
    record(f"{rig['framework']}_rollout_killers", figures)
    assert healthy is True and status == 503 and figures["same_tokens"], figures


def test_4_requests_sent_all_along_are_never_served_on_released_or_stale_weights(rig: Any) -> None:
    """A client sending the rollout's requests through the router without pause across 5 cycles:
    each answer is a version loaded whole, with that version's tokens; the rest find no worker."""
    import requests

    router, stop, answers = rig["router"], threading.Event(), []

    def client() -> None:
        # The whole batch the reference tokens were generated with: greedy tokens in bfloat16 depend
        # on the batch's shape (the kernels' tiling), so another batch is compared with nothing.
        body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
        while not stop.is_set():
            try:
                reply = requests.post(f"{router.url}/generate", json=body, timeout=120)
                answers.append((reply.status_code, reply.json() if reply.status_code == 200 else None))
            except Exception as exc:
                answers.append((type(exc).__name__, None))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    for cycle in range(5):
        one_cycle(rig, "A" if cycle % 2 else "B")
        time.sleep(0.5)  # awake and in the router: the client's requests are served
    stop.set()
    thread.join(120)

    def aborted(answer: Any) -> bool:  # in flight when the sleep paused generation (abort): not served
        finish = answer[0].get("meta_info", {}).get("finish_reason")
        return isinstance(finish, dict) and finish.get("type") == "abort"

    served = [a for s, a in answers if s == 200 and not aborted(a)]
    wrong = []
    for answer in served:
        version = answer[0].get("meta_info", {}).get("weight_version")
        if version is None:  # the server does not say: the tokens must be one set's
            ok = any(set_tokens(rig, n, answer) for n in rig["tokens"])
        else:
            name = rig["version_set"].get(str(version))
            ok = name is not None and set_tokens(rig, name, answer)
        if not ok:
            out = tokens_of(answer)
            wrong.append(
                {
                    "version": version,
                    "set": rig["version_set"].get(str(version)),
                    "cached_tokens": cached_tokens(answer),
                    "tokens_of": [n for n, t in rig["tokens"].items() if t == out],
                    "repeat_tokens_of": [n for n, t in rig["tokens_cached"].items() if t == out],
                }
            )
    figures = {
        "requests": len(answers),
        "served": len(served),
        "aborted": sum(1 for s, a in answers if s == 200 and aborted(a)),
        "no_worker": sum(1 for s, _ in answers if s == 503),
        "other": sorted({str(s) for s, _ in answers} - {"200", "503"}),
        "served_cached": sum(1 for a in served if cached_tokens(a)),
        "served_wrong": len(wrong),
        "wrong": wrong[:10],
    }
    record(f"{rig['framework']}_rollout_client", figures)
    assert served and not wrong and not figures["other"], figures


def our_sender(rig: Any, corrupt_version: int | None = None) -> Any:
    """The lifecycle's sender in this (the trainer's) process, into the wrapped actor's
    `lifecycle_update_weights`; `corrupt_version`: that version's first bucket has 8 bytes flipped
    in the trainer's staging buffer after it was packed and checksummed (no resend), as a bad copy
    or a trainer bug would leave it."""
    from actor_integration.weight_sync import RankSlot, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    engine, transport = rig["engine"], CudaIpcSender(device=0)

    def engine_call(version: int, payloads: list[Any]) -> Any:
        if version == corrupt_version:
            buffer_id = payloads[0].descriptors[0].buffer_id
            staging = next(s for s in transport._staging.values() if s.buffer_id == buffer_id)
            torch.cuda.synchronize()
            staging.tensor[:8].bitwise_not_()
            torch.cuda.synchronize()
        return engine.lifecycle_update_weights(version, payloads)

    return WeightSender(
        RankSlot.single(0),
        None,
        transport,
        rank=0,
        engine_call=engine_call,
        bucket_bytes=BUCKET,
        deadline_s=600,
        corrupt_resends=0,
    )


def ray_round_trip_ms(engine: Any) -> float:
    """A call into the actor that sends nothing to the server (its lifecycle snapshot): median ms."""
    times = []
    for _ in range(10):
        start = time.perf_counter()
        engine.lifecycle_state_name()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def own_sync(engine: Any, named: dict[str, Any], version: int) -> float:
    """The framework's whole colocated sync on the engine: pause, flush, the buckets, continue; ms."""
    start = time.perf_counter()
    engine.pause_generation()
    engine.flush_cache()
    own_push(engine, named, version)
    engine.continue_generation()
    return (time.perf_counter() - start) * 1e3


def test_5_our_sender_into_the_same_server_loads_the_same_weights_no_slower_than_the_frameworks_push(
    rig: Any,
) -> None:
    """The framework's offload / onload_weights / sync / onload_kv, the sync alternating between its
    own path and the lifecycle's sender (same sets, same server): the same greedy tokens for the same
    set, the server tagged with the version; then a corrupt round refused with nothing served."""
    from actor_integration.weight_sync.wire import CorruptBucketError
    from tests.helpers.host_time import CallTimes, HostTime

    engine, router, sets = rig["engine"], rig["router"], rig["sets"]
    sender = our_sender(rig)
    # Each of our timed syncs, call by call: the transport's steps and the packer's (wall and the
    # sending thread's CPU), so a pack_ms far above its CPU names the call that waited.
    transport = sender.transport
    calls = CallTimes().wrap(transport, ["begin_round", "export", "_buffer", "_share", "ready"])
    calls.wrap(transport._packer, ["pack", "_plan"])
    calls.wrap(sender, ["_start", "_finish"])
    ours_calls: list[dict[str, Any]] = []
    ours, theirs, phases = [], [], []
    # This process's threads' CPU while each path syncs, and a profile of our sender's thread in
    # extra syncs after the timed ones: whether its pack_ms is work or waiting, and for what.
    ours_host, own_host, profiled = HostTime(), HostTime(), HostTime(profile=True)
    try:
        for cycle in range(2 * SYNC_CYCLES + PROFILED_SYNCS):
            name = "A" if cycle % 2 else "B"
            rig["version"] += 1
            version = rig["version"]
            engine.release_memory_occupation()
            engine.resume_memory_occupation(tags=["weights"])
            if cycle >= 2 * SYNC_CYCLES:
                with profiled.measure():
                    sender.send(version, sets[name].items())
                path = "ours, profiled"
            elif (cycle // 2) % 2 == 0:
                calls.take()
                with ours_host.measure():  # its /proc reads outside the time taken
                    start = time.perf_counter()
                    report = sender.send(version, sets[name].items())
                    ours.append((time.perf_counter() - start) * 1e3)
                phases.append(dict(report.phases_ms))
                ours_calls.append(calls.take())
                path = "ours"
            else:
                with own_host.measure():
                    theirs.append(own_sync(engine, sets[name], version))
                path = rig["framework"]
            engine.resume_memory_occupation(tags=REST)
            rig["version_set"][str(version)] = name
            status, answer = router_generate(router.url)
            assert status == 200, (cycle, path, answer)
            assert set_tokens(rig, name, answer), f"cycle {cycle} ({path}): set {name}, other tokens"
            assert answer[0]["meta_info"].get("weight_version") == str(version), (
                path,
                answer[0]["meta_info"],
            )
        good = rig["version"]
        corrupt = good + 1
        bad = our_sender(rig, corrupt_version=corrupt)
        engine.release_memory_occupation()
        engine.resume_memory_occupation(tags=["weights"])
        try:
            with pytest.raises(CorruptBucketError) as refused:
                bad.send(corrupt, sets["A"].items())
        finally:
            bad.close()
        engine.resume_memory_occupation(tags=REST)
        refused_state = engine.lifecycle_state()
        status_refused, _ = router_generate(router.url)
        health = engine.health_generate(timeout=5.0)
        rig["version"] = corrupt + 1
        sender.send(rig["version"], sets["A"].items())  # the way out: the version again, whole
        rig["version_set"][str(rig["version"])] = "A"
        status_after, answer = router_generate(router.url)
    finally:
        sender.close()
    figures = {
        "cycles_each": SYNC_CYCLES,
        "ours_sync_ms": round(statistics.median(ours[1:]), 2),
        "own_sync_ms": round(statistics.median(theirs[1:]), 2),
        "ours_all_ms": [round(v, 1) for v in ours],
        # the sender's: pack (and its CPU time), ready (packing and checksums), engine (acknowledgement)
        "ours_phases_ms": phases,
        "ours_calls": ours_calls,  # per timed sync: {call: calls, ms, median_ms, max_ms, cpu_ms}
        "host_during_ours": {k: v for k, v in ours_host.summary().items() if k != "profile"},
        "host_during_own": {k: v for k, v in own_host.summary().items() if k != "profile"},
        "profiled_syncs": profiled.summary(top=30),
        "ray_round_trip_ms": ray_round_trip_ms(engine),
        "own_all_ms": [round(v, 1) for v in theirs],
        "gb": round(sum(t.numel() * t.element_size() for t in sets["A"].values()) / 1e9, 3),
        "corrupt_written": refused.value.fields.get("written"),
        "after_refusal": {
            k: refused_state.get(k)
            for k in ("state", "contents", "weight_version", "weights_valid", "admitted", "served_version")
        },
        "router_after_refusal": status_refused,
        "health_after_refusal": health,
        "router_after_resend": status_after,
        "same_tokens_after_resend": status_after == 200 and set_tokens(rig, "A", answer),
    }
    record(f"{rig['framework']}_rollout_our_sender", figures)
    assert status_refused == 503 and figures["same_tokens_after_resend"], figures


def test_5b_a_request_sent_to_the_sleeping_server_waits_for_the_wake_and_the_new_version(rig: Any) -> None:
    """What miles' own router does with a sleeping server (it has no route that removes one): it
    sends the request to the server. The request waits on SGLang's pause through the release, the
    trainer's pause (absorbed by the wrap: slime's, in "abort" mode, would abort the waiting
    request), the push and the continue the wrap holds back, and is answered after the wake with
    the new version's tokens; the server lives."""
    import psutil
    import requests

    engine, answers = rig["engine"], []
    name = "B" if rig["version_set"][str(rig["version"])] == "A" else "A"

    def send() -> None:
        body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
        try:
            reply = requests.post(f"{rig['url']}/generate", json=body, timeout=120)
            answers.append((reply.status_code, reply.json() if reply.status_code == 200 else reply.text))
        except Exception as exc:
            answers.append((type(exc).__name__, str(exc)))
        answers.append(time.monotonic())

    engine.release_memory_occupation()  # offload: out of the router, paused, released
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    time.sleep(1.0)
    held_asleep = not answers
    rig["version"] += 1
    engine.resume_memory_occupation(tags=["weights"])  # onload_weights
    engine.pause_generation()
    engine.flush_cache()
    own_push(engine, rig["sets"][name], rig["version"])
    engine.continue_generation()  # held back by the wrap until the wake
    time.sleep(0.5)
    held_loaded = not answers
    woke = time.monotonic()
    engine.resume_memory_occupation(tags=REST)  # onload_kv: continue, back into the router
    rig["version_set"][str(rig["version"])] = name
    thread.join(120)
    (status, answer), answered = answers if len(answers) == 2 else (("no answer", None), None)
    figures = {
        "held_while_asleep_1s": held_asleep,
        "held_after_the_push": held_loaded,
        "status": status,
        "answered_after_wake_start_ms": None if answered is None else round((answered - woke) * 1e3, 1),
        "weight_version": answer[0].get("meta_info", {}).get("weight_version") if status == 200 else None,
        "same_tokens": status == 200 and set_tokens(rig, name, answer),
        "server_pid_alive": psutil.pid_exists(rig["pid"]),
    }
    record(f"{rig['framework']}_rollout_request_while_asleep", figures)
    assert held_asleep and held_loaded and figures["same_tokens"], figures
    assert figures["answered_after_wake_start_ms"] is not None and figures["answered_after_wake_start_ms"] > 0


def test_6_a_release_on_a_hung_server_is_a_typed_timeout_and_recovers_without_a_restart(rig: Any) -> None:
    """The server's scheduler and detokenizer stopped (SIGSTOP: a hung scheduler) while it serves:
    the rollout manager's offload gets no answer to its flush. A typed timeout naming the server
    within the actor's deadline, nothing released, the server out of the router and unhealthy to
    the health monitor; once they run again (SIGCONT), `lifecycle_recover()` puts the same server
    back in the router, generating the loaded set's tokens."""
    import psutil

    from actor_integration.errors import SGLangServerTimeout
    from lifecycle.errors import LifecycleError

    engine, router = rig["engine"], rig["router"]
    name = rig["version_set"][str(rig["version"])]
    children = psutil.Process(rig["pid"]).children(recursive=True)
    deadline = 5.0
    before = engine.set_request_timeout(deadline)
    used_before = free_gib()
    for child in children:
        child.suspend()
    try:
        start = time.monotonic()
        with pytest.raises(SGLangServerTimeout) as timed_out:
            engine.release_memory_occupation()  # offload
        waited = time.monotonic() - start
        state = engine.lifecycle_state()
        listed = rig["url"] in router.urls()
        with pytest.raises(LifecycleError):
            engine.health_generate(timeout=5.0)
        freed = free_gib() - used_before
    finally:
        for child in children:
            child.resume()
        engine.set_request_timeout(before)
    recovered = engine.lifecycle_recover("AWAKE")
    status, answer = router_generate(router.url)
    figures = {
        "stopped": sorted({c.name() for c in children}),
        "deadline_s": deadline,
        "typed_error_s": round(waited, 3),
        "error": type(timed_out.value).__name__,
        "names_the_server": rig["url"] in str(timed_out.value),
        "state": state["state"],
        "residency": state["residency"],
        "freed_gib": round(freed, 2),
        "router_lists_it_while_failed": listed,
        "after_recover": {k: recovered.get(k) for k in ("state", "admitted", "served_version")},
        "router_after": status,
        "same_tokens": status == 200 and set_tokens(rig, name, answer),
        "cached_tokens_after": cached_tokens(answer) if status == 200 else None,
    }
    record(f"{rig['framework']}_rollout_hung_release", figures)
    assert waited < deadline + 5 and figures["names_the_server"] and state["state"] == "FAILED", figures
    assert set(state["residency"].values()) == {"resident"} and not listed, figures
    assert recovered["state"] == "AWAKE" and recovered["admitted"] and figures["same_tokens"], figures


def test_7_a_killed_server_is_a_typed_error_naming_it_and_the_router_is_told(rig: Any) -> None:
    """The server's process tree killed while it serves (awake, in the router): the rollout
    manager's next offload is a typed error naming it within the deadline (`EngineDiedError`: the
    actor watches the server it launched, before any request), the router no longer lists it,
    every later call is refused the same way, and the health monitor's check reports it unhealthy
    (fault tolerance restarts it). The machine's state is recorded, not asserted: the death is
    found before the table runs, so it stays where the last transition left it."""
    import psutil
    from sglang.srt.utils import kill_process_tree

    from actor_integration.errors import EngineDiedError
    from lifecycle.errors import LifecycleError

    engine, router = rig["engine"], rig["router"]
    listed_before = rig["url"] in router.urls()
    kill_process_tree(rig["pid"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the actor's child, not ours: gone, or a zombie it has not reaped
        try:
            if psutil.Process(rig["pid"]).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(EngineDiedError) as dead:
        engine.release_memory_occupation()
    waited = time.monotonic() - start
    with pytest.raises(EngineDiedError):  # found once, refused every time after
        engine.resume_memory_occupation()
    with pytest.raises(LifecycleError):
        engine.health_generate(timeout=5.0)
    figures = {
        "listed_before": listed_before,
        "typed_error_s": round(waited, 3),
        "error": type(dead.value).__name__,
        "names_the_server": rig["url"] in str(dead.value),
        "state": engine.lifecycle_state_name(),
        "router_lists_it": rig["url"] in router.urls(),
    }
    record(f"{rig['framework']}_rollout_kill", figures)
    assert waited < 10 and figures["names_the_server"], figures
    assert listed_before and not figures["router_lists_it"], figures

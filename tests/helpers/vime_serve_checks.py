"""What tests/gpu/test_vime_rollout_gpu.py does with vime's `VLLMEngine` on a `vllm serve` process, as
functions its CPU dry run (tests/actor_integration/frameworks/vime/test_vime_serve_dry_run.py) calls
too, on the fake server in a child process (tests only).

A `Rig` is one server launched by vime's wrapped engine (`lifecycle_engine(VLLMEngine)`, its `init`
as vime's `ServerGroup` calls it), vime's own class pointed at the same server (`plain`), the router
(`FakeRouter`: vllm-router's worker API and `/v1/completions`), and the trainer: two weight sets and
vLLM's sender (`trainer_send_weights(iterator, {"send_mode": callable, "packed": ...})`), whose
update fields each chunk goes through vime's own `update_weights`. The checks run in this order on
one rig; the last kills the server.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.engine_source import start_engine
from tests.helpers.sglang_server import FakeRouter
from tests.helpers.vime_serve import ServeLaunched, update_fields

VLLM_FLAGS = {  # vime's `--vllm-*` flags for the server (vime passes each as vLLM's field of that name)
    "vllm_load_format": "dummy",
    "vllm_dtype": "bfloat16",
    "vllm_enforce_eager": True,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_len": 512,
    "vllm_skip_tokenizer_init": True,
}
REST = ["kv_cache", "cuda_graph"]  # vime's onload_kv (`cuda_graph` dropped by vime for vLLM)
Sender = Callable[[Iterator[tuple[str, Any]], dict[str, Any]], None]


@dataclass
class Rig:
    module: Any  # vime's vllm_engine module
    engine: Any  # vime's VLLMEngine under VimeRolloutMixin: it launched the server
    plain: Any  # vime's VLLMEngine as it is, sending to the same server
    router: FakeRouter
    launched: ServeLaunched
    sets: dict[str, dict[str, Any]]  # the trainer's weight sets, by name
    send: Sender
    prompts: list[list[int]]
    new_tokens: int = 16
    chunk_bytes: int = 2 << 20  # the packed sender's buffer: a version in several chunks
    free_bytes: Callable[[], int | None] = lambda: None  # the GPU's free memory (None: not measured)
    url: str = ""
    model: str = ""  # the served model's name (`GET /v1/models`)
    version: int = 0  # the trainer's last version pushed
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # per set: the greedy tokens
    figures: dict[str, Any] = field(default_factory=dict)


def job_args(model: str) -> Any:
    """vime's parsed flags for a colocated, offloaded job of one engine on one GPU serving `model`."""
    from tests.helpers.vime_rollout import engine_args

    return engine_args(hf_checkpoint=model, **VLLM_FLAGS)


def start(module: Any, router: FakeRouter, launched: ServeLaunched, args: Any, **rig: Any) -> Rig:
    """vime's wrapped engine launches its server (vime's `init`), vime's own class is pointed at it."""
    import requests

    from actor_integration.frameworks.vime.rollout import lifecycle_engine

    started = time.monotonic()  # the constructor (it keeps the flags) and vime's init, the server's start
    engine = start_engine(lifecycle_engine(module.VLLMEngine), args, router=router)
    up_s = time.monotonic() - started
    plain = module.VLLMEngine(
        args,
        rank=0,
        worker_type="regular",
        base_gpu_id=0,
        num_gpus_per_engine=args.rollout_num_gpus_per_engine,
    )
    plain.node_rank, plain.server_host, plain.server_port = 0, engine.server_host, engine.server_port
    plain.router_ip, plain.router_port, plain.process = router.host, router.port, engine.process
    url = engine.get_url()
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    engine.init_weight_transfer_engine({"init_info": {}})  # vime's trainer, once (IPC sets nothing up)
    out = Rig(module, engine, plain, router, launched, url=url, model=model, **rig)
    out.figures["server_up_s"] = round(up_s, 1)
    out.figures["launch"] = launched.launches[-1]
    return out


def generate(rig: Rig) -> tuple[int, Any]:
    """A rollout request through the router (greedy, token ids): (status, tokens per prompt or the error)."""
    import requests

    body = {
        "model": rig.model,
        "prompt": rig.prompts,
        "max_tokens": rig.new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = requests.post(f"{rig.router.url}/v1/completions", json=body, timeout=300)
    if reply.status_code != 200:
        return reply.status_code, reply.text[:300]
    choices = sorted(reply.json()["choices"], key=lambda c: int(c.get("index", 0)))
    return 200, [list(c["token_ids"]) for c in choices]


def server_alive(rig: Rig) -> bool:
    """`GET /health` on the server itself (no generation)."""
    import requests

    try:
        return requests.get(f"{rig.url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def send_chunks(rig: Rig, engine: Any, name: str) -> int:
    """Set `name` through vLLM's sender (packed), each chunk's update fields through vime's own
    `update_weights`; the chunks sent."""
    chunks = []

    def chunk(info: Any) -> None:
        chunks.append(engine.update_weights(update_fields(info)))

    trainer_args = {"send_mode": chunk, "packed": True, "packed_buffer_size_bytes": rig.chunk_bytes}
    rig.send(iter(rig.sets[name].items()), trainer_args)
    return len(chunks)


def send_version(rig: Rig, engine: Any, name: str) -> int:
    """vime's trainer pushes set `name` as a new version: start, the chunks, finish; the chunks sent."""
    rig.version += 1
    engine.start_weight_update()
    chunks = send_chunks(rig, engine, name)
    engine.finish_weight_update(weight_version=str(rig.version))
    return chunks


def cycle(
    rig: Rig, engine: Any, name: str, while_asleep: Callable[[], None] | None = None
) -> dict[str, float]:
    """vime's rollout manager and trainer on `engine`: offload (level 2: the model is updated),
    onload_weights, the trainer's pause, push and continue, onload_kv; each call's ms."""
    times = [time.perf_counter()]
    engine.release_memory_occupation(level=2)
    times.append(time.perf_counter())
    if while_asleep is not None:
        while_asleep()
    times.append(time.perf_counter())
    engine.resume_memory_occupation(tags=["weights"])
    times.append(time.perf_counter())
    engine.pause_generation(mode="in_place")
    times.append(time.perf_counter())
    chunks = send_version(rig, engine, name)
    times.append(time.perf_counter())
    engine.continue_generation()
    times.append(time.perf_counter())
    engine.resume_memory_occupation(tags=REST)
    times.append(time.perf_counter())
    ms = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return {
        "release_ms": ms[0],
        "resume_weights_ms": ms[2],
        "pause_ms": ms[3],
        "push_ms": ms[4],
        "continue_ms": ms[5],
        "resume_kv_ms": ms[6],
        "chunks": chunks,
    }


def rounded(row: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 3) for key, value in row.items()}


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the cycles after the first (the first warms connections and kernels);
    `sleep_wake_ms`: release + both resumes; `with_trainer_ms`: and the trainer's pause and continue."""
    kept = rows[1:] or rows
    out = {key: round(statistics.median(row[key] for row in kept), 3) for key in rows[0]}
    out["sleep_wake_ms"] = round(out["release_ms"] + out["resume_weights_ms"] + out["resume_kv_ms"], 3)
    out["with_trainer_ms"] = round(out["sleep_wake_ms"] + out["pause_ms"] + out["continue_ms"], 3)
    return out


# ---------------------------------------------------------------------------------------------- the checks


def own_and_wrapped(rig: Rig, cycles: int) -> dict[str, Any]:
    """vime's own class and the wrapped one on the same server, a cycle of each in turn (`cycles`
    each, so that a drift of the machine's speed falls on both alike): each call timed, the medians
    side by side, and every cycle's figures (`rows`). The wrap moves the trainer's pause into its sleep
    and the continue to the end of onload_kv (absorbing the trainer's), so the like-for-like figure is
    `with_trainer_ms`."""
    own, wrapped = [], []
    for i in range(cycles):
        own.append(cycle(rig, rig.plain, "AB"[i % 2]))
        wrapped.append(cycle(rig, rig.engine, "AB"[i % 2]))
    figures: dict[str, Any] = {"cycles": cycles, "own": medians(own), "wrapped": medians(wrapped)}
    figures["rows"] = {
        name: [rounded(row) for row in rows] for name, rows in (("own", own), ("wrapped", wrapped))
    }
    for key in ("sleep_wake_ms", "with_trainer_ms"):
        figures[f"wrapped_minus_own_{key}"] = round(figures["wrapped"][key] - figures["own"][key], 3)
    figures["state"] = {
        k: rig.engine.lifecycle_state().get(k) for k in ("state", "admitted", "served_version")
    }
    return figures


def wrapped_cycles(rig: Rig, cycles: int) -> dict[str, Any]:
    """`cycles` of vime's offload / onload / push / onload_kv on the wrapped engine, the two sets in turn:
    out of the router while released (503), and the same greedy tokens whenever the same set is loaded."""
    rows, freed, asleep = [], [], []

    def while_asleep() -> None:
        free = rig.free_bytes()
        if free is not None and before is not None:
            freed.append(free - before)
        asleep.append(generate(rig)[0])

    for i in range(cycles):
        name = "AB"[i % 2]
        before = rig.free_bytes()
        rows.append(cycle(rig, rig.engine, name, while_asleep))
        status, tokens = generate(rig)
        assert status == 200, (i, name, tokens)
        assert all(len(t) == rig.new_tokens for t in tokens), (i, tokens)
        expected = rig.tokens.setdefault(name, tokens)
        assert tokens == expected, f"cycle {i}: set {name} served other tokens than at its first load"
        state = rig.engine.lifecycle_state()
        assert state["served_version"] == str(rig.version) and state["admitted"], (i, state)
    assert set(asleep) == {503}, asleep  # a released server is out of the router
    assert rig.tokens["A"] != rig.tokens["B"], rig.tokens
    figures = {
        "cycles": cycles,
        "wrapped": medians(rows),
        "freed_by_release_bytes": int(statistics.median(freed)) if freed else None,
        "tokens_A": rig.tokens["A"][0],
        "tokens_B": rig.tokens["B"][0],
        "version": rig.version,
    }
    return figures


def refused(error: type[BaseException], call: Callable[[], Any]) -> str:
    """`call()` must raise `error` (any other exception propagates): its type and message."""
    try:
        call()
    except error as exc:
        return f"{type(exc).__name__}: {exc}"[:240]
    raise AssertionError(f"not refused with {error.__name__}")


def killers(rig: Rig) -> dict[str, Any]:
    """The calls that kill or corrupt vLLM, made on the wrapped engine as vime's job would: each refused
    (typed) or absorbed before vLLM hears of it, the server alive after each; then a push of set A and
    its greedy tokens."""
    from actor_integration.errors import (
        DuplicateWeightUpdateStartError,
        MemoryStateError,
        WeightUpdateNotStartedError,
    )
    from lifecycle import Contents
    from lifecycle.errors import IllegalTransitionError

    engine, out = rig.engine, {}
    engine.release_memory_occupation(level=2)
    engine.release_memory_occupation(level=2)  # a second sleep: a no-op (vllm #36651)
    out["second_sleep_alive"] = server_alive(rig)
    out["generate_asleep_status"] = generate(rig)[0]  # out of the router (vllm #15483, #45326)
    out["health_asleep"] = engine.health_generate(timeout=5.0)  # GET /health only while asleep
    # an update while asleep (vllm #57853: the chunk segfaults the EngineCore): the start is refused,
    # and a chunk, its handles live while it is tried
    out["start_asleep"] = refused(IllegalTransitionError, engine.start_weight_update)
    chunk = dict(list(rig.sets["A"].items())[-1:])
    tried: list[str] = []
    rig.send(
        iter(chunk.items()),
        {
            "send_mode": lambda info: tried.append(
                refused(WeightUpdateNotStartedError, lambda: engine.update_weights(update_fields(info)))
            ),
            "packed": False,
        },
    )
    out["update_asleep"] = tried
    out["update_asleep_alive"] = server_alive(rig)
    engine.resume_memory_occupation(tags=["weights"])
    # a sleep while the KV cache still sleeps: vLLM would ignore it ("already sleeping")
    out["sleep_half_awake"] = refused(MemoryStateError, lambda: engine.release_memory_occupation(level=2))
    engine.resume_memory_occupation(tags=REST)  # level 2 and no reload: the weights are gibberish
    out["discarded_generate_status"] = generate(rig)[0]
    out["discarded_contents"] = engine.lifecycle.contents["weights"].value
    assert engine.lifecycle.contents["weights"] is Contents.DISCARDED
    engine.pause_generation(mode="in_place")
    engine.start_weight_update()
    out["second_start"] = refused(DuplicateWeightUpdateStartError, engine.start_weight_update)  # vime #57
    out["chunks_after_second_start"] = send_chunks(rig, engine, "A")  # the first start's update goes on
    rig.version += 1
    engine.finish_weight_update(weight_version=str(rig.version))
    engine.continue_generation()
    status, tokens = generate(rig)
    out["after"] = {
        "status": status,
        "same_tokens_as_A": tokens == rig.tokens.get("A"),
        "alive": server_alive(rig),
    }
    assert out["second_sleep_alive"] and out["update_asleep_alive"] and out["health_asleep"] is True, out
    assert out["generate_asleep_status"] == 503 and out["discarded_generate_status"] == 503, out
    assert len(tried) == 1 and out["after"] == {"status": 200, "same_tokens_as_A": True, "alive": True}, out
    return out


def within(deadline_s: float, call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run `call` in a thread: (what it raised, None if nothing; seconds); a call still running at the
    deadline fails the test instead of hanging it."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise AssertionError(f"still waiting after {deadline_s} s: the call hangs on the killed server")
    return outcome[0], time.monotonic() - started


def killed_server(rig: Rig, deadline_s: float = 30.0) -> dict[str, Any]:
    """The server's process tree SIGKILLed while a client sends rollout requests through the router:
    the wrapped engine's next call (the rollout manager's offload) is a typed error naming the engine
    within the deadline, it leaves the router, and its health check reports it."""
    from actor_integration.errors import EngineDiedError
    from lifecycle.errors import LifecycleError

    engine, router = rig.engine, rig.router
    listed_before = rig.url in router.urls()
    stop, statuses = threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            try:
                statuses.append(generate(rig)[0])
            except Exception as exc:
                statuses.append(type(exc).__name__)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    time.sleep(1.0)
    served_before = statuses.count(200)
    process = rig.launched.process()
    killed = process.kill_tree()
    time.sleep(0.5)
    stop.set()
    thread.join(60)
    error, waited = within(deadline_s, lambda: engine.release_memory_occupation(level=2))
    health, _ = within(deadline_s, lambda: engine.health_generate(timeout=5.0))
    figures = {
        "listed_before": listed_before,
        "served_before_kill": served_before,
        "client_statuses": sorted({str(s) for s in statuses}),  # 200 before the kill, 502 after
        "killed_pids": len(killed),
        "exitcode": process.exitcode,
        "error": type(error).__name__ if error is not None else None,
        "message": str(error)[:300],
        "typed_error_s": round(waited, 3),
        "names_the_server": rig.url in str(error),
        "health": type(health).__name__ if health is not None else None,
        "router_lists_it": rig.url in router.urls(),
        "state": engine.lifecycle_state().get("state"),  # the machine's: the watch refuses before it runs
    }
    assert listed_before and served_before > 0 and not thread.is_alive(), figures
    assert isinstance(error, EngineDiedError) and figures["names_the_server"], figures
    assert isinstance(health, LifecycleError) and not figures["router_lists_it"], figures
    return figures

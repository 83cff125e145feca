"""What tests/gpu/test_vllm_http_gpu.py does with `VLLMHTTPEngine` on a `vllm serve` process, as
functions its CPU dry run (tests/actor_integration/engines/vllm/test_vllm_http_dry_run.py) calls too,
on the fake `vllm serve` in a child process (tests only).

`launched(program, model, ...)` starts the server (`vime_serve.serving`: `VLLM_PROGRAM`, the real
`vllm serve`, or `FAKE_PROGRAM`'s fake of it) with `http_serve_argv`'s command line and
`serve_env`'s environment, and yields a `Rig`: the server's URL and process, the lifecycle's client
of it (`VLLMHTTPEngine(url, worker_receiver=True, sleep_level=2)`), its `VLLMRolloutActor`, the
trainer's two weight sets and our sender into the actor's `update_weights`. The checks run in this
order on one rig; the last kills the server:
- `cycles`: sleep, wake the weights, generation refused while they are discarded, our sync of set A
  or B, wake the KV cache, greedy tokens equal to that set's first ones (A's != B's); the bytes each
  release freed against the engine's report (`free_bytes`: None where nothing measures them: CPU);
- `vllm_ipc`: vLLM's own IPC weight transfer through the HTTP routes serves what our path did;
- `killers`: the field's killers refused before a request leaves the client, the server alive after;
- `killed_server`: the server's process tree SIGKILLed, the next call a typed error within a deadline.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.framework_source import free_port
from tests.helpers.vime_serve import ServeProcess, serving, with_repo_on_path
from tests.helpers.vime_serve_checks import refused, within

EXTENSION = "actor_integration.engines.vllm.worker.LifecycleWorkerExtension"


def http_serve_argv(model: str, port: int) -> list[str]:
    """`vllm serve`'s command line: sleep mode, the lifecycle's worker extension, vLLM's IPC weight
    transfer, dummy weights, eager, 0.3 of the GPU, no tokenizer (token ids in and out)."""
    return [
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-sleep-mode",
        "--worker-extension-cls",
        EXTENSION,
        "--weight-transfer-config",
        '{"backend": "ipc"}',
        "--load-format",
        "dummy",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.3",
        "--max-model-len",
        "512",
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
    ]


def serve_env() -> dict[str, str]:
    """This process's environment, with the dev routes (sleep, weight transfer, collective_rpc), vLLM's
    pickled IPC handles allowed, and the repository importable by the workers."""
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return with_repo_on_path(env)


@dataclass
class Rig:
    process: ServeProcess
    url: str
    engine: Any  # VLLMHTTPEngine
    actor: Any  # VLLMRolloutActor over it
    sender: Any  # our WeightSender into actor.update_weights
    sets: dict[str, dict[str, Any]]  # the trainer's weight sets, by name
    prompts: list[list[int]]
    new_tokens: int
    free_bytes: Callable[[], int | None] = lambda: None  # the GPU's free bytes (None: not measured)
    freed_at_least: float | None = (
        None  # each release frees this share of the engine's report (None: unchecked)
    )
    version: int = 0  # the trainer's last version pushed
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # per set: its first greedy tokens
    figures: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def launched(
    program: tuple[str, ...],
    model: str,
    log_dir: Path,
    *,
    make_sender: Callable[[Any], Any],
    deadline_s: float,
    engine_options: dict[str, Any] | None = None,
    **rig: Any,
) -> Iterator[Rig]:
    """The server (`program`'s `vllm serve`), the client, its actor (lifecycle log under `log_dir`) and
    `make_sender(actor)`; `rig`: `Rig`'s other fields. The server's tree is killed on exit."""
    from actor_integration.engines.vllm import VLLMHTTPEngine, VLLMRolloutActor

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = http_serve_argv(model, port)
    log_path = log_dir / "vllm-serve.log"
    with serving(program, argv, serve_env(), log_path, url, deadline_s) as (process, up_s):
        engine = VLLMHTTPEngine(url, worker_receiver=True, sleep_level=2, **(engine_options or {}))
        actor = VLLMRolloutActor(
            engine, max_new_tokens=rig["new_tokens"], log_dir=str(log_dir / "lifecycle-logs")
        )
        sender = make_sender(actor)
        try:
            out = Rig(process, url, engine, actor, sender, **rig)
            out.figures = {
                "argv": argv,
                "log": str(log_path),
                "server_up_s": round(up_s, 1),
                "described": engine.describe(),
                "workers": engine.workers,
                "vllm_report": engine.memory_report(),
            }
            yield out
        finally:
            sender.close()
            engine.close()


@contextlib.contextmanager
def requests_sent(engine: Any) -> Iterator[list[str]]:
    """Every request the client sends to the server while inside ("METHOD path")."""
    sent: list[str] = []
    request = engine._request

    def counted(method: str, path: str, body: Any, **kwargs: Any) -> Any:
        sent.append(f"{method} {path}")
        return request(method, path, body, **kwargs)

    engine._request = counted
    try:
        yield sent
    finally:
        del engine._request


@contextlib.contextmanager
def requests_timed(engine: Any) -> Iterator[Callable[[], float]]:
    """While inside, every request the client sends is timed; yields a reader of the seconds spent
    in them so far (both sides of the side-by-side send through it alike)."""
    spent = [0.0]
    request = engine._request

    def timed(method: str, path: str, body: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return request(method, path, body, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    engine._request = timed
    try:
        yield lambda: spent[0]
    finally:
        del engine._request


def cycle(rig: Rig, name: str) -> dict[str, Any]:
    """Sleep (level 2), wake the weights, try to generate (refused: discarded), our sync of set `name`,
    wake the KV cache; the phases' ms, the freed bytes and the refusal (None: not refused)."""
    from lifecycle.errors import IllegalTransitionError

    actor = rig.actor
    before = rig.free_bytes()
    t0 = time.perf_counter()
    actor.sleep()
    t1 = time.perf_counter()
    after = rig.free_bytes()
    actor.wake_up(["weights"])
    t2 = time.perf_counter()
    try:  # discarded weights: nothing may serve until the sync
        refusal = str(refused(IllegalTransitionError, lambda: actor.generate(rig.prompts[:1])))
    except AssertionError:
        refusal = None
    rig.version += 1
    t3 = time.perf_counter()
    rig.sender.send(rig.version, rig.sets[name].items())
    t4 = time.perf_counter()
    actor.wake_up(["kv_cache"])
    t5 = time.perf_counter()
    return {
        "set": name,
        "version": rig.version,
        "freed_bytes": None if before is None or after is None else after - before,
        "reported_bytes": rig.engine.memory_bytes(None),
        "refused_while_discarded": refusal,
        "sleep_ms": round((t1 - t0) * 1e3, 2),
        "wake_weights_ms": round((t2 - t1) * 1e3, 2),
        "sync_ms": round((t4 - t3) * 1e3, 2),
        "wake_kv_ms": round((t5 - t4) * 1e3, 2),
    }


def cycles(rig: Rig, count: int) -> dict[str, Any]:
    """`count` cycles, sets A and B in turn: each refuses generation on discarded weights, serves its
    set's first greedy tokens, and (where measured) frees `freed_at_least` of the engine's report."""
    rows = []
    for i in range(count):
        name = "AB"[i % 2]
        row = cycle(rig, name)
        assert row["refused_while_discarded"] is not None, f"cycle {i}: generation was not refused: {row}"
        tokens = rig.actor.generate(rig.prompts, min_weight_version=rig.version)
        assert all(len(t) == rig.new_tokens for t in tokens), (i, tokens)
        expected = rig.tokens.setdefault(name, tokens)
        assert tokens == expected, f"cycle {i}: set {name} served other tokens than at its first load"
        if rig.freed_at_least is not None:
            assert row["reported_bytes"], f"vLLM's workers reported nothing to free: {row}"  # not vacuous
            assert row["freed_bytes"] >= rig.freed_at_least * row["reported_bytes"], row
        rows.append(row)
    assert rig.tokens["A"] != rig.tokens["B"], rig.tokens
    served = rig.engine.served_weight_version()
    assert served == str(rig.version), (served, rig.version)
    kept = rows[1:] or rows  # the first warms connections
    return {
        **rig.figures,
        "cycles": count,
        "freed_at_least": rig.freed_at_least,
        "median_ms": {
            k: round(statistics.median(r[k] for r in kept), 2)
            for k in ("sleep_ms", "wake_weights_ms", "sync_ms", "wake_kv_ms")
        },
        "served_version": served,
        "tokens_A": rig.tokens["A"][0],
        "tokens_B": rig.tokens["B"][0],
        "rows": rows,
    }


def vllm_ipc(rig: Rig) -> dict[str, Any]:
    """Set A through vLLM's own IPC weight transfer (`/start_weight_update`, `/update_weights`,
    `/finish_weight_update`) serves the tokens our path served for A."""
    rig.actor.sleep()
    rig.actor.wake_up()
    rig.version += 1
    started = time.perf_counter()
    rig.engine.load_weights(rig.version, [list(rig.sets["A"].items())], round_index=0, final=True)
    load_ms = (time.perf_counter() - started) * 1e3
    tokens = rig.engine.generate(rig.prompts, max_new_tokens=rig.new_tokens)
    assert tokens == rig.tokens["A"], "vLLM's IPC path served other tokens than ours for set A"
    return {"load_ms": round(load_ms, 2), "version": rig.version, "same_tokens_as_ours": True}


def killers(rig: Rig) -> dict[str, Any]:
    """The calls that kill or corrupt vLLM, each refused before a request leaves the client, the server
    alive (`GET /health`) after; then set A through vLLM's IPC and through our sync (one cycle under the
    actor), each serving A's tokens."""
    from actor_integration.errors import (
        MemoryStateError,
        SleepTagsError,
        WeightsDiscardedError,
        WeightUpdateBusyError,
    )

    engine, out = rig.engine, {}
    weights_a = [list(rig.sets["A"].items())]
    one = rig.prompts[:1]

    def quietly(error: type[BaseException], call: Callable[[], Any]) -> str:
        with requests_sent(engine) as sent:
            message = refused(error, call)
        assert sent == [], f"{message}: refused only after sending {sent}"
        return message

    engine.pause_generation("abort")
    engine.flush_cache()
    engine.release_memory_occupation(None)
    out["update_asleep"] = quietly(  # vllm #57853: EngineCore segfaults, the server stays up
        MemoryStateError, lambda: engine.load_weights(99, weights_a, round_index=0, final=True)
    )
    out["generate_asleep"] = quietly(MemoryStateError, lambda: engine.generate(one))  # vllm #15483
    out["second_sleep"] = quietly(MemoryStateError, lambda: engine.release_memory_occupation(None))  # #36651
    out["sleep_one_tag"] = quietly(SleepTagsError, lambda: engine.release_memory_occupation(["kv_cache"]))
    engine.resume_memory_occupation(["weights"])
    out["generate_kv_asleep"] = quietly(MemoryStateError, lambda: engine.generate(one))
    out["second_wake"] = quietly(MemoryStateError, lambda: engine.resume_memory_occupation(["weights"]))
    engine.resume_memory_occupation(["kv_cache"])
    out["generate_discarded"] = quietly(WeightsDiscardedError, lambda: engine.generate(one))  # level 2
    first = engine.begin_weight_update("coordinator-0")
    out["second_start"] = quietly(  # vime #57
        WeightUpdateBusyError, lambda: engine.begin_weight_update("coordinator-1")
    )
    first.abort()
    engine.continue_generation()
    engine.alive()  # GET /health: the server and its engine are up
    rig.version += 1
    engine.load_weights(rig.version, weights_a, round_index=0, final=True)
    tokens = engine.generate(rig.prompts, max_new_tokens=rig.new_tokens)
    out["vllm_ipc_same_tokens_as_A"] = tokens == rig.tokens["A"]
    row = cycle(rig, "A")
    tokens = rig.actor.generate(rig.prompts, min_weight_version=rig.version)
    out["our_sync_same_tokens_as_A"] = tokens == rig.tokens["A"]
    out["refused_while_discarded"] = row["refused_while_discarded"] is not None
    out["version"] = rig.version
    assert out["vllm_ipc_same_tokens_as_A"] and out["our_sync_same_tokens_as_A"], out
    assert out["refused_while_discarded"], out
    return out


def killed_server(rig: Rig, deadline_s: float = 30.0) -> dict[str, Any]:
    """The server's process tree SIGKILLed: the actor's next call (a sleep) and the client's (a
    generation) each a typed error within the deadline (`VLLMServerError` with status None: the server
    cannot be reached; `EngineDiedError` where a process watch saw it go), not a hang."""
    from actor_integration.errors import EngineDiedError, VLLMServerError

    killed = rig.process.kill_tree()
    figures: dict[str, Any] = {"killed_pids": len(killed), "exitcode": rig.process.exitcode}
    calls = {
        "actor_sleep": rig.actor.sleep,
        "engine_generate": lambda: rig.engine.generate(rig.prompts, max_new_tokens=rig.new_tokens),
    }
    for name, call in calls.items():
        error, waited = within(deadline_s, call)
        typed = _typed(error, (EngineDiedError, VLLMServerError))
        figures[name] = {
            "error": type(error).__name__ if error is not None else None,
            "typed": None if typed is None else type(typed).__name__,
            "status": None if typed is None else typed.fields.get("status", "n/a"),
            "message": str(error)[:300],
            "waited_s": round(waited, 3),
        }
        assert typed is not None, figures
        assert not isinstance(typed, VLLMServerError) or typed.fields["status"] is None, figures
    return figures


def _typed(error: BaseException | None, kinds: tuple[type[Any], ...]) -> Any:
    """`error` or the first of its causes that is one of `kinds`; None if none is."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, kinds):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def own_and_wrapped(rig: Rig, cycles: int | None = None) -> dict[str, Any]:
    """The server's own routes (/sleep?level=2&mode=abort, /wake_up?tags=weights, then kv_cache, over
    the client's connection) next to the rollout actor's sleep and wakes, with the release audit on
    and off (`vllm_gpu.own_and_wrapped_runs`), each call's time inside the client's request and
    inside the server's EngineCore (its log) beside it; then set A through our sync, which must serve
    its first tokens again."""
    from tests.helpers.vllm_gpu import SIDE_BY_SIDE_CYCLES, own_and_wrapped_runs

    engine = rig.engine
    own = {
        "sleep": lambda: engine._request("POST", "/sleep?level=2&mode=abort", None),
        "wake_weights": lambda: engine._request("POST", "/wake_up?tags=weights", None),
        "wake_kv": lambda: engine._request("POST", "/wake_up?tags=kv_cache", None),
    }
    with requests_timed(engine) as in_engine_s:
        figures = own_and_wrapped_runs(
            own, rig.actor, Path(rig.figures["log"]), cycles or SIDE_BY_SIDE_CYCLES, in_engine_s=in_engine_s
        )
    rig.actor.sleep()
    rig.actor.wake_up(["weights"])
    rig.version += 1
    rig.sender.send(rig.version, rig.sets["A"].items())
    rig.actor.wake_up(["kv_cache"])
    tokens = rig.actor.generate(rig.prompts, min_weight_version=rig.version)
    figures["same_tokens_as_A"] = tokens == rig.tokens["A"]
    assert figures["same_tokens_as_A"], figures
    return figures

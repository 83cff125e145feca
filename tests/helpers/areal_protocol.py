"""AReaL's colocate calls on its own `RemoteSGLangEngine` against one SGLang server, plain and under
`ArealRolloutMixin` (tests only): the driver tests/gpu/test_areal_rollout_gpu.py runs on a real
SGLang server and test_areal_gpu_driver.py runs on `FakeSGLangServer` (the same code, a CPU dry run).

The engine classes are AReaL's (`tests/helpers/areal_engine.py` imports them from its source); the
server is stock SGLang (no AWEX plugin: its loops do not fit 0.5.17's scheduler). The switch each
cycle makes is rl_trainer's colocate switch (areal/trainer/rl_trainer.py 771-779 at cbff54d6):
`pause()`, `pause_generation()` (abort, then in_place), `offload(["kv_cache"])`,
`offload(["weights"])`; the trainer's turn; then, where AWEX's plugin would resume `weights` in the
scheduler and load them, the same through stock SGLang: `onload(["weights"])` and AReaL's disk
update as `MegatronEngine._update_weights_from_disk` sends it (megatron_engine.py 2467-2483:
`pause_generation()`, `update_weights_from_disk(meta)`, the checkpoint's name published through
`name_resolve`, the future's result), its `continue_generation` sent after `onload(["kv_cache"])`
as the AWEX branch orders them (megatron_engine.py 990-991); then the workflow's `resume()`.
The trainer's save is a link: version v's checkpoint, where AReaL's `WeightUpdateMeta.with_version`
puts it (`<save_root>/weight_update_v<v>`), links to set A's or B's directory, written once; it is
in place before the update asks for it, so the name is published first and AReaL's
`name_resolve.wait` (it polls each second) returns at once.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.frameworks.areal import ArealRolloutMixin
from actor_integration.frameworks.areal.rollout import SGLangServers
from tests.helpers.areal_engine import wrapped_class

EXPERIMENT, TRIAL = "rl-lifecycle-gpu", "areal"
PROMPTS = [[11, 12, 13, 14], [100, 2000, 30000], [7] * 9, [151, 152, 153, 154, 155, 156]]
NEW_TOKENS = 16
HANG_S = 2.0  # a request unanswered this long waits on a pause nobody lifts
TIMEOUT_S = 120.0


class RecordedServers(SGLangServers):
    """The wrap's client, recording each request it sends (the order the wrap makes, on any server)."""

    def __init__(self, urls: Sequence[str], sent: list[str], *, timeout_s: float) -> None:
        super().__init__(urls, timeout_s=timeout_s)
        self.sent = sent

    def pause_generation(self, mode: str = "abort") -> None:
        self.sent.append(f"pause {mode}")
        super().pause_generation(mode)

    def continue_generation(self) -> None:
        self.sent.append("continue")
        super().continue_generation()

    def flush_cache(self) -> bool:
        self.sent.append("flush")
        return super().flush_cache()

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        self.sent.append(f"release {','.join(tags)}")
        super().release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        self.sent.append(f"resume {','.join(tags)}")
        super().resume_memory_occupation(tags)


@dataclass
class Rig:
    """One server and AReaL's engines over it: `plain` (AReaL's class) and `wrapped` (under the mixin)."""

    areal: types.SimpleNamespace
    address: str  # host:port, as AReaL's engine holds it
    checkpoints: dict[str, str]  # weight set -> a checkpoint directory SGLang loads
    save_root: str  # where the trainer's versioned checkpoints go (each a link to a set's)
    plain: Any = None
    wrapped: Any = None
    sent: list[str] = field(default_factory=list)  # what the wrap sent, in order
    version: int = 0  # the last version loaded (one counter for both engines)
    loaded: str | None = None  # the set the server holds
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # each set's greedy tokens
    free_gib: Callable[[], float] | None = None  # the GPU's free memory, where there is one
    engines: list[Any] = field(default_factory=list)  # every engine built, destroyed by close()
    figures: dict[str, Any] = field(default_factory=dict)  # what the test records about the rig
    server: Any = None  # the server's process, where the test launched one

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def probe(self) -> SGLangHTTPEngine:
        return SGLangHTTPEngine(self.url, timeout_s=30, codec=lambda named: None, multi_dtype_buckets=False)

    def close(self) -> None:
        for engine in self.engines:
            engine.destroy()


def config(areal: types.SimpleNamespace, **overrides: Any) -> Any:
    """AReaL's InferenceEngineConfig for one server (one try per request: a dead server is an error)."""
    values: dict[str, Any] = {
        "experiment_name": EXPERIMENT,
        "trial_name": TRIAL,
        "backend": "sglang:d1",
        "request_retries": 1,
        "request_timeout": TIMEOUT_S,
        "setup_timeout": TIMEOUT_S,
    }
    return areal.cli_args.InferenceEngineConfig(**{**values, **overrides})


def build(
    areal: types.SimpleNamespace,
    address: str,
    checkpoints: dict[str, str],
    *,
    log_dir: str,
    scratch: str,
    free_gib: Callable[[], float] | None = None,
) -> Rig:
    """AReaL's engine plain and wrapped over the server at `address`, both initialized; AReaL's
    name_resolve on files under `scratch` (its NFS repository, as a one-node job sets it), the
    trainer's versioned checkpoints there too."""
    record_root, save_root = Path(scratch) / "name_resolve", Path(scratch) / "saved"
    save_root.mkdir(parents=True, exist_ok=True)
    areal.name_resolve.reconfigure(
        areal.cli_args.NameResolveConfig(type="nfs", nfs_record_root=str(record_root))
    )
    rig = Rig(
        areal=areal, address=address, checkpoints=checkpoints, save_root=str(save_root), free_gib=free_gib
    )
    rig.plain = engine(rig, wrapped=False)
    rig.wrapped = engine(rig, wrapped=True, lifecycle_log_dir=log_dir, lifecycle_rank=0)
    return rig


def engine(rig: Rig, *, wrapped: bool, **attributes: Any) -> Any:
    """One more AReaL engine over the rig's server (wrapped: `attributes` set on its class)."""
    if wrapped:
        sent = rig.sent if attributes.get("lifecycle_rank", 0) == 0 else []

        def lifecycle_servers(self: ArealRolloutMixin, addresses: Sequence[str]) -> SGLangServers:
            return RecordedServers(addresses, sent, timeout_s=self.lifecycle_timeout_s)

        klass = wrapped_class(rig.areal, lifecycle_servers=lifecycle_servers, **attributes)
    else:
        klass = rig.areal.sglang_remote.RemoteSGLangEngine
    made = klass(config(rig.areal))
    made.initialize(addr=rig.address, train_data_parallel_size=1)
    rig.engines.append(made)
    return made


# ---------------------------------------------------------------------------------------------- requests


def post(url: str, body: dict[str, Any], timeout_s: float = TIMEOUT_S) -> tuple[Any, Any]:
    """(status, decoded answer), or (exception type name, text) when no answer came."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (TimeoutError, urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return type(reason).__name__, str(reason)


def generate(rig: Rig, timeout_s: float = TIMEOUT_S, **sampling: Any) -> tuple[Any, Any]:
    """The workflow's batch, greedy, sent to the server."""
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, **sampling}
    return post(f"{rig.url}/generate", {"input_ids": PROMPTS, "sampling_params": params}, timeout_s)


def tokens_of(answer: Any) -> list[list[int]]:
    return [list(out["output_ids"]) for out in answer]


def served_set(rig: Rig, name: str, answer: Any) -> bool:
    """Whether `answer` holds set `name`'s tokens; the first answer after a set's first load is its
    reference (the server runs without a radix cache, so a batch's greedy tokens depend on the
    weights alone)."""
    out = tokens_of(answer)
    return rig.tokens.setdefault(name, out) == out


class Pending:
    """One request sent in a thread: `answer` once answered ((status, body), and when)."""

    def __init__(self, rig: Rig, **sampling: Any) -> None:
        self.answer: tuple[Any, Any] | None = None
        self.answered_at: float | None = None
        self.thread = threading.Thread(target=self._send, args=(rig, sampling), daemon=True)
        self.thread.start()

    def _send(self, rig: Rig, sampling: dict[str, Any]) -> None:
        self.answer = generate(rig, **sampling)
        self.answered_at = time.monotonic()

    def held(self, seconds: float = HANG_S) -> bool:
        """Still unanswered after `seconds` (waiting on the pause)."""
        self.thread.join(seconds)
        return self.answer is None

    def wait(self, timeout_s: float = TIMEOUT_S) -> tuple[Any, Any]:
        self.thread.join(timeout_s)
        return self.answer if self.answer is not None else ("no answer", None)


# ---------------------------------------------------------------------------------------------- the switch


def publish(rig: Rig, engine: Any) -> None:
    """The trainer's side of the disk update: the checkpoint saved, its name added to name_resolve
    under the engine's current version (megatron_engine.py 2474-2480)."""
    names = rig.areal.names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version())
    rig.areal.name_resolve.add(names, str(datetime.now().timestamp()), keepalive_ttl=120, replace=True)


def load(rig: Rig, engine: Any, name: str, *, then_continue: bool = False) -> float:
    """AReaL's disk update of set `name` through `engine`, as MegatronEngine sends it; ms. The next
    version, its own `continue_generation` only with `then_continue` (rl_trainer's disk path)."""
    engine.set_version(rig.version)
    meta = rig.areal.io_struct.WeightUpdateMeta(
        type="disk", path=str(Path(rig.save_root) / "weight_update"), clear_checkpoint_after_load=False
    ).with_version(rig.version + 1)
    saved = Path(meta.path)  # the trainer's save of this version: set `name`
    saved.unlink(missing_ok=True)
    saved.symlink_to(rig.checkpoints[name], target_is_directory=True)
    publish(rig, engine)
    start = time.perf_counter()
    engine.pause_generation()
    engine.update_weights_from_disk(meta).result(timeout=TIMEOUT_S)
    if then_continue:
        engine.continue_generation()
    elapsed = (time.perf_counter() - start) * 1e3
    rig.version += 1
    engine.set_version(rig.version)
    rig.loaded = name
    return elapsed


def cycle(rig: Rig, engine: Any, name: str) -> dict[str, float]:
    """One colocate step's switch through `engine`, loading set `name`; ms per phase. `switch_ms`
    is the phase switch without the load: to the trainer, and back to the rollout."""
    t0 = time.perf_counter()
    engine.pause()
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    engine.offload(tags=["weights"])
    t1 = time.perf_counter()
    engine.onload(tags=["weights"])
    t2 = time.perf_counter()
    update_ms = load(rig, engine, name)
    t3 = time.perf_counter()
    engine.onload(tags=["kv_cache"])
    engine.continue_generation()
    engine.resume()
    t4 = time.perf_counter()
    to_trainer, onload_weights, to_rollout = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t4 - t3) * 1e3
    return {
        "to_trainer_ms": to_trainer,
        "onload_weights_ms": onload_weights,
        "update_ms": update_ms,
        "to_rollout_ms": to_rollout,
        "switch_ms": to_trainer + onload_weights + to_rollout,
    }


def cycles(rig: Rig, engine: Any, count: int) -> dict[str, Any]:
    """`count` switches through `engine`, alternating sets A and B, each checked by a greedy batch:
    the medians (the first cycle left out), every switch, the cycles that served other tokens, and
    what the wrap sent in the first cycle (nothing for the plain engine)."""
    timings: list[dict[str, float]] = []
    wrong: list[dict[str, Any]] = []
    first_sent: list[str] = []
    for index in range(count):
        name = "B" if rig.loaded == "A" else "A"
        mark = len(rig.sent)
        timings.append(cycle(rig, engine, name))
        if index == 0:
            first_sent = rig.sent[mark:]
        status, answer = generate(rig)
        if status != 200 or not served_set(rig, name, answer):
            wrong.append({"cycle": index, "set": name, "status": status, "answer": str(answer)[:300]})
    kept = timings[1:] or timings
    medians = (
        {key: round(statistics.median(t[key] for t in kept), 3) for key in timings[0]} if timings else {}
    )
    return {
        "cycles": count,
        "median": medians,
        "switch_ms_all": [round(t["switch_ms"], 2) for t in timings],
        "wrong": wrong,
        "wrap_sent_first_cycle": first_sent,
    }


def side_by_side(rig: Rig, count: int) -> dict[str, Any]:
    """AReaL's own switch and the wrapped one on the same server, a cycle of each in turn
    (`tests.helpers.side_by_side.alternate`: the machine's drift falls on both), each cycle loading
    the other set and checked by a greedy batch. The medians of each (the first cycle of each left
    out), `wrapped_minus_own_switch_ms`, every cycle in its order, and the cycles that served other
    tokens."""
    from tests.helpers.side_by_side import alternate

    wrong: list[dict[str, Any]] = []

    def side(engine: Any, label: str) -> Any:
        def one(index: int) -> dict[str, float]:
            name = "B" if rig.loaded == "A" else "A"
            timing = cycle(rig, engine, name)
            status, answer = generate(rig)
            if status != 200 or not served_set(rig, name, answer):
                wrong.append(
                    {
                        "side": label,
                        "cycle": index,
                        "set": name,
                        "status": status,
                        "answer": str(answer)[:300],
                    }
                )
            return timing

        return one

    figures = alternate(
        side(rig.plain, "own"), side(rig.wrapped, "wrapped"), count, totals={"switch_ms": ("switch_ms",)}
    )
    figures["wrong"] = wrong
    return figures


def released_gib(rig: Rig, engine: Any) -> float | None:
    """The GPU memory the switch to the trainer frees (GiB), then the way back; None without a GPU."""
    if rig.free_gib is None:
        return None
    name = "B" if rig.loaded == "A" else "A"
    before = rig.free_gib()
    engine.pause()
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    engine.offload(tags=["weights"])
    freed = rig.free_gib() - before
    engine.onload(tags=["weights"])
    load(rig, engine, name)
    engine.onload(tags=["kv_cache"])
    engine.continue_generation()
    engine.resume()
    return round(freed, 2)


# ---------------------------------------------------------------------------------------------- field failures


def kv_left_released(rig: Rig) -> dict[str, Any]:
    """AReaL #1726's shape on the wrapped engine: paused, `kv_cache` released, continued. The wrap
    holds the continue (no request sent); a request waits on the pause instead of reaching released
    memory; the workflow's `resume()` wakes `kv_cache`, continues, and the request is served."""
    engine, name = rig.wrapped, rig.loaded
    mark = len(rig.sent)
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    engine.continue_generation()
    continued = "continue" in rig.sent[mark:]
    pending = Pending(rig)
    held = pending.held()
    engine.resume()
    status, answer = pending.wait()
    return {
        "continue_sent_while_released": continued,
        "request_held": held,
        "status": status,
        "same_tokens": status == 200 and name is not None and served_set(rig, name, answer),
        "sent": rig.sent[mark:],
        "state": engine.lifecycle_state()["state"],
    }


def recover_without_checkpoint(rig: Rig) -> dict[str, Any]:
    """AReaL #1726 through RecoverHandler.load's colocate branch (recover.py at cbff54d6): pause,
    release both tags, the checkpoint load raises, the `finally` resumes the workflow. Wrapped: the
    `resume()` wakes both tags and refuses admission on the discarded weights (`InvalidWeightsError`),
    the server alive; a disk update of the set, then `resume()`, serves it."""
    from lifecycle.errors import InvalidWeightsError

    engine, name = rig.wrapped, rig.loaded or "A"
    engine.pause()
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    engine.offload(tags=["weights"])
    refused = None
    try:
        try:
            raise FileNotFoundError("recover checkpoint missing")  # RecoverHandler._load_checkpoint
        finally:
            try:
                engine.resume()
            except InvalidWeightsError as exc:
                refused = exc
    except FileNotFoundError:
        pass  # RecoverHandler.load swallows it (returns None)
    state = engine.lifecycle_state()
    rig.probe().alive()
    load(rig, engine, name)
    engine.resume()
    status, answer = generate(rig)
    return {
        "refused": type(refused).__name__ if refused else None,
        "residency_after_refusal": state["residency"],
        "weights_after_refusal": state["contents"].get("weights"),
        "status_after_load": status,
        "same_tokens": status == 200 and served_set(rig, name, answer),
    }


def ordering(rig: Rig) -> dict[str, Any]:
    """AReaL #1737's ordering, what of it stock SGLang runs: a transfer reported into resident weights
    is refused naming the call that must come first (nothing sent); `lifecycle_before_weights_update`
    pauses in place before it releases, and a second one releases nothing twice. The plugin's read of
    the transfer is not there (no AWEX plugin on 0.5.17): the engine comes back through the disk."""
    from lifecycle.errors import IllegalTransitionError

    engine, name = rig.wrapped, "B" if rig.loaded == "A" else "A"
    mark = len(rig.sent)
    refusal = None
    try:
        engine.lifecycle_weights_updated(rig.version + 1)
    except IllegalTransitionError as exc:
        refusal = str(exc)
    sent_by_refusal = rig.sent[mark:]
    before = rig.free_gib() if rig.free_gib else None
    engine.lifecycle_before_weights_update()
    engine.lifecycle_before_weights_update()  # plain: a second release of each tag kills the server
    freed = None if before is None or rig.free_gib is None else round(rig.free_gib() - before, 2)
    sent = rig.sent[mark:]
    rig.probe().alive()
    engine.onload(tags=["weights"])
    load(rig, engine, name)
    engine.onload(tags=["kv_cache"])
    engine.continue_generation()
    engine.resume()
    status, answer = generate(rig)
    return {
        "refusal_names_the_call": refusal is not None and "lifecycle_before_weights_update" in refusal,
        "sent_by_refusal": sent_by_refusal,
        "sent": sent,
        "freed_gib": freed,
        "status": status,
        "same_tokens": status == 200 and served_set(rig, name, answer),
    }


def missing_continue(rig: Rig, *, wrapped: bool) -> dict[str, Any]:
    """AReaL #1160: pause, disk update, no continue. Plain: the next request waits (continued here
    by AReaL's own `continue_generation`, after the wait is seen); wrapped: the update's end
    continues generation and the request is served on the new set."""
    engine = rig.wrapped if wrapped else rig.plain
    name = "B" if rig.loaded == "A" else "A"
    load(rig, engine, name)
    pending = Pending(rig)
    held = pending.held()
    if held and not wrapped:
        engine.continue_generation()  # the operator's way out, plain
    status, answer = pending.wait()
    return {
        "request_held": held,
        "status": status,
        "same_tokens": status == 200 and served_set(rig, name, answer),
        "version": rig.version,
        "lifecycle_version": engine.lifecycle.weight_version if wrapped else None,
    }


class Load:
    """The rollout's requests in flight: `clients` threads each sending long generations in a loop
    (ignore_eos, `tokens` new tokens) until `stop()`; every answer is kept."""

    def __init__(self, rig: Rig, *, clients: int = 6, tokens: int = 384) -> None:
        self.rig, self.tokens = rig, tokens
        self.stopped = threading.Event()
        self.answers: list[tuple[Any, Any]] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.stopped.is_set():
            self.answers.append(generate(self.rig, max_new_tokens=self.tokens, ignore_eos=True))

    def running(self, timeout_s: float = 30.0) -> bool:
        """Wait until the server reports a request running."""
        probe = self.rig.probe()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if probe.queued_requests()["running"] > 0:
                return True
            time.sleep(0.05)
        return False

    def stop(self, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout_s)
        finishes = [finish_reason(status, answer) for status, answer in self.answers]
        return {
            "requests": len(finishes),
            "by_finish": {f: finishes.count(f) for f in sorted(set(finishes))},
            "errors": [f for f in finishes if f not in ("length", "stop", "abort")],
        }


def finish_reason(status: Any, answer: Any) -> str:
    """How a batch ended: "length" / "stop", "abort" (200 with an abort finish, or SGLang's error
    answer for an aborted request: 400, 500 or 503 naming the abort), else "status <code>"."""
    if status != 200 and "abort" in str(answer).lower():
        return "abort"
    if status != 200 or not isinstance(answer, list) or not answer:
        return f"status {status}"
    reasons = {str((out.get("meta_info", {}).get("finish_reason") or {}).get("type")) for out in answer}
    return "abort" if "abort" in reasons else "/".join(sorted(reasons))


def drain_before_release(rig: Rig, load_factory: Callable[[Rig], Any]) -> dict[str, Any]:
    """SGLang asserts an idle scheduler at a release. With the rollout's requests running, the wrapped
    switch's two-step pause aborts them before the flush and the release (the server lives); the way
    back continues the requests that waited meanwhile, which are served."""
    engine = rig.wrapped
    traffic = load_factory(rig)
    busy = traffic.running()
    mark = len(rig.sent)
    engine.pause()
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    sent = rig.sent[mark:]
    rig.probe().alive()
    engine.onload(tags=["kv_cache"])
    engine.continue_generation()
    engine.resume()
    figures = traffic.stop()
    status, answer = generate(rig)
    return {
        "running_at_pause": busy,
        "sent": sent,
        "traffic": figures,
        "status_after": status,
        "same_tokens": status == 200 and rig.loaded is not None and served_set(rig, rig.loaded, answer),
    }


def in_place_only(rig: Rig, load_factory: Callable[[Rig], Any], *, deadline_s: float = 3.0) -> dict[str, Any]:
    """#1500's ablation (pause in place only, requests running, release): plain, SGLang's fully-idle
    assertion kills the server, so only the wrapped engine runs it: in that mode its flush is refused
    until the deadline (`EngineNotIdleError`), nothing is released, the server alive; AReaL's own
    `continue_generation` (the plain engine's) lets the paused requests finish, served."""
    from actor_integration.errors import EngineNotIdleError

    ablation = engine(
        rig,
        wrapped=True,
        lifecycle_pause_mode="in_place",
        lifecycle_flush_deadline_s=deadline_s,
        lifecycle_rank=1,
    )
    traffic = load_factory(rig)
    busy = traffic.running()
    before = rig.free_gib() if rig.free_gib else None
    refused = None
    try:
        ablation.offload(tags=["kv_cache"])
    except EngineNotIdleError as exc:
        refused = exc
    freed = None if before is None or rig.free_gib is None else round(rig.free_gib() - before, 2)
    state = ablation.lifecycle_state()
    rig.probe().alive()
    rig.plain.continue_generation()
    figures = traffic.stop()
    status, answer = generate(rig)
    return {
        "running_at_pause": busy,
        "refused": type(refused).__name__ if refused else None,
        "state": state["state"],
        "residency": state["residency"],
        "freed_gib": freed,
        "traffic": figures,
        "status_after": status,
        "same_tokens": status == 200 and rig.loaded is not None and served_set(rig, rig.loaded, answer),
    }

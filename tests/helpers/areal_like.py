"""AReaL-shaped trainer and rollout engines (tests only), plain and under the adapters.

Written from AReaL cbff54d6 (`areal/engine/megatron_engine.py`, `areal/engine/awex/colocate_writer.py`,
`areal/engine/sglang_remote.py`, `areal/infra/remote_inf_engine.py`, `areal/utils/recover.py`,
`areal/engine/awex/sglang_plugin.py`): the method names, the order of the calls and the requests
AReaL sends, with the tensors as integers. Nothing of AReaL is copied; the same classes from its
source run in test_areal_source.py.

- `MegatronEngineLike` + `AwexAdapterLike`: the trainer in AWEX colocate mode (tag offload and onload
  with a `_released_tags` set, its weight update, save, load, train_batch).
- `RemoteEngineLike`: a rollout worker's `RemoteSGLangEngine`, sending AReaL's requests through
  `send(endpoint, payload)` to every server (HTTP to a `FakeSGLangServer`, or a `ServerModel`).
- `ServerModel`: SGLang 0.5.17 with AReaL's AWEX plugin as the model check needs it, in this process:
  each sequence that kills or hangs the real one raises `ProtocolViolation`.
- `recover_like`: `RecoverHandler.load`'s colocate branch.
- `World`, `METHODS`, `check`: the model check's actors (test_areal_sequences.py).
"""

from __future__ import annotations

import contextlib
import json
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from actor_integration.frameworks.areal import (
    ArealRolloutControllerMixin,
    ArealRolloutMixin,
    ArealTrainControllerMixin,
    ArealTrainerMixin,
)
from lifecycle import Residency
from lifecycle.testing import ProtocolViolation

# AReaL's engine module reads `current_platform` (synchronize, clear_memory); the adapter calls it too.
current_platform = types.SimpleNamespace(synchronize=lambda: None, clear_memory=lambda: None)

DEVICE_TAGS = ("optimizer", "weights")


@dataclass
class Meta:
    """AReaL's WeightUpdateMeta / SaveLoadMeta, the fields these paths read."""

    type: str = "awex"
    version: int | None = None
    path: str = "/tmp/areal-like"
    exists: bool = True  # a checkpoint on disk (RecoverHandler._load_checkpoint raises without one)


# ---------------------------------------------------------------------------------------------- the trainer


class AwexAdapterLike:
    """`AwexMegatronAdapter`: release and resume by tag with a set, the grad buffers, the writer."""

    def __init__(self, engine: MegatronEngineLike) -> None:
        self._engine = engine
        self._released_tags: set[str] = set()

    def release_memory(self, tags: list[str] | None = None) -> None:
        tags = tags or ["optimizer", "weights"]
        for tag in [t for t in DEVICE_TAGS if t in tags and t not in self._released_tags]:
            self._engine.host[tag] = self._engine.mem[tag]  # a pinned copy (weights), or .to("cpu")
            self._engine.mem[tag] = None
            if tag == "weights":  # the DDP path resizes the grad storage with the params
                self._engine.mem["grads"] = None
            self._released_tags.add(tag)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        tags = tags or ["optimizer", "weights"]
        for tag in [t for t in ("weights", "optimizer") if t in tags and t in self._released_tags]:
            self._engine.mem[tag] = self._engine.host[tag]
            self._released_tags.discard(tag)

    def _release_grad_memory(self) -> None:
        self._engine.mem["grads"] = None

    def ensure_grad_buffers(self) -> None:
        if self._engine.mem["grads"] is None:
            self._engine.mem["grads"] = 0

    def execute_colocate_weight_update(self, version: int) -> None:
        weights_were_offloaded = "weights" in self._released_tags
        self.release_memory(tags=["optimizer"])
        self._release_grad_memory()
        if weights_were_offloaded:
            self.resume_memory(tags=["weights"])
        converted = self._engine.read("weights", "convert_parameters")
        self.release_memory(tags=["weights"])
        self._engine.awex_publish(version, converted)  # the reader's side runs in the scheduler

    def finish_colocate_weight_update(self, training_world_size: int) -> None:
        pass


class MegatronEngineLike:
    """`MegatronEngine`'s AWEX colocate branches (one rank). `mem` holds each tensor's value
    (None: released); `trained` is the version the last train step made."""

    def __init__(self) -> None:
        self.mem: dict[str, int | None] = {"weights": 0, "optimizer": 0, "grads": None}
        self.host: dict[str, int | None] = {}
        self.trained = 0
        self.saved: list[int] = []
        self.is_offload = False
        self._offload_depth = 0
        self._awex_adapter: Any = AwexAdapterLike(self)
        self.rollout_engine: Any = None
        self.rank = 0  # only rank 0 calls the rollout (AReaL: dist.get_rank() == 0)
        self.cpu_group = None
        self.publish: Callable[[int, int], None] = lambda version, value: None

    def read(self, tag: str, what: str) -> int:
        value = self.mem[tag]
        if value is None:
            raise ProtocolViolation(f"body used memory: {what} read {tag!r}, which is released")
        return value

    def awex_publish(self, version: int, value: int) -> None:
        self.publish(version, value)

    @contextlib.contextmanager
    def _offload_aware_context(self) -> Iterator[None]:
        if not self.is_offload:
            yield
            return
        self._offload_depth += 1
        if self._offload_depth == 1:
            self.onload()
        try:
            yield
        finally:
            self._offload_depth -= 1
            if self._offload_depth == 0:
                self.offload()

    def offload(self) -> None:
        self._awex_adapter.release_memory(tags=["optimizer", "weights"])
        self.is_offload = True

    def onload(self) -> None:
        self._awex_adapter.resume_memory(tags=["optimizer", "weights"])
        self.is_offload = False

    def train(self, mode: bool = True) -> MegatronEngineLike:
        return self

    def train_batch(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self.is_offload:  # _ensure_ready
            self.onload()
        self._awex_adapter.ensure_grad_buffers()
        weights = self.read("weights", "train_batch")
        self.read("optimizer", "train_batch")
        self.mem["weights"] = self.trained = max(weights, self.trained) + 1
        return {"loss": 0.0}

    def save(self, meta: Any = None) -> None:
        self._awex_adapter._release_grad_memory()
        with self._offload_aware_context():
            self.saved.append(self.read("weights", "save"))
            self.read("optimizer", "save")

    def load(self, meta: Any = None) -> None:
        if meta is not None and not getattr(meta, "exists", True):
            raise FileNotFoundError(f"Checkpoint path {meta.path} does not exist.")
        with self._offload_aware_context():
            self.read("weights", "load")
            self.read("optimizer", "load")

    def update_weights(self, meta: Any) -> None:
        self._awex_adapter.execute_colocate_weight_update(meta.version or 0)
        self._awex_adapter.finish_colocate_weight_update(training_world_size=1)
        if self.rank == 0:
            self.rollout_engine.onload(tags=["kv_cache"])
            self.rollout_engine.continue_generation()


class LifecycleEngineLike(ArealTrainerMixin, MegatronEngineLike):
    """What an AReaL user writes for the trainer."""


class TrainerRank(LifecycleEngineLike):
    """One trainer rank in a Ray actor: its writer publishes to an `awex_fake_server`; rank 0 reaches
    the rollout (`RayCalls` of its actor), as AReaL's rank 0 reaches it through its callback."""

    def __init__(self, rank: int, server_url: str, rollout: Any = None) -> None:
        super().__init__()
        self.rank = rank
        self.publish = publish_to(server_url)
        self.rollout_engine = rollout

    def flush_logs(self) -> bool:
        from lifecycle import flush_logs

        return flush_logs()


# ---------------------------------------------------------------------------------------------- the rollout


def http_send(url: str, endpoint: str, payload: dict[str, Any]) -> Any:
    """One of AReaL's requests over HTTP (`arequest_with_retry`: an error status raises)."""
    data = json.dumps(payload).encode()
    request = urllib.request.Request(
        f"{url}{endpoint}", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{endpoint} answered {exc.code}: {exc.read().decode(errors='replace')}") from None
    return json.loads(raw) if raw else None


class RemoteEngineLike:
    """`RemoteSGLangEngine` (over `RemoteInfEngine`): AReaL's requests to every server."""

    def __init__(self, addresses: list[str], send: Callable[[str, str, dict[str, Any]], Any]) -> None:
        self._engine = self
        self.addresses = list(addresses)
        self.send = send
        self.workflow_paused = False
        self.answers: list[Any] = []

    def _all(self, endpoint: str, payload: dict[str, Any]) -> None:
        for address in self.addresses:
            self.send(address, endpoint, payload)

    def pause_generation(self) -> None:
        for payload in ({}, {"mode": "in_place"}):  # SGLangBackend.get_pause_requests
            self._all("/pause_generation", payload)

    def continue_generation(self) -> None:
        self._all("/continue_generation", {})

    def offload(self, tags: list[str] | None = None) -> None:
        self._all("/release_memory_occupation", {"tags": tags} if tags is not None else {})

    def onload(self, tags: list[str] | None = None) -> None:
        self._all("/resume_memory_occupation", {"tags": tags} if tags is not None else {})

    def pause(self) -> None:
        self.workflow_paused = True

    def resume(self) -> None:
        self.workflow_paused = False

    def update_weights_from_disk(self, meta: Any) -> Future[None]:
        future: Future[None] = Future()
        try:
            self._all("/update_weights_from_disk", {"model_path": str(meta.path), "abort_all_requests": True})
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    def submit(self) -> None:
        """The workflow's next request (`agenerate`), when the workflow is not paused."""
        if self.workflow_paused:
            return
        self.answers.append(self.send(self.addresses[0], "/generate", {"input_ids": [1, 2, 3]}))


class LifecycleRemoteEngineLike(ArealRolloutMixin, RemoteEngineLike):
    """What an AReaL user writes for the rollout."""

    lifecycle_flush_deadline_s = 0.0

    def flush_logs(self) -> bool:
        from lifecycle import flush_logs

        return flush_logs()


# ---------------------------------------------------------------------------------------------- AReaL's controllers


class RolloutControllerLike:
    """AReaL's `RolloutController` (single controller): each call fanned out to every worker's engine
    (`_collective_rpc`); the trainer's rank-0 `RolloutCallback` reaches it for onload and continue."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    def _collective_rpc(self, method: str, http_timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        return [getattr(engine, method)(**kwargs) for engine in self.engines]

    def pause(self) -> None:
        self._collective_rpc("pause")

    def resume(self) -> None:
        self._collective_rpc("resume")

    def pause_generation_sync(self) -> None:
        self._collective_rpc("pause_generation", http_timeout=120.0)

    def pause_generation(self) -> None:
        self._collective_rpc("pause_generation")

    def continue_generation(self) -> None:
        self._collective_rpc("continue_generation")

    def offload(self, tags: list[str] | None = None) -> None:
        self._collective_rpc("offload", tags=tags, http_timeout=120.0)

    def onload(self, tags: list[str] | None = None) -> None:
        self._collective_rpc("onload", tags=tags, http_timeout=120.0)

    def set_version(self, version: int) -> None:
        pass


class TrainControllerLike:
    """AReaL's `TrainController`: each call fanned out to its workers' engines; `connect_engine`
    gives rank 0 a callback to the rollout controller (here the controller itself)."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.rollout: Any = None

    def connect_engine(self, rollout: Any, meta: Any) -> None:
        self.rollout = rollout
        self.engines[0].rollout_engine = rollout

    def _call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(engine, method)(*args) for engine in self.engines]

    def offload(self) -> None:
        self._call("offload")

    def onload(self) -> None:
        self._call("onload")

    def load(self, meta: Any) -> None:
        self._call("load", meta)

    def update_weights(self, meta: Any) -> None:
        self._call("update_weights", meta)

    def set_version(self, version: int) -> None:
        pass


class LifecycleRolloutController(ArealRolloutControllerMixin, RolloutControllerLike):
    """What an AReaL user writes for the rollout controller."""


class LifecycleTrainController(ArealTrainControllerMixin, TrainControllerLike):
    """What an AReaL user writes for the train controller."""


# ---------------------------------------------------------------------------------------------- SGLang, in this process


class ServerModel:
    """SGLang 0.5.17 and AReaL's AWEX plugin (cbff54d6: its queue read only while the scheduler is
    paused), as far as the model check needs: every sequence that kills or hangs the real server
    raises `ProtocolViolation` (tests/helpers/method_sequences.py names the kinds)."""

    def __init__(self) -> None:
        self.released: set[str] = set()
        self.tokenizer_paused = False  # any pause: requests wait in the tokenizer manager
        self.engine_paused = False  # in_place / retract: the scheduler's flag, what the plugin waits for
        self.running = 0  # requests in flight in the scheduler
        self.held = 0  # requests waiting in the tokenizer manager for the continue
        self.label: str = "checkpoint"  # what the weights hold

    def handle(self, endpoint: str, payload: dict[str, Any]) -> Any:
        tags = payload.get("tags") or ["weights", "kv_cache", "cuda_graph"]
        if endpoint == "/pause_generation":
            mode = payload.get("mode", "abort")
            self.tokenizer_paused = True
            if mode == "abort":
                self.running = self.held = 0
            else:
                self.engine_paused = True
            return None
        if endpoint == "/continue_generation":
            self.tokenizer_paused = self.engine_paused = False
            held, self.held = self.held, 0
            for _ in range(held):
                self._admit("a request held by the pause")
            return None
        if endpoint == "/release_memory_occupation":
            if self.running:
                raise ProtocolViolation(
                    "AssertionError: release_memory_occupation should be called only when server is idle "
                    f"({self.running} running)"
                )
            for tag in (t for t in tags if t in ("weights", "kv_cache")):
                if tag in self.released:
                    raise ProtocolViolation(f"Cannot pause allocation that is not active (tag {tag})")
                self.released.add(tag)
                if tag == "weights":
                    self.label = "garbage"
            return None
        if endpoint == "/resume_memory_occupation":
            for tag in (t for t in tags if t in ("weights", "kv_cache")):
                if tag not in self.released:
                    raise ProtocolViolation(f"KeyError: {tag!r} resumed without a release (the server dies)")
                self.released.discard(tag)
            return None
        if endpoint == "/flush_cache":
            return self.running == 0
        if endpoint == "/v1/loads":
            return {"running": self.running, "waiting": 0}
        if endpoint == "/update_weights_from_disk":
            if "weights" in self.released:
                raise ProtocolViolation(
                    "update_weights_from_disk into released weights: illegal memory access"
                )
            self.running = 0
            self.label = f"v{payload.get('version', 'disk')}"
            return None
        if endpoint == "/generate":
            if self.tokenizer_paused:
                if self.released:
                    raise ProtocolViolation(
                        f"waits forever: a request admitted while generation is paused with {sorted(self.released)} "
                        "released, and nothing left to resume them before a continue"
                    )
                self.held += 1
                return None
            self._admit("a request")
            return None
        raise AssertionError(f"ServerModel: no route {endpoint}")

    def _admit(self, what: str) -> None:
        if self.released:
            raise ProtocolViolation(
                f"Pointer argument cannot be accessed: {what} ran with {sorted(self.released)} released"
            )
        if self.label == "garbage":
            raise ProtocolViolation(f"served discarded weights: {what} read weights a release discarded")
        self.running += 1

    def awex_transfer(self, version: int) -> None:
        """The writer published `version`: the plugin's main loop loads it, if it ever reads the queue."""
        if not self.engine_paused:
            raise ProtocolViolation(
                "AWEX queue never processed: the writer published while the scheduler was not paused in place, "
                "and waits for weights_update_finished forever"
            )
        if "weights" not in self.released:
            raise ProtocolViolation(
                "KeyError: 'weights' resumed without a release (the AWEX reader's resume)"
            )
        self.released.discard("weights")
        self.label = f"v{version}"


class ModelServers:
    """`SGLangServers`' interface over a `ServerModel` (the wrap's hooks in the model check)."""

    def __init__(self, server: ServerModel) -> None:
        self.server = server

    def pause_generation(self, mode: str = "abort") -> None:
        self.server.handle("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.server.handle("/continue_generation", {})

    def flush_cache(self) -> bool:
        return bool(self.server.handle("/flush_cache", {}))

    def queued_requests(self) -> dict[str, int]:
        return dict(self.server.handle("/v1/loads", {}))

    def release_memory_occupation(self, tags: list[str]) -> None:
        self.server.handle("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: list[str]) -> None:
        self.server.handle("/resume_memory_occupation", {"tags": list(tags)})

    def close(self) -> None:
        pass


class ModelRolloutEngine(LifecycleRemoteEngineLike):
    """The wrapped rollout over a `ServerModel` (its hooks in this process)."""

    server: ServerModel

    def lifecycle_servers(self, addresses: Any) -> Any:
        return ModelServers(self.server)


# ---------------------------------------------------------------------------------------------- the loop


def recover_like(trainer: Any, rollout: Any, version: int, *, checkpoint: bool = True) -> None:
    """`RecoverHandler.load`'s AWEX colocate branch: pause and offload the rollout, load the actor's
    checkpoint, push it, and `resume()` in a finally; a missing checkpoint is a warning."""
    try:
        rollout.pause()
        try:
            # the controller's pause_generation_sync: every worker's pause_generation
            sync = getattr(rollout, "pause_generation_sync", None)
            (sync or rollout.pause_generation)()
            rollout.offload(tags=["kv_cache"])
            rollout.offload(tags=["weights"])
            if not checkpoint:
                raise FileNotFoundError("recover checkpoint does not exist")
            trainer.load(Meta(type="dcp"))
            trainer.update_weights(Meta(version=version))
        finally:
            rollout.resume()
    except FileNotFoundError:
        return  # "Resume info not found ... This should not be a resumed experiment!"


@dataclass
class World:
    """One trainer rank and one rollout engine over one server, plain or wrapped."""

    trainer: Any
    rollout: Any
    server: ServerModel
    version: int = 0


def started(wrapped: bool) -> World:
    """As rl_trainer leaves them after init: the actor offloaded (the adapter's own offload before
    SGLang starts), the rollout awake on the launch checkpoint."""
    server = ServerModel()
    trainer = (LifecycleEngineLike if wrapped else MegatronEngineLike)()
    send = lambda address, endpoint, payload: server.handle(endpoint, payload)  # noqa: E731
    rollout: Any
    if wrapped:
        rollout = ModelRolloutEngine(["server"], send)
        rollout.server = server
    else:
        rollout = RemoteEngineLike(["server"], send)
    trainer.rollout_engine = rollout
    trainer.publish = lambda version, value: server.awex_transfer(version)
    trainer.offload()
    return World(trainer, rollout, server)


def _update(world: World) -> None:
    world.version += 1
    world.trainer.update_weights(Meta(version=world.version))


def _recover(world: World, checkpoint: bool) -> None:
    world.version += 1
    recover_like(world.trainer, world.rollout, world.version, checkpoint=checkpoint)


def _request(world: World) -> None:
    world.rollout.resume()
    world.rollout.submit()


# The driver's calls between the trainer and the rollout, as rl_trainer and RecoverHandler make them.
METHODS: dict[str, Callable[[World], object]] = {
    "pause_generation": lambda w: w.rollout.pause_generation(),
    "offload_kv": lambda w: w.rollout.offload(tags=["kv_cache"]),
    "offload_weights": lambda w: w.rollout.offload(tags=["weights"]),
    "onload_kv": lambda w: w.rollout.onload(tags=["kv_cache"]),
    "onload_weights": lambda w: w.rollout.onload(tags=["weights"]),  # rl_trainer's path without AWEX
    "continue_generation": lambda w: w.rollout.continue_generation(),
    "request": _request,
    "actor_onload": lambda w: w.trainer.onload(),
    "actor_offload": lambda w: w.trainer.offload(),
    "train": lambda w: w.trainer.train_batch(),
    "save": lambda w: w.trainer.save(Meta(type="dcp")),
    "update_weights": _update,
    "recover": lambda w: _recover(w, True),
    "recover_no_checkpoint": lambda w: _recover(w, False),
}

# rl_trainer's colocate step, in its order (HEAD), and the same after init.
STEP = (
    "request",
    "pause_generation",
    "offload_kv",
    "offload_weights",
    "actor_onload",
    "train",
    "save",
    "update_weights",
    "request",
)

RESIDENCY_MISMATCH = "the machine's residency is not the backend's"


def check(world: World) -> str | None:
    """Under the adapters: each machine's residency is what its backend holds (AReaL's set, the server's)."""
    trainer, rollout = world.trainer, world.rollout
    for actor, released in (
        (trainer, set(getattr(trainer._awex_adapter, "_released_tags", ()))),
        (rollout, set(world.server.released)),
    ):
        lifecycle = actor.__dict__.get("_lifecycle") or actor.__dict__.get("_lc")
        if lifecycle is None or lifecycle.failure is not None:
            continue
        machine = {t for t, r in lifecycle.residency.items() if r is Residency.RELEASED}
        if machine != released:
            return RESIDENCY_MISMATCH
    return None


# ---------------------------------------------------------------------------------------------- SGLang over HTTP


def awex_fake_server(**kwargs: Any) -> Any:
    """A `FakeSGLangServer` (SGLang 0.5.17 over HTTP) with AReaL's AWEX plugin in its scheduler:
    `engine_paused` is the scheduler's flag (an in_place or retract pause; an abort pause never
    reaches the scheduler), and `POST /_fake/awex_transfer {"version": v}` is the writer's publish,
    which the plugin reads only while that flag is up (cbff54d6): then it resumes `weights` in the
    scheduler (a KeyError kills the server when they were not released) and loads `v`. Unread, the
    writer's wait ends at its timeout: 504."""
    from tests.helpers.sglang_server import FakeSGLangServer

    class AwexFakeServer(FakeSGLangServer):
        engine_paused = False
        transfers: list[int]

        def _route(self, method: str, path: str, query: dict[str, Any], body: dict[str, Any]) -> Any:
            if path == "/pause_generation" and body.get("mode", "abort") in ("in_place", "retract"):
                self.engine_paused = True
            elif path == "/continue_generation":
                self.engine_paused = False
            return super()._route(method, path, query, body)

        def _control(self, path: str, body: Any) -> Any:
            if path == "/_fake/awex_transfer":
                return self.awex_transfer(int(body["version"]))
            return super()._control(path, body)

        def awex_transfer(self, version: int) -> tuple[int, Any]:
            with self.cond:
                if version in getattr(self, "transfers", []):
                    return 200, {"version": version}  # another trainer rank's shard of the same version
                if not self.engine_paused:
                    return 504, {
                        "detail": f"weights_update_finished for v{version} never came: queue not read"
                    }
            self._resume(["weights"])  # the plugin's ResumeMemoryOccupationReqInput(tags=["weights"])
            with self.cond:
                self.labels = dict.fromkeys(self.names, str(version))
                self.transfers = [*getattr(self, "transfers", []), version]
            return 200, {"version": version}

    return AwexFakeServer(**kwargs)


def http_rollout(server: Any, *, wrapped: bool, cls: type | None = None) -> Any:
    """A rollout worker's engine over `server`'s HTTP front, plain or wrapped."""
    klass = cls or (LifecycleRemoteEngineLike if wrapped else RemoteEngineLike)
    return klass([server.url], http_send)


def publish_to(server_url: str) -> Callable[[int, int], None]:
    """The writer's publish to an `awex_fake_server`: raises when the plugin never reads it."""

    def publish(version: int, value: int) -> None:
        http_send(server_url, "/_fake/awex_transfer", {"version": version})

    return publish


# What the search of plain AReaL's sequences finds (test_areal_sequences.py): per kind of violation
# and the call where it happens, a shortest sequence after init.
_KEYERROR = "resumes a tag not released (SGLang's KeyError kills the server)"
_DOUBLE = "pauses a paused tag (torch_memory_saver exits)"
_RELEASED = "generates on released memory (the server dies)"
_IDLE = "releases with requests running (SGLang's fully-idle assertion)"
_BODY = "runs a body on paused memory"
_DISCARDED = "serves weights a release discarded"
REPRODUCTIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("update_weights",), "publishes weights the scheduler never reads (not paused in place)"),
    (("onload_kv",), _KEYERROR),
    (("onload_weights",), _KEYERROR),
    (("pause_generation", "update_weights"), _KEYERROR),
    (("offload_kv", "offload_kv"), _DOUBLE),
    (("offload_weights", "offload_weights"), _DOUBLE),
    (("offload_kv", "recover"), _DOUBLE),
    (("offload_kv", "recover_no_checkpoint"), _DOUBLE),
    (("offload_kv", "request"), _RELEASED),
    (("pause_generation", "request", "offload_kv", "continue_generation"), _RELEASED),
    (("request", "offload_kv"), _IDLE),
    (("request", "offload_weights"), _IDLE),
    (
        ("recover_no_checkpoint", "request"),
        "admits requests that wait forever (generation paused, memory released)",
    ),
    (("actor_onload", "recover", "save"), _BODY),
    (("actor_onload", "recover", "train"), _BODY),
    (("actor_onload", "recover", "recover"), _BODY),
    (("offload_weights", "onload_weights", "request"), _DISCARDED),
    (("pause_generation", "offload_weights", "onload_weights", "request", "continue_generation"), _DISCARDED),
)

"""The calls slime's and miles' rollout side make on one engine actor, as a small world to search
(tests only): one engine (the framework's own class from its source, plain or wrapped), its fake
SGLang server, the router, and the trainer's version.

Each method is one thing the job does, with the calls the framework's own code makes for it (read
from slime 624b824a's `train.py`, `slime/ray/rollout.py`, `update_weight_from_tensor.py`,
`health_monitor.py`, and miles 31f1ca96's `train.py`, `miles/ray/rollout/`): the rollout manager's
offload and onloads, the trainer's weight push, the health monitor's check, a rollout request
through the router, and the fault-tolerance restart of the engine. A world starts as the driver
leaves it before the first rollout: init, offload, onload_weights, push version 1, onload_kv.

`check(world)` names what went wrong on the server after a call: it died (which of the ways the
real one dies), or a generation ran on weights that are not the trainer's current version whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lifecycle.errors import LifecycleError
from tests.helpers.engine_source import engine_args, start_engine
from tests.helpers.sglang_server import FakeRouter, FakeSGLangServer, encode_names

CHUNKS = (("embed", "layer0"), ("lm_head",))  # one version in two buckets

DEATHS = {
    "Cannot pause allocation": "kills the server: a second release (torch_memory_saver exits)",
    "KeyError": "kills the server: a resume of a resident tag (KeyError)",
    "Pointer argument": "kills the server: a generation on released memory (Triton)",
    "into released weights": "kills the server: weights written into released memory",
    "only when server is idle": "kills the server: a release with requests in the scheduler",
}
GARBAGE = "serves discarded weights"
STALE = "serves stale or partly loaded weights"
KILLS = "kills the server: "

# What the search of the job's calls finds on plain slime: per kind of damage and call, the
# shortest sequence after start-up (the model check in rollout_source_suite holds it exact).
SLIME_REPRODUCTIONS = (
    (("onload",), KILLS + "a resume of a resident tag (KeyError)"),
    (("onload_weights",), KILLS + "a resume of a resident tag (KeyError)"),
    (("onload_kv",), KILLS + "a resume of a resident tag (KeyError)"),
    (("offload", "offload"), KILLS + "a second release (torch_memory_saver exits)"),
    (("offload", "generate"), KILLS + "a generation on released memory (Triton)"),
    (("offload", "health"), KILLS + "a generation on released memory (Triton)"),
    (("offload", "update_weights"), KILLS + "weights written into released memory"),
    (("offload", "onload", "generate"), GARBAGE),
)


@dataclass
class World:
    framework: str
    cls: type
    launched: Any
    router: FakeRouter
    args: Any
    version: int = 0
    engine: Any = None
    errors: list[str] = field(default_factory=list)  # the framework's own exceptions, "call: Type: message"
    threads: list[threading.Thread] = field(default_factory=list)
    servers: list[FakeSGLangServer] = field(default_factory=list)

    @property
    def server(self) -> FakeSGLangServer:
        return self.servers[-1]

    def start(self) -> None:
        before = set(self.launched.servers)
        self.engine = start_engine(self.cls, self.args, rank=0, router=self.router)
        new = [s for pid, s in self.launched.servers.items() if pid not in before]
        self.servers.append(new[0])
        self.server.trainer_version = str(self.version) if self.version else None

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for thread in self.threads:
            thread.join(5)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """A framework call; its own exceptions recorded (the server's state says what they mean)."""
        try:
            return fn()
        except LifecycleError:
            raise
        except Exception as exc:
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return None


# ---------------------------------------------------------------------------------------------- the calls


def offload(world: World, tags: list[str] | None = None) -> None:
    """The rollout manager's offload: `release_memory_occupation` (miles: with its tags)."""
    if tags is None:
        world.call("offload", world.engine.release_memory_occupation)
    else:
        world.call("offload", lambda: world.engine.release_memory_occupation(tags=tags))


def onload(world: World, tags: list[str] | None) -> None:
    world.call("onload", lambda: world.engine.resume_memory_occupation(tags=tags))


def update_weights(world: World) -> None:
    """The trainer's `UpdateWeightFromTensor.update_weights` on this engine: pause, flush, (miles:
    begin the session), the buckets, (end it), continue."""
    world.version += 1
    for server in world.servers:
        server.trainer_version = str(world.version)
    engine, version = world.engine, str(world.version)
    if world.framework == "slime":
        world.call("pause_generation", engine.pause_generation)
    else:
        world.call("pause_generation", lambda: engine.pause_generation(mode=world.args.pause_generation_mode))
    world.call("flush_cache", engine.flush_cache)
    if world.framework == "miles":
        world.call("begin_weight_update", engine.begin_weight_update)
    for chunk in CHUNKS:
        world.call(
            "update_weights_from_tensor",
            lambda chunk=chunk: engine.update_weights_from_tensor(
                [encode_names(chunk)], load_format="flattened_bucket", weight_version=version
            ),
        )
    if world.framework == "miles":
        world.call("end_weight_update", engine.end_weight_update)
    world.call("continue_generation", engine.continue_generation)


def health(world: World) -> None:
    """The health monitor's check (`RolloutHealthMonitor._check_engine_health`)."""
    world.call("health_generate", lambda: world.engine.health_generate(timeout=2.0))


def generate(world: World) -> None:
    """One rollout request, from the rollout function through the router (sglang_rollout.generate)."""
    import requests

    def send() -> None:
        payload = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}}
        try:
            requests.post(f"{world.router.url}/generate", json=payload, timeout=30)
        except Exception as exc:
            world.errors.append(f"generate: {type(exc).__name__}: {exc}")

    # A paused server holds the request until generation continues: it then goes on in the background.
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(0.5)
    if thread.is_alive():
        world.threads.append(thread)


def recover(world: World) -> None:
    """Fault tolerance's restart of the engine: the health monitor's `_kill_engine` (shutdown, kill),
    then `RolloutServer.recover` for an updatable group that needs offload: a new actor's init,
    release, resume of the weights (the trainer's next push follows, at its next update)."""
    world.call("shutdown", world.engine.shutdown)
    world.start()
    offload(world)
    onload(world, ["weights"])


def _slime_methods() -> dict[str, Callable[[World], None]]:
    return {
        "offload": offload,
        "onload": lambda w: onload(w, None),
        "onload_weights": lambda w: onload(w, ["weights"]),
        "onload_kv": lambda w: onload(w, ["kv_cache", "cuda_graph"]),
        "update_weights": update_weights,
        "health": health,
        "generate": generate,
        "recover": recover,
    }


def _miles_methods() -> dict[str, Callable[[World], None]]:
    return {
        "offload": lambda w: offload(w, ["cuda_graph", "kv_cache", "weights"]),
        "offload_kv": lambda w: offload(w, ["cuda_graph", "kv_cache"]),  # --offload-rollout-level kv_cache
        "onload": lambda w: onload(w, None),
        "onload_weights": lambda w: onload(w, ["weights"]),
        "onload_kv": lambda w: onload(w, ["kv_cache", "cuda_graph"]),
        "update_weights": update_weights,
        "health": health,
        "generate": generate,
        "recover": recover,
    }


METHODS = {"slime": _slime_methods(), "miles": _miles_methods()}


def started(framework: str, cls: type, launched: Any, router: FakeRouter, **overrides: Any) -> World:
    """A world as the driver leaves it before the first rollout (both frameworks' train.py);
    `overrides` change the job's arguments (miles: `use_miles_router=True`)."""
    router.workers.clear()
    world = World(framework, cls, launched, router, engine_args(framework, router=router, **overrides))
    world.start()
    methods = METHODS[framework]
    methods["offload"](world)  # create_rollout_manager (slime) / the first offload
    methods["onload_weights"](world)
    update_weights(world)
    methods["onload_kv"](world)
    return world


def check(world: World) -> str | None:
    """What went wrong on the servers after the last call, or None."""
    for server in world.servers:
        server.settle()
    for server in world.servers:
        for death in server.deaths:
            for needle, kind in DEATHS.items():
                if needle in death:
                    return kind
            return f"kills the server: {death}"
    for server in world.servers:
        for served in server.served:
            if served["path"] == "/generate" and not served["ok"]:  # a health check's token is thrown away
                return GARBAGE if "garbage" in served["labels"].values() else STALE
    return None

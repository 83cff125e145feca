"""vime's real rollout actor (`VLLMEngine`) and engine groups, from its source files, against a fake
`vllm serve` and a fake vllm-router over real HTTP on localhost (tests only).

`installed(source, tree)` runs, in this process, vime's own `vllm_engine.py`, `engine_group.py`
and `server_control.py` (the files and commits of tests/helpers/vime_manifest.json) and stands in
only for what they import around them: Ray (actors run in this process, `ray.get` returns what it
is given), vLLM's `kill_process_tree` and server field names (read from the pinned 0.26.0 wheel),
vime's host helpers, `RayActor`, `ServerGroupConfig`, `get_server_info`, and `httpx` (the rollout
function's drain, not called here). `requests`, `cloudpickle` and `urllib3` are the real ones.
vime's `launch_server_process` is replaced by one that starts `FakeVLLMServer` (vLLM 0.26.0's
routes, its killers: tests/helpers/vllm_server.py) in this process on the port vime chose: vime's
own spawns `vllm serve` and waits for `GET /health_generate`, a route vLLM 0.26.0 does not serve.
Everything is taken out of `sys.modules` again on exit. `vime_modules` is that setup less the
launch: tests/helpers/vime_serve.py uses it to launch a `vllm serve` process instead (the real one
on the GPU machine, with the installed vLLM; a fake one in a child process on CPU).

The job's calls on one engine (`METHODS`) are the ones vime's own code makes (read from vime
8c1c944b): the rollout manager's offload (`RolloutServer.offload`: level 2, the model is updated)
and onloads, the trainer's `UpdateWeightFromTensor.update_weights` split into its calls (pause,
start, the chunks, finish, continue), and a rollout request through the router. A world starts as
vime's driver leaves it before the first rollout: init, offload, onload_weights, version 1
pushed, onload_kv. `check(world)` names what went wrong: the engine died (which killer), or a
request was served on weights that are not the trainer's current version whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import engine_source, rollout_calls
from tests.helpers.framework_source import FrameworkSource, import_what_stays, ray_stand_in, stand_in_module
from tests.helpers.sglang_server import FakeRouter
from tests.helpers.sglang_source import SourceTree
from tests.helpers.vllm_fake import FakeVLLM, Model, weights
from tests.helpers.vllm_server import FakeVLLMServer
from tests.helpers.vllm_source import field_names

OWN_PACKAGES = ("actor_integration.", "lifecycle.", "tests.")
ROLLOUT_MODULES = (
    "vime/backends/vllm_utils/server_control.py",
    "vime/backends/vllm_utils/vllm_engine.py",
    "vime/backends/vllm_utils/engine_group.py",
)
ENGINE_MODULE = "vime.backends.vllm_utils.vllm_engine"
GROUP_MODULE = "vime.backends.vllm_utils.engine_group"
SERVER_FIELDS = ("vllm.engine.arg_utils.AsyncEngineArgs", "vllm.entrypoints.openai.cli_args.FrontendArgs")
CHUNKS = (
    ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"),
    ("model.norm.weight",),
)  # one version in two chunks, as vime's trainer sends a model in buckets


class RecordingVLLM(FakeVLLM):
    """`FakeVLLM` that records the weights each generation it served read."""

    def __init__(self, tree: SourceTree) -> None:
        super().__init__(tree, weights(0))
        self.served: list[dict[str, Any]] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        tokens = super().generate(prompts, max_tokens)
        garbage = all(bool((t == 7).all()) for t in self.model.params.values())
        self.served.append({"digest": self.model.digest(), "garbage": garbage})
        return tokens


@dataclass
class Launched(engine_source.Launched):
    """The servers vime's `launch_server_process` started in this process, by their stand-in pid
    (`servers`), and what vime would have passed `vllm serve` (`server_args`)."""

    tree: SourceTree | None = None
    server_args: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_pid: int = -2000

    def latest(self) -> FakeVLLMServer:
        if not self.servers:
            raise LookupError("no vLLM server runs: every one launched was killed")
        server: FakeVLLMServer = self.servers[min(self.servers)]
        return server


def _wrap_ipv6(host: str) -> str:
    """vime.utils.http_utils._wrap_ipv6: an IPv6 literal in brackets, anything else as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _not_here(what: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{what} is not stood in: the vime rollout suites do not call it")

    return call


def _stand_ins(launched: engine_source.Launched, *, stand_in_vllm: bool = True) -> None:
    from tests.helpers.vime_source import RayActor, _LocalActorClass

    for package in ("vime", "vime.backends", "vime.backends.vllm_utils", "vime.ray", "vime.utils"):
        stand_in_module(package, __path__=[])
    stand_in_module("vime.ray.ray_actor", RayActor=RayActor)
    stand_in_module(
        "vime.ray.utils",
        NOSET_VISIBLE_DEVICES_ENV_VARS_LIST=["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"],
        add_default_ray_env_vars=lambda env_vars: dict(env_vars),
    )
    stand_in_module(
        "vime.utils.http_utils",
        _wrap_ipv6=_wrap_ipv6,
        get_host_info=lambda: ("localhost", "127.0.0.1"),
        get=_not_here("vime.utils.http_utils.get"),
        post=_not_here("vime.utils.http_utils.post"),
    )
    stand_in_module(
        "vime.backends.vllm_utils.external", get_server_info=_not_here("get_server_info (external engines)")
    )
    config = dataclasses.make_dataclass(
        "ServerGroupConfig",
        [("worker_type", str), ("num_gpus", int), ("num_gpus_per_engine", int), ("overrides", dict)],
    )
    stand_in_module("vime.backends.vllm_utils.vllm_config", ServerGroupConfig=config)
    stand_in_module(
        "httpx", AsyncClient=_not_here("httpx.AsyncClient"), HTTPError=type("HTTPError", (Exception,), {})
    )

    def kill_process_tree(pid: int, **_: Any) -> None:
        server = launched.servers.pop(pid, None)
        if server is not None:
            server.close()

    if stand_in_vllm:
        for name in ("vllm", "vllm.utils"):
            stand_in_module(name, __path__=[])
        stand_in_module("vllm.utils.system_utils", kill_process_tree=kill_process_tree)

    ray_stand_in(_LocalActorClass, wait=lambda refs, num_returns=1, timeout=None: (list(refs), []))
    stand_in_module(  # engine_group passes placement_group_capture_child_tasks too
        "ray.util.scheduling_strategies",
        PlacementGroupSchedulingStrategy=lambda **kwargs: types.SimpleNamespace(**kwargs),
    )


def _in_process_launch(launched: Launched) -> Callable[[dict[str, Any]], Any]:
    def launch_server_process(server_args_dict: dict[str, Any]) -> Any:
        assert launched.tree is not None
        server = FakeVLLMServer(
            RecordingVLLM(launched.tree),
            host=str(server_args_dict["host"]).strip("[]"),
            port=int(server_args_dict["port"]),
            **launched.options,
        )
        pid = launched.next_pid
        launched.next_pid -= 1
        launched.servers[pid] = server
        launched.server_args[pid] = {k: v for k, v in server_args_dict.items() if not k.startswith("_")}
        return engine_source._InProcess(pid, server)

    return launch_server_process


@contextlib.contextmanager
def vime_modules(
    source: FrameworkSource,
    launched: engine_source.Launched,
    server_fields: frozenset[str],
    *,
    stand_in_vllm: bool = True,
) -> Iterator[tuple[Any, Any]]:
    """(vime's vllm_engine module, its engine_group module), run from vime's source with the stand-ins
    above; vime's launch is left to the caller to replace. `stand_in_vllm=False` keeps the installed
    vLLM (the GPU machine's: import what vime needs of it before). `server_fields`: the vLLM server
    fields vime maps its `--vllm-*` flags onto (`_VLLM_SERVER_FIELDS`: vime reads them from
    `vllm.entrypoints.launchers.cli_args`, which 0.26.0 does not have). Undone on exit, the servers
    `launched` holds closed first."""
    import_what_stays()
    before, environ = dict(sys.modules), dict(os.environ)
    try:
        _stand_ins(launched, stand_in_vllm=stand_in_vllm)
        for path in ROLLOUT_MODULES:
            name = path.removesuffix(".py").replace("/", ".")
            module = stand_in_module(name, __package__=name.rpartition(".")[0])
            module.__file__ = f"<vime {source.commit_of(path)[:8]}>/{path}"
            exec(compile(source.read(path), module.__file__, "exec"), module.__dict__)
        engine_module = sys.modules[ENGINE_MODULE]
        engine_module._VLLM_SERVER_FIELDS = server_fields
        yield engine_module, sys.modules[GROUP_MODULE]
    finally:
        launched.close()
        os.environ.clear()  # the actors' runtime_env went into it (vime_source's local Ray)
        os.environ.update(environ)
        for name in [n for n in sys.modules if n not in before and not n.startswith(OWN_PACKAGES)]:
            del sys.modules[name]
        sys.modules.update(before)


def wheel_server_fields(tree: SourceTree) -> frozenset[str]:
    """vLLM 0.26.0's server fields (`AsyncEngineArgs`'s and `FrontendArgs`'), read from its wheel."""
    return frozenset(set().union(*(field_names(tree, c) for c in SERVER_FIELDS)))


@contextlib.contextmanager
def installed(source: FrameworkSource, tree: SourceTree) -> Iterator[tuple[Any, Any, Launched]]:
    """(vime's vllm_engine module, its engine_group module, the servers launched), from vime's source."""
    launched = Launched(tree=tree)
    with vime_modules(source, launched, wheel_server_fields(tree)) as (engine_module, group_module):
        engine_module.launch_server_process = _in_process_launch(launched)
        yield engine_module, group_module, launched


def engine_args(*, offload: bool = True, **overrides: Any) -> Any:
    """vime's parsed flags the engine actor and its group read, for a colocated job of one GPU per engine:
    slime's (vime's are slime's) less SGLang's, plus vime's own (fresh each time: vime's
    `_compute_server_args` writes `vllm_enable_sleep_mode` into them)."""
    args = engine_source.engine_args("slime", offload=offload)
    for name in [n for n in vars(args) if n.startswith("sglang_")]:
        delattr(args, name)
    vars(args).update(
        rollout_num_gpus=1,
        debug_train_only=False,
        use_critic=False,
        rollout_health_check_timeout=10,
        vllm_dp_size=1,
        **overrides,
    )
    return args


# ---------------------------------------------------------------------------------------------- the world


KILLERS = {
    "segfault": "kills the engine: a weight update into sleeping weights (EngineCore segfault, vllm #57853)",
    "generate with": "kills the engine: a generation on sleeping memory (illegal memory access)",
    "sleep with requests": "kills the engine: a sleep with requests running",
}
GARBAGE = "serves discarded weights"
STALE = "serves stale or partly loaded weights"

_DIGESTS: dict[int, str] = {}


def digest(version: int) -> str:
    """The fake model's digest holding the trainer's version `version` whole (0: the checkpoint)."""
    if version not in _DIGESTS:
        _DIGESTS[version] = Model(weights(version)).digest()
    return _DIGESTS[version]


@dataclass
class World:
    """One engine actor (vime's class, plain or wrapped), its server, the router, the trainer's version."""

    cls: type
    launched: Launched
    router: FakeRouter
    args: Any
    engine: Any = None
    version: int = 0  # the trainer's current version: the last it finished
    sending: int | None = None  # the version a start opened
    errors: list[str] = field(default_factory=list)  # vime's own exceptions, "call: Type: message"

    @property
    def server(self) -> FakeVLLMServer:
        return self.launched.latest()

    @property
    def fake(self) -> RecordingVLLM:
        fake = self.server.fake
        assert isinstance(fake, RecordingVLLM)
        return fake

    def start(self) -> None:
        self.engine = engine_source.start_engine(self.cls, self.args, router=self.router)

    call = rollout_calls.World.call  # vime's own exceptions recorded, the lifecycle's raised

    def close(self) -> None:
        self.launched.close()


def update_info(world: World, chunk: tuple[str, ...], version: int) -> dict[str, Any]:
    """One chunk of `version` as vime's trainer sends it (names, dtypes, shapes, one IPC handle per
    tensor), its tensors "exported" into the fake's handle table."""
    tensors = weights(version)
    handles = []
    for name in chunk:
        key = len(world.fake.ipc)
        world.fake.ipc[key] = tensors[name].clone()
        handles.append({"fake-gpu": (key,)})
    return {
        "names": list(chunk),
        "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in chunk],
        "shapes": [list(tensors[n].shape) for n in chunk],
        "ipc_handles": handles,
    }


def offload(world: World) -> None:
    """vime's `RolloutServer.offload`: `release_memory_occupation(level=2)` (the model is updated)."""
    world.call("offload", lambda: world.engine.release_memory_occupation(level=2))


def onload_weights(world: World) -> None:
    world.call("onload_weights", lambda: world.engine.resume_memory_occupation(tags=["weights"]))


def onload_kv(world: World) -> None:
    world.call("onload_kv", lambda: world.engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"]))


def pause(world: World) -> None:
    """The trainer's pause (`in_place` between flushes; vime sends vLLM `keep`)."""
    world.call("pause", lambda: world.engine.pause_generation(mode="in_place"))


def start(world: World) -> None:
    world.sending = world.version + 1  # the trainer counts its version up before the update
    world.call("start", world.engine.start_weight_update)


def update(world: World) -> None:
    """The trainer's chunks of the version it sends (`_send_weight_chunks`: every chunk)."""
    version = world.sending or world.version + 1
    for chunk in CHUNKS:
        world.call(
            "update", lambda chunk=chunk: world.engine.update_weights(update_info(world, chunk, version))
        )


def finish(world: World) -> None:
    version = world.sending or world.version + 1
    world.sending = None
    before = len(world.errors)
    world.call("finish", lambda: world.engine.finish_weight_update(weight_version=str(version)))
    if len(world.errors) == before:
        world.version = version


def resume(world: World) -> None:
    world.call("continue", world.engine.continue_generation)


def generate(world: World) -> Any:
    """One rollout request through the router (vllm-router forwards `/v1/completions`); what it was
    served on is held against the trainer's version at that time."""
    import requests

    payload = {"model": "tiny", "prompt": [[1, 2, 3]], "max_tokens": 4, "return_token_ids": True}
    answer = None
    with contextlib.suppress(requests.RequestException):
        answer = requests.post(f"{world.router.url}/v1/completions", json=payload, timeout=10)
    for server in world.launched.servers.values():
        for served in server.fake.served:
            served.setdefault("expected", digest(world.version))
    return answer


def push(world: World) -> None:
    """The trainer's whole `update_weights` on this engine: pause, start, the chunks, finish, continue."""
    for step in (pause, start, update, finish, resume):
        step(world)


def started(cls: type, launched: Launched, router: FakeRouter, **overrides: Any) -> World:
    """A world as vime's driver leaves it before the first rollout (see the module doc)."""
    world = World(cls, launched, router, engine_args(**overrides))
    world.start()
    offload(world)
    onload_weights(world)
    push(world)
    onload_kv(world)
    assert not world.errors and world.version == 1, world.errors
    return world


METHODS: dict[str, Callable[[World], Any]] = {
    "offload": offload,
    "onload_weights": onload_weights,
    "onload_kv": onload_kv,
    "pause": pause,
    "start": start,
    "update": update,
    "finish": finish,
    "continue": resume,
    "generate": generate,
}


def check(world: World) -> str | None:
    """What went wrong on the server after a call (None: nothing)."""
    for server in world.launched.servers.values():
        dead = server.fake.dead
        if dead is not None:
            return next(
                (kind for needle, kind in KILLERS.items() if needle in dead), f"kills the engine: {dead}"
            )
    for server in world.launched.servers.values():
        for served in server.fake.served:
            if served["digest"] != served.get("expected", digest(world.version)):
                return GARBAGE if served["garbage"] else STALE
    return None

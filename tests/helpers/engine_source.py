"""slime's and miles' real `SGLangEngine` (their rollout actor), from their source at the pinned
commits, against `FakeSGLangServer` and `FakeRouter` over real HTTP on localhost (tests only).

`installed(framework, source)` runs, in this process, the framework's own `sglang_engine.py` and
`ray_actor.py` from its source, and stands in only for what they import around them: `requests`
(`requests_stand_in`, over real HTTP), SGLang's `ServerArgs` (a dataclass with the fields of the
pinned SGLang's, read from its wheel), `kill_process_tree`, the host and port helpers, miles' LoRA
and environment-report helpers, `sglang_router.__version__`. `launch="spawn"` keeps the
framework's own `launch_server_process`, which spawns SGLang's `launch_server` (the fake's, in a
child process); the default runs each server in this process (the same `FakeSGLangServer`,
started by a stand-in for that one function), so a search can start thousands of them.
Everything is taken out of `sys.modules` again on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import requests_stand_in
from tests.helpers.framework_source import FrameworkSource, free_port, import_what_stays, stand_in_module
from tests.helpers.sglang_server import VERSION_ENV, FakeSGLangServer

OWN_PACKAGES = ("actor_integration.", "lifecycle.", "tests.")
SLIME_MODULES = ("slime/ray/ray_actor.py", "slime/backends/sglang_utils/sglang_engine.py")
MILES_MODULES = ("miles/ray/ray_actor.py", "miles/backends/sglang_utils/sglang_engine.py")
ENGINE_MODULE = {
    "slime": "slime.backends.sglang_utils.sglang_engine",
    "miles": "miles.backends.sglang_utils.sglang_engine",
}


@dataclass
class Launched:
    """The servers `launch_server_process` started in this process, by their stand-in pid."""

    servers: dict[int, FakeSGLangServer] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # FakeSGLangServer keyword arguments
    next_pid: int = -1000

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


class _InProcess:
    """What `launch_server_process` returns (a `multiprocessing.Process`), for an in-process server."""

    def __init__(self, pid: int, server: FakeSGLangServer) -> None:
        self.pid, self.server = pid, server

    def is_alive(self) -> bool:
        return self.server.alive


def _server_args_class(fields: set[str]) -> type:
    """SGLang's ServerArgs as a dataclass with the pinned release's field names."""
    defaults = {"host": "127.0.0.1", "port": 30000, "node_rank": 0, "nnodes": 1, "encoder_only": False}
    spec = [(name, Any, dataclasses.field(default=defaults.get(name))) for name in sorted(fields)]

    def url(self: Any) -> str:
        return f"http://{self.host}:{self.port}"

    def reduce(self: Any) -> tuple[Any, ...]:
        return (types.SimpleNamespace, (), dict(vars(self)))  # what a spawned launch_server reads

    return dataclasses.make_dataclass("ServerArgs", spec, namespace={"url": url, "__reduce__": reduce})


def _kill_process_tree(launched: Launched) -> Any:
    def kill(pid: int, **_: Any) -> None:
        server = launched.servers.pop(pid, None)
        if server is not None:
            server.close()
        elif pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    return kill


def _common(launched: Launched, server_fields: set[str] | None, framework: str) -> None:
    try:
        import requests  # noqa: F401 - the real one where it is installed (the GPU machine)
    except ImportError:
        requests_stand_in.install()
    _frameworks_helpers(framework)
    if server_fields is None:
        return  # the real sglang
    stand_in_module("sglang", __path__=[])
    stand_in_module("sglang.srt", __path__=[])
    stand_in_module("sglang.srt.server_args", ServerArgs=_server_args_class(server_fields))
    stand_in_module("sglang.srt.utils", kill_process_tree=_kill_process_tree(launched))
    stand_in_module("sglang.srt.entrypoints", __path__=[])
    from tests.helpers.sglang_server import launch_server

    stand_in_module("sglang.srt.entrypoints.http_server", launch_server=launch_server)


def _frameworks_helpers(framework: str) -> None:
    for package in (framework, f"{framework}.utils", f"{framework}.ray", f"{framework}.backends"):
        stand_in_module(package, __path__=[])
    stand_in_module(f"{framework}.backends.sglang_utils", __path__=[])
    stand_in_module(
        f"{framework}.utils.misc",
        get_current_node_ip=lambda: "127.0.0.1",
        get_free_port=lambda start_port=10000, consecutive=1: free_port(),
    )
    stand_in_module(f"{framework}.utils.http_utils", get_host_info=lambda: ("localhost", "127.0.0.1"))


def _slime_stand_ins() -> None:
    stand_in_module("slime.utils.accelerator", resolve_visible_device_id=lambda index: int(index))

    def get_server_info(url: str) -> Any:
        import requests

        return requests.get(f"{url}/server_info", timeout=10).json()

    stand_in_module("slime.backends.sglang_utils.external", get_server_info=get_server_info)


def _miles_stand_ins(router_version: str) -> None:
    stand_in_module("sglang_router", __version__=router_version)
    stand_in_module("miles.backends.megatron_utils", __path__=[])
    stand_in_module(
        "miles.backends.megatron_utils.lora_utils",
        convert_target_modules_to_hf=lambda modules: list(modules or []),
        lora_base_cpu_backup_enabled=lambda args: False,
        sglang_lora_target_all_sentinel=lambda args: False,
    )
    stand_in_module("miles.utils.env_report", collect_and_print_node_env_report=lambda **kwargs: None)
    stand_in_module(
        "miles.utils.lora", LORA_ADAPTER_NAME="miles_lora", lora_rollout_enabled=lambda args: False
    )
    stand_in_module("miles.utils.multi_lora", is_multi_lora_enabled=lambda args: False)


def _launch_without_host_write(engine_module: Any) -> Any:
    """The framework's `launch_server_process` less its `server_args.host = server_args.host.strip("[]")`,
    which SGLang 0.5.17's resolved `ServerArgs` refuses ("assigned after resolution; server_args is
    read-only"): the same spawn of SGLang's `launch_server` and the framework's own health wait."""

    def launch_server_process(server_args: Any) -> Any:
        import multiprocessing

        from sglang.srt.entrypoints.http_server import launch_server

        if server_args.host != server_args.host.strip("[]"):
            raise ValueError(
                f"an IPv6 host {server_args.host!r}: SGLang 0.5.17 cannot take the framework's rewrite"
            )
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
        multiprocessing.set_start_method("spawn", force=True)
        process = multiprocessing.Process(target=launch_server, args=(server_args,))
        process.start()
        if getattr(server_args, "node_rank", 0) != 0:
            return process
        engine_module._wait_server_healthy(
            base_url=server_args.url(), api_key=server_args.api_key, is_process_alive=process.is_alive
        )
        return process

    return launch_server_process


@contextlib.contextmanager
def installed(
    framework: str,
    source: FrameworkSource,
    *,
    server_fields: set[str] | None,
    version: str = "0.5.17",
    launch: str = "in_process",
    router_version: str = "0.3.2",
) -> Iterator[tuple[types.ModuleType, Launched]]:
    """(the framework's sglang_engine module run from its source, the in-process servers).

    `server_fields=None`: the installed sglang itself (the GPU machine), launched by the framework."""
    if server_fields is None:
        launch = "spawn"
    if framework not in ENGINE_MODULE or launch not in ("in_process", "spawn"):
        raise ValueError(f"installed({framework!r}, launch={launch!r})")
    import_what_stays()
    before = dict(sys.modules)
    children = set(multiprocessing.active_children())
    environ = os.environ.get(VERSION_ENV)
    os.environ[VERSION_ENV] = version
    launched = Launched(options={"version": version})
    try:
        _common(launched, server_fields, framework)
        if framework == "slime":
            _slime_stand_ins()
        else:
            _miles_stand_ins(router_version)
        for path in SLIME_MODULES if framework == "slime" else MILES_MODULES:
            name = path.removesuffix(".py").replace("/", ".")
            module = stand_in_module(name, __package__=name.rpartition(".")[0])
            module.__file__ = f"<{framework} {source.commit}>/{path}"
            exec(compile(source.read(path), module.__file__, "exec"), module.__dict__)
        engine_module = sys.modules[ENGINE_MODULE[framework]]
        if server_fields is None:
            engine_module.launch_server_process = _launch_without_host_write(engine_module)
        if launch == "in_process":
            original_wait = engine_module._wait_server_healthy

            def launch_server_process(server_args: Any) -> Any:
                server = FakeSGLangServer(
                    host=server_args.host.strip("[]"),
                    port=int(server_args.port),
                    weights_cpu_backup=bool(getattr(server_args, "enable_weights_cpu_backup", False)),
                    custom_weight_loader=getattr(server_args, "custom_weight_loader", None),
                    **launched.options,
                )
                pid = launched.next_pid
                launched.next_pid -= 1
                launched.servers[pid] = server
                handle = _InProcess(pid, server)
                if getattr(server_args, "node_rank", 0) != 0:
                    return handle if framework == "slime" else None
                original_wait(
                    base_url=server_args.url(), api_key=server_args.api_key, is_process_alive=handle.is_alive
                )
                return handle

            engine_module.launch_server_process = launch_server_process
        yield engine_module, launched
    finally:
        launched.close()
        for child in set(multiprocessing.active_children()) - children:  # servers a failed test left running
            child.kill()
            child.join(10)
        if environ is None:
            os.environ.pop(VERSION_ENV, None)
        else:
            os.environ[VERSION_ENV] = environ
        for name in [n for n in sys.modules if n not in before and not n.startswith(OWN_PACKAGES)]:
            del sys.modules[name]  # the stand-ins and the framework's modules; the project's own stay
            # imported (a second copy of a module would make a second class of each of its types)
        sys.modules.update(before)


def engine_args(
    framework: str, *, offload: bool = True, router: Any = None, **overrides: Any
) -> types.SimpleNamespace:
    """The parsed flags the engine actor reads, for a colocated job with one GPU per engine."""
    args = types.SimpleNamespace(
        num_gpus_per_node=1,
        rollout_num_gpus_per_engine=1,
        colocate=True,
        debug_rollout_only=False,
        actor_num_gpus_per_node=1,
        actor_num_nodes=1,
        sglang_pp_size=1,
        sglang_dp_size=1,
        sglang_ep_size=1,
        hf_checkpoint="model",
        seed=1234,
        offload_rollout=offload,
        use_rollout_routing_replay=False,
        fp16=False,
        rollout_external=False,
        sglang_router_ip=None if router is None else router.host,
        sglang_router_port=None if router is None else router.port,
    )
    if framework == "miles":
        vars(args).update(
            env_report=None,
            use_rollout_indexer_replay=False,
            use_miles_router=False,
            pause_generation_mode="retract",
        )
    vars(args).update(overrides)
    return args


def start_engine(
    cls: type, args: Any, *, rank: int = 0, router: Any = None, dist_init_addr: str | None = None, **init: Any
) -> Any:
    """The engine actor as the rollout manager builds and initialises it (ports from free ones)."""
    engine = cls(
        args,
        rank=rank,
        worker_type="regular",
        base_gpu_id=0,
        num_gpus_per_engine=args.rollout_num_gpus_per_engine,
    )
    engine.init(
        dist_init_addr=dist_init_addr or f"127.0.0.1:{free_port()}",
        port=free_port(),
        nccl_port=free_port(),
        host="127.0.0.1",
        router_ip=None if router is None else router.host,
        router_port=None if router is None else router.port,
        **init,
    )
    return engine


@contextlib.contextmanager
def slime_like_installed() -> Iterator[tuple[types.ModuleType, Any]]:
    """(a module whose `SGLangEngine` is `slime_engine_like.SlimeLikeEngine`, its servers by pid), with
    `requests` stood in; for CI, where slime's source is not reachable. Undone on exit."""
    import_what_stays()
    before = dict(sys.modules)
    try:
        if "requests" not in sys.modules:
            requests_stand_in.install()
        sys.modules.pop("tests.helpers.slime_engine_like", None)
        import importlib

        like = importlib.import_module("tests.helpers.slime_engine_like")
        module = types.ModuleType("slime_like_engine")
        module.SGLangEngine = like.SlimeLikeEngine  # type: ignore[attr-defined]
        yield module, types.SimpleNamespace(servers=like.SERVERS)
        for server in like.SERVERS.values():
            server.close()
        like.SERVERS.clear()
    finally:
        for name in [n for n in sys.modules if n not in before and not n.startswith(OWN_PACKAGES)]:
            del sys.modules[name]  # the stand-ins and the framework's modules; the project's own stay
            # imported (a second copy of a module would make a second class of each of its types)
        sys.modules.update(before)

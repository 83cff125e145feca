"""vime's `VLLMEngine` over a `vllm serve` process (tests only): the real server on the GPU machine, a
fake one in a child process on CPU, both launched the same way.

`installed_serve(source, log_dir)` runs vime's rollout modules as `vime_rollout.vime_modules` does
(Ray run in this process) and replaces only vime's `launch_server_process` (8c1c944b), which vLLM
0.26.0 cannot take as it is:
- vime's `_run_vllm_server` imports `vllm.entrypoints.launchers.cli_args` (0.26.0 has
  `vllm.entrypoints.openai.cli_args`) and hands vLLM's parser a namespace of its arguments;
- vime's `_wait_server_healthy` waits on `GET /health_generate`, which 0.26.0 does not serve (404:
  vime's launch would wait forever).
The replacement starts `python -m vllm.entrypoints.cli.main serve MODEL --flag value ...` from the
arguments vime computed (`_compute_server_args`), leaving out and recording those 0.26.0 has no
field for (`ServeLaunched.launches`: vime 8c1c944b passes `enable_scale_out`), in the environment
vime's own `_build_subprocess_env` builds (CUDA_VISIBLE_DEVICES from vime's GPU choice,
VLLM_SERVER_DEV_MODE=1 for the sleep and weight-transfer routes, VLLM_USE_V2_MODEL_RUNNER=1, and for
a colocated job VLLM_ALLOW_INSECURE_SERIALIZATION=1: vime's `update_weights` sends the IPC handles
cloudpickled in `ipc_handles_pickled`, which 0.26.0's `IPCWeightTransferEngine.parse_update_info`
refuses to unpickle without it). It waits on `GET /health` and returns the server's process as
vime's launch returns its own (`ServeProcess`: pid, is_alive, exitcode, kill, join: what vime's
`shutdown` and the wrap's process watch read). Every server still running is killed, with its
whole process tree, on exit.

`fake_wheel` (CPU): vLLM stood in as `vime_rollout` does, and the program is this module's `main`: a
`FakeVLLMServer` (vLLM 0.26.0's routes and killers, read from that wheel) in a child process, whose
weight-transfer handles carry the tensors themselves (`inline_sender` stands in for vLLM's
`IPCWeightTransferEngine.trainer_send_weights`, which needs CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import engine_source
from tests.helpers.framework_source import FrameworkSource
from tests.helpers.vime_rollout import vime_modules, wheel_server_fields

REPO = Path(__file__).resolve().parents[2]
VLLM_PROGRAM = ("-m", "vllm.entrypoints.cli.main")  # `vllm serve`, by the interpreter running the tests
FAKE_PROGRAM = ("-m", "tests.helpers.vime_serve")
VIME_ENV = (  # what of the environment vime's `_build_subprocess_env` sets the figures show
    "CUDA_VISIBLE_DEVICES",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "NCCL_CUMEM_ENABLE",
)


def _die_with_the_tests() -> None:
    """In the child before exec (Linux): SIGKILL it when the test process exits, however it exits."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServeProcess:
    """A `vllm serve` process, with the surface of the `multiprocessing.Process` vime's launch
    returns (pid, is_alive, exitcode, kill, join); its output goes to `log_path`."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_the_tests,  # the test's main thread starts it (vime's init)
            )

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill_tree(self, timeout_s: float = 30.0) -> list[int]:
        """SIGKILL every process of the server (its descendants, then itself), reaped; the pids."""
        import psutil

        try:
            descendants = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for process in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.kill()
        self.join(timeout_s)
        psutil.wait_procs(descendants, timeout=timeout_s)
        return [p.pid for p in descendants] + [self.pid]

    def close(self) -> None:
        self.kill_tree()

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


@dataclass
class ServeLaunched(engine_source.Launched):
    """The servers vime's (replaced) launch started, by pid, and how each was started (`launches`:
    the command line, the arguments left out, vime's environment)."""

    log_dir: Path = Path()
    launches: list[dict[str, Any]] = field(default_factory=list)

    def process(self) -> ServeProcess:
        if not self.servers:
            raise LookupError("no vllm serve process runs: every one launched was killed")
        process: ServeProcess = self.servers[max(self.servers)]
        return process


def serve_argv(kwargs: dict[str, Any], fields: frozenset[str]) -> tuple[list[str], list[str]]:
    """`vllm serve`'s command line for vime's server arguments: the model first, then one flag per
    field (True `--x`, False `--no-x`, a dict or list as JSON, None left out); the arguments that are
    no field of this vLLM's are left out and returned."""
    import json

    arguments = dict(kwargs)
    argv, dropped = ["serve", str(arguments.pop("model"))], []
    for key, value in arguments.items():
        if key not in fields:
            dropped.append(key)
            continue
        if value is None:
            continue
        flag = key.replace("_", "-")
        if value is True:
            argv.append(f"--{flag}")
        elif value is False:
            argv.append(f"--no-{flag}")
        elif isinstance(value, (dict, list)):
            argv += [f"--{flag}", json.dumps(value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv, dropped


def wait_healthy(url: str, process: ServeProcess, deadline_s: float) -> float:
    """Wait for `GET {url}/health` to answer 200 while `process` runs; the seconds waited."""
    import requests

    started = time.monotonic()
    while True:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        if not process.is_alive():
            raise RuntimeError(
                f"vllm serve exited (code {process.exitcode}) before {url}/health answered; "
                f"{process.log_path}:\n{process.log_tail()}"
            )
        if time.monotonic() - started > deadline_s:
            process.kill_tree()
            raise TimeoutError(
                f"vllm serve did not answer {url}/health within {deadline_s:.0f} s; {process.log_path}:\n"
                f"{process.log_tail()}"
            )
        time.sleep(0.5)


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the repository first on PYTHONPATH (vLLM's workers import the lifecycle's extension)."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@contextlib.contextmanager
def serving(
    program: tuple[str, ...],
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    url: str,
    deadline_s: float,
) -> Iterator[tuple[ServeProcess, float]]:
    """`python <program> <argv>` (`VLLM_PROGRAM` or `FAKE_PROGRAM`'s) in `env`, waited on at
    `GET {url}/health`: (the process, the seconds its start took); its tree killed on exit."""
    process = ServeProcess([sys.executable, *program, *argv], env, log_path)
    try:
        yield process, wait_healthy(url, process, deadline_s)
    finally:
        process.kill_tree()


def _serve_launch(
    engine_module: Any,
    launched: ServeLaunched,
    fields: frozenset[str],
    program: tuple[str, ...],
    deadline_s: float,
) -> Callable[[dict[str, Any]], ServeProcess]:
    def launch_server_process(server_args_dict: dict[str, Any]) -> ServeProcess:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # as vime's launch does
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
        env = with_repo_on_path(engine_module._build_subprocess_env(server_args_dict))  # vime's own
        kwargs = {k: v for k, v in server_args_dict.items() if not k.startswith("_")}
        host = engine_module._wrap_ipv6(kwargs.get("host") or "127.0.0.1")
        kwargs["host"] = host.strip("[]")
        argv, dropped = serve_argv(kwargs, fields)
        log_path = launched.log_dir / f"vllm-serve-{len(launched.launches)}.log"
        process = ServeProcess([sys.executable, *program, *argv], env, log_path)
        launched.servers[process.pid] = process
        launch = {
            "argv": argv,
            "dropped": dropped,
            "env": {k: env.get(k) for k in VIME_ENV},
            "log": str(log_path),
        }
        launched.launches.append(launch)
        if server_args_dict.get("node_rank", 0) == 0:
            launch["up_s"] = round(wait_healthy(f"http://{host}:{kwargs['port']}", process, deadline_s), 1)
        return process

    return launch_server_process


def installed_vllm_fields() -> frozenset[str]:
    """The installed vLLM's server fields (`AsyncEngineArgs`'s and `FrontendArgs`'), as vime reads them."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import FrontendArgs

    classes = (AsyncEngineArgs, FrontendArgs)
    return frozenset(f.name for c in classes for f in dataclasses.fields(c))


@contextlib.contextmanager
def installed_serve(
    source: FrameworkSource, log_dir: Path, *, fake_wheel: Path | None = None, deadline_s: float = 900.0
) -> Iterator[tuple[Any, Any, ServeLaunched]]:
    """(vime's vllm_engine module, its engine_group module, the servers launched): vime's
    `launch_server_process` starts `vllm serve` (the installed vLLM's; with `fake_wheel`, this
    module's fake of that wheel's) in a child process. Undone on exit, every server killed."""
    launched = ServeLaunched(log_dir=log_dir)
    if fake_wheel is None:
        fields = installed_vllm_fields()
        program: tuple[str, ...] = VLLM_PROGRAM
        # what vime and the test import of vLLM, imported before Ray is stood in (they stay imported)
        import vllm.distributed.weight_transfer.ipc_engine
        import vllm.utils.system_utils  # noqa: F401
    else:
        from tests.helpers.sglang_source import SourceTree
        from tests.helpers.vllm_source import VERSION

        tree = SourceTree(fake_wheel, VERSION)
        try:
            fields = wheel_server_fields(tree)
        finally:
            tree.close()
        program = (*FAKE_PROGRAM, "--wheel", str(fake_wheel))
    with vime_modules(source, launched, fields, stand_in_vllm=fake_wheel is not None) as (
        engine_module,
        group,
    ):
        # vime's `_build_subprocess_env` puts vime's root on the server's PYTHONPATH
        sys.modules["vime"].__file__ = str(Path(source.location) / "vime" / "__init__.py")
        engine_module.launch_server_process = _serve_launch(
            engine_module, launched, fields, program, deadline_s
        )
        yield engine_module, group, launched


def unknown_serve_flags(argv: list[str], wheel: Path) -> tuple[list[str], list[str]]:
    """(the flags of a `vllm serve` command line, those vLLM's parser would not know): read from the
    wheel's source, not run; its parser defines the engine's flags one by one in
    `EngineArgs.add_cli_args`, and one per field of `FrontendArgs` (`FrontendArgs.add_cli_args`)."""
    from tests.helpers.sglang_source import SourceTree
    from tests.helpers.vllm_source import VERSION, field_names

    tree = SourceTree(wheel, VERSION)
    try:
        engine_flags = tree.source("vllm.engine.arg_utils")
        frontend = field_names(tree, "vllm.entrypoints.openai.cli_args.FrontendArgs")
    finally:
        tree.close()
    flags = [a for a in argv if a.startswith("--")]
    unknown = [
        f
        for f in flags
        if f'"{f}"' not in engine_flags and f.removeprefix("--").replace("-", "_") not in frontend
    ]
    return flags, unknown


def update_fields(info: Any) -> dict[str, Any]:
    """What vime's trainer hands `VLLMEngine.update_weights`: vLLM's `IPCWeightTransferUpdateInfo` fields
    (the dataclass `trainer_send_weights` gives its `send_mode`), as a dict."""
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return dict(info)


# ---------------------------------------------------------------------------------------------- the CPU fake


def inline_sender(iterator: Iterator[tuple[str, Any]], trainer_args: dict[str, Any]) -> None:
    """`IPCWeightTransferEngine.trainer_send_weights` for the fake server in a child process: the same
    update fields, sent in two chunks, each handle carrying its tensor (a CPU copy) instead of CUDA's."""
    named = list(iterator)
    middle = max(1, len(named) // 2)
    for chunk in (named[:middle], named[middle:]):
        if not chunk:
            continue
        trainer_args["send_mode"](
            {
                "names": [n for n, _ in chunk],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                "shapes": [list(t.shape) for _, t in chunk],
                "ipc_handles": [{"fake-gpu": ("inline", t.detach().to("cpu", copy=True))} for _, t in chunk],
                "packed": False,
            }
        )


def _fake_serve(argv: list[str] | None = None) -> None:
    """The fake `vllm serve` (`FakeVLLMServer` over vLLM 0.26.0's routes) until the test process exits."""
    from tests.helpers.sglang_source import SourceTree
    from tests.helpers.vllm_fake import FakeVLLM, weights
    from tests.helpers.vllm_server import FakeVLLMServer
    from tests.helpers.vllm_source import VERSION

    parser = argparse.ArgumentParser(prog="fake vllm serve")
    parser.add_argument("--wheel", required=True)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, rest = parser.parse_known_args(argv)
    wanted = {
        "VLLM_SERVER_DEV_MODE": "the sleep and weight-transfer routes",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "",
    }
    missing = [name for name in wanted if os.environ.get(name) != "1"]
    if missing or "--enable-sleep-mode" not in rest:
        sys.exit(f"fake vllm serve: needs {missing} set to 1 and --enable-sleep-mode (got {rest})")

    class InlineVLLM(FakeVLLM):
        """Opens the handles `inline_sender` sends (the tensor itself) as the fake's own IPC table."""

        def update(self, update_info: dict[str, Any]) -> None:
            handles = []
            for handle in update_info.get("ipc_handles") or []:
                kind, *rest_of = handle["fake-gpu"]
                if kind == "inline":
                    key = len(self.ipc)
                    self.ipc[key] = rest_of[0]
                    handle = {"fake-gpu": (key,)}
                handles.append(handle)
            super().update({**update_info, "ipc_handles": handles})

    server = FakeVLLMServer(
        InlineVLLM(SourceTree(Path(args.wheel), VERSION), weights(0)),
        model=args.model,
        host=args.host,
        port=args.port,
    )
    # The executor's sleep and wake lines on this process's output (the server's log), as vLLM's are.
    executor_log = logging.getLogger("vllm.v1.executor.abstract")
    executor_log.setLevel(logging.INFO)
    to_log = logging.StreamHandler(sys.stdout)
    to_log.setFormatter(logging.Formatter("(EngineCore) %(levelname)s %(message)s"))
    executor_log.addHandler(to_log)
    print(f"fake vllm serve {args.model} on {server.url}: {' '.join(rest)}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # the test process is gone: so is this server
        time.sleep(0.5)


if __name__ == "__main__":
    _fake_serve()

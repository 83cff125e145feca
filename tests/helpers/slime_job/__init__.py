"""slime's own `train.py` as a job on a real Ray cluster on a CPU machine, launched as the docs say (tests only).

`build(source, root)` writes slime's source at the pinned commit (`git archive`; nothing of slime is
stored in this repository) with one-line stand-ins over the modules that need a GPU, Megatron-LM or
SGLang (`stand_ins`), and a directory of stand-in packages for SGLang, its router, httpx, wandb
and torch_memory_saver. `RayHead` is `ray start --head --block` (a fake GPU, as many CPUs as asked),
stopped by its own process session. `run(job, args, ...)` starts the driver the way `ray job
submit` does (the job's runtime env in `RAY_JOB_CONFIG_JSON_ENV_VAR`, its `env_vars` in the
driver's environment, `RAY_ADDRESS` the head): `python3 train.py` in slime's tree, nothing else.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.framework_source import free_port
from tests.helpers.slime_job import stand_ins
from tests.helpers.slime_source import SlimeSource

ROOT = Path(__file__).resolve().parents[3]
STAND_INS = "tests.helpers.slime_job.stand_ins"


def _reexport(*names: str, why: str) -> str:
    return (
        f"# stand-in written by tests/helpers/slime_job: {why}\nfrom {STAND_INS} import (  # noqa: F401\n"
        + "".join(f"    {name},\n" for name in names)
        + ")\n"
    )


def _aliases(names: list[str], to: str, why: str) -> str:
    return f"# stand-in written by tests/helpers/slime_job: {why}\n" + "".join(
        f"from {STAND_INS} import {to} as {name}  # noqa: F401\n" for name in names
    )


def _overlays(source_of: Any) -> dict[str, str]:
    """slime's files replaced in the job's tree: path → content."""
    megatron = "slime/backends/megatron_utils"
    out = {
        "slime/utils/accelerator/__init__.py": _reexport(
            *stand_ins.ACCELERATOR, why="a CPU plays the device"
        ),
        "slime/utils/memory_utils.py": _reexport(*stand_ins.MEMORY_UTILS, why="no device memory to read"),
        f"{megatron}/update_weight/common.py": _reexport("named_params_and_buffers", why="Megatron's names"),
        f"{megatron}/update_weight/update_weight_from_tensor.py": _reexport(
            "UpdateWeightFromTensor", why="CUDA IPC buckets need a GPU"
        ),
        f"{megatron}/update_weight/update_weight_from_disk.py": _reexport(
            "UpdateWeightFromDisk", why="unused"
        ),
        f"{megatron}/update_weight/update_weight_from_distributed.py": _reexport(
            "UpdateWeightFromDistributed", why="unused"
        ),
        f"{megatron}/megatron_patch/__init__.py": "# stand-in: slime's patch of Megatron-LM's grad coalescing\n",
    }
    for module, names in stand_ins.MEGATRON.items():
        out[f"{megatron}/{module}.py"] = _reexport(
            *names, why="Megatron's model and training step need a GPU"
        )
    for module, names in stand_ins.NO_OPS.items():
        out[f"{megatron}/{module}.py"] = _aliases(
            names, "no_op", why="Megatron-side helpers of the training step"
        )
    backuper = source_of("slime/utils/tensor_backper.py")
    assert "\nimport torch\n" in backuper, (
        "slime's tensor_backper no longer imports torch as the stand-in expects"
    )
    out["slime/utils/tensor_backper.py"] = backuper.replace(
        "\nimport torch\n",
        f"\nimport torch\nfrom {STAND_INS} import NO_PINNED_TORCH as torch  # stand-in: no pinned memory on a CPU\n",
        1,
    )
    return out


SITE = {
    "megatron/training/__init__.py": "",
    "megatron/training/arguments.py": _reexport(
        "megatron_parse_args", "megatron_validate_args", why="Megatron-LM"
    )
    + "parse_args, validate_args = megatron_parse_args, megatron_validate_args\n",
    "megatron/training/tokenizer/__init__.py": "",
    "megatron/training/tokenizer/tokenizer.py": _reexport("vocab_size_with_padding", why="Megatron-LM")
    + "_vocab_size_with_padding = vocab_size_with_padding\n",
    "aiohttp/__init__.py": "# stand-in: slime's reward hub posts with it only to a remote reward model\n"
    "ClientSession = TCPConnector = ClientTimeout = object\n",
    "pylatexenc/__init__.py": "",
    "pylatexenc/latex2text.py": "# stand-in: slime's math grading of LaTeX answers\nLatexNodes2Text = object\n",
    "wandb/__init__.py": "# stand-in: slime calls wandb only with --use-wandb\nrun = None\n",
    "httpx/__init__.py": _reexport(
        "AsyncClient", "HTTPStatusError", "Limits", "Timeout", why="httpx is not installed"
    ),
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/constants.py": _reexport(
        "GPU_MEMORY_TYPE_WEIGHTS",
        "GPU_MEMORY_TYPE_KV_CACHE",
        "GPU_MEMORY_TYPE_CUDA_GRAPH",
        why="SGLang's names",
    ),
    "sglang/srt/server_args.py": _reexport("ServerArgs", why="SGLang's ServerArgs, the fields slime sets"),
    "sglang/srt/utils.py": _reexport("kill_process_tree", why="SGLang's"),
    "sglang/srt/entrypoints/__init__.py": "",
    "sglang/srt/entrypoints/http_server.py": _reexport("launch_server", why="the fake server"),
    "sglang_router/__init__.py": '__version__ = "0.3.2"\n',
    "sglang_router/launch_router.py": _reexport("RouterArgs", why="the job's router is the test's"),
    "torch_memory_saver/__init__.py": _reexport(
        "torch_memory_saver", why="slime's fork's Python API on a CPU"
    )
    + "from . import utils  # noqa: F401,E402\n",
    "torch_memory_saver/utils.py": _reexport(
        "get_binary_path_from_package", why="the library next to the package"
    ),
    # Found by slime's launcher and put in LD_PRELOAD (the loader ignores it: no ELF): the names the
    # fork's library exports (its csrc/entrypoint.cpp at 8d30c59c), which the capability check reads.
    stand_ins.PRELOAD_LIBRARY: "\n".join(stand_ins.FORK_LIBRARY_EXPORTS) + "\n",
}


@dataclass(frozen=True)
class SlimeJob:
    tree: Path  # slime's source with the stand-ins: the driver's working directory
    site: Path  # the stand-in packages
    logs: Path  # RL_LIFECYCLE_LOG_DIR of every actor

    def python_path(self) -> str:
        return os.pathsep.join(str(p) for p in (self.site, self.tree, ROOT))


def build(source: SlimeSource, root: Path) -> SlimeJob:
    """slime's tree at the source's commit with the stand-ins, under `root`."""
    return write_job(source, root, "slime", _overlays(source.read), SITE)


def write_job(
    source: Any, root: Path, package: str, overlays: dict[str, str], site_files: dict[str, str]
) -> SlimeJob:
    """A framework's tree (`package`, train.py, train_async.py) at the source's commit under
    `root/package`, with `overlays` written over its files and `site_files` as the stand-in site."""
    tree, site, logs = root / package, root / "site", root / "lifecycle-logs"
    for path in (tree, site, logs):
        path.mkdir(parents=True)
    archive = subprocess.run(
        [*source._git(), "archive", "--format=tar", source.commit, package, "train.py", "train_async.py"],
        capture_output=True,
        timeout=120,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    for relative, content in overlays.items():
        (tree / relative).write_text(content)
    for relative, content in site_files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return SlimeJob(tree=tree, site=site, logs=logs)


class RayHead:
    """`ray start --head --block` in a session of its own: a fake GPU on this CPU machine."""

    def __init__(self, root: Path, *, cpus: int, gpus: int = 1, attempts: int = 3) -> None:
        # The port is free when picked, not when Ray binds it: another process on the machine (a
        # second test run) can take it in between. Ray then fails to start its GCS ("Address already
        # in use"); the head is started again on other ports.
        for attempt in range(1, attempts + 1):
            try:
                self._start(root, cpus=cpus, gpus=gpus)
                return
            except RuntimeError as error:
                if attempt == attempts or "Failed to start GCS" not in str(error):
                    raise

    def _start(self, root: Path, *, cpus: int, gpus: int) -> None:
        self.port = free_port()
        self.temp = Path(f"/tmp/rlj{os.getpid()}_{self.port}")  # Ray's socket paths must stay short
        self.log = root / "ray-head.log"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        command = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--num-cpus={cpus}",
            f"--num-gpus={gpus}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--temp-dir={self.temp}",
        ]
        self.process = subprocess.Popen(
            command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while "will now block" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start --head did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """SIGTERM to `ray start`, then SIGKILL to what is left of its session (every process it started)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=20)
        for pid in session_pids(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        shutil.rmtree(self.temp, ignore_errors=True)  # Ray's session files and sockets


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (a `ray start` started in a session of its own: all it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def ray_head(root: Path, *, cpus: int, gpus: int = 1) -> Iterator[RayHead]:
    head = RayHead(root, cpus=cpus, gpus=gpus)
    try:
        yield head
    finally:
        head.stop()


@dataclass(frozen=True)
class JobRun:
    returncode: int
    output: str


def runtime_env(
    job: SlimeJob,
    *,
    wrap: str | None,
    extra_env: Mapping[str, str],
    hook: str = "actor_integration.frameworks.launch.slime",
) -> dict[str, Any]:
    """The documented runtime env JSON (the hook and RL_LIFECYCLE_WRAP), with what slime's scripts put
    in env_vars anyway (PYTHONPATH) and the test's own (where logs go, the fake server's version)."""
    env_vars = {"PYTHONPATH": job.python_path(), "RL_LIFECYCLE_LOG_DIR": str(job.logs), **extra_env}
    if wrap is not None:
        env_vars["RL_LIFECYCLE_WRAP"] = wrap
    return {"worker_process_setup_hook": hook, "env_vars": env_vars}


def run(
    job: SlimeJob,
    head: RayHead,
    argv: list[str],
    *,
    env: Mapping[str, Any],
    timeout_s: float = 600.0,
    script: str = "train.py",
) -> JobRun:
    """slime's train.py (or `script`) as `ray job submit --runtime-env-json ENV -- python3 train.py ARGV` starts it."""
    env_vars = {**env["env_vars"], "SLIME_JOB_SITE": str(job.site)}
    runtime = {**env, "env_vars": env_vars}
    driver_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RL_LIFECYCLE_"))}
    driver_env.update(env_vars)  # the job supervisor's process has them, and its child inherits them
    driver_env.update(
        RAY_ADDRESS=head.address,
        RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps({"runtime_env": runtime}),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        RAY_DEDUP_LOGS="0",
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.Popen(
        [sys.executable, script, *argv],
        cwd=job.tree,
        env=driver_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[test] the driver ran past {timeout_s} s and was killed"
    return JobRun(proc.returncode, output)

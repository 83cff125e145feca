"""What the slime, vime and miles source loaders share (tests only): reading a framework's source at a
pinned commit, putting stand-in modules in place, Ray run in the calling process, free ports.

Nothing of either framework is stored in this repository: `FrameworkSource.read` takes a file from a
checkout or git directory (`git show COMMIT:PATH`) or from a tree `export_tree` wrote for a machine
without git (the resolved commit in its COMMIT file).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


class SourceUnavailable(RuntimeError):
    """A framework's source is not reachable here (CI has no network): its suite skips."""


@dataclass(frozen=True)
class FrameworkSource:
    """A framework's source at one commit; subclasses name the variables that find it."""

    location: Path
    commit: str

    SOURCE_ENV: ClassVar[str]
    COMMIT_ENV: ClassVar[str]
    DEFAULT_COMMIT: ClassVar[str]
    HOW_TO_RUN: ClassVar[str]
    PROBE: ClassVar[str]  # a file every commit has: `find` reads it to fail early, with the reason
    UNAVAILABLE: ClassVar[type[SourceUnavailable]] = SourceUnavailable

    @classmethod
    def find(cls) -> Any:
        given = os.environ.get(cls.SOURCE_ENV)
        if not given:
            raise cls.UNAVAILABLE(f"{cls.SOURCE_ENV} is not set; {cls.HOW_TO_RUN}")
        source = cls(Path(given).expanduser(), os.environ.get(cls.COMMIT_ENV, cls.DEFAULT_COMMIT))
        source.read(cls.PROBE)
        return source

    def _exported(self) -> bool:
        return (self.location / "COMMIT").is_file()

    def _git(self) -> list[str]:
        is_git_dir = (self.location / "HEAD").is_file() and (self.location / "objects").is_dir()
        return ["git", f"--git-dir={self.location}"] if is_git_dir else ["git", "-C", str(self.location)]

    def read(self, path: str) -> str:
        if self._exported():
            return (self.location / path).read_text()
        command = [*self._git(), "show", f"{self.commit}:{path}"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise self.UNAVAILABLE(f"`{' '.join(command)}` failed: {proc.stderr.strip()}; {self.HOW_TO_RUN}")
        return proc.stdout

    def resolved_commit(self) -> str:
        if self._exported():
            return (self.location / "COMMIT").read_text().strip()
        command = [*self._git(), "rev-parse", self.commit]
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip()

    def export(self, destination: Path, paths: Iterable[str]) -> Any:
        """`paths` written as plain files with the resolved commit in COMMIT; never commit the result."""
        for path in paths:
            target = destination / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.read(path))
        (destination / "COMMIT").write_text(self.resolved_commit() + "\n")
        return type(self)(destination, self.commit)


def suite_source(cls: type[FrameworkSource], who: str) -> tuple[Any, Any, Any]:
    """For a source suite: (the source or None, its `pytestmark`, an autouse fixture to assign).

    The suite skips where nobody pointed at the source (CI); a location given on purpose but
    unreadable fails every test with the reason instead.
    """
    import pytest

    try:
        source, unavailable = cls.find(), ""
    except cls.UNAVAILABLE as exc:
        source, unavailable = None, str(exc)
    mark = pytest.mark.skipif(
        cls.SOURCE_ENV not in os.environ, reason=f"{who} source is not available: {cls.HOW_TO_RUN}"
    )

    @pytest.fixture(autouse=True)
    def source_readable() -> None:
        if source is None:
            pytest.fail(f"{cls.SOURCE_ENV} is set but {who} source cannot be read: {unavailable}")

    return source, mark, source_readable


def import_what_stays() -> None:
    """Import the real packages a block of stand-ins must not drop, before it takes its snapshot of
    `sys.modules` (the block then removes only what was imported inside it): `requests`, which does
    not survive a re-import, and Ray, which the frameworks' modules import: dropped and imported again,
    a second copy of Ray's Python modules runs over the one `ray._raylet` the process keeps, and the
    next `ray.init` in the process segfaults."""
    for name in ("requests", "ray"):
        with contextlib.suppress(ImportError):
            __import__(name)


def stand_in_module(name: str, **attrs: Any) -> types.ModuleType:
    """A module named `name` in sys.modules (and as its parent's attribute) holding `attrs`."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def ray_stand_in(local_actor_class: Callable[[type, dict[str, Any]], Any], **extra: Any) -> None:
    """`ray` run in this process: `ray.remote(cls)` is `local_actor_class(cls, options)`; `ray.get` returns
    what it is given; one GPU (index 0) on 127.0.0.1; `extra` adds the framework's other calls."""

    def remote(*args: Any, **options: Any) -> Any:
        if args and isinstance(args[0], type):  # bare @ray.remote
            return local_actor_class(args[0], {})
        return lambda cls: local_actor_class(cls, options)

    stand_in_module(
        "ray",
        remote=remote,
        get=lambda refs, timeout=None: refs,
        get_gpu_ids=lambda: [0],
        _private=types.SimpleNamespace(
            services=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")
        ),
        **extra,
    )
    stand_in_module("ray.util")
    stand_in_module(
        "ray.util.placement_group",
        PlacementGroup=type("PlacementGroup", (), {}),
        placement_group=lambda bundles, strategy="PACK": None,
    )
    stand_in_module(
        "ray.util.scheduling_strategies",
        PlacementGroupSchedulingStrategy=lambda placement_group, placement_group_bundle_index: None,
    )


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
        s.bind(("", port))
        return True
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def initialize_megatron_groups(args: Any) -> None:
    """What slime's and miles' `initialize.init` do to process groups: Megatron's groups from the parsed
    flags, through the `dist.new_group` the framework has patched by then (so each is wrapped)."""
    import torch
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-dp-pp",
    )
    torch.manual_seed(args.seed + 100 * mpu.get_pipeline_model_parallel_rank())


def group_counts(framework: str) -> dict[str, int]:
    """Groups torch holds in this process, and the framework's registry of wrappers (`<framework>_registry`)."""
    import torch.distributed as dist

    groups_module = sys.modules[f"{framework}.utils.reloadable_process_group"]
    registry = groups_module.ReloadableProcessGroup.GROUPS
    return {
        "live": len(dist.distributed_c10d._world.pg_map),
        f"{framework}_registry": len(registry.get(os.getpid(), [])),
    }


def launcher_env() -> dict[str, str]:
    """What slime's RayTrainGroup (vime's alike) and miles' allocate_gpus_for_actor put in an offloaded
    megatron actor's environment (this CPU torch's preload library: CUDA 13's)."""
    from actor_integration.backends.tms_env import preload_library

    return {"LD_PRELOAD": preload_library(13), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}


def error_of(call: Callable[[], Any]) -> str | None:
    """`call()`'s exception as "Type: message", or None when it returned."""
    try:
        call()
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

"""vLLM's source, read from the pinned wheel without importing it, for checking the vLLM adapters.

The wheel (~290 MiB: its compiled kernels; only its .py files are read) is downloaded once by
hash into the cache (`~/.cache/rl-lifecycle/vllm`, or under `$XDG_CACHE_HOME`), as SGLang's is:
the parsing (`SourceTree`, signatures, struct fields, FastAPI routes) is `sglang_source`'s, which
knows nothing SGLang-specific but its messages. `binds()` checks one call against the signature
vLLM declares; `route_problem()` one HTTP request against vLLM's route and its query parameters.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from tests.helpers.sglang_source import (
    OFFLINE_ENV,
    ClassSym,
    FunctionSym,
    Route,
    SourceTree,
    WheelUnavailable,
    _sha256,
)

VERSION = "0.26.0"  # the newest vLLM that pins torch 2.11 (what the GPU machine runs)
SHA256 = "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_TAGS = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp")
WHEEL_TAGS += ("--abi", "abi3")

LLM = "vllm.entrypoints.llm.LLM"
LLM_ENGINE = "vllm.v1.engine.llm_engine.LLMEngine"
MP_CLIENT = "vllm.v1.engine.core_client.MPClient"
SAMPLING_PARAMS = "vllm.sampling_params.SamplingParams"
IPC_UPDATE_INFO = "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferUpdateInfo"
IPC_ENGINE = "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferEngine"
GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
EXECUTOR = "vllm.v1.executor.abstract.Executor"
PAUSE_MODE = "vllm.v1.engine.PauseMode"
SERVER_MODULES = (
    "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.dev.rlhf.api_router",
    "vllm.entrypoints.serve.dev.cache.api_router",
    "vllm.entrypoints.serve.dev.rpc.api_router",
    "vllm.entrypoints.serve.instrumentator.health",
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.models.api_router",
)
COMPLETION_REQUEST = "vllm.entrypoints.openai.completion.protocol.CompletionRequest"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rl-lifecycle" / "vllm"


def cached_wheel() -> Path | None:
    path = cache_dir() / WHEEL
    return path if path.is_file() and _sha256(path) == SHA256 else None


def fetch_wheel(timeout_s: float = 600.0) -> Path:
    """The pinned wheel from the cache, or downloaded there with pip (no dependencies, no install)."""
    cached = cached_wheel()
    if cached is not None:
        return cached
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        command += [*WHEEL_TAGS, f"vllm=={VERSION}", "-d", tmp]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise WheelUnavailable(f"`{' '.join(command)}` did not finish within {timeout_s:.0f} s") from exc
        got = Path(tmp) / WHEEL
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise WheelUnavailable(f"`{' '.join(command)}` exited {proc.returncode}: {tail}")
        digest = _sha256(got)
        if digest != SHA256:
            raise WheelUnavailable(f"{WHEEL} has sha256 {digest}, expected {SHA256}")
        os.replace(got, target / WHEEL)
    return target / WHEEL


def open_tree() -> SourceTree:
    """vLLM's source tree, or a skip (`RL_LIFECYCLE_OFFLINE=1` without the cached wheel) or a failure."""
    import pytest

    if os.environ.get(OFFLINE_ENV) == "1":
        wheel = cached_wheel()
        if wheel is None:
            pytest.skip(
                f"{OFFLINE_ENV}=1 and vllm {VERSION}'s wheel is not cached: the source checks need it"
            )
    else:
        try:
            wheel = fetch_wheel()
        except WheelUnavailable as exc:
            pytest.fail(
                f"cannot fetch vllm {VERSION}'s wheel to check the adapters against its source: {exc}. "
                f"On a machine without the package registry set {OFFLINE_ENV}=1 to skip these checks.",
                pytrace=False,
            )
    return SourceTree(wheel, VERSION)


# ---------------------------------------------------------------------------------------------- calls


def method(tree: SourceTree, dotted_class: str, name: str) -> FunctionSym:
    found = tree.cls(dotted_class).method(name)
    if found is None:
        raise AttributeError(f"vllm {VERSION}: {dotted_class} has no method {name}")
    return found


def binds(
    tree: SourceTree, dotted_class: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise TypeError unless `dotted_class.name(*args, **kwargs)` binds to vLLM's signature."""
    signature = method(tree, dotted_class, name).signature(bound=True)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"vllm {VERSION}: {dotted_class}.{name}{signature} refuses {args!r} {kwargs!r}: {exc}"
        ) from exc


def construct(tree: SourceTree, dotted_class: str, kwargs: dict[str, Any]) -> None:
    """Raise TypeError unless `dotted_class(**kwargs)` binds to its fields or `__init__`."""
    cls: ClassSym = tree.cls(dotted_class)
    try:
        cls.constructor().bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"vllm {VERSION}: {dotted_class}({sorted(kwargs)}) does not bind: {exc}") from exc


def field_names(tree: SourceTree, dotted_class: str) -> set[str]:
    return {f.name for f in tree.cls(dotted_class).fields()}


# ---------------------------------------------------------------------------------------------- routes


def routes(tree: SourceTree) -> dict[str, Route]:
    return tree.routes(*SERVER_MODULES)


def query_parameters(route: Route) -> set[str]:
    """The query parameters a handler reads: `raw_request.query_params.get/getlist("x")` in its body,
    and parameters declared with `Query(...)` (or `Annotated[..., Query()]`)."""
    found: set[str] = set()
    for node in ast.walk(route.handler.node):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "getlist")
            and ast.unparse(node.func.value).endswith("query_params")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    signature = route.handler.signature(bound=False)
    for param in signature.parameters.values():
        annotation = route.handler.annotation(param.name)
        declared = ast.unparse(annotation) if annotation is not None else ""
        if "Query" in declared or "Query(" in repr(param.default):
            found.add(param.name)
    return found


def route_problem(tree: SourceTree, method_name: str, target: str) -> str | None:
    """Why vLLM's server would not route `method_name target` (with its query) as the adapter means it."""
    split = urllib.parse.urlsplit(target)
    route = routes(tree).get(split.path)
    if route is None:
        return f"vllm {VERSION} has no route {split.path}"
    if method_name not in route.methods:
        return f"vllm {VERSION} serves {split.path} with {sorted(route.methods)}, not {method_name}"
    asked = {k for k, _v in urllib.parse.parse_qsl(split.query)}
    unknown = asked - query_parameters(route)
    if unknown:
        return f"vllm {VERSION}'s {split.path} reads no query parameter {sorted(unknown)}"
    return None


def literal_choices(tree: SourceTree, dotted: str) -> tuple[Any, ...]:
    """The values of a module-level `X = Literal[...]` alias (vLLM's PauseMode)."""
    module, name = dotted.rsplit(".", 1)
    for node in tree.module(module).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
            if isinstance(value, ast.Subscript) and ast.unparse(value.value).endswith("Literal"):
                elements = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
                return tuple(ast.literal_eval(e) for e in elements)
    raise LookupError(f"vllm {VERSION}: {dotted} is not a Literal alias")


__all__ = [
    "binds",
    "cached_wheel",
    "construct",
    "fetch_wheel",
    "field_names",
    "literal_choices",
    "method",
    "open_tree",
    "route_problem",
    "routes",
]

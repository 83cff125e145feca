"""miles' own `train.py` and `train_async.py` as jobs on a real Ray cluster on a CPU machine (tests only).

What `tests.helpers.slime_job` does for slime, for miles (slime's maintained fork): `build(source,
root)` writes miles' source at the pinned commit (`git archive`; nothing of miles is stored in this
repository) with one-line stand-ins over the modules that need a GPU, Megatron-LM or SGLang
(`stand_ins`), and a directory of stand-in packages: slime_job's (SGLang, its router, httpx, wandb,
torch_memory_saver, Megatron-LM's parser) and the few more miles imports on its driver's path
(fastapi, uvicorn, polars, ... for servers and dashboards a job here never starts). The Ray head,
the runtime env and the driver's start are slime_job's (`ray_head`, `runtime_env(hook=...)`,
`run(script=...)`), with `actor_integration.frameworks.launch.miles` as the job's setup hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers import slime_job
from tests.helpers.miles_job import stand_ins
from tests.helpers.miles_source import MilesSource
from tests.helpers.slime_job import JobRun, RayHead, SlimeJob, ray_head, run

__all__ = ["HOOK", "JobRun", "RayHead", "SlimeJob", "build", "ray_head", "run", "runtime_env"]

HOOK = "actor_integration.frameworks.launch.miles"
STAND_INS = "tests.helpers.miles_job.stand_ins"


def _reexport(*names: str, why: str) -> str:
    return (
        f"# stand-in written by tests/helpers/miles_job: {why}\nfrom {STAND_INS} import (  # noqa: F401\n"
        + "".join(f"    {name},\n" for name in names)
        + ")\n"
    )


def _module(why: str, **values: str) -> str:
    return f"# stand-in written by tests/helpers/miles_job: {why}\n" + "".join(
        f"{name} = {value}\n" for name, value in values.items()
    )


def _overlays(source_of: Any) -> dict[str, str]:
    """miles' files replaced in the job's tree: path → content."""
    out: dict[str, str] = {}
    for path, (names, why) in stand_ins.OVERLAYS.items():
        out[path] = _reexport(*names, why=why)
    for path, names in stand_ins.NO_OPS.items():
        out[path] = out.get(path, f"# stand-in written by tests/helpers/miles_job: {path}\n") + "".join(
            f"from {STAND_INS} import no_op as {name}  # noqa: F401\n" for name in names
        )
    for path in stand_ins.CPU_TORCH_MODULES:
        text = source_of(path)
        assert "\nimport torch\n" in text, f"miles' {path} no longer imports torch as the stand-in expects"
        out[path] = text.replace(
            "\nimport torch\n",
            f"\nimport torch\nfrom {STAND_INS} import CPU_TORCH as torch  # stand-in: a CPU plays the device\n",
            1,
        )
    return out


SITE = {
    **slime_job.SITE,
    "megatron/training/arguments.py": _reexport(
        "megatron_parse_args", "megatron_validate_args", why="Megatron-LM's parser, the flags miles reads"
    )
    + "parse_args, validate_args = megatron_parse_args, megatron_validate_args\n",
    "polars/__init__.py": _module(
        "miles' dashboard names its dtypes at import (no dashboard here)",
        **{
            name: f"{name!r}"
            for name in ("Float64", "Float32", "String", "Int64", "Int32", "Null", "Boolean")
        },
    ),
    "httpx/__init__.py": _reexport(
        "AsyncClient", "HTTPError", "HTTPStatusError", "Limits", "Timeout", why="httpx is not installed"
    ),
    "pybase64/__init__.py": "# stand-in: base64's own\nfrom base64 import b64decode, b64encode  # noqa: F401\n",
    "setproctitle/__init__.py": _module("process titles", setproctitle="lambda title: None"),
    "uvicorn/__init__.py": _module("miles' session server and router (not started here)"),
    "fastapi/__init__.py": _module(
        "miles' session server and router (not started here)",
        FastAPI="type('FastAPI', (), {})",
        HTTPException="type('HTTPException', (Exception,), {})",
        Query="lambda *a, **k: None",
        Request="type('Request', (), {})",
    ),
    "fastapi/responses.py": _module(
        "miles' servers' responses",
        FileResponse="type('FileResponse', (), {})",
        Response="type('Response', (), {})",
        JSONResponse="type('JSONResponse', (), {})",
    ),
    "fastapi/staticfiles.py": _module("miles' dashboard", StaticFiles="type('StaticFiles', (), {})"),
    "starlette/__init__.py": "",
    "starlette/responses.py": _module(
        "miles' servers' responses",
        Response="type('Response', (), {})",
        JSONResponse="type('JSONResponse', (), {})",
    ),
    "sglang/srt/entrypoints/openai/__init__.py": "from . import encoding_dsv4  # noqa: F401\n",
    "sglang/srt/entrypoints/openai/encoding_dsv4.py": "# stand-in: SGLang's DeepSeek-V4 chat encoding\n",
    "sglang/srt/function_call/__init__.py": "",
    "sglang/srt/function_call/core_types.py": _module(
        "SGLang's tool calls", ToolCallItem="type('ToolCallItem', (), {})"
    ),
    "sglang/srt/function_call/function_call_parser.py": _module(
        "SGLang's tool calls", FunctionCallParser="type('FunctionCallParser', (), {})"
    ),
    "sglang/srt/server_args.py": _reexport(
        "ServerArgs", why="SGLang's ServerArgs, the fields miles sets or reads"
    ),
    "sglang/srt/utils.py": slime_job.SITE["sglang/srt/utils.py"]
    + "MultiprocessingSerializer = type('MultiprocessingSerializer', (), {})  # miles' weight push (stood in)\n",
    "sglang/srt/entrypoints/openai/protocol.py": _module(
        "SGLang's OpenAI request types (miles' chat templates import them)",
        ChatCompletionRequest="type('ChatCompletionRequest', (), {})",
        Tool="type('Tool', (), {})",
    ),
    "sglang/srt/debug_utils/__init__.py": "",
    "sglang/srt/debug_utils/dumper.py": _reexport(
        "DumperConfig", "_get_rank", why="SGLang's tensor dumper (off)"
    )
    + "dumper = None\n",
}


def build(source: MilesSource, root: Path) -> SlimeJob:
    """miles' tree at the source's commit with the stand-ins, under `root`."""
    return slime_job.write_job(source, root, "miles", _overlays(source.read), SITE)


def runtime_env(job: SlimeJob, *, wrap: str | None, extra_env: dict[str, str]) -> dict[str, Any]:
    """The documented runtime env JSON with miles' hook (see slime_job.runtime_env)."""
    return slime_job.runtime_env(job, wrap=wrap, extra_env=extra_env, hook=HOOK)

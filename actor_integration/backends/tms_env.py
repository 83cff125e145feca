"""The environment torch_memory_saver reads, checked before any CUDA or TMS initialisation.

torch_memory_saver reads `TMS_*` variables, `LD_PRELOAD` and the allocator configuration at its
first use, and answers an invalid value with `exit(1)` (an empty string included) or a silent
misreading. `validate_environment` refuses those environments with a Python error saying how to fix
them; `lifecycle doctor` and `TorchMemorySaverBackend` both call it. (vLLM keeps its environment
reading in `envs.py`, apart from the allocator; this module is that part here.)
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from actor_integration.errors import MemorySaverConfigError

__all__ = [
    "CPU_BACKUP_BACKENDS",
    "HOOK_MODES",
    "PRELOAD_LIBRARY_STEM",
    "TMS_ENV_VARS",
    "HookMode",
    "hook_mode_from_environment",
    "is_true",
    "preload_library",
    "preloads_tms",
    "validate_environment",
]

HookMode = Literal["torch", "preload"]
HOOK_MODES: tuple[str, ...] = ("torch", "preload")
CPU_BACKUP_BACKENDS: tuple[str, ...] = ("pinned", "mmap")
PRELOAD_LIBRARY_STEM = "torch_memory_saver_hook_mode_preload"

# Read with get_bool_env_var() in csrc/utils.h: exactly these spellings, anything else (even "") is exit(1).
_BOOL_VARS = (
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_ENABLE_DISK_BACKUP",
    "TMS_RETAIN_CPU_BACKUP",
)
_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")
TMS_ENV_VARS: tuple[str, ...] = (
    *_BOOL_VARS,
    "TMS_INIT_CPU_BACKUP_BACKEND",  # cpu_backup.h: "mmap" | "pinned", else exit(1)
    "TMS_DISK_BACKUP_DIR",  # disk_backend.cpp: used as given, default /tmp
    "TMS_DISK_BACKUP_CHUNK_MB",  # disk_backend.cpp: strtoull, 0 or garbage silently becomes 256
)
_TEST_ONLY_PREFIX = "TMS_XPU_FAULT_"  # fault injection of TMS's own XPU tests


# ---------------------------------------------------------------------------------------------- environment


def validate_environment(
    environ: Mapping[str, str] | None = None,
    *,
    hook_mode: str = "torch",
    cuda_major: int | None = None,
) -> list[str]:
    """Check the environment torch_memory_saver will read; return notes, raise on what it would die on.

    `cuda_major` overrides the CUDA major used to pick the preload library (default: TMS's own
    detection from torch).
    """
    if hook_mode not in HOOK_MODES:
        raise MemorySaverConfigError(f"hook_mode must be one of {list(HOOK_MODES)}, got {hook_mode!r}")
    env: Mapping[str, str] = os.environ if environ is None else environ
    errors: list[str] = []
    notes: list[str] = []

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if _expandable_segments(env.get(name, "")):
            errors.append(
                f"{name}={env[name]!r} enables expandable_segments, which torch_memory_saver refuses "
                "(its allocations would bypass the saver); remove expandable_segments:True or set "
                "expandable_segments:False"
            )

    flags: dict[str, bool | None] = {name: _parse_bool(name, env, errors) for name in _BOOL_VARS}
    backend = env.get("TMS_INIT_CPU_BACKUP_BACKEND")
    if backend is not None and backend not in CPU_BACKUP_BACKENDS:
        what = "is empty" if backend == "" else f"is {backend!r}"
        errors.append(
            f"TMS_INIT_CPU_BACKUP_BACKEND {what}; torch_memory_saver accepts exactly 'pinned' or 'mmap' "
            "(case-sensitive) and exits on anything else. Set one of them or unset the variable."
        )
    elif backend == "mmap" and torch.version.hip:
        errors.append(
            "TMS_INIT_CPU_BACKUP_BACKEND='mmap' is not supported on ROCm; torch_memory_saver exits. "
            "Set it to 'pinned' or unset it."
        )
    _check_disk_dir(env, flags, errors, notes)
    _check_chunk_mb(env, errors)

    unknown = sorted(k for k in env if k.startswith("TMS_") and k not in TMS_ENV_VARS)
    for name in unknown:
        if name.startswith(_TEST_ONLY_PREFIX):
            continue
        close = difflib.get_close_matches(name, TMS_ENV_VARS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        notes.append(f"{name} is not read by torch_memory_saver and has no effect{hint}")

    init_enable = bool(flags["TMS_INIT_ENABLE"])
    if flags["TMS_INIT_ENABLE_CPU_BACKUP"] and flags["TMS_INIT_ENABLE_DISK_BACKUP"]:
        errors.append(
            "TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are both on; torch_memory_saver "
            "exits at the first allocation ('cpu_backup and disk_backup are mutually exclusive'). Turn one off."
        )
    if init_enable and hook_mode == "torch":
        errors.append(
            "TMS_INIT_ENABLE is on but hook_mode is 'torch': in torch mode only allocations inside region() "
            "are saver memory, so the variable has no effect and every allocation outside a region stays "
            "resident. Unset TMS_INIT_ENABLE, or use hook_mode='preload' with the preload library in LD_PRELOAD."
        )
    if not init_enable:
        # Not TMS_INIT_CPU_BACKUP_BACKEND: it is also the backend of every region() given none.
        for name in ("TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP"):
            if flags[name]:
                notes.append(
                    f"{name} only applies to allocations outside region(), which are saver memory only with "
                    "TMS_INIT_ENABLE=1 in preload mode; it has no effect here"
                )

    tms_preloads = [p for p in env.get("LD_PRELOAD", "").split(":") if "torch_memory_saver" in p]
    if hook_mode == "preload":
        _check_preload(env.get("LD_PRELOAD", ""), tms_preloads, cuda_major, errors)
    elif tms_preloads:
        notes.append(
            f"LD_PRELOAD loads {tms_preloads} but hook_mode is 'torch': that library keeps its own state, "
            "which this process's pause/resume never reach; remove it from LD_PRELOAD"
        )

    if errors:
        raise MemorySaverConfigError(
            f"torch_memory_saver (hook_mode={hook_mode!r}) would exit or misbehave with this environment:\n- "
            + "\n- ".join(errors)
        )
    return notes


def preload_library(cuda_major: int | None = None) -> str:
    """The preload `.so` for torch's CUDA major (or `cuda_major`), as torch_memory_saver resolves it."""
    try:
        from torch_memory_saver import utils as tms_utils
    except ImportError as exc:  # pragma: no cover - TMS is a declared dependency
        raise MemorySaverConfigError(f"torch_memory_saver is not importable: {exc}") from exc
    if cuda_major is None:
        try:
            return str(tms_utils.get_binary_path_from_package(PRELOAD_LIBRARY_STEM))
        except RuntimeError as exc:
            raise MemorySaverConfigError(
                f"cannot resolve torch_memory_saver's preload library for this torch ({torch.__version__}, "
                f"torch.version.cuda={torch.version.cuda}): {exc}. Preload mode needs a CUDA build of torch "
                "and the matching torch-memory-saver wheel (or pass cuda_major= explicitly)."
            ) from exc
    # Same search as utils.get_binary_path_from_package, which takes no major argument.
    package_dir = Path(tms_utils.__file__).parent
    pattern = f"{PRELOAD_LIBRARY_STEM}_cu{cuda_major}.*.so"
    candidates = list(package_dir.glob(pattern)) or list(package_dir.parent.glob(pattern))
    if len(candidates) != 1:
        raise MemorySaverConfigError(
            f"expected exactly one torch_memory_saver library matching {pattern!r} next to "
            f"{package_dir}, found {[str(c) for c in candidates]}; install a torch-memory-saver wheel built "
            f"for CUDA {cuda_major}"
        )
    return str(candidates[0])


def _expandable_segments(conf: str) -> bool:
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip() == "True":
            return True
    return False


def _parse_bool(name: str, env: Mapping[str, str], errors: list[str]) -> bool | None:
    value = env.get(name)
    if value is None:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    what = "is empty" if value == "" else f"is {value!r}"
    errors.append(
        f"{name} {what}; torch_memory_saver exits on it ('Unsupported environment varialbe value'). "
        f"It accepts exactly {'/'.join(_TRUE)} or {'/'.join(_FALSE)}: set one of them or unset the variable."
    )
    return None


def _check_disk_dir(
    env: Mapping[str, str], flags: Mapping[str, bool | None], errors: list[str], notes: list[str]
) -> None:
    value = env.get("TMS_DISK_BACKUP_DIR")
    if value is None:
        return
    if not value.strip():
        errors.append(
            "TMS_DISK_BACKUP_DIR is empty; torch_memory_saver would create its backup files under '/' and exit "
            "when that fails. Set it to a directory on a real disk, or unset it (default /tmp)."
        )
        return
    path = Path(value)
    if path.exists() and not path.is_dir():
        errors.append(
            f"TMS_DISK_BACKUP_DIR={value!r} exists and is not a directory; torch_memory_saver exits at the first "
            "disk-backed pause. Point it at a directory."
        )
    elif flags["TMS_INIT_ENABLE_DISK_BACKUP"] and path.is_dir() and not os.access(path, os.W_OK):
        errors.append(
            f"TMS_DISK_BACKUP_DIR={value!r} is not writable; torch_memory_saver exits at the first "
            "disk-backed pause. Point it at a writable directory."
        )
    if not path.is_absolute():
        notes.append(
            f"TMS_DISK_BACKUP_DIR={value!r} is relative: it depends on each process's working directory"
        )


def _check_chunk_mb(env: Mapping[str, str], errors: list[str]) -> None:
    value = env.get("TMS_DISK_BACKUP_CHUNK_MB")
    if value is None:
        return
    if not re.fullmatch(r"[0-9]+", value) or int(value) == 0:
        what = "is empty" if value == "" else f"is {value!r}"
        errors.append(
            f"TMS_DISK_BACKUP_CHUNK_MB {what}; torch_memory_saver parses it with strtoull, so anything but a "
            "positive whole number of MiB is silently read as 256 (or, negative, as a huge buffer it cannot "
            "allocate). Set a positive integer such as 256, or unset it."
        )
        return
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if int(value) * 2**20 > physical:
        errors.append(
            f"TMS_DISK_BACKUP_CHUNK_MB={value} asks for a pinned staging buffer larger than this host's memory "
            f"({physical / 2**30:.0f} GiB); torch_memory_saver exits when it cannot allocate it. Use e.g. 256."
        )


def _check_preload(
    ld_preload: str, tms_preloads: list[str], cuda_major: int | None, errors: list[str]
) -> None:
    try:
        expected = preload_library(cuda_major)
    except MemorySaverConfigError as exc:
        errors.append(str(exc))
        return
    fix = (
        f"set LD_PRELOAD={expected} (torch_memory_saver.configure_subprocess() does this for a child process)"
    )
    if not tms_preloads:
        errors.append(
            f"hook_mode is 'preload' but LD_PRELOAD={ld_preload!r} names no torch_memory_saver library; {fix}"
        )
        return
    if len(tms_preloads) > 1:
        errors.append(
            f"LD_PRELOAD names {len(tms_preloads)} torch_memory_saver libraries {tms_preloads}; torch_memory_saver "
            f"needs exactly one. Keep only {expected}."
        )
        return
    given = tms_preloads[0]
    if any(c.isspace() for c in given.strip()):
        errors.append(
            f"LD_PRELOAD entry {given!r} holds several paths separated by spaces; torch_memory_saver splits "
            f"LD_PRELOAD on ':' only. Separate entries with ':' and {fix}."
        )
        return
    given = given.strip()
    if not Path(given).is_file():
        errors.append(f"LD_PRELOAD names {given}, which does not exist (the loader skips it); {fix}")
    elif os.path.realpath(given) != os.path.realpath(expected):
        errors.append(
            f"LD_PRELOAD names {given}, but this torch needs {expected} (a library for another CUDA major or "
            f"hook mode does not hook this process's allocations; slime #2186); {fix}"
        )


def hook_mode_from_environment(environ: Mapping[str, str] | None = None) -> HookMode:
    """The hook mode an environment asks for: "preload" when `LD_PRELOAD` loads a torch_memory_saver
    library or `TMS_INIT_ENABLE` is on, else "torch".

    slime's and miles' `RayTrainGroup` launch offloaded trainers with the preload library and
    `TMS_INIT_ENABLE=1`; a backend in torch mode there would refuse that environment.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    return "preload" if preloads_tms(env) or is_true(env.get("TMS_INIT_ENABLE")) else "torch"


def preloads_tms(environ: Mapping[str, str]) -> bool:
    """Whether `LD_PRELOAD` loads a torch_memory_saver library: every cudaMalloc of the process is then its."""
    return any("torch_memory_saver" in p for p in environ.get("LD_PRELOAD", "").split(":"))


def is_true(value: str | None) -> bool:
    """How torch_memory_saver reads a boolean variable that passed `validate_environment`."""
    return value in _TRUE

"""`lifecycle doctor`: check the environment before a colocated job and recommend a weight transport
and what sleep should do with the NCCL communicators.

Each check gives a verdict (ok / warn / fail / skip) and one line of detail; on a CPU-only machine
the GPU checks are reported as skipped with the reason, not failed. Two hazards depend on how the
job runs, which the caller says (`--cuda-graphs`, `--transport`): CUDA graphs with NCCL buffer
registration over torch_memory_saver memory, and expandable_segments with CUDA IPC export.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # ok | warn | fail | skip
    detail: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hook_mode(env: Mapping[str, str]) -> str:
    return "preload" if "torch_memory_saver" in env.get("LD_PRELOAD", "") else "torch"


def check_torch() -> list[Check]:
    import torch

    checks = [Check("python", "ok", f"{platform.python_version()} ({sys.executable})")]
    cuda = torch.version.cuda
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        checks.append(
            Check(
                "torch / CUDA",
                "ok",
                f"torch {torch.__version__}, CUDA {cuda}, {torch.cuda.device_count()} GPU(s): {names}",
            )
        )
    else:
        why = "CPU build of torch" if cuda is None else f"CUDA {cuda} build but no GPU visible"
        checks.append(
            Check("torch / CUDA", "warn", f"torch {torch.__version__}; {why}: GPU checks are skipped")
        )
    return checks


def check_memory_saver(env: Mapping[str, str]) -> list[Check]:
    import torch

    from actor_integration.backends.tms_env import preload_library, validate_environment
    from actor_integration.errors import MemorySaverConfigError

    version = _version("torch-memory-saver")
    if version is None:
        return [Check("torch_memory_saver", "fail", "not installed: pip install torch-memory-saver")]
    checks = [Check("torch_memory_saver", "ok", f"{version} installed")]
    if torch.version.cuda is None:
        checks.append(
            Check("TMS library for CUDA major", "skip", "CPU build of torch: no CUDA major to match")
        )
    else:
        major = int(torch.version.cuda.split(".")[0])
        try:
            path = preload_library()
            checks.append(Check("TMS library for CUDA major", "ok", f"CUDA {major} → {Path(path).name}"))
        except MemorySaverConfigError as exc:
            checks.append(Check("TMS library for CUDA major", "fail", str(exc)))
    mode = _hook_mode(env)
    try:
        notes = validate_environment(env, hook_mode=mode)
        detail = f"hook_mode {mode}: LD_PRELOAD, PYTORCH_CUDA_ALLOC_CONF and TMS_* values are valid"
        checks.append(
            Check(
                "TMS environment",
                "warn" if notes else "ok",
                detail + ("; " + "; ".join(notes) if notes else ""),
            )
        )
    except MemorySaverConfigError as exc:
        checks.append(Check("TMS environment", "fail", str(exc).replace("\n", " ")))
    capabilities = check_saver_capabilities(env)
    checks.append(capabilities)
    checks.append(check_cpu_backup_retention(env, can_retain=capabilities.verdict == "ok"))
    return checks


def check_saver_capabilities(env: Mapping[str, str], saver: Any = None) -> Check:
    """What the installed torch_memory_saver supports (upstream and slime's pinned fork differ), read
    from its class and the library LD_PRELOAD loads, without initialising it."""
    from actor_integration.backends.tms_capabilities import RETAIN_COST, saver_capabilities

    library = next(
        (e for e in env.get("LD_PRELOAD", "").replace(":", " ").split() if "torch_memory_saver" in e), None
    )
    try:
        capabilities = saver_capabilities(saver, library=library)
    except ImportError as exc:
        return Check("TMS capabilities", "skip", f"torch_memory_saver is not importable: {exc}")
    if capabilities.supports("retain_cpu_backup"):
        return Check("TMS capabilities", "ok", capabilities.describe())
    return Check(
        "TMS capabilities",
        "warn",
        f"{capabilities.describe()}. Without retain_cpu_backup {RETAIN_COST}; the adapters log this decision "
        "in lifecycle.configured (memory_notes)",
    )


def check_cpu_backup_retention(env: Mapping[str, str], *, can_retain: bool = True) -> Check:
    """Whether the CPU backup of the launcher's environment outlives a resume, and who decided.
    `can_retain`: whether the installed torch_memory_saver can retain it at all."""
    from actor_integration.backends.tms_env import is_true

    name = "TMS CPU backup"
    if not is_true(env.get("TMS_INIT_ENABLE_CPU_BACKUP")):
        return Check(name, "skip", "TMS_INIT_ENABLE_CPU_BACKUP is off: regions say their own backup")
    given = env.get("TMS_RETAIN_CPU_BACKUP")
    cost = "5.75 s per sleep + wake for 8.9 GiB on an H200 against 0.39 s retained"
    if not can_retain and (given is None or is_true(given)):
        return Check(
            name,
            "warn",
            "not retained: this torch_memory_saver has no retain_cpu_backup (see TMS capabilities), so every "
            f"pause allocates the pinned backup again and every resume frees it ({cost})",
        )
    if given is None:
        return Check(
            name,
            "ok",
            "TMS_RETAIN_CPU_BACKUP unset: SlimeLifecycleMixin retains the backup (allocated once by the sleep "
            f"that ends init); plain torch_memory_saver allocates it in every pause ({cost})",
        )
    if is_true(given):
        return Check(name, "ok", f"TMS_RETAIN_CPU_BACKUP={given}: retained, steady pauses copy at PCIe speed")
    return Check(
        name,
        "warn",
        f"TMS_RETAIN_CPU_BACKUP={given}: every pause allocates the pinned backup again and every resume frees "
        f"it ({cost}); unset it, or set 1, unless host RAM cannot hold the backup between steps",
    )


def check_cuda_ipc(env: Mapping[str, str]) -> tuple[list[Check], bool | None]:
    """Can this process export CUDA IPC handles (slime #2188)? Returns checks and the export verdict."""
    import torch

    from actor_integration.weight_sync.transport import probe_cuda_ipc

    if not torch.cuda.is_available():
        return [
            Check("CUDA IPC export", "skip", "no GPU: the colocated transport on this machine is shm")
        ], None
    plain_ok, plain_why = probe_cuda_ipc(None)
    checks = []
    if plain_ok:
        checks.append(Check("CUDA IPC export", "ok", plain_why))
        return checks, True
    if _hook_mode(env) == "preload" and env.get("TMS_INIT_ENABLE") == "1":
        from torch_memory_saver import torch_memory_saver

        disabled_ok, disabled_why = probe_cuda_ipc(torch_memory_saver)
        checks.append(
            Check(
                "CUDA IPC export",
                "ok" if disabled_ok else "fail",
                f"plain allocations cannot export under the TMS preload hook (slime #2188: {plain_why}); "
                + (
                    "buffers allocated inside disable() can, and cuda_ipc allocates there"
                    if disabled_ok
                    else disabled_why
                ),
            )
        )
        return checks, disabled_ok
    checks.append(Check("CUDA IPC export", "fail", plain_why))
    return checks, False


# The reason shown for the recommendation: one H200 rank, WORLD + 16 warmed NCCL subgroups
# (docs/measurements.md#ncclcommsuspend-on-nccl-2307-2026-12-02).
MEASURED_WAYS = (
    "measured on an H200 (one rank, WORLD + 16 warmed groups): destroy frees 6.4 GiB in 0.73-0.80 s and "
    "rebuilds in 0.22-0.68 s; NCCL 2.30.7's suspend frees the same in 3.7-6.3 s and resumes in 1.3-1.8 s "
    "(it copies the buffers to pinned host memory); keep costs 0 s and holds ~390 MiB per communicator "
    "(Megatron's 25 groups: 8.1 GB)"
)


def _shown(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


def check_nccl() -> Check:
    """The NCCL this process loaded (not the one torch was built with), where from, and torch's view."""
    import torch.distributed as dist

    from actor_integration.backends.process_groups import _nccl

    loaded = _nccl.loaded_nccl()
    torch_version = _nccl.torch_nccl_version() if dist.is_available() and dist.is_nccl_available() else None
    if loaded is None and torch_version is None:
        return Check("NCCL", "skip", "no NCCL is loaded: a CPU build of torch (gloo groups only)")
    if loaded is None:
        detail = f"torch reports NCCL {_shown(torch_version)} (linked into torch; no libnccl.so.2 is loaded)"
    else:
        detail = f"NCCL {_shown(loaded.version)} loaded from {loaded.path or 'libnccl.so.2'}"
        if torch_version is not None and tuple(torch_version) != loaded.version:
            detail += f" (torch was built against {_shown(torch_version)}; its NCCL calls run this library)"
        elif torch_version is None:
            detail += "; torch here has no NCCL backend"
    return Check(
        "NCCL",
        "ok",
        f"{detail}. For trainer process groups and non-colocated engines; never a transport between a "
        "trainer and an engine on one GPU ('Duplicate GPU detected')",
    )


def check_communicators() -> tuple[Check, str, str]:
    """Can suspend reach the communicators here, and which way sleep should take: (check, way, why)."""
    import torch.distributed as dist

    from actor_integration.backends.process_groups import _nccl

    name = "NCCL communicators on sleep"
    if not dist.is_available() or not dist.is_nccl_available():
        support = _nccl.nccl_suspend_support("nccl")
        return (
            Check(
                name,
                "skip",
                f"no NCCL groups ({support.reason}): communicators='destroy' tears gloo groups down",
            ),
            "destroy",
            "the default; no NCCL here",
        )
    support = _nccl.nccl_suspend_support("nccl")
    reachable = (
        f"suspend is reachable ({support.reason}) but opt-in: communicators='suspend'"
        if support.available
        else f"suspend is not reachable: {support.reason}"
    )
    why = f"the fastest measured way that frees the memory; {MEASURED_WAYS}"
    return (
        Check(name, "ok", f"recommended: communicators='destroy' (the default). {reachable}. {why}"),
        "destroy",
        why,
    )


def check_cuda_graph_registration(env: Mapping[str, str], cuda_graphs: bool | None) -> Check:
    """CUDA graphs over memory torch_memory_saver releases, with NCCL graph buffer registration on."""
    name = "CUDA graphs + NCCL buffer registration"
    register = env.get("NCCL_GRAPH_REGISTER")
    # NCCL registers the buffers of graph-captured collectives (NCCL_GRAPH_REGISTER, default on);
    # a torch_memory_saver resume maps new physical pages under the same addresses, the
    # registrations still point at the old ones, and replay hangs (torch_memory_saver #88 and
    # #107, sglang #40648). SGLang 0.5.23 defaults it to 0 for its own multi-rank graphs only.
    fix = "export NCCL_GRAPH_REGISTER=0 for every process that captures CUDA graphs (trainer and rollout)"
    if _version("torch-memory-saver") is None:
        return Check(name, "skip", "torch_memory_saver is not installed: no physical pages are swapped")
    if register == "0":
        return Check(
            name, "ok", "NCCL_GRAPH_REGISTER=0: captured collectives keep no stale buffer registrations"
        )
    if cuda_graphs is False:
        return Check(name, "skip", "no CUDA graphs captured (--no-cuda-graphs)")
    if cuda_graphs is None:
        if register is None:
            return Check(
                name,
                "skip",
                "say whether a process captures CUDA graphs (SGLang does unless --disable-cuda-graph): "
                "--cuda-graphs / --no-cuda-graphs",
            )
        return Check(
            name,
            "warn",
            f"NCCL_GRAPH_REGISTER={register!r} registers graph-captured NCCL buffers, which go stale when "
            "torch_memory_saver releases and resumes memory; if a process captures CUDA graphs (SGLang "
            f"does by default) replay can hang: {fix}",
        )
    if register is None:
        return Check(
            name,
            "warn",
            "NCCL_GRAPH_REGISTER is unset, so NCCL registers graph-captured buffers; they go stale when "
            "torch_memory_saver resumes memory on new pages and replay can hang (SGLang 0.5.23 turns "
            f"the registration off for its own multi-rank graphs, a trainer's graphs keep it): {fix}",
        )
    return Check(
        name,
        "fail",
        f"NCCL_GRAPH_REGISTER={register!r} with CUDA graphs over torch_memory_saver memory: the "
        "registrations go stale when memory is resumed on new pages and graph replay hangs "
        f"(torch_memory_saver #88, sglang #40648); {fix}",
    )


def check_ipc_allocator(env: Mapping[str, str], transport: str) -> Check:
    """expandable_segments in a process that exports CUDA IPC handles for the weight sync."""
    # One parser of the allocator setting: the one the torch_memory_saver adapter refuses with.
    from actor_integration.backends.tms_env import _expandable_segments

    name = "CUDA IPC + expandable_segments"
    if transport != "cuda_ipc":
        return Check(name, "skip", f"transport {transport}: no CUDA IPC handles are exported")
    enabled = [
        n for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if _expandable_segments(env.get(n, ""))
    ]
    if not enabled:
        return Check(name, "ok", "expandable_segments is off: the trainer's buffers export over CUDA IPC")
    return Check(
        name,
        "fail",
        f"{', '.join(f'{n}={env[n]!r}' for n in enabled)} enables expandable_segments; exporting its memory "
        "over CUDA IPC fails with 'pidfd_getfd: Operation not permitted' (NeMo-RL #3782). Remove "
        "expandable_segments:True from the trainer's environment, or switch it off around update_weights "
        "(torch.cuda.memory._set_allocator_settings('expandable_segments:False'), as verl does), or use "
        "--transport shm",
    )


def unreachable(address: str, timeout_s: float) -> str | None:
    """Why nothing answers at a Ray `address` (HOST:PORT or ray://HOST:PORT), or None if something
    does: one TCP connection within `timeout_s`, where Ray itself retries an absent GCS for minutes."""
    if address == "auto":
        return None
    target = urllib.parse.urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = target.hostname, target.port
    except ValueError:
        host = port = None
    if host is None or port is None:
        return "expected HOST:PORT (or ray://HOST:PORT, or auto)"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"no Ray cluster answers there ({exc.strerror or exc})"


def check_ray(address: str | None, env: Mapping[str, str]) -> Check:
    version = _version("ray")
    if version is None:
        return Check("Ray", "fail", "not installed: pip install ray")
    address = address or env.get("RAY_ADDRESS")
    if address and (problem := unreachable(address, 10.0)) is not None:
        return Check("Ray", "fail", f"ray {version}: {address}: {problem}; start one with `ray start --head`")
    if address:
        code = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); print(len(ray.nodes()))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45)
        except subprocess.TimeoutExpired:
            return Check("Ray", "fail", f"ray {version}: no answer from {address} within 45 s")
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            return Check("Ray", "fail", f"ray {version}: cannot join {address}: {last}")
        return Check("Ray", "ok", f"ray {version}: joined {address}, {out.stdout.strip()} node(s)")
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists():
        return Check(
            "Ray", "ok", f"ray {version}: a local cluster was started at {current.read_text().strip()}"
        )
    return Check("Ray", "ok", f"ray {version}: no running cluster here; `lifecycle demo` starts a local one")


def check_memory_budget(need_bytes: int | None = None) -> tuple[Check, str]:
    """What a `MemoryBudget` (default margin) would decide on this device now, for a rollout whose wake
    needs `need_bytes` (None: say up to what need the trainer keeps everything)."""
    from lifecycle.budget import MemoryBudget

    margin = MemoryBudget().margin_bytes
    try:
        import torch

        if not torch.cuda.is_available():
            return Check("memory budget", "skip", "no CUDA device: nothing to plan"), "no GPU"
        free, total = torch.cuda.mem_get_info()
    except Exception as exc:  # a broken CUDA install is reported by the torch check
        return Check("memory budget", "skip", f"free memory unreadable: {exc!r}"), "unknown"
    gib = 1 << 30
    fits = max(0, free - margin)
    if need_bytes is None:
        decision = (
            f"a rollout needing up to {fits / gib:.1f} GiB wakes with the trainer's memory and communicators "
            f"kept (sleep releases nothing); beyond, the cheapest tags go first, the communicators last"
        )
    elif need_bytes + margin <= free:
        decision = f"a {need_bytes / gib:.1f} GiB need fits: sleep releases nothing"
    else:
        decision = (
            f"a {need_bytes / gib:.1f} GiB need leaves {(need_bytes + margin - free) / gib:.1f} GiB to free: "
            "the cheapest tags that free it, then the communicators; all when not enough"
        )
    detail = f"{free / gib:.1f} of {total / gib:.1f} GiB free, margin {margin / gib:.0f} GiB: {decision}"
    return Check("memory budget", "ok", detail), decision


# What vLLM 0.26.0 imports with its engine core that a trimmed environment (a wheel set carried to an
# offline machine) can lack: vllm/v1/structured_output's dataclasses annotate fields with these
# modules' classes, which vLLM's LazyLoader then imports at load. Seen on an H100, 2026-12-06.
VLLM_LOAD_TIME_MODULES = ("llguidance", "xgrammar")


def check_engines(find_spec: Any = importlib.util.find_spec) -> list[Check]:
    """The rollout engines installed here against the releases the adapters are checked on (CI reads
    those wheels' source), and what vLLM needs importable at load."""
    from actor_integration.engines.sglang.engine import SUPPORTED_VERSIONS, version_tuple
    from actor_integration.engines.vllm.offline import SUPPORTED_VERSION

    checks = []
    oldest, newest = SUPPORTED_VERSIONS
    sglang = _version("sglang")
    if sglang is None:
        checks.append(
            Check(
                "SGLang", "skip", "not installed (the sglang extra): the SGLang engines are not usable here"
            )
        )
    elif version_tuple(oldest) <= version_tuple(sglang) <= version_tuple(newest):  # as the engine's own
        checks.append(
            Check(
                "SGLang",
                "ok",
                f"sglang {sglang}: within the releases the adapter is checked on ({oldest}-{newest})",
            )
        )
    else:
        checks.append(
            Check(
                "SGLang",
                "warn",
                f"sglang {sglang}: the adapter's calls are checked against {oldest} and {newest}; a release "
                "outside them may have moved one: run the SGLang GPU tests (make gpu-check) on it first",
            )
        )
    vllm = _version("vllm")
    if vllm is None:
        checks.append(
            Check("vLLM", "skip", "not installed (the vllm extra): the vLLM engines are not usable here")
        )
        return checks
    missing = [m for m in VLLM_LOAD_TIME_MODULES if find_spec(m) is None]
    if vllm != SUPPORTED_VERSION:
        checks.append(
            Check(
                "vLLM",
                "warn",
                f"vllm {vllm}: the adapter's calls, routes and fields are checked against {SUPPORTED_VERSION} "
                "only; another release may have moved one (`pip install 'rl-lifecycle[vllm]'` pins it)",
            )
        )
    elif missing:
        checks.append(
            Check(
                "vLLM",
                "fail",
                f"vllm {vllm} without {', '.join(missing)}: its engine core imports "
                f"{' and '.join(VLLM_LOAD_TIME_MODULES)} at load (vllm/v1/structured_output), so the first engine "
                f"fails with `No module named {missing[0]!r}`; install vllm's own requirements "
                f"(`pip install vllm=={vllm}` brings them)",
            )
        )
    else:
        checks.append(Check("vLLM", "ok", f"vllm {vllm}: the release the adapter is checked on"))
    return checks


def run_checks(
    environ: Mapping[str, str] | None = None,
    *,
    ray_address: str | None = None,
    cuda_graphs: bool | None = None,
    transport: str | None = None,
) -> dict[str, Any]:
    """Every check. `cuda_graphs`: whether a process captures CUDA graphs (None: not said);
    `transport`: the weight transport the job will use (None or "auto": the recommended one)."""
    env = dict(os.environ if environ is None else environ)
    planned = transport
    checks = check_torch()
    checks += check_memory_saver(env)
    ipc_checks, ipc_ok = check_cuda_ipc(env)
    checks += ipc_checks
    checks.append(check_nccl())
    communicators_check, communicators, communicators_why = check_communicators()
    checks.append(communicators_check)
    checks.append(check_ray(ray_address, env))
    checks += check_engines()
    budget_check, budget_decision = check_memory_budget()
    checks.append(budget_check)
    if ipc_ok:
        transport, why = "cuda_ipc", "CUDA IPC export works for buffers outside torch_memory_saver regions"
    elif ipc_ok is False:
        transport, why = "shm", "CUDA IPC export fails under this allocator: shared host memory instead"
    else:
        transport, why = "shm", "no GPU: shared host memory between the processes"
    checks.append(check_cuda_graph_registration(env, cuda_graphs))
    checks.append(check_ipc_allocator(env, transport if planned in (None, "auto") else planned))
    return {
        "checks": [asdict(c) for c in checks],
        "transport": transport,
        "transport_reason": why,
        "communicators": communicators,
        "communicators_reason": communicators_why,
        "memory_budget": budget_decision,
        "ok": not any(c.verdict == "fail" for c in checks),
    }


def render(report: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    colours = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
    table = Table(title="lifecycle doctor", show_lines=False)
    table.add_column("check")
    table.add_column("verdict")
    table.add_column("detail", overflow="fold")
    for check in report["checks"]:
        verdict = check["verdict"]
        table.add_row(check["name"], f"[{colours[verdict]}]{verdict}[/]", check["detail"])
    console = Console(width=max(100, Console().width))
    console.print(table)
    console.print(
        f"recommended weight transport: [bold]{report['transport']}[/] ({report['transport_reason']})"
    )
    console.print(
        f"recommended communicators on sleep: [bold]{report['communicators']}[/] ({report['communicators_reason']})"
    )
    if "memory_budget" in report:
        console.print(
            f"memory budget (LifecyclePolicy(memory_budget=MemoryBudget())): {report['memory_budget']}"
        )

"""Preflight: what a colocated job needs against what the machine has, before anything starts.

`preflight(machine, job)` is a pure function over a described machine (`Machine`: nodes, their
GPUs and memory, CPUs, available host RAM) and a described job (`JobNeeds`: GPUs, the trainer's
state per GPU, the engine's memory fraction and weights, the host RAM for the trainer's CPU
backups, the CPUs its actors reserve). It returns every shortfall, each one line saying what is
short and what to change. `check_job` raises `PreflightError` with those lines (or only reports
them). The descriptions come from elsewhere: `slime_job_needs(args)` from slime's (or miles') parsed
flags and the model's files, `demo_job_needs(...)` from `lifecycle demo`'s placement, `describe_ray_cluster()` from a running Ray cluster (one probe task
per node), `describe_this_machine()` from this host. A figure that is not known (a GPU's memory
where nothing can read it) leaves its check out, and the report says which were left out.

The estimates are lower bounds, meant to catch what cannot fit at all: the trainer's static state
is 16 bytes per parameter (bf16 weights and gradients, fp32 main weights and Adam's two moments;
the 12 optimizer bytes split over data-parallel ranks with a distributed optimizer), divided by
tensor x pipeline parallelism; activations come on top.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actor_integration.errors import PreflightError

__all__ = [
    "GPU",
    "JobNeeds",
    "Machine",
    "Node",
    "PreflightError",
    "Shortfall",
    "check_job",
    "demo_job_needs",
    "describe_ray_cluster",
    "describe_this_machine",
    "model_weight_bytes",
    "preflight",
    "slime_job_needs",
]

GIB = 1 << 30
TRAINER_BYTES_PER_PARAM = 2 + 2 + 12  # bf16 weights, bf16 grads, fp32 main + Adam m and v
OPTIMIZER_BYTES_PER_PARAM = 12
# What stays on a GPU beside the other half while one half sleeps: CUDA contexts, NCCL's own, the
# allocator's slack. Not measured per job; a floor so a fraction of 1.0 is never taken as fitting.
GPU_RESERVE_BYTES = 2 * GIB
HOST_RAM_USABLE = 0.9  # of the available host RAM: the OS and Ray's object store need the rest


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU: its name and total memory (None: not known)."""

    name: str = "GPU"
    total_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Node:
    """One node: its GPUs, the CPUs Ray schedules on it, and its available host RAM (None: not known)."""

    name: str
    gpus: tuple[GPU, ...] = ()
    cpus: float = 0.0
    host_ram_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The nodes a job can use."""

    nodes: tuple[Node, ...]

    @property
    def gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "name": n.name,
                    "gpus": [{"name": g.name, "total_bytes": g.total_bytes} for g in n.gpus],
                    "cpus": n.cpus,
                    "host_ram_bytes": n.host_ram_bytes,
                }
                for n in self.nodes
            ]
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        return cls(
            nodes=tuple(
                Node(
                    name=str(n["name"]),
                    gpus=tuple(
                        GPU(name=str(g.get("name", "GPU")), total_bytes=g.get("total_bytes"))
                        for g in n["gpus"]
                    ),
                    cpus=float(n.get("cpus", 0.0)),
                    host_ram_bytes=n.get("host_ram_bytes"),
                )
                for n in data["nodes"]
            )
        )


@dataclass(frozen=True, kw_only=True)
class JobNeeds:
    """What a job needs. Byte figures are per GPU (per trainer rank); None: not known, not checked.

    `flags` names the job's own settings for each need ("gpus", "trainer_memory", "engine_memory",
    "host_ram", "cpus"), so a shortfall says what to change in the job's own words.
    """

    framework: str = "slime"
    gpus: int
    gpus_per_node: int
    trainer_ranks: int
    colocate: bool = True
    offload_train: bool = True
    offload_rollout: bool = True
    critic: bool = False
    trainer_bytes_per_gpu: int | None = None
    engine_mem_fraction: float | None = None
    engine_weight_bytes_per_gpu: int | None = None
    backup_bytes_per_rank: int | None = None  # host RAM a trainer rank holds while asleep
    cpus: float = 0.0
    flags: Mapping[str, str] = field(default_factory=dict)

    def how(self, need: str, default: str) -> str:
        return self.flags.get(need, default)


@dataclass(frozen=True)
class Shortfall:
    """One need the machine cannot meet: `need` names it, `message` is one line with what to change."""

    need: str
    message: str


# ---------------------------------------------------------------------------------------------- the check


def preflight(machine: Machine, job: JobNeeds) -> list[Shortfall]:
    """Every shortfall of `machine` for `job`, in a fixed order (GPUs, GPU memory, host RAM, CPUs)."""
    out: list[Shortfall] = []
    out += _gpus(machine, job)
    out += _gpu_memory(machine, job)
    out += _host_ram(machine, job)
    out += _cpus(machine, job)
    return out


def unchecked(machine: Machine, job: JobNeeds) -> list[str]:
    """The checks left out because a figure is not known."""
    left = []
    gpu_memory_known = (
        all(g.total_bytes is not None for n in machine.nodes for g in n.gpus) and machine.gpus > 0
    )
    if job.trainer_bytes_per_gpu is None or not gpu_memory_known:
        left.append("the trainer's GPU memory")
    if job.engine_mem_fraction is None or job.engine_weight_bytes_per_gpu is None or not gpu_memory_known:
        left.append("the engine's GPU memory")
    if job.backup_bytes_per_rank is None or any(n.host_ram_bytes is None for n in machine.nodes):
        left.append("host RAM")
    return left


def check_job(machine: Machine, job: JobNeeds, *, refuse: bool = True) -> str:
    """Raise `PreflightError` (one line per shortfall) when `refuse`; else return the report, one line."""
    shortfalls = preflight(machine, job)
    left = unchecked(machine, job)
    if shortfalls and refuse:
        lines = [s.message for s in shortfalls]
        raise PreflightError(
            f"{job.framework} preflight refused the job ({len(lines)} shortfall(s)):\n" + "\n".join(lines),
            shortfalls=lines,
        )
    head = (
        f"{len(shortfalls)} shortfall(s): " + " | ".join(s.message for s in shortfalls)
        if shortfalls
        else f"fits: {job.gpus} GPU(s) of {machine.gpus}, {job.cpus:g} CPU(s) of {machine.cpus:g}"
    )
    return head + (f" (not checked, figures unknown: {', '.join(left)})" if left else "")


def _gpus(machine: Machine, job: JobNeeds) -> list[Shortfall]:
    out = []
    if job.gpus > machine.gpus:
        out.append(
            Shortfall(
                "gpus",
                f"GPUs: the job asks for {job.gpus} GPU(s) ({job.how('gpus', 'its placement group')}) and the cluster "
                f"has {machine.gpus}: ask for fewer, or add GPUs or nodes",
            )
        )
    largest = max((len(n.gpus) for n in machine.nodes), default=0)
    if job.gpus_per_node > largest:
        out.append(
            Shortfall(
                "gpus",
                f"GPUs per node: the job places {job.gpus_per_node} per node "
                f"({job.how('gpus_per_node', 'GPUs per node')}) and the largest node has {largest}: set it to "
                f"{largest} or less",
            )
        )
    return out


def _gpu_memory(machine: Machine, job: JobNeeds) -> list[Shortfall]:
    totals = [g.total_bytes for n in machine.nodes for g in n.gpus]
    if not totals or any(t is None for t in totals):
        return []
    smallest = min(t for t in totals if t is not None)
    out = []
    fraction = job.engine_mem_fraction
    if fraction is not None and not 0.0 < fraction < 1.0:
        out.append(
            Shortfall(
                "engine_memory",
                f"engine memory: the engine's memory fraction is {fraction:g} "
                f"({job.how('engine_memory', 'its memory fraction')}); it must lie between 0 and 1",
            )
        )
        return out
    engine_static = None if fraction is None else int(fraction * smallest)
    weights = job.engine_weight_bytes_per_gpu
    if engine_static is not None and weights is not None and weights >= engine_static:
        need = math.ceil(100 * (weights + GIB) / smallest) / 100
        out.append(
            Shortfall(
                "engine_memory",
                f"engine memory: a fraction of {fraction:g} of a {_gib(smallest)} GPU is {_gib(engine_static)}, "
                f"not more than the model's weights per engine GPU ({_gib(weights)}), leaving no KV cache: "
                f"raise {job.how('engine_memory', 'the memory fraction')} to at least {min(need, 0.95):.2f}, "
                "or spread each engine over more GPUs",
            )
        )
    if job.trainer_bytes_per_gpu is not None:
        resident = job.trainer_bytes_per_gpu * (2 if job.critic and not job.offload_train else 1)
        # Colocated, both halves are resident at once unless each sleeps while the other runs.
        both = job.colocate and not (job.offload_train and job.offload_rollout)
        beside = engine_static if (both and engine_static is not None) else 0
        room = smallest - beside - GPU_RESERVE_BYTES
        if resident > room:
            why = f", beside the engine's {_gib(beside)} (the halves are resident at once)" if beside else ""
            out.append(
                Shortfall(
                    "trainer_memory",
                    f"trainer memory: the trainer's state needs at least {_gib(resident)} per GPU "
                    f"({job.how('trainer_memory', 'its model parallelism')}) and a {_gib(smallest)} GPU has "
                    f"{_gib(max(room, 0))} for it{why}: raise tensor or pipeline parallelism, use a distributed "
                    "optimizer, or use larger GPUs",
                )
            )
    return out


def _host_ram(machine: Machine, job: JobNeeds) -> list[Shortfall]:
    if job.backup_bytes_per_rank is None:
        return []
    out = []
    per_node = min(job.gpus_per_node, job.trainer_ranks)
    halves = 2 if job.critic else 1
    need = job.backup_bytes_per_rank * per_node * halves
    for node in machine.nodes:
        if node.host_ram_bytes is None or not node.gpus:
            continue
        usable = int(node.host_ram_bytes * HOST_RAM_USABLE)
        if need > usable:
            who = f"{per_node} rank(s) x {_gib(job.backup_bytes_per_rank)}" + (
                " for the actor and the critic" if job.critic else ""
            )
            out.append(
                Shortfall(
                    "host_ram",
                    f"host RAM: the trainer's CPU backups need {_gib(need)} on node {node.name} while it sleeps "
                    f"({who}) and {_gib(usable)} of its available RAM can hold them: spread the trainer over more "
                    f"nodes or more model parallelism ({job.how('host_ram', 'fewer GPUs per node')}), or free host RAM",
                )
            )
    return out


def _cpus(machine: Machine, job: JobNeeds) -> list[Shortfall]:
    if job.cpus <= machine.cpus:
        return []
    return [
        Shortfall(
            "cpus",
            f"CPUs: the job's actors reserve {job.cpus:g} CPU(s) in Ray ({job.how('cpus', 'its actors')}) and the "
            f"cluster offers {machine.cpus:g}: start Ray with --num-cpus {math.ceil(job.cpus)} or more",
        )
    ]


def _gib(nbytes: int | float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------- the job


def model_weight_bytes(checkpoint: str | os.PathLike[str] | None) -> int | None:
    """The bytes of a Hugging Face checkpoint's weights (its *.safetensors or *.bin files); None when
    the directory is not readable here."""
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
    total = sum(f.stat().st_size for f in files if f.is_file())
    return total or None


def _dtype_bytes(checkpoint: str | os.PathLike[str] | None) -> int:
    try:
        config = json.loads((Path(str(checkpoint)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return 2
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 2


def slime_job_needs(
    args: Any,
    *,
    framework: str = "slime",
    weight_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> JobNeeds:
    """What a slime (or miles) job asks for, from its parsed flags (624b824a's names) and its model.

    GPUs as slime's placement group takes them (`--colocate`: the larger of the trainer's and the
    rollout's; `--debug-rollout-only` / `--debug-train-only`: one half), CPUs as its actors reserve
    them (one per placement-group bundle, one for the rollout manager, one for its engine lock), the
    model's size from `--hf-checkpoint` (`weight_bytes` overrides it).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ

    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    actor_gpus = int(get("actor_num_nodes", 1) or 1) * int(get("actor_num_gpus_per_node", 1) or 1)
    rollout_gpus = int(get("rollout_num_gpus", 0) or 0)
    if get("debug_train_only", False):
        gpus, how = actor_gpus, "--actor-num-nodes x --actor-num-gpus-per-node, --debug-train-only"
    elif get("debug_rollout_only", False):
        gpus, how = rollout_gpus, "--rollout-num-gpus, --debug-rollout-only"
    elif get("colocate", False):
        gpus, how = (
            max(actor_gpus, rollout_gpus),
            "--colocate: the larger of the trainer's and --rollout-num-gpus",
        )
    else:
        gpus, how = actor_gpus + rollout_gpus, "the trainer's GPUs plus --rollout-num-gpus"
    tp = int(get("tensor_model_parallel_size", 1) or 1)
    pp = int(get("pipeline_model_parallel_size", 1) or 1)
    cp = int(get("context_parallel_size", 1) or 1)
    dp = max(1, actor_gpus // (tp * pp * cp))
    checkpoint = get("hf_checkpoint")
    weights = weight_bytes if weight_bytes is not None else model_weight_bytes(checkpoint)
    trainer_bytes = backup = engine_weights = None
    if weights is not None:
        params = weights / _dtype_bytes(checkpoint)
        optimizer = OPTIMIZER_BYTES_PER_PARAM / (dp if get("use_distributed_optimizer", False) else 1)
        trainer_bytes = int(
            params * (TRAINER_BYTES_PER_PARAM - OPTIMIZER_BYTES_PER_PARAM + optimizer) / (tp * pp)
        )
        # Asleep, a rank's state is in its CPU backup; slime also keeps bf16 host copies of the actor
        # (and the reference model's, with a KL term) in its TensorBackuper.
        host_copies = 1 + int(bool(get("kl_coef", 0) or get("use_kl_loss", False)))
        backed_up = str(env.get("TMS_INIT_ENABLE_CPU_BACKUP", "1")) not in ("0", "false", "no")
        backup = int((trainer_bytes if backed_up else 0) + host_copies * params * 2 / (tp * pp))
        engine_tp = int(get("rollout_num_gpus_per_engine", 1) or 1)
        engine_weights = int(weights / engine_tp)
    cpus = float(gpus + (0 if get("debug_train_only", False) else 2))
    return JobNeeds(
        framework=framework,
        gpus=gpus,
        gpus_per_node=int(get("num_gpus_per_node", 1) or 1),
        trainer_ranks=actor_gpus,
        colocate=bool(get("colocate", False)),
        offload_train=bool(get("offload_train", False)),
        offload_rollout=bool(get("offload_rollout", False)),
        critic=bool(get("use_critic", False)),
        trainer_bytes_per_gpu=trainer_bytes,
        engine_mem_fraction=get("sglang_mem_fraction_static"),
        engine_weight_bytes_per_gpu=engine_weights,
        backup_bytes_per_rank=backup,
        cpus=cpus,
        flags={
            "gpus": how,
            "gpus_per_node": "--num-gpus-per-node",
            "trainer_memory": f"{_gib(weights or 0)} of weights, TP {tp} x PP {pp}",
            "engine_memory": "--sglang-mem-fraction-static",
            "host_ram": "--num-gpus-per-node, --tensor-model-parallel-size, --pipeline-model-parallel-size",
            "cpus": "one per placement-group bundle, the rollout manager and its engine lock",
        },
    )


def demo_job_needs(
    *,
    trainers: int,
    gpu: bool,
    params: int,
    param_bytes: int,
    engine_mem_fraction: float | None = None,
    engine_param_bytes: int | None = None,
    ranks_per_node: int = 1,
) -> JobNeeds:
    """What `lifecycle demo` asks for: on a GPU host one GPU per trainer rank, shared with that rank's
        one-GPU engine; each rank holds its model's weights, gradients and Adam's two moments in the
        model's dtype (`param_bytes` per parameter) and, asleep, a CPU backup of that state plus its own
        copy of the weights. `engine_mem_fraction` (SGLang's mem_fraction_static) and the engine's weights
        (`engine_param_bytes` per parameter, the model's dtype by default) only with an engine that takes
        a fraction of the GPU; `ranks_per_node`, how many trainer ranks the placement puts on one node
    (their backups share its host RAM). On CPU the ranks need no GPU and a hundredth of a CPU each."""
    state = params * param_bytes * 4
    engine_bytes = None
    if engine_mem_fraction is not None:
        engine_bytes = params * (engine_param_bytes if engine_param_bytes is not None else param_bytes)
    return JobNeeds(
        framework="lifecycle demo",
        gpus=trainers if gpu else 0,
        gpus_per_node=ranks_per_node if gpu else 0,
        trainer_ranks=trainers,
        trainer_bytes_per_gpu=state if gpu else None,
        engine_mem_fraction=engine_mem_fraction if gpu else None,
        engine_weight_bytes_per_gpu=engine_bytes if gpu else None,
        backup_bytes_per_rank=state + params * param_bytes if gpu else None,
        cpus=0.0 if gpu else 0.01 * trainers,
        flags={
            "gpus": "--trainers (one GPU per trainer rank)",
            "gpus_per_node": "one trainer rank per GPU, a node's GPUs filled first",
            "trainer_memory": "the model of --model-config or --hidden/--layers",
            "engine_memory": "--mem-fraction",
            "host_ram": "--trainers, or a smaller --model-config",
            "cpus": "the demo's actors",
        },
    )


# ---------------------------------------------------------------------------------------------- the machine


def _nvidia_smi() -> list[GPU] | None:
    """This node's GPUs and their memory from nvidia-smi (all of them, whatever CUDA_VISIBLE_DEVICES says)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            gpus.append(GPU(name=name.strip(), total_bytes=int(float(mib.strip())) << 20))
        except ValueError:
            continue
    return gpus


def _available_ram() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a dependency of the torch extra
        return None


def _probe_node() -> dict[str, Any]:
    gpus = _nvidia_smi()
    return {
        "gpus": None if gpus is None else [{"name": g.name, "total_bytes": g.total_bytes} for g in gpus],
        "host_ram_bytes": _available_ram(),
    }


def describe_this_machine(*, cpus: float | None = None) -> Machine:
    """This host as one node: its GPUs (nvidia-smi, else torch's view), CPUs, available host RAM."""
    gpus = _nvidia_smi()
    if gpus is None:
        try:
            import torch

            gpus = [
                GPU(
                    name=torch.cuda.get_device_name(i),
                    total_bytes=torch.cuda.get_device_properties(i).total_memory,
                )
                for i in range(torch.cuda.device_count())
            ]
        except ImportError:
            gpus = []
    return Machine(
        nodes=(
            Node(
                name=os.uname().nodename,
                gpus=tuple(gpus),
                cpus=float(cpus if cpus is not None else os.cpu_count() or 0),
                host_ram_bytes=_available_ram(),
            ),
        )
    )


def describe_ray_cluster(*, timeout_s: float = 60.0) -> Machine:
    """The alive nodes of the connected Ray cluster: GPUs and CPUs as Ray schedules them, each GPU's
    memory and the host RAM read on the node itself (one probe task per node, no resources held);
    a node whose probe does not answer keeps its figures unknown."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]  # ray ships no types
    probe = ray.remote(num_cpus=0, num_gpus=0)(_probe_node)
    refs = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
        ).remote()
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    described = []
    for node, ref in zip(nodes, refs, strict=True):
        resources = node.get("Resources", {})
        count = int(resources.get("GPU", 0))
        read: dict[str, Any] = {}
        if ref in ready:
            try:
                read = ray.get(ref)
            except Exception:  # a probe that failed leaves the figures unknown, as one that timed out
                read = {}
        measured = read.get("gpus")
        if measured is not None and len(measured) >= count:
            gpus: Sequence[GPU] = [
                GPU(name=g["name"], total_bytes=g["total_bytes"]) for g in measured[:count]
            ]
        else:
            gpus = [GPU() for _ in range(count)]
        described.append(
            Node(
                name=str(node.get("NodeManagerAddress", node["NodeID"])),
                gpus=tuple(gpus),
                cpus=float(resources.get("CPU", 0.0)),
                host_ram_bytes=read.get("host_ram_bytes"),
            )
        )
    return Machine(nodes=tuple(described))

"""Where the demo's actors run: Ray, the device, one trainer rank per GPU sharing it with an engine.

Each slot (an engine and its trainer ranks) is kept on one node (`cluster.place_slots`); on the
CPU the slots are spread over the cluster's nodes. Every actor then reports where it runs, the
node topology is checked (`NodeTopology.plan`), and each trainer rank's transport is chosen for
its pair of nodes; the table of (sender node, receiver node) → transport is printed and kept.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from actor_integration.actors.cluster import SlotPlacement, cluster_nodes, describe_cluster, place_slots
from actor_integration.actors.ray_group import LifecycleGroup
from actor_integration.rollout.registry import engine_names
from actor_integration.tools.demo.options import ENGINE_NAMES, refuse
from actor_integration.weight_sync.nodes import (
    NodeTopology,
    Place,
    TransportRow,
    node_label,
    transport_table,
)
from actor_integration.weight_sync.topology import SlotTopology

# The first call to the new actors waits for Ray to start their processes (a fresh worker imports
# torch): on a loaded host that took over 20 s (CI, two test workers), which is a start, not a hang.
# Their slots are already reserved (`place_slots`), so this only lets a slow start finish; every
# call after it keeps `--timeout-s`.
START_S = 120.0
VOCAB = 97


@dataclass(frozen=True)
class Placement:
    """The started actors, their lifecycle groups, and what the trainers reported from `init`."""

    device: str
    engine: str  # "reference", "sglang" or "vllm"
    vocab: int  # the model's vocabulary (prompts are drawn from it)
    wake_rest: tuple[str, ...]  # the rollout tags its wake resumes after the weights and the sync
    trainers: int
    engine_gpu_counts: list[int]
    trainer_actors: list[Any]
    rollout_actors: list[Any]
    trainer_group: LifecycleGroup
    rollout_group: LifecycleGroup
    infos: list[dict[str, Any]]
    slots: SlotPlacement
    topology: NodeTopology
    transports: tuple[TransportRow, ...]  # what the ranks chose, per (sender node, receiver node)
    designed: tuple[TransportRow, ...]  # what the node topology says they should choose
    nodes: dict[str, str]  # node id → "id8 (ip)"
    places: dict[str, dict[int, dict[str, Any]]]  # role → rank → where it runs (node, pid, GPUs)

    def __post_init__(self) -> None:
        if self.engine not in engine_names():
            raise ValueError(f"Placement: engine must be one of {list(engine_names())}, got {self.engine!r}")

    @property
    def transport(self) -> str:
        name: str = self.infos[0]["transport"]
        return name


def start_ray(args: argparse.Namespace, console: Console) -> Any:
    import ray

    if args.address:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
        console.print(f"joined Ray cluster at {args.address}: {describe_cluster()}")
    else:
        ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        console.print(f"started a local Ray cluster: {describe_cluster()}")
    return ray


def resolve_device(requested: str, transport: str = "auto", engine: str = "reference") -> str:
    """The device the demo runs on; refuses what this machine cannot do before Ray starts."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda asked for, but torch sees no GPU (see `lifecycle doctor`)")
    device = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and engine in ENGINE_NAMES:
        refuse(f"--engine {engine} needs a GPU ({ENGINE_NAMES[engine]} runs on CUDA); torch sees none")
    if device == "cpu" and transport == "cuda_ipc":
        refuse("--transport cuda_ipc needs CUDA, and the demo runs on the CPU here: use shm (or auto)")
    return device


def place(ray: Any, args: argparse.Namespace, device: str, out: Path, console: Console) -> Placement:
    """Start the rollout engines and the trainer ranks, initialise the trainers (asleep, as slime's)."""
    from actor_integration.tools.demo.rollout import DemoRollout
    from actor_integration.tools.demo.trainer import DemoTrainer

    gpus = int(ray.cluster_resources().get("GPU", 0))
    trainers = args.trainers or (max(gpus, 1) if device == "cuda" else 2)
    if device == "cuda" and args.engines not in (None, trainers):
        refuse(
            f"on a GPU host every GPU has its own 1-GPU engine ({trainers}); --engines "
            f"{args.engines} is for CPU runs"
        )
    if device == "cuda" and trainers > gpus:
        refuse(
            f"{trainers} trainer ranks need {trainers} GPUs (one rank per GPU: NCCL refuses two "
            f"ranks on one GPU, 'Duplicate GPU detected'); this cluster has {gpus}"
        )
    engine: str = getattr(args, "engine", "reference")
    if engine in ENGINE_NAMES and device != "cuda":
        refuse(f"--engine {engine} needs a GPU ({ENGINE_NAMES[engine]} runs on CUDA); torch sees none")
    if engine in ENGINE_NAMES:
        from actor_integration.models.qwen2 import QwenConfig

        config_dir = str(Path(args.model_config).resolve())
        try:
            vocab = QwenConfig.from_json(config_dir).vocab_size
        except ValueError as exc:
            refuse(f"--model-config {args.model_config}: {exc}")
        model: dict[str, Any] = {"qwen_config": config_dir, "seed": args.seed}
    else:
        vocab = VOCAB
        model = {
            "vocab_size": VOCAB,
            "dim": args.hidden,
            "n_layers": args.layers,
            "n_heads": 4,
            "max_seq_len": 64,
            "seed": args.seed,
        }
    preflight(args, device, trainers, engine, model, console)
    # GPU: one 1-GPU engine per trainer GPU, each sharing it (0.5 + 0.5). CPU: one engine over
    # `trainers // engines` virtual devices per slot, so the slot has several ranks and one coordinator.
    if device == "cuda":
        engine_gpu_counts = [1] * trainers
    else:
        engines = args.engines or 1
        if trainers % engines:
            refuse(f"--engines {engines} must divide the {trainers} trainer ranks into equal slots")
        engine_gpu_counts = [trainers // engines] * engines
    try:
        slots = place_slots(engine_gpu_counts, gpu=device == "cuda", timeout_s=args.timeout_s)
    except TimeoutError as exc:
        refuse(str(exc))
    rollout_options = [slots.engine_options(i) for i in range(len(engine_gpu_counts))]
    if device == "cuda":
        rollout_devices = [["cuda:0"] for _ in range(trainers)]
    else:
        rollout_devices = [["cpu"] * count for count in engine_gpu_counts]
    console.print(
        f"[bold]lifecycle demo[/]: {trainers} trainer rank(s) on {device}, {len(engine_gpu_counts)} rollout "
        f"engine(s) ({engine}) of {engine_gpu_counts} device(s), {args.steps} steps, checkpoint every {args.save_every}, "
        f"transport {args.transport}, output {out}"
    )
    # Threaded (two calls at once): a rank blocked on peers lost with their node can still be told.
    trainer_cls = ray.remote(max_concurrency=2)(DemoTrainer)
    if engine in ENGINE_NAMES:
        rollouts, wake_rest = _start_engines(ray, args, engine, model, rollout_options, out, console)
    else:
        wake_rest = ("kv_cache",)
        rollout_cls = ray.remote(DemoRollout)
        rollouts = [
            rollout_cls.options(**opts).remote(
                model=model, devices=devs, rank=i, out=str(out), world_size=len(rollout_options)
            )
            for i, (opts, devs) in enumerate(zip(rollout_options, rollout_devices, strict=True))
        ]
    actors = [trainer_cls.options(**slots.rank_options(i)).remote() for i in range(trainers)]
    trainer_group = LifecycleGroup(actors, timeout_s=args.timeout_s, role="trainer")
    rollout_group = LifecycleGroup(rollouts, timeout_s=args.timeout_s, role="rollout")
    trainer_group.link(rollout_group)
    topology = _node_topology(
        trainers,
        engine_gpu_counts,
        trainer_group.locate(timeout_s=max(args.timeout_s, START_S)),
        rollout_group.locate(timeout_s=max(args.timeout_s, START_S)),
        device,
    )
    nodes = {n.node_id: n.label for n in cluster_nodes()}
    render_slots(topology, nodes, console)
    pairs = {p.rank: p for p in topology.pairs() if p.colocated}
    init_method = ray.get(actors[0].rendezvous.remote(), timeout=args.timeout_s)
    infos = ray.get(
        [
            a.init.remote(
                rank=i,
                world_size=trainers,
                init_method=init_method,
                device=device,
                model=model,
                engine_gpu_counts=engine_gpu_counts,
                rollouts=rollouts,
                transport=args.transport,
                bucket_mb=args.bucket_mb,
                memory_budget=not getattr(args, "no_memory_budget", False),
                out=str(out),
                timeout_s=args.timeout_s,
                between=(pairs[i].sender.node, pairs[i].receiver.node),
            )
            for i, a in enumerate(actors)
        ],
        timeout=args.timeout_s * 2,
    )
    console.print(
        f"trainer memory: {infos[0]['memory']}; weight transport: [bold]{infos[0]['transport']}[/]; "
        f"slot coordinators: {[i['rank'] for i in infos if i['coordinator']]}"
    )
    probes: dict[str, Callable[[], tuple[bool, str]]] = {}
    for info in infos:  # each node's CUDA IPC probe, as its first rank found it
        ok, why = info["cuda_ipc_probe"]
        probes.setdefault(info["node_id"], functools.partial(_probed, bool(ok), str(why)))
    designed = topology.transport_table(args.transport, probe=probes)
    reasons = {(r.sender_node, r.receiver_node, r.transport): r.reason for r in designed}
    chosen = transport_table(
        topology.pairs(),
        lambda p: (
            infos[p.rank]["transport"],
            reasons.get((p.sender.node, p.receiver.node, infos[p.rank]["transport"]), "not as designed"),
        ),
    )
    render_transports(chosen, nodes, console)
    placed = Placement(
        device=device,
        engine=engine,
        vocab=vocab,
        wake_rest=wake_rest,
        trainers=trainers,
        engine_gpu_counts=engine_gpu_counts,
        trainer_actors=actors,
        rollout_actors=rollouts,
        trainer_group=trainer_group,
        rollout_group=rollout_group,
        infos=infos,
        slots=slots,
        topology=topology,
        transports=chosen,
        designed=designed,
        nodes=nodes,
        places={"trainer": dict(trainer_group.places), "rollout": dict(rollout_group.places)},
    )
    placed.trainer_group.assert_consistent()
    return placed


def _start_engines(
    ray: Any,
    args: argparse.Namespace,
    engine: str,
    model: dict[str, Any],
    rollout_options: list[dict[str, Any]],
    out: Path,
    console: Console,
) -> tuple[list[Any], tuple[str, ...]]:
    """One real engine's actor per GPU (`DemoSGLangRollout`, `DemoVLLMRollout`), waited for until its
    engine is up; the actors, and the tags a wake resumes after the weights and the sync."""
    from actor_integration.tools.demo.rollout import DemoSGLangRollout, DemoVLLMRollout

    common = {"config_dir": model["qwen_config"], "mem_fraction": args.mem_fraction, "seed": args.seed}
    if engine == "sglang":
        cls, options = ray.remote(DemoSGLangRollout), {**common, "timeout_s": args.timeout_s}
    else:
        cls, options = ray.remote(DemoVLLMRollout), common
    rollouts = [
        cls.options(**opts).remote(rank=i, out=str(out), **options) for i, opts in enumerate(rollout_options)
    ]
    # The engine starts in the actors' constructors: wait for it here, not inside the trainers' deadline.
    started = time.monotonic()
    described = ray.get([r.describe_engine.remote() for r in rollouts], timeout=max(args.timeout_s, 300.0))
    first = described[0]
    console.print(
        f"{ENGINE_NAMES[engine]} {first['version']} up on {len(rollouts)} GPU(s) in "
        f"{time.monotonic() - started:.1f} s: tags {first['memory_tags']}, weights via {first['weights_via']}, "
        f"CUDA graphs {'on' if first['cuda_graphs'] else 'off'}"
        + (f", sleep level {first['sleep_level']}" if "sleep_level" in first else "")
    )
    return rollouts, tuple(t for t in first["memory_tags"] if t != "weights")


def preflight(
    args: argparse.Namespace, device: str, trainers: int, engine: str, model: dict[str, Any], console: Console
) -> None:
    """What the demo needs (`tools.preflight.demo_job_needs`: GPUs, each GPU's memory for the trainer's
    state beside the engine's fraction, host RAM for the sleeping ranks' backups, CPUs) against the Ray
    cluster, before any actor starts; each shortfall a line of the refusal (exit 2)."""
    import torch

    from actor_integration.errors import PreflightError
    from actor_integration.models.qwen2 import QwenConfig, QwenLM
    from actor_integration.models.tiny import TinyLM, TinyLMConfig
    from actor_integration.tools.preflight import check_job, demo_job_needs, describe_ray_cluster

    with torch.device("meta"):  # sizes only: nothing allocated, nothing initialised
        if "qwen_config" in model:
            built: torch.nn.Module = QwenLM(QwenConfig.from_json(model["qwen_config"]), device="meta")
        else:
            built = TinyLM(TinyLMConfig(**model))
    params = sum(p.numel() for p in built.parameters())
    param_bytes = next(built.parameters()).element_size()
    machine = describe_ray_cluster(timeout_s=min(args.timeout_s, 60.0))
    largest = max((len(n.gpus) for n in machine.nodes), default=0)
    needs = demo_job_needs(
        trainers=trainers,
        gpu=device == "cuda",
        params=params,
        param_bytes=param_bytes,
        engine_mem_fraction=args.mem_fraction if engine in ENGINE_NAMES else None,
        ranks_per_node=max(1, min(trainers, largest)),
    )
    try:
        console.print(f"preflight: {check_job(machine, needs)}")
    except PreflightError as exc:
        refuse(str(exc))


def _node_topology(
    trainers: int,
    engine_gpu_counts: list[int],
    rank_places: dict[int, dict[str, Any]],
    engine_places: dict[int, dict[str, Any]],
    device: str,
) -> NodeTopology:
    """The places every actor reported, checked: each engine rank on its trainer rank's node (and
    GPU); refused with the slot and what to change otherwise."""
    from actor_integration.errors import PlacementError

    def place(where: dict[str, Any]) -> Place:
        gpus = where.get("gpus") or []
        return Place(where["node_id"], int(gpus[0]) if device == "cuda" and gpus else None)

    ranks = [place(rank_places[r]) for r in range(trainers)]
    # A CPU engine is one actor over its slot's virtual devices; on a GPU each engine has one GPU.
    engines = [[place(engine_places[e])] * count for e, count in enumerate(engine_gpu_counts)]
    try:
        return NodeTopology.plan(SlotTopology.plan(trainers, engine_gpu_counts), ranks, engines)
    except PlacementError as exc:
        refuse(str(exc))


def render_slots(topology: NodeTopology, nodes: dict[str, str], console: Console) -> None:
    """One line per slot: its node, its trainer ranks and its engine index. A function of its own:
    its loop variable once rebound `place`'s engine kind to the last slot's index (issue 46)."""
    for slot, (ranks, index) in enumerate(
        zip(topology.slots.slots, topology.slots.slot_engines, strict=True)
    ):
        node = topology.ranks[ranks[0]].node
        console.print(
            f"slot {slot} on node {nodes.get(node, node_label(node))}: trainer ranks {list(ranks)}, engine {index}"
        )


def render_transports(rows: tuple[TransportRow, ...], nodes: dict[str, str], console: Console) -> None:
    """The weight transport per (sender node, receiver node), with the pairs and why."""
    from rich.table import Table

    table = Table(title="weight transport per (sender node, receiver node)")
    for column in ("sender node", "receiver node", "transport", "trainer ranks", "engines", "why"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            nodes.get(row.sender_node, node_label(row.sender_node)),
            nodes.get(row.receiver_node, node_label(row.receiver_node)),
            row.transport,
            str(list(row.ranks)),
            str(list(row.engines)),
            row.reason,
        )
    console.print(table)


def _probed(ok: bool, why: str) -> tuple[bool, str]:
    return ok, why

"""The Ray cluster's nodes: what a cluster has, where an actor runs, slots placed per node, a node
found lost, and the per-rank logs gathered from every node.

    placement = place_slots([2, 2], gpu=False, timeout_s=60)   # one node per slot
    trainer = Trainer.options(**placement.rank_options(rank)).remote()
    engine = Engine.options(**placement.engine_options(slot)).remote()
    ...
    gather_logs("run-logs/")   # one task per live node; then `lifecycle check run-logs/`

Each rank writes its log on its own node (`lifecycle.configure_rank_log`); `gather_logs` brings
them to the driver in one call (`lifecycle gather` in one command). Ray is imported where it is
used, so an actor can import `here` and `lose_peers` without a driver's imports.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actor_integration.errors import NodeLostError
from actor_integration.weight_sync.nodes import node_label
from lifecycle.events import DEFAULT_LOG_DIR, LOG_DIR_ENV
from lifecycle.logs import Event

__all__ = [
    "GatheredLogs",
    "NodeInfo",
    "NodeLostError",
    "SlotPlacement",
    "cluster_nodes",
    "describe_cluster",
    "gather_logs",
    "here",
    "lose_peers",
    "lost_nodes",
    "place_slots",
]


def here() -> dict[str, Any]:
    """Where this process runs: Ray node id, IP, hostname, pid and the GPU ids Ray gave it (the
    node's own indices); outside a Ray worker the node is the hostname."""
    import ray

    host = socket.gethostname()
    if not ray.is_initialized():
        return {"node_id": host, "node_ip": None, "hostname": host, "pid": os.getpid(), "gpus": []}
    context = ray.get_runtime_context()
    gpus = [int(g) if str(g).isdigit() else g for g in ray.get_gpu_ids()]
    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        "hostname": host,
        "pid": os.getpid(),
        "gpus": gpus,
    }


def lose_peers(lifecycle: Any, lost: Mapping[str, Sequence[int]], reason: str) -> dict[str, Any]:
    """What an actor does when its driver found `lost` (role → ranks) gone with their node: its
    process groups give up every wait on the lost ranks of its own role (`abandon`), it logs
    `ranks.lost` (what `lifecycle check` reads), and returns its snapshot. Takes no lock: it runs on
    a second thread of a threaded actor while the first is blocked on those peers."""
    mine = sorted(lost.get(lifecycle.context.get("role"), ()))
    abandon = getattr(lifecycle.hooks.process_groups, "abandon", None)
    if mine and callable(abandon):
        abandon(mine, reason)
    lifecycle.event(
        Event.RANKS_LOST, "error", lost={role: list(ranks) for role, ranks in lost.items()}, reason=reason
    )
    snapshot: dict[str, Any] = lifecycle.snapshot()
    return snapshot


# ---------------------------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class NodeInfo:
    """One node as Ray's GCS lists it."""

    node_id: str
    ip: str
    alive: bool
    cpus: float
    gpus: float
    raylet_port: int
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{node_label(self.node_id)} ({self.ip})"


def cluster_nodes() -> list[NodeInfo]:
    """Every node Ray knows, dead ones included, in the GCS's order."""
    import ray

    return [
        NodeInfo(
            node_id=n["NodeID"],
            ip=n.get("NodeManagerAddress", "?"),
            alive=bool(n.get("Alive")),
            cpus=float(n.get("Resources", {}).get("CPU", 0)),
            gpus=float(n.get("Resources", {}).get("GPU", 0)),
            raylet_port=int(n.get("NodeManagerPort", 0)),
            resources=dict(n.get("Resources", {})),
        )
        for n in ray.nodes()  # type: ignore[no-untyped-call]
    ]


def describe_cluster(nodes: Sequence[NodeInfo] | None = None) -> str:
    """One line on what the cluster has: live nodes, CPUs, GPUs, each node's share."""
    nodes = [n for n in (cluster_nodes() if nodes is None else nodes) if n.alive]
    each = "; ".join(f"{n.label}: {n.cpus:g} CPUs, {n.gpus:g} GPUs" for n in nodes)
    return (
        f"{len(nodes)} node(s), {sum(n.cpus for n in nodes):g} CPUs, {sum(n.gpus for n in nodes):g} GPUs "
        f"({each})"
    )


def lost_nodes(node_ids: Iterable[str], *, probe_s: float = 1.0) -> dict[str, str]:
    """Of `node_ids`, the nodes that are gone, each described with how that is known: Ray marked
    it dead, or its raylet does not accept a connection within `probe_s` (Ray's own health check
    takes ~15 s to say what a refused connection says at once)."""
    known = {n.node_id: n for n in cluster_nodes()}
    out: dict[str, str] = {}
    for node in dict.fromkeys(node_ids):
        info = known.get(node)
        if info is None:
            out[node] = f"{node_label(node)}, no longer in the cluster"
        elif not info.alive:
            out[node] = f"{info.label}, marked dead by Ray"
        elif not _accepts(info.ip, info.raylet_port, probe_s):
            out[node] = f"{info.label}, whose raylet at {info.ip}:{info.raylet_port} refuses connections"
    return out


def _accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- placement

# A CPU rank holds this much of a CPU: the CPU demo time-shares the host's cores (a 2-core CI
# machine runs 4 ranks and 2 engines), but a placement-group bundle needs some resource to place.
CPU_PER_RANK = 0.01


@dataclass(frozen=True)
class SlotPlacement:
    """Placement groups that keep each slot (its trainer ranks and their engine) on one node.

    On GPUs: one STRICT_PACK group per slot, one bundle per GPU; rank k of a slot and the engine
    share bundles (0.5 GPU each, as one GPU time-shared). On the CPU: one group, one bundle per
    slot (`CPU_PER_RANK` per rank), spread over the nodes (`spread`) or packed. `nodes[s]` is slot s's node;
    slots are numbered in node order, so ranks on one node are consecutive.
    """

    sizes: tuple[int, ...]
    gpu: bool
    groups: tuple[Any, ...]  # ray PlacementGroup per slot (on the CPU: the same group)
    bundles: tuple[int, ...]  # slot → its first bundle in its group
    nodes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    def slot_of(self, rank: int) -> tuple[int, int]:
        """(slot, index in the slot) of trainer `rank`."""
        start = 0
        for slot, size in enumerate(self.sizes):
            if rank < start + size:
                return slot, rank - start
            start += size
        raise ValueError(f"SlotPlacement: rank {rank} is beyond the {self.world_size} ranks placed")

    def rank_options(self, rank: int) -> dict[str, Any]:
        """`.options(...)` for trainer `rank`: its slot's group and bundle."""
        slot, index = self.slot_of(rank)
        bundle = self.bundles[slot] + (index if self.gpu else 0)
        resources = {"num_gpus": 0.5, "num_cpus": 0} if self.gpu else {"num_cpus": CPU_PER_RANK}
        return {**resources, "scheduling_strategy": self._strategy(slot, bundle)}

    def engine_options(self, slot: int) -> dict[str, Any]:
        """`.options(...)` for the engine of `slot`: its first bundle (its other GPUs are the ones
        its trainer ranks report: give it those, not ids computed from ranks)."""
        resources = {"num_gpus": 0.5, "num_cpus": 0} if self.gpu else {"num_cpus": 0}
        return {**resources, "scheduling_strategy": self._strategy(slot, self.bundles[slot])}

    def _strategy(self, slot: int, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.groups[slot], placement_group_bundle_index=bundle)

    def remove(self) -> None:
        """Give the placement groups back."""
        from ray.util.placement_group import remove_placement_group

        for group in dict.fromkeys(self.groups):
            remove_placement_group(group)


def place_slots(sizes: Sequence[int], *, gpu: bool, timeout_s: float, spread: bool = True) -> SlotPlacement:
    """Reserve the slots (trainer ranks per engine) and learn each slot's node; see `SlotPlacement`.
    Refuses, naming what the cluster has, when the groups cannot be placed within `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    sizes = tuple(sizes)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"place_slots: every slot needs at least one rank, got {list(sizes)}")
    if gpu:
        groups = [placement_group([{"GPU": 1, "CPU": 1}] * s, strategy="STRICT_PACK") for s in sizes]
        firsts = [0] * len(sizes)
    else:
        one = placement_group(
            [{"CPU": s * CPU_PER_RANK} for s in sizes], strategy="SPREAD" if spread else "PACK"
        )
        groups, firsts = [one] * len(sizes), list(range(len(sizes)))
    unique = list(dict.fromkeys(groups))
    ready, _ = ray.wait([g.ready() for g in unique], num_returns=len(unique), timeout=timeout_s)
    if len(ready) != len(unique):
        for g in unique:
            remove_placement_group(g)
        need = "1 GPU and 1 CPU per trainer rank" if gpu else f"{CPU_PER_RANK} CPU per trainer rank"
        raise TimeoutError(
            f"place_slots: the slots {list(sizes)} (each on one node; {need}) could not be placed within "
            f"{timeout_s:.0f} s on this cluster: {describe_cluster()}. Add nodes, free resources, or use "
            "fewer or smaller slots."
        )
    nodes = [placement_group_table(g)["bundles_to_node_id"][b] for g, b in zip(groups, firsts, strict=True)]
    order = {n.node_id: i for i, n in enumerate(cluster_nodes())}
    slots = sorted(range(len(sizes)), key=lambda s: (order.get(nodes[s], len(order)), s))
    return SlotPlacement(
        sizes=tuple(sizes[s] for s in slots),
        gpu=gpu,
        groups=tuple(groups[s] for s in slots),
        bundles=tuple(firsts[s] for s in slots),
        nodes=tuple(nodes[s] for s in slots),
    )


# ---------------------------------------------------------------------------------------------- logs


@dataclass(frozen=True)
class GatheredLogs:
    """What `gather_logs` brought back: file → the nodes that had it, the nodes that could not be
    read (lost, or their task failed), and where the files were written."""

    directory: Path
    files: dict[str, list[str]]
    unread: dict[str, str]

    def __str__(self) -> str:
        nodes = {n for holders in self.files.values() for n in holders}
        text = f"{len(self.files)} log file(s) from {len(nodes)} node(s) into {self.directory}"
        shared = sum(len(holders) > 1 for holders in self.files.values())
        if shared:
            text += (
                f" ({shared} held by several nodes with the same bytes: a shared filesystem; written once)"
            )
        if self.unread:
            text += "; not read: " + "; ".join(f"{node_label(n)}: {why}" for n, why in self.unread.items())
        return text


def _read_logs(directory: str | None) -> dict[str, Any]:
    """On one node: its per-rank logs (the `*.jsonl` of `directory`, else of where the actors there
    write by default: `$RL_LIFECYCLE_LOG_DIR`, else `./lifecycle-logs`)."""
    import ray

    where = Path(directory or os.environ.get(LOG_DIR_ENV, "").strip() or DEFAULT_LOG_DIR)
    files = {p.name: p.read_bytes() for p in sorted(where.glob("*.jsonl"))} if where.is_dir() else {}
    return {"node_id": ray.get_runtime_context().get_node_id(), "directory": str(where), "files": files}


def gather_logs(
    destination: str | Path, *, directory: str | None = None, timeout_s: float = 60.0
) -> GatheredLogs:
    """Copy every live node's per-rank logs into `destination`, one Ray task per node, so that
    `lifecycle check` and `lifecycle timeline` read one directory. `directory` is where the ranks
    wrote on their nodes (default: each node's own default log directory). A file held by several
    nodes with the same bytes (a shared filesystem) is written once; with other bytes, each copy
    is kept as `<name>.<node>.jsonl`. `gathered.json` says which node had which file."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = Path(destination)
    out.mkdir(parents=True, exist_ok=True)
    read = ray.remote(num_cpus=0)(_read_logs)
    nodes = [n for n in cluster_nodes() if n.alive]
    # A node whose raylet is gone is still "alive" to Ray for ~15 s; a task sent there waits that long.
    unread: dict[str, str] = {
        node: f"lost: {how}" for node, how in lost_nodes(n.node_id for n in nodes).items()
    }
    live = [n for n in nodes if n.node_id not in unread]
    refs = {
        n.node_id: read.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)
        ).remote(directory)
        for n in live
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    files: dict[str, list[str]] = {}
    digests: dict[str, str] = {}
    for node, ref in refs.items():
        if ref not in ready:
            unread[node] = f"no answer within {timeout_s:.0f} s"
            continue
        try:
            answer = ray.get(ref)
        except Exception as exc:  # a node lost while we read: named, the others kept
            unread[node] = f"{type(exc).__name__}: {exc}"
            continue
        for name, data in answer["files"].items():
            digest = hashlib.sha256(data).hexdigest()
            target = (
                name if digests.get(name, digest) == digest else f"{Path(name).stem}.{node_label(node)}.jsonl"
            )
            if target not in digests:
                destination_file = out / target
                if not (destination_file.exists() and destination_file.read_bytes() == data):
                    destination_file.write_bytes(data)
                digests[target] = digest
            files.setdefault(target, []).append(node)
    gathered = GatheredLogs(out, files, unread)
    (out / "gathered.json").write_text(
        json.dumps({"time": time.time(), "files": files, "unread": unread}, indent=2)
    )
    return gathered

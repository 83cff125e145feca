"""Where every trainer rank and engine rank runs (its node and physical GPU), and what that decides.

`SlotTopology` knows ranks, engines and GPU offsets; `NodeTopology` adds the place each process
reported about itself (`Place`: its Ray node and the machine-wide GPU index on it). The rules:

- A colocated engine rank sits on its trainer rank's node and GPU. So a slot stays on one node,
  unless its engine itself spans nodes (SGLang `nnodes > 1`): then the engine still has one
  coordinator (the slot's lowest rank, on the engine's head node) and followers on its other
  nodes, which a driver never calls (miles: an engine actor with `node_rank != 0` answers every
  call with None). The engine's GPUs are the ones its trainer ranks report, never arithmetic on
  ranks (slime's `get_base_gpu_id` assumes every node has the same GPUs in rank order).
- The weight transport is decided per (sender node, receiver node): cuda_ipc or shm within a node,
  nccl or disk across nodes. cuda_ipc or shm between nodes is refused (`CrossNodeTransportError`)
  when asked for, before anything is exported: a CUDA IPC handle or a /dev/shm file only opens on
  the host that made it.

Pure: no torch, no Ray; the driver and every rank compute the same answer from the same places.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from actor_integration.errors import CrossNodeTransportError, PlacementError
from actor_integration.weight_sync.topology import SlotTopology

# `decide_transport`'s probe: whether CUDA IPC export works in the sender's process, and why.
Probe = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class Place:
    """Where one process runs: its node (a Ray node id, or any name) and, on a GPU host, the
    machine-wide index of the GPU it uses (None on the CPU)."""

    node: str
    gpu: int | None = None

    def __str__(self) -> str:
        return node_label(self.node) + ("" if self.gpu is None else f" GPU {self.gpu}")


def node_label(node: str) -> str:
    """A Ray node id shortened to its first 8 hex digits (the 56-digit id is unreadable in a table)."""
    return node[:8] if len(node) > 16 and all(c in "0123456789abcdef" for c in node) else node


@dataclass(frozen=True)
class Pair:
    """One sender → receiver link of a weight sync: trainer `rank`'s buffers, read by rank
    `engine_rank` of `engine` (its GPU index inside the engine)."""

    rank: int
    engine: int
    engine_rank: int
    sender: Place
    receiver: Place
    colocated: bool

    @property
    def same_node(self) -> bool:
        return self.sender.node == self.receiver.node


@dataclass(frozen=True)
class TransportRow:
    """The transport of every pair between one sender node and one receiver node (and why)."""

    sender_node: str
    receiver_node: str
    transport: str
    reason: str
    pairs: tuple[Pair, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({p.rank for p in self.pairs}))

    @property
    def engines(self) -> tuple[int, ...]:
        return tuple(sorted({p.engine for p in self.pairs}))

    def __str__(self) -> str:
        return (
            f"{node_label(self.sender_node)} -> {node_label(self.receiver_node)}: {self.transport} "
            f"(trainer ranks {list(self.ranks)} -> engines {list(self.engines)}; {self.reason})"
        )


def decide_transport(
    requested: str,
    *,
    colocated: bool,
    same_node: bool,
    probe: Probe | None = None,
    between: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """The transport for one pair, and why; refuses what cannot work there.

    `nccl` toward a colocated engine rank is refused (NCCL cannot connect two ranks on one GPU:
    "Duplicate GPU detected"); `cuda_ipc` toward another GPU is refused (its handles open only
    on the GPU that exported them); `cuda_ipc` and `shm` toward another node are refused
    (`CrossNodeTransportError`). `auto` is cuda_ipc where `probe` says CUDA IPC export works,
    else shm, for a colocated engine rank, and nccl for any other. `between`: the (sender,
    receiver) nodes, for the refusals' words.
    """
    if colocated and not same_node:
        raise PlacementError(
            "a colocated engine rank must be on its trainer rank's node (they share one GPU), but this pair "
            "spans two nodes; check the placement (NodeTopology.plan says which slot)"
        )
    if requested in ("cuda_ipc", "shm") and not same_node:
        what = "CUDA IPC handles" if requested == "cuda_ipc" else "shared-memory files (/dev/shm)"
        sender, receiver = between or ("?", "?")
        nodes = f"nodes {node_label(sender)} and {node_label(receiver)}" if between else "two nodes"
        raise CrossNodeTransportError(
            f"weight transport {requested!r} refused between {nodes}: {what} open only on the host that "
            "made them, so the engine rank could not read the trainer's buffers. Use 'nccl' (what 'auto' "
            "picks across nodes), or 'disk' on a filesystem both nodes mount; or place the engine on its "
            "trainer ranks' node.",
            requested=requested,
            sender_node=sender,
            receiver_node=receiver,
        )
    if requested == "nccl" and colocated:
        raise ValueError(
            "weight transport 'nccl' refused for a colocated engine: the trainer rank and the engine rank "
            "share a GPU and NCCL cannot connect two ranks on one GPU ('Duplicate GPU detected'). "
            "Use 'cuda_ipc' (what 'auto' picks when CUDA IPC works), or 'shm' / 'disk'."
        )
    if requested == "cuda_ipc" and not colocated:
        raise ValueError(
            "weight transport 'cuda_ipc' refused for a non-colocated engine: CUDA IPC handles only open on "
            "the GPUs that exported them. Use 'nccl' (what 'auto' picks for remote engines), or 'disk' on a "
            "shared filesystem."
        )
    if requested == "disk" and not same_node:
        return "disk", "requested explicitly; the directory must be on a filesystem both nodes mount"
    if requested != "auto":
        return requested, "requested explicitly"
    if not same_node:
        return "nccl", "the engine rank is on another node: broadcast over a process group"
    if not colocated:
        return "nccl", "the engine is not colocated: broadcast over a process group"
    ok, why = probe() if probe is not None else (False, "CUDA IPC was not probed")
    return ("cuda_ipc", why) if ok else ("shm", f"{why}; falling back to shared host memory")


@dataclass(frozen=True)
class NodeTopology:
    """`SlotTopology` with the place of every trainer rank and engine rank, checked by `plan`.

    `engines[i]` lists engine i's places in its rank order (one per GPU; on the CPU one per
    device, all the engine actor's node). A remote engine is fed by `remote_source`.
    """

    slots: SlotTopology
    ranks: tuple[Place, ...]
    engines: tuple[tuple[Place, ...], ...]
    remote_source: int = 0

    @classmethod
    def plan(
        cls,
        slots: SlotTopology,
        ranks: Sequence[Place],
        engines: Sequence[Sequence[Place]],
        *,
        remote_source: int = 0,
    ) -> NodeTopology:
        """Check that every colocated engine rank is on its trainer rank's node and GPU, or raise
        `PlacementError` naming the slot, its ranks, the nodes and what to change."""
        rank_places = tuple(ranks)
        engine_places = tuple(tuple(e) for e in engines)
        if len(rank_places) != slots.world_size:
            raise ValueError(
                f"NodeTopology.plan: {len(rank_places)} rank places for world size {slots.world_size}; "
                "give one Place per trainer rank"
            )
        counts = slots.engine_gpu_counts
        if len(engine_places) != len(counts) or any(
            len(p) != c for p, c in zip(engine_places, counts, strict=True)
        ):
            raise ValueError(
                f"NodeTopology.plan: engines have {[len(p) for p in engine_places]} places but "
                f"{list(counts)} GPUs; give one Place per engine rank"
            )
        if not 0 <= remote_source < slots.world_size:
            raise ValueError(f"NodeTopology.plan: remote_source {remote_source} is not a trainer rank")
        for slot, (slot_ranks, engine) in enumerate(zip(slots.slots, slots.slot_engines, strict=True)):
            _check_slot(slot, engine, slot_ranks, rank_places, engine_places[engine])
        return cls(slots, rank_places, engine_places, remote_source)

    def engine_nodes(self, engine: int) -> tuple[str, ...]:
        """The nodes engine `engine` runs on, its head node (the one of its rank 0) first."""
        return tuple(dict.fromkeys(p.node for p in self.engines[engine]))

    def followers(self, engine: int) -> tuple[str, ...]:
        """The engine's other nodes: its processes there take part in its collectives only, and a
        driver sends its calls to the head's actor, never to these."""
        return self.engine_nodes(engine)[1:]

    def pairs(self) -> tuple[Pair, ...]:
        """Every sender → receiver link: each slot rank to the engine rank on its GPU, and the
        remote source to every rank of each remote engine."""
        out = [
            Pair(rank, engine, k, self.ranks[rank], self.engines[engine][k], colocated=True)
            for slot_ranks, engine in zip(self.slots.slots, self.slots.slot_engines, strict=True)
            for k, rank in enumerate(slot_ranks)
        ]
        source = self.remote_source
        out += [
            Pair(source, engine, k, self.ranks[source], place, colocated=False)
            for engine in self.slots.remote_engines
            for k, place in enumerate(self.engines[engine])
        ]
        return tuple(out)

    def pair_of(self, rank: int) -> Pair | None:
        """Trainer `rank`'s link to its colocated engine rank (None: no engine on its GPU)."""
        return next((p for p in self.pairs() if p.colocated and p.rank == rank), None)

    def transport_table(
        self, requested: str, *, probe: Probe | Mapping[str, Probe] | None = None
    ) -> tuple[TransportRow, ...]:
        """The designed transport of every pair, grouped per (sender node, receiver node).
        `probe`: the CUDA IPC probe, one for all or one per sender node."""

        def choose(pair: Pair) -> tuple[str, str]:
            node_probe = probe.get(pair.sender.node) if isinstance(probe, Mapping) else probe
            return decide_transport(
                requested,
                colocated=pair.colocated,
                same_node=pair.same_node,
                probe=node_probe,
                between=(pair.sender.node, pair.receiver.node),
            )

        return transport_table(self.pairs(), choose)


def transport_table(
    pairs: Sequence[Pair], choose: Callable[[Pair], tuple[str, str]]
) -> tuple[TransportRow, ...]:
    """Group pairs per (sender node, receiver node, transport); `choose(pair)` is (transport, reason)
    (the designed one, or what each rank reported it chose)."""
    rows: dict[tuple[str, str, str], tuple[str, list[Pair]]] = {}
    for pair in pairs:
        transport, reason = choose(pair)
        key = (pair.sender.node, pair.receiver.node, transport)
        rows.setdefault(key, (reason, []))[1].append(pair)
    return tuple(
        TransportRow(sender, receiver, transport, reason, tuple(group))
        for (sender, receiver, transport), (reason, group) in rows.items()
    )


def _check_slot(
    slot: int,
    engine: int,
    slot_ranks: tuple[int, ...],
    rank_places: tuple[Place, ...],
    engine_places: tuple[Place, ...],
) -> None:
    wrong = [(k, rank) for k, rank in enumerate(slot_ranks) if rank_places[rank] != engine_places[k]]
    if not wrong:
        return
    by_node: dict[str, list[int]] = {}
    for rank in slot_ranks:
        by_node.setdefault(rank_places[rank].node, []).append(rank)
    engine_nodes = list(dict.fromkeys(p.node for p in engine_places))
    fields = {"slot": slot, "engine": engine, "ranks": list(slot_ranks), "nodes": by_node}
    if len(by_node) > 1 and len(engine_nodes) == 1:
        spread = ", ".join(f"{node_label(n)} (ranks {r})" for n, r in by_node.items())
        raise PlacementError(
            f"slot {slot} (trainer ranks {list(slot_ranks)}, engine {engine}) spans nodes {spread}, but "
            f"engine {engine} runs on {node_label(engine_nodes[0])} only: a colocated slot stays on one node "
            "unless its engine spans nodes itself. Place each slot's GPUs in one STRICT_PACK placement group "
            "(actor_integration.actors.cluster.place_slots), or start the engine over those nodes.",
            **fields,
        )
    k, rank = wrong[0]
    raise PlacementError(
        f"engine {engine} rank {k} is at {engine_places[k]} but trainer rank {rank}, the slot {slot} rank on "
        f"the same GPU, is at {rank_places[rank]} ({len(wrong)} of {len(slot_ranks)} slot ranks apart): a "
        "colocated engine must use its trainer ranks' GPUs. Give the engine the GPUs its slot's ranks report "
        "(node and physical GPU), not GPU ids computed from ranks.",
        **fields,
    )

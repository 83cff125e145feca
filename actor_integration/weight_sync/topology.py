"""Which trainer ranks share GPUs with which rollout engine: slots, coordinators, slot groups.

Pure functions of the world size and the engines' GPU counts and offsets, so every rank computes
the same answer without talking to the others. The rules come from the colocated-sync failures:
exactly one coordinator per slot, the slot's lowest global rank (vime #57: `tp_rank == 0` is not
unique inside an 8-GPU slot fed by TP=4), handles gathered over the whole slot (vime #53), and
every slot group created on every rank in the same order (a group made inside a rank branch
deadlocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankSlot:
    """One trainer rank's place in the topology."""

    rank: int
    slot: int | None  # None: this rank's GPU hosts no colocated engine
    engine: int | None  # index of the engine in the list given to `plan`
    ranks: tuple[int, ...]  # the slot's global ranks, ascending; () outside every slot

    @property
    def coordinator(self) -> int | None:
        """The slot's lowest global rank: the only rank that talks to the engine."""
        return self.ranks[0] if self.ranks else None

    @property
    def is_coordinator(self) -> bool:
        return self.slot is not None and self.rank == self.coordinator

    @property
    def colocated(self) -> bool:
        return self.slot is not None

    @property
    def index_in_slot(self) -> int | None:
        """Position of this rank in the slot: the engine rank on the same GPU."""
        return self.ranks.index(self.rank) if self.slot is not None else None

    @classmethod
    def single(cls, rank: int, *, slot: int = 0, engine: int = 0) -> RankSlot:
        """A slot of one rank: the sender of a non-colocated engine (nccl) or a one-GPU job."""
        return cls(rank=rank, slot=slot, engine=engine, ranks=(rank,))


@dataclass(frozen=True)
class SlotTopology:
    """Slots of colocated engines over trainer ranks `0 .. world_size-1`.

    Engine `i` occupies GPUs `offset[i] .. offset[i]+count[i]-1`, counted like trainer ranks (one
    GPU per rank). Engines entirely inside the trainer's GPUs are colocated and get a slot, in
    engine order; engines entirely beyond them are remote (non-colocated, reached by nccl).
    """

    world_size: int
    engine_gpu_counts: tuple[int, ...]
    engine_gpu_offsets: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    slot_engines: tuple[int, ...]  # engine index of each slot
    remote_engines: tuple[int, ...]

    @classmethod
    def plan(
        cls,
        world_size: int,
        engine_gpu_counts: Sequence[int],
        engine_gpu_offsets: Sequence[int] | None = None,
    ) -> SlotTopology:
        """Place the engines; offsets default to engines packed densely from GPU 0."""
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"SlotTopology.plan: world_size must be a positive int, got {world_size!r}")
        counts = tuple(engine_gpu_counts)
        for i, count in enumerate(counts):
            if not _is_int(count) or count < 1:
                raise ValueError(
                    f"SlotTopology.plan: engine_gpu_counts[{i}] must be a positive int, got {count!r}"
                )
        if engine_gpu_offsets is None:
            offsets, start = [], 0
            for count in counts:
                offsets.append(start)
                start += count
        else:
            offsets = list(engine_gpu_offsets)
            if len(offsets) != len(counts):
                raise ValueError(
                    f"SlotTopology.plan: {len(counts)} engine_gpu_counts but {len(offsets)} "
                    "engine_gpu_offsets; give one offset per engine or none"
                )
            for i, offset in enumerate(offsets):
                if not _is_int(offset) or offset < 0:
                    raise ValueError(
                        f"SlotTopology.plan: engine_gpu_offsets[{i}] must be a non-negative int, got {offset!r}"
                    )
        spans = sorted((offsets[i], offsets[i] + counts[i], i) for i in range(len(counts)))
        for (a_start, a_end, a), (b_start, _b_end, b) in itertools.pairwise(spans):
            if b_start < a_end:
                raise ValueError(
                    f"SlotTopology.plan: engines {a} (GPUs {a_start}..{a_end - 1}) and {b} (from GPU {b_start}) "
                    "overlap; every GPU hosts at most one engine"
                )
        slots: list[tuple[int, ...]] = []
        slot_engines: list[int] = []
        remote: list[int] = []
        for i, (offset, count) in enumerate(zip(offsets, counts, strict=True)):
            end = offset + count
            if end <= world_size:
                slots.append(tuple(range(offset, end)))
                slot_engines.append(i)
            elif offset >= world_size:
                remote.append(i)
            else:
                raise ValueError(
                    f"SlotTopology.plan: engine {i} spans GPUs {offset}..{end - 1} but the trainer has ranks "
                    f"0..{world_size - 1}: an engine must sit entirely on trainer GPUs (colocated) or entirely "
                    "beyond them (remote)"
                )
        return cls(
            world_size=world_size,
            engine_gpu_counts=counts,
            engine_gpu_offsets=tuple(offsets),
            slots=tuple(slots),
            slot_engines=tuple(slot_engines),
            remote_engines=tuple(remote),
        )

    def for_rank(self, rank: int) -> RankSlot:
        """The slot, engine and slot ranks of trainer `rank` (slot None: no colocated engine on its GPU)."""
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"SlotTopology.for_rank: rank must be in 0..{self.world_size - 1}, got {rank!r}")
        for slot, ranks in enumerate(self.slots):
            if rank in ranks:
                return RankSlot(rank=rank, slot=slot, engine=self.slot_engines[slot], ranks=ranks)
        return RankSlot(rank=rank, slot=None, engine=None, ranks=())

    @property
    def coordinators(self) -> tuple[int, ...]:
        """Each slot's coordinator: its first rank."""
        return tuple(ranks[0] for ranks in self.slots)

    @property
    def non_colocated_ranks(self) -> tuple[int, ...]:
        """The trainer ranks in no slot (no colocated engine on their GPU)."""
        inside = {r for ranks in self.slots for r in ranks}
        return tuple(r for r in range(self.world_size) if r not in inside)

    def create_groups(self, new_group: Callable[..., Any]) -> tuple[Any, ...]:
        """Create every slot's gloo group, in slot order; call this on EVERY rank.

        `torch.distributed.new_group` is collective over the whole world, so a rank that skips a
        group, or creates them in another order, deadlocks the others. Returns one group per slot;
        a rank picks its own with `groups[rank_slot.slot]`.
        """
        return tuple(new_group(ranks=list(ranks), backend="gloo") for ranks in self.slots)


def physical_gpu_id(cuda_visible_devices: str | None, current_device: int) -> int:
    """The machine-wide GPU index behind `current_device` in a process with this CUDA_VISIBLE_DEVICES.

    `"2,3"` with device 1 is GPU 3. UUID or MIG entries cannot be turned into an index here, so
    they fall back to the device index (AReaL #1500 review).
    """
    if not _is_int(current_device) or current_device < 0:
        raise ValueError(
            f"physical_gpu_id: current_device must be a non-negative int, got {current_device!r}"
        )
    if cuda_visible_devices is None:
        return current_device
    entries = [e.strip() for e in cuda_visible_devices.split(",")]
    if not any(entries):
        raise ValueError(
            f"physical_gpu_id: CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU, so device "
            f"{current_device} does not exist; unset it or list the GPUs this process may use"
        )
    if current_device >= len(entries):
        raise ValueError(
            f"physical_gpu_id: device {current_device} is not visible with CUDA_VISIBLE_DEVICES="
            f"{cuda_visible_devices!r} ({len(entries)} GPUs)"
        )
    entry = entries[current_device]
    return int(entry) if entry.isdigit() else current_device


def local_device_index(physical_id: int, cuda_visible_devices: str | None) -> int:
    """The inverse of `physical_gpu_id`: this process's device index for a machine-wide GPU."""
    if cuda_visible_devices is None:
        return physical_id
    entries = [e.strip() for e in cuda_visible_devices.split(",")]
    if not all(e.isdigit() for e in entries):
        return physical_id  # UUID entries: both sides fell back to device indices
    ids = [int(e) for e in entries]
    if physical_id not in ids:
        raise ValueError(
            f"GPU {physical_id} is not visible in this process (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}); "
            "a colocated engine must see the GPUs of the trainer ranks in its slot"
        )
    return ids.index(physical_id)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""One `start_weight_update` per vLLM engine slot, and every GPU's handle in the slot's payload (vime #57).

A colocated vLLM engine of N GPUs sits on N trainer ranks (its slot). vime's colocated sender
(`UpdateWeightFromTensor`, update_weight_from_tensor.py) brackets each sync with
`start_weight_update` / `finish_weight_update` on the slot's engine and ships each chunk's CUDA IPC
handles, one per GPU of the slot keyed by GPU UUID, in one `update_weights_from_tensor` call. vime #57
fixed two ways this broke in an 8-GPU slot fed by Megatron TP=4: the start was gated on
`tp_rank == 0`, which two ranks of the slot pass (0 and 4), so the engine got two starts; and the
handles were gathered over the TP group (4 ranks), so half the engine's workers found no handle
for their GPU ("IPC handle not found for GPU UUID").

`SlotStartGuard` is the engine handle a trainer rank holds, placed by `SlotTopology` (the slot's
lowest global rank is its one coordinator, the rule `actor_integration.weight_sync` uses): on any
other rank start / finish are absorbed (recorded, not sent), so exactly one start reaches the engine
whatever rule the sender's code gates on; a second start before a finish is refused
(`DuplicateWeightUpdateStartError`), and so is an update before a start; a payload whose handles
do not cover every GPU of the slot is refused before it is sent (`IncompleteSlotHandlesError`).
`guard_weight_updater(updater)` installs it on vime's sender after every `connect_rollout_engines`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from actor_integration.errors import (
    DuplicateWeightUpdateStartError,
    IncompleteSlotHandlesError,
    WeightUpdateNotStartedError,
)
from actor_integration.weight_sync.topology import RankSlot, SlotTopology

__all__ = [
    "DuplicateWeightUpdateStartError",
    "IncompleteSlotHandlesError",
    "SlotStartGuard",
    "WeightUpdateNotStartedError",
    "guard_weight_updater",
]

_log = logging.getLogger("rl_lifecycle.vime")

GATED = ("start_weight_update", "finish_weight_update")
PAYLOADS = ("update_weights_from_tensor",)


def _done() -> Any:
    """What an absorbed `.remote()` returns: a finished Ray ref where Ray runs, else None."""
    try:
        import ray

        if ray.is_initialized():
            return ray.put(None)
    except (ImportError, AttributeError):
        pass
    return None


class _Gated:
    """One engine method as this rank may call it: `.remote(...)` for a Ray handle, or a plain call."""

    def __init__(self, guard: SlotStartGuard, name: str) -> None:
        self.guard, self.name = guard, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.guard._call(self.name, True, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.guard._call(self.name, False, args, kwargs)


class SlotStartGuard:
    """The slot's engine as trainer rank `slot.rank` holds it (see the module's doc); other attributes are the engine's.

    `sent` and `absorbed` list the gated calls this rank sent to the engine and those it kept back.
    """

    def __init__(self, slot: RankSlot, engine: Any) -> None:
        if slot.slot is None:
            raise ValueError(f"SlotStartGuard: rank {slot.rank} is in no engine slot (no colocated engine)")
        self.slot = slot
        self.engine = engine
        self.started = False
        self.sent: list[str] = []
        self.absorbed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in GATED or name in PAYLOADS:
            return _Gated(self, name)
        return getattr(self.engine, name)

    def _call(self, name: str, remote: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in PAYLOADS:
            self._check_payload(name, kwargs)
            if not self.slot.is_coordinator:  # the slot's payload goes in once, from its coordinator
                self.absorbed.append(name)
                return _done() if remote else None
        elif not self.slot.is_coordinator:
            self.absorbed.append(name)
            return _done() if remote else None
        elif name == "start_weight_update":
            if self.started:
                raise DuplicateWeightUpdateStartError(
                    f"rank {self.slot.rank}: start_weight_update on the engine of slot {self.slot.slot} (ranks "
                    f"{list(self.slot.ranks)}) while its update is open; one start per finish (vime #57)",
                    rank=self.slot.rank,
                    slot=self.slot.slot,
                )
            self.started = True
        elif not self.started:
            raise WeightUpdateNotStartedError(
                f"rank {self.slot.rank}: {name} on the engine of slot {self.slot.slot} with no open update",
                rank=self.slot.rank,
                slot=self.slot.slot,
            )
        else:
            self.started = False
        self.sent.append(name)
        method = getattr(self.engine, name)
        return method.remote(*args, **kwargs) if remote else method(*args, **kwargs)

    def _check_payload(self, name: str, kwargs: dict[str, Any]) -> None:
        if self.slot.is_coordinator and not self.started:
            raise WeightUpdateNotStartedError(
                f"rank {self.slot.rank}: {name} before start_weight_update on the engine of slot {self.slot.slot}",
                rank=self.slot.rank,
                slot=self.slot.slot,
            )
        handles = kwargs.get("ipc_handles")
        if handles is None:
            return
        need = len(self.slot.ranks)
        short = [i for i, per_gpu in enumerate(handles) if len(per_gpu) != need]
        if short:
            got = sorted({len(handles[i]) for i in short})
            raise IncompleteSlotHandlesError(
                f"rank {self.slot.rank}: {name} carries handles for {got} GPU(s) per weight, but the engine of slot "
                f"{self.slot.slot} spans {need} (ranks {list(self.slot.ranks)}): gather them over the slot, not the "
                "TP group (vime #57); its workers would find no handle for their GPU",
                rank=self.slot.rank,
                slot=self.slot.slot,
                weights=len(short),
            )


def guard_weight_updater(updater: Any, *, rank: int | None = None, world_size: int | None = None) -> bool:
    """Install `SlotStartGuard` on vime's colocated sender after each of its `connect_rollout_engines`. Idempotent.

    Works on the sender's field as vime's update_weight_from_tensor.py (01ea2336) names it
    (`_ipc_engine`, the engine this rank's slot holds); its `_ipc_engine_coordinator` is only read
    (a disagreement with the slot's coordinator is logged). A sender without
    `connect_rollout_engines` (disk, or none) is left alone. Returns whether the sender is guarded.
    """
    connect = getattr(updater, "connect_rollout_engines", None)
    if not callable(connect):
        return False
    if getattr(connect, "_rl_lifecycle_slot_guard", False):
        return True

    @functools.wraps(connect)
    def connect_then_guard(
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        result = connect(
            rollout_engines,
            rollout_engine_lock,
            engine_gpu_counts=engine_gpu_counts,
            engine_gpu_offsets=engine_gpu_offsets,
            **kwargs,
        )
        _install(updater, rollout_engines, engine_gpu_counts, engine_gpu_offsets, rank, world_size)
        return result

    connect_then_guard._rl_lifecycle_slot_guard = True  # type: ignore[attr-defined]
    updater.connect_rollout_engines = connect_then_guard
    return True


def _install(
    updater: Any,
    engines: Sequence[Any],
    counts: Sequence[int] | None,
    offsets: Sequence[int] | None,
    rank: int | None,
    world_size: int | None,
) -> None:
    import torch.distributed as dist

    engine = getattr(updater, "_ipc_engine", None)
    if engine is None or isinstance(engine, SlotStartGuard):
        return
    if counts is None:
        counts = [int(updater.args.rollout_num_gpus_per_engine)] * len(engines)
    me = dist.get_rank() if rank is None else rank
    size = dist.get_world_size() if world_size is None else world_size
    colocated = _colocated(counts, offsets, size)
    slot = SlotTopology.plan(size, colocated[0], colocated[1]).for_rank(me)
    if slot.slot is None:
        return
    updater._ipc_engine = SlotStartGuard(slot, engine)
    named = getattr(updater, "_ipc_engine_coordinator", None)
    if named is not None and bool(named) != slot.is_coordinator:
        # The sender's own flag is left as it is: every rank keeps the code path its sender takes (a rank
        # switched to another path would wait in a barrier its peers never reach); the guard decides
        # what reaches the engine.
        _log.warning(
            "vime: rank %s's sender names itself %s of slot %s (ranks %s); the slot's coordinator is rank %s, "
            "and only its start, finish and payload reach the engine",
            me,
            "coordinator" if named else "not the coordinator",
            slot.slot,
            list(slot.ranks),
            slot.coordinator,
        )


def _colocated(
    counts: Sequence[int], offsets: Sequence[int] | None, world_size: int
) -> tuple[list[int], list[int]]:
    """The engines vime treats as colocated: in order, while each fits on the trainer's GPUs."""
    placed: list[int] = []
    if offsets is None:
        start = 0
        for count in counts:
            placed.append(start)
            start += count
    else:
        placed = [int(o) for o in offsets]
    kept_counts: list[int] = []
    kept_offsets: list[int] = []
    for offset, count in zip(placed, counts, strict=True):
        if offset + count > world_size:
            break
        kept_counts.append(int(count))
        kept_offsets.append(int(offset))
    return kept_counts, kept_offsets

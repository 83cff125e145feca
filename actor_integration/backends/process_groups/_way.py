"""What every way of treating the communicators on sleep offers, what it may do to its groups, and
how the bytes are counted.

A host (`ReloadableProcessGroups`, or a framework's registry: `RegistryProcessGroups`) meets the
other ranks, then hands the work to its way: `release` on destroy(), `restore` on reload(). Three
ways, one unit each: `_destroy` (tear down, rebuild), `_suspend` (ncclCommSuspend /
ncclCommResume) and `_keep` (leave them as they are). A way reaches its groups through
`WayHost` alone, so the units never import a host; which state each way leaves the groups in is
the transition table's (`lifecycle.table.ASLEEP`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import _nccl
from lifecycle.table import Communicators, Groups


@dataclass
class Outcome:
    """What one release or restore did; `process_groups.destroyed` / `reloaded` log it."""

    way: Communicators  # the way that ran (DESTROY where a suspend fell back whole)
    communicator_count: int  # how many communicators (groups) it went through
    bytes: int | None = None  # GPU memory freed (release) or taken again (restore); None: not measured
    measured_by: str | None = None  # "ncclCommMemStats" or "mem_get_info" (device-wide)
    fell_back: dict[str, str] = field(default_factory=dict)  # group → why it was destroyed, not suspended
    held_bytes: int | None = None  # keep: what stays on the GPU while asleep

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "way": self.way.value,
            "communicator_count": self.communicator_count,
            "bytes": self.bytes,
            "measured_by": self.measured_by,
        }
        if self.fell_back:
            out["fell_back"] = dict(self.fell_back)
        if self.held_bytes is not None:
            out["held_bytes"] = self.held_bytes
        return out


class WayHost(Protocol):
    """What a way may see and do of the groups it treats: the whole door between a way and its host.

    A handle is the host's own reference to one of its groups (a `GroupHandle`, a framework's
    wrapper), named the same on every rank; a hidden handle refuses collectives until shown again.
    """

    @property
    def device(self) -> torch.device | None:
        """The device the groups are bound to (None: the current one), for `DeviceMemory`."""
        ...

    def groups(self) -> list[ProcessGroup]:
        """The torch groups this host's sleep acts on, in creation order (the same on every rank)."""
        ...

    def handle_names(self) -> tuple[str, ...]:
        """Every handle's name, in registration order (the same on every rank)."""
        ...

    def hide_handles(self, asleep: Groups) -> dict[str, ProcessGroup | None]:
        """Take every handle's group away (the handles then say they are `asleep`); returns them by name."""
        ...

    def show_handles(self, hidden: Mapping[str, ProcessGroup | None]) -> None:
        """Give the handles named in `hidden` their groups back."""
        ...

    def stand_in(self) -> int:
        """Tear down every group the sleep acts on (what stands in for WORLD is the host's); how many went."""
        ...

    def rebuild(self) -> None:
        """After `stand_in`: new torch groups for every handle. Collective."""
        ...

    def recreate(self, names: Sequence[str]) -> None:
        """New groups for the hidden handles named (collective: the same list on every rank)."""
        ...

    def gather(self, what: str, value: str) -> list[str]:
        """Meet every rank at `what` within the host's deadline; every rank's `value`, by rank."""
        ...


class CommunicatorWay(Protocol):
    """One way of treating the NCCL communicators while the groups sleep."""

    name: Communicators
    asleep: Groups  # the groups' state after release: `lifecycle.table.ASLEEP[name]`
    lost: tuple[str, ...]  # others' groups the last release tore down: their owner rebuilds them

    def check(self, backend: str) -> None:
        """Refuse, before any group exists, where this way cannot work; say what was found and what to do."""
        ...

    def release(self, host: WayHost) -> Outcome:
        """Sleep: called on every rank once all ranks met, with this rank's device work finished."""
        ...

    def restore(self, host: WayHost) -> Outcome:
        """Wake (also after a release that failed half-way): called on every rank once all met."""
        ...

    def close(self, host: WayHost) -> None:
        """Before the final teardown: leave every communicator in a state torch can destroy."""
        ...


def nccl_bytes(pgs: Iterable[ProcessGroup], counter: str) -> int | None:
    """One ncclCommMemStats counter ("total", "suspendable") summed over the groups' communicators.

    None where there is no NCCL group, or NCCL has no ncclCommMemStats (before 2.29.7) or it
    cannot be reached; communicators not created yet count nothing.
    """
    total, nccl = 0, False
    for pg in pgs:
        communicator = _nccl.communicator_of(pg)
        if communicator is None:
            continue
        nccl = True
        if not communicator.created():
            continue
        stats = communicator.stats()
        if stats is None:
            return None
        total += int(getattr(stats, counter))
    return total if nccl else None


class DeviceMemory:
    """Device-wide used memory before and after (mem_get_info): counts whatever else ran meanwhile."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self._before = self._used()

    def _used(self) -> int | None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return None
        # No synchronize: the sleep's memory pause runs on the device beside this hook, and waiting
        # for it would serialise the stage; NCCL unmaps and releases synchronously anyway.
        free, total = torch.cuda.mem_get_info(self._device)
        return int(total - free)

    def change(self) -> int | None:
        """Bytes freed since construction (negative: taken); None without CUDA."""
        after = self._used()
        return None if self._before is None or after is None else self._before - after


def measured(nccl: int | None, device: DeviceMemory, *, taken: bool = False) -> tuple[int | None, str | None]:
    """NCCL's own count where it has one, else the device-wide change: bytes freed, or with
    `taken` bytes taken again (a wake)."""
    if nccl is not None:
        return nccl, "ncclCommMemStats"
    change = device.change()
    if change is None:
        return None, None
    return (-change if taken else change), "mem_get_info"

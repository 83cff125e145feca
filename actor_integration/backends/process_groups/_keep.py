"""Keep the communicators as they are while asleep: nothing to free, nothing to bring back (0 s).

For a GPU with room for the communicators' memory during the other phase (verl keeps them). The
memory stays held: `held_bytes()`, the configured event and every `process_groups.destroyed`
event say how much, and `lifecycle doctor` recommends this way only where it fits.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups._way import Outcome, WayHost, nccl_bytes
from lifecycle.table import ASLEEP, Communicators


class KeepCommunicators:
    """The groups stay; their handles refuse collectives until reload (the other phase owns the GPU)."""

    name = Communicators.KEEP
    asleep = ASLEEP[name]
    lost: tuple[str, ...] = ()  # nothing is torn down

    def __init__(self) -> None:
        self._hidden: dict[str, ProcessGroup | None] = {}

    def check(self, backend: str) -> None:
        return None  # nothing to refuse: the cost is the memory held, which the events report

    def release(self, host: WayHost) -> Outcome:
        self._hidden.update(host.hide_handles(self.asleep))
        kept = host.groups()
        return Outcome(self.name, len(kept), 0, None, held_bytes=nccl_bytes(kept, "total"))

    def restore(self, host: WayHost) -> Outcome:
        host.show_handles(self._hidden)
        self._hidden = {}
        return Outcome(self.name, len(host.groups()), 0, None)

    def close(self, host: WayHost) -> None:
        self._hidden = {}

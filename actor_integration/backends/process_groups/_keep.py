"""Keep the communicators as they are while asleep: nothing to free, nothing to bring back (0 s).

For a GPU with room for the communicators' memory during the other phase (verl keeps them). The
memory stays held: `held_bytes()`, the configured event and every `process_groups.destroyed`
event say how much, and `lifecycle doctor` recommends this way only where it fits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import _teardown
from actor_integration.backends.process_groups._way import Outcome, nccl_bytes
from lifecycle.table import Communicators

if TYPE_CHECKING:
    from actor_integration.backends.process_groups._reloadable import ReloadableProcessGroups


class KeepCommunicators:
    """The groups stay; their handles refuse collectives until reload (the other phase owns the GPU)."""

    name = Communicators.KEEP
    asleep = "kept"

    def __init__(self) -> None:
        self._hidden: dict[str, ProcessGroup | None] = {}

    def check(self, backend: str) -> None:
        return None  # nothing to refuse: the cost is the memory held, which the events report

    def release(self, groups: ReloadableProcessGroups) -> Outcome:
        self._hidden.update(groups._hide_handles(self.asleep))
        held = nccl_bytes(_teardown.registered_groups(), "total")
        count = len(_teardown.registered_groups())
        return Outcome(self.name.value, count, 0, None, held_bytes=held)

    def restore(self, groups: ReloadableProcessGroups) -> Outcome:
        groups._show_handles(self._hidden)
        self._hidden = {}
        return Outcome(self.name.value, len(_teardown.registered_groups()), 0, None)

    def close(self, groups: ReloadableProcessGroups) -> None:
        self._hidden = {}

"""What the backends say of themselves in the `lifecycle.configured` event.

The choices a backend made from the environment (a retained CPU backup, the hook mode) are read
from the log of the run that made them, not from the code.
"""

from __future__ import annotations

from typing import Any

from lifecycle.hooks import Hooks
from lifecycle.table import Communicators


def describe_backends(hooks: Hooks, communicators: Communicators) -> dict[str, Any]:
    """The backends' `describe()`, `notes` and `capabilities`, then the process groups' declared way
    (`communicators`) and what kept communicators hold on the GPU."""
    described: dict[str, Any] = {}
    for slot in ("memory", "process_groups"):
        backend = getattr(hooks, slot)
        describe = getattr(backend, "describe", None)
        if callable(describe):
            described[slot] = str(describe())
        notes = getattr(backend, "notes", None)
        if isinstance(notes, list) and notes:
            described[f"{slot}_notes"] = [str(note) for note in notes]
        # What the backend's library supports (torch_memory_saver's line differs: upstream or a fork).
        to_dict = getattr(getattr(backend, "capabilities", None), "to_dict", None)
        if callable(to_dict):
            described[f"{slot}_capabilities"] = to_dict()
    if hooks.process_groups is None:
        return described
    described["communicators"] = communicators.value
    if len(hooks.communicators_ways) > 1:  # a memory budget chooses among them per sleep
        described["communicators_ways"] = [w.value for w in hooks.communicators_ways]
    held = getattr(hooks.process_groups, "held_bytes", None)
    if communicators is Communicators.KEEP and callable(held):
        described["communicators_held_bytes"] = held()  # stays on the GPU while asleep
    return described

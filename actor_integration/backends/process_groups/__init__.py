"""torch.distributed groups that sleep can free and wake_up bring back, and the pieces they are made of.

`ReloadableProcessGroups` is what an actor uses; `communicators=` says what its sleep does to the
NCCL communicators: "destroy" (default), "suspend" or "keep", one unit each (`_destroy`,
`_suspend`, `_keep`). `loaded_nccl()` and `nccl_suspend_support()` say what the NCCL this process
loaded can do. The rest is public for other group registries (slime's and miles') that tear their own groups
down the same way or take the same ways: `Meeting` (store-based meeting points whose deadlines
name the missing ranks), `registered_groups`, `each_at_once`, `destroy_registered_groups` (every
subgroup concurrently, WORLD last), `quiesce`, and `choose_way` (the unit for a `communicators=`
name, checked once), `WayHost` (what a way may do to a host's groups), `CommunicatorWay`,
`Outcome`, `nccl_bytes`, `why_this_way` and `WayLog` (the groups' events).
"""

from __future__ import annotations

from actor_integration.backends.process_groups._choice import WayLog, choose_way, why_this_way
from actor_integration.backends.process_groups._nccl import (
    LoadedNccl,
    NcclSuspendSupport,
    loaded_nccl,
    nccl_suspend_support,
)
from actor_integration.backends.process_groups._reloadable import GroupHandle, ReloadableProcessGroups
from actor_integration.backends.process_groups._rendezvous import LIFECYCLE_CAUSE, Meeting
from actor_integration.backends.process_groups._teardown import (
    destroy_registered_groups,
    each_at_once,
    quiesce,
    registered_groups,
)
from actor_integration.backends.process_groups._way import CommunicatorWay, Outcome, WayHost, nccl_bytes
from actor_integration.errors import (
    NcclError,
    ProcessGroupsAsleepError,
    RendezvousMismatchError,
    RendezvousTimeoutError,
)
from lifecycle.table import Communicators

__all__ = [
    "LIFECYCLE_CAUSE",
    "CommunicatorWay",
    "Communicators",
    "GroupHandle",
    "LoadedNccl",
    "Meeting",
    "NcclError",
    "NcclSuspendSupport",
    "Outcome",
    "ProcessGroupsAsleepError",
    "ReloadableProcessGroups",
    "RendezvousMismatchError",
    "RendezvousTimeoutError",
    "WayHost",
    "WayLog",
    "choose_way",
    "destroy_registered_groups",
    "each_at_once",
    "loaded_nccl",
    "nccl_bytes",
    "nccl_suspend_support",
    "quiesce",
    "registered_groups",
    "why_this_way",
]

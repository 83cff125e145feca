"""Process groups a framework keeps in its own registry of reloadable wrappers, torn down concurrently.

slime and miles wrap every subgroup Megatron creates (`ReloadableProcessGroup`, through a patched
`dist.new_group`); Megatron caches the wrappers, and the framework's own reload puts a new torch
group inside each wrapper, so the cached references stay valid and the group count stays flat.
Their teardown is serial: slime destroys the accelerator WORLD and lets torch shut every backend
down one after another (8.4-9.3 s per sleep for Megatron's groups on an H200, FACTS.md); miles
destroys its wrappers one by one. slime went serial on purpose: with pure PP=4, ranks destroying
overlapping groups one at a time let rank 0 start reloading (a collective `new_group`) while another
rank was still shutting down, and it waited forever (slime's comment in
`reloadable_process_group.py`, slime #2208).

`RegistryProcessGroups.destroy()` frees the same communicators, free of that deadlock by
construction: every rank meets on the rendezvous store (a deadline whose error names the missing
ranks), then tears down its whole set at once (each group in its own thread, WORLD once and last),
then meets again, so no rank reloads before every rank has finished tearing down, and no teardown
can wait on another in a cycle (see `actor_integration.backends.process_groups.each_at_once`). `reload()`
is the framework's own, after a meeting. A subclass says which groups its framework owns and what its framework does around WORLD.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from actor_integration.backends.process_groups import (
    LIFECYCLE_CAUSE,
    Meeting,
    destroy_registered_groups,
    each_at_once,
    quiesce,
)
from lifecycle import events
from lifecycle.logs import Event

__all__ = ["RegistryProcessGroups"]


class RegistryProcessGroups:
    """destroy()/reload()/is_alive() over a framework's registry of reloadable group wrappers. Collective.

    Build it on every rank after the framework's groups exist (the end of the actor's init).
    `store`, `rank`, `world_size`: where the ranks meet (default: the default group's store, rank
    and size now); `timeout`: every meeting's deadline.
    """

    framework = "framework"

    def __init__(
        self,
        *,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if (store is None or rank is None or world_size is None) and not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialised (the actor's init runs first), "
                "or store=, rank= and world_size="
            )
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.timeout = timeout or dist.default_pg_timeout
        # The store outlives every WORLD (the framework keeps its reference too); our keys get their
        # own namespace, so they never meet the framework's or torch's.
        self._meeting = Meeting(
            PrefixStore(f"rl-lifecycle/{self.framework}", base), self.rank, self.world_size
        )
        self._cycles = 0

    # ------------------------------------------------------------------ what a framework supplies

    def wrappers(self) -> list[Any]:
        """The framework's wrappers in this process, in creation order (each has `.group`)."""
        raise NotImplementedError

    def _tears_down_world(self) -> bool:
        """Whether this teardown also replaces the accelerator WORLD (the framework's own rule)."""
        return False

    def _after_world_destroyed(self) -> None:
        """Put the framework's stand-in WORLD in place (slime: a gloo WORLD) and mark it destroyed."""

    def _reload(self) -> None:
        """The framework's own reload: new torch groups inside the same wrappers."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle hooks

    def destroy(self) -> None:
        """Free every communicator of the framework's groups on every rank at once. Collective."""
        t0 = time.perf_counter()
        free_before = _free_device_bytes()
        wrappers = self.wrappers()
        world = self._tears_down_world()
        quiesce(str(dist.get_backend()), None)
        # The same set on every rank: the registry's size is part of what each rank says it is doing.
        what = f"destroy(cycle {self._cycles}, {len(wrappers)} wrapped groups, world={world})"
        self._meeting.meet(what, self.timeout, LIFECYCLE_CAUSE)
        if world:
            for wrapper in wrappers:
                wrapper.group = None  # torch's registry holds the only references left
            try:
                torn = destroy_registered_groups()
            finally:
                # WORLD is gone even when a subgroup's teardown raised: the framework's stand-in WORLD
                # and its "destroyed" mark must follow, or its reload would skip rebuilding WORLD.
                if not dist.is_initialized():
                    self._after_world_destroyed()
        else:
            # A rank outside a group holds torch's NON_GROUP_MEMBER sentinel: nothing of its own to free.
            live = [w.group for w in wrappers if w.group not in (None, dist.GroupMember.NON_GROUP_MEMBER)]
            for wrapper in wrappers:
                wrapper.group = None
            torn = len(live)
            each_at_once(dist.destroy_process_group, live)
        # Nobody reloads (a collective new_group) before every rank has finished tearing down.
        self._meeting.meet(f"destroyed(cycle {self._cycles})", self.timeout, LIFECYCLE_CAUSE)
        self._log(Event.GROUPS_DESTROYED, t0, communicators=torn, world=world, free_before=free_before)

    def reload(self) -> None:
        """Meet, then the framework's own reload. Collective."""
        t0 = time.perf_counter()
        self._meeting.meet(f"reload(cycle {self._cycles})", self.timeout, LIFECYCLE_CAUSE)
        self._reload()
        self._cycles += 1
        self._log(Event.GROUPS_RELOADED, t0)

    def is_alive(self) -> bool:
        """Whether every wrapped group holds a live torch group."""
        return all(w.group is not None for w in self.wrappers())

    def _log(self, event: str, t0: float, *, free_before: int | None = None, **fields: Any) -> None:
        if not events.enabled(events.LEVELS["debug"]):
            return
        if free_before is not None:  # as ReloadableProcessGroups counts without ncclCommMemStats
            after = _free_device_bytes()
            fields["bytes"] = None if after is None else after - free_before
            fields["measured_by"] = "mem_get_info"
        events.emit(
            "debug",
            event,
            {
                "group_rank": self.rank,
                "framework": self.framework,
                "way": "destroy",
                "groups": len(self.wrappers()),
                "duration_ms": round((time.perf_counter() - t0) * 1e3, 3),
                **fields,
            },
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alive={self.is_alive()} wrapped={len(self.wrappers())}>"


def registry(module: Any, attribute: str = "ReloadableProcessGroup") -> list[Any]:
    """A framework module's wrappers of this process (`<attribute>.GROUPS[pid]`)."""
    return list(getattr(module, attribute).GROUPS.get(os.getpid(), []))


def require(module: Any, names: Sequence[str], who: str, version: str) -> None:
    """Refuse a framework module that lacks what an adapter calls, naming the version it is written for."""
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise TypeError(
            f"{who}: {module.__name__} lacks {missing}; this adapter is written against {version}"
        )


def _free_device_bytes() -> int | None:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return None
    return int(torch.cuda.mem_get_info()[0])

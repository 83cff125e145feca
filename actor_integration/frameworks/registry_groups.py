"""Process groups a framework keeps in its own registry of reloadable wrappers, torn down concurrently.

slime and miles wrap every subgroup Megatron creates (`ReloadableProcessGroup`, through a patched
`dist.new_group`); Megatron caches the wrappers, and the framework's own reload puts a new torch
group inside each wrapper, so the cached references stay valid and the group count stays flat.
Their teardown is serial: slime destroys the accelerator WORLD and lets torch shut every backend
down one after another (most of a sleep for Megatron's groups on an H200:
docs/measurements.md#serial-process-group-teardown-2026-12-01); miles destroys its wrappers one by one. slime went serial on purpose: with pure PP=4, ranks destroying
overlapping groups one at a time let rank 0 start reloading (a collective `new_group`) while another
rank was still shutting down, and it waited forever (slime's comment in
`reloadable_process_group.py`, slime #2208).

`RegistryProcessGroups.destroy()` frees the same communicators, free of that deadlock by
construction: every rank meets on the rendezvous store (a deadline whose error names the missing
ranks), then tears down its whole set at once (each group in its own thread, WORLD once and last),
then meets again, so no rank reloads before every rank has finished tearing down, and no teardown
can wait on another in a cycle (see `actor_integration.backends.process_groups.each_at_once`). `reload()`
is the framework's own, after a meeting. A subclass says which groups its framework owns and what its framework does around WORLD.

`communicators=` takes the ways `ReloadableProcessGroups` takes, through the same units: "destroy"
(the default, above), "suspend" (ncclCommSuspend on sleep, resume on wake, NCCL 2.29.7+; a group
that cannot be suspended is torn down and rebuilt by the framework's reload) or "keep" (nothing
freed). Suspended or kept, the wrappers hold no group while asleep (a collective through one fails
as on a destroyed one) and get the same groups back on wake; the groups a sleep acts on are every
registered one where the framework's teardown takes WORLD (slime), else the wrapped ones (miles).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import PrefixStore, Store

from actor_integration.backends.process_groups import (
    LIFECYCLE_CAUSE,
    Meeting,
    Outcome,
    WayLog,
    choose_way,
    destroy_registered_groups,
    each_at_once,
    nccl_bytes,
    quiesce,
    registered_groups,
)
from lifecycle.logs import Event
from lifecycle.table import Communicators, Groups

__all__ = ["RegistryProcessGroups"]


class RegistryProcessGroups:
    """destroy()/reload()/is_alive() over a framework's registry of reloadable group wrappers. Collective.

    Build it on every rank after the framework's groups exist (the end of the actor's init).
    `store`, `rank`, `world_size`: where the ranks meet (default: the default group's store, rank
    and size now); `timeout`: every meeting's deadline; `communicators`: what sleep does to the
    communicators ("destroy", "suspend" or "keep", as `ReloadableProcessGroups` takes it; checked
    here against `backend`, default the default group's).
    """

    framework = "framework"

    def __init__(
        self,
        *,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: timedelta | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
        backend: str | None = None,
    ) -> None:
        if (store is None or rank is None or world_size is None) and not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialised (the actor's init runs first), "
                "or store=, rank= and world_size="
            )
        if backend is None:
            backend = str(dist.get_backend()) if dist.is_initialized() else ""
        self._way = choose_way(communicators, backend)
        self.communicators = self._way.name.value  # read by the lifecycle machine (which state sleep leaves)
        self.backend = backend
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
        self._asleep = False  # a release returned and no restore since
        self._way_log = WayLog()  # the first destroy says at info which way ran and why
        self._host = _RegistryHost(self)

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
        """The framework's own reload: new torch groups inside the wrappers that hold none."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle hooks

    def destroy(self) -> None:
        """Free (or suspend, or keep) the communicators of the framework's groups on every rank at once. Collective."""
        t0 = time.perf_counter()
        wrappers = self.wrappers()
        world = self._tears_down_world()
        quiesce(str(dist.get_backend()), None)
        # The same set on every rank: the registry's size is part of what each rank says it is doing.
        what = (
            f"destroy(cycle {self._cycles}, {len(wrappers)} wrapped groups, world={world}, "
            f"communicators={self.communicators})"
        )
        self._meeting.meet(what, self.timeout, LIFECYCLE_CAUSE)
        outcome = self._way.release(self._host)
        # Nobody reloads (a collective new_group) before every rank has finished tearing down.
        self._meeting.meet(f"destroyed(cycle {self._cycles})", self.timeout, LIFECYCLE_CAUSE)
        self._asleep = True
        self._log(Event.GROUPS_DESTROYED, t0, outcome, world=world)

    def reload(self) -> None:
        """Meet, then bring the communicators back the way they went (the framework's own reload). Collective."""
        t0 = time.perf_counter()
        self._meeting.meet(f"reload(cycle {self._cycles})", self.timeout, LIFECYCLE_CAUSE)
        outcome = self._way.restore(self._host)
        self._asleep = False
        self._cycles += 1
        self._log(Event.GROUPS_RELOADED, t0, outcome)

    def is_alive(self) -> bool:
        """Whether the groups are awake and every wrapped group holds a live torch group."""
        return not self._asleep and all(w.group is not None for w in self.wrappers())

    def held_bytes(self) -> int | None:
        """GPU memory the NCCL communicators of the groups a sleep acts on hold now (ncclCommMemStats),
        None where NCCL cannot say. With communicators="keep" this is what stays on the GPU while asleep."""
        return nccl_bytes(self._host.groups(), "total")

    @property
    def lost_groups(self) -> tuple[str, ...]:
        """Groups outside the registry the last sleep tore down because NCCL could not suspend them
        (communicators="suspend"): nothing rebuilds them."""
        return self._way.lost

    def _log(self, event: str, t0: float, outcome: Outcome, **extra: Any) -> None:
        self._way_log.emit(
            event,
            t0,
            outcome,
            way=self._way,
            backend=self.backend,
            fields=lambda: {
                "group_rank": self.rank,
                "framework": self.framework,
                "groups": len(self.wrappers()),
                **extra,
            },
            lost_groups=self.lost_groups,
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} alive={self.is_alive()} wrapped={len(self.wrappers())} "
            f"communicators={self.communicators}>"
        )


class _RegistryHost:
    """What the way of one registry may do to the framework's groups (`WayHost`); the wrappers are
    the handles, named by their place in the registry (the same on every rank)."""

    def __init__(self, registry: RegistryProcessGroups) -> None:
        self._registry = registry
        self._hidden: set[int] = set()  # ids of the groups hide_handles took from the wrappers

    @property
    def device(self) -> torch.device | None:
        return None  # the framework binds none: the current device

    def groups(self) -> list[ProcessGroup]:
        registered = registered_groups()
        if self._registry._tears_down_world():
            return registered  # torch's WORLD teardown takes every registered group with it
        ours = self._hidden | {id(group) for group in _live(self._registry.wrappers())}
        return [pg for pg in registered if id(pg) in ours]

    def handle_names(self) -> tuple[str, ...]:
        return tuple(f"wrapper{index}" for index in range(len(self._registry.wrappers())))

    def hide_handles(self, asleep: Groups) -> dict[str, ProcessGroup | None]:
        hidden: dict[str, ProcessGroup | None] = {}
        for name, wrapper in zip(self.handle_names(), self._registry.wrappers(), strict=True):
            if wrapper.group is not None:
                hidden[name] = wrapper.group
                self._hidden.add(id(wrapper.group))
            wrapper.group = None  # the framework's own mark of a group to rebuild
        return hidden

    def show_handles(self, hidden: Mapping[str, ProcessGroup | None]) -> None:
        for name, wrapper in zip(self.handle_names(), self._registry.wrappers(), strict=True):
            if name in hidden:
                wrapper.group = hidden[name]
        self._hidden.clear()

    def stand_in(self) -> int:
        registry, wrappers = self._registry, self._registry.wrappers()
        self._hidden.clear()
        if registry._tears_down_world():
            for wrapper in wrappers:
                wrapper.group = None  # torch's registry holds the only references left
            try:
                return destroy_registered_groups()
            finally:
                # WORLD is gone even when a subgroup's teardown raised: the framework's stand-in WORLD
                # and its "destroyed" mark must follow, or its reload would skip rebuilding WORLD.
                if not dist.is_initialized():
                    registry._after_world_destroyed()
        live = _live(wrappers)
        for wrapper in wrappers:
            wrapper.group = None
        torn = len(live)
        each_at_once(dist.destroy_process_group, live)
        return torn

    def rebuild(self) -> None:
        self._registry._reload()

    def recreate(self, names: Sequence[str]) -> None:
        if names:  # the wrappers named hold no group: the framework's reload rebuilds exactly those
            self._registry._reload()

    def gather(self, what: str, value: str) -> list[str]:
        registry = self._registry
        return registry._meeting.gather(
            f"{what}(cycle {registry._cycles})", value, registry.timeout, LIFECYCLE_CAUSE
        )


def _live(wrappers: list[Any]) -> list[Any]:
    # A rank outside a group holds torch's NON_GROUP_MEMBER sentinel: nothing of its own to free.
    return [w.group for w in wrappers if w.group not in (None, dist.GroupMember.NON_GROUP_MEMBER)]


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

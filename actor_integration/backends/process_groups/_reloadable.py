"""`ReloadableProcessGroups`: torch.distributed groups that sleep can free and wake_up bring back.

NCCL communicators hold GPU memory (~390 MiB each on an H200 rank), so a sleeping trainer frees
them. The design, without monkey-patching torch.distributed:

- Awake, WORLD runs on the accelerator backend; `new_group` records each subgroup's spec and
  returns a `GroupHandle` whose `.group` is the live torch group of the current generation.
- `destroy()` and `reload()` meet the other ranks, then hand the communicators to one way, chosen
  with `communicators=` (one unit each): "destroy" (the default, measured fastest: every group
  torn down concurrently, WORLD last, WORLD re-initialised as gloo so `dist.get_rank()` and CPU
  collectives keep working; rebuilt on reload, in registration order), "suspend" (NCCL 2.29.7+
  releases their memory and keeps them) or "keep" (nothing freed). `ways=("destroy", "suspend")`
  offers a memory budget both, to choose per sleep (`use_communicators`); reload undoes the
  way the last destroy took. While asleep every handle,
  `world`, `new_group` and `connect` refuse with `ProcessGroupsAsleepError`, saying how they sleep.
- Every WORLD generation rendezvouses under a fresh `PrefixStore` namespace of the one store kept
  from `init`, so stale keys of an earlier generation never collide.
- Every wait among ranks (destroy, reload, new_group, barrier) meets on that store with a
  deadline. Each rank that arrives posts what it is doing, so on a timeout every waiting rank
  names the ranks that never came, and a rank doing something else is named as a mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from actor_integration.backends.process_groups import _teardown
from actor_integration.backends.process_groups._choice import WayLog, choose_way, choose_ways
from actor_integration.backends.process_groups._rendezvous import (
    BARRIER_CAUSE,
    LIFECYCLE_CAUSE,
    NAMESPACE,
    NEW_GROUP_CAUSE,
    Meeting,
)
from actor_integration.backends.process_groups._way import CommunicatorWay, Outcome, nccl_bytes
from actor_integration.errors import ProcessGroupsAsleepError
from lifecycle.logs import Event
from lifecycle.table import ASLEEP, Communicators, Groups

_ALIVE, _BROKEN, _CLOSED = "alive", "broken", "closed"
_ASLEEP = tuple(groups.value for groups in ASLEEP.values())  # the table's states after a sleep
_DESTROYED = ASLEEP[Communicators.DESTROY].value
_REMOVED = object()  # `suspend=` was replaced by `communicators=`
# How a handle's group sleeps, in its error message.
_WHY: Mapping[str, str] = {
    Groups.DESTROYED: "was destroyed by sleep()",
    Groups.SUSPENDED: (
        "is suspended by sleep() (its NCCL communicator's memory is released: a collective would read "
        "unmapped memory)"
    ),
    Groups.KEPT: "is asleep (communicators='keep': its memory is held, but the other phase owns the GPU)",
}


class GroupHandle:
    """A subgroup that survives sleep: `.group` is the torch group of the current generation."""

    __slots__ = ("_asleep", "_group", "backend", "generation", "name", "ranks")

    def __init__(self, name: str, ranks: tuple[int, ...], backend: str) -> None:
        self.name = name
        self.ranks = ranks
        self.backend = backend
        self.generation = -1
        self._group: ProcessGroup | None = None
        self._asleep = _DESTROYED  # how the group sleeps while `_group` is None

    @property
    def group(self) -> ProcessGroup:
        """The live group; for a rank outside `ranks`, torch's `GroupMember.NON_GROUP_MEMBER`."""
        if self._group is None:
            raise ProcessGroupsAsleepError(
                f"process group {self.name} {_WHY[self._asleep]}; call wake_up() first "
                f"(ranks {list(self.ranks)}, backend {self.backend}, last generation {self.generation})",
                state=self._asleep,
                operation="group",
                group=self.name,
            )
        return self._group

    @property
    def alive(self) -> bool:
        """Whether the handle holds a group now (False while its groups sleep)."""
        return self._group is not None

    def __repr__(self) -> str:
        state = "alive" if self._group is not None else self._asleep
        return f"<GroupHandle {self.name} ranks={list(self.ranks)} backend={self.backend} gen={self.generation} {state}>"


class ReloadableProcessGroups:
    """WORLD plus the subgroups an actor uses, destroyable and reloadable in lockstep on all ranks.

    Build it with `init(...)` (initialises torch.distributed) or `adopt()` (an already
    initialised default group). It fits `lifecycle.Lifecycle(process_groups=...)`.
    """

    def __init__(
        self,
        *,
        store: Store,
        backend: str,
        rank: int,
        world_size: int,
        timeout: timedelta,
        device_id: torch.device | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
        eager_connect: bool = False,
        suspend: object = _REMOVED,
        ways: Sequence[Communicators | str] | None = None,
        _way: CommunicatorWay | None = None,
        _units: Mapping[str, CommunicatorWay] | None = None,
    ) -> None:
        # Use init() or adopt(); this constructor expects WORLD to be initialised on `store` already.
        # `_way`, `_units`: the units init() chose and checked before WORLD existed (a check probes NCCL once).
        _refuse_suspend_argument(suspend)
        if not isinstance(eager_connect, bool):
            raise ValueError(f"eager_connect must be a bool, got {eager_connect!r}")
        self._way = _way if _way is not None else choose_way(communicators, backend)
        self.communicators = self._way.name.value  # read by the lifecycle machine (which state sleep leaves)
        self._units = dict(_units) if _units is not None else choose_ways(self._way, ways, backend)
        # What a memory budget may choose among per sleep (`use_communicators`), the configured way first.
        self.communicators_ways = tuple(self._units)
        self.eager_connect = eager_connect
        self._way_log = WayLog()  # the first destroy says at info which way ran and why
        self._store = store
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.generation = 0
        self._state = _ALIVE
        self._meeting = Meeting(store, rank, world_size)
        self._handles: list[GroupHandle] = []
        self._device_id = device_id
        self._worlds = 1  # WORLDs built on this store so far; each gets its own key namespace
        self._side: ProcessGroup | None = self._new_side_channel()
        self._host = _Host(self)
        self.abandoned: tuple[int, ...] = ()  # ranks given up by `abandon` (their node was lost)

    # ------------------------------------------------------------------ construction

    @classmethod
    def init(
        cls,
        *,
        backend: str,
        rank: int,
        world_size: int,
        init_method: str | None = None,
        store: Store | None = None,
        timeout: timedelta = dist.default_pg_timeout,
        device_id: torch.device | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
        eager_connect: bool = False,
        suspend: object = _REMOVED,
        ways: Sequence[Communicators | str] | None = None,
    ) -> ReloadableProcessGroups:
        """Initialise torch.distributed (WORLD on `backend`) and keep its rendezvous store.

        `device_id` binds every accelerator WORLD to that device (NCCL then connects eagerly, and
        each `new_group` splits WORLD's communicator, one after another).
        `communicators`: what sleep does to the NCCL communicators. "destroy" (default): tear
        them down, rebuild on wake (the fastest measured way that frees the memory). "suspend":
        ncclCommSuspend/Resume, refused here unless NCCL 2.29.7+ is loaded and reachable
        (`nccl_suspend_support()`). "keep": leave them (0 s; their memory stays held).
        `eager_connect`: every `reload()` ends with `connect()` (all NCCL communicators created
        at once) instead of leaving each to its group's first collective.
        `ways`: the ways a memory budget may choose among per sleep, `communicators` among them:
        ("destroy", "suspend") where both can work (suspend is refused as above); None: the
        configured way alone, every sleep.
        """
        _refuse_suspend_argument(suspend)
        _check_backend(backend)
        way = choose_way(communicators, backend)  # refused before WORLD exists, so the call can be retried
        units = choose_ways(way, ways, backend)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if store is not None and init_method is not None:
            raise ValueError("pass either store= or init_method=, not both")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive timedelta, got {timeout!r}")
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process; use "
                "ReloadableProcessGroups.adopt() to take over its default group"
            )
        if store is None:
            # What init_process_group does inside; done here so the store outlives every WORLD.
            store, rank, world_size = next(
                rendezvous(init_method or "env://", rank, world_size, timeout=timeout)
            )
            store.set_timeout(timeout)
        _init_world(backend, store, "world0", rank, world_size, timeout, device_id)
        return cls(
            store=store,
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
            communicators=communicators,
            eager_connect=eager_connect,
            _way=way,
            _units=units,
        )

    @classmethod
    def adopt(
        cls,
        *,
        timeout: timedelta = dist.default_pg_timeout,
        untracked_subgroups: bool = False,
        communicators: Communicators | str = Communicators.DESTROY,
        ways: Sequence[Communicators | str] | None = None,
    ) -> ReloadableProcessGroups:
        """Take over an initialised default group and keep its store (`_get_default_store()`).

        Subgroups that exist already are destroyed with WORLD on every `destroy()` and never
        rebuilt; that is refused unless `untracked_subgroups=True` says their owner rebuilds them
        (as `MegatronParallelState` does for Megatron's groups).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "adopt() needs an initialised default group; call dist.init_process_group first, or use "
                "ReloadableProcessGroups.init(...)"
            )
        existing = _subgroup_count()
        if existing and not untracked_subgroups:
            raise RuntimeError(
                f"adopt() found {existing} process groups besides WORLD that it did not create "
                f"({_describe_subgroups()}); destroy() would destroy them with WORLD and reload() could not "
                "rebuild them. Create subgroups after adopt() with new_group(), or pass untracked_subgroups=True "
                "if their owner rebuilds them (MegatronParallelState does for Megatron's). A slime actor has its "
                "own reloadable groups: use actor_integration.frameworks.slime.SlimeLifecycleMixin, which keeps them."
            )
        backend = str(dist.get_backend())
        _check_backend(backend)
        return cls(
            store=dist.distributed_c10d._get_default_store(),
            backend=backend,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            timeout=timeout,
            device_id=dist.distributed_c10d._get_default_group().bound_device_id,
            communicators=communicators,
            ways=ways,
        )

    # ------------------------------------------------------------------ groups

    def new_group(
        self,
        ranks: Sequence[int],
        *,
        backend: str | None = None,
        name: str | None = None,
        timeout: timedelta | None = None,
    ) -> GroupHandle:
        """Create a subgroup now and rebuild it on every reload. Collective: call it on every rank."""
        self._require(_ALIVE, "new_group")
        given: tuple[object, ...] = (ranks,) if isinstance(ranks, (str, bytes)) else tuple(ranks)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in given):
            raise ValueError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
        wanted = cast(tuple[int, ...], given)
        if not wanted:
            raise ValueError("new_group: ranks is empty")
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"new_group: ranks {list(wanted)} repeat a rank")
        outside = [r for r in wanted if not 0 <= r < self.world_size]
        if outside:
            raise ValueError(f"new_group: ranks {outside} are outside the world of size {self.world_size}")
        if backend is not None:
            _check_backend(backend)
        index = len(self._handles)
        name = name if name is not None else f"group{index}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"new_group: name must be a non-empty string, got {name!r}")
        if any(h.name == name for h in self._handles):
            raise ValueError(f"new_group: a group named {name!r} exists already; names must be unique")
        handle = GroupHandle(name, wanted, backend or self.backend)
        what = f"new_group #{index}(name={name!r}, ranks={list(wanted)}, backend={handle.backend!r})"
        self._meeting.meet(what, timeout or self.timeout, NEW_GROUP_CAUSE)
        self._create(handle)
        self._handles.append(handle)
        return handle

    @property
    def handles(self) -> tuple[GroupHandle, ...]:
        """Every handle `new_group` gave out, in creation order."""
        return tuple(self._handles)

    @property
    def world(self) -> ProcessGroup:
        """The accelerator WORLD; refused while asleep (destroyed, WORLD is a gloo stand-in; suspended or
        kept, it must not run collectives)."""
        self._require(_ALIVE, "world")
        return dist.distributed_c10d._get_default_group()

    @property
    def side_channel(self) -> ProcessGroup:
        """A gloo group of all ranks that works awake and asleep; read it again after each sleep/wake."""
        self._require((_ALIVE, *_ASLEEP), "side_channel")
        assert self._side is not None
        return self._side

    def barrier(self, timeout: timedelta | None = None, *, name: str = "barrier") -> None:
        """Wait for every rank, awake or asleep, with a deadline that names the missing ranks."""
        self._require((_ALIVE, *_ASLEEP), "barrier")
        self._meeting.meet(f"barrier({name!r})", timeout or self.timeout, BARRIER_CAUSE)

    # ------------------------------------------------------------------ lifecycle hooks

    def is_alive(self) -> bool:
        """Whether the groups are up (not destroyed, suspended or kept asleep); recover asks it."""
        return self._state == _ALIVE

    @property
    def state(self) -> str:
        """ "alive"; asleep: "destroyed", "suspended" or "kept" (the way's); "broken" (a destroy or
        reload failed half-way); "closed"."""
        return self._state

    @property
    def device(self) -> torch.device | None:
        """The device every accelerator WORLD is bound to (`device_id`), if any."""
        return self._device_id

    @property
    def lost_groups(self) -> tuple[str, ...]:
        """Groups of others (Megatron's) the last sleep tore down because NCCL could not suspend
        them (communicators="suspend"): their owner must rebuild them on wake."""
        return self._way.lost

    def held_bytes(self) -> int | None:
        """GPU memory the NCCL communicators hold now (ncclCommMemStats), None where NCCL cannot say.

        With communicators="keep" this is what stays on the GPU while asleep.
        """
        return nccl_bytes(_teardown.registered_groups(), "total")

    def destroy(self) -> None:
        """Sleep: free (or suspend, or keep) every communicator, as `communicators` says. Collective.

        With "destroy" every subgroup registered in torch (ours, the side channel, Megatron's)
        goes down in its own thread, WORLD once and last, between two rendezvous: a communicator's
        teardown waits only on the same communicator's on its peers, and every rank starts all of
        its own at once, so no wait can close a cycle (torch shuts them down one by one, in name
        order, because ncclCommAbort once was collective). Measured on an H200 (one rank, each
        communicator warmed): WORLD + 16 NCCL subgroups 7.66 s one by one (torch), 0.72-0.79 s
        here, the same 6.44 GiB freed; Megatron's 25 groups 0.49-0.99 s (8.8-9.2 s through
        torch's WORLD destroy). What is left is about two NCCL teardowns' latency: the subgroups'
        together, then WORLD's (WORLD + one subgroup: 0.98 s).
        """
        self._require((_ALIVE, _BROKEN), "destroy")
        t0 = time.perf_counter()
        _teardown.quiesce(self.backend, self._device_id)
        self._meeting.meet(f"destroy(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _BROKEN  # until the way is done
        outcome = self._way.release(self._host)
        # Leave only once every rank is done: a rank that moved on (or exited) while a peer was
        # still in connectFullMesh (the gloo stand-in) made that peer fail with "closed by peer".
        self._meeting.meet(f"destroyed(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = ASLEEP[outcome.way].value
        self._log(Event.GROUPS_DESTROYED, t0, outcome)

    def use_communicators(self, way: Communicators | str) -> None:
        """The way the next `destroy()` takes, one of `communicators_ways` (a memory budget's choice for
        this sleep); reload then undoes that way. Only while the groups are alive. Every rank must take
        the same way (the budget's plan is agreed over the ranks)."""
        unit = self._units.get(Communicators(way).value)
        if unit is None:
            raise ValueError(
                f"ReloadableProcessGroups.use_communicators({way!r}): this backend offers "
                f"{list(self.communicators_ways)} (pass ways= at init to offer more)"
            )
        if unit is self._way:
            return
        self._require(_ALIVE, "use_communicators")
        self._way = unit

    def reload(self) -> None:
        """Wake: bring every communicator back the way it went (rebuild, resume, or nothing). Collective."""
        self._require((*_ASLEEP, _BROKEN), "reload")
        t0 = time.perf_counter()
        self._meeting.meet(f"reload(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _BROKEN  # until every group is back
        self.generation += 1
        outcome = self._way.restore(self._host)
        self._meeting.meet(f"reloaded(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _ALIVE
        self._log(Event.GROUPS_RELOADED, t0, outcome)

    def connect(self) -> int:
        """Create every NCCL communicator registered in torch now, all at once. Collective.

        Lazily created groups (WORLD without `device_id`) otherwise create theirs one by one at
        their first collective. Groups created by splitting a bound WORLD are connected already and
        are left alone (splits of one parent communicator cannot run concurrently). Call it right
        after a rebuild. Returns how many groups were connected. Measured on an H200, WORLD + 16
        groups of one rank: 0.46 s at once against 0.31 s one by one at their first collectives,
        so NCCL's communicator creation does not overlap and `eager_connect` stays off by default.
        """
        self._require((_ALIVE, _BROKEN), "connect")
        if not torch.cuda.is_available():
            return 0
        device = self._device_id or torch.device("cuda", torch.cuda.current_device())
        lazy = [
            pg
            for pg in _teardown.registered_groups()
            if _teardown.nccl_backend(pg) is not None and pg.bound_device_id is None
        ]
        _teardown.each_at_once(
            lambda pg: cast(Any, _teardown.nccl_backend(pg)).eager_connect_single_device(device), lazy
        )
        return len(lazy)

    def close(self) -> None:
        """Final teardown, idempotent: destroy every group and WORLD (suspended ones are resumed first,
        which waits on their peers: close on every rank; after `abandon`, nothing waits on a peer)."""
        if self._state == _CLOSED:
            return
        if not self.abandoned:
            self._way.close(self._host)
        self._drop_groups()
        self._state = _CLOSED

    def abandon(self, lost: Sequence[int], reason: str) -> None:
        """Give up on `lost` ranks (their node died, as the driver found): a destroy, reload, barrier
        or new_group waiting on them ends within a quarter second with `PeersLostError` instead of at
        its deadline, and so does every later one; `close()` then tears down locally. Callable from
        another thread of the actor (`LifecycleMixin.lifecycle_peers_lost`)."""
        self.abandoned = tuple(sorted(lost))
        self._meeting.abandon(lost, reason)

    # ------------------------------------------------------------------ for the ways, through _Host

    def _hide_handles(self, asleep: str) -> dict[str, ProcessGroup | None]:
        """Take every handle's group away until `_show_handles`; returns them by handle name."""
        hidden: dict[str, ProcessGroup | None] = {}
        for handle in self._handles:
            if handle._group is not None:
                hidden[handle.name] = handle._group
            handle._group, handle._asleep = None, asleep
        return hidden

    def _show_handles(self, hidden: Mapping[str, ProcessGroup | None]) -> None:
        for handle in self._handles:
            if handle.name in hidden:
                handle._group = hidden[handle.name]
                handle.generation = self.generation

    def _stand_in(self) -> int:
        """Every group down (subgroups together, WORLD last), then WORLD as gloo. Returns how many went down."""
        torn = self._drop_groups()
        self._init_world("gloo", None)
        self._side = dist.distributed_c10d._get_default_group()
        return torn

    def _rebuild(self) -> None:
        """Whatever is left down, then the accelerator WORLD, the side channel and every handle's group."""
        self._drop_groups()
        self._init_world(self.backend, self._device_id)
        self._side = self._new_side_channel()
        for handle in self._handles:
            self._create(handle)
        if self.eager_connect:
            self.connect()

    def _recreate(self, names: Sequence[str]) -> None:
        """New groups for the handles named, in registration order (collective: the same list on every rank)."""
        for handle in self._handles:
            if handle.name in names:
                self._create(handle)

    # ------------------------------------------------------------------ internals

    def _init_world(self, backend: str, device_id: torch.device | None) -> None:
        # A fresh namespace even when a failed destroy/reload is retried: stale keys never collide.
        namespace = f"world{self._worlds}"
        self._worlds += 1
        _init_world(backend, self._store, namespace, self.rank, self.world_size, self.timeout, device_id)

    def _create(self, handle: GroupHandle) -> None:
        group = dist.new_group(
            list(handle.ranks), timeout=self.timeout, backend=handle.backend, group_desc=handle.name
        )
        # Non-members get torch's NON_GROUP_MEMBER sentinel, which collectives skip.
        handle._group = cast(ProcessGroup, group)
        handle.generation = self.generation

    def _new_side_channel(self) -> ProcessGroup:
        group = dist.new_group(
            list(range(self.world_size)), timeout=self.timeout, backend="gloo", group_desc="side_channel"
        )
        return cast(ProcessGroup, group)

    def _drop_groups(self) -> int:
        """Destroy every registered group: subgroups at once, then WORLD. Returns how many went down."""
        self._hide_handles(_DESTROYED)
        self._side = None
        return _teardown.destroy_registered_groups()

    def _require(self, states: str | tuple[str, ...], operation: str) -> None:
        allowed = (states,) if isinstance(states, str) else states
        if self._state in allowed:
            return
        where = f"ReloadableProcessGroups.{operation} on rank {self.rank}"
        if self._state in _ASLEEP:
            raise ProcessGroupsAsleepError(
                f"{where}: the groups are {self._state} (asleep); call wake_up() (reload()) first "
                f"(communicators={self.communicators!r})",
                state=self._state,
                operation=operation,
            )
        advice = {
            _ALIVE: "the groups are alive; destroy() first",
            _BROKEN: "a previous destroy()/reload() failed half-way; call reload() (Lifecycle.recover) or close()",
            _CLOSED: "the groups were closed; build new ReloadableProcessGroups",
        }[self._state]
        raise RuntimeError(f"{where}: {advice}")

    def _log(self, event: str, t0: float, outcome: Outcome) -> None:
        self._way_log.emit(
            event,
            t0,
            outcome,
            way=self._way,
            backend=self.backend,
            fields=lambda: {
                "group_rank": self.rank,
                "generation": self.generation,
                "groups": len(self._handles),
            },
            lost_groups=self.lost_groups,
        )

    def __repr__(self) -> str:
        return (
            f"<ReloadableProcessGroups rank {self.rank}/{self.world_size} {self.backend} {self._state} "
            f"communicators={self.communicators} generation={self.generation} "
            f"groups={[h.name for h in self._handles]}>"
        )


class _Host:
    """What the way of one `ReloadableProcessGroups` may do to it (`WayHost`): its only door in."""

    def __init__(self, groups: ReloadableProcessGroups) -> None:
        self._groups = groups

    @property
    def device(self) -> torch.device | None:
        return self._groups.device

    def groups(self) -> list[ProcessGroup]:
        return _teardown.registered_groups()  # ours, the side channel and others' (Megatron's)

    def handle_names(self) -> tuple[str, ...]:
        return tuple(handle.name for handle in self._groups.handles)

    def hide_handles(self, asleep: Groups) -> dict[str, ProcessGroup | None]:
        return self._groups._hide_handles(asleep.value)

    def show_handles(self, hidden: Mapping[str, ProcessGroup | None]) -> None:
        self._groups._show_handles(hidden)

    def stand_in(self) -> int:
        return self._groups._stand_in()

    def rebuild(self) -> None:
        self._groups._rebuild()

    def recreate(self, names: Sequence[str]) -> None:
        self._groups._recreate(names)

    def gather(self, what: str, value: str) -> list[str]:
        groups = self._groups
        return groups._meeting.gather(
            f"{what}(generation {groups.generation})", value, groups.timeout, LIFECYCLE_CAUSE
        )


def _refuse_suspend_argument(suspend: object) -> None:
    if suspend is _REMOVED:
        return
    raise ValueError(
        f"ReloadableProcessGroups: suspend={suspend!r} was replaced by communicators='destroy' | 'suspend' | "
        "'keep'. suspend='auto' switched silently to ncclCommSuspend wherever NCCL 2.29.7+ was loaded, and "
        "that measured ~7x slower than destroying on an H200 (5.0 s against 0.75 s for 17 communicators). "
        "The default, communicators='destroy', is what suspend='never' did; pass communicators='suspend' "
        "to opt in (lifecycle doctor says whether this machine can)."
    )


def _init_world(
    backend: str,
    store: Store,
    namespace: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    device_id: torch.device | None = None,
) -> None:
    dist.init_process_group(
        backend=backend,
        store=PrefixStore(f"{NAMESPACE}/{namespace}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )


def _describe_subgroups(shown: int = 6) -> str:
    """The subgroups of this rank as "backend ranks" items, for error messages."""
    world = dist.distributed_c10d._world
    default = dist.distributed_c10d._get_default_group()
    items = [
        f"{world.pg_map[g][0]} {sorted(world.pg_group_ranks.get(g, {}))}"
        for g in world.pg_map
        if g is not default
    ]
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _subgroup_count() -> int:
    pg_map: dict[Any, Any] = dist.distributed_c10d._world.pg_map
    return max(len(pg_map) - 1, 0)


def _check_backend(backend: str) -> None:
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a name such as 'nccl' or 'gloo', got {backend!r}")
    # Device maps such as "cpu:gloo,cuda:nccl" are checked by torch itself.
    if ":" not in backend and not dist.is_backend_available(backend):
        raise ValueError(
            f"torch.distributed backend {backend!r} is not available in this torch build "
            "(CPU-only builds have gloo, not nccl)"
        )

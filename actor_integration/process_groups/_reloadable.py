"""`ReloadableProcessGroups`: torch.distributed groups that sleep can destroy and wake_up rebuild.

NCCL communicators hold GPU memory, so a sleeping trainer destroys them. The design, without
monkey-patching torch.distributed:

- Awake, WORLD runs on the accelerator backend; `new_group` records each subgroup's spec and
  returns a `GroupHandle` whose `.group` is the live torch group of the current generation.
- `destroy()` frees every communicator registered in torch (ours, the side channel, and groups
  created by others such as Megatron's), each subgroup in its own thread, then WORLD once and
  last, then re-initialises WORLD as gloo so `dist.get_rank()` and CPU collectives keep working
  while asleep. Where NCCL can suspend a communicator (2.29.7+, through torch's
  `Backend.suspend`), its memory is released and the communicator kept instead.
- `reload()` rebuilds the accelerator WORLD and every recorded subgroup, in registration order
  (`new_group` is collective and numbered: it cannot run in threads); `connect()` then creates
  every NCCL communicator at once instead of one by one at each group's first collective.
- Every WORLD generation rendezvouses under a fresh `PrefixStore` namespace of the one store kept
  from `init`, so stale keys of an earlier generation never collide.
- Every wait among ranks (destroy, reload, new_group, barrier) meets on that store with a
  deadline. Each rank that arrives posts what it is doing, so on a timeout every waiting rank
  names the ranks that never came, and a rank doing something else is named as a mismatch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from actor_integration.process_groups import _nccl, _teardown
from actor_integration.process_groups._rendezvous import (
    BARRIER_CAUSE,
    LIFECYCLE_CAUSE,
    NAMESPACE,
    NEW_GROUP_CAUSE,
    Meeting,
)
from lifecycle import events
from lifecycle.logs import Event

_ALIVE, _DESTROYED, _BROKEN, _CLOSED = "alive", "destroyed", "broken", "closed"
SuspendMode = Literal["auto", "never"]


class GroupHandle:
    """A subgroup that survives sleep: `.group` is the torch group of the current generation."""

    __slots__ = ("_group", "backend", "generation", "name", "ranks")

    def __init__(self, name: str, ranks: tuple[int, ...], backend: str) -> None:
        self.name = name
        self.ranks = ranks
        self.backend = backend
        self.generation = -1
        self._group: ProcessGroup | None = None

    @property
    def group(self) -> ProcessGroup:
        """The live group; for a rank outside `ranks`, torch's `GroupMember.NON_GROUP_MEMBER`."""
        if self._group is None:
            raise RuntimeError(
                f"process group {self.name} was destroyed by sleep(); call wake_up() first "
                f"(ranks {list(self.ranks)}, backend {self.backend}, last generation {self.generation})"
            )
        return self._group

    @property
    def alive(self) -> bool:
        return self._group is not None

    def __repr__(self) -> str:
        state = "alive" if self._group is not None else "destroyed"
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
        suspend: SuspendMode = "auto",
        eager_connect: bool = False,
    ) -> None:
        # Use init() or adopt(); this constructor expects WORLD to be initialised on `store` already.
        if suspend not in ("auto", "never"):
            raise ValueError(f"suspend must be 'auto' or 'never', got {suspend!r}")
        if not isinstance(eager_connect, bool):
            raise ValueError(f"eager_connect must be a bool, got {eager_connect!r}")
        self.suspend = suspend
        self.eager_connect = eager_connect
        self._suspended: list[ProcessGroup] = []  # groups whose NCCL communicators are suspended
        self._kept: dict[str, ProcessGroup | None] = {}  # the handles' groups while suspended
        self._path: str | None = None  # "destroy" or "suspend", decided at the first destroy()
        self._announced = False  # the first destroy logs its path at info
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
        suspend: SuspendMode = "auto",
        eager_connect: bool = False,
    ) -> ReloadableProcessGroups:
        """Initialise torch.distributed (WORLD on `backend`) and keep its rendezvous store.

        `device_id` binds every accelerator WORLD to that device (NCCL then connects eagerly, and
        each `new_group` splits WORLD's communicator, one after another).
        `suspend`: "auto" suspends NCCL communicators instead of destroying them where NCCL and
        torch can (`nccl_suspend_support()`); "never" always destroys them.
        `eager_connect`: every `reload()` ends with `connect()` (all NCCL communicators created
        at once) instead of leaving each to its group's first collective.
        """
        _check_backend(backend)
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
            suspend=suspend,
            eager_connect=eager_connect,
        )

    @classmethod
    def adopt(
        cls, *, timeout: timedelta = dist.default_pg_timeout, untracked_subgroups: bool = False
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
                "own reloadable groups: use actor_integration.slime.SlimeLifecycleMixin, which keeps them."
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
        return tuple(self._handles)

    @property
    def world(self) -> ProcessGroup:
        """The accelerator WORLD; raises while destroyed (WORLD is then a gloo stand-in)."""
        self._require(_ALIVE, "world")
        return dist.distributed_c10d._get_default_group()

    @property
    def side_channel(self) -> ProcessGroup:
        """A gloo group of all ranks that works awake and asleep; read it again after each sleep/wake."""
        self._require((_ALIVE, _DESTROYED), "side_channel")
        assert self._side is not None
        return self._side

    def barrier(self, timeout: timedelta | None = None, *, name: str = "barrier") -> None:
        """Wait for every rank, in either state, with a deadline that names the missing ranks."""
        self._require((_ALIVE, _DESTROYED), "barrier")
        self._meeting.meet(f"barrier({name!r})", timeout or self.timeout, BARRIER_CAUSE)

    # ------------------------------------------------------------------ lifecycle hooks

    def is_alive(self) -> bool:
        return self._state == _ALIVE

    @property
    def state(self) -> str:
        """One of "alive", "destroyed" (asleep), "broken" (destroy/reload failed half-way), "closed"."""
        return self._state

    @property
    def teardown_path(self) -> str:
        """How `destroy()` frees communicators: "suspend" (NCCL keeps them, memory released) or "destroy"."""
        if self._path is None:
            self._path = "destroy"
            if self.suspend == "auto" and "nccl" in self.backend and _nccl.nccl_suspend_support().available:
                self._path = "suspend"
        return self._path

    def destroy(self) -> None:
        """Free every communicator; WORLD becomes gloo until `reload()`. Collective.

        Every subgroup registered in torch goes down in its own thread, WORLD once and last, between
        two rendezvous: a communicator's teardown waits only on the same communicator's on its
        peers, and every rank starts all of its own at once, so no wait can close a cycle (torch
        shuts them down one by one, in name order, because ncclCommAbort once was collective).
        Measured on an H200 (one rank, each communicator warmed): WORLD + 16 NCCL subgroups 7.66 s
        one by one (torch), 0.72-0.79 s here, the same 6.44 GiB freed; Megatron's 25 groups
        0.49-0.99 s (8.8-9.2 s through torch's WORLD destroy). What is left is about two NCCL
        teardowns' latency: the subgroups' together, then WORLD's (WORLD + one subgroup: 0.98 s).
        """
        self._require((_ALIVE, _BROKEN), "destroy")
        t0 = time.perf_counter()
        path = self.teardown_path
        _teardown.quiesce(self.backend, self._device_id)
        self._meeting.meet(f"destroy(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _BROKEN  # until the gloo stand-in is up
        if path == "suspend":
            torn = self._suspend_all()
        else:
            torn = self._drop_groups()
            self._init_world("gloo", None)
            self._side = dist.distributed_c10d._get_default_group()
        # Leave only once every rank's gloo stand-in is connected: a rank that moved on (or exited)
        # while a peer was still in connectFullMesh made that peer fail with "closed by peer".
        self._meeting.meet(f"destroyed(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _DESTROYED
        self._log(Event.GROUPS_DESTROYED, t0, path=path, communicators=torn)

    def reload(self) -> None:
        """Rebuild the accelerator WORLD and every subgroup in registration order. Collective."""
        self._require((_DESTROYED, _BROKEN), "reload")
        t0 = time.perf_counter()
        self._meeting.meet(f"reload(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _BROKEN  # until every subgroup is back
        self.generation += 1
        if self._suspended:
            path = "resume"
            self._resume_all()
        else:
            path = "rebuild"
            self._drop_groups()
            self._init_world(self.backend, self._device_id)
            self._side = self._new_side_channel()
            for handle in self._handles:
                self._create(handle)
            if self.eager_connect:
                self.connect()
        self._meeting.meet(f"reloaded(generation {self.generation})", self.timeout, LIFECYCLE_CAUSE)
        self._state = _ALIVE
        self._log(Event.GROUPS_RELOADED, t0, path=path)

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
        """Final teardown, local and idempotent: destroy every group and WORLD."""
        if self._state == _CLOSED:
            return
        if self._suspended:
            with contextlib.suppress(Exception):  # a suspended communicator is destroyed either way
                self._resume_all()
        self._drop_groups()
        self._state = _CLOSED

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
        for handle in self._handles:
            handle._group = None
        self._side = None
        self._suspended = []
        return _teardown.destroy_registered_groups()

    def _suspend_all(self) -> int:
        """NCCL's suspend path: every communicator's memory released, the groups kept (WORLD last)."""
        self._kept = {handle.name: handle._group for handle in self._handles}
        for handle in self._handles:
            handle._group = None
        world = dist.distributed_c10d._get_default_group()
        nccl = [pg for pg in _teardown.registered_groups() if _teardown.nccl_backend(pg) is not None]
        done = self._suspended = []

        def suspend(pg: ProcessGroup) -> None:
            cast(Any, _teardown.nccl_backend(pg)).suspend()
            done.append(pg)  # what reload() must resume, even if a sibling failed

        _teardown.each_at_once(suspend, [pg for pg in nccl if pg is not world])
        if world in nccl:
            suspend(world)
        return len(done)

    def _resume_all(self) -> None:
        def resume(pg: ProcessGroup) -> None:
            cast(Any, _teardown.nccl_backend(pg)).resume()
            self._suspended.remove(pg)  # a retry after a failure resumes only the rest

        _teardown.each_at_once(resume, list(self._suspended))
        for handle in self._handles:
            handle._group = self._kept.get(handle.name)
            handle.generation = self.generation

    def _require(self, states: str | tuple[str, ...], operation: str) -> None:
        allowed = (states,) if isinstance(states, str) else states
        if self._state in allowed:
            return
        advice = {
            _DESTROYED: "the groups are destroyed (asleep); call wake_up() (reload()) first",
            _ALIVE: "the groups are alive; destroy() first",
            _BROKEN: "a previous destroy()/reload() failed half-way; call reload() (Lifecycle.recover) or close()",
            _CLOSED: "the groups were closed; build new ReloadableProcessGroups",
        }[self._state]
        raise RuntimeError(f"ReloadableProcessGroups.{operation} on rank {self.rank}: {advice}")

    def _log(self, event: str, t0: float, **fields: Any) -> None:
        # The first teardown says at info which path ran and why; later ones at debug (the
        # Lifecycle already logs each hook's duration at info). No "rank"/"role" keys: those name a
        # lifecycle machine to the checker and the timeline, and this is not one.
        first = event == Event.GROUPS_DESTROYED and not self._announced
        level = "info" if first else "debug"
        if events.enabled(events.LEVELS[level]):
            if first:
                fields["why"] = (
                    _nccl.nccl_suspend_support().reason if "nccl" in self.backend else "no NCCL groups"
                )
            events.emit(
                level,
                event,
                {
                    "group_rank": self.rank,
                    "generation": self.generation,
                    "groups": len(self._handles),
                    "duration_ms": round((time.perf_counter() - t0) * 1e3, 3),
                    **fields,
                },
            )
        self._announced = self._announced or first

    def __repr__(self) -> str:
        return (
            f"<ReloadableProcessGroups rank {self.rank}/{self.world_size} {self.backend} {self._state} "
            f"generation={self.generation} groups={[h.name for h in self._handles]}>"
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

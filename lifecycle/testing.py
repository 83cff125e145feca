"""Fakes with the exact interfaces of the real backends, a fault injector, and event capture.

`FakeMemorySaver` behaves like the `torch_memory_saver` singleton: where the real one calls
`exit(1)` (pausing a paused tag, resuming a resident one, `pause()` with no tag while some tag
is paused) the fake raises `ProtocolViolation`, so a test sees the crash as an error; where the
real one asserts (`disable()` while TMS is not active on the thread: nested, or outside any
region without `TMS_INIT_ENABLE`) the fake asserts with the same message.
Every fake writes to one shared `CallLog`, so tests can assert the order across backends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.budget import BudgetInputs, agree
from lifecycle.errors import InjectedFault, ProtocolViolation
from lifecycle.events import capture_events
from lifecycle.faults import FaultInjector
from lifecycle.hooks import Hooks
from lifecycle.machine import Lifecycle
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import ASLEEP, Communicators, Hook, State

__all__ = [
    "CallLog",
    "FakeAgreement",
    "FakeDevice",
    "FakeGeneration",
    "FakeMemorySaver",
    "FakeProcessGroups",
    "FaultInjector",
    "InjectedFault",
    "ProtocolViolation",
    "Recorders",
    "RecordingHook",
    "capture_events",
    "recording_lifecycle",
]


class CallLog:
    """Thread-safe ordered record of backend calls: (backend, method, tag)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[tuple[str, str, str | None]] = []

    def add(self, backend: str, method: str, tag: str | None = None) -> None:
        with self._lock:
            self.calls.append((backend, method, tag))

    def names(self) -> list[str]:
        """Calls as "memory.pause[tag]", "process_groups.reload", "switch_model[actor]", ... strings."""
        with self._lock:
            return [
                b + (f".{m}" if m else "") + (f"[{t}]" if t is not None else "") for b, m, t in self.calls
            ]

    def count(self, name: str) -> int:
        """How many calls of "backend.method" (any tag) or of one "backend.method[tag]" were made.

        A held scope's test reads its wakes and sleeps here: `log.count("memory.resume") == 1`.
        """
        return sum(call == name or call.startswith(f"{name}[") for call in self.names())

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


class FakeMemorySaver:
    """torch_memory_saver's interface over per-tag paused flags and TMS's per-thread "active" flag.

    TMS keeps a thread-local "interesting region" flag: allocations are saver memory while it is
    set. It starts from `TMS_INIT_ENABLE` (`init_enable`; on by default, as slime's launcher sets
    it, which is when passing the raw singleton as the memory hook works), is set inside
    `region()` and cleared inside `disable()`, which asserts it first (entrypoint.py): a nested
    `disable()`, or one outside any region without `init_enable`, raises `AssertionError`.
    """

    def __init__(
        self,
        tags: Iterable[str] | None = None,
        *,
        log: CallLog | None = None,
        faults: FaultInjector | None = None,
        may_overlap_process_groups: bool = False,
        init_enable: bool = True,
    ) -> None:
        self.tags = tuple(tags) if tags is not None else ("default",)
        # Off by default so call logs keep the plan's order; on to exercise hooks run together.
        self.may_overlap_process_groups = may_overlap_process_groups
        self.paused: dict[str, bool] = dict.fromkeys(self.tags, False)
        self.log = log if log is not None else CallLog()
        self.faults = faults
        self.init_enable = init_enable
        self._local = threading.local()
        self._retain_cpu_backup = False
        self.pause_count = 0
        self.resume_count = 0

    @property
    def hook_mode(self) -> str:
        raise AttributeError("torch_memory_saver.hook_mode is write-only (set it before the first use)")

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        self._impl_ctor_kwargs = {"hook_mode": mode}  # where TMS keeps it until its first use

    @property
    def retain_cpu_backup(self) -> bool:
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain_cpu_backup = bool(value)

    @property
    def active(self) -> bool:
        """TMS's flag on the calling thread: whether allocations now are saver memory."""
        return bool(getattr(self._local, "active", self.init_enable))

    @property
    def disabled(self) -> bool:
        """Whether the calling thread is inside `disable()`: its allocations are plain memory."""
        return not self.active

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        self.log.add("memory", "region", tag)
        previous, self._local.active = self.active, True
        try:
            yield
        finally:
            self._local.active = previous

    def _affected(self, tag: str | None) -> tuple[str, ...]:
        if tag is None:
            return self.tags
        return (tag,) if tag in self.paused else ()  # TMS: an unknown tag is a silent no-op

    def pause(self, tag: str | None = None) -> None:
        self.log.add("memory", "pause", tag)
        if self.faults:
            self.faults.check("memory.pause", after_effect=False)
        for t in self._affected(tag):
            if self.paused[t]:
                raise ProtocolViolation(
                    f"Cannot pause allocation that is not active (tag={t!r}; TMS would exit(1))"
                )
        for t in self._affected(tag):
            self.paused[t] = True
        self.pause_count += 1
        if self.faults:
            self.faults.check("memory.pause", after_effect=True)

    def resume(self, tag: str | None = None) -> None:
        self.log.add("memory", "resume", tag)
        if self.faults:
            self.faults.check("memory.resume", after_effect=False)
        for t in self._affected(tag):
            if not self.paused[t]:
                raise ProtocolViolation(
                    f"Cannot resume allocation that is not paused (tag={t!r}; TMS would exit(1))"
                )
        for t in self._affected(tag):
            self.paused[t] = False
        self.resume_count += 1
        if self.faults:
            self.faults.check("memory.resume", after_effect=True)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        self.log.add("memory", "disable")
        # torch_memory_saver/entrypoint.py, _TorchMemorySaverImpl.disable: the same assertion.
        assert self.active, "disable() should be called only when tms is active"
        self._local.active = False
        try:
            yield
        finally:
            self._local.active = True

    def is_paused(self, tag: str | None = None) -> bool:
        return any(self.paused[t] for t in (self.tags if tag is None else (tag,)))

    def resident(self, tag: str | None = None) -> bool:
        return not any(self.paused[t] for t in (self.tags if tag is None else (tag,)))

    def touch(self, tag: str | None = None) -> None:
        """What a body does with its memory: a violation if any of it is paused."""
        if not self.resident(tag):
            raise ProtocolViolation(f"body used memory of tag {tag or 'any'} while it is paused")


class FakeProcessGroups:
    """destroy()/reload()/is_alive() over a flag; `use()` is what a collective does.

    `communicators` declares what destroy does to the communicators, as a real backend does
    ("destroy", "suspend" or "keep"): the machine reads it, `state` tells it back while asleep,
    and `held_bytes` is what kept communicators would hold. `ways` (besides `communicators`):
    the other ways a memory budget may choose per sleep (`use_communicators`); `way` is the one
    the next (or the last) destroy takes, and reload undoes it.
    """

    def __init__(
        self,
        *,
        log: CallLog | None = None,
        faults: FaultInjector | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
        held_bytes: int | None = None,
        ways: Sequence[Communicators | str] = (),
    ) -> None:
        self.communicators = Communicators(communicators).value
        if ways:
            self.communicators_ways = tuple(
                dict.fromkeys([self.communicators, *(Communicators(w).value for w in ways)])
            )
        self.way = self.communicators
        self._held_bytes = held_bytes
        self.alive = True
        self.log = log if log is not None else CallLog()
        self.faults = faults
        self.destroy_count = 0
        self.reload_count = 0

    def destroy(self) -> None:
        self.log.add("process_groups", "destroy")
        if self.faults:
            self.faults.check("process_groups.destroy", after_effect=False)
        if not self.alive:
            raise ProtocolViolation("destroy() on destroyed process groups")
        self.alive = False
        self.destroy_count += 1
        if self.faults:
            self.faults.check("process_groups.destroy", after_effect=True)

    def use_communicators(self, way: Communicators | str) -> None:
        """The way of the next destroy (one of `communicators_ways`); only while the groups are alive."""
        way = Communicators(way).value
        if way not in getattr(self, "communicators_ways", (self.communicators,)):
            raise ProtocolViolation(f"use_communicators({way!r}): this backend offers no such way")
        if not self.alive and way != self.way:
            raise ProtocolViolation(f"use_communicators({way!r}) on {self.state} process groups")
        self.log.add("process_groups", f"use_{way}")
        self.way = way

    def reload(self) -> None:
        self.log.add("process_groups", "reload")
        if self.faults:
            self.faults.check("process_groups.reload", after_effect=False)
        if self.alive:
            raise ProtocolViolation("reload() on alive process groups (would leak communicators)")
        self.alive = True
        self.reload_count += 1
        if self.faults:
            self.faults.check("process_groups.reload", after_effect=True)

    def is_alive(self) -> bool:
        return self.alive

    @property
    def state(self) -> str:
        """ "alive", or how the groups sleep: "destroyed", "suspended" or "kept"."""
        return "alive" if self.alive else ASLEEP[Communicators(self.way)].value

    def held_bytes(self) -> int | None:
        return self._held_bytes if self.way == Communicators.KEEP else 0

    def use(self) -> None:
        if not self.alive:
            raise ProtocolViolation(f"collective on {self.state} process groups")


class FakeDevice:
    """A `MemoryProbe` over a device of `total_bytes`: what is free follows the fakes' residency.

    Each tag of `memory` holds `tag_bytes[tag]` while resident, live `groups` hold `groups_bytes`
    (suspended ones `suspended_bytes`: what NCCL's suspend does not release), and `taken_bytes` is what another process allocated (set it to take memory meanwhile).
    `declared` says whether `expected_bytes(tag)` answers the tags' sizes (the release audit's
    estimate before it measured) or None. `agreement` reduces the inputs over fake ranks.
    """

    def __init__(
        self,
        total_bytes: int,
        memory: FakeMemorySaver,
        tag_bytes: dict[str, int],
        *,
        groups: FakeProcessGroups | None = None,
        groups_bytes: int = 0,
        suspended_bytes: int = 0,
        taken_bytes: int = 0,
        declared: bool = True,
        agreement: FakeAgreement | None = None,
    ) -> None:
        self.total_bytes = total_bytes
        self.memory = memory
        self.tag_bytes = dict(tag_bytes)
        self.groups = groups
        self.groups_bytes = groups_bytes
        self.suspended_bytes = suspended_bytes
        self.taken_bytes = taken_bytes
        self.declared = declared
        self.agreement = agreement

    def free_bytes(self) -> int | None:
        used = sum(b for t, b in self.tag_bytes.items() if not self.memory.paused.get(t, False))
        if self.groups is not None and self.groups.alive:
            used += self.groups_bytes
        elif self.groups is not None and self.groups.way == Communicators.SUSPEND:
            used += self.suspended_bytes
        return self.total_bytes - used - self.taken_bytes

    def expected_bytes(self, tag: str | None) -> int | None:
        if not self.declared:
            return None
        return sum(self.tag_bytes.values()) if tag is None else self.tag_bytes.get(tag)

    def agree(self, inputs: BudgetInputs) -> BudgetInputs:
        return inputs if self.agreement is None else self.agreement.agree(inputs)


class FakeAgreement:
    """What a group's reduction does, for ranks running as threads: each rank's inputs in, the
    reduced inputs (`lifecycle.budget.agree`) out to all, once every rank gave its own."""

    def __init__(self, world_size: int, *, timeout: float = 10.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._lock = threading.Lock()
        self._round: list[BudgetInputs] = []
        self._result: BudgetInputs | None = None

    def agree(self, inputs: BudgetInputs) -> BudgetInputs:
        with self._lock:
            self._round.append(inputs)
        if self._barrier.wait() == 0:
            self._result = agree(sorted(self._round, key=lambda i: i.free_bytes))
            self._round = []
        self._barrier.wait()
        assert self._result is not None
        return self._result


class RecordingHook:
    """A plain callable hook (routing-replay clear, clear-memory, switch-model) that records its calls."""

    def __init__(self, name: str, *, log: CallLog | None = None, faults: FaultInjector | None = None) -> None:
        self.name = name
        self.log = log if log is not None else CallLog()
        self.faults = faults
        self.args: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> None:
        self.log.add(self.name, "", str(args[0]) if args else None)
        if self.faults:
            self.faults.check(self.name, after_effect=False)
        self.args.append(args)
        if self.faults:
            self.faults.check(self.name, after_effect=True)


class FakeGeneration:
    """A rollout engine's pause/resume of generation."""

    def __init__(self, *, log: CallLog | None = None, faults: FaultInjector | None = None) -> None:
        self.log = log if log is not None else CallLog()
        self.faults = faults
        self.serving = True

    def pause(self) -> None:
        self.log.add("generation", "pause")
        if self.faults:
            self.faults.check("generation.pause", after_effect=False)
        self.serving = False
        if self.faults:
            self.faults.check("generation.pause", after_effect=True)

    def resume(self) -> None:
        self.log.add("generation", "resume")
        if self.faults:
            self.faults.check("generation.resume", after_effect=False)
        self.serving = True
        if self.faults:
            self.faults.check("generation.resume", after_effect=True)


@dataclass
class Recorders:
    """The fakes behind one `recording_lifecycle`, sharing one log and one injector."""

    log: CallLog
    faults: FaultInjector
    memory: FakeMemorySaver
    process_groups: FakeProcessGroups
    routing_replay: RecordingHook
    clear_memory: RecordingHook
    switch_model: RecordingHook
    generation: FakeGeneration | None

    def check_body(self, lifecycle: Lifecycle, operation: str) -> None:
        """Assert what a real body would need: the protocol a real backend enforces."""
        if operation == "sync":
            for tag in lifecycle.policy.sync_requires:
                self.memory.touch(tag)
            if not self.memory.disabled:
                raise ProtocolViolation("sync body allocated with the memory saver enabled")
        else:
            self.memory.touch(None)
        self.process_groups.use()


def recording_lifecycle(
    policy: LifecyclePolicy,
    *,
    initial: State = State.AWAKE,
    generation: bool = False,
    rank: int | None = None,
    role: str | None = None,
    overlap: bool = False,
    communicators: Communicators | str = Communicators.DESTROY,
) -> tuple[Lifecycle, Recorders]:
    """A `Lifecycle` wired to fresh fakes for every hook slot (`overlap`: hooks may run together;
    `communicators`: what the fake process groups declare their destroy does)."""
    log, faults = CallLog(), FaultInjector()
    memory = FakeMemorySaver(policy.memory_tags, log=log, faults=faults, may_overlap_process_groups=overlap)
    if initial is State.PAUSED:
        memory.paused = dict.fromkeys(memory.tags, True)
    groups = FakeProcessGroups(log=log, faults=faults, communicators=communicators)
    if initial is State.PAUSED and policy.destroy_process_groups:
        groups.alive = False
    rec = Recorders(
        log=log,
        faults=faults,
        memory=memory,
        process_groups=groups,
        routing_replay=RecordingHook(Hook.ROUTING_REPLAY_CLEAR.value, log=log, faults=faults),
        clear_memory=RecordingHook(Hook.CLEAR_MEMORY.value, log=log, faults=faults),
        switch_model=RecordingHook(Hook.SWITCH_MODEL.value, log=log, faults=faults),
        generation=FakeGeneration(log=log, faults=faults) if generation else None,
    )
    hooks = Hooks(
        memory=memory,
        process_groups=groups,
        routing_replay=rec.routing_replay,
        clear_memory=rec.clear_memory,
        switch_model=rec.switch_model,
        generation=rec.generation,
    )
    lifecycle = Lifecycle(policy, hooks, rank=rank, role=role, initial=initial)
    return lifecycle, rec

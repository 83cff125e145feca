"""Fakes with the exact interfaces of the real backends, a fault injector, and event capture.

`FakeMemorySaver` behaves like the `torch_memory_saver` singleton: where the real one calls
`exit(1)` (pausing a paused tag, resuming a resident one, `pause()` with no tag while some tag
is paused) the fake raises `ProtocolViolation`, so a test sees the crash as an error.
Every fake writes to one shared `CallLog`, so tests can assert the order across backends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lifecycle.errors import InjectedFault, ProtocolViolation
from lifecycle.events import capture_events
from lifecycle.machine import Lifecycle
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import Hook, State

__all__ = [
    "CallLog",
    "FakeGeneration",
    "FakeMemorySaver",
    "FakeProcessGroups",
    "FaultInjector",
    "FaultyMemory",
    "FaultyProcessGroups",
    "InjectedFault",
    "ProtocolViolation",
    "Recorders",
    "RecordingHook",
    "capture_events",
    "recording_lifecycle",
    "with_faults",
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

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


@dataclass
class FaultInjector:
    """Makes the n-th call of a hook raise `InjectedFault`, before or after its effect.

    Hooks are named as in the logs: "memory.pause", "process_groups.reload", "clear_memory", ...
    """

    armed: dict[str, tuple[int, bool]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)

    def arm(self, hook: str | Hook, *, at: int = 1, after_effect: bool = False) -> None:
        name = Hook(hook).value
        self.armed[name] = (self.counts.get(name, 0) + at, after_effect)

    def disarm(self) -> None:
        self.armed.clear()

    def check(self, hook: str, *, after_effect: bool) -> None:
        """Called by fakes twice per call: before (after_effect=False) and after the effect."""
        if not after_effect:
            self.counts[hook] = self.counts.get(hook, 0) + 1
        target = self.armed.get(hook)
        if target is None:
            return
        at, when_after = target
        if self.counts.get(hook, 0) == at and when_after == after_effect:
            del self.armed[hook]
            self.fired.append(hook)
            raise InjectedFault(
                f"injected fault in {hook} (call {at}, {'after' if after_effect else 'before'} effect)"
            )


class FakeMemorySaver:
    """torch_memory_saver's interface over per-tag paused flags."""

    def __init__(
        self,
        tags: Iterable[str] | None = None,
        *,
        log: CallLog | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.tags = tuple(tags) if tags is not None else ("default",)
        self.paused: dict[str, bool] = dict.fromkeys(self.tags, False)
        self.log = log if log is not None else CallLog()
        self.faults = faults
        self.disabled = False
        self.pause_count = 0
        self.resume_count = 0

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
        previous, self.disabled = self.disabled, True
        try:
            yield
        finally:
            self.disabled = previous

    def is_paused(self, tag: str | None = None) -> bool:
        return any(self.paused[t] for t in (self.tags if tag is None else (tag,)))

    def resident(self, tag: str | None = None) -> bool:
        return not any(self.paused[t] for t in (self.tags if tag is None else (tag,)))

    def touch(self, tag: str | None = None) -> None:
        """What a body does with its memory: a violation if any of it is paused."""
        if not self.resident(tag):
            raise ProtocolViolation(f"body used memory of tag {tag or 'any'} while it is paused")


class FakeProcessGroups:
    """destroy()/reload()/is_alive() over a flag; `use()` is what a collective does."""

    def __init__(self, *, log: CallLog | None = None, faults: FaultInjector | None = None) -> None:
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

    def use(self) -> None:
        if not self.alive:
            raise ProtocolViolation("collective on destroyed process groups")


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


class FaultyMemory:
    """Wraps a real memory backend so a `FaultInjector` can fail its calls (tests, `demo --inject-fault`)."""

    def __init__(self, inner: Any, faults: FaultInjector) -> None:
        self.inner, self.faults = inner, faults

    def pause(self, tag: str | None = None) -> None:
        self.faults.check("memory.pause", after_effect=False)
        self.inner.pause(tag=tag)
        self.faults.check("memory.pause", after_effect=True)

    def resume(self, tag: str | None = None) -> None:
        self.faults.check("memory.resume", after_effect=False)
        self.inner.resume(tag=tag)
        self.faults.check("memory.resume", after_effect=True)

    def disable(self) -> Any:
        return self.inner.disable()

    def __getattr__(self, name: str) -> Any:
        # is_paused, region, ...: present exactly when the wrapped backend has them.
        return getattr(self.inner, name)


class FaultyProcessGroups:
    """Wraps a real process-group backend for a `FaultInjector`."""

    def __init__(self, inner: Any, faults: FaultInjector) -> None:
        self.inner, self.faults = inner, faults

    def destroy(self) -> None:
        self.faults.check("process_groups.destroy", after_effect=False)
        self.inner.destroy()
        self.faults.check("process_groups.destroy", after_effect=True)

    def reload(self) -> None:
        self.faults.check("process_groups.reload", after_effect=False)
        self.inner.reload()
        self.faults.check("process_groups.reload", after_effect=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyGeneration:
    def __init__(self, inner: Any, faults: FaultInjector) -> None:
        self.inner, self.faults = inner, faults

    def pause(self) -> None:
        self.faults.check("generation.pause", after_effect=False)
        self.inner.pause()

    def resume(self) -> None:
        self.faults.check("generation.resume", after_effect=False)
        self.inner.resume()


def faulty_hook(name: str, fn: Callable[..., Any], faults: FaultInjector) -> Callable[..., Any]:
    def hook(*args: Any) -> Any:
        faults.check(name, after_effect=False)
        return fn(*args)

    return hook


def with_faults(faults: FaultInjector, **hooks: Any) -> dict[str, Any]:
    """The keyword arguments of `Lifecycle(...)`/`configure_lifecycle(...)`, each wrapped for `faults`."""
    wrapped: dict[str, Any] = {}
    for name, hook in hooks.items():
        if hook is None:
            wrapped[name] = None
        elif name == "memory":
            wrapped[name] = FaultyMemory(hook, faults)
        elif name == "process_groups":
            wrapped[name] = FaultyProcessGroups(hook, faults)
        elif name == "generation":
            wrapped[name] = FaultyGeneration(hook, faults)
        elif name in ("routing_replay", "clear_memory", "switch_model"):
            wrapped[name] = faulty_hook(
                Hook.ROUTING_REPLAY_CLEAR.value if name == "routing_replay" else name, hook, faults
            )
        else:
            raise ValueError(f"with_faults: {name!r} is not a lifecycle hook slot")
    return wrapped


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
) -> tuple[Lifecycle, Recorders]:
    """A `Lifecycle` wired to fresh fakes for every hook slot."""
    log, faults = CallLog(), FaultInjector()
    memory = FakeMemorySaver(policy.memory_tags, log=log, faults=faults)
    if initial is State.PAUSED:
        memory.paused = dict.fromkeys(memory.tags, True)
    groups = FakeProcessGroups(log=log, faults=faults)
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
    lifecycle = Lifecycle(
        policy,
        memory=memory,
        process_groups=groups,
        routing_replay=rec.routing_replay,
        clear_memory=rec.clear_memory,
        switch_model=rec.switch_model,
        generation=rec.generation,
        rank=rank,
        role=role,
        initial=initial,
    )
    return lifecycle, rec


def make_body(rec: Recorders, lifecycle: Lifecycle, operation: str, result: Any = None) -> Callable[[], Any]:
    """A body that checks the protocol, records itself, and returns `result`."""

    def body() -> Any:
        rec.check_body(lifecycle, operation)
        rec.log.add("body", operation)
        return result

    return body

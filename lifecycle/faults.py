"""Fault injection at the hook calls of a plan: tests, `lifecycle demo --inject-fault` and a
framework job's `RL_LIFECYCLE_FAULT` (testing and staging only).

    faults = FaultInjector()
    lifecycle = Lifecycle(policy, with_faults(faults, hooks))
    faults.arm("memory.pause", at=1, after_effect=False)  # the next pause raises InjectedFault

Hooks are named as in the logs ("memory.pause", "process_groups.reload", "clear_memory", ...).
A fault fires before a call's effect (nothing happened) or after it (the effect happened, the
call still raised), which are the two cases `recover()` must tell apart.

`parse_fault("rollout:generation.pause@3")` reads the one grammar both switches take,
`[trainer:|rollout:]HOOK@STEP`, into a `Fault` (a ValueError says what is wrong with the text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lifecycle.errors import InjectedFault
from lifecycle.hooks import Hooks
from lifecycle.table import Hook

__all__ = [
    "FAULT_FORM",
    "FAULT_ROLES",
    "Fault",
    "FaultInjector",
    "FaultyGeneration",
    "FaultyMemory",
    "FaultyProcessGroups",
    "parse_fault",
    "with_faults",
]

FAULT_FORM = "[trainer:|rollout:]HOOK@STEP"
FAULT_ROLES = ("trainer", "rollout")
_FAULT = re.compile(r"^(?:(?P<role>trainer|rollout):)?(?P<hook>[a-z_.]+)@(?P<step>\d+)$")


class Fault(NamedTuple):
    """One injected fault: `hook` raises on every actor of `role` at `step` (from 1). What a step
    is belongs to the switch: the demo's RL step; a framework job's `step`-th call of the hook."""

    role: str
    hook: str
    step: int


def parse_fault(text: str) -> Fault:
    """`[trainer:|rollout:]HOOK@STEP` (role trainer when left out) → `Fault`; the hook names are
    the logs'. ValueError, with the form and the hooks, for anything else."""
    match = _FAULT.match(text)
    hooks = [h.value for h in Hook]
    if match is None or match["hook"] not in hooks or int(match["step"]) < 1:
        raise ValueError(
            f"{text!r}: expected {FAULT_FORM} with HOOK one of {hooks} and STEP from 1, "
            "e.g. memory.pause@2 or rollout:generation.pause@3"
        )
    return Fault(match["role"] or "trainer", match["hook"], int(match["step"]))


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
        attr = getattr(self.inner, name)
        hook = _BATCH_HOOKS.get(name)
        if hook is None:
            return attr

        def batch(tags: tuple[str, ...]) -> None:  # pause_tags / resume_tags: one call, one count
            self.faults.check(hook, after_effect=False)
            attr(tags)
            self.faults.check(hook, after_effect=True)

        return batch


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


def with_faults(faults: FaultInjector, hooks: Hooks) -> Hooks:
    """The same hooks, each call of each slot able to fail when `faults` says so."""
    wrapped: dict[str, Any] = {}
    for name, hook in hooks.slots():
        if hook is None:
            wrapped[name] = None
        elif name == "memory":
            wrapped[name] = FaultyMemory(hook, faults)
        elif name == "process_groups":
            wrapped[name] = FaultyProcessGroups(hook, faults)
        elif name == "generation":
            wrapped[name] = FaultyGeneration(hook, faults)
        elif name == "budget":
            wrapped[name] = hook  # a probe the machine reads; faults go to the hooks it plans
        else:
            wrapped[name] = faulty_hook(_HOOK_OF_SLOT.get(name, name), hook, faults)
    return Hooks(**wrapped)


_HOOK_OF_SLOT = {"routing_replay": Hook.ROUTING_REPLAY_CLEAR.value}
# A backend's batch calls (`MemoryBatches`): the tags of a plan stage in one call, failing as one.
_BATCH_HOOKS = {"pause_tags": Hook.MEMORY_PAUSE.value, "resume_tags": Hook.MEMORY_RESUME.value}

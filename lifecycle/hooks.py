"""The hook bundle an actor hands its machine, and the backend interfaces beside it.

`Hooks` lists the slots once; the machine, the mixin and fault injection all take a `Hooks`.
The Protocols are what each slot must offer; the real objects fit them as they are (the
`torch_memory_saver` singleton is a `MemoryBackend`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lifecycle.table import Communicators, Hook

__all__ = [
    "EventSink",
    "GenerationBackend",
    "Hooks",
    "MemoryBackend",
    "MemoryBatches",
    "MemoryDisable",
    "MemoryProbe",
    "ProcessGroupsBackend",
]


@runtime_checkable
class MemoryDisable(Protocol):
    """The part of a memory backend a weight sender needs: allocations inside `disable()` are plain."""

    def disable(self) -> contextlib.AbstractContextManager[Any]:
        """A context inside which allocations are plain memory, outside every pausable region."""
        ...


@runtime_checkable
class MemoryBackend(MemoryDisable, Protocol):
    """torch_memory_saver's own interface: the real `torch_memory_saver` singleton fits as is.

    A backend that releases several tags in one call (an engine server's one request) may also
    offer `MemoryBatches`: a plan's run of pauses (or resumes) of named tags then goes to it in
    one call; without it, one call per tag."""

    def pause(self, tag: str | None = None) -> None:
        """Release the device memory of `tag` (None: all of it), keeping its virtual addresses."""
        ...

    def resume(self, tag: str | None = None) -> None:
        """Map device memory back under the paused `tag` (None: all of it)."""
        ...


@runtime_checkable
class MemoryBatches(Protocol):
    """The optional batch calls of a `MemoryBackend`: the tags of one plan stage's consecutive
    pauses (or resumes), in plan order, in one call. The log keeps one hook entry per tag: the
    first carries the call's time (or its failure; the later tags are then not reached), the
    others follow it with none."""

    def pause_tags(self, tags: tuple[str, ...]) -> None:
        """Release the device memory of every tag in `tags` at once."""
        ...

    def resume_tags(self, tags: tuple[str, ...]) -> None:
        """Map device memory back under every tag in `tags` at once."""
        ...


@runtime_checkable
class ProcessGroupsBackend(Protocol):
    """destroy() on sleep, reload() on wake. A backend may also declare `communicators`
    ("destroy", "suspend" or "keep": what its destroy does to the communicators; absent means
    "destroy"), `is_alive()` (asked by recover) and, for "keep", `held_bytes()` (the GPU memory
    the kept communicators hold, or None when it cannot be measured). A backend that can take
    both "destroy" and "suspend" may declare `communicators_ways` (the ways it offers, its
    configured one among them) and `use_communicators(way)` (the way of the next destroy, called
    by the memory budget before each sleep that destroys; reload undoes the way that ran)."""

    def destroy(self) -> None:
        """Take the process groups down for sleep (what it does to the communicators: `communicators`)."""
        ...

    def reload(self) -> None:
        """Bring the process groups back up on wake."""
        ...


@runtime_checkable
class GenerationBackend(Protocol):
    """A rollout engine's generation control: pause (and flush) before release, resume after wake."""

    def pause(self) -> None:
        """Stop generating and flush what is in flight, before the engine's memory is released."""
        ...

    def resume(self) -> None:
        """Generate again, after the engine's memory is back."""
        ...


@runtime_checkable
class MemoryProbe(Protocol):
    """What a memory budget reads (`lifecycle.budget`): the device's free bytes (None: cannot tell).

    It may also offer `agree(inputs) -> inputs`, the `BudgetInputs` reduced over the ranks of the
    group (`lifecycle.budget.agree` over every rank's; absent: one rank), and `expected_bytes(tag)`,
    what a tag holds while resident (the estimate before the release audit measured it).
    """

    def free_bytes(self) -> int | None:
        """Free bytes on this rank's device now."""
        ...


class EventSink(Protocol):
    """What `Lifecycle.event` offers: layers above the machine log through it with the actor's context."""

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        """Log the event `name` at `level`, with the actor's rank, role and step beside `fields`."""
        ...


_METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "memory": (("pause", "resume", "disable"), "torch_memory_saver's pause/resume/disable"),
    "process_groups": (("destroy", "reload"), "destroy()/reload()"),
    "generation": (("pause", "resume"), "pause()/resume()"),
    "budget": (("free_bytes",), "free_bytes()"),
}


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """What a plan may call. Only `memory` is required; a slot left None is skipped by every plan.

    memory: pauses and resumes tags (torch_memory_saver, `TorchMemorySaverBackend`, `NoopMemory`).
    process_groups: destroyed on sleep, reloaded on wake (`ReloadableProcessGroups`, Megatron's).
    routing_replay: clears routing-replay caches before memory is released (MoE).
    clear_memory: drops garbage and cached blocks around the memory calls.
    switch_model: called with the policy's `model_tag` after a wake (slime's `_switch_model`).
    generation: pauses and resumes an engine's generation (rollout).
    budget: the free memory a `LifecyclePolicy(memory_budget=...)` plans from (`MemoryProbe`).
    """

    memory: MemoryBackend
    process_groups: ProcessGroupsBackend | None = None
    routing_replay: Callable[[], Any] | None = None
    clear_memory: Callable[[], Any] | None = None
    switch_model: Callable[[str], Any] | None = None
    generation: GenerationBackend | None = None
    budget: MemoryProbe | None = None

    def __post_init__(self) -> None:
        for slot in dataclasses.fields(self):
            value = getattr(self, slot.name)
            if value is None:
                if slot.name == "memory":
                    raise TypeError(
                        "Hooks: memory is required (torch_memory_saver's pause/resume/disable); for machines "
                        "without CUDA pass actor_integration.NoopMemory()"
                    )
                continue
            methods = _METHODS.get(slot.name)
            if methods is None:
                if not callable(value):
                    raise TypeError(f"Hooks: {slot.name} must be a callable, got {type(value).__name__}")
                continue
            missing = [m for m in methods[0] if not callable(getattr(value, m, None))]
            if missing:
                hint = (
                    ". For machines without CUDA pass actor_integration.NoopMemory()"
                    if slot.name == "memory"
                    else ""
                )
                raise TypeError(
                    f"Hooks: {slot.name} must provide {methods[1]}; {type(value).__name__} lacks {missing}{hint}"
                )
        if self.process_groups is not None:
            self.communicators  # noqa: B018 - a declaration the table cannot read fails here, not at sleep
            self.communicators_ways  # noqa: B018 - likewise

    @property
    def present(self) -> frozenset[Hook]:
        """The hook slots of the table these hooks fill (memory always)."""
        present = {Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME}
        if self.process_groups is not None:
            present |= {Hook.PROCESS_GROUPS_DESTROY, Hook.PROCESS_GROUPS_RELOAD}
        if self.generation is not None:
            present |= {Hook.GENERATION_PAUSE, Hook.GENERATION_RESUME}
        if self.budget is not None:
            present.add(Hook.BUDGET_CHECK)
        for hook, given in (
            (Hook.ROUTING_REPLAY_CLEAR, self.routing_replay),
            (Hook.CLEAR_MEMORY, self.clear_memory),
            (Hook.SWITCH_MODEL, self.switch_model),
        ):
            if given is not None:
                present.add(hook)
        return frozenset(present)

    @property
    def communicators(self) -> Communicators | None:
        """What `process_groups.destroy` does to the communicators, as the backend declares it
        (its `communicators` attribute; absent: destroy). None without process groups."""
        if self.process_groups is None:
            return None
        declared = getattr(self.process_groups, "communicators", Communicators.DESTROY)
        try:
            return Communicators(declared)
        except ValueError:
            raise TypeError(
                f"Hooks: process_groups ({type(self.process_groups).__name__}) declares communicators="
                f"{declared!r}; the lifecycle knows {[c.value for c in Communicators]} (what a sleep does to "
                "the NCCL communicators). Fix the backend's `communicators` attribute, or remove it to destroy"
            ) from None

    @property
    def communicators_ways(self) -> tuple[Communicators, ...]:
        """The ways the process groups offer a sleep, the configured one (`communicators`) first; the
        backend's `communicators_ways` (absent: the configured way alone). Empty without process groups."""
        configured = self.communicators
        if configured is None:
            return ()
        declared = getattr(self.process_groups, "communicators_ways", None)
        if declared is None:
            return (configured,)
        name = type(self.process_groups).__name__
        try:
            ways = tuple(dict.fromkeys(Communicators(w) for w in declared))
        except (TypeError, ValueError):
            raise TypeError(
                f"Hooks: process_groups ({name}) declares communicators_ways={declared!r}; each must be one "
                f"of {[c.value for c in Communicators]}"
            ) from None
        if configured not in ways:
            raise TypeError(
                f"Hooks: process_groups ({name}) offers communicators_ways={[w.value for w in ways]} without "
                f"its configured communicators={configured.value!r}"
            )
        others = tuple(w for w in ways if w is not configured)
        if others and (
            Communicators.KEEP in ways
            or not callable(getattr(self.process_groups, "use_communicators", None))
        ):
            raise TypeError(
                f"Hooks: process_groups ({name}) offers communicators_ways={[w.value for w in ways]}: several "
                "ways must be 'destroy' and 'suspend' (keep is the budget's own choice), and the backend "
                "needs use_communicators(way) to take the one a sleep chose"
            )
        return (configured, *others)

    def slots(self) -> Iterator[tuple[str, Any]]:
        """(slot name, value) for every slot, in declaration order."""
        for slot in dataclasses.fields(self):
            yield slot.name, getattr(self, slot.name)

    def replace(self, **changes: Any) -> Hooks:
        """A copy with the slots named in `changes` replaced."""
        return dataclasses.replace(self, **changes)

"""The resource calls a framework's bodies make themselves, owned by the plans while a body runs.

slime's and miles' `update_weights`/`save_model` bodies reach their resources through module
globals (`reload_process_groups()`, `destroy_process_groups()`, `torch_memory_saver.disable()` /
`.pause()` / `.resume()`). Under the lifecycle the operation's plans own those resources: the
groups are already up when a body starts, `disable()` is already entered for a sync
(torch_memory_saver asserts on a nested one), and a pause or resume from a body would give a tag
a second owner (torch_memory_saver exits on a paused tag paused again). `plan_owned_globals`
builds the stand-ins an adapter returns from `lifecycle_body_globals`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from actor_integration.actors.mixin import LifecycleMixin
from lifecycle.errors import IllegalTransitionError
from lifecycle.machine import Lifecycle
from lifecycle.table import Groups

__all__ = [
    "PlanOwnedMemorySaver",
    "body_owner",
    "pipeline_parallel_size",
    "plan_owned_globals",
    "stand_in_calls",
]


def plan_owned_globals(
    actor: LifecycleMixin,
    operation: str,
    *,
    on_pause: Callable[[str | None], bool] | None = None,
) -> dict[str, Any]:
    """Stand-ins for the module globals of `actor`'s framework class, for a body of `operation`.

    Each call a body makes through them is recorded (`stand_in_calls`). `on_pause(tag)` may claim
    a body's `torch_memory_saver.pause(tag)` as the plans' own (return True: recorded, not run,
    because the exit plan pauses that tag); any other pause or resume is refused.
    """
    owner = body_owner(actor)
    namespace = vars(sys.modules[owner.__module__])
    saver = namespace.get("torch_memory_saver")
    if isinstance(saver, PlanOwnedMemorySaver):  # asked again from inside a body (a refused nested call)
        saver = saver.saver
    calls: list[tuple[str, str]] = actor.__dict__.setdefault("_lifecycle_stand_in_calls", [])
    lifecycle = actor.lifecycle

    def record(name: str) -> None:
        calls.append((operation, name))

    def reload_process_groups() -> None:
        record("reload_process_groups")
        if lifecycle.groups is not Groups.ALIVE:
            raise IllegalTransitionError(
                f"{owner.__name__}'s {operation} body needs the process groups, but they are "
                f"{lifecycle.groups}: under the lifecycle the {operation} plan brings them up; this body's "
                "own reload_process_groups() is not run",
                state=lifecycle.state,
                operation=f"{operation}: reload_process_groups",
                allowed=(),
            )

    def destroy_process_groups() -> None:
        record("destroy_process_groups")  # the exit plan destroys what the enter plan brought up

    return {
        "torch_memory_saver": PlanOwnedMemorySaver(saver, lifecycle, operation, record, on_pause),
        "reload_process_groups": reload_process_groups,
        "destroy_process_groups": destroy_process_groups,
    }


def stand_in_calls(actor: LifecycleMixin) -> list[tuple[str, str]]:
    """(operation, name) of every resource call a body made that the plans owned, oldest first."""
    return list(actor.__dict__.get("_lifecycle_stand_in_calls", []))


class PlanOwnedMemorySaver:
    """`torch_memory_saver` as a framework's bodies see it under the lifecycle; other attributes are the real one's."""

    def __init__(
        self,
        saver: Any,
        lifecycle: Lifecycle,
        operation: str,
        record: Callable[[str], None],
        on_pause: Callable[[str | None], bool] | None = None,
    ) -> None:
        self.saver = saver
        self._lifecycle = lifecycle
        self._operation = operation
        self._record = record
        self._on_pause = on_pause

    def disable(self) -> contextlib.AbstractContextManager[Any]:
        self._record("torch_memory_saver.disable")
        if self._operation == "sync":
            return contextlib.nullcontext()  # the sync plan runs the body under memory.disable() already
        return self._lifecycle.hooks.memory.disable()

    def pause(self, tag: str | None = None) -> None:
        if self._on_pause is not None and self._on_pause(tag):
            self._record(f"torch_memory_saver.pause({tag})")
            return
        self._refuse("pause", tag)

    def resume(self, tag: str | None = None) -> None:
        self._refuse("resume", tag)

    def _refuse(self, method: str, tag: str | None) -> None:
        self._record(f"torch_memory_saver.{method}")
        raise IllegalTransitionError(
            f"the {self._operation} body called torch_memory_saver.{method}({'' if tag is None else repr(tag)}) in "
            f"state {self._lifecycle.state}: under the lifecycle the sleep and wake plans own pause and resume, and "
            "a second owner would pause a paused tag (torch_memory_saver exits). Call self.sleep()/self.wake_up() "
            "instead.",
            state=self._lifecycle.state,
            operation=f"{self._operation}: torch_memory_saver.{method}",
            allowed=(),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.saver, name)


def body_owner(actor: LifecycleMixin) -> type:
    """The class whose `update_weights` body runs under the sync operation (the framework's actor class)."""
    return actor._super_method("update_weights")[1]


def pipeline_parallel_size() -> int:
    """Megatron's pipeline-parallel size, 1 when Megatron is absent or not initialised."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 1
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_pipeline_model_parallel_world_size())

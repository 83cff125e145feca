"""The routing-replay hook: clear MoE routing-replay caches before memory is released.

slime records each MoE layer's routed experts per step (`RoutingReplay.record`) and clears every
layer's cache with the static `RoutingReplay.clear_all()`; the sleep plan calls it before the pause.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

__all__ = ["RoutingReplayCache", "RoutingReplayClear"]


class RoutingReplayClear:
    """`routing_replay()` for a Lifecycle: calls `clear_all()` on `target`, or on each of an iterable of them.

    `target` is slime's `RoutingReplay` class (or anything with `clear_all()`), or an iterable of such.
    """

    def __init__(self, target: Any) -> None:
        if callable(getattr(target, "clear_all", None)):
            targets: tuple[Any, ...] = (target,)
        elif isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
            targets = tuple(target)
            lacking = [t for t in targets if not callable(getattr(t, "clear_all", None))]
            if lacking:
                raise TypeError(
                    f"RoutingReplayClear: {[type(t).__name__ for t in lacking]} have no clear_all(); pass "
                    "slime's RoutingReplay class or objects with clear_all()"
                )
            if not targets:
                raise ValueError(
                    "RoutingReplayClear: the iterable of targets is empty; nothing would be cleared"
                )
        else:
            raise TypeError(
                f"RoutingReplayClear needs an object with clear_all() (slime's RoutingReplay) or an iterable "
                f"of them, got {type(target).__name__}"
            )
        self.targets = targets

    def __call__(self) -> None:
        for target in self.targets:
            target.clear_all()

    def __repr__(self) -> str:
        return f"RoutingReplayClear({[getattr(t, '__name__', type(t).__name__) for t in self.targets]})"


class RoutingReplayCache:
    """A reference routing-replay cache: one per MoE layer, `clear_all()` over every live instance (as slime)."""

    # Weak, unlike slime's list, so caches of discarded models do not live forever.
    _instances: ClassVar[weakref.WeakSet[RoutingReplayCache]] = weakref.WeakSet()

    def __init__(self, layer: int | None = None, *, pin_memory: bool | None = None) -> None:
        self.layer = layer
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.recorded: list[torch.Tensor] = []
        self.forward_index = 0
        RoutingReplayCache._instances.add(self)

    def record(self, top_indices: torch.Tensor) -> None:
        """Keep a host copy of this step's routed experts (pinned when CUDA is there, as slime)."""
        buffer = torch.empty_like(top_indices, device="cpu", pin_memory=self.pin_memory)
        buffer.copy_(top_indices)
        self.recorded.append(buffer)

    def pop_forward(self) -> torch.Tensor:
        """The next recorded routing, in record order."""
        if self.forward_index >= len(self.recorded):
            raise IndexError(
                f"routing replay of layer {self.layer}: {len(self.recorded)} steps recorded, "
                f"replay asked for step {self.forward_index + 1}"
            )
        top_indices = self.recorded[self.forward_index]
        self.forward_index += 1
        return top_indices

    def clear(self) -> None:
        """Drop the recorded routing and rewind to the first forward."""
        self.recorded = []
        self.forward_index = 0

    @classmethod
    def clear_all(cls) -> None:
        """Clear every live cache of this process."""
        for cache in list(cls._instances):
            cache.clear()

    @classmethod
    def instances(cls) -> list[RoutingReplayCache]:
        """The live caches of this process."""
        return list(cls._instances)

    def __len__(self) -> int:
        return len(self.recorded)

"""The machine's held scopes: no sleep runs while a hold is taken; the release of the last hold
sleeps the tags the calls inside would have left released without the scope."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lifecycle.logs import Event
from lifecycle.table import PolicyView, Residency, State, deferred_tags, unheld_residency


class HeldScope:
    """Holds taken (any thread), and the residency the calls made since the first hold would have
    left without a scope (`unheld`; None: no scope, or a failure dropped what it deferred).

    `emit` logs an info event of the machine (hold, release, deferred).
    """

    def __init__(self, view: PolicyView, emit: Callable[[str, dict[str, Any]], None]) -> None:
        self._view = view
        self._emit = emit
        self.holds = 0
        self.unheld: dict[str, Residency] | None = None

    def deferred(self, residency: Mapping[str, Residency]) -> tuple[str, ...]:
        """The tags whose sleep the scope deferred: the release of the last hold sleeps them."""
        return deferred_tags(residency, self.unheld)

    def take(self, state: State, residency: Mapping[str, Residency]) -> None:
        """Take a hold; the first opens the scope at the residency now."""
        self.holds += 1
        if self.holds == 1:
            self.unheld = dict(residency)
        self._emit(Event.HOLD, {"state": state, "holds": self.holds})

    def give_back(self, state: State, deferred: tuple[str, ...]) -> None:
        """Give a hold back (`deferred`: what its release slept, if it ran the sleep)."""
        self.holds -= 1
        if self.holds == 0:
            self.unheld = None
        self._emit(Event.RELEASE, {"state": state, "holds": self.holds, "deferred": list(deferred)})

    def track(
        self,
        operation: str,
        targets: tuple[str, ...],
        state: State,
        residency: Mapping[str, Residency],
        before: tuple[str, ...],
    ) -> None:
        """Inside a held scope, replay a finished operation on the rows outside one (no hooks);
        `before`: the deferred tags when it started."""
        if not self.holds or state is State.FAILED:
            return
        if operation == "recover" or self.unheld is None:
            self.unheld = dict(residency)  # after a failure the scope defers from here on
        else:
            self.unheld = unheld_residency(operation, targets, self._view, self.unheld)
        after = self.deferred(residency)
        if after != before:
            self._emit(
                Event.DEFERRED,
                {"operation": operation, "state": state, "targets": list(targets), "deferred": list(after)},
            )

    def drop(self) -> None:
        """A failure drops the deferred sleep: recover decides where the machine goes."""
        self.unheld = None

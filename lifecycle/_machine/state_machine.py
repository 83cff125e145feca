"""The `transitions` machine over the table's edges, and the object it drives."""

from __future__ import annotations

import logging

from transitions import Machine

from lifecycle.table import EDGES, FAIL_SOURCES, FAIL_TRIGGER, Edge, State

# `transitions` logs two INFO lines per state change ("Finished processing state ... callbacks"); a
# framework that sets its root logger to INFO (slime's configure_logger does) would print them for
# every hook plan. The machine's own events say the same with the hooks and durations.
_TRANSITIONS_LOGGER = logging.getLogger("transitions.core")
if _TRANSITIONS_LOGGER.level == logging.NOTSET:
    _TRANSITIONS_LOGGER.setLevel(logging.WARNING)


class _Model:
    """The object `transitions` drives; kept apart so its trigger methods don't crowd `Lifecycle`."""

    state: State


class StateMachine:
    """The state alone: `move` along one of the table's edges, `fail` into FAILED from any source."""

    def __init__(self, initial: State) -> None:
        self._model = _Model()
        machine = Machine(
            model=self._model,
            states=State,
            initial=initial,
            auto_transitions=False,
        )
        for edge in EDGES:
            machine.add_transition(edge.trigger, edge.source, edge.dest)
        for source in FAIL_SOURCES:
            machine.add_transition(FAIL_TRIGGER, source, State.FAILED)
        self._machine = machine
        self._moves = {edge: machine.events[edge.trigger].trigger for edge in EDGES}
        self._fail = machine.events[FAIL_TRIGGER].trigger

    @property
    def state(self) -> State:
        """The state `transitions` holds."""
        return self._model.state

    def move(self, edge: Edge) -> None:
        """Take `edge` (its source is the state now)."""
        self._moves[edge](self._model)

    def fail(self) -> None:
        """Enter FAILED."""
        self._fail(self._model)

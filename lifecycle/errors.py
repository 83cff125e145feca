"""The two errors the machine raises; each says what happened, in which state, and what to do."""

from __future__ import annotations

from collections.abc import Mapping

from lifecycle.table import Groups, Residency, State


class IllegalTransitionError(RuntimeError):
    """An operation was asked for in a state (or under a policy) where the table has no row for it."""

    def __init__(self, message: str, *, state: State, operation: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.state = state
        self.operation = operation
        self.allowed = allowed

    def __reduce__(self) -> tuple[object, ...]:
        # Ray ships exceptions between processes by pickling; keep the attributes.
        return (_rebuild_illegal, (str(self), self.state, self.operation, self.allowed))


def _rebuild_illegal(
    message: str, state: State, operation: str, allowed: tuple[str, ...]
) -> IllegalTransitionError:
    return IllegalTransitionError(message, state=state, operation=operation, allowed=allowed)


class LifecycleFailedError(RuntimeError):
    """The machine is FAILED: a hook raised, and only `recover(target=...)` is allowed."""

    def __init__(
        self,
        message: str,
        *,
        hook: str,
        operation: str,
        residency: Mapping[str, Residency],
        groups: Groups | None,
        error: str,
    ) -> None:
        super().__init__(message)
        self.hook = hook
        self.operation = operation
        self.residency = dict(residency)
        self.groups = groups
        self.error = error

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_failed,
            (str(self), self.hook, self.operation, self.residency, self.groups, self.error),
        )


def _rebuild_failed(
    message: str,
    hook: str,
    operation: str,
    residency: Mapping[str, Residency],
    groups: Groups | None,
    error: str,
) -> LifecycleFailedError:
    return LifecycleFailedError(
        message, hook=hook, operation=operation, residency=residency, groups=groups, error=error
    )

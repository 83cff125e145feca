"""The core's errors: the root `LifecycleError`, the machine's refusals and failures, the checker's.

Every error of the library derives from `LifecycleError`, the adapters' too (those live beside the
adapters, in `actor_integration.errors`), and each keeps the built-in base callers already catch
(`RuntimeError`, `ValueError`, `TimeoutError`, `KeyError`, `AssertionError`, `TypeError`).
Structured fields are keyword arguments, kept as attributes and in `.fields`; one pickling scheme
carries them across processes (Ray and torch.multiprocessing ship exceptions by pickling). Wherever
ranks or parties did not answer in time, the field is `missing`. Each message says what happened,
in which state, and what to do next.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from lifecycle.table import Groups, Residency, State

__all__ = [
    "IllegalTransitionError",
    "InjectedFault",
    "InvalidWeightsError",
    "LifecycleError",
    "LifecycleFailedError",
    "LifecycleNotConfiguredError",
    "LogFieldError",
    "MemoryBudgetShortError",
    "ProtocolViolation",
]


class LifecycleError(Exception):
    """The root of this library's errors; `fields` holds the structured details."""

    fields: dict[str, Any]

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), self.fields))


def _rebuild(cls: type[LifecycleError], message: str, fields: dict[str, Any]) -> LifecycleError:
    # Past the subclass's own __init__: `fields` already holds everything it was built with.
    error = cls.__new__(cls)
    LifecycleError.__init__(error, message, **fields)
    return error


# ---------------------------------------------------------------------------------------------- the machine


class IllegalTransitionError(LifecycleError, RuntimeError):
    """An operation was asked for in a state (or under a policy) where the table has no row for it."""

    state: State
    operation: str
    allowed: tuple[str, ...]

    def __init__(self, message: str, *, state: State, operation: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message, state=state, operation=operation, allowed=tuple(allowed))


class InvalidWeightsError(IllegalTransitionError):
    """An operation that reads the weights was refused: their contents are not valid, or older than required.

    `tags` maps each weight tag that is not valid to its contents ("discarded", "unknown");
    `weight_version` is the version loaded (None: unknown); `required_version` what the caller
    asked for; `fix` the call that makes the weights servable again.
    """

    tags: dict[str, str]
    weight_version: int | None
    required_version: int | None
    fix: str

    def __init__(
        self,
        message: str,
        *,
        state: State,
        operation: str,
        allowed: tuple[str, ...],
        tags: Mapping[str, str],
        weight_version: int | None,
        required_version: int | None,
        fix: str,
    ) -> None:
        LifecycleError.__init__(
            self,
            message,
            state=state,
            operation=operation,
            allowed=tuple(allowed),
            tags=dict(tags),
            weight_version=weight_version,
            required_version=required_version,
            fix=fix,
        )


class LifecycleFailedError(LifecycleError, RuntimeError):
    """The machine is FAILED: a hook raised, and only `recover(target=...)` is allowed."""

    hook: str
    operation: str
    residency: dict[str, Residency]
    groups: Groups | None
    error: str

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
        super().__init__(
            message, hook=hook, operation=operation, residency=dict(residency), groups=groups, error=error
        )


class MemoryBudgetShortError(LifecycleError, RuntimeError):
    """After a sleep under a memory budget, less is free than the next phase declared it needs.

    Raised before the other phase's wake (which would otherwise run out of memory inside the
    engine): the machine is FAILED, `recover(State.PAUSED)` releases what is still resident.
    """

    short_bytes: int
    need_bytes: int
    free_bytes: int
    resident: tuple[str, ...]
    groups: Groups | None

    def __init__(
        self,
        message: str,
        *,
        short_bytes: int,
        need_bytes: int,
        free_bytes: int,
        resident: tuple[str, ...],
        groups: Groups | None,
    ) -> None:
        super().__init__(
            message,
            short_bytes=short_bytes,
            need_bytes=need_bytes,
            free_bytes=free_bytes,
            resident=tuple(resident),
            groups=groups,
        )


class LifecycleNotConfiguredError(LifecycleError, RuntimeError):
    """A wrapped method ran before `configure_lifecycle(...)`."""


class ProtocolViolation(LifecycleError, AssertionError):
    """A backend was used in a way the real one would crash on (torch_memory_saver: exit(1))."""


class InjectedFault(LifecycleError, RuntimeError):
    """Raised where a `FaultInjector` was armed (tests, `lifecycle demo --inject-fault`)."""


class LogFieldError(LifecycleError, ValueError):
    """A field of a log line cannot be read; the checker reports it as a finding for that line."""


# 0.1 defined the adapters' errors here; their old names still resolve for one release (0.2 removes
# them). The core names no adapter module: the distribution declares where the moved classes live
# (the `rl_lifecycle.moved_errors` entry point, pyproject.toml), and a name is looked up there on use.
MOVED_TO_ADAPTERS = frozenset(
    {
        "CorruptBucketError",
        "DeadActorsError",
        "EngineDiedError",
        "EngineNotIdleError",
        "GroupCallError",
        "GroupTimeoutError",
        "InconsistentGroupError",
        "MemorySaverConfigError",
        "MemoryStateError",
        "NcclError",
        "ProcessGroupsAsleepError",
        "RendezvousMismatchError",
        "RendezvousTimeoutError",
        "SGLangServerError",
        "SGLangServerTimeout",
        "StaleVersionError",
        "UnknownModelTagError",
        "WeightMismatchError",
        "WeightSyncError",
        "WeightSyncTimeout",
    }
)
MOVED_ERRORS_ENTRY_POINT = "rl_lifecycle.moved_errors"


def moved_error(module: str, name: str) -> Any:
    """An adapter error asked for under its 0.1 name: the class itself, with a DeprecationWarning."""
    if name not in MOVED_TO_ADAPTERS:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    for entry in metadata.entry_points(group=MOVED_ERRORS_ENTRY_POINT):
        where = entry.load()
        if isinstance(getattr(where, name, None), type):
            warnings.warn(
                f"{module}.{name} moved to {where.__name__}.{name}; import it from there "
                "(the old name goes in 0.2)",
                DeprecationWarning,
                stacklevel=3,
            )
            return getattr(where, name)
    raise AttributeError(
        f"{module}.{name} moved to the adapters' errors module, and no installed distribution says "
        f"where (entry point {MOVED_ERRORS_ENTRY_POINT!r}): import it from actor_integration.errors, "
        "or install rl-lifecycle (pip install -e . in a checkout)"
    )


def __getattr__(name: str) -> Any:
    return moved_error(__name__, name)

"""Every error the library raises, in one module (as structlog does, to avoid import loops).

All derive from `LifecycleError`, and each keeps the built-in base callers already catch
(`RuntimeError`, `ValueError`, `TimeoutError`, `KeyError`, `AssertionError`). Structured fields
are keyword arguments, kept as attributes and in `.fields`; one pickling scheme carries them
across processes (Ray and torch.multiprocessing ship exceptions by pickling). Wherever ranks or
parties did not answer in time, the field is `missing`. Each message says what happened, in which
state, and what to do next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lifecycle.table import Groups, Residency, State

__all__ = [
    "CorruptBucketError",
    "CrossNodeTransportError",
    "DeadActorsError",
    "EngineDiedError",
    "EngineNotIdleError",
    "GroupCallError",
    "GroupTimeoutError",
    "IllegalTransitionError",
    "InconsistentGroupError",
    "InjectedFault",
    "InvalidWeightsError",
    "LifecycleError",
    "LifecycleFailedError",
    "LifecycleNotConfiguredError",
    "LogFieldError",
    "MemorySaverConfigError",
    "MemoryStateError",
    "NcclError",
    "NodeLostError",
    "PeersLostError",
    "PlacementError",
    "ProcessGroupsAsleepError",
    "ProtocolViolation",
    "RendezvousMismatchError",
    "RendezvousTimeoutError",
    "SGLangServerError",
    "SGLangServerTimeout",
    "StaleVersionError",
    "UnknownModelTagError",
    "WeightMismatchError",
    "WeightSyncError",
    "WeightSyncTimeout",
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


class LifecycleNotConfiguredError(LifecycleError, RuntimeError):
    """A wrapped method ran before `configure_lifecycle(...)`."""


class ProtocolViolation(LifecycleError, AssertionError):
    """A backend was used in a way the real one would crash on (torch_memory_saver: exit(1))."""


class InjectedFault(LifecycleError, RuntimeError):
    """Raised where a `FaultInjector` was armed (tests, `lifecycle demo --inject-fault`)."""


class LogFieldError(LifecycleError, ValueError):
    """A field of a log line cannot be read; the checker reports it as a finding for that line."""


# ---------------------------------------------------------------------------------------------- memory


class MemorySaverConfigError(LifecycleError, ValueError):
    """A configuration torch_memory_saver would exit(1) on (or silently misread) later."""


class MemoryStateError(LifecycleError, RuntimeError):
    """A pause/resume/region call that torch_memory_saver would answer with exit(1)."""


class UnknownModelTagError(LifecycleError, KeyError):
    """No weight backup was taken under this model tag."""

    def __str__(self) -> str:
        # KeyError quotes its message; this one is a sentence.
        return str(self.args[0]) if self.args else ""


class WeightMismatchError(LifecycleError, ValueError):
    """The tensors given do not match the backup of a model tag (names, shapes or dtypes)."""


# ---------------------------------------------------------------------------------------------- ranks


class RendezvousTimeoutError(LifecycleError, TimeoutError):
    """Some ranks did not reach a meeting point before its deadline."""

    what: str
    missing: tuple[int, ...]
    waited_s: float

    def __init__(self, message: str, *, what: str, missing: Sequence[int], waited_s: float) -> None:
        super().__init__(message, what=what, missing=tuple(missing), waited_s=waited_s)


class RendezvousMismatchError(LifecycleError, RuntimeError):
    """Ranks met, but were doing different things (e.g. different new_group arguments)."""

    what: str
    other_rank: int
    other_what: str

    def __init__(self, message: str, *, what: str, other_rank: int, other_what: str) -> None:
        super().__init__(message, what=what, other_rank=other_rank, other_what=other_what)


class ProcessGroupsAsleepError(LifecycleError, RuntimeError):
    """A group was asked for (a collective, `new_group`, `connect`) while the process groups sleep.

    `state` is how they sleep: "destroyed", "suspended" or "kept" (`Groups`); `operation` what
    was asked; `group` the group's name, when one was named. A collective on a suspended NCCL
    communicator would read unmapped memory, so it is refused here, before it reaches NCCL.
    """

    state: str
    operation: str
    group: str | None

    def __init__(self, message: str, *, state: str, operation: str, group: str | None = None) -> None:
        super().__init__(message, state=state, operation=operation, group=group)


class NcclError(LifecycleError, RuntimeError):
    """An NCCL call (`call`) returned an error code (`code`; None: it could not be made), or a
    communicator cannot be reached; the message has NCCL's own words and the loaded version."""

    call: str
    code: int | None

    def __init__(self, message: str, *, call: str, code: int | None = None) -> None:
        super().__init__(message, call=call, code=code)


class GroupTimeoutError(LifecycleError, TimeoutError):
    """Some actors of a `LifecycleGroup` did not answer within the deadline."""

    operation: str
    missing: list[int]
    waited_s: float

    def __init__(self, message: str, *, operation: str, missing: list[int], waited_s: float) -> None:
        super().__init__(message, operation=operation, missing=list(missing), waited_s=waited_s)


class DeadActorsError(LifecycleError, RuntimeError):
    """Some actors are dead; `.dead` maps each rank to its last known lifecycle state (or None)."""

    dead: dict[int, dict[str, Any] | None]

    def __init__(self, message: str, *, dead: dict[int, dict[str, Any] | None]) -> None:
        super().__init__(message, dead=dead)


class NodeLostError(DeadActorsError):
    """A Ray node died under a group: its actors are gone with it. Fields: `nodes` (node id → how
    the node was known), `lost` (role → the ranks that were on those nodes), `survivors` (role →
    rank → the state each surviving actor ended in), `operation` (what was running), `waited_s`
    (from the call to the verdict), and `dead` (rank → last known state, as `DeadActorsError`)."""

    nodes: dict[str, str]
    lost: dict[str, list[int]]
    survivors: dict[str, dict[int, str]]
    operation: str
    waited_s: float

    def __init__(
        self,
        message: str,
        *,
        nodes: Mapping[str, str],
        lost: Mapping[str, Sequence[int]],
        survivors: Mapping[str, Mapping[int, str]],
        operation: str,
        waited_s: float,
        dead: dict[int, dict[str, Any] | None],
    ) -> None:
        LifecycleError.__init__(
            self,
            message,
            nodes=dict(nodes),
            lost={role: list(ranks) for role, ranks in lost.items()},
            survivors={role: dict(states) for role, states in survivors.items()},
            operation=operation,
            waited_s=waited_s,
            dead=dead,
        )


class PeersLostError(LifecycleError, RuntimeError):
    """A wait among ranks was given up because the driver said some of them are lost with their
    node (`LifecycleGroup` found it dead): no teardown waits out its deadline on a dead peer.
    Fields: `what` (the meeting), `lost` (the ranks), `reason`."""

    what: str
    lost: tuple[int, ...]
    reason: str

    def __init__(self, message: str, *, what: str, lost: Sequence[int], reason: str) -> None:
        super().__init__(message, what=what, lost=tuple(lost), reason=reason)


class GroupCallError(LifecycleError, RuntimeError):
    """The call raised on some actors; `.errors` maps each rank to its exception."""

    operation: str
    errors: dict[int, BaseException]

    def __init__(self, message: str, *, operation: str, errors: dict[int, BaseException]) -> None:
        super().__init__(message, operation=operation, errors=errors)


class InconsistentGroupError(LifecycleError, RuntimeError):
    """Actors disagree on state or residency; `.groups` maps each distinct view to its ranks."""

    groups: dict[str, list[int]]

    def __init__(self, message: str, *, groups: dict[str, list[int]]) -> None:
        super().__init__(message, groups=groups)


# ---------------------------------------------------------------------------------------------- placement


class PlacementError(LifecycleError, ValueError):
    """Trainer ranks and rollout engines are not where colocation needs them: a slot whose engine
    runs on one node spans several, or an engine rank is not on its trainer rank's GPU. Fields:
    slot, engine, ranks (the slot's), nodes (node → the slot's ranks there)."""


class CrossNodeTransportError(PlacementError):
    """A weight transport that only works within one host (cuda_ipc, shm) was asked for between
    two nodes; refused before anything is exported. Fields: requested, sender_node, receiver_node."""


# ---------------------------------------------------------------------------------------------- weight sync


class WeightSyncError(LifecycleError, RuntimeError):
    """A weight update failed; the fields (slot, version, ...) say which one."""


class WeightSyncTimeout(WeightSyncError):
    """A cross-process wait of a weight update passed its deadline. Fields: slot, version, awaited,
    waiting_rank, missing (the ranks or party that did not answer), waited_s, cause."""


class StaleVersionError(WeightSyncError):
    """The engine refused a version that is not newer than the one it has loaded."""


class CorruptBucketError(WeightSyncError):
    """A received bucket is truncated or fails its checksum. Nothing of the round was loaded,
    unless `written` is true (a receiver that checks while it writes, `keep_previous=False`)."""


# ---------------------------------------------------------------------------------------------- rollout


class EngineNotIdleError(LifecycleError, RuntimeError):
    """The engine still had requests after pausing generation; its memory was not released."""


class EngineDiedError(LifecycleError, RuntimeError):
    """A process of the rollout engine exited (SGLang's scheduler or detokenizer): the engine can
    neither serve nor release memory any more. Fields: process (its name), pid, exitcode (None
    when unknown), call (what the adapter was doing), waited_s."""


class SGLangServerError(LifecycleError, RuntimeError):
    """An SGLang server refused a request (`status`, SGLang's text in `answer`) or could not be
    reached (`status` None). Fields: method, path, status, answer."""


class SGLangServerTimeout(LifecycleError, TimeoutError):
    """An SGLang server did not answer a request in time. Fields: method, path, timeout_s, and
    `missing` (the server's URL: who did not answer, as in every timeout of this library)."""

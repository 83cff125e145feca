"""Lifecycle state machine for colocated RL actors (pure core: no torch, no Ray).

    from lifecycle import Lifecycle, LifecyclePolicy, State

The transition table in `lifecycle.table` is the single source of truth; the machine, the
diagrams and the log checker are derived from it.

Here: the machine (`Lifecycle`, `LifecyclePolicy`, `Hooks` and the backend Protocols), the table's
names (`State`, `Residency`, `Groups`, `Contents`, `Hook`, `Communicators`, `ALL_TAGS`), the logging
set-up (`configure_logging`, `configure_rank_log`, `flush_logs`, `capture_events`) and every error of the library (under
`LifecycleError`). Beside them: `lifecycle.checker` and `lifecycle.timeline` (what `lifecycle check`
and `lifecycle timeline` run), `lifecycle.testing` (fakes for users' tests), `lifecycle.faults`,
`lifecycle.diagram` and `lifecycle.modelcheck`.
"""

from importlib import metadata as _metadata

from lifecycle.errors import (
    CorruptBucketError,
    CrossNodeTransportError,
    DeadActorsError,
    EngineDiedError,
    EngineNotIdleError,
    GroupCallError,
    GroupTimeoutError,
    IllegalTransitionError,
    InconsistentGroupError,
    InjectedFault,
    InvalidWeightsError,
    LifecycleError,
    LifecycleFailedError,
    LifecycleNotConfiguredError,
    LogFieldError,
    MemorySaverConfigError,
    MemoryStateError,
    NcclError,
    NodeLostError,
    PeersLostError,
    PlacementError,
    ProcessGroupsAsleepError,
    ProtocolViolation,
    RendezvousMismatchError,
    RendezvousTimeoutError,
    SGLangServerError,
    SGLangServerTimeout,
    StaleVersionError,
    UnknownModelTagError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
)
from lifecycle.events import capture_events, configure_logging, configure_rank_log, flush_logs
from lifecycle.hooks import EventSink, GenerationBackend, Hooks, MemoryBackend, ProcessGroupsBackend
from lifecycle.machine import Failure, Lifecycle
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import ALL_TAGS, Communicators, Contents, Groups, Hook, Residency, State

try:
    __version__ = _metadata.version("rl-lifecycle")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ALL_TAGS",
    "Communicators",
    "Contents",
    "CorruptBucketError",
    "CrossNodeTransportError",
    "DeadActorsError",
    "EngineDiedError",
    "EngineNotIdleError",
    "EventSink",
    "Failure",
    "GenerationBackend",
    "GroupCallError",
    "GroupTimeoutError",
    "Groups",
    "Hook",
    "Hooks",
    "IllegalTransitionError",
    "InconsistentGroupError",
    "InjectedFault",
    "InvalidWeightsError",
    "Lifecycle",
    "LifecycleError",
    "LifecycleFailedError",
    "LifecycleNotConfiguredError",
    "LifecyclePolicy",
    "LogFieldError",
    "MemoryBackend",
    "MemorySaverConfigError",
    "MemoryStateError",
    "NcclError",
    "NodeLostError",
    "PeersLostError",
    "PlacementError",
    "ProcessGroupsAsleepError",
    "ProcessGroupsBackend",
    "ProtocolViolation",
    "RendezvousMismatchError",
    "RendezvousTimeoutError",
    "Residency",
    "SGLangServerError",
    "SGLangServerTimeout",
    "StaleVersionError",
    "State",
    "UnknownModelTagError",
    "WeightMismatchError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "capture_events",
    "configure_logging",
    "configure_rank_log",
    "flush_logs",
]

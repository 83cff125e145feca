"""Lifecycle state machine for colocated RL actors (pure core: no torch, no Ray).

    from lifecycle import Lifecycle, LifecyclePolicy, State

The transition table in `lifecycle.table` is the single source of truth; the machine, the
diagrams and the log checker are derived from it.

Here: the machine (`Lifecycle`, `LifecyclePolicy`, `Hooks` and the backend Protocols), the table's
names (`State`, `Residency`, `Groups`, `Contents`, `Hook`, `Communicators`, `ALL_TAGS`), the logging
set-up (`configure_logging`, `configure_rank_log`, `flush_logs`, `capture_events`) and the core's errors (under `LifecycleError`,
the root of every error of the library; the adapters' are in `actor_integration.errors`). Beside them: `lifecycle.checker` and `lifecycle.timeline` (what `lifecycle check`
and `lifecycle timeline` run), `lifecycle.testing` (fakes for users' tests), `lifecycle.faults`,
`lifecycle.diagram` and `lifecycle.modelcheck`.
"""

from importlib import metadata as _metadata
from typing import Any as _Any

from lifecycle.budget import MemoryBudget
from lifecycle.errors import (
    IllegalTransitionError,
    InjectedFault,
    InvalidWeightsError,
    LifecycleError,
    LifecycleFailedError,
    LifecycleNotConfiguredError,
    LogFieldError,
    MemoryBudgetShortError,
    ProtocolViolation,
)
from lifecycle.errors import moved_error as _moved_error
from lifecycle.events import capture_events, configure_logging, configure_rank_log, flush_logs
from lifecycle.hooks import (
    EventSink,
    GenerationBackend,
    Hooks,
    MemoryBackend,
    MemoryProbe,
    ProcessGroupsBackend,
)
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
    "EventSink",
    "Failure",
    "GenerationBackend",
    "Groups",
    "Hook",
    "Hooks",
    "IllegalTransitionError",
    "InjectedFault",
    "InvalidWeightsError",
    "Lifecycle",
    "LifecycleError",
    "LifecycleFailedError",
    "LifecycleNotConfiguredError",
    "LifecyclePolicy",
    "LogFieldError",
    "MemoryBackend",
    "MemoryBudget",
    "MemoryBudgetShortError",
    "MemoryProbe",
    "ProcessGroupsBackend",
    "ProtocolViolation",
    "Residency",
    "State",
    "capture_events",
    "configure_logging",
    "configure_rank_log",
    "flush_logs",
]


def __getattr__(name: str) -> _Any:
    """0.1's names of the adapters' errors (`lifecycle.CorruptBucketError`), for one release."""
    return _moved_error(__name__, name)

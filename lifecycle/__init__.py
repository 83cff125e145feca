"""Lifecycle state machine for colocated RL actors (pure core: no torch, no Ray).

    from lifecycle import Lifecycle, LifecyclePolicy, State

The transition table in `lifecycle.table` is the single source of truth; the machine, the
diagrams and the log checker are derived from it.
"""

from lifecycle.errors import IllegalTransitionError, InvalidWeightsError, LifecycleError, LifecycleFailedError
from lifecycle.events import capture_events, configure_logging, flush_logs
from lifecycle.hooks import EventSink, GenerationBackend, Hooks, MemoryBackend, ProcessGroupsBackend
from lifecycle.machine import Failure, Lifecycle
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import ALL_TAGS, Communicators, Contents, Groups, Hook, Residency, State

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
    "InvalidWeightsError",
    "Lifecycle",
    "LifecycleError",
    "LifecycleFailedError",
    "LifecyclePolicy",
    "MemoryBackend",
    "ProcessGroupsBackend",
    "Residency",
    "State",
    "capture_events",
    "configure_logging",
    "flush_logs",
]

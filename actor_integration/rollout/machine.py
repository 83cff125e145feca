"""The rollout's machine, built in one place, and its `weight_sync.loaded` event, written in one place.

`RolloutActor` (an engine in the actor's process) and `ServerActorLifecycle` (a framework's
engine-server actor) both build their `Lifecycle` with `rollout_lifecycle` and log a version's
load with `log_loaded`, so the role, the per-rank log and the event's fields (which `lifecycle
check`, the demo report and the GPU tests read) are the same for every engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.events import configure_rank_log
from lifecycle.logs import Event

__all__ = ["ROLE", "log_loaded", "rollout_lifecycle"]

ROLE = "rollout"


def rollout_lifecycle(
    policy: LifecyclePolicy,
    hooks: Hooks,
    *,
    rank: int | None,
    log_dir: str | None = None,
    initial: State = State.AWAKE,
    weight_version: int | None = None,
) -> Lifecycle:
    """The rank's log configured (before the machine's first event), then its machine."""
    configure_rank_log(ROLE, rank, log_dir=log_dir)
    return Lifecycle(policy, hooks, role=ROLE, rank=rank, initial=initial, weight_version=weight_version)


def log_loaded(
    event: Callable[..., None],
    *,
    version: Any,
    nbytes: int,
    transport: str,
    ok: bool,
    **fields: Any,
) -> None:
    """`weight_sync.loaded` through `event` (a machine's `event`, or the wrap's): a whole version
    loaded (`ok`, level info), or a round refused or found wrong (level error); `nbytes`: the
    version's bytes loaded so far. `fields`: checksum_ok, digest_ok, duration_ms, written, buckets,
    engine_ms."""
    event(
        Event.SYNC_LOADED,
        "info" if ok else "error",
        version=version,
        bytes=nbytes,
        transport=transport,
        ok=ok,
        **fields,
    )

"""Choosing a way of treating the communicators (`communicators=`), and saying why it runs.

One place for every host (`ReloadableProcessGroups`, a framework's `RegistryProcessGroups`): the
unit a name stands for, checked once against the backend (the suspend probe runs here, once per
host), and the groups' events (`WayLog`), whose first teardown says why the way runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from actor_integration.backends.process_groups import _nccl
from actor_integration.backends.process_groups._destroy import DestroyCommunicators
from actor_integration.backends.process_groups._keep import KeepCommunicators
from actor_integration.backends.process_groups._suspend import SuspendCommunicators
from actor_integration.backends.process_groups._way import CommunicatorWay, Outcome
from lifecycle import events
from lifecycle.logs import Event
from lifecycle.table import Communicators


def choose_way(communicators: Communicators | str, backend: str) -> CommunicatorWay:
    """The unit for the chosen way, after it checked it can work with `backend` here."""
    try:
        chosen = Communicators(communicators)
    except ValueError:
        raise ValueError(
            f"communicators must be one of {[c.value for c in Communicators]} (what sleep does to the NCCL "
            f"communicators), got {communicators!r}"
        ) from None
    way: CommunicatorWay
    if chosen is Communicators.SUSPEND:
        way = SuspendCommunicators()
    elif chosen is Communicators.KEEP:
        way = KeepCommunicators()
    else:
        way = DestroyCommunicators()
    way.check(backend)
    return way


def choose_ways(
    configured: CommunicatorWay, ways: Sequence[Communicators | str] | None, backend: str
) -> dict[str, CommunicatorWay]:
    """The units a memory budget may choose among per sleep, by name, the `configured` one first;
    each other one checked like it (suspend refused where NCCL cannot suspend). None: it alone."""
    units: dict[str, CommunicatorWay] = {configured.name.value: configured}
    if ways is None:
        return units
    if isinstance(ways, str):
        raise ValueError(f"ways must be a sequence of ways, such as ('destroy', 'suspend'), got {ways!r}")
    names = []
    for way in ways:
        try:
            names.append(Communicators(way).value)
        except ValueError:
            raise ValueError(
                f"ways must name ways of {[c.value for c in Communicators]}, got {way!r} in {list(ways)}"
            ) from None
    if configured.name.value not in names:
        raise ValueError(
            f"ways={names} must include the configured communicators={configured.name.value!r} (the full sleep's way)"
        )
    if Communicators.KEEP.value in names and len(set(names)) > 1:
        raise ValueError(
            f"ways={names}: a memory budget chooses among 'destroy' and 'suspend'; keeping the communicators "
            "is always its own choice, not a way to offer"
        )
    for name in names:
        if name not in units:
            units[name] = choose_way(name, backend)
    return units


def why_this_way(way: CommunicatorWay, backend: str) -> str:
    """Why `way` runs here, for the first sleep's event."""
    if isinstance(way, SuspendCommunicators) and way.support is not None:
        return f"communicators='suspend' (opt-in): {way.support.reason}"
    if isinstance(way, KeepCommunicators):
        return "communicators='keep' (opt-in): nothing is freed; the communicators' memory stays held"
    if "nccl" not in backend:
        return "no NCCL groups"
    return (
        "communicators='destroy' (default): the fastest measured way that frees the memory "
        f"(suspend is opt-in; here: {_nccl.nccl_suspend_support(backend).reason})"
    )


class WayLog:
    """A host's `process_groups.destroyed` / `.reloaded` events. The first teardown says at info which
    way ran and why; later ones at debug (the Lifecycle already logs each hook's duration at info),
    unless a group fell back: a warning, every time. No "rank"/"role" keys: those name a lifecycle
    machine to the checker and the timeline, and a host is not one."""

    def __init__(self) -> None:
        self.announced = False

    def emit(
        self,
        event: str,
        t0: float,
        outcome: Outcome,
        *,
        way: CommunicatorWay,
        backend: str,
        fields: Callable[[], dict[str, Any]],
        lost_groups: tuple[str, ...] = (),
    ) -> None:
        """Log `event` for a teardown or rebuild that began at `t0` (`time.perf_counter()`)."""
        first = event == Event.GROUPS_DESTROYED and not self.announced
        level = "warning" if outcome.fell_back else "info" if first else "debug"
        self.announced = self.announced or first
        if not events.enabled(events.LEVELS[level]):
            return
        record = {
            **fields(),
            "duration_ms": round((time.perf_counter() - t0) * 1e3, 3),
            **outcome.fields(),
        }
        if first:
            record["why"] = why_this_way(way, backend)
        if lost_groups:
            record["lost_groups"] = list(lost_groups)
        events.emit(level, event, record)

"""Checks of the weight-sync events in lifecycle logs, per actor and across the ranks of a slot.

Per actor: `weight_sync.update` (a trainer rank sent a version) and `weight_sync.loaded` (an
engine loaded one) happen inside the sync body (SYNCING), versions increase (the same version
again only as the retry of a failed one), and a load whose written weights differ from what was
sent (`digest_ok` false) is a finding. Across ranks, every rank of a slot reports each
version, exactly one rank coordinates and it is the slot's first rank, with one transport per
slot and version. `lifecycle.checker.LogChecker` feeds the events with the replayed state.

Only the ranks whose logs were read are expected to report: the log of one rank, checked alone,
gives no finding about the ranks it shares a slot with.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle import logs
from lifecycle._replay.state import Key, Report
from lifecycle.errors import LogFieldError
from lifecycle.logs import Event
from lifecycle.table import State

__all__ = ["WeightSyncChecks"]


@dataclass(frozen=True)
class _Update:
    path: str
    line: int
    rank: int | None
    role: str | None
    coordinator: bool
    ranks: tuple[int, ...]
    transport: str
    ok: bool


class WeightSyncChecks:
    """Collects the weight-sync events of many logs; `finish` runs the cross-rank checks."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._last: dict[tuple[Key, Event], tuple[int, int, bool]] = {}  # (version, line, ok)
        self._updates: dict[tuple[Any, int], list[_Update]] = collections.defaultdict(list)

    def event(self, event: Event, key: Key, state: State | None, line: int, d: Mapping[str, Any]) -> None:
        """One weight-sync event of the machine `key`; `state` is the replayed state (None: unknown)."""
        version = logs.integer(d, "version")
        ok = d.get("ok") is not False
        if event is Event.SYNC_UPDATE:
            self._update(key, line, version, ok, d)
        what = f"{event.value} (version {version})"
        if event is Event.SYNC_UPDATE:
            what = f"{event.value} (slot {d.get('slot')}, version {version})"
        if state is not None and state is not State.SYNCING:
            body = "updates run" if event is Event.SYNC_UPDATE else "the rollout loads"
            self._at(key, line, f"{what} logged in {state}; {body} inside the sync body (SYNCING)")
        if event is Event.SYNC_LOADED and d.get("digest_ok") is False:
            self._at(
                key,
                line,
                f"{what}: the engine's weights differ from what was sent (the digest of what was written, "
                f"read where it was written, against the senders' checksum; buckets {d.get('buckets')}): "
                "generation stays refused until a version loads whole",
            )
        previous = self._last.get((key, event))
        # The same version again is a retry, legal only after a failed attempt.
        if previous is not None and (version < previous[0] or (version == previous[0] and previous[2])):
            self._at(
                key,
                line,
                f"{event.value} version {version} does not increase (line {previous[1]} has version "
                f"{previous[0]})",
            )
        self._last[(key, event)] = (version, line, ok)

    def _at(self, key: Key, line: int, message: str) -> None:
        """Report one finding at a line of the machine `key`."""
        self._report(key[0], line, key[1], key[2], message)

    def finish(self, present: Collection[tuple[int | None, str | None]] | None = None) -> None:
        """Run the cross-rank checks; `present` is the (rank, role) of every actor whose log was read
        (None: every rank of a slot is expected to report)."""
        for (slot, version), updates in self._updates.items():
            self._check_slot(f"slot {slot} version {version}", updates, present)
        self._updates.clear()

    def _update(self, key: Key, line: int, version: int, ok: bool, d: Mapping[str, Any]) -> None:
        ranks = logs.get(d, "ranks")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            raise LogFieldError(f"ranks={ranks!r} is not a list of ranks")
        coordinator = logs.get(d, "coordinator")
        if not isinstance(coordinator, bool):
            raise LogFieldError(f"coordinator={coordinator!r} is not a bool")
        slot = d.get("slot")
        if isinstance(slot, (list, dict)):
            raise LogFieldError(f"slot={slot!r} is not a slot index")
        if slot is not None:  # a rank outside every slot sends to no engine: nothing to cross-check
            transport = str(logs.get(d, "transport"))
            self._updates[(slot, version)].append(
                _Update(key[0], line, key[1], key[2], coordinator, tuple(ranks), transport, ok)
            )

    def _check_slot(
        self, what: str, updates: list[_Update], present: Collection[tuple[int | None, str | None]] | None
    ) -> None:
        """One slot's reports of one version: same ranks, all of them, one coordinator, one transport."""
        coordinators = list({u.rank: u for u in updates if u.coordinator}.values())  # a retry is no second
        reference = next(
            (u for u in coordinators if u.ranks and u.rank == min(u.ranks)),
            coordinators[0] if coordinators else updates[0],
        )
        ranks = reference.ranks

        def report(u: _Update, message: str) -> None:
            self._report(u.path, u.line, u.rank, u.role, f"{what}: {message}")

        roles = {u.role for u in updates}

        def read(rank: int) -> bool:
            """Whether this rank's log was read (a rank not given cannot be missing from it)."""
            return present is None or any((rank, role) in present for role in roles)

        ok_reports: collections.Counter[int | None] = collections.Counter()
        for u in updates:
            if u.ranks != ranks:
                report(
                    u,
                    f"ranks {list(u.ranks)} differ from {list(ranks)} (line {reference.line} of {reference.path})",
                )
            if u.rank not in ranks:
                report(u, f"rank {u.rank} is not among the slot's ranks {list(ranks)}")
            if u.transport != reference.transport:
                report(
                    u,
                    f"transport {u.transport!r} differs from {reference.transport!r} of rank {reference.rank}; "
                    "a slot uses one transport per version",
                )
            ok_reports[u.rank] += u.ok
            if u.ok and ok_reports[u.rank] == 2:
                report(u, f"rank {u.rank} reported this update twice")
        # A failed version is already logged with its error; who did not report is part of it.
        if all(u.ok for u in updates):
            missing = [r for r in ranks if r not in ok_reports and read(r)]
            if missing:
                report(
                    reference,
                    f"ranks {missing} did not report weight_sync.update (the slot's ranks are {list(ranks)})",
                )
        if not ranks:
            return
        first = min(ranks)
        if not coordinators and read(first):
            report(reference, f"no rank coordinated; rank {first}, the slot's first rank, must")
        for u in coordinators:
            if u.rank != first:
                twice = (
                    " (two coordinators: the slot's engine is updated twice, vime #57)"
                    if len(coordinators) > 1
                    else ""
                )
                report(
                    u,
                    f"rank {u.rank} coordinated, but the coordinator is the slot's first rank {first}{twice}",
                )

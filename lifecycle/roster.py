"""The checker's "missing ranks" rule: which ranks a run had, and which of them its logs lose.

A run with a rank missing is not clean, however clean each file reads. The logs say so three ways:

- a role's events carry its `world_size` (bound into every event, as the demo's trainers and
  engines do), and some of its ranks `0 .. world_size-1` have no log here: their node was lost, or
  its disk was not gathered (`lifecycle gather`);
- a log ends inside an operation (a transition entered, never left nor failed): its process stopped
  in the middle of a call, killed or with its node;
- an actor logged `ranks.lost`: its driver found ranks gone with their node and told it.

Each is reported through the checker's `report(path, line, rank, role, message)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lifecycle.logs import Event

Report = Callable[[str, int, "int | None", "str | None", str], None]


class Roster:
    """Collects, from every event the checker reads, who was in the run and how each log ends."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._world: dict[str, dict[int, tuple[str, int]]] = {}  # role → world size → first (path, line)
        self._present: dict[str, set[int]] = {}  # role → ranks with a configured machine
        self._steps: dict[int, Any] = {}  # this file's lines → their step
        self._losses: dict[str, list[tuple[str, int, int, str]]] = {}  # what was lost → who was told where

    def note(self, path: str, line: int, event: Mapping[str, Any]) -> None:
        """One parsed event of `path` (any event, lifecycle or not)."""
        rank, role, size = event.get("rank"), event.get("role"), event.get("world_size")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(role, str):
            return
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self._world.setdefault(role, {}).setdefault(size, (path, line))
        name = event.get("event")
        self._steps[line] = event.get("step")
        if name == Event.CONFIGURED.value:
            self._present.setdefault(role, set()).add(rank)
        elif name == Event.RANKS_LOST.value:
            lost = event.get("lost")
            named = (
                "; ".join(f"{r} ranks {v}" for r, v in lost.items() if v)
                if isinstance(lost, Mapping)
                else lost
            )
            said = f"{named} lost ({event.get('reason')})"
            self._losses.setdefault(said, []).append((path, line, rank, role))

    def end_file(self, path: str, unfinished: Iterable[tuple[int | None, str | None, int, str]]) -> None:
        """The end of `path`; `unfinished`: (rank, role, line, operation) of each operation the
        replay still has open there (entered, not left): it stopped in the middle."""
        for rank, role, line, operation in sorted(unfinished, key=lambda u: u[2]):
            step = self._steps.get(line)
            at = f" of step {step}" if _is_int(step) else ""
            self._report(
                path,
                line,
                rank,
                role,
                f"the log ends inside {operation}{at}, entered here: the process stopped mid-operation "
                "(killed, or lost with its node) and what it did after is missing; a log read while its run "
                "is still going ends like this too",
            )
        self._steps.clear()

    def finish(self) -> None:
        """The run as a whole: each loss once (every survivor logged it), and every rank of each
        role's world size has a log."""
        for said, told in self._losses.items():
            path, line, rank, role = told[0]
            others = f" (and {len(told) - 1} other actor(s) were told)" if len(told) > 1 else ""
            self._report(
                path,
                line,
                rank,
                role,
                f"its driver found {said}{others}: the run could not go on without them, and what they would "
                "have done after this is missing",
            )
        for role, sizes in sorted(self._world.items()):
            if len(sizes) > 1:
                said = ", ".join(f"{size} ({path}:{line})" for size, (path, line) in sorted(sizes.items()))
                first_path = min(sizes.values())[0]
                self._report(first_path, 0, None, role, f"the {role} logs disagree on the world size: {said}")
            size = max(sizes)
            path, line = sizes[size]
            missing = sorted(set(range(size)) - self._present.get(role, set()))
            if missing:
                self._report(
                    path,
                    0,
                    None,
                    role,
                    f"{role} ranks {missing} of world size {size} (line {line}) have no log here: lost with "
                    "their node, or their node's logs were not gathered (`lifecycle gather`); the run is not "
                    "complete without them",
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

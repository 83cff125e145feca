"""An engine's own calls and the wrapped ones, timed side by side on one engine (tests only).

`alternate` runs a cycle of each in turn, the pair's first one alternating (own then wrapped, then
wrapped then own), so that a drift of the machine's speed, or a cost the first cycle of a pair pays
after the other's, falls on both alike; the last pair ends with the wrapped cycle, so that what
runs after finds the engine as the wrapped actor last left it. It keeps every cycle's figures
(`rows`) and gives the medians after the first cycle of each side (it warms connections), with the
wrapped-minus-own difference of the totals asked for. The GPU tests print the difference next to
its target, never assert it (timings on a shared machine).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["SIDES", "alternate"]

SIDES = ("own", "wrapped")


def alternate(
    own: Callable[[int], Mapping[str, float]],
    wrapped: Callable[[int], Mapping[str, float]],
    cycles: int,
    *,
    totals: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    """`cycles` of `own(i)` and of `wrapped(i)` in turn (each returns its phases in ms); `totals` names
    sums of phases (`{"sleep_wake_ms": ("release_ms", "resume_ms")}`), each cycle's sum taken before the
    median. The figures: `own` and `wrapped` (medians), `rows` (every cycle, in its order),
    `wrapped_minus_own_<total>` for each total, and `order`."""
    if cycles < 2:
        raise ValueError(
            f"alternate: cycles must be at least 2 (the first of each side is not counted), got {cycles}"
        )
    sides = {"own": own, "wrapped": wrapped}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
    order: list[str] = []
    for i in range(cycles):
        for name in SIDES if (cycles - 1 - i) % 2 == 0 else SIDES[::-1]:
            row = dict(sides[name](i))
            for total, parts in totals.items():
                missing = [p for p in parts if p not in row]
                if missing:
                    raise KeyError(
                        f"alternate: the {name} cycle gave no {missing} for {total!r}; it gave {sorted(row)}"
                    )
                row[total] = sum(row[p] for p in parts)
            rows[name].append(row)
            order.append(name)
    figures: dict[str, Any] = {"cycles": cycles}
    for name in SIDES:
        kept = rows[name][1:]
        figures[name] = {key: round(statistics.median(r[key] for r in kept), 3) for key in kept[0]}
    for total in totals:
        figures[f"wrapped_minus_own_{total}"] = round(figures["wrapped"][total] - figures["own"][total], 3)
    figures["rows"] = {name: [{k: round(v, 3) for k, v in r.items()} for r in rows[name]] for name in SIDES}
    figures["order"] = order
    return figures

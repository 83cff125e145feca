"""The demo's final table, computed from the per-rank lifecycle logs (the same files `check` reads)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lifecycle.logs import Event
from lifecycle.table import State
from lifecycle.timeline import read_lanes


def per_rank_rows(
    log_paths: Iterable[Path], checksums: Mapping[tuple[str, int], list[bool]]
) -> list[dict[str, Any]]:
    """One row per (role, rank): seconds in each state, transitions, bytes synced, GB/s, checksum results."""
    rows = []
    lanes = sorted(
        read_lanes(list(log_paths)), key=lambda lane: (lane.role != "trainer", lane.role, lane.rank)
    )
    for lane in lanes:
        seconds = dict.fromkeys(State, 0.0)
        for start, end, state in lane.states:
            seconds[state] += end - start
        transitions = sum(1 for span in lane.spans if span.cat == "transition")
        noops = sum(1 for mark in lane.marks if mark.kind == "noop")
        failures = sum(1 for mark in lane.marks if mark.kind == "failed")
        name = Event.SYNC_UPDATE if lane.role == "trainer" else Event.SYNC_LOADED
        synced = [
            m.args
            for m in lane.marks
            if m.kind == "weight_sync" and m.name.startswith(name) and m.args.get("ok", True)
        ]
        nbytes = sum(int(a.get("bytes", 0)) for a in synced)
        sync_s = sum(float(a.get("duration_ms", 0.0)) for a in synced) / 1e3
        checks = checksums.get((lane.role or "", lane.rank or 0), [])
        rows.append(
            {
                "role": lane.role,
                "rank": lane.rank,
                **{f"{state.value}_s": round(seconds[state], 3) for state in State},
                "transitions": transitions,
                "noops": noops,
                "failures": failures,
                "syncs": len(synced),
                "bytes_synced": nbytes,
                "gbps": round(nbytes / sync_s / 1e9, 3) if sync_s > 0 else 0.0,
                "checksum_ok": sum(checks),
                "checksum_total": len(checks),
            }
        )
    return rows


def render_table(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="lifecycle demo: per rank", show_lines=False)
    for column in (
        "role",
        "rank",
        "AWAKE s",
        "PAUSED s",
        "SAVING s",
        "SYNCING s",
        "FAILED s",
        "transitions",
        "no-ops",
        "failures",
        "synced",
        "GB/s",
        "checksum",
    ):
        table.add_column(column, justify="left" if column == "role" else "right")
    for row in rows:
        checks = f"{row['checksum_ok']}/{row['checksum_total']}"
        colour = "green" if row["checksum_ok"] == row["checksum_total"] else "bold red"
        table.add_row(
            str(row["role"]),
            str(row["rank"]),
            *(f"{row[f'{s.value}_s']:.2f}" for s in State),
            str(row["transitions"]),
            str(row["noops"]),
            str(row["failures"]),
            _size(row["bytes_synced"]),
            f"{row['gbps']:.2f}",
            f"[{colour}]{checks}[/]",
        )
    console.print(table)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)

"""The demo's report: its per-rank logs read once, then the table, the check, the timeline and summary.json.

The logs are the same files `lifecycle check` and `lifecycle timeline` read; `RunLogs.read` parses
them once (`lifecycle.logs`) and every part of the report works on that one reading.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifecycle import checker, timeline
from lifecycle.logs import Event, LogFile, read_logs
from lifecycle.table import State
from lifecycle.timeline import Lane, read_lanes

if TYPE_CHECKING:
    from rich.console import Console

    from actor_integration.tools.demo.placement import Placement
    from actor_integration.tools.demo.step import StepDriver
    from actor_integration.weight_sync.nodes import TransportRow


@dataclass(frozen=True)
class RunLogs:
    """The run's per-rank logs, parsed once and shared by the check, the table and the timeline."""

    files: list[LogFile]
    lanes: list[Lane]

    @classmethod
    def read(cls, paths: Iterable[str | Path]) -> RunLogs:
        files = read_logs(paths)
        return cls(files, read_lanes(files))


def per_rank_rows(
    lanes: Sequence[Lane],
    checksums: Mapping[tuple[str, int], list[bool]],
    step_walls: Mapping[int, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per (role, rank): seconds in each state, transitions, bytes synced, GB/s, checksum results,
    and the lifecycle's cost per step: seconds of transitions (their logged `duration_ms`) in the steps
    of `step_walls` (step → its wall time in seconds), and their share of those steps' wall time."""
    walls = dict(step_walls or {})
    rows = []
    for lane in sorted(lanes, key=lambda lane: (lane.role != "trainer", lane.role or "", lane.rank or 0)):
        seconds = dict.fromkeys(State, 0.0)
        for start, end, state in lane.states:
            seconds[state] += end - start
        transitions = [span for span in lane.spans if span.cat == "transition"]
        in_steps = sum(
            float(span.args.get("duration_ms", 0.0)) / 1e3
            for span in transitions
            if span.args.get("step") in walls
        )
        noops = sum(1 for mark in lane.marks if mark.kind == "noop")
        failures = sum(1 for mark in lane.marks if mark.kind == "failed")
        name = Event.SYNC_UPDATE if lane.role == "trainer" else Event.SYNC_LOADED
        synced = [m.args for m in sync_marks(lane, name) if m.args.get("ok", True)]
        nbytes = sum(int(a.get("bytes", 0)) for a in synced)
        # The engine's read-back of what each load wrote (weight_sync.loaded's digest_ok).
        digests = [
            m.args.get("digest_ok")
            for m in sync_marks(lane, Event.SYNC_LOADED.value)
            if m.args.get("digest_ok") is not None
        ]
        sync_s = sum(float(a.get("duration_ms", 0.0)) for a in synced) / 1e3
        checks = checksums.get((lane.role or "", lane.rank or 0), [])
        rows.append(
            {
                "role": lane.role,
                "rank": lane.rank,
                **{f"{state.value}_s": round(seconds[state], 3) for state in State},
                "transitions": len(transitions),
                "noops": noops,
                "failures": failures,
                "syncs": len(synced),
                "bytes_synced": nbytes,
                "gbps": round(nbytes / sync_s / 1e9, 3) if sync_s > 0 else 0.0,
                "checksum_ok": sum(checks),
                "checksum_total": len(checks),
                "read_back_ok": sum(1 for d in digests if d is True),
                "read_back_total": len(digests),
                "lifecycle_s_per_step": round(in_steps / len(walls), 4) if walls else None,
                "lifecycle_share": round(in_steps / sum(walls.values()), 4) if sum(walls.values()) else None,
                "release": release_audit(lane),
            }
        )
    return rows


def sync_marks(lane: Lane, name: str) -> list[Any]:
    """The lane's weight-sync marks of one event, failed ones included."""
    return [m for m in lane.marks if m.kind == "weight_sync" and m.name.startswith(name)]


def release_audit(lane: Lane) -> dict[str, Any] | None:
    """What the lane's measured releases freed against what their tags hold (None: nothing measured)."""
    released = [m.args for m in lane.marks if m.name == Event.MEMORY_RELEASED.value]
    taken = [m.args for m in lane.marks if m.name == Event.MEMORY_TAKEN.value]
    if not released and not taken:
        return None
    expected = [int(a["expected_bytes"]) for a in released if isinstance(a.get("expected_bytes"), int)]
    return {
        "releases": len(released),
        "freed_bytes": sum(int(a.get("freed_bytes", 0)) for a in released),
        "expected_bytes": sum(expected) if expected else None,
        "short": sum(1 for a in released if a.get("short")),
        "wakes": len(taken),
        "taken_bytes": sum(int(a.get("taken_bytes", 0)) for a in taken),
    }


# Tags smaller than this are not judged by the release check: the allocator's and torch_memory_saver's
# 2 MiB granularity, and SGLang's figures in GB to three decimals, make a small tag's ratio noise.
JUDGED_BYTES = 256 << 20
# Where a real engine reads back what a sync wrote (its receiver's processes); vLLM's workers do not.
READ_BACK_IN = {"sglang": "SGLang's schedulers"}


def engine_verdicts(
    args: argparse.Namespace, driver: StepDriver, lanes: Sequence[Lane], engine: str = "sglang"
) -> dict[str, Any]:
    """The checks of a run on a real engine (SGLang's or vLLM's), as (line, ok) pairs and their figures.
    vLLM's workers verify every bucket but read nothing back after the load (that line is a note), and
    its sleep releases both tags at once (its release figure is both tags' together)."""
    from actor_integration.tools.demo.options import ENGINE_NAMES, ENGINE_PROCESS

    name = ENGINE_NAMES[engine]
    steps = driver.records
    lines: list[tuple[str, bool]] = []

    def check(what: str, key: str, want: Any = True) -> None:
        seen = [s for s in steps if key in s]
        bad = [s["step"] for s in seen if s[key] != want]
        lines.append(
            (
                f"{what}: {len(seen) - len(bad)}/{len(seen)} steps" + (f", not at {bad}" if bad else ""),
                bool(seen) and not bad,
            )
        )

    check("generation refused between the release and the sync", "refused_before_sync")
    check(
        f"greedy tokens and {name}'s weights bit-identical after re-syncing the same weights",
        "resync_identical",
    )
    if any("tokens_changed" in s for s in steps):
        check("greedy tokens changed after training", "tokens_changed")
    agreement = [s["trainer_agreement"] for s in steps if "trainer_agreement" in s]
    if agreement:
        tokens = sum(a["tokens"] for a in agreement) / len(agreement)
        first = sum(a["first_tokens"] for a in agreement) / len(agreement)
        # A figure, not a pass mark: bf16 kernels and the trainer's float32 math may break near-ties.
        lines.append(
            (
                f"the trainer's own Qwen model (float32, CPU) generates {tokens:.0%} of {name}'s greedy tokens "
                f"from the same weights ({first:.0%} of the first tokens), mean over {len(agreement)} steps",
                True,
            )
        )
    read_back = [
        m.args.get("digest_ok")
        for lane in lanes
        if lane.role == "rollout"
        for m in sync_marks(lane, Event.SYNC_LOADED.value)
        if m.args.get("ok", True)
    ]
    if engine in READ_BACK_IN:
        lines.append(
            (
                f"{READ_BACK_IN[engine]} read back what each sync wrote, equal to what was sent: "
                f"{sum(1 for d in read_back if d is True)}/{len(read_back)} syncs",
                bool(read_back) and all(d is True for d in read_back),
            )
        )
    else:  # a note, not a pass mark: the re-sync check (tokens and checksum) stands for it
        lines.append(
            (
                f"{name}'s workers verified every bucket before loading; nothing read back after the load "
                f"({len(read_back)} syncs loaded)",
                True,
            )
        )
    for step in sorted(set(getattr(args, "corrupt_sync", ()))):
        record = next((s for s in steps if s["step"] == step), None)
        resends = None if record is None else record.get("corrupt_resends")
        lines.append(
            (f"corrupt round at step {step}: refused and sent again ({resends} resend(s))", bool(resends))
        )
    ratios: dict[str, float] = {}
    for lane in lanes:
        if lane.role != "rollout":
            continue
        for mark in lane.marks:
            a = mark.args
            if mark.name == Event.MEMORY_RELEASED.value and int(a.get("expected_bytes") or 0) >= JUDGED_BYTES:
                ratio = int(a.get("freed_bytes", 0)) / int(a["expected_bytes"])
                ratios[a["tag"]] = min(ratio, ratios.get(a["tag"], ratio))
    if ratios:
        shown = ", ".join(f"{tag} {r:.1%}" for tag, r in sorted(ratios.items()))
        per = "both tags in one sleep, under the first" if engine == "vllm" else "per tag"
        lines.append(
            (
                f"{name}'s releases freed, of what it reports ({per}, lowest): {shown}",
                min(ratios.values()) >= 0.95,
            )
        )
    if getattr(args, "kill_engine", None) is not None:
        killed = driver.killed or {}
        lines.append(
            (
                f"killed {ENGINE_PROCESS[engine]} at step {killed.get('step')}: {killed.get('error')} after "
                f"{killed.get('noticed_s')} s",
                bool(killed.get("typed")),
            )
        )
    return {"lines": lines, "release_ratios": ratios, "killed": driver.killed}


COLUMNS = (
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
    "read back",
    "lifecycle s/step",
    "% of step",
)


def _read_back(row: dict[str, Any]) -> str:
    """Loads whose written weights the engine read back equal to what was sent (— where none was)."""
    if not row["read_back_total"]:
        return "—"
    colour = "green" if row["read_back_ok"] == row["read_back_total"] else "bold red"
    return f"[{colour}]{row['read_back_ok']}/{row['read_back_total']}[/]"


def render_table(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="lifecycle demo: per rank", show_lines=False)
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "role" else "right")
    for row in rows:
        checks = f"{row['checksum_ok']}/{row['checksum_total']}"
        colour = "green" if row["checksum_ok"] == row["checksum_total"] else "bold red"
        per_step, share = row["lifecycle_s_per_step"], row["lifecycle_share"]
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
            _read_back(row),
            "—" if per_step is None else f"{per_step:.3f}",
            "—" if share is None else f"{share:.1%}",
        )
    console.print(table)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def finish(
    out: Path,
    console: Console,
    args: argparse.Namespace,
    placed: Placement,
    driver: StepDriver,
    wall: float,
) -> int:
    """Read the logs once, print the table, the check and the totals, write the timeline and
    summary.json; return the demo's exit code."""
    logs = RunLogs.read(sorted((out / "logs").glob("*.jsonl")))
    findings = checker.check_logs(logs.files)
    steps = driver.records
    rows = per_rank_rows(logs.lanes, driver.checksums, {s["step"]: s["wall_s"] for s in steps})
    render_table(rows, console)
    timeline.write_trace(logs.lanes, out / "timeline.json")
    picture = timeline.render_png(logs.lanes, out / "timeline.png")
    exit_code = 0 if driver.ok else 1
    losses = [s["loss"] for s in steps if s["loss"] is not None]
    growth = [g for s in steps for g in (s.get("peak_rss_growth_mib") or {}).values() if g is not None]
    synced = [s for s in steps if s.get("bytes")]
    if growth and synced:
        console.print(
            f"peak host RSS growth during a sync, any trainer rank: {max(growth):.1f} MiB "
            f"(bucket {args.bucket_mb} MiB; weights {synced[-1]['bytes'] / placed.trainers / 2**20:.1f} MiB per rank)"
        )
    for row in rows:
        audit = row["release"]
        if audit is None:
            continue
        expected = audit["expected_bytes"]
        console.print(
            f"release verification, {row['role']} rank {row['rank']}: {audit['releases']} release(s) freed "
            f"{_size(audit['freed_bytes'])}"
            + (f" of {_size(expected)} expected ({audit['freed_bytes'] / expected:.0%})" if expected else "")
            + f", {audit['short']} short; {audit['wakes']} wake(s) took {_size(audit['taken_bytes'])}"
        )
    loss = f"loss {losses[0]:.3f} → {losses[-1]:.3f}" if losses else "no training step"
    console.print(
        f"steps {len(steps)}, {loss}, "
        f"checkpoints {sum(1 for s in steps if 'checkpoint_reload_ok' in s)}, "
        f"faults recovered {len(driver.faults)}, refusals recovered {len(driver.refusals)}, wall {wall:.1f} s"
    )
    if findings:
        exit_code = 1
        console.print(f"[bold red]lifecycle check: {len(findings)} finding(s)[/]")
        for finding in findings[:20]:
            console.print(f"  {finding}")
    else:
        console.print(f"lifecycle check: [green]clean[/] ({len(logs.files)} logs)")
    marks = {kind: picture.markers.get(kind, 0) for kind in ("weights_valid", "weights_invalid")}
    console.print(
        f"logs: {out / 'logs'}  timeline: {out / 'timeline.json'}, {picture.path} "
        f"(marks: weights valid {marks['weights_valid']}, discarded/unknown {marks['weights_invalid']})"
    )
    expected_faults = len(args.inject_fault)
    if len(driver.faults) != expected_faults:
        exit_code = 1
        console.print(
            f"[bold red]{expected_faults} fault(s) injected but {len(driver.faults)} seen and recovered[/]"
        )
    skipped = sorted(set(args.skip_sync))
    if [r["step"] - 1 for r in driver.refusals] != skipped:
        exit_code = 1
        console.print(
            f"[bold red]syncs skipped at steps {skipped}, but refusals seen and recovered at steps "
            f"{[r['step'] for r in driver.refusals]} (expected at the step after each)[/]"
        )
    transports = [_row(r, placed.nodes) for r in placed.transports]
    designed = [_row(r, placed.nodes) for r in placed.designed]
    if [(t["sender_node"], t["receiver_node"], t["transport"]) for t in transports] != [
        (t["sender_node"], t["receiver_node"], t["transport"]) for t in designed
    ]:
        exit_code = 1
        console.print(
            f"[bold red]the ranks chose transports {transports}, but the node topology says {designed}[/]"
        )
    if driver.node_lost is not None:
        exit_code = 1
        lost = driver.node_lost
        console.print(
            f"[bold red]node lost at step {lost['step']} during {lost['operation']} (noticed after "
            f"{lost['noticed_s']:.1f} s): {lost['lost']}; survivors: {lost['survivors']}[/]",
            soft_wrap=True,
        )
    verdicts: dict[str, Any] = {"sglang": None, "vllm": None}  # the real engine's checks, under its name
    if placed.engine in verdicts:
        checked = verdicts[placed.engine] = engine_verdicts(args, driver, logs.lanes, placed.engine)
        for line, ok in checked["lines"]:
            console.print(line if ok else f"[bold red]{line}[/]")
            exit_code = exit_code if ok else 1
    summary = {
        "device": placed.device,
        "engine": placed.engine,
        **verdicts,
        "trainers": placed.trainers,
        "engine_gpu_counts": placed.engine_gpu_counts,
        "transport": placed.transport,
        "nodes": placed.nodes,
        "places": placed.places,
        "slots": [
            {
                "slot": slot,
                "node": placed.topology.ranks[ranks[0]].node,
                "ranks": list(ranks),
                "engine": engine,
            }
            for slot, (ranks, engine) in enumerate(
                zip(placed.topology.slots.slots, placed.topology.slots.slot_engines, strict=True)
            )
        ],
        "transports": transports,
        "designed_transports": designed,
        "node_lost": driver.node_lost,
        "steps": steps,
        "faults": driver.faults,
        "refusals": driver.refusals,
        "ranks": rows,
        "timeline_marks": marks,
        "findings": [str(f) for f in findings],
        "wall_s": round(wall, 2),
        "ok": exit_code == 0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return exit_code


def _row(row: TransportRow, nodes: Mapping[str, str]) -> dict[str, Any]:
    return {
        "sender_node": row.sender_node,
        "receiver_node": row.receiver_node,
        "sender": nodes.get(row.sender_node, row.sender_node),
        "receiver": nodes.get(row.receiver_node, row.receiver_node),
        "transport": row.transport,
        "ranks": list(row.ranks),
        "engines": list(row.engines),
        "reason": row.reason,
    }

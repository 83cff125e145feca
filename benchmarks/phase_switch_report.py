"""bench_phase_switch.py's report: the per-column summaries, the targets and their verdicts, and
the printed tables (hooks per column, the ways, the memory budget)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.phase_switch_common import (
    BUDGET_COLUMNS,
    BUDGETS,
    COLUMNS,
    GIB,
    SM_COLUMNS,
    WAY_COLUMNS,
    WAY_CYCLES,
    WAYS,
)

TARGET_S = 1.2
TARGET_RATIO = 10.0
TARGET_FITS_S = 0.05
TARGET_PART_SLACK_S = 0.1


def budget_of(column: str) -> str | None:
    """The memory-budget variant a column runs ("fits", "part", "all"), or None: no budget."""
    if column in SM_COLUMNS:
        return SM_COLUMNS[column]
    return next((b for b, name in BUDGET_COLUMNS.items() if name == column), None)


# (label, key, counted in the lifecycle total)
ROWS: tuple[tuple[str, str], ...] = (
    ("rollout sleep", "rollout.sleep"),
    ("trainer wake", "wake"),
    ("  memory.resume", "wake.memory.resume"),
    ("  clear_memory", "wake.clear_memory"),
    ("  process_groups.reload", "wake.process_groups.reload"),
    ("train body: 1 collective per group *", "body"),
    ("trainer sleep", "sleep"),
    ("  clear_memory", "sleep.clear_memory"),
    ("  process_groups.destroy", "sleep.process_groups.destroy"),
    ("  memory.pause", "sleep.memory.pause"),
    ("rollout wake weights", "rollout.wake_weights"),
    ("sync", "sync"),
    ("  groups up (process_groups.reload)", "sync.groups_up"),
    ("  transfer", "sync.transfer"),
    ("  groups down (process_groups.destroy)", "sync.groups_down"),
    ("rollout wake kv_cache", "rollout.wake_kv"),
)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    steps: list[dict[str, float]] = result.get("steps") or []
    if not steps:
        return {}
    # Each step's lifecycle first, then the medians: a median of steps minus a median of bodies
    # can pair one step's wall with another's body.
    steps = [{**s, "lifecycle": s["step"] - s.get("body", 0.0)} for s in steps]
    rest = steps[1:] or steps
    keys = {k for s in steps for k in s}
    steady = {k: statistics.median(s.get(k, 0.0) for s in rest) for k in keys}
    return {"first": steps[0], "steady": steady}


def print_report(report: dict[str, Any]) -> None:
    order = [*COLUMNS, *WAY_COLUMNS.values(), *BUDGET_COLUMNS.values(), *SM_COLUMNS]
    shown = [c for c in order if c in report["columns"] and "skipped" not in report["columns"][c]]
    summary = {c: report["summary"].get(c, {}) for c in shown}
    steady = {c: summary[c].get("steady", {}) for c in shown}
    parallel = {
        "wake.memory.resume",
        "wake.process_groups.reload",
        "sleep.process_groups.destroy",
        "sleep.memory.pause",
    }

    def cell(rows: dict[str, float], key: str, mark: bool = False) -> str:
        if key not in rows:
            return "-"
        return f"{rows[key]:.3f}" + (" ||" if mark and key in parallel else "")

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<40} " + " ".join(f"{c:>14}" for c in cells))

    cfg = report["config"]
    print()
    nccl = report.get("nccl_loaded")
    print(
        f"phase switch, one colocated step ({report['device']}, {report['state_gib']:.2f} GiB training state in "
        f"{report['state_tensors']} tensors, {report['weights_gb']:.2f} GB bf16 weights synced, "
        f"groups: {cfg['groups']}, NCCL loaded: {nccl['version'] if nccl else 'none'}); seconds, "
        "steady = median of steps 2..n"
    )
    names = {"slime": "slime-style"}
    line("phase / hook", [names.get(c, c) for c in shown])
    print("-" * (41 + 15 * len(shown)))
    for label, key in ROWS:
        line(label, [cell(steady[c], key, mark=c != "slime") for c in shown])
    print("-" * (41 + 15 * len(shown)))
    for label, key in (
        ("lifecycle per step (step - body)", "lifecycle"),
        ("  trainer's (train-body + sync groups)", "trainer"),
        ("step wall", "step"),
    ):
        line(label, [cell(steady[c], key) for c in shown])
    line("first step: lifecycle", [cell(summary[c].get("first", {}), "lifecycle") for c in shown])
    line("GPU used after the step, GiB (device)", [cell(steady[c], "asleep_used_gib") for c in shown])
    line("groups freed by the sleep, GiB", [cell(steady[c], "sleep.groups_freed_gib") for c in shown])
    ran = [report["columns"].get(c, {}).get("steps") for c in shown]
    line(
        "state intact after every wake", [str(all(r.get("intact") for r in st)) if st else "-" for st in ran]
    )
    for column, result in report["columns"].items():
        if "skipped" in result:
            print(f"{column}: skipped ({result['skipped']})")
    print("|| = hooks of one stage, run together (each its own time; the edge takes the longest)")
    print("*  not lifecycle: the first collective on each group creates the communicators a wake rebuilt")
    c = report["ceilings"]
    if c.get("pcie_d2h_gbps"):
        floor = report["state_gib"] * GIB / 1e9 * (1 / c["pcie_d2h_gbps"] + 1 / c["pcie_h2d_gbps"])
        print(
            f"ceilings (same run): PCIe pinned D2H {c['pcie_d2h_gbps']} GB/s, H2D {c['pcie_h2d_gbps']} GB/s, "
            f"D2D {c['d2d_gbps']} GB/s; the state down and up at PCIe speed = {floor:.3f} s"
        )
    v = report["verdict"]
    if v:
        print(
            f"targets: ours <= {TARGET_S} s of lifecycle per step: {v['ours_lifecycle_s']:.3f} s "
            f"({'met' if v['meets_time'] else 'missed'}); >= {TARGET_RATIO:.0f}x slime-style: "
            f"{v['speedup']:.1f}x ({'met' if v['meets_ratio'] else 'missed'})"
        )
        print("ours, where the lifecycle time goes: " + ", ".join(f"{k} {t:.3f} s" for k, t in v["largest"]))
    t = report.get("teardown") or {}
    if t and "error" not in t:
        print(
            f"teardown, WORLD + 16 subgroups warmed (1 rank): torch's serial destroy {t['serial_destroy_s']:.3f} s "
            f"(freed {t['serial_freed_gib']} GiB); ours (+ gloo side channel) {t['concurrent_destroy_0_s']:.3f} / "
            f"{t['concurrent_destroy_1_s']:.3f} s (freed {t['concurrent_freed_0_gib']} / {t['concurrent_freed_1_gib']} GiB)"
        )
        print(
            f"rebuild: reload {t['reload_0_s']:.3f} s + first collectives one by one {t['lazy_first_collectives_s']:.3f} s; "
            f"reload {t['reload_1_s']:.3f} s + connect() at once {t['connect_s']:.3f} s + the collectives "
            f"{t['after_connect_collectives_s']:.3f} s"
        )
    elif t:
        print(f"teardown section failed: {t['error'][:500]}")
    print_ways(report.get("ways") or {})
    print_budget(report.get("budget") or {})
    for column, result in report["columns"].items():
        if result.get("error"):
            print(f"{column} FAILED: {result['error'][:1500]}")


def print_ways(ways: dict[str, Any]) -> None:
    """The ways section: one row per way, medians over its cycles."""
    if not ways:
        return
    print()
    print(
        "communicators on sleep, WORLD + 16 warmed subgroups (1 rank), seconds and GiB, "
        f"median of {WAY_CYCLES} cycles (freed: device-wide mem_get_info; NCCL: ncclCommMemStats)"
    )
    header = (
        f"{'way':<10} {'free':>8} {'freed':>8} {'NCCL says':>10} {'held':>8} {'bring back':>11} "
        f"{'1st coll.':>10}  notes"
    )
    print(header)
    print("-" * len(header))
    for way in WAYS:
        result = ways.get(way)
        if result is None:
            continue
        if "skipped" in result or "error" in result:
            why = result.get("skipped") or f"FAILED: {result['error'][:300]}"
            print(f"{way:<10} {why}")
            continue
        cycles = result["cycles"]

        def med(key: str, cycles: list[dict[str, Any]] = cycles) -> str:
            values = [c[key] for c in cycles if c.get(key) is not None]
            return f"{statistics.median(values):.3f}" if values else "-"

        fell = [c["fell_back"] for c in cycles if c.get("fell_back")]
        notes = f"fell back: {fell[0]}" if fell else ""
        print(
            f"{way:<10} {med('free_s'):>8} {med('freed_gib'):>8} {med('nccl_freed_gib'):>10} "
            f"{med('held_gib'):>8} {med('back_s'):>11} {med('first_collectives_s'):>10}  {notes}"
        )


def budget_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Per budget column (and ours, the full sleep): need, releases, bytes moved, the trainer's
    lifecycle per step, and its target (issue 31) with the PCIe figures of this run."""
    c = report["ceilings"]
    d2h, h2d = c.get("pcie_d2h_gbps"), c.get("pcie_h2d_gbps")
    rows: dict[str, Any] = {}
    full_column = "full-kv-all" if report["summary"].get("full-kv-all") else "ours"
    full = report["summary"].get(full_column, {}).get("steady")
    for column in ("ours", "full-kv-all", *(BUDGET_COLUMNS[b] for b in BUDGETS), *SM_COLUMNS):
        result = report["columns"].get(column)
        steady = report["summary"].get(column, {}).get("steady")
        if not result or not steady or (column != "ours" and "need" not in result):
            continue
        plans = (result.get("plans") or [])[1:] or (result.get("plans") or [])  # the steady steps'
        released = sorted({tuple(p["released"]) for p in plans}) if plans else []
        row: dict[str, Any] = {
            "trainer_s": steady["trainer"],
            "lifecycle_s": steady["lifecycle"],
            "moved_bytes": steady.get("moved_bytes", 0.0),
            "released": [list(r) for r in released] if budget_of(column) in BUDGETS else None,
            "need_bytes": result.get("need", {}).get("need_bytes"),
            "required_bytes": result.get("need", {}).get("required_bytes"),
            "met_every_check": all(p.get("met") for p in result.get("plans") or [])
            if budget_of(column) in BUDGETS
            else None,
        }
        budget = budget_of(column)
        if budget == "fits":
            row["target_s"], row["target"] = TARGET_FITS_S, f"<= {TARGET_FITS_S:.3f} s"
        elif budget == "part":
            if d2h and h2d:
                floor = row["moved_bytes"] / 1e9 * (1 / d2h + 1 / h2d)
                row["target_s"] = floor + TARGET_PART_SLACK_S
                row["target"] = (
                    f"<= moved / PCIe {floor:.3f} + {TARGET_PART_SLACK_S} = {row['target_s']:.3f} s"
                )
            else:
                row["target_s"], row["target"] = None, "moved / PCIe + 0.1 s: no PCIe figure (CPU)"
        elif budget == "all":
            row["target_s"] = full["trainer"] if full else None
            row["target"] = (
                f"<= the full sleep ({full_column}) {full['trainer']:.3f} s"
                if full
                else "the full sleep: not run"
            )
        if budget in BUDGETS:
            row["met"] = None if row["target_s"] is None else row["trainer_s"] <= row["target_s"]
        rows[column] = row
    return {"pcie_d2h_gbps": d2h, "pcie_h2d_gbps": h2d, "columns": rows} if rows else {}


def print_budget(budget: dict[str, Any]) -> None:
    """The memory-budget section: one row per budget column, ours (the full sleep) first."""
    if not budget:
        return
    print()
    pcie = (
        f"PCIe in this run: D2H {budget['pcie_d2h_gbps']} GB/s, H2D {budget['pcie_h2d_gbps']} GB/s"
        if budget["pcie_d2h_gbps"]
        else "no PCIe figure (CPU)"
    )
    print(
        "memory budget (issue 31): the rollout's KV cache sized so the trainer's sleep must release nothing, "
        f"part, or all; steady = median of steps 2..n; trainer = its lifecycle per step; {pcie}"
    )
    header = (
        f"{'column':<14} {'need GiB':>9} {'to free':>9} {'released':<34} {'moved GiB':>10} "
        f"{'trainer s':>10} {'lifecycle s':>12}  target"
    )
    print(header)
    print("-" * (len(header) + 40))
    for column, row in budget["columns"].items():
        need = "-" if row["need_bytes"] is None else f"{row['need_bytes'] / GIB:.2f}"
        required = "-" if row["required_bytes"] is None else f"{max(0, row['required_bytes']) / GIB:.2f}"
        if row["released"] is None:
            released = "everything (no budget)"
        else:
            released = " / ".join(", ".join(r) or "nothing" for r in row["released"]) or "-"
        target = row.get(
            "target",
            "(today's full sleep)" if column == "ours" else "(the full sleep, rollout as budget-all)",
        )
        if "met" in row:
            target += "" if row["met"] is None else (": met" if row["met"] else ": MISSED")
        if row["met_every_check"] is False:
            target += "; a check found the need not free"
        print(
            f"{column:<14} {need:>9} {required:>9} {released:<34} {row['moved_bytes'] / GIB:>10.2f} "
            f"{row['trainer_s']:>10.3f} {row['lifecycle_s']:>12.3f}  {target}"
        )
    print(
        "to free: GiB the sleep had to free (need + margin - free at the sleep); moved: each released tag down at the "
        "sleep and up at the next wake (so twice over PCIe)"
    )


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    slime, ours = summary.get("slime", {}).get("steady"), summary.get("ours", {}).get("steady")
    if not slime or not ours:
        return {}
    parts = {
        k: ours[k]
        for k in ("rollout.sleep", "wake", "sleep", "rollout.wake_weights", "sync", "rollout.wake_kv")
        if k in ours
    }
    return {
        "ours_lifecycle_s": ours["lifecycle"],
        "slime_lifecycle_s": slime["lifecycle"],
        "speedup": slime["lifecycle"] / ours["lifecycle"],
        "meets_time": ours["lifecycle"] <= TARGET_S,
        "meets_ratio": slime["lifecycle"] / ours["lifecycle"] >= TARGET_RATIO,
        "largest": sorted(parts.items(), key=lambda kv: -kv[1])[:3],
    }

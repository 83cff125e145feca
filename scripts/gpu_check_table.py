"""The summary table of `scripts/gpu_check.sh`: one row per step, pass or fail, its headline figure.

    python3 scripts/gpu_check_table.py WORK STEP...
    python3 scripts/gpu_check_table.py --merge [--steps "STEP ..."] TABLE.md...

Reads what `scripts/gpu_sglang.sh` left in WORK: `summary.txt` (one "name rc=N Ts" line per command
it ran), each command's log and the figures the benchmarks and GPU tests wrote as JSON; the table
ends with the id of the code that ran (`scripts/code_id.py`, kept in WORK/code-id). Standard
library only: it runs on the GPU machine before anything is installed.

`--merge`, here: the tables that several device calls brought back (from one machine or several, one
session or several) joined into one, each step's latest row, and whether every step passed on the
code of this tree. Exit 0 only when every step named (default: every step of the tables) passed and
every table ran this tree's code; a table without its code line, or with another, counts for
nothing. `scripts/gpu_vllm.sh`'s and `scripts/gpu_slime.sh`'s tables merge the same way.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# Each step of gpu_check.sh: the commands gpu_sglang.sh runs for it (their names in summary.txt).
COMMANDS = {
    "bench": ["bench_sglang_sync"],
    "demo": ["demo_sglang", "demo_sglang_check"],
    "demoplain": ["demo_sglang_plain", "demo_sglang_plain_check"],
    "tests": ["test_sglang_gpu"],
    "wsync": ["test_weight_sync_gpu"],
    "kill": ["demo_sglang_kill", "demo_sglang_kill_check"],
    "probeorder": ["probe_release_order"],
    "slime": ["test_slime_rollout_gpu", "slime_rollout_check"],
    "miles": ["test_miles_rollout_gpu", "miles_rollout_check"],
    "areal": ["test_areal_rollout_gpu", "areal_rollout_check"],
}


def ran(work: Path) -> dict[str, tuple[int, int]]:
    """name -> (exit code, seconds) of the last run of each command."""
    out: dict[str, tuple[int, int]] = {}
    summary = work / "summary.txt"
    for line in summary.read_text().splitlines() if summary.is_file() else []:
        match = re.fullmatch(r"(\S+) rc=(-?\d+) (\d+)s", line.strip())
        if match:
            out[match[1]] = (int(match[2]), int(match[3]))
    return out


def log(work: Path, name: str) -> str:
    path = work / f"{name}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def last(pattern: str, text: str) -> str | None:
    found = re.findall(pattern, text, flags=re.MULTILINE)
    return found[-1].strip() if found else None


def pytest_line(text: str) -> str:
    return last(r"^=*\s*(\d+ (?:passed|failed|error)[^=\n]*?)\s*=*$", text) or "no pytest summary"


def check_line(text: str) -> str:
    return last(r"^(lifecycle check: .*)$", text) or last(r"^(\d+ finding.*)$", text) or "no check output"


def demo_headline(work: Path, name: str) -> str:
    text = log(work, name)
    verdict = last(r"^(demo (?:OK|FAILED).*)$", text) or "no verdict"
    checks = re.findall(r"^(.*?: \d+/\d+ (?:steps|syncs).*)$", text, flags=re.MULTILINE)
    failed = [c for c in checks if re.search(r"(\d+)/(\d+)", c) and _short(c)]
    parts = [verdict, f"{len(checks) - len(failed)}/{len(checks)} SGLang checks passed"]
    parts += [f"FAILED: {c.strip()[:120]}" for c in failed]
    killed = last(r"^(killed .* at step .*)$", text)
    if killed:
        parts.append(killed[:140])
    return "; ".join(parts)


def _short(line: str) -> bool:
    a, b = (int(v) for v in re.search(r"(\d+)/(\d+)", line).groups())  # type: ignore[union-attr]
    return a != b or b == 0


def bench_headline(work: Path) -> str:
    path = work / "bench_sglang_sync.json"
    if not path.is_file():
        return last(r"^(\S*Error.*)$", log(work, "bench_sglang_sync")) or "no figures"
    rows: list[dict[str, Any]] = json.loads(path.read_text())["rows"]
    return "; ".join(
        f"{r['shape']} {r['gb']} GB: ours {r['ours_ms']} ms, slime {r['slime_ms']} ms ({r['ours_over_slime']}x), "
        f"d2d {r['d2d_ms']} ms, same weights {r['identical_engine_weights']}, "
        f"read back {r.get('ours_breakdown_ms', {}).get('engine_digest_ms', '?')} ms"
        for r in rows
    )


def probe_headline(work: Path) -> str:
    lines = re.findall(
        r"^probe (\S+): (ok|FAILED)(.*)$", log(work, "probe_release_order"), flags=re.MULTILINE
    )
    return ", ".join(
        f"{stage} {verdict}{'' if verdict == 'ok' else rest[:160]}" for stage, verdict, rest in lines
    )


def figures(work: Path, name: str) -> dict[str, Any]:
    path = work / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def areal_headline(work: Path) -> str:
    """AReaL's engine on the server: the switch plain and wrapped against the 3 ms target, the field
    failures, whether AReaL's AWEX plugin fits this SGLang's scheduler."""
    summary = figures(work, "areal_rollout_summary") or figures(work, "areal_rollout_switch")
    parts = []
    if "wrapped_switch_ms" in summary:
        met = {True: "met", False: "MISSED"}.get(summary.get("target_met"), "?")
        delta = summary.get("delta_ms")
        parts.append(
            f"switch plain {summary.get('plain_switch_ms')} ms, wrapped {summary.get('wrapped_switch_ms')} ms "
            f"({'?' if delta is None else f'{delta:+}'} ms, target <= 3: {met})"
        )
    failures = [
        ("#1726", "1726_absorbed"),
        ("#1737", "1737_refused_then_ordered"),
        ("#1160", "1160_plain_held_wrapped_served"),
        ("idle", "idle_drained"),
        ("in-place refused", "idle_ablation_refused"),
    ]
    seen = [f"{label} {'ok' if summary[key] else 'FAILED'}" for label, key in failures if key in summary]
    if seen:
        parts.append(", ".join(seen))
    if "plugin_runs_on_this_sglang" in summary:
        parts.append(f"AWEX plugin fits this SGLang: {summary['plugin_runs_on_this_sglang']}")
    return "; ".join(parts)


def framework_rollout_headline(work: Path, framework: str) -> str:
    """slime's or miles' engine on SGLang's server: the wrapped sleep + wake beside the framework's own
    (cycles in turn) against issue 48's 3 ms, and our sender's sync beside the framework's push."""
    parts = []
    beside = figures(work, f"{framework}_rollout_side_by_side")
    if "wrapped_minus_own_sleep_wake_ms" in beside:
        met = {True: "met", False: "MISSED"}.get(beside.get("target_met"), "?")
        parts.append(
            f"sleep + wake own {beside['own']['sleep_wake_ms']} ms, wrapped {beside['wrapped']['sleep_wake_ms']} ms "
            f"({beside['wrapped_minus_own_sleep_wake_ms']:+} ms, target <= {beside.get('target_ms', 3.0)}: {met})"
        )
    sync = figures(work, f"{framework}_rollout_our_sender")
    if sync.get("ours_sync_ms") and sync.get("own_sync_ms"):
        ratio = round(sync["own_sync_ms"] / sync["ours_sync_ms"], 2)
        parts.append(f"sync ours {sync['ours_sync_ms']} ms, own push {sync['own_sync_ms']} ms ({ratio}x)")
    return "; ".join(parts)


def headline(work: Path, step: str) -> str:
    if step == "bench":
        return bench_headline(work)
    if step in ("demo", "demoplain", "kill"):
        name = COMMANDS[step][0]
        return f"{demo_headline(work, name)}; {check_line(log(work, COMMANDS[step][1]))}"
    if step == "probeorder":
        return probe_headline(work) or "no stages"
    if step == "tests":
        cycles = figures(work, "sglang_cycles")
        extra = ""
        if cycles:
            extra = f"; {cycles.get('cycles')} cycles, load paths {cycles.get('load_paths')}, read back {cycles.get('digests')}"
        beside = figures(work, "sglang_sleep_wake_vs_own")
        if "difference_ms" in beside:
            extra += (
                f"; sleep + wake ours {beside.get('ours_ms_median')} ms, SGLang's own "
                f"{beside.get('sglang_own_ms_median')} ms ({beside['difference_ms']:+} ms)"
            )
        return pytest_line(log(work, COMMANDS[step][0])) + extra
    if step == "wsync":
        return pytest_line(log(work, COMMANDS[step][0]))
    if step in ("slime", "miles"):
        return "; ".join(
            p
            for p in (
                pytest_line(log(work, COMMANDS[step][0])),
                framework_rollout_headline(work, step),
                check_line(log(work, COMMANDS[step][1])),
            )
            if p
        )
    if step == "areal":
        extra = areal_headline(work)
        return "; ".join(
            p
            for p in (
                pytest_line(log(work, COMMANDS[step][0])),
                extra,
                check_line(log(work, COMMANDS[step][1])),
            )
            if p
        )
    return ""


def main(argv: list[str]) -> int:
    work, steps = Path(argv[0]), argv[1:]
    commands = ran(work)
    rows = ["| step | result | s | headline |", "|---|---|---|---|"]
    for step in steps:
        names = COMMANDS.get(step, [step])
        done = [commands[n] for n in names if n in commands]
        if not done:
            rows.append(f"| {step} | not run | | |")
            continue
        ok = len(done) == len(names) and all(rc == 0 for rc, _s in done)
        timed_out = any(rc in (124, 137) for rc, _s in done)
        result = "pass" if ok else ("FAIL (time limit)" if timed_out else "FAIL")
        seconds = sum(s for _rc, s in done)
        rows.append(f"| {step} | {result} | {seconds} | {headline(work, step).replace('|', '/')} |")
    install = commands.get("install")
    if install is not None:
        rows.append(f"| (install) | {'pass' if install[0] == 0 else 'FAIL'} | {install[1]} | |")
    kept = work / "code-id"
    rows.append(kept.read_text().strip() if kept.is_file() else "code: not recorded")
    print("\n".join(rows))
    return 0


# --- joining the tables of several calls ----------------------------------------------------------
CODE_LINE = re.compile(r"^code ([0-9a-f]{12}) \((\d+) files\)$")


def read_table(path: Path) -> tuple[list[list[str]], str | None]:
    """The step rows of one table (its cells) and its code line."""
    rows, code = [], None
    for raw in path.read_text(errors="replace").splitlines():
        text = raw.strip()
        if CODE_LINE.match(text):
            code = text
        elif text.startswith("|") and text.endswith("|"):
            cells = [c.strip() for c in text.strip("|").split("|")]
            if cells[0] not in ("step", "") and not set(cells[0]) <= set("-: "):
                rows.append(cells)
    return rows, code


def verdict_of(result: str) -> str | None:
    """pass, fail, or None (not run); gpu_check's "pass"/"FAIL", the other scripts' exit codes."""
    if result == "not run" or not result:
        return None
    return "pass" if result in ("pass", "0") else "fail"


def this_tree() -> str:
    spec = importlib.util.spec_from_file_location("code_id", Path(__file__).resolve().parent / "code_id.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.line())


def git_head() -> str:
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True)
    except OSError:
        return "no git"
    if head.returncode != 0:
        return "no git"
    return f"HEAD {head.stdout.strip()}" + (
        ", with uncommitted changes" if dirty.stdout.strip() else ", clean"
    )


def merge(paths: list[Path], expected: list[str], tree: str) -> tuple[list[str], bool]:
    """The joined table's lines, and whether every expected step passed on the tree's code."""
    latest: dict[str, tuple[list[str], Path]] = {}
    problems = []
    for path in paths:
        rows, code = read_table(path)
        if code != tree:
            problems.append(f"{path}: ran {code or 'code not recorded'}, not this tree's")
            continue
        for cells in rows:
            if cells[0] in ("(install)", "install") or verdict_of(cells[1]) is None:
                continue
            latest[cells[0]] = (cells, path)
    order = expected or list(latest)
    out = ["| step | result | s | headline | table |", "|---|---|---|---|---|"]
    for step in order:
        if step not in latest:
            out.append(f"| {step} | not run | | | |")
            continue
        cells, path = latest[step]
        result = "pass" if verdict_of(cells[1]) == "pass" else f"FAIL ({cells[1]})"
        seconds = cells[2] if len(cells) > 2 else ""
        headline = cells[3] if len(cells) > 3 else ""
        out.append(f"| {step} | {result} | {seconds} | {headline} | {path.parent.name}/{path.name} |")
    failed = [s for s in order if s in latest and verdict_of(latest[s][0][1]) != "pass"]
    missing = [s for s in order if s not in latest]
    ok = bool(order) and not failed and not missing
    out += [f"this tree: {tree}; {git_head()}", *problems]
    if ok:
        out.append(
            f"every step passed on this tree's code ({len(order)} steps, {len({p for _c, p in latest.values()})} table(s))"
        )
    else:
        out.append(
            "NOT every step passed on this tree's code:"
            + (f" failed {' '.join(failed)};" if failed else "")
            + (f" not run on it {' '.join(missing)}" if missing else "")
        )
    return out, ok


def main_merge(argv: list[str]) -> int:
    expected: list[str] = []
    if argv[:1] == ["--steps"]:
        expected, argv = argv[1].split(), argv[2:]
    if not argv:
        print("usage: gpu_check_table.py --merge [--steps 'STEP ...'] TABLE.md...", file=sys.stderr)
        return 2
    missing = [a for a in argv if not Path(a).is_file()]
    if missing:
        print(f"gpu_check_table.py --merge: no such table: {' '.join(missing)}", file=sys.stderr)
        return 2
    lines, ok = merge([Path(a) for a in argv], expected, this_tree())
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main_merge(args[1:]) if args[:1] == ["--merge"] else main(args))

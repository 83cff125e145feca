#!/usr/bin/env python3
"""slime's own job, plain beside wrapped: the per-step table of scripts/slime_e2e.sh's `report` step.

    python3 scripts/slime_e2e_report.py OUT [JOB]   (OUT: slime_e2e.sh's output directory; JOB the job set
                                                     beside plain: wrapped, the default, or budget)

Reads what slime itself logs in each job's output (OUT/plain.log, OUT/wrapped.log): its `perf N: {...}`
lines (train_metric_utils.py), `rollout N: {...}` and `step N: {...}` metrics, and its
`Memory-Usage after offload model` printouts of rank 0; and, for the wrapped job, the lifecycle's
JSON-lines logs (OUT/lifecycle-logs/actor-rank0.jsonl): what each trainer sleep spent in which hook.
Prints markdown. slime reports step N's `perf/sleep_time` from the sleep that ended step N-1 (its
timer is read before the post-train sleep), so a row's sleep is the previous step's.

Targets of issue 47 it prints beside the figures: slime's own sleep + wake at least 10x lower
wrapped; step time wrapped no higher than plain; slime's weight check answered 200 every time, and
the lifecycle's check of every later push (`RL_LIFECYCLE_CHECK_WEIGHTS=every`, the wrapped job) equal.
Standard library only: it runs wherever the logs are (the GPU machine, or here on fetched logs).
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "main",
    "memory_after_sleep",
    "metrics",
    "push_checks",
    "report",
    "trainer_sleeps",
    "weight_checks",
]

PERF_KEYS = (
    "perf/sleep_time",
    "perf/wake_up_time",
    "perf/update_weights_time",
    "perf/rollout_time",
    "perf/train_time",
    "perf/step_time",
)
ROLLOUT_KEYS = ("rollout/raw_reward",)
TRAIN_KEYS = ("train/loss", "train/grad_norm")
_METRICS = re.compile(r" - (perf|rollout|step) (\d+): (\{.*\})\s*$")
_MEMORY = re.compile(r"\[Rank 0\] Memory-Usage after offload model: (\{.*\})\s*$")
_CHECKER = re.compile(r'"POST /weights_checker HTTP/1\.1" (\d+)')
_PUSH_CHECK = re.compile(r"\[rl-lifecycle\] weights check, update (\d+): equal \(([\d.]+) ms")
_CHECK_ERROR = re.compile(r"EngineWeightsCheckError: (.*)")


def metrics(lines: Iterable[str]) -> dict[str, dict[int, dict[str, float]]]:
    """slime's logged metric dicts by kind ("perf", "rollout", "step") and step number."""
    out: dict[str, dict[int, dict[str, float]]] = {"perf": {}, "rollout": {}, "step": {}}
    for line in lines:
        match = _METRICS.search(line)
        if match is None:
            continue
        kind, step, body = match.groups()
        try:
            values = ast.literal_eval(body)
        except (SyntaxError, ValueError):
            continue  # a line Ray cut short
        if isinstance(values, dict):
            out[kind].setdefault(int(step), {}).update(values)
    return out


def memory_after_sleep(lines: Iterable[str]) -> list[float]:
    """GPU memory used (GB) in slime's printout after each offload of rank 0's model."""
    used = []
    for line in lines:
        match = _MEMORY.search(line)
        if match is not None:
            used.append(float(ast.literal_eval(match.group(1))["used_GB"]))
    return used


def weight_checks(lines: Iterable[str]) -> list[int]:
    """The HTTP status of each of slime's `/weights_checker` calls (snapshot, reset, compare)."""
    return [int(m.group(1)) for line in lines if (m := _CHECKER.search(line))]


def push_checks(lines: Iterable[str]) -> tuple[list[tuple[int, float]], list[str]]:
    """`RL_LIFECYCLE_CHECK_WEIGHTS=every`'s checks in a job's output: (update, ms) of each found equal,
    and the first line of each `EngineWeightsCheckError` (a push found different)."""
    equal, different = [], []
    for line in lines:
        if match := _PUSH_CHECK.search(line):
            equal.append((int(match.group(1)), float(match.group(2))))
        elif match := _CHECK_ERROR.search(line):
            different.append(match.group(1)[:300])
    return equal, list(dict.fromkeys(different))


def trainer_sleeps(jsonl: Path) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Each sleep plan of the trainer: (operation, ms, [(hook, ms), ...]) from the lifecycle's log."""
    sleeps = []
    for line in jsonl.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "lifecycle.transition" and event.get("plan") == "sleep":
            hooks = [(hook["name"], float(hook["ms"])) for hook in event.get("hooks", [])]
            sleeps.append((str(event.get("operation")), float(event["duration_ms"]), hooks))
    return sleeps


def _get(table: dict[int, dict[str, float]], step: int, key: str) -> float:
    return float(table.get(step, {}).get(key, math.nan))


def _pair(plain: float, wrapped: float) -> str:
    return f"{plain:.3f} / {wrapped:.3f}"


def report(out: Path, job: str = "wrapped") -> str:
    logs = {"plain": out / "plain.log", job: out / f"{job}.log"}
    missing = [str(path) for path in logs.values() if not path.is_file()]
    if missing:
        return f"no job log at {', '.join(missing)}: run scripts/slime_e2e.sh plain and {job} first\n"
    text = {name: path.read_text(errors="replace").splitlines() for name, path in logs.items()}
    got = {name: metrics(lines) for name, lines in text.items()}
    plain, wrapped = got["plain"], got[job]
    steps = sorted(set(plain["perf"]) | set(wrapped["perf"]))
    rows = [
        f"## slime's own metrics per step, plain / {job} (seconds; reward and loss as slime logs them)",
        "",
    ]
    keys = (*PERF_KEYS, *ROLLOUT_KEYS, *TRAIN_KEYS)
    rows.append("| step | " + " | ".join(keys) + f" | sleep + wake, plain / {job} |")
    rows.append("|" + " --- |" * (len(keys) + 2))
    ratios, slower = [], []
    for step in steps:
        cells = []
        for key in keys:
            kind = "perf" if key.startswith("perf/") else "rollout" if key.startswith("rollout/") else "step"
            cells.append(_pair(_get(plain[kind], step, key), _get(wrapped[kind], step, key)))
        sw_plain = _get(plain["perf"], step, "perf/sleep_time") + _get(
            plain["perf"], step, "perf/wake_up_time"
        )
        sw_wrapped = _get(wrapped["perf"], step, "perf/sleep_time") + _get(
            wrapped["perf"], step, "perf/wake_up_time"
        )
        ratio = sw_plain / sw_wrapped if sw_wrapped > 0 else math.nan
        ratios.append(ratio)
        if _get(wrapped["perf"], step, "perf/step_time") > _get(plain["perf"], step, "perf/step_time"):
            slower.append(step)
        rows.append(
            f"| {step} | " + " | ".join(cells) + f" | {sw_plain:.3f} / {sw_wrapped:.3f} ({ratio:.1f}x) |"
        )
    finite = [r for r in ratios if not math.isnan(r)]
    rows += [
        "",
        f"- steps: plain {len(plain['perf'])}, {job} {len(wrapped['perf'])}",
        f"- sleep + wake, plain over {job}: "
        + (f"{min(finite):.1f}x to {max(finite):.1f}x" if finite else "no steps")
        + " (target: at least 10x every step: "
        + ("met" if finite and min(finite) >= 10 else "MISSED")
        + ")",
        f"- step time {job} no higher than plain: "
        + ("met" if not slower else f"MISSED at step(s) {', '.join(map(str, slower))}"),
    ]
    for name in ("plain", job):
        checks = weight_checks(text[name])
        verdict = "all 200" if checks and all(code == 200 for code in checks) else "NOT all 200"
        rows.append(f"- slime's /weights_checker calls, {name}: {len(checks)} ({verdict})")
    equal, different = push_checks(text[job])
    if equal or different:
        updates = sorted({update for update, _ in equal})
        ms = sorted(m for _, m in equal)
        rows.append(
            f"- the lifecycle's check of every push (RL_LIFECYCLE_CHECK_WEIGHTS=every), {job}: "
            f"{len(updates)} update(s) equal ({', '.join(map(str, updates))}"
            + (f"; {ms[len(ms) // 2]:.1f} ms median each" if ms else "")
            + f"), {len(different)} different"
            + "".join(f"\n  - {line}" for line in different)
        )
    for name in ("plain", job):
        rows.append(
            f"- GPU memory used after each trainer sleep (GB), {name}: {memory_after_sleep(text[name])}"
        )
    actor_log = (
        out / ("lifecycle-logs" if job == "wrapped" else f"lifecycle-logs-{job}") / "actor-rank0.jsonl"
    )
    if actor_log.is_file():
        rows += ["", f"## The {job} trainer's sleeps, from the lifecycle's log (ms)", ""]
        rows += ["| # | after | total | hooks |", "| --- | --- | --- | --- |"]
        for index, (operation, total, hooks) in enumerate(trainer_sleeps(actor_log)):
            spent = ", ".join(f"{name} {ms:.1f}" for name, ms in hooks)
            rows.append(f"| {index} | {operation} | {total:.1f} | {spent} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(
            "usage: slime_e2e_report.py OUT [JOB] (slime_e2e.sh's output directory; JOB: wrapped or budget)",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(report(Path(argv[0]), *argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""scripts/slime_e2e_report.py: slime's own per-step figures, plain beside wrapped, read from its job logs.

The lines are shaped as slime 624b824a logs them under `ray job submit` (Ray's actor prefix, slime's
logger head, a Python dict), as they came off the GPU machine's first run of slime's job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_script

HEAD = "\x1b[36m(MegatronTrainRayActor pid=6850)\x1b[0m [2026-12-06 10:28:51] "


@pytest.fixture(scope="module")
def report_module() -> ModuleType:
    return load_script("slime_e2e_report")


def job_log(sleep: list[float], wake: list[float], step_time: list[float], checker: list[int]) -> str:
    lines = ["Running entrypoint for job raysubmit_x: python3 train.py --colocate"]
    for step, (s, w, t) in enumerate(zip(sleep, wake, step_time, strict=True)):
        lines.append(
            HEAD
            + f"train_metric_utils.py:135 - rollout {step}: {{'rollout/raw_reward': 0.25, 'rollout/truncated': 0.9}}"
        )
        lines.append(HEAD + f"model.py:918 - step {step}: {{'train/loss': 0.5, 'train/grad_norm': 0.125}}")
        lines.append(
            HEAD + "memory_utils.py:49 - [Rank 0] Memory-Usage after offload model: "
            "{'gpu': '0', 'total_GB': 79.18, 'used_GB': 3.68, 'host_free_GB': 113.59}"
        )
        lines.append(
            HEAD
            + f"train_metric_utils.py:401 - perf {step}: {{'perf/sleep_time': {s}, 'perf/wake_up_time': {w}, "
            f"'perf/update_weights_time': 0.05, 'perf/rollout_time': 0.3, 'perf/train_time': 0.6, "
            f"'perf/step_time': {t}}}"
        )
    for code in checker:
        lines.append(
            f'(SGLangEngine pid=1) [2026-12-06 10:28:25] INFO:     1.2.3.4:5 - "POST /weights_checker HTTP/1.1" {code} OK'
        )
    lines.append(
        HEAD + "train_metric_utils.py:401 - perf 9: {'perf/sleep_time': 0.5,"
    )  # a line Ray cut short
    return "\n".join(lines) + "\n"


def test_the_table_puts_plain_beside_wrapped_and_judges_the_targets(
    report_module: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0, 1.5], [0.4, 0.7], [3.0, 2.9], [200, 200, 200]))
    (tmp_path / "wrapped.log").write_text(job_log([0.05, 0.1], [0.03, 0.04], [3.1, 2.0], [200, 200, 400]))
    text = report_module.report(tmp_path)
    assert "| 0 | 1.000 / 0.050 | 0.400 / 0.030 |" in text
    assert "1.400 / 0.080 (17.5x)" in text and "2.200 / 0.140 (15.7x)" in text
    assert "15.7x to 17.5x (target: at least 10x every step: met)" in text
    assert "step time wrapped no higher than plain: MISSED at step(s) 0" in text
    assert "0.250 / 0.250" in text and "0.500 / 0.500" in text and "0.125 / 0.125" in text
    assert "/weights_checker calls, plain: 3 (all 200)" in text
    assert "/weights_checker calls, wrapped: 3 (NOT all 200)" in text
    assert "(GB), wrapped: [3.68, 3.68]" in text
    assert "steps: plain 2, wrapped 2" in text  # the cut line is no step


def test_a_missed_speed_target_says_so(report_module: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "wrapped.log").write_text(job_log([0.5], [0.03], [2.0], [200]))
    text = report_module.report(tmp_path)
    assert "2.6x to 2.6x (target: at least 10x every step: MISSED)" in text
    assert "step time wrapped no higher than plain: met" in text


def test_the_budget_job_is_named_as_the_budget_job(report_module: ModuleType, tmp_path: Path) -> None:
    """`report OUT budget` reads budget.log and says so in every line it judges (the H100 run of 2026-12-07
    printed the budget job's figures under 'wrapped')."""
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "wrapped.log").write_text(job_log([0.5], [0.03], [2.0], [200, 200]))
    (tmp_path / "budget.log").write_text(job_log([0.001], [0.005], [1.5], [200, 200, 200, 200]))
    text = report_module.report(tmp_path, "budget")
    assert "sleep + wake, plain / budget |" in text
    assert "steps: plain 1, budget 1" in text
    assert "sleep + wake, plain over budget: 233.3x to 233.3x (target: at least 10x every step: met)" in text
    assert "step time budget no higher than plain: met" in text
    assert "/weights_checker calls, budget: 4 (all 200)" in text  # budget.log's, not wrapped.log's
    assert "(GB), budget: [3.68]" in text
    assert "wrapped" not in text


def test_the_wrapped_trainers_sleeps_come_from_the_lifecycle_log(
    report_module: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "wrapped.log").write_text(job_log([0.5], [0.03], [2.0], [200]))
    logs = tmp_path / "lifecycle-logs"
    logs.mkdir()
    events = [
        {"event": "lifecycle.configured"},
        {
            "event": "lifecycle.transition",
            "operation": "train",
            "plan": "sleep",
            "duration_ms": 489.1,
            "hooks": [{"name": "clear_memory", "ms": 23.6}, {"name": "process_groups.destroy", "ms": 462.6}],
        },
        {
            "event": "lifecycle.transition",
            "operation": "train",
            "plan": "wake",
            "duration_ms": 28.5,
            "hooks": [],
        },
    ]
    (logs / "actor-rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = report_module.report(tmp_path)
    assert "| 0 | train | 489.1 | clear_memory 23.6, process_groups.destroy 462.6 |" in text
    assert "| 1 |" not in text.split("from the lifecycle's log")[1]  # the wake is no sleep


def test_without_the_job_logs_it_says_what_to_run(report_module: ModuleType, tmp_path: Path) -> None:
    assert "run scripts/slime_e2e.sh plain and wrapped first" in report_module.report(tmp_path)
    assert report_module.main([]) == 2


def test_the_budget_job_beside_plain(report_module: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "budget.log").write_text(job_log([0.01], [0.01], [2.0], [200]))
    text = report_module.report(tmp_path, "budget")
    assert "plain / budget" in text and "70.0x to 70.0x (target: at least 10x every step: met)" in text
    assert "run scripts/slime_e2e.sh plain and budget first" in report_module.report(
        tmp_path / "none", "budget"
    )


def test_the_check_of_every_push_is_counted_and_a_difference_named(
    report_module: ModuleType, tmp_path: Path
) -> None:
    """What the wrapped trainer says of each push it checks (`RL_LIFECYCLE_CHECK_WEIGHTS=every`)."""
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    said = (
        "(MegatronTrainRayActor pid=7) [rl-lifecycle] weights check, update {}: equal ({} ms: snapshot, ...)"
    )
    lines = [said.format(2, 80.5), said.format(3, 60.25), said.format(4, 70.0)]
    error = (
        "ray.exceptions.RayTaskError(EngineWeightsCheckError): EngineWeightsCheckError: weight update 5: the "
        "engines' weights differ"
    )
    (tmp_path / "wrapped.log").write_text(
        job_log([0.1], [0.1], [2.0], [200]) + "\n".join([*lines, error, error])
    )
    text = report_module.report(tmp_path)
    assert (
        "- the lifecycle's check of every push (RL_LIFECYCLE_CHECK_WEIGHTS=every), wrapped: 3 update(s) equal "
        "(2, 3, 4; 70.0 ms median each), 1 different\n  - weight update 5: the engines' weights differ"
        in text
    )
    (tmp_path / "wrapped.log").write_text(job_log([0.1], [0.1], [2.0], [200]))
    assert "check of every push" not in report_module.report(tmp_path)


def run_report_step(out: Path) -> subprocess.CompletedProcess[str]:
    """`scripts/slime_e2e.sh report`, the device's `report` step, on the logs in `out`."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(
        ["bash", str(repo / "scripts" / "slime_e2e.sh"), "report"],
        env={**os.environ, "OUT": str(out), "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_report_step_puts_the_budget_job_beside_plain_without_a_wrapped_job(tmp_path: Path) -> None:
    """On the H100 of 2026-12-07 the report step ran after plain and budget, before wrapped, and printed
    nothing: it compared budget only when wrapped.log was there too."""
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "budget.log").write_text(job_log([0.001], [0.005], [1.5], [200]))
    logs = tmp_path / "lifecycle-logs-budget"
    logs.mkdir()
    configured = {  # the first line of the budget job's log on the H100, its memory fields left out
        "event": "lifecycle.configured",
        "rank": 0,
        "role": "actor",
        "step": None,
        "policy": {
            "offload_train": True,
            "destroy_process_groups": True,
            "auto_wake": True,
            "model_tag": "actor",
        },
        "hooks": [
            "clear_memory",
            "memory.budget_check",
            "memory.pause",
            "memory.resume",
            "process_groups.destroy",
        ],
        "state": "AWAKE",
        "residency": {"*": "resident"},
        "groups": "alive",
        "contents": {"*": "valid"},
        "weight_version": None,
        "communicators": "destroy",
    }
    (logs / "actor-rank0.jsonl").write_text(json.dumps(configured) + "\n")
    done = run_report_step(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "## slime's own metrics per step, plain / budget" in done.stdout
    assert "plain / wrapped" not in done.stdout
    assert "lifecycle check: 1 file(s), 1 event(s), 1 machine(s): clean" in done.stdout + done.stderr


def test_the_report_step_fails_on_a_job_without_its_lifecycle_logs(tmp_path: Path) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    (tmp_path / "wrapped.log").write_text(job_log([0.5], [0.03], [2.0], [200]))
    done = run_report_step(tmp_path)
    assert done.returncode != 0
    assert "lifecycle-logs does not exist" in done.stderr


def test_the_report_step_says_when_there_is_nothing_to_compare(tmp_path: Path) -> None:
    (tmp_path / "plain.log").write_text(job_log([1.0], [0.4], [3.0], [200]))
    done = run_report_step(tmp_path)
    assert done.returncode == 0
    assert "nothing to put side by side" in done.stdout

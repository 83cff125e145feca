"""What slime's and miles' job suites share (test_slime_job_source.py, test_miles_job_source.py): the
tiny model both jobs train and the command line both parsers read for it, the module's stage (the
framework's tree, the model, a Ray head), the job's lifecycle logs and perf lines read back, and the
checks both make of a job run under the launch switch.

miles is slime's maintained fork: its driver is slime's, so a suite's test class subclasses
`LaunchSwitchJobSuite` (its `ran` fixture: the run, each role's lifecycle log, `lifecycle check`'s
output) and `RefusalsSuite` (its `refused` runs the job with an unknown half).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.helpers.cli import lifecycle
from tests.helpers.sglang_server import FakeRouter
from tests.helpers.slime_job import JobRun, SlimeJob, ray_head

ROOT = Path(__file__).resolve().parents[3]
TINY = ("--hidden", "64", "--layers", "1", "--vocab", "300", "--prompts", "8")
# Megatron-LM's flags for the TINY model: the framework's check of the HF config against them passes.
TINY_MEGATRON = (
    *("--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "2"),
    *("--group-query-attention", "--num-query-groups", "1", "--norm-epsilon", "1e-6"),
    *("--rotary-base", "10000", "--swiglu", "--disable-bias-linear", "--add-qkv-bias"),
    *("--normalization", "RMSNorm", "--position-embedding-type", "rope"),
)


def tiny_model(out: Path) -> Path:
    """scripts/make_tiny_qwen2.py's TINY model and prompt set under `out`; the model's directory."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_qwen2.py"), str(out), *TINY],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out / "model"


def job_argv(model: Path, prompts: Path, router: FakeRouter, *extra: str) -> list[str]:
    """The command line slime's parser and miles' both read for a job on the tiny model (Megatron-LM's
    flags from the stand-in parser): one actor GPU, one engine of one GPU behind `router`, two prompts
    of two samples a step, a save every step; `extra`, the framework's and the test's own."""
    return [
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"),
        *("--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1", "--hf-checkpoint", str(model)),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"),
        *("--rollout-max-response-len", "8", "--save-interval", "1"),
        *("--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label"),
        *("--apply-chat-template", "--rm-type", "random"),
        *TINY_MEGATRON,
        *("--sglang-mem-fraction-static", "0.5"),
        *("--sglang-router-ip", router.host, "--sglang-router-port", str(router.port)),
        *extra,
    ]


def staged(
    build: Callable[[Any, Path], SlimeJob], source: Any, root: Path, **head: int
) -> Iterator[tuple[SlimeJob, Any, Path]]:
    """A suite's stage, for its module fixture to yield from: the framework's tree (`build(source, root)`;
    a source that is no git checkout holding the commit skips the suite), the tiny model, and a Ray head
    with `head`'s resources while the suite runs."""
    try:
        job = build(source, root)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"{source.location} is not a git checkout holding {source.commit}: {exc.stderr!r}")
    tiny_model(root / "tiny")
    with ray_head(root, **head) as started:
        yield job, started, root / "tiny"


def logs(job: SlimeJob) -> dict[str, list[dict[str, Any]]]:
    """Each lifecycle log the job wrote (by file stem, e.g. "actor-rank0"): its events."""
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(job.logs.glob("*.jsonl"))
    }


def transitions(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["operation"], e["plan"], e["dst"]) for e in events if e["event"] == "lifecycle.transition"]


def perf_reports(output: str) -> list[dict[str, Any]]:
    """What slime's log_perf_data (miles' log_perf_data_raw) sent to its tracking, from its own log
    line (`perf N: {...}`)."""
    return [
        ast.literal_eval(line.split(" - perf ", 1)[1].split(": ", 1)[1])
        for line in output.splitlines()
        if "train_metric_utils.py" in line and " - perf " in line
    ]


def check(job: SlimeJob) -> str:
    """`lifecycle check` over the job's logs: its output."""
    done = lifecycle("check", *map(str, sorted(job.logs.glob("*.jsonl"))), timeout=120)
    return done.stdout + done.stderr


class LaunchSwitchJobSuite:
    """A framework's own driver run as a job under the launch switch; the subclass's `ran` fixture is
    (the run, each role's lifecycle log, `check`'s output) and `roles` the logs the job writes."""

    roles: ClassVar[tuple[str, ...]]

    @staticmethod
    def check_runs_to_its_end(ran: Any) -> None:
        result, _, _ = ran
        assert result.returncode == 0, result.output[-8000:]

    @staticmethod
    def check_says(output: str, *lines: str) -> None:
        """The job's output says each of `lines` (which class runs as which, and where)."""
        for line in lines:
            assert line in output

    def check_logs(self, ran: Any) -> dict[str, list[tuple[str, str, str]]]:
        """One lifecycle log per role, all clean by `lifecycle check`: each role's transitions."""
        _, found, checked = ran
        assert sorted(found) == list(self.roles)
        assert f"{len(self.roles)} machine(s): clean" in checked, checked
        return {role: transitions(events) for role, events in found.items()}

    @staticmethod
    def check_two_steps(actor: list[Any], engine: list[Any]) -> None:
        """Two steps of the colocated driver: the first push and one per step, the engine's offload at
        the start and after each rollout."""
        assert actor.count(("sync", "groups_up", "SYNCING")) == 3
        assert engine.count(("sleep", "sleep", "PAUSED")) == 3

    @staticmethod
    def check_perf(output: str) -> list[dict[str, Any]]:
        """One perf report per step (from the actor's train): the framework's own sleep and wake timers
        are there, and the lifecycle's per-phase figures with them."""
        reports = perf_reports(output)
        assert len(reports) == 2, output[-4000:]
        for report in reports:
            assert report["perf/sleep_time"] > 0 and report["perf/wake_up_time"] > 0
            assert "perf/lifecycle_sleep_process_groups_destroy_time" in report
            assert "perf/lifecycle_wake_memory_resume_time" in report
        return reports


class RefusalsSuite:
    """`RL_LIFECYCLE_WRAP=actor`: the subclass's `refused(stage)` runs its job so; `check_nothing_ran` what
    would show an actor had started."""

    def refused(self, stage: Any) -> tuple[JobRun, SlimeJob]:
        raise NotImplementedError

    def check_nothing_ran(self, result: JobRun, job: SlimeJob) -> None:
        raise NotImplementedError

    def test_an_unknown_half_is_refused_before_any_actor_runs(self, stage: Any) -> None:
        result, job = self.refused(stage)
        assert result.returncode != 0
        assert "RL_LIFECYCLE_WRAP='actor': 'actor' is not a half of the job" in result.output
        self.check_nothing_ran(result, job)

"""slime's real `train.py`, run as a job on a real Ray cluster, switched on the way the docs say.

`ray start --head` (a fake GPU on this CPU machine), then the driver started as `ray job submit
--runtime-env-json '{"worker_process_setup_hook": "actor_integration.frameworks.launch.slime",
"env_vars": {..., "RL_LIFECYCLE_WRAP": "trainer,rollout"}}' -- python3 train.py` starts it. slime's
own driver order runs unchanged: Ray started by `create_placement_groups`, the rollout manager with
its SGLang engine actors (slime's real `SGLangEngine` over a fake server), the trainers, the first
weight push, and the job's end. Stand-ins only where a GPU, Megatron-LM or SGLang is needed
(tests/helpers/slime_job). A documented launch that breaks slime's driver (the "ray.init twice" of
`ray.init(runtime_env=...)` before `create_rollout_manager`) fails here.

Needs slime's source as a git checkout or git directory (CI has none: the suite skips there):

    RL_LIFECYCLE_SLIME_SOURCE=/path/to/slime python -m pytest tests/actor_integration/frameworks/slime/test_slime_job_source.py
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from actor_integration.rollout.server_watch import pid_alive
from tests.actor_integration.frameworks import job_source_suite as suite
from tests.actor_integration.frameworks.job_source_suite import LaunchSwitchJobSuite, RefusalsSuite
from tests.helpers import slime_job
from tests.helpers.framework_source import suite_source
from tests.helpers.sglang_server import VERSION_ENV, FakeRouter, fake_state
from tests.helpers.slime_source import SlimeSource

SOURCE: SlimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(SlimeSource, "slime's")
pytestmark = [pytestmark, pytest.mark.ray]


def job_argv(model: Path, prompts: Path, router: FakeRouter, *extra: str) -> list[str]:
    """slime's command line for a colocated one-GPU PPO job (actor, critic, one engine) on the tiny model
    (job_source_suite's, slime's own parser reading it)."""
    return suite.job_argv(
        model,
        prompts,
        router,
        *("--num-gpus-per-node", "1", "--colocate", "--advantage-estimator", "ppo", "--num-rollout", "2"),
        *("--save", str(model.parent / "checkpoints"), *extra),
    )


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Any:
    assert SOURCE is not None
    yield from suite.staged(slime_job.build, SOURCE, tmp_path_factory.mktemp("slime-job"), cpus=6)


def _run(
    stage: Any,
    *extra: str,
    wrap: str | None = "trainer,rollout",
    env: dict[str, str] | None = None,
    before_forward: Callable[[str], None] | None = None,
) -> tuple[slime_job.JobRun, Any]:
    job, head, tiny = stage
    for old in job.logs.glob("*.jsonl"):
        old.unlink()
    runtime = slime_job.runtime_env(job, wrap=wrap, extra_env={VERSION_ENV: "0.5.17", **(env or {})})
    router = FakeRouter()  # one per job: slime's dispose leaves its engines registered
    router.before_forward = before_forward
    try:
        argv = job_argv(tiny / "model", tiny / "prompts.jsonl", router, *extra)
        return slime_job.run(job, head, argv, env=runtime, timeout_s=900), job
    finally:
        router.close()


class TestSlimesOwnJobUnderTheLaunchSwitch(LaunchSwitchJobSuite):
    """Two PPO steps of slime's own driver: actor, critic and engine under the lifecycle."""

    roles = ("actor-rank0", "critic-rank0", "rollout-rank0")

    @pytest.fixture(scope="class")
    def ran(self, stage: Any) -> tuple[slime_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        result, job = _run(stage)
        return result, suite.logs(job), suite.check(job)

    def test_slimes_driver_runs_to_its_end(self, ran: Any) -> None:
        self.check_runs_to_its_end(ran)

    def test_the_job_says_which_classes_are_wrapped_where(self, ran: Any) -> None:
        self.check_says(
            ran[0].output,
            "slime job: RL_LIFECYCLE_WRAP=trainer,rollout: MegatronTrainRayActor (actor and critic)",
            "slime: slime.backends.megatron_utils.actor.MegatronTrainRayActor (actor and critic) runs as "
            "LifecycleMegatronTrainRayActor (SlimeLifecycleMixin)",
            "slime: slime.ray.rollout.SGLangEngine (rollout engines) runs as LifecycleSGLangEngine",
            "slime preflight: fits: 1 GPU(s) of 1, 3 CPU(s) of 6",
        )

    def test_actor_critic_and_engine_each_ran_under_the_lifecycle_and_their_logs_check_clean(
        self, ran: Any
    ) -> None:
        found = self.check_logs(ran)
        critic, actor, engine = (found[f"{role}-rank0"] for role in ("critic", "actor", "rollout"))
        assert critic[0] == ("sleep", "sleep", "PAUSED")  # the sleep that ends slime's init
        assert ("train", "wake", "AWAKE") in critic and ("save", "sleep", "PAUSED") in critic
        self.check_two_steps(actor, engine)  # slime's offload at start and after each rollout
        assert actor[-1][2] == "PAUSED" and critic[-1][2] == "PAUSED"
        assert ("wake_up", "wake", "AWAKE") in engine

    def test_slimes_own_perf_metrics_keep_sleep_and_wake_and_gain_the_lifecycles(self, ran: Any) -> None:
        for report in self.check_perf(ran[0].output):
            assert report["perf/lifecycle_sleep_time"] == pytest.approx(report["perf/sleep_time"])

    def test_the_missing_retained_backup_of_slimes_fork_is_a_logged_decision(self, ran: Any) -> None:
        _, logs, _ = ran
        for role in ("actor-rank0", "critic-rank0"):
            (configured,) = [e for e in logs[role] if e["event"] == "lifecycle.configured"]
            assert "retain_cpu_backup" in configured["memory_capabilities"]["missing"]
            assert any(
                "retain_cpu_backup was asked for" in n and "5.75 s" in n for n in configured["memory_notes"]
            )


class TestEveryPushChecked:
    """`RL_LIFECYCLE_CHECK_WEIGHTS=every` in the job's runtime env, with slime's `--check-weight-update-equal`:
    slime's driver checks the first push; the wrapped actor each later one, through slime's own
    RolloutManager.check_weights and SGLangEngine's `/weights_checker` requests (the fake server answers
    them; a difference found is `EngineWeightsCheckError`, tests/.../test_slime_source.py)."""

    @pytest.fixture(scope="class")
    def ran(self, stage: Any) -> slime_job.JobRun:
        result, _ = _run(stage, "--check-weight-update-equal", env={"RL_LIFECYCLE_CHECK_WEIGHTS": "every"})
        return result

    def test_the_job_says_so_and_runs_to_its_end(self, ran: slime_job.JobRun) -> None:
        assert ran.returncode == 0, ran.output[-8000:]
        assert (
            "RL_LIFECYCLE_CHECK_WEIGHTS=every: each weight update is pushed twice and compared" in ran.output
        )
        assert "the first by slime's own --check-weight-update-equal" in ran.output

    def test_each_push_after_slimes_first_is_checked_once(self, ran: slime_job.JobRun) -> None:
        checked = [int(v) for v in re.findall(r"weights check, update (\d+): equal", ran.output)]
        assert checked == [2, 4], ran.output[-8000:]  # pushes 2 and 3 of the job; each check pushes once more

    def test_the_checks_time_is_its_own_in_slimes_perf_metrics(self, ran: slime_job.JobRun) -> None:
        """slime reports its timers at each train: the check after step 0's push is in step 1's report (as
        that push's perf/update_weights_time is), none before it."""
        first, second = suite.perf_reports(ran.output)
        assert "perf/lifecycle_weights_check_time" not in first
        assert second["perf/lifecycle_weights_check_time"] > 0 and second["perf/update_weights_time"] > 0


class TestRefusals(RefusalsSuite):
    def refused(self, stage: Any) -> tuple[slime_job.JobRun, Any]:
        return _run(stage, wrap="actor")

    def check_nothing_ran(self, result: slime_job.JobRun, job: Any) -> None:
        assert "LifecycleMegatronTrainRayActor" not in result.output

    def test_a_fault_the_job_cannot_arm_is_refused_before_any_actor_runs(self, stage: Any) -> None:
        result, _ = _run(stage, env={"RL_LIFECYCLE_FAULT": "trainer:generation.pause@1"})
        assert result.returncode != 0
        assert (
            "LaunchConfigError: RL_LIFECYCLE_FAULT='trainer:generation.pause@1': slime's trainer never calls "
            "generation.pause" in result.output
        )
        assert "LifecycleMegatronTrainRayActor" not in result.output


class TestDebugRolloutOnly:
    def test_slimes_debug_rollout_only_runs_under_the_wrap(self, stage: Any) -> None:
        """slime's init returns before `role` is set; the driver's first update_weights raised
        AttributeError under the wrap. The job now runs its rollouts to the end."""
        result, job = _run(stage, "--debug-rollout-only")
        assert result.returncode == 0, result.output[-8000:]
        assert "AttributeError" not in result.output
        assert sorted(p.stem for p in job.logs.glob("*.jsonl")) == ["rollout-rank0"]


# ---------------------------------------------------------------------------------------------- faults


class KillServerAt:
    """The router's hook: SIGKILL the engine's server process as the `at`-th rollout request reaches
    the router, before it is forwarded (mid-rollout: the rollout's other requests are in flight)."""

    def __init__(self, at: int, head: slime_job.RayHead) -> None:
        self.at, self.seen, self.head = at, 0, head
        self.pid: int | None = None
        self.killed_at: float | None = None
        self.running: list[str] = []  # the job's actors when the server was killed
        self.lock = threading.Lock()

    def __call__(self, url: str) -> None:
        with self.lock:
            self.seen += 1
            if self.seen != self.at:
                return
            self.pid = int(fake_state(url)["pid"])
            self.running = _job_actors(self.head)
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()


def _job_actors(head: slime_job.RayHead) -> list[str]:
    """The job's actors still running under the Ray head (the rollout manager, engines, trainers)."""
    left = []
    started = set(slime_job.session_pids(head.process.pid))  # every process `ray start` started
    with contextlib.suppress(psutil.Error):
        started |= {p.pid for p in psutil.Process(head.process.pid).children(recursive=True)}
    for pid in sorted(started):
        with contextlib.suppress(psutil.Error):
            title = " ".join(psutil.Process(pid).cmdline())
            if title.startswith("ray::") and any(
                name in title for name in ("RolloutManager", "SGLangEngine", "TrainRayActor")
            ):
                left.append(f"{pid} {title}")
    return left


def _gone(head: slime_job.RayHead, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _job_actors(head)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


class TestFaultsInsideTheJob:
    """`RL_LIFECYCLE_FAULT` set in the job's runtime env, and the engine's server killed mid-rollout:
    slime's own driver stops on a typed error, within a deadline, and nothing of the job runs on."""

    @pytest.fixture(scope="class")
    def hook_fault(self, stage: Any) -> tuple[slime_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        # The trainers' second pause: the sleep that ends rollout 0's train (the first ends slime's init).
        result, job = _run(stage, env={"RL_LIFECYCLE_FAULT": "trainer:memory.pause@2"})
        return result, suite.logs(job), suite.check(job)

    def test_a_hook_failure_stops_the_job_naming_the_rank_the_transition_and_the_residency(
        self, hook_fault: Any
    ) -> None:
        result, _, _ = hook_fault
        out = result.output
        assert result.returncode != 0
        assert "RL_LIFECYCLE_FAULT=trainer:memory.pause@2: call 2 of memory.pause raises" in out
        typed = re.search(
            r"LifecycleFailedError: lifecycle of (actor|critic) rank 0 is FAILED since hook memory\.pause\S* raised "
            r"InjectedFault\('injected fault in memory\.pause \(call 2, before effect\)'\) during train \(exit\) "
            r"from AWAKE; residency \{[^}]+\}, groups destroyed\.",
            out,
        )
        assert typed is not None, out[-6000:]
        assert not suite.perf_reports(out)  # no train step finished: the job stopped at its first

    def test_lifecycle_check_reports_each_failed_trainer_and_finds_the_logs_clean(
        self, hook_fault: Any
    ) -> None:
        """The critic trains first (the actor's train waits for its values), so it fails first and the
        actor's train may never run: every trainer whose log has the failure is reported, none else."""
        _, logs, check = hook_fault
        failed = {role: [e for e in logs[role] if e["event"] == "lifecycle.failed"] for role in logs}
        trainers = sorted(role for role, events in failed.items() if events)
        assert trainers and set(trainers) <= {"actor-rank0", "critic-rank0"}, failed
        for role in trainers:
            (event,) = failed[role]
            assert (event["hook"], event["operation"], event["phase"]) == ("memory.pause", "train", "exit")
            assert f"{role}.jsonl rank 0 {role.split('-')[0]}: ends FAILED (line " in check
        assert f"3 machine(s): clean; {len(trainers)} ended FAILED" in check, check

    @pytest.fixture(scope="class")
    def engine_death(
        self, stage: Any
    ) -> tuple[slime_job.JobRun, dict[str, list[dict[str, Any]]], KillServerAt, float, str]:
        kill = KillServerAt(
            5, stage[1]
        )  # the first request of rollout 1 (4 a rollout: 2 prompts x 2 samples)
        result, job = _run(stage, before_forward=kill)
        ended = time.monotonic()
        return result, suite.logs(job), kill, ended, suite.check(job)

    def test_a_server_killed_mid_rollout_ends_the_job_with_engine_died_within_a_deadline(
        self, engine_death: Any
    ) -> None:
        result, _, kill, ended, _ = engine_death
        out = result.output
        assert kill.pid is not None and kill.killed_at is not None, out[-4000:]
        assert result.returncode != 0
        # slime's own retries of a dead server take a minute (60 tries a second apart, per request)
        assert ended - kill.killed_at < 30, out[-4000:]
        assert (
            f"EngineDiedError: SGLang's server process (pid {kill.pid}, exit code -9) of rollout engine 0 at "
            in out
        ), out[-6000:]
        assert "died; noticed during slime's rollout 1 (generate) after " in out

    def test_nothing_of_the_job_is_left_running(self, engine_death: Any, stage: Any) -> None:
        _, _, kill, _, _ = engine_death
        assert kill.pid is not None and not pid_alive(kill.pid)
        assert any("RolloutManager" in title for title in kill.running), kill.running  # seen while it ran
        assert _gone(stage[1]) == []

    def test_the_engine_logged_the_death_and_its_log_checks_clean(self, engine_death: Any) -> None:
        _, logs, kill, _, check = engine_death
        (died,) = [e for e in logs["rollout-rank0"] if e["event"] == "rollout.server_died"]
        assert (died["process"], died["pid"], died["exitcode"]) == ("server", kill.pid, -9)
        assert died["call"] == "the rollout manager's watch"
        assert "rank 0 rollout: its engine SGLang http://" in check, check
        assert f"died: server (pid {kill.pid}, exit code -9) during the rollout manager's watch" in check, (
            check
        )
        assert "clean; 1 engine(s) died" in check, check

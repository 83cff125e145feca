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

from pathlib import Path
from typing import Any

import pytest

from tests.actor_integration.frameworks import job_source_suite as suite
from tests.actor_integration.frameworks.job_source_suite import LaunchSwitchJobSuite, RefusalsSuite
from tests.helpers import slime_job
from tests.helpers.framework_source import suite_source
from tests.helpers.sglang_server import VERSION_ENV, FakeRouter
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


def _run(stage: Any, *extra: str, wrap: str | None = "trainer,rollout") -> tuple[slime_job.JobRun, Any]:
    job, head, tiny = stage
    for old in job.logs.glob("*.jsonl"):
        old.unlink()
    env = slime_job.runtime_env(job, wrap=wrap, extra_env={VERSION_ENV: "0.5.17"})
    router = FakeRouter()  # one per job: slime's dispose leaves its engines registered
    try:
        argv = job_argv(tiny / "model", tiny / "prompts.jsonl", router, *extra)
        return slime_job.run(job, head, argv, env=env, timeout_s=900), job
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


class TestRefusals(RefusalsSuite):
    def refused(self, stage: Any) -> tuple[slime_job.JobRun, Any]:
        return _run(stage, wrap="actor")

    def check_nothing_ran(self, result: slime_job.JobRun, job: Any) -> None:
        assert "LifecycleMegatronTrainRayActor" not in result.output


class TestDebugRolloutOnly:
    def test_slimes_debug_rollout_only_runs_under_the_wrap(self, stage: Any) -> None:
        """slime's init returns before `role` is set; the driver's first update_weights raised
        AttributeError under the wrap. The job now runs its rollouts to the end."""
        result, job = _run(stage, "--debug-rollout-only")
        assert result.returncode == 0, result.output[-8000:]
        assert "AttributeError" not in result.output
        assert sorted(p.stem for p in job.logs.glob("*.jsonl")) == ["rollout-rank0"]

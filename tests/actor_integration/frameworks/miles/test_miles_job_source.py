"""miles' real `train.py` and `train_async.py`, run as jobs on a real Ray cluster, switched on the way the docs say.

`ray start --head` (fake GPUs on this CPU machine), then each driver started as miles' scripts start
it (`ray job submit --runtime-env-json '{"env_vars": {...}}' -- python3 train.py ...`,
miles/utils/external_utils/command_utils.py), with the one documented change: the runtime env's
`"worker_process_setup_hook": "actor_integration.frameworks.launch.miles"` and `RL_LIFECYCLE_WRAP`.
miles' own driver order runs unchanged (miles 31f1ca96): Ray started by `create_placement_groups`,
miles' rollout manager with its SGLang engine actors (miles' real `SGLangEngine` over a fake
server), the trainers, the first weight push, the steps, the job's end. Stand-ins only where a
GPU, Megatron-LM or SGLang is needed (tests/helpers/miles_job, reusing tests/helpers/slime_job).

`train_async.py` refuses `--colocate` ("Colocation is not supported for async training."), so it
runs as miles allows it: actor and engine on GPUs of their own (two fake GPUs), no offload; its
overlap (rollout N+1 generated while step N trains) is checked from the job's own timestamps.

Needs miles' source as a git checkout or git directory (CI has none: the suite skips there):

    RL_LIFECYCLE_MILES_SOURCE=/path/to/miles python -m pytest tests/actor_integration/frameworks/miles/test_miles_job_source.py
"""

from __future__ import annotations

import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.actor_integration.frameworks import job_source_suite as suite
from tests.actor_integration.frameworks.job_source_suite import LaunchSwitchJobSuite, RefusalsSuite
from tests.helpers import miles_job
from tests.helpers.framework_source import suite_source
from tests.helpers.miles_job import stand_ins
from tests.helpers.miles_source import MilesSource
from tests.helpers.sglang_server import VERSION_ENV, FakeRouter

SOURCE: MilesSource | None
SOURCE, pytestmark, _source_readable = suite_source(MilesSource, "miles'")
pytestmark = [pytestmark, pytest.mark.ray]

TRAINER = (
    "miles: miles.backends.megatron_utils.actor.MegatronTrainRayActor (actor and critic, train.py and "
    "train_async.py) runs as LifecycleMegatronTrainRayActor (MilesLifecycleMixin) in this process (pid {pid})"
)
ENGINE = (
    "miles: miles.ray.rollout.server_group.SGLangEngine (rollout engines) runs as LifecycleSGLangEngine "
    "(SGLangActorLifecycle) in this process (pid {pid})"
)


def job_argv(model: Path, prompts: Path, router: FakeRouter, *extra: str) -> list[str]:
    """miles' command line for a GRPO job (actor, one engine) on the tiny model (job_source_suite's, miles'
    own parser reading it; miles' own validation passes)."""
    return suite.job_argv(
        model,
        prompts,
        router,
        *("--advantage-estimator", "grpo", "--save", str(model.parent / "ckpt")),
        *("--distributed-backend", "gloo", *extra),
    )


COLOCATED = (
    "--num-gpus-per-node",
    "1",
    "--colocate",
    "--offload-train",
    "--offload-rollout",
    "--num-rollout",
    "2",
)
ASYNC = ("--num-gpus-per-node", "2", "--num-rollout", "3")  # train_async.py: no --colocate


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Any:
    assert SOURCE is not None
    root = tmp_path_factory.mktemp("miles-job")
    # Room for both drivers' jobs at once.
    yield from suite.staged(miles_job.build, SOURCE, root, cpus=8, gpus=3)


def _pid_of(output: str, actor: str) -> str:
    (pid,) = set(re.findall(rf"\({actor} pid=(\d+)\)", output))
    return pid


def _stamp(line: str) -> float:
    """The wall-clock time of one of miles' log lines (`[YYYY-MM-DD HH:MM:SS.mmm <source>]`)."""
    found = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ", line)
    assert found is not None, line
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _train_intervals(output: str) -> list[tuple[float, float]]:
    """Each `train` call of the actor, from miles' own structured start/end lines."""
    starts = [_stamp(x) for x in output.splitlines() if "fn=train phase=start" in x]
    ends = [_stamp(x) for x in output.splitlines() if "fn=train phase=end" in x]
    assert len(starts) == len(ends), output[-3000:]
    return list(zip(starts, ends, strict=True))


def _generate_intervals(output: str) -> list[tuple[float, float]]:
    return [
        (float(a), float(b))
        for a, b in re.findall(re.escape(stand_ins.GENERATED) + r" (\d+\.\d+) (\d+\.\d+)", output)
    ]


def _overlapped(output: str) -> list[bool]:
    """For each train step: whether some /generate request ran while it trained."""
    generates = _generate_intervals(output)
    return [any(a < end and start < b for a, b in generates) for start, end in _train_intervals(output)]


def _run(
    stage: Any,
    script: str,
    *extra: str,
    wrap: str | None = "trainer,rollout",
    env: dict[str, str] | None = None,
    logs: str = "lifecycle-logs",
) -> tuple[miles_job.JobRun, miles_job.SlimeJob]:
    job, head, tiny = stage
    job = dataclasses.replace(job, logs=job.logs.parent / logs)  # one directory per job
    job.logs.mkdir(exist_ok=True)
    for old in job.logs.glob("*.jsonl"):
        old.unlink()
    runtime = miles_job.runtime_env(job, wrap=wrap, extra_env={VERSION_ENV: "0.5.17", **(env or {})})
    router = FakeRouter()  # one per job: miles' dispose leaves its engines registered
    try:
        argv = job_argv(tiny / "model", tiny / "prompts.jsonl", router, *extra)
        return miles_job.run(job, head, argv, env=runtime, timeout_s=600, script=script), job
    finally:
        router.close()


@pytest.fixture(scope="module")
def jobs(stage: Any) -> dict[str, tuple[miles_job.JobRun, dict[str, list[dict[str, Any]]], str]]:
    """train.py and train_async.py, at once on the one cluster (each its own GPUs and log directory)."""
    # train_async: each /generate takes 0.5 s and each train step 0.3 s, as decoding and Megatron's step would.
    times = {stand_ins.GENERATE_SECONDS_ENV: "0.5", stand_ins.TRAIN_SECONDS_ENV: "0.3"}
    with ThreadPoolExecutor(2) as pool:
        colocated = pool.submit(_run, stage, "train.py", *COLOCATED, logs="train-logs")
        # miles picks each engine's port from 15000 in each job: two jobs picking before either server
        # binds would launch two servers on one port, and the loser's engine would drive the winner's
        # (its own server dead: EngineDiedError). The second starts once the first's server is up.
        started = stage[0].logs.parent / "train-logs" / "rollout-rank0.jsonl"  # written when it is
        deadline = time.monotonic() + 300
        while not started.exists() and not colocated.done() and time.monotonic() < deadline:
            time.sleep(0.2)
        overlapped = pool.submit(_run, stage, "train_async.py", *ASYNC, env=times, logs="async-logs")
        done = {"train.py": colocated.result(), "train_async.py": overlapped.result()}
    return {script: (result, suite.logs(job), suite.check(job)) for script, (result, job) in done.items()}


class TestMilesTrainPyUnderTheLaunchSwitch(LaunchSwitchJobSuite):
    """Two GRPO steps of miles' own train.py, colocated on one GPU with both offloads: actor and engine
    under the lifecycle."""

    roles = ("actor-rank0", "rollout-rank0")

    @pytest.fixture(scope="class")
    def ran(self, jobs: Any) -> tuple[miles_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        return jobs["train.py"]  # type: ignore[no-any-return]

    def test_miles_driver_runs_to_its_end(self, ran: Any) -> None:
        self.check_runs_to_its_end(ran)

    def test_each_class_is_replaced_in_the_worker_that_resolves_it_and_says_so(self, ran: Any) -> None:
        out = ran[0].output
        trainer, manager = _pid_of(out, "MegatronTrainRayActor"), _pid_of(out, "RolloutManager")
        self.check_says(
            out,
            "miles job: RL_LIFECYCLE_WRAP=trainer,rollout: MegatronTrainRayActor (actor and critic, train.py "
            "and train_async.py) from miles.backends.megatron_utils.actor; SGLangEngine (rollout engines) "
            "from miles.ray.rollout.server_group under the lifecycle",
            TRAINER.format(pid=trainer),  # unpickling miles' class in the trainer's worker
            ENGINE.format(pid=manager),  # server_group's binding in the rollout manager's worker
            "mark_allocated end new=actor_handle=Actor(LifecycleSGLangEngine",  # miles' own log line
            "miles preflight: fits: 1 GPU(s) of 3",
        )

    def test_actor_and_engine_ran_under_the_lifecycle_and_their_logs_check_clean(self, ran: Any) -> None:
        found = self.check_logs(ran)
        actor, engine = found["actor-rank0"], found["rollout-rank0"]
        self.check_two_steps(actor, engine)  # miles' offload at start and after each rollout
        assert actor[0] == ("sleep", "sleep", "PAUSED")  # the sleep that ends miles' init
        assert actor.count(("wake_up", "wake", "AWAKE")) == 2  # miles' train wakes it through wake_up()
        assert actor.count(("sleep", "sleep", "PAUSED")) == 3  # init's, then miles' offload() after each step
        assert actor.count(("save", None, "SAVING")) == 2
        assert actor[-1] == ("sync", "groups_down", "PAUSED")
        assert (
            engine.count(("wake_up", "wake", "AWAKE")) == 3
        )  # onload_weights, then onload_kv: the last tags

    def test_miles_own_perf_metrics_keep_its_timers_and_gain_the_lifecycles(self, ran: Any) -> None:
        reports = self.check_perf(ran[0].output)
        for report in reports:
            for own in ("sleep", "wake_up", "update_weights", "train", "actor_train", "data_preprocess"):
                assert report[f"perf/{own}_time"] > 0, own
            assert report["perf/lifecycle_sleep_time"] > 0
            assert report["perf/lifecycle_wake_time"] > 0
        assert "perf/save_model_time" in reports[1]

    def test_train_py_never_generates_while_it_trains(self, ran: Any) -> None:
        """The counterpart of train_async's overlap: the same measure finds none in the synchronous driver."""
        assert _overlapped(ran[0].output) == [False, False]


class TestMilesTrainAsyncPyUnderTheLaunchSwitch(LaunchSwitchJobSuite):
    """Three steps of miles' own train_async.py (actor and engine on GPUs of their own, as miles allows it)."""

    roles = ("actor-rank0", "rollout-rank0")

    @pytest.fixture(scope="class")
    def ran(self, jobs: Any) -> tuple[miles_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        return jobs["train_async.py"]  # type: ignore[no-any-return]

    def test_miles_async_driver_runs_to_its_end_with_both_classes_replaced(self, ran: Any) -> None:
        self.check_runs_to_its_end(ran)
        out = ran[0].output
        trainer, manager = _pid_of(out, "MegatronTrainRayActor"), _pid_of(out, "RolloutManager")
        self.check_says(out, TRAINER.format(pid=trainer), ENGINE.format(pid=manager))
        actor = self.check_logs(ran)["actor-rank0"]  # no --offload-train: awake throughout, a sync per push
        assert actor.count(("sync", None, "SYNCING")) == 4  # the first push, then one per step
        assert {dst for _, _, dst in actor} == {"SYNCING", "SAVING", "AWAKE"}

    def test_rollout_of_the_next_step_overlaps_each_train_step_under_the_wrap(self, ran: Any) -> None:
        result, _, _ = ran
        assert len(_train_intervals(result.output)) == 3
        # rollout 1 while step 0 trains, rollout 2 while step 1 trains; the last step has no next rollout.
        assert _overlapped(result.output) == [True, True, False], (
            _train_intervals(result.output),
            _generate_intervals(result.output),
        )


class TestRefusals(RefusalsSuite):
    def refused(self, stage: Any) -> tuple[miles_job.JobRun, miles_job.SlimeJob]:
        return _run(stage, "train.py", *COLOCATED, wrap="actor")

    def check_nothing_ran(self, result: miles_job.JobRun, job: miles_job.SlimeJob) -> None:
        assert (
            "RolloutManager pid=" not in result.output and "MegatronTrainRayActor pid=" not in result.output
        )
        assert not list(job.logs.glob("*.jsonl"))

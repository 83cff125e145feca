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

import ast
import dataclasses
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import miles_job
from tests.helpers.cli import lifecycle
from tests.helpers.framework_source import suite_source
from tests.helpers.miles_job import stand_ins
from tests.helpers.miles_source import MilesSource
from tests.helpers.sglang_server import VERSION_ENV, FakeRouter

SOURCE: MilesSource | None
SOURCE, pytestmark, _source_readable = suite_source(MilesSource, "miles'")
pytestmark = [pytestmark, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[4]
TRAINER = (
    "miles: miles.backends.megatron_utils.actor.MegatronTrainRayActor (actor and critic, train.py and "
    "train_async.py) runs as LifecycleMegatronTrainRayActor (MilesLifecycleMixin) in this process (pid {pid})"
)
ENGINE = (
    "miles: miles.ray.rollout.server_group.SGLangEngine (rollout engines) runs as LifecycleSGLangEngine "
    "(SGLangActorLifecycle) in this process (pid {pid})"
)


TINY = ("--hidden", "64", "--layers", "1", "--vocab", "300", "--prompts", "8")


def _tiny_model(out: Path) -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_qwen2.py"), str(out), *TINY],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out / "model"


def job_argv(model: Path, prompts: Path, router: FakeRouter, *extra: str) -> list[str]:
    """miles' command line for a GRPO job (actor, one engine) on the tiny model: miles' own parser reads
    it (Megatron-LM's flags from the stand-in parser), miles' own validation passes."""
    return [
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"),
        *("--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1"),
        *("--hf-checkpoint", str(model), "--advantage-estimator", "grpo"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"),
        *("--rollout-max-response-len", "8", "--save-interval", "1", "--save", str(model.parent / "ckpt")),
        *("--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label"),
        *("--apply-chat-template", "--rm-type", "random", "--distributed-backend", "gloo"),
        *(
            "--num-layers",
            "1",
            "--hidden-size",
            "64",
            "--ffn-hidden-size",
            "192",
            "--num-attention-heads",
            "2",
        ),
        *("--group-query-attention", "--num-query-groups", "1", "--norm-epsilon", "1e-6"),
        *("--rotary-base", "10000", "--swiglu", "--disable-bias-linear", "--add-qkv-bias"),
        *("--normalization", "RMSNorm", "--position-embedding-type", "rope"),
        *("--sglang-mem-fraction-static", "0.5"),
        *("--sglang-router-ip", router.host, "--sglang-router-port", str(router.port)),
        *extra,
    ]


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
    try:
        job = miles_job.build(SOURCE, root)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"{SOURCE.location} is not a git checkout holding {SOURCE.commit}: {exc.stderr!r}")
    _tiny_model(root / "tiny")
    with miles_job.ray_head(root, cpus=8, gpus=3) as head:  # room for both drivers' jobs at once
        yield job, head, root / "tiny"


def _logs(job: miles_job.SlimeJob) -> dict[str, list[dict[str, Any]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(job.logs.glob("*.jsonl"))
    }


def _transitions(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["operation"], e["plan"], e["dst"]) for e in events if e["event"] == "lifecycle.transition"]


def _perf_reports(output: str) -> list[dict[str, Any]]:
    """What miles' log_perf_data_raw sent to its tracking, from its own log line (`perf N: {...}`)."""
    return [
        ast.literal_eval(line.split(" - perf ", 1)[1].split(": ", 1)[1])
        for line in output.splitlines()
        if "train_metric_utils.py" in line and " - perf " in line
    ]


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


def _check(job: miles_job.SlimeJob) -> str:
    done = lifecycle("check", *map(str, sorted(job.logs.glob("*.jsonl"))), timeout=120)
    return done.stdout + done.stderr


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
    return {script: (result, _logs(job), _check(job)) for script, (result, job) in done.items()}


class TestMilesTrainPyUnderTheLaunchSwitch:
    """Two GRPO steps of miles' own train.py, colocated on one GPU with both offloads: actor and engine
    under the lifecycle."""

    @pytest.fixture(scope="class")
    def ran(self, jobs: Any) -> tuple[miles_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        return jobs["train.py"]  # type: ignore[no-any-return]

    def test_miles_driver_runs_to_its_end(self, ran: Any) -> None:
        result, _, _ = ran
        assert result.returncode == 0, result.output[-8000:]

    def test_each_class_is_replaced_in_the_worker_that_resolves_it_and_says_so(self, ran: Any) -> None:
        out = ran[0].output
        assert (
            "miles job: RL_LIFECYCLE_WRAP=trainer,rollout: MegatronTrainRayActor (actor and critic, train.py "
            "and train_async.py) from miles.backends.megatron_utils.actor; SGLangEngine (rollout engines) "
            "from miles.ray.rollout.server_group under the lifecycle" in out
        )
        trainer, manager = _pid_of(out, "MegatronTrainRayActor"), _pid_of(out, "RolloutManager")
        assert TRAINER.format(pid=trainer) in out  # unpickling miles' class in the trainer's worker
        assert ENGINE.format(pid=manager) in out  # server_group's binding in the rollout manager's worker
        assert "mark_allocated end new=actor_handle=Actor(LifecycleSGLangEngine" in out  # miles' own log line
        assert "miles preflight: fits: 1 GPU(s) of 3" in out

    def test_actor_and_engine_ran_under_the_lifecycle_and_their_logs_check_clean(self, ran: Any) -> None:
        _, logs, check = ran
        assert sorted(logs) == ["actor-rank0", "rollout-rank0"]
        assert "2 machine(s): clean" in check, check
        actor = _transitions(logs["actor-rank0"])
        assert actor[0] == ("sleep", "sleep", "PAUSED")  # the sleep that ends miles' init
        assert actor.count(("wake_up", "wake", "AWAKE")) == 2  # miles' train wakes it through wake_up()
        assert actor.count(("sleep", "sleep", "PAUSED")) == 3  # init's, then miles' offload() after each step
        assert actor.count(("sync", "groups_up", "SYNCING")) == 3  # the first push, then one per step
        assert actor.count(("save", None, "SAVING")) == 2
        assert actor[-1] == ("sync", "groups_down", "PAUSED")
        engine = _transitions(logs["rollout-rank0"])
        assert (
            engine.count(("sleep", "sleep", "PAUSED")) == 3
        )  # miles' offload at start and after each rollout
        assert (
            engine.count(("wake_up", "wake", "AWAKE")) == 3
        )  # onload_weights, then onload_kv: the last tags

    def test_miles_own_perf_metrics_keep_its_timers_and_gain_the_lifecycles(self, ran: Any) -> None:
        reports = _perf_reports(ran[0].output)
        assert len(reports) == 2, ran[0].output[-4000:]  # one per step, from the actor's train
        for report in reports:
            for own in ("sleep", "wake_up", "update_weights", "train", "actor_train", "data_preprocess"):
                assert report[f"perf/{own}_time"] > 0, own
            assert report["perf/lifecycle_sleep_time"] > 0
            assert report["perf/lifecycle_wake_time"] > 0
            assert "perf/lifecycle_sleep_process_groups_destroy_time" in report
            assert "perf/lifecycle_wake_memory_resume_time" in report
        assert "perf/save_model_time" in reports[1]

    def test_train_py_never_generates_while_it_trains(self, ran: Any) -> None:
        """The counterpart of train_async's overlap: the same measure finds none in the synchronous driver."""
        assert _overlapped(ran[0].output) == [False, False]


class TestMilesTrainAsyncPyUnderTheLaunchSwitch:
    """Three steps of miles' own train_async.py (actor and engine on GPUs of their own, as miles allows it)."""

    @pytest.fixture(scope="class")
    def ran(self, jobs: Any) -> tuple[miles_job.JobRun, dict[str, list[dict[str, Any]]], str]:
        return jobs["train_async.py"]  # type: ignore[no-any-return]

    def test_miles_async_driver_runs_to_its_end_with_both_classes_replaced(self, ran: Any) -> None:
        result, logs, check = ran
        assert result.returncode == 0, result.output[-8000:]
        out = result.output
        assert TRAINER.format(pid=_pid_of(out, "MegatronTrainRayActor")) in out
        assert ENGINE.format(pid=_pid_of(out, "RolloutManager")) in out
        assert sorted(logs) == ["actor-rank0", "rollout-rank0"]
        assert "2 machine(s): clean" in check, check
        actor = _transitions(logs["actor-rank0"])  # no --offload-train: awake throughout, a sync per push
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


class TestRefusals:
    def test_an_unknown_half_is_refused_before_any_actor_runs(self, stage: Any) -> None:
        result, job = _run(stage, "train.py", *COLOCATED, wrap="actor")
        assert result.returncode != 0
        assert "RL_LIFECYCLE_WRAP='actor': 'actor' is not a half of the job" in result.output
        assert (
            "RolloutManager pid=" not in result.output and "MegatronTrainRayActor pid=" not in result.output
        )
        assert not list(job.logs.glob("*.jsonl"))

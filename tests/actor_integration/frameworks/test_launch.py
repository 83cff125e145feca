"""The launch switch: a framework job's classes replaced where its workers resolve them, never run
unwrapped once asked for, and the preflight before the engines start.

On a framework laid out as slime's job resolves its classes (`tests/helpers/launch_fake.py`); the
same switch on slime's and miles' own source is in test_launch_source.py and, as a whole job on a
Ray cluster, test_slime_job_source.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actor_integration.actors.mixin import LifecycleMixin
from actor_integration.errors import LaunchConfigError, PreflightError, UnwrappedClassError
from actor_integration.frameworks import launch
from lifecycle import Hooks, LifecyclePolicy
from lifecycle.errors import InjectedFault, LifecycleFailedError
from lifecycle.faults import Fault
from lifecycle.testing import FakeMemorySaver
from tests.helpers import launch_fake
from tests.helpers.launch_fake import FakeLifecycle, launch_for, write_framework

ROOT = Path(__file__).resolve().parents[3]
_names = itertools.count()


@pytest.fixture
def framework(tmp_path: Path) -> Iterator[str]:
    """A fresh fake framework on sys.path (its own name: the switch keeps per-process state)."""
    name = f"fakefw{os.getpid()}_{next(_names)}"
    write_framework(tmp_path, name)
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


class TestWrapVariable:
    def test_unset_or_empty_asks_for_both_halves(self) -> None:
        assert launch.parse_wrap(None) == launch.parse_wrap("") == ("trainer", "rollout")
        assert launch.parse_wrap(" Rollout ") == ("rollout",)
        assert launch.parse_wrap("rollout,trainer") == ("trainer", "rollout")

    def test_an_unknown_half_is_refused_in_one_line(self) -> None:
        with pytest.raises(LaunchConfigError) as caught:
            launch.parse_wrap("actor,critic,rollout")
        message = str(caught.value)
        assert "\n" not in message
        assert "'actor', 'critic' is not a half of the job" in message
        assert "'trainer' puts both under the lifecycle" in message

    def test_an_unknown_preflight_mode_is_refused(self, framework: str) -> None:
        with pytest.raises(LaunchConfigError, match="RL_LIFECYCLE_PREFLIGHT='maybe'"):
            launch.install(launch_for(framework), {"RL_LIFECYCLE_PREFLIGHT": "maybe"})


class TestReplacement:
    def test_each_half_is_replaced_where_the_framework_reads_it_when_its_module_is_imported(
        self, framework: str
    ) -> None:
        assert launch.install(launch_for(framework), {}) == ("trainer", "rollout")
        assert f"{framework}.trainer" not in sys.modules  # nothing imported by the switch itself
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        rollout = __import__(f"{framework}.rollout", fromlist=["Group"])
        assert issubclass(trainer.TrainActor, FakeLifecycle)
        assert issubclass(rollout.Engine, FakeLifecycle)
        assert launch.replaced()[f"{framework}.trainer.TrainActor"] == "LifecycleTrainActor"
        assert isinstance(rollout.start_servers.__wrapped__({"gpus": 1}), FakeLifecycle)

    def test_a_module_imported_before_the_switch_is_replaced_at_once(self, framework: str) -> None:
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        launch.install(launch_for(framework), {"RL_LIFECYCLE_WRAP": "trainer"})
        assert issubclass(trainer.TrainActor, FakeLifecycle)

    def test_a_half_not_asked_for_is_left_alone(self, framework: str) -> None:
        launch.install(launch_for(framework), {"RL_LIFECYCLE_WRAP": "rollout"})
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        assert not issubclass(trainer.TrainActor, FakeLifecycle)
        assert trainer.TrainActor(0).rank == 0  # and not guarded


class TestNeverSilentlyUnwrapped:
    def test_the_frameworks_own_class_refuses_to_be_created_outside_the_lifecycle(
        self, framework: str
    ) -> None:
        launch.install(launch_for(framework), {})
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        original = trainer.TrainActor.__mro__[
            4
        ]  # after the job class, JobLifecycle and the lifecycle class with its mixin
        assert original.__name__ == "TrainActor" and not issubclass(original, FakeLifecycle)

        class OwnActorCls(original):  # a user's actor_cls without the lifecycle
            pass

        with pytest.raises(UnwrappedClassError) as caught:
            OwnActorCls(0)
        message = str(caught.value)
        assert "\n" not in message and "asks for the trainer under the lifecycle" in message
        assert "OwnActorCls, a TrainActor without FakeLifecycle: it would run unwrapped" in message
        assert trainer.TrainActor(3).rank == 3  # the lifecycle class is created as before

    def test_an_engine_built_from_a_name_bound_before_the_patch_is_refused(self, framework: str) -> None:
        launch.install(launch_for(framework), {})
        engine = __import__(f"{framework}.engine", fromlist=["ORIGINAL"])
        with pytest.raises(UnwrappedClassError, match="asks for the rollout under the lifecycle"):
            engine.ORIGINAL({})

    def test_a_framework_laid_out_differently_is_refused_at_install(
        self, framework: str, tmp_path: Path
    ) -> None:
        (tmp_path / framework / "rollout.py").unlink()
        with pytest.raises(
            LaunchConfigError, match=rf"no module {framework}\.rollout in .*laid out differently"
        ):
            launch.install(launch_for(framework), {})

    def test_a_class_that_moved_is_refused_when_its_module_is_imported(
        self, framework: str, tmp_path: Path
    ) -> None:
        path = tmp_path / framework / "trainer.py"
        path.write_text(path.read_text().replace("class TrainActor", "class Trainer"))
        launch.install(launch_for(framework), {"RL_LIFECYCLE_WRAP": "trainer"})
        with pytest.raises(LaunchConfigError, match=rf"{framework}\.trainer has no class TrainActor"):
            __import__(f"{framework}.trainer")

    def test_a_framework_that_is_not_importable_is_refused(self) -> None:
        with pytest.raises(LaunchConfigError, match="not importable in this Ray worker"):
            launch.install(launch_for("no_such_framework_here"), {})


class TestPreflightBeforeTheEngines:
    def test_a_job_the_machine_cannot_hold_is_refused_before_an_engine_starts(self, framework: str) -> None:
        launch.install(launch_for(framework), {})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        with pytest.raises(PreflightError, match="the job asks for 2 GPU"):
            rollout.start_servers({"gpus": 2})
        assert isinstance(rollout.start_servers({"gpus": 1, "gib": 4}), FakeLifecycle)

    def test_warn_reports_and_starts_anyway(self, framework: str, capsys: pytest.CaptureFixture[str]) -> None:
        launch.install(launch_for(framework), {"RL_LIFECYCLE_PREFLIGHT": "warn"})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        assert isinstance(rollout.start_servers({"gpus": 2}), FakeLifecycle)
        assert (
            f"[rl-lifecycle] {framework} preflight: 2 shortfall(s): GPUs: the job asks for 2"
            in capsys.readouterr().err
        )

    def test_off_skips_it(self, framework: str) -> None:
        launch.install(launch_for(framework), {"RL_LIFECYCLE_PREFLIGHT": "off"})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        assert not hasattr(rollout.start_servers, "__wrapped__")


class _Args(dict):  # type: ignore[type-arg]
    """The fake framework's flags (read by key) as slime's argparse namespace too (read by attribute)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


class TestMemoryBudgetVariable:
    """`RL_LIFECYCLE_MEMORY_BUDGET`: checked before any GPU work, never ignored in silence."""

    SLIME_CHECK = "actor_integration.frameworks.slime.budget:check_budget"

    def test_the_launch_reads_slimes_variable(self) -> None:
        from actor_integration.frameworks.slime.budget import BUDGET_VARIABLE

        assert launch.BUDGET_VARIABLE == BUDGET_VARIABLE
        assert launch.SLIME.memory_budget == self.SLIME_CHECK and launch.MILES.memory_budget is None

    @pytest.mark.parametrize("value", ["rollout", "on"])
    def test_a_framework_whose_trainer_has_none_refuses_it(self, value: str) -> None:
        with pytest.raises(LaunchConfigError, match=r"miles's trainer adapter has no memory budget .*Unset"):
            launch.install(launch.MILES, {"RL_LIFECYCLE_MEMORY_BUDGET": value})

    @pytest.mark.parametrize("value", ["", " ", "off", "OFF"])
    def test_off_or_unset_is_nothing_anywhere(self, framework: str, value: str) -> None:
        launch.install(launch_for(framework), {"RL_LIFECYCLE_MEMORY_BUDGET": value})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        assert isinstance(rollout.start_servers({"gpus": 1}), FakeLifecycle)

    def test_a_bad_value_is_refused_at_install(self, framework: str) -> None:
        fw = dataclasses.replace(launch_for(framework), memory_budget=self.SLIME_CHECK)
        with pytest.raises(LaunchConfigError, match=r"RL_LIFECYCLE_MEMORY_BUDGET='half': use 'rollout'"):
            launch.install(fw, {"RL_LIFECYCLE_MEMORY_BUDGET": "half"})
        assert not [name for name in launch.replaced() if name.startswith(f"{framework}.")]

    def test_without_the_trainer_wrapped_it_is_refused(self, framework: str) -> None:
        fw = dataclasses.replace(launch_for(framework), memory_budget=self.SLIME_CHECK)
        with pytest.raises(
            LaunchConfigError, match=r"RL_LIFECYCLE_WRAP=rollout leaves the trainer .* add 'trainer'"
        ):
            launch.install(fw, {"RL_LIFECYCLE_MEMORY_BUDGET": "rollout", "RL_LIFECYCLE_WRAP": "rollout"})

    @pytest.mark.parametrize("preflight", ["error", "off"])
    @pytest.mark.parametrize(
        ("flags", "says"),
        [
            ({}, "no --colocate"),
            ({"colocate": True}, "pass --sglang-mem-fraction-static"),
            ({"colocate": True, "sglang_mem_fraction_static": 1.5}, "it must be in"),
        ],
    )
    def test_the_jobs_flags_are_refused_before_an_engine_starts(
        self, framework: str, preflight: str, flags: dict[str, Any], says: str
    ) -> None:
        fw = dataclasses.replace(launch_for(framework), memory_budget=self.SLIME_CHECK)
        launch.install(fw, {"RL_LIFECYCLE_MEMORY_BUDGET": "rollout", "RL_LIFECYCLE_PREFLIGHT": preflight})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        with pytest.raises(LaunchConfigError, match=says):  # not an engine: start_servers never ran
            rollout.start_servers(_Args(gpus=1, **flags))

    def test_the_job_says_what_each_sleep_leaves_free(
        self, framework: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        fw = dataclasses.replace(launch_for(framework), memory_budget=self.SLIME_CHECK)
        launch.install(fw, {"RL_LIFECYCLE_MEMORY_BUDGET": "rollout"})
        assert "; RL_LIFECYCLE_MEMORY_BUDGET=rollout" in capsys.readouterr().err
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        engine = rollout.start_servers(_Args(gpus=1, colocate=True, sglang_mem_fraction_static=0.5))
        assert isinstance(engine, FakeLifecycle)
        assert (
            f"[rl-lifecycle] {framework} memory budget: RL_LIFECYCLE_MEMORY_BUDGET=rollout: each trainer sleep "
            "frees only what leaves 0.5 of its GPU free" in capsys.readouterr().err
        )


class TestWeightsCheckVariable:
    """`RL_LIFECYCLE_CHECK_WEIGHTS`: checked before any GPU work like the budget, never ignored in silence."""

    SLIME_CHECK = "actor_integration.frameworks.slime.weights_check:check_setting"

    def test_the_launch_reads_slimes_variable(self) -> None:
        from actor_integration.frameworks.slime.weights_check import CHECK_VARIABLE

        assert launch.CHECK_WEIGHTS_VARIABLE == CHECK_VARIABLE
        assert launch.SLIME.weights_check == self.SLIME_CHECK and launch.MILES.weights_check is None

    def test_a_framework_whose_trainer_has_none_refuses_it(self) -> None:
        with pytest.raises(LaunchConfigError, match=r"miles's trainer adapter has no weights check .*Unset"):
            launch.install(launch.MILES, {"RL_LIFECYCLE_CHECK_WEIGHTS": "every"})

    def test_a_bad_value_is_refused_at_install(self, framework: str) -> None:
        fw = dataclasses.replace(launch_for(framework), weights_check=self.SLIME_CHECK)
        with pytest.raises(LaunchConfigError, match=r"RL_LIFECYCLE_CHECK_WEIGHTS='first': use 'every'"):
            launch.install(fw, {"RL_LIFECYCLE_CHECK_WEIGHTS": "first"})
        assert not [name for name in launch.replaced() if name.startswith(f"{framework}.")]

    def test_without_the_trainer_wrapped_it_is_refused(self, framework: str) -> None:
        fw = dataclasses.replace(launch_for(framework), weights_check=self.SLIME_CHECK)
        with pytest.raises(
            LaunchConfigError, match=r"RL_LIFECYCLE_WRAP=rollout leaves the trainer .* add 'trainer'"
        ):
            launch.install(fw, {"RL_LIFECYCLE_CHECK_WEIGHTS": "every", "RL_LIFECYCLE_WRAP": "rollout"})

    @pytest.mark.parametrize("flag", ["debug_train_only", "debug_rollout_only"])
    def test_a_job_that_pushes_nothing_is_refused_before_an_engine_starts(
        self, framework: str, flag: str
    ) -> None:
        fw = dataclasses.replace(launch_for(framework), weights_check=self.SLIME_CHECK)
        launch.install(fw, {"RL_LIFECYCLE_CHECK_WEIGHTS": "every", "RL_LIFECYCLE_PREFLIGHT": "off"})
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        with pytest.raises(LaunchConfigError, match=f"--{flag.replace('_', '-')} pushes none"):
            rollout.start_servers(_Args(gpus=1, **{flag: True}))

    def test_the_job_says_what_it_checks(self, framework: str, capsys: pytest.CaptureFixture[str]) -> None:
        fw = dataclasses.replace(launch_for(framework), weights_check=self.SLIME_CHECK)
        launch.install(fw, {"RL_LIFECYCLE_CHECK_WEIGHTS": "every"})
        assert "; RL_LIFECYCLE_CHECK_WEIGHTS=every" in capsys.readouterr().err
        rollout = __import__(f"{framework}.rollout", fromlist=["start_servers"])
        assert isinstance(rollout.start_servers(_Args(gpus=1, check_weight_update_equal=True)), FakeLifecycle)
        assert (
            f"[rl-lifecycle] {framework} weights check: RL_LIFECYCLE_CHECK_WEIGHTS=every: each weight update is "
            "pushed twice and compared with slime's /weights_checker (the first by slime's own "
            "--check-weight-update-equal)" in capsys.readouterr().err
        )


class TestFaultVariable:
    """`RL_LIFECYCLE_FAULT`: the demo's `--inject-fault` grammar, read by the same parser, checked
    against the halves the job wraps and the hooks each half's machine calls."""

    def test_unset_or_empty_arms_nothing(self) -> None:
        assert launch.parse_fault_variable(None) is None and launch.parse_fault_variable("  ") is None

    def test_the_demos_grammar(self) -> None:
        assert launch.parse_fault_variable("trainer:memory.pause@3") == Fault("trainer", "memory.pause", 3)
        assert launch.parse_fault_variable(" process_groups.destroy@2 ") == Fault(
            "trainer", "process_groups.destroy", 2
        )
        assert launch.parse_fault_variable("rollout:generation.pause@1") == Fault(
            "rollout", "generation.pause", 1
        )

    @pytest.mark.parametrize(
        ("value", "says"),
        [
            ("memory.pause", "RL_LIFECYCLE_FAULT='memory.pause': expected [trainer:|rollout:]HOOK@STEP"),
            ("critic:memory.pause@1", "expected [trainer:|rollout:]HOOK@STEP"),
            ("trainer:memory.pause@0", "STEP from 1"),
            (
                "trainer:generation.pause@1",
                "slime's trainer never calls generation.pause; its machine's hooks",
            ),
            ("rollout:switch_model@1", "slime's rollout never calls switch_model"),
            ("rollout:memory.budget_check@1", "slime's rollout never calls memory.budget_check"),
        ],
    )
    def test_a_bad_value_is_refused_in_one_line_naming_the_variable(self, value: str, says: str) -> None:
        with pytest.raises(LaunchConfigError) as caught:
            launch.parse_fault_variable(value)
        message = str(caught.value)
        assert "\n" not in message and says in message
        assert caught.value.fields["variable"] == "RL_LIFECYCLE_FAULT"

    def test_a_half_the_job_does_not_wrap_is_refused(self) -> None:
        with pytest.raises(
            LaunchConfigError,
            match=r"the rollout half is not under the lifecycle in this job \(RL_LIFECYCLE_WRAP=trainer\)",
        ):
            launch.parse_fault_variable("rollout:memory.pause@1", launch.SLIME, ("trainer",))

    def test_install_refuses_a_bad_value_before_anything_is_replaced(self, framework: str) -> None:
        with pytest.raises(LaunchConfigError, match=r"RL_LIFECYCLE_FAULT='trainer:memory\.pause'"):
            launch.install(launch_for(framework), {"RL_LIFECYCLE_FAULT": "trainer:memory.pause"})
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        assert not issubclass(trainer.TrainActor, FakeLifecycle)

    def test_install_arms_the_fault_on_the_half_it_names(
        self, framework: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        launch.install(launch_for(framework), {"RL_LIFECYCLE_FAULT": "trainer:memory.pause@2"})
        trainer = __import__(f"{framework}.trainer", fromlist=["TrainActor"])
        rollout = __import__(f"{framework}.rollout", fromlist=["Engine"])
        assert trainer.TrainActor.lifecycle_fault == Fault("trainer", "memory.pause", 2)
        assert issubclass(rollout.Engine, launch.JobLifecycle) and rollout.Engine.lifecycle_fault is None
        err = capsys.readouterr().err
        assert (
            "RL_LIFECYCLE_FAULT=trainer:memory.pause@2: call 2 of memory.pause raises in every trainer" in err
        )
        assert "runs as LifecycleTrainActor (FakeLifecycle) in this process" in err
        assert "RL_LIFECYCLE_FAULT armed: call 2 of memory.pause raises" in err


class _Actor(LifecycleMixin):
    """A trainer-shaped actor under the lifecycle (its memory `memory`, built on first use)."""

    memory: Any = None

    def lifecycle_config(self) -> dict[str, Any]:
        memory = self.memory if self.memory is not None else FakeMemorySaver(("model",))
        return {"policy": LifecyclePolicy(memory_tags=("model",)), "hooks": Hooks(memory=memory), "rank": 1}


class TestTheJobsClasses:
    """What the launch switch builds: a hook failure is `LifecycleFailedError` naming the rank, the
    transition and what is resident (slime's driver prints it and stops); the fault fires where armed."""

    def test_the_armed_fault_fires_at_its_call_as_the_typed_error(self) -> None:
        job = launch.job_class(_Actor, Fault("trainer", "memory.pause", 2))
        assert job is launch.job_class(_Actor, Fault("trainer", "memory.pause", 2))
        assert (job.__name__, job.__module__) == ("_Actor", _Actor.__module__)
        actor = job()
        actor.sleep()  # the first pause
        actor.wake_up()
        with pytest.raises(LifecycleFailedError) as failed:
            actor.sleep()
        assert str(failed.value).startswith(
            "lifecycle of _Actor rank 1 is FAILED since hook memory.pause[model] raised InjectedFault("
        )
        assert isinstance(failed.value.__cause__, InjectedFault)
        assert actor.lifecycle_faults.fired == ["memory.pause"]

    def test_a_real_hook_failure_is_the_typed_error_too(self) -> None:
        class Broken(FakeMemorySaver):
            def pause(self, tag: str | None = None) -> None:
                raise RuntimeError("cudaErrorIllegalAddress")

        actor = launch.job_class(_Actor)()
        actor.memory = Broken(("model",))
        with pytest.raises(
            LifecycleFailedError, match=r"raised RuntimeError\('cudaErrorIllegalAddress'\) during sleep"
        ):
            actor.sleep()
        assert actor.lifecycle_state()["state"] == "FAILED"


class TestTheFrameworksSpecs:
    def test_the_hooks_are_named_for_the_frameworks(self) -> None:
        assert [r.module for r in launch.SLIME.replacements] == [
            "slime.backends.megatron_utils.actor",
            "slime.ray.rollout",
        ]
        assert [r.module for r in launch.MILES.replacements] == [
            "miles.backends.megatron_utils.actor",
            "miles.ray.rollout.server_group",
        ]
        assert callable(launch.slime) and callable(launch.miles)


@pytest.mark.ray
def test_in_a_ray_job_each_half_is_replaced_in_the_worker_that_resolves_it(tmp_path: Path) -> None:
    """A Ray job started as `ray job submit` starts its driver (the job config in
    RAY_JOB_CONFIG_JSON_ENV_VAR, no `ray.init()` in the driver: Ray starts itself, as under slime's
    `create_placement_groups`). The driver wraps the trainer class with `ray.remote`, a manager actor
    with a runtime_env of its own creates the engine from its module's globals: both run under the
    lifecycle in their workers, the driver's class is untouched, the job's variable reaches the
    engine, an engine built past the replacement is refused, and the job's output says what was
    replaced."""
    name = f"fakefw_ray{os.getpid()}"
    write_framework(tmp_path, name)
    driver = textwrap.dedent(
        f"""
        import json, ray
        from ray.util.placement_group import placement_group

        pg = placement_group([{{"CPU": 1}}])  # Ray's auto-init, as slime's create_placement_groups
        ray.get(pg.ready(), timeout=120)
        from {name}.trainer import TrainActor
        from {name}.rollout import Manager

        trainer = ray.remote(num_cpus=0)(TrainActor).options(
            runtime_env={{"env_vars": {{"NCCL_CUMEM_ENABLE": "0"}}}}).remote(0)
        manager = Manager.options(runtime_env={{"env_vars": {{"RAY_USE_UVLOOP": "0"}}}}).remote()
        out = {{
            "driver": [c.__name__ for c in TrainActor.__mro__],
            "trainer": ray.get(trainer.bases.remote(), timeout=120),
            "engine": ray.get(manager.start.remote({{}}), timeout=120),
            "elsewhere": ray.get(manager.start_elsewhere.remote({{}}), timeout=120),
        }}
        print("RESULT " + json.dumps(out), flush=True)
        """
    )
    runtime_env = {
        "worker_process_setup_hook": "tests.helpers.launch_fake.hook",
        "env_vars": {
            "PYTHONPATH": f"{tmp_path}:{ROOT}",
            launch_fake.FRAMEWORK_ENV: name,
            "RL_LIFECYCLE_WRAP": "trainer,rollout",
            "RL_LIFECYCLE_LOG_DIR": "off",
        },
    }
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    env.update(
        PYTHONPATH=f"{tmp_path}:{ROOT}",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps({"runtime_env": runtime_env}),
        RAY_DEDUP_LOGS="0",
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    output = proc.stdout + proc.stderr
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    assert line is not None, output[-4000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert "FakeLifecycle" not in result["driver"]  # the driver never runs the hook
    assert result["trainer"][:5] == [
        "TrainActor",
        "LifecycleTrainActor",  # the job's class (`launch.job_class`)
        "JobLifecycle",
        "LifecycleTrainActor",
        "FakeLifecycle",
    ]
    bases, variable = result["engine"]
    assert "FakeLifecycle" in bases and variable == "trainer,rollout"
    assert "UnwrappedClassError" in result["elsewhere"] and "asks for the rollout" in result["elsewhere"]
    assert f"{name}.trainer.TrainActor (actor) runs as LifecycleTrainActor" in output
    assert f"{name}.rollout.Engine (engines) runs as LifecycleEngine" in output

"""vime's real MegatronTrainRayActor (its source files at the manifest's commits) under VimeLifecycleMixin.

Two gloo ranks with real megatron-core (PP=2) and vime's own process-group, gloo-group, memory
(`reset_cuda_stack_size`), tensor backuper, timer, TrainRayActor and RayTrainGroup code; only the
heavy internals are stand-ins (tests/helpers/vime_source.py). Needs vime's source folder: CI has
none, so the suite skips there; run it with

    RL_LIFECYCLE_VIME_SOURCE=.vime-source python -m pytest -s tests/actor_integration/frameworks/vime
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.actor_integration.frameworks import trainer_source_suite as suite
from tests.helpers.framework_source import error_of, free_port, launcher_env, suite_source
from tests.helpers.spawn import no_crash, run_world
from tests.helpers.vime_source import VimeSource, vime_args

SOURCE: VimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(VimeSource, "vime's")

DEADLINE_S = 240.0


def _classes(actor_module: Any) -> dict[str, type]:
    from actor_integration.frameworks.vime import VimeLifecycleMixin

    return {
        "vime": actor_module.MegatronTrainRayActor,
        "lifecycle": suite.lifecycle_trainer(VimeLifecycleMixin, actor_module.MegatronTrainRayActor),
    }


def _worker(rank: int, world_size: int, store: Any, location: str, port: int, variant: str) -> dict[str, Any]:
    from tests.helpers.vime_source import RECORD, SAVER, RolloutManager, install, rollout

    actor_module = install(VimeSource(Path(location), "manifest"))
    os.environ.update(launcher_env())
    if variant.startswith("ray_group:"):
        return _ray_group_run(actor_module, variant.removeprefix("ray_group:"))
    rule = "slot"
    if variant.startswith("rule:"):  # "rule:<sender rule>:<class>": init and one sync
        _, rule, variant = variant.split(":")
    actor = _classes(actor_module)[variant](world_size, rank, "127.0.0.1", port)
    run = suite.TrainerRun(actor, "vime", SAVER, rollout)

    def init() -> Any:
        return actor.init(vime_args(world_size, sender_rule=rule), "actor")

    if rule != "slot":
        run.step("init", init)
        actor.set_rollout_manager(RolloutManager())
        run.step("update_weights", actor.update_weights)
        run.out["engine_calls"] = RECORD["engine_calls"]
        return run.out
    run.to_the_first_sync(init, RolloutManager())
    if variant == "vime":
        run.step("sleep", actor.sleep)  # the second pause of the same memory (slime #1895's shape)
    else:

        def world() -> dict[str, Any]:
            groups = sys.modules["vime.utils.reloadable_process_group"]
            state = groups.default_process_group_states[os.getpid()]
            return {
                "world_after_wake": {"destroyed": state.nccl_world_destroyed, "generation": state.generation}
            }

        run.under_the_adapter(
            awake=world, end=lambda: {"stack_reset_observer": actor._lifecycle_stack_reset.count}
        )
    return run.finish(RECORD, ("trained", "saved", "engine", "stack_resets", "engine_calls"))


def _ray_group_run(actor_module: Any, cuda: str) -> dict[str, Any]:
    """vime's RayTrainGroup as its train loop drives it, one rank, under the launch switch (Ray in this process).

    `cuda`: "13" leaves the adapter to read this torch's CUDA major (this CPU build resolves cu13);
    "12" is a torch of CUDA 12, whose preload library is the one vime's RayTrainGroup picks.
    """
    from actor_integration.frameworks.slime import slime_memory_backend
    from actor_integration.frameworks.vime import VimeLifecycleMixin
    from actor_integration.frameworks.vime.launch import install_vime
    from tests.helpers.vime_source import RECORD, RolloutManager, rollout

    for name in launcher_env():
        os.environ.pop(name)  # RayTrainGroup must put them there itself
    if cuda == "12":
        VimeLifecycleMixin.lifecycle_memory = lambda self: slime_memory_backend(cuda_major=12)  # type: ignore[method-assign]
    out: dict[str, Any] = {"halves": list(install_vime({"RL_LIFECYCLE_WRAP": "trainer"}))}
    from vime.ray.actor_group import RayTrainGroup

    placement = sys.modules["ray.util.placement_group"].PlacementGroup()
    group = RayTrainGroup(vime_args(1), 1, 1, pg=(placement, [0], [0]))
    actor = group._actor_handlers[0].instance
    out["mro"] = [c.__name__ for c in type(actor).__mro__[:5]]
    out["env_vars"] = RECORD["ray_actors"][0]["env_vars"]
    out["init"] = error_of(lambda: group.async_init(vime_args(1), "actor"))
    own = next(c for c in type(actor).__mro__ if c.__name__ == "MegatronTrainRayActor")
    out["unwrapped"] = error_of(lambda: own(1, 0, "127.0.0.1", 1))  # vime's class, built directly
    if out["init"] is not None:
        return out
    group.set_rollout_manager(RolloutManager())
    return {**out, **suite.drive_the_group(group, actor, rollout, RECORD)}


def _run(variant: str, world_size: int = 2) -> list[dict[str, Any]]:
    assert SOURCE is not None
    results = run_world(
        _worker, world_size, str(SOURCE.location), free_port(), variant, deadline_s=DEADLINE_S
    )
    no_crash(results)
    return results


@pytest.fixture(scope="module")
def lifecycle_run() -> list[dict[str, Any]]:
    return _run("lifecycle")


@pytest.fixture(scope="module")
def vime_run() -> list[dict[str, Any]]:
    return _run("vime")


class TestUnderTheAdapter(suite.UnderTheAdapterSuite):
    """init → train → save → update_weights → sleep x2 → wake x2 → injected failure → recover → train → save."""

    def test_vimes_stack_reset_follows_every_pause(self, lifecycle_run: list[dict[str, Any]]) -> None:
        """vime's sleep calls reset_cuda_stack_size() after the pause: under the wrap, after every sleep plan."""
        for result in lifecycle_run:
            assert result["record"]["stack_resets"] == [1, 2, 3, 4, 5, 6]  # the pause count at each reset
            assert result["stack_reset_observer"] == 6  # each one the observer, init's sleep included

    def test_world_is_destroyed_and_restored_with_a_flat_group_count(
        self, lifecycle_run: list[dict[str, Any]]
    ) -> None:
        for result in lifecycle_run:
            assert result["world_after_wake"]["destroyed"] is False
            assert result["world_after_wake"]["generation"] >= 2  # a gloo stand-in WORLD, then WORLD again
            assert result["groups_end"] == result["groups_init"]
            assert result["groups_awake_end"] == result["groups_awake"]

    def test_one_start_per_sync(self, lifecycle_run: list[dict[str, Any]]) -> None:
        calls = [c["call"] for result in lifecycle_run for c in result["record"]["engine_calls"]]
        assert calls == ["start_weight_update", "update_weights_from_tensor", "finish_weight_update"]

    def test_figures(self, lifecycle_run: list[dict[str, Any]]) -> None:
        assert SOURCE is not None
        print(f"\nvime {SOURCE.resolved_commit()}")
        for rank, ours in enumerate(lifecycle_run):
            record = ours["record"]
            print(
                f"rank {rank}: groups asleep {ours['groups_init']} → {ours['groups_end']}, awake "
                f"{ours['groups_awake']} → {ours['groups_awake_end']}; trained {record['trained']} saved "
                f"{record['saved']} synced {[e['checksum'] for e in record['engine']]}; pauses {ours['pauses']}, "
                f"stack resets at pauses {record['stack_resets']}"
            )


class TestWithoutTheAdapter:
    def test_plain_vime_double_pauses(self, vime_run: list[dict[str, Any]]) -> None:
        """vime's own class: the driver's sleep after update_weights pauses paused memory (TMS exits)."""
        suite.check_the_plain_sleep_after_a_sync_double_pauses(vime_run)


class TestRayTrainGroupUnderTheLaunchSwitch:
    def test_vimes_train_group_builds_and_drives_the_lifecycle_class(self) -> None:
        """RayTrainGroup imports MegatronTrainRayActor from vime's actor module at call time: the launch
        switch replaced it there, so the group's actor is the lifecycle class, with vime's preload env;
        vime's own class refuses to be built outside the lifecycle in that process."""
        (result,) = _run("ray_group:12", world_size=1)
        assert result["halves"] == ["trainer"]
        assert result["mro"] == [
            "LifecycleMegatronTrainRayActor",  # the job's class (`launch.job_class`)
            "JobLifecycle",
            "LifecycleMegatronTrainRayActor",
            "VimeLifecycleMixin",
            "SlimeLifecycleMixin",
        ]
        assert result["unwrapped"].startswith("UnwrappedClassError")
        assert result["env_vars"]["LD_PRELOAD"].endswith("preload_cu12.abi3.so")
        assert result["init"] is None
        suite.check_driven_through_the_group(result)

    def test_vimes_cu12_preload_on_a_cuda13_torch_is_refused_before_the_first_pause(self) -> None:
        """vime's RayTrainGroup takes torch_memory_saver's cu12 preload library whenever it is installed; a
        CUDA 13 torch needs the cu13 one (slime #2186: the other major hooks nothing). The adapter refuses
        that environment in init, naming the library to preload, instead of pausing unhooked memory."""
        (result,) = _run("ray_group:13", world_size=1)
        assert result["env_vars"]["LD_PRELOAD"].endswith("preload_cu12.abi3.so")
        assert result["init"].startswith("MemorySaverConfigError")
        assert "preload_cu13.abi3.so" in result["init"]


class TestVime57OnTheTrainer:
    """vime #57's trainer-side failures with vime's actor and a sender of the pre-#57 shape (tests/helpers/
    vime_source.py): one 2-GPU engine slot over two ranks of Megatron TP=1, so both ranks have tp_rank 0."""

    @staticmethod
    def _calls(results: list[dict[str, Any]], call: str) -> list[dict[str, Any]]:
        return [c for result in results for c in result["engine_calls"] if c["call"] == call]

    def test_plain_vime_starts_the_slots_engine_twice(self) -> None:
        results = _run("rule:tp_start:vime")
        assert [c["rank"] for c in self._calls(results, "start_weight_update")] == [0, 1]  # two coordinators
        assert len(self._calls(results, "update_weights_from_tensor")) == 2

    def test_under_the_wrap_two_would_be_coordinators_make_one_start(self) -> None:
        results = _run("rule:tp_start:lifecycle")
        for result in results:
            assert result["steps"][-1]["error"] is None and result["steps"][-1]["state"] == "PAUSED"
        assert [c["rank"] for c in self._calls(results, "start_weight_update")] == [0]
        assert [c["rank"] for c in self._calls(results, "update_weights_from_tensor")] == [0]
        assert [c["rank"] for c in self._calls(results, "finish_weight_update")] == [0]

    def test_plain_vime_sends_handles_gathered_over_tp_only(self) -> None:
        """Each update carries one GPU's handle for a 2-GPU engine: its other worker finds none."""
        updates = self._calls(_run("rule:tp:vime"), "update_weights_from_tensor")
        assert [u["gpus"] for u in updates] == [["gpu0"], ["gpu1"]]

    def test_under_the_wrap_handles_short_of_the_slot_are_refused_before_sending(self) -> None:
        results = _run("rule:tp:lifecycle")
        for result in results:
            assert result["steps"][-1]["error"].startswith("IncompleteSlotHandlesError")
        assert self._calls(results, "update_weights_from_tensor") == []
        assert len(self._calls(results, "start_weight_update")) == 1

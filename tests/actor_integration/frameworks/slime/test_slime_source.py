"""slime's real MegatronTrainRayActor (its source at the pinned commit) under SlimeLifecycleMixin.

Two gloo ranks with real megatron-core (PP=2) and slime's own process-group, gloo-group, tensor
backuper, routing replay, TrainRayActor and RayTrainGroup code; only the heavy internals are
stand-ins (tests/helpers/slime_source.py). Needs slime's source: CI has no network, so the suite
skips there; run it with

    RL_LIFECYCLE_SLIME_SOURCE=/path/to/slime python -m pytest -s tests/actor_integration/frameworks/slime/test_slime_source.py

(`-s` prints the figures: process groups before/after, weight checksums at save, sync and wake).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.actor_integration.frameworks import trainer_source_suite as suite
from tests.helpers.cli import lifecycle
from tests.helpers.framework_source import error_of, group_counts, launcher_env, suite_source
from tests.helpers.slime_source import SlimeSource, rollout, slime_args
from tests.helpers.spawn import no_crash, run_world

SOURCE: SlimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(SlimeSource, "slime's")


DEADLINE_S = 240.0


def _classes(actor_module: Any) -> dict[str, type]:
    from actor_integration.frameworks.slime import SlimeLifecycleMixin

    LifecycleTrainer = suite.lifecycle_trainer(SlimeLifecycleMixin, actor_module.MegatronTrainRayActor)

    class GenericMixinTrainer(LifecycleTrainer):
        """The generic mixin's behaviour: slime's bodies keep their own resource calls."""

        def lifecycle_body_globals(self, operation: str) -> dict[str, Any]:
            return {}

    return {
        "slime": actor_module.MegatronTrainRayActor,
        "lifecycle": LifecycleTrainer,
        "generic": GenericMixinTrainer,
    }


def _groups() -> dict[str, int]:
    return group_counts("slime")


_error = error_of


def _worker(
    rank: int, world_size: int, store: Any, location: str, commit: str, port: int, variant: str
) -> dict[str, Any]:
    from tests.helpers.slime_source import RECORD, SAVER, RolloutManager, install

    actor_module = install(SlimeSource(Path(location), commit))
    os.environ.update(launcher_env())
    if variant.startswith("logs:"):  # as a user's job: logging left to the wrapped actor
        from lifecycle.events import LOG_DIR_ENV, reset_logging

        reset_logging()
        variant, os.environ[LOG_DIR_ENV] = "lifecycle", variant.removeprefix("logs:")
    serial = _count_serial_teardowns()
    if variant.startswith("perf:"):
        return _perf_run(
            _classes(actor_module)[variant.removeprefix("perf:")](world_size, rank, "127.0.0.1", port)
        )
    if variant.startswith("debug:"):
        flag = variant.removeprefix("debug:")
        return _debug_run(_classes(actor_module)["lifecycle"](world_size, rank, "127.0.0.1", port), flag)
    if variant.startswith("check:"):
        return _check_run(_classes(actor_module)["lifecycle"](world_size, rank, "127.0.0.1", port), variant)
    if variant == "ray_group":
        return _ray_group_run(actor_module, _classes(actor_module)["lifecycle"])
    if variant == "pp4":
        return _pp4_run(_classes(actor_module)["lifecycle"](world_size, rank, "127.0.0.1", port), serial)
    actor = _classes(actor_module)[variant](world_size, rank, "127.0.0.1", port)
    run = suite.TrainerRun(actor, "slime", SAVER, rollout, out={"serial_teardowns": serial})
    run.to_the_first_sync(lambda: actor.init(slime_args(world_size), "actor"), RolloutManager())
    if variant == "slime":
        run.step("sleep", actor.sleep)  # slime #1895: the second pause of the same memory
        run.step("wake_up", actor.wake_up)
        run.out["groups_awake"] = run.groups()
        run.step("sleep", actor.sleep)
        run.step("train", run.train(1))
    elif variant == "lifecycle":
        mpu = sys.modules["megatron.core.parallel_state"]

        def memory() -> dict[str, Any]:
            backend = actor.lifecycle.hooks.memory
            return {"memory": backend.describe(), "memory_notes": backend.notes}

        run.under_the_adapter(
            awake=lambda: {"pp_size": mpu.get_pipeline_model_parallel_world_size()}, end=memory
        )
    run.out.setdefault("groups_end", run.groups())
    return run.finish(RECORD, ("trained", "saved", "engine"))


def _perf_run(actor: Any) -> dict[str, Any]:
    """Two steps as slime's loop runs them; what slime's log_perf_data sent to its tracking."""
    from tests.helpers.slime_source import RECORD, RolloutManager

    actor.init(slime_args(2), "actor")
    actor.set_rollout_manager(RolloutManager())
    for step in range(3):
        actor.train(step, rollout(step))
    tracked = [{k: v for k, v in m.items() if k.startswith("perf/")} for m in RECORD.get("tracked", [])]
    return {"perf": [m for m in tracked if m]}


def _debug_run(actor: Any, flag: str) -> dict[str, Any]:
    """slime's calls in their driver order under `--debug-rollout-only` / `--debug-train-only`."""
    from tests.helpers.slime_source import RECORD, SAVER, RolloutManager

    out: dict[str, Any] = {"init": _error(lambda: actor.init(slime_args(2, **{flag: True}), "actor"))}
    out["set_rollout_manager"] = _error(lambda: actor.set_rollout_manager(RolloutManager()))
    pauses = SAVER.pause_count
    operations: list[str] = []
    if flag == "debug_train_only":  # the machine exists (init slept): what it runs from here on
        actor.lifecycle.observe(lambda event, fields: operations.append(str(fields.get("operation"))))
    out["update_weights"] = _error(actor.update_weights)
    out["operations_in_update_weights"] = sorted(set(operations))
    out["train"] = _error(lambda: actor.train(0, rollout(0)))
    out["save_model"] = _error(lambda: actor.save_model(0))
    out["update_weights_again"] = _error(actor.update_weights)
    out["pauses_after_init"] = SAVER.pause_count - pauses
    out["lifecycle_state"] = _error(actor.lifecycle_state)
    out["engine"] = list(RECORD["engine"])
    out["stand_in_calls"] = actor.__dict__.get("_lifecycle_stand_in_calls", [])
    return out


def _check_run(actor: Any, variant: str) -> dict[str, Any]:
    """`RL_LIFECYCLE_CHECK_WEIGHTS=every` through slime's loop: the first push, two train steps each with
    its push; `check:stale` makes the trainer's second push of each update write nothing."""
    import torch.distributed as dist

    from actor_integration.frameworks.slime.weights_check import CHECK_VARIABLE
    from tests.helpers.slime_source import RECORD, RolloutManager, UpdateWeightFromTensor

    os.environ[CHECK_VARIABLE] = "every"
    if variant == "check:stale":
        push = UpdateWeightFromTensor.update_weights
        calls = [0]

        def stale(self: Any) -> None:
            calls[0] += 1
            if calls[0] % 2:  # the update itself; the check's push after it writes nothing
                push(self)
            else:
                self.weight_version += 1

        UpdateWeightFromTensor.update_weights = stale  # type: ignore[method-assign]
    actor.init(slime_args(2), "actor")
    actor.set_rollout_manager(RolloutManager())
    timer = sys.modules["slime.backends.megatron_utils.actor"].Timer()
    out: dict[str, Any] = {"updates": [], "rank": dist.get_rank()}
    # One update where the check fails: rank 0 raises, and the other ranks (as in slime's job, where the
    # driver's ray.get then stops it) must not wait for it in a train step.
    for step in range(1 if variant == "check:stale" else 3):
        if step:
            actor.train(step, rollout(step))
        before = dict(timer.log_dict())
        error = _error(actor.update_weights)
        out["updates"].append(
            {
                "error": error,
                "update_weights_s": timer.log_dict().get("update_weights", 0.0)
                - before.get("update_weights", 0.0),
                "check_s": timer.log_dict().get("lifecycle_weights_check", 0.0)
                - before.get("lifecycle_weights_check", 0.0),
            }
        )
        if error:
            break
    out["versions"] = [e["version"] for e in RECORD["engine"]]
    out["weights_checker"] = RECORD.get("weights_checker", [])
    out["state"] = actor.lifecycle_state()["state"]
    return out


def _count_serial_teardowns() -> list[int]:
    """Count slime's own WORLD teardowns (torch's serial shutdown of every group), in place."""
    module = sys.modules["slime.utils.reloadable_process_group"]
    serial_world = module._destroy_default_accelerator_process_group
    count = [0]

    def counted() -> None:
        count[0] += 1
        serial_world()

    module._destroy_default_accelerator_process_group = counted
    return count


def _pp4_run(actor: Any, serial: list[int]) -> dict[str, Any]:
    """Pure PP=4 (slime's deadlock case): overlapping embedding and pipeline groups, the last rank late."""
    import time

    import torch.distributed as dist

    from tests.helpers.slime_source import RolloutManager

    out: dict[str, Any] = {"states": []}
    actor.init(slime_args(4), "actor")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    actor.set_rollout_manager(RolloutManager())
    out["groups_init"] = _groups()
    mpu = sys.modules["megatron.core.parallel_state"]
    for cycle in range(3):
        if rank == world_size - 1:
            time.sleep(0.3)  # the others reach the teardown first, as in slime's report
        actor.wake_up()
        out.setdefault("groups_awake", []).append(_groups())
        if cycle == 0:  # the layout, read while the groups are up
            in_embedding = mpu.is_rank_in_embedding_group()
            out["layout"] = {
                "pp": mpu.get_pipeline_model_parallel_world_size(),
                "embedding_ranks": dist.get_process_group_ranks(mpu.get_embedding_group())
                if in_embedding
                else None,
            }
        actor.train(cycle, rollout(cycle))  # collectives on every group, then the sleep
        out["states"].append(actor.lifecycle_state()["state"])
    out["groups_end"] = _groups()
    out["serial_teardowns"] = serial[0]
    return out


def _ray_group_run(actor_module: Any, trainer: type) -> dict[str, Any]:
    """RayTrainGroup(actor_cls=...) as slime's train loop drives it, one rank, Ray run in this process."""
    from slime.ray.actor_group import RayTrainGroup

    from tests.helpers.slime_source import RECORD, RolloutManager

    for name in launcher_env():
        os.environ.pop(name)  # RayTrainGroup must put them there itself
    placement = sys.modules["ray.util.placement_group"].PlacementGroup()
    group = RayTrainGroup(slime_args(1), 1, 1, pg=(placement, [0], [0]), actor_cls=trainer)
    out: dict[str, Any] = {"create": group.create(rollout_manager=RolloutManager())}
    actor = group._actor_handlers[0].instance
    out["env_vars"] = RECORD["ray_actors"][0]["env_vars"]
    return {**out, **suite.drive_the_group(group, actor, rollout, RECORD)}


def _run(variant: str, world_size: int = 2) -> list[dict[str, Any]]:
    from tests.helpers.framework_source import free_port

    assert SOURCE is not None
    results = run_world(
        _worker, world_size, str(SOURCE.location), SOURCE.commit, free_port(), variant, deadline_s=DEADLINE_S
    )
    no_crash(results)
    return results


@pytest.fixture(scope="module")
def lifecycle_run() -> list[dict[str, Any]]:
    return _run("lifecycle")


@pytest.fixture(scope="module")
def slime_run() -> list[dict[str, Any]]:
    return _run("slime")


class TestUnderTheAdapter(suite.UnderTheAdapterSuite):
    """init → train → save → update_weights → sleep x2 → wake x2 → injected failure → recover → train."""

    def test_the_plans_own_the_resources(self, lifecycle_run: list[dict[str, Any]]) -> None:
        super().test_the_plans_own_the_resources(lifecycle_run)
        for result in lifecycle_run:
            assert "hook_mode=preload, all memory as one unit" in result["memory"]
            # megatron.core's import set hook_mode="torch"; the preloaded process needs preload.
            assert any("megatron-core does this" in note for note in result["memory_notes"])

    def test_group_count_is_flat(self, lifecycle_run: list[dict[str, Any]]) -> None:
        for result in lifecycle_run:
            assert result["groups_end"] == result["groups_init"]  # asleep: the temporary gloo WORLD
            assert result["groups_awake_end"] == result["groups_awake"]  # awake, 4 wakes later
            assert result["groups_awake"]["slime_registry"] == result["groups_init"]["slime_registry"]
            assert result["pp_size"] == 2  # the layout Megatron was initialised with

    def test_as_many_groups_as_plain_slime(
        self, lifecycle_run: list[dict[str, Any]], slime_run: list[dict[str, Any]]
    ) -> None:
        for ours, theirs in zip(lifecycle_run, slime_run, strict=True):
            assert ours["groups_end"] == theirs["groups_end"]
            assert ours["groups_awake"] == theirs["groups_awake"]

    def test_figures(self, lifecycle_run: list[dict[str, Any]], slime_run: list[dict[str, Any]]) -> None:
        assert SOURCE is not None
        print(f"\nslime {SOURCE.resolved_commit()} from {SOURCE.location}")
        for rank, (ours, theirs) in enumerate(zip(lifecycle_run, slime_run, strict=True)):
            record = ours["record"]
            print(
                f"rank {rank}: groups asleep after init {ours['groups_init']}, at the end {ours['groups_end']}; "
                f"awake first {ours['groups_awake']}, last {ours['groups_awake_end']} (plain slime awake "
                f"{theirs['groups_awake']}); weights init {ours['weights_init']} trained "
                f"{record['trained']} saved {record['saved']} synced {[e['checksum'] for e in record['engine']]} "
                f"after wake {ours['weights_after_wake']}; pauses {ours['pauses']} resumes {ours['resumes']}"
            )


class TestLogs:
    def test_the_wrapped_actors_logs_pass_lifecycle_check_with_no_code_of_the_users(
        self, tmp_path: Path
    ) -> None:
        """slime's own actor under the adapter, logging left unconfigured and only
        RL_LIFECYCLE_LOG_DIR set: every rank writes its file there and `lifecycle check` is clean."""
        _run(f"logs:{tmp_path}")
        names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
        assert len(names) == 2 and all(n.endswith(("-rank0.jsonl", "-rank1.jsonl")) for n in names), names
        proc = lifecycle("check", *map(str, sorted(tmp_path.glob("*.jsonl"))), timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "2 machine(s): clean" in proc.stderr


class TestConcurrentTeardown:
    def test_the_sleep_does_not_take_slimes_serial_teardown(
        self, lifecycle_run: list[dict[str, Any]], slime_run: list[dict[str, Any]]
    ) -> None:
        """The adapter frees the same groups itself (all at once); plain slime destroys WORLD serially."""
        for ours, theirs in zip(lifecycle_run, slime_run, strict=True):
            assert ours["serial_teardowns"] == [0]
            assert theirs["serial_teardowns"][0] >= 2

    def test_pure_pp4_on_four_ranks_cycles_without_deadlock(self) -> None:
        """slime's deadlock case (pure PP=4, overlapping groups, one rank late): three wake/train/sleep
        cycles on four gloo ranks end PAUSED with the group count flat and equal on every cycle."""
        results = _run("pp4", world_size=4)
        for result in results:
            assert result["layout"]["pp"] == 4
            assert result["states"] == ["PAUSED", "PAUSED", "PAUSED"]
            assert result["serial_teardowns"] == 0
            assert result["groups_end"] == result["groups_init"]
            assert len({tuple(sorted(g.items())) for g in result["groups_awake"]}) == 1
        # The first and the last stage share the embedding group: groups overlap across ranks.
        assert results[0]["layout"]["embedding_ranks"] == [0, 3]


class TestWithoutTheAdapter:
    def test_plain_slime_double_pauses(self, slime_run: list[dict[str, Any]]) -> None:
        """slime #1895 on slime's own class: sleep after update_weights pauses paused memory (TMS exits)."""
        suite.check_the_plain_sleep_after_a_sync_double_pauses(slime_run)

    def test_the_generic_mixin_crashes_in_update_weights(self) -> None:
        """The issue's first failure: slime's body nests torch_memory_saver.disable() in the plan's."""
        for result in _run("generic"):
            update = next(s for s in result["steps"] if s["step"] == "update_weights")
            assert update["error"].startswith(
                "AssertionError: disable() should be called only when tms is active"
            )
            assert result["record"]["engine"] == []


class TestRayTrainGroup:
    def test_constructed_and_driven_through_ray_train_group(self) -> None:
        """RayTrainGroup(actor_cls=...) builds the actor with (world_size, rank, addr, port) and sets the
        preload environment, which the adapter's memory backend follows."""
        (result,) = _run("ray_group", world_size=1)
        assert result["create"] == [0]
        assert "torch_memory_saver" in result["env_vars"]["LD_PRELOAD"]
        suite.check_driven_through_the_group(result)


class TestSlimesInstrumentation:
    """slime's own `@timer` figures and the lifecycle's per-phase ones reach slime's tracking (its real
    `log_perf_data` → `logging_utils.log`, wandb or tensorboard as slime configures them)."""

    @pytest.fixture(scope="class")
    def perf(self) -> dict[str, list[dict[str, Any]]]:
        return {variant: _run(f"perf:{variant}") for variant in ("slime", "lifecycle")}

    def _logged(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # slime logs perf data on the last pipeline stage's first TP and DP rank: rank 1 of PP=2.
        (logged,) = [r["perf"] for r in results if r["perf"]]
        return logged

    def test_slimes_sleep_and_wake_timers_still_record_under_the_wrap(self, perf: dict[str, Any]) -> None:
        plain, wrapped = self._logged(perf["slime"]), self._logged(perf["lifecycle"])
        assert len(plain) == len(wrapped) == 3  # one report per train step
        for theirs, ours in zip(plain, wrapped, strict=True):
            own = {k for k in theirs if not k.startswith("perf/lifecycle_")}
            assert own <= set(ours), own - set(ours)
            assert ours["perf/sleep_time"] > 0 and ours["perf/wake_up_time"] > 0

    def test_the_lifecycles_per_phase_figures_are_added(self, perf: dict[str, Any]) -> None:
        for report in self._logged(perf["lifecycle"]):
            assert report["perf/lifecycle_sleep_time"] == pytest.approx(report["perf/sleep_time"])
            assert report["perf/lifecycle_wake_time"] == pytest.approx(report["perf/wake_up_time"])
            for hook in ("process_groups_destroy", "memory_pause", "clear_memory"):
                assert report[f"perf/lifecycle_sleep_{hook}_time"] >= 0
            assert report["perf/lifecycle_wake_memory_resume_time"] >= 0
        assert not any(k.startswith("perf/lifecycle_") for r in self._logged(perf["slime"]) for k in r)


class TestWeightsCheck:
    """`RL_LIFECYCLE_CHECK_WEIGHTS=every` on slime's own actor: every push checked with slime's calls."""

    def test_every_push_is_pushed_again_between_snapshot_reset_and_compare(self) -> None:
        results = _run("check:every")
        for result in results:
            assert [u["error"] for u in result["updates"]] == [None] * 3
            assert result["state"] == "PAUSED"
            for update in result["updates"]:  # slime's update_weights timer keeps the first push only
                assert update["check_s"] > 0 and update["update_weights_s"] < update["check_s"] + 1.0
        (lead,) = [r for r in results if r["rank"] == 0]
        assert lead["weights_checker"] == ["snapshot", "reset_tensors", "compare"] * 3
        assert lead["versions"] == [1, "reset", 2, 3, "reset", 4, 5, "reset", 6]
        assert [r["weights_checker"] for r in results if r["rank"] != 0] == [[]]

    def test_a_push_that_writes_nothing_stops_the_job_with_the_version(self) -> None:
        results = _run("check:stale")
        (lead,) = [r for r in results if r["rank"] == 0]
        assert lead["updates"][0]["error"].startswith("EngineWeightsCheckError: weight update 1: ")
        assert "weights differ: 'random'" in lead["updates"][0]["error"]


class TestDebugModes:
    def test_debug_rollout_only_runs_slimes_calls_without_a_lifecycle(self) -> None:
        """slime's init returns before setting `role`: the first update_weights under the wrap raised
        AttributeError. Now each body is slime's own (it returns at once) and the actor says why it has
        no lifecycle."""
        for result in _run("debug:debug_rollout_only"):
            assert [
                result[k] for k in ("init", "update_weights", "train", "save_model", "update_weights_again")
            ] == [None] * 5
            assert result["lifecycle_state"].startswith("LifecycleNotConfiguredError")
            assert "--debug-rollout-only" in result["lifecycle_state"]
            assert result["engine"] == []

    def test_debug_train_only_skips_the_sync_as_slime_does(self) -> None:
        """update_weights returns at once in slime: no groups brought up and down for nothing."""
        for result in _run("debug:debug_train_only"):
            assert result["init"] is None and result["update_weights"] is None
            assert result["train"] is None and result["save_model"] is None
            assert result["engine"] == [] and result["stand_in_calls"] == []
            assert result["operations_in_update_weights"] == []  # no sync: the groups stayed down

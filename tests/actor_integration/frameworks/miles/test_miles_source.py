"""miles' real MegatronTrainRayActor (its source at the pinned commit) under MilesLifecycleMixin.

Two gloo ranks with real megatron-core (PP=2) and miles' own process-group patch and registry,
gloo group, tensor backuper (with its rematerializing variant), replay managers, timers,
TrainRayActor and launcher (`allocate_gpus_for_actor`); only the heavy internals are stand-ins
(tests/helpers/miles_source.py). Each of miles' three tag layouts runs the whole sequence. The
model check's reproductions (test_miles_sequences.py) run again on miles' real class, plain and
under the adapter. Needs miles' source: CI has no network, so the suite skips there; run it with

    RL_LIFECYCLE_MILES_SOURCE=/path/to/miles python -m pytest -s tests/actor_integration/frameworks/miles/test_miles_source.py

(`-s` prints the figures: process groups, weight checksums at save, sync and wake, memory calls per step).
"""

from __future__ import annotations

import math
import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

from tests.actor_integration.frameworks.trainer_source_suite import lifecycle_trainer, steps_of
from tests.helpers.framework_source import error_of, group_counts, launcher_env, suite_source
from tests.helpers.miles_like import REFUSED, REPRODUCTIONS
from tests.helpers.miles_source import MilesSource
from tests.helpers.slime_source import slime_args
from tests.helpers.spawn import no_crash, run_world

SOURCE: MilesSource | None
SOURCE, pytestmark, _source_readable = suite_source(MilesSource, "miles'")


DEADLINE_S = 300.0
LAYOUTS = ("all memory", "rematerialize", "lora rollout")
MARGIN = 1 << 30  # --train-memory-margin-bytes: miles' init sets it on torch_memory_saver


# slime's flags miles' parser does not have (miles' actor asks `getattr(args, "use_routing_replay", False)`).
NOT_MILES_FLAGS = (
    "release_train",
    "update_weight_mode",
    "update_weight_transport",
    "update_weight_start_version",
    "use_routing_replay",
    "use_rollout_routing_replay",
    "loss_type",
    "kl_coef",
    "use_opd",
    "advantage_estimator",
    "save_debug_train_data",
    "wandb_always_use_train_step",
    "use_wandb",
    "use_tensorboard",
)


def _args(world_size: int, config: str) -> Namespace:
    """miles' parsed flags for a colocated, offloaded actor (only what the code paths read): slime's, with
    miles' differences, and the tag layout's (`CONFIGS[config]`)."""
    from tests.helpers.miles_like import CONFIGS

    args = slime_args(
        world_size,
        absent=NOT_MILES_FLAGS,
        distributed_backend="gloo",
        debug_skip_weight_update=False,
        debug_deterministic_collective=False,
        env_report=None,
        dumper_enable=False,
        dumper_source_patcher_config_train=None,
        profile_target=[],
        use_pytorch_profiler=False,
        chat_template_path=None,
        indep_dp=False,
        offload_train_target="cpu",
        train_memory_margin_bytes=MARGIN,
        non_persistent_ckpt_type=None,
        rematerialize_param_from_master_weight=False,
        megatron_to_hf_mode="raw",
        update_weight_transfer_mode="broadcast",
        lora_rank=0,
        skip_actor_forward_only=False,
        custom_megatron_post_save_hook_path=None,
    )
    vars(args).update(CONFIGS[config])
    return args


def _rollout(step: int) -> Any:
    import torch
    from miles.utils.ray_utils import Box

    return Box({"tokens": [torch.arange(8) + step]})


def _lifecycle_class(actor_module: Any) -> Any:
    from actor_integration.frameworks.miles import MilesLifecycleMixin, miles_memory_backend

    return lifecycle_trainer(
        MilesLifecycleMixin,
        actor_module.MegatronTrainRayActor,
        memory=lambda self: miles_memory_backend(self.lifecycle_layout(), cuda_major=13),
    )


def _groups() -> dict[str, int]:
    return group_counts("miles")


_error = error_of


def _memory_calls() -> list[str]:
    from tests.helpers.miles_source import CALLS

    names = [n for n in CALLS.names() if n.startswith(("memory.pause", "memory.resume"))]
    CALLS.clear()
    return names


def _watch_miles_logs() -> dict[str, list[Any]]:
    """miles' own Timer entries "sleep" / "wake_up" as they end (its event sinks), and the structured
    start/end lines its `with_logs` writes for them on the actor module's logger, as (class, method, phase)."""
    import logging

    watched: dict[str, list[Any]] = {"timed": [], "logged": []}
    timer = sys.modules["miles.utils.timer"].Timer()
    timer.event_sinks.append(
        lambda name, t0, t1: name in ("sleep", "wake_up") and watched["timed"].append(name)
    )

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = dict(item.partition("=")[::2] for item in record.getMessage().split()[1:])
            if fields.get("fn") in ("sleep", "wake_up"):
                watched["logged"].append((fields["cls"], fields["fn"], fields["phase"]))

    logger = logging.getLogger("miles.backends.megatron_utils.actor")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(Lines())
    return watched


def _count_miles_teardowns() -> list[int]:
    """Count miles' own one-by-one teardowns of its registry, in place."""
    groups = sys.modules["miles.utils.reloadable_process_group"].ReloadableProcessGroup
    serial = groups.destroy_process_groups
    count = [0]

    def counted() -> None:
        count[0] += 1
        serial()

    groups.destroy_process_groups = staticmethod(counted)
    return count


def _build(cls: type, world_size: int, rank: int, port: int, config: str) -> Any:
    """As miles' launcher builds an actor: `(args, world_size, rank, master_addr, master_port, ...)`."""
    args = _args(world_size, config)
    return cls(
        args, world_size, rank, "127.0.0.1", port, indep_dp_store_addr=None, role="actor", cell_index=0
    )


def _init(actor: Any, world_size: int, config: str) -> Any:
    from types import SimpleNamespace

    from tests.helpers.miles_source import RolloutManager

    result = actor.init(
        _args(world_size, config), "actor", indep_dp_info=SimpleNamespace(cell_index=0, num_cells=1)
    )
    actor.set_rollout_manager(RolloutManager())
    return result


def _worker(
    rank: int, world_size: int, store: Any, location: str, commit: str, port: int, variant: str, config: str
) -> dict[str, Any]:
    from tests.helpers.miles_source import RECORD, SAVER, engines_and_lock, install, model_checksum
    from tests.helpers.slime_source import checksum

    actor_module = install(MilesSource(Path(location), commit))
    os.environ.update(launcher_env())
    if variant == "reproductions":
        return _reproductions(actor_module)
    if variant == "launcher":
        return _launcher_run(actor_module, config)
    if variant == "save after sync":
        return _save_after_sync(actor_module, port)
    serial = _count_miles_teardowns()
    watched = _watch_miles_logs()
    cls = _lifecycle_class(actor_module) if variant == "lifecycle" else actor_module.MegatronTrainRayActor
    actor = _build(cls, world_size, rank, port, config)
    out: dict[str, Any] = {"steps": []}
    first = [True]

    def step(name: str, call: Any) -> None:
        error = _error(call)
        machine = getattr(actor, "_lifecycle", None)
        out["steps"].append(
            {
                "step": name,
                "state": machine.state.value if machine is not None else None,
                "error": error,
                "memory": _memory_calls(),
            }
        )

    def update_weights() -> None:
        actor.update_weights(engines_and_lock(new_engines=first[0]))
        first[0] = False

    step("init", lambda: _init(actor, world_size, config))
    out["hook_mode"] = SAVER.initialised_hook_mode
    out["margin"] = SAVER.margin
    out["groups_init"] = _groups()
    # What the first sync reads: the CPU copy, or the params the sleep kept resident (rematerialize).
    out["weights_init"] = checksum(actor.weights_backuper.get("actor"))
    step("update_weights", update_weights)
    step("train", lambda: actor.train(0, _rollout(0)))
    out["groups_awake"] = _groups()
    step("save", lambda: actor.save_model(0))
    if variant == "miles":  # miles' own driver order (train.py): offload after the save, then the sync
        step("sleep", actor.sleep)
        step("update_weights", update_weights)
        out["groups_end"] = _groups()
    else:
        step("update_weights", update_weights)
        step("sleep", actor.sleep)
        step("sleep", actor.sleep)
        step("wake_up", actor.wake_up)
        step("wake_up", actor.wake_up)
        out["weights_after_wake"] = model_checksum(actor.model)
        actor.faults.arm("process_groups.destroy")  # the next sleep fails on every rank
        step("sleep", actor.sleep)
        out["failure"] = actor.lifecycle_state()["failure"]
        step("recover", lambda: actor.lifecycle_recover("PAUSED"))
        step("train", lambda: actor.train(1, _rollout(1)))
        step("save", lambda: actor.save_model(1))
        step("sleep", actor.sleep)
        step("update_weights", update_weights)
        out["groups_end"] = _groups()
        step("wake_up", actor.wake_up)
        out["groups_awake_end"] = _groups()
        out["weights_end"] = model_checksum(actor.model)
        out["stand_in_calls"] = actor.lifecycle_stand_in_calls()
        out["memory_backend"] = actor.lifecycle.hooks.memory.describe()
    out["serial_teardowns"] = serial[0]
    out["record"] = {k: RECORD[k] for k in ("trained", "saved", "engine", "cpu_memory")}
    out["miles_logs"] = watched
    return out


def _reproductions(actor_module: Any) -> dict[str, Any]:
    """Each of the model check's reproductions on miles' real class, plain and under the adapter (one rank)."""
    from tests.helpers.framework_source import free_port
    from tests.helpers.method_sequences import KINDS
    from tests.helpers.miles_source import RECORD, engines_and_lock, fresh_process_state

    def kind_of(exc: BaseException) -> str:
        return next((kind for needle, kind in KINDS.items() if needle in str(exc)), f"other: {exc!r}")

    def discarded() -> bool:
        read = [*RECORD["saved"][-1:], *(e["checksum"] for e in RECORD["engine"][-1:])]
        return any(math.isnan(value) for value in read)

    def run(cls: type, config: str, sequence: tuple[str, ...]) -> list[str | None]:
        """What each call did: None (ran clean), the kind of violation, or the typed error it was refused with."""
        from lifecycle.errors import LifecycleError, ProtocolViolation

        fresh_process_state()
        actor = _build(cls, 1, 0, free_port(), config)
        _init(actor, 1, config)
        calls = {
            "sleep": actor.sleep,
            "wake_up": actor.wake_up,
            "train": lambda: actor.train(1, _rollout(1)),
            "save_model": lambda: actor.save_model(1),
            "update_weights": lambda: actor.update_weights(engines_and_lock()),
        }
        outcome: list[str | None] = []
        for name in sequence:
            RECORD["saved"].clear()
            RECORD["engine"].clear()
            try:
                calls[name]()
            except ProtocolViolation as exc:
                outcome.append(kind_of(exc))
                break
            except LifecycleError as exc:
                outcome.append(type(exc).__name__)
                continue
            outcome.append("reads discarded params" if discarded() else None)
        return outcome

    lifecycle = _lifecycle_class(actor_module)
    return {
        "results": [
            {
                "config": config,
                "sequence": list(sequence),
                "plain": run(actor_module.MegatronTrainRayActor, config, sequence),
                "lifecycle": run(lifecycle, config, sequence),
            }
            for config, sequence, _ in REPRODUCTIONS
        ]
    }


def _save_after_sync(actor_module: Any, port: int) -> dict[str, Any]:
    """Rematerialize layout, one rank: init (asleep, the params resident) → update_weights (pushes them,
    releases them) → save_model from PAUSED → a second push → wake_up."""
    from tests.helpers.miles_source import RECORD, SAVER, engines_and_lock

    actor = _build(_lifecycle_class(actor_module), 1, 0, port, "rematerialize")
    _init(actor, 1, "rematerialize")
    actor.update_weights(engines_and_lock())
    out: dict[str, Any] = {"before": dict(SAVER.paused)}
    _memory_calls()
    out["save_error"] = _error(lambda: actor.save_model(0))
    out["after"], out["memory"], out["state"] = (
        dict(SAVER.paused),
        _memory_calls(),
        actor.lifecycle_state()["state"],
    )
    out["saved"] = list(RECORD["saved"])
    out["second_push"] = _error(lambda: actor.update_weights(engines_and_lock(new_engines=False)))
    actor.wake_up()
    out["after_wake"] = dict(SAVER.paused)
    return out


def _launcher_run(actor_module: Any, config: str) -> dict[str, Any]:
    """miles' launcher picks the class by the name in miles' actor module: the one line a user adds."""
    from types import SimpleNamespace

    from tests.helpers.miles_source import RECORD, RolloutManager, engines_and_lock

    for name in launcher_env():
        os.environ.pop(name)  # the launcher must put them there itself
    trainer = _lifecycle_class(actor_module)
    actor_module.MegatronTrainRayActor = trainer
    factory = sys.modules["miles.ray.train.actor_factory"]
    placement = sys.modules["ray.util.placement_group"].PlacementGroup()
    handles = factory.allocate_gpus_for_actor(
        args=_args(1, config),
        gpus_per_cell=1,
        pg=(placement, [0], [0]),
        num_gpus_per_actor=0.4,
        indep_dp_store_addr=None,
        role="actor",
        cell_index=0,
    )
    actor = handles[0].instance
    out: dict[str, Any] = {"cls": type(actor).__name__, "env_vars": RECORD["ray_actors"][0]["env_vars"]}
    actor.init(_args(1, config), "actor", indep_dp_info=SimpleNamespace(cell_index=0, num_cells=1))
    actor.set_rollout_manager(RolloutManager())
    out["hook_mode"] = actor.lifecycle.hooks.memory.hook_mode
    out["states"] = [actor.lifecycle_state()["state"]]
    actor.update_weights(engines_and_lock())
    actor.train(0, _rollout(0))
    actor.save_model(0)
    actor.sleep()
    actor.update_weights(engines_and_lock(new_engines=False))
    out["states"].append(actor.lifecycle_state()["state"])
    actor.wake_up()
    out["states"].append(actor.lifecycle_state()["state"])
    out["record"] = {k: RECORD[k] for k in ("trained", "saved", "engine")}
    return out


def _run(variant: str, config: str = "all memory", world_size: int = 2) -> list[dict[str, Any]]:
    from tests.helpers.framework_source import free_port

    assert SOURCE is not None
    results = run_world(
        _worker,
        world_size,
        str(SOURCE.location),
        SOURCE.commit,
        free_port(),
        variant,
        config,
        deadline_s=DEADLINE_S,
    )
    no_crash(results)
    return results


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


_RUNS: dict[tuple[str, str], list[dict[str, Any]]] = {}


def _cached(variant: str, config: str) -> list[dict[str, Any]]:
    if (variant, config) not in _RUNS:
        _RUNS[variant, config] = _run(variant, config)
    return _RUNS[variant, config]


# Per layout, the pauses and resumes each step made under the adapter: one per tag per sleep, one per wake.
_ALL = ("memory.pause", "memory.resume")
_TAGS = ("grad_buffer", "default", "param_buffer")
_SLEEP_TAGS = ("grad_buffer", "default")


def _expected_memory(layout: str) -> list[list[str]]:
    if layout == "rematerialize":
        pause = [f"memory.pause[{t}]" for t in _SLEEP_TAGS]
        resume_all = [f"memory.resume[{t}]" for t in _TAGS]
        return [
            pause,  # init's sleep: the params stay for the sync
            ["memory.pause[param_buffer]"],  # update_weights from PAUSED, after its push
            resume_all,  # train
            [],  # save
            [],  # update_weights from AWAKE: an awake actor keeps its params
            pause,  # sleep
            [],  # sleep: no-op
            [f"memory.resume[{t}]" for t in _SLEEP_TAGS],  # wake: the params were never released
            [],  # wake: no-op
            [],  # the failed sleep (the teardown raised before any pause)
            [*pause, "memory.pause[param_buffer]"],  # recover(PAUSED): every tag
            resume_all,  # train
            [],  # save
            pause,  # sleep
            ["memory.pause[param_buffer]"],  # update_weights
            resume_all,  # wake
        ]
    tag = "" if layout == "all memory" else "[default]"
    pause, resume = [f"memory.pause{tag}"], [f"memory.resume{tag}"]
    return [pause, [], resume, [], [], pause, [], resume, [], [], pause, resume, [], pause, [], resume]


class TestUnderTheAdapter:
    """init → update_weights → train → save → update_weights → sleep x2 → wake x2 → injected failure →
    recover → train → save → sleep → update_weights → wake, in each of miles' tag layouts."""

    def test_states(self, layout: str) -> None:
        for result in _cached("lifecycle", layout):
            assert steps_of(result) == [
                ("init", "PAUSED", None),
                ("update_weights", "PAUSED", None),
                ("train", "AWAKE", None),
                ("save", "AWAKE", None),
                ("update_weights", "AWAKE", None),
                ("sleep", "PAUSED", None),
                ("sleep", "PAUSED", None),
                ("wake_up", "AWAKE", None),
                ("wake_up", "AWAKE", None),
                ("sleep", "FAILED", "InjectedFault"),
                ("recover", "PAUSED", None),
                ("train", "AWAKE", None),
                ("save", "AWAKE", None),
                ("sleep", "PAUSED", None),
                ("update_weights", "PAUSED", None),
                ("wake_up", "AWAKE", None),
            ]
            assert result["failure"]["hook"] == "process_groups.destroy"

    def test_one_pause_per_tag_per_sleep_and_one_resume_per_wake(self, layout: str) -> None:
        for result in _cached("lifecycle", layout):
            assert [s["memory"] for s in result["steps"]] == _expected_memory(layout)

    def test_save_sync_and_wake_see_the_trained_weights(self, layout: str) -> None:
        for result in _cached("lifecycle", layout):
            trained, saved, engine = (result["record"][k] for k in ("trained", "saved", "engine"))
            assert trained[0] != result["weights_init"]
            assert saved == trained  # each save after the train before it
            assert [e["checksum"] for e in engine] == [result["weights_init"], trained[0], trained[1]]
            assert result["weights_after_wake"] == trained[0]
            assert result["weights_end"] == trained[1]

    def test_the_plans_own_the_resources(self, layout: str) -> None:
        body = [("sync", "reload_process_groups"), ("sync", "torch_memory_saver.disable")]
        released = [("sync", "torch_memory_saver.pause(param_buffer)")] if layout == "rematerialize" else []
        # miles' body takes its asleep branch from PAUSED only: _asleep reads the machine.
        from_paused = [*body, *released, ("sync", "destroy_process_groups")]
        from_awake = [("sync", "torch_memory_saver.disable"), *released]
        for result in _cached("lifecycle", layout):
            assert [tuple(c) for c in result["stand_in_calls"]] == [*from_paused, *from_awake, *from_paused]
            assert result["serial_teardowns"] == 0  # the sleep never ran miles' one-by-one teardown

    def test_the_saver_runs_in_the_launchers_mode(self, layout: str) -> None:
        """miles' init sets the memory margin, the saver's first use: the adapter set preload before it."""
        for result in _cached("lifecycle", layout):
            assert (result["hook_mode"], result["margin"]) == ("preload", MARGIN)
            assert "hook_mode=preload" in result["memory_backend"]

    def test_miles_own_timers_log_lines_and_memory_metric_run(self, layout: str) -> None:
        """miles' `@with_logs @timer` on sleep / wake_up (real: miles' Timer and structured_log) run for every
        call, no-ops and the failed sleep included, as in plain miles, with train's wake among them; its
        perf/cpu_memory_after_offload_train_gb is logged after each sleep that released memory, on the rank
        miles logs it from (PP's last stage here) and once a train step ran."""
        timed = [
            "sleep",
            "wake_up",
            "sleep",
            "sleep",
            "wake_up",
            "wake_up",
            "sleep",
            "wake_up",
            "sleep",
            "wake_up",
        ]
        for rank, result in enumerate(_cached("lifecycle", layout)):
            assert result["miles_logs"]["timed"] == timed
            lines = [(fn, phase) for _, fn, phase in result["miles_logs"]["logged"]]
            assert lines == [(fn, phase) for fn in timed for phase in ("start", "end")]
            assert {cls for cls, _, _ in result["miles_logs"]["logged"]} == {"LifecycleTrainer"}
            expected = [[0, "after_offload_train"], [1, "after_offload_train"]] if rank == 1 else []
            assert result["record"]["cpu_memory"] == expected

    def test_group_count_is_flat_and_plain_miles(self, layout: str) -> None:
        for ours, theirs in zip(_cached("lifecycle", layout), _cached("miles", layout), strict=True):
            assert ours["groups_end"] == ours["groups_init"] == theirs["groups_init"] == theirs["groups_end"]
            assert ours["groups_awake_end"] == ours["groups_awake"] == theirs["groups_awake"]
            assert ours["groups_awake"]["miles_registry"] == ours["groups_init"]["miles_registry"] > 0

    def test_figures(self, layout: str) -> None:
        assert SOURCE is not None
        print(f"\nmiles {SOURCE.resolved_commit()} from {SOURCE.location}, layout {layout!r}")
        for rank, (ours, theirs) in enumerate(
            zip(_cached("lifecycle", layout), _cached("miles", layout), strict=True)
        ):
            record = ours["record"]
            print(
                f"rank {rank}: groups asleep {ours['groups_init']} → {ours['groups_end']}, awake "
                f"{ours['groups_awake']} → {ours['groups_awake_end']} (plain miles asleep {theirs['groups_init']}, "
                f"awake {theirs['groups_awake']}); weights init {ours['weights_init']} trained {record['trained']} "
                f"saved {record['saved']} synced {[e['checksum'] for e in record['engine']]} after wake "
                f"{ours['weights_after_wake']}; memory calls {[s['memory'] for s in ours['steps']]}"
            )


class TestSaveAfterSync:
    def test_a_save_from_paused_leaves_the_residency_it_found(self) -> None:
        """miles' real class, rematerialize layout: the push released the params; the save wakes (they are
        rebuilt from the master weights), saves them and releases every tag again, param_buffer included."""
        (result,) = _run("save after sync", "rematerialize", world_size=1)
        assert result["save_error"] is None and result["state"] == "PAUSED"
        assert result["before"] == result["after"] == dict.fromkeys(_TAGS, True)
        assert result["memory"] == [
            *(f"memory.resume[{t}]" for t in _TAGS),
            *(f"memory.pause[{t}]" for t in _TAGS),
        ]
        assert len(result["saved"]) == 1 and not math.isnan(result["saved"][0])
        assert (
            result["second_push"].startswith("IllegalTransitionError")
            and "released after its push" in (result["second_push"])
        )
        assert not any(result["after_wake"].values())


class TestPlainMiles:
    def test_initialises_the_saver_in_the_mode_megatron_left_pending(self) -> None:
        """--train-memory-margin-bytes: plain miles' init is the saver's first use, in torch mode, which in
        its preloaded process pauses none of the preload library's memory."""
        for result in _cached("miles", "all memory"):
            assert result["hook_mode"] == "torch"

    def test_its_driver_order_runs_and_its_sleep_tears_down_one_by_one(self, layout: str) -> None:
        for result in _cached("miles", layout):
            assert [s["error"] for s in result["steps"]] == [None] * 6
            # init's sleep, the driver's, and the two syncs from asleep (miles destroys what they reloaded)
            assert result["serial_teardowns"] == 4

    def test_its_timers_and_memory_metric_are_what_the_adapter_keeps(self, layout: str) -> None:
        """init's sleep, train's wake, the driver's sleep: the same entries the adapter's run makes for them."""
        for rank, result in enumerate(_cached("miles", layout)):
            assert result["miles_logs"]["timed"] == ["sleep", "wake_up", "sleep"]
            assert result["record"]["cpu_memory"] == ([[0, "after_offload_train"]] if rank == 1 else [])


class TestReproductionsOnMilesSource:
    """The model check's shortest reproductions on miles' real class: plain miles breaks as the model says;
    under the adapter every call runs or is refused with a typed error before any work."""

    @pytest.fixture(scope="class")
    def results(self) -> list[dict[str, Any]]:
        (result,) = _run("reproductions", world_size=1)
        return list(result["results"])

    def test_plain_miles_breaks_as_the_model_says(self, results: list[dict[str, Any]]) -> None:
        for (config, sequence, kind), result in zip(REPRODUCTIONS, results, strict=True):
            plain = result["plain"]
            assert plain[:-1] == [None] * (len(sequence) - 1), (config, sequence, plain)
            assert plain[-1] is not None and (plain[-1] == kind or kind.startswith(plain[-1])), (
                config,
                sequence,
                plain,
            )

    def test_each_runs_under_the_adapter(self, results: list[dict[str, Any]]) -> None:
        for (config, sequence, _), result in zip(REPRODUCTIONS, results, strict=True):
            refused = REFUSED.get((config, sequence))
            expected = [None] * len(sequence)
            if refused is not None:
                expected[-1] = refused[1].__name__
            assert result["lifecycle"] == expected, (config, sequence, result["lifecycle"])

    def test_figures(self, results: list[dict[str, Any]]) -> None:
        print("\nreproductions on miles' real class (plain → under the adapter):")
        for result in results:
            print(
                f"  {result['config']}: init → {' → '.join(result['sequence'])}: {result['plain']} → {result['lifecycle']}"
            )


class TestLauncher:
    def test_miles_launcher_builds_and_drives_the_adapter(self) -> None:
        """allocate_gpus_for_actor builds the class named in miles' actor module, with the preload
        environment, which the adapter's memory backend follows."""
        (result,) = _run("launcher", "rematerialize", world_size=1)
        assert result["cls"] == "LifecycleTrainer"
        env = result["env_vars"]
        assert env["TMS_INIT_ENABLE"] == "1" and "torch_memory_saver" in env["LD_PRELOAD"]
        assert result["hook_mode"] == "preload"
        assert result["states"] == ["PAUSED", "PAUSED", "AWAKE"]
        record = result["record"]
        assert record["saved"] == record["trained"] == [e["checksum"] for e in record["engine"]][1:]

"""What the trainer suites share on a framework's real MegatronTrainRayActor from its source
(test_slime_source.py, test_vime_source.py; miles' test_miles_source.py takes the trainer class and
the step list): the class a user writes, one rank's run as the workers drive it, and the checks of
the run under the adapter.

vime is slime's trainer under another package name, so its suite runs slime's sequence: each
suite's worker records its calls in a `TrainerRun` (`to_the_first_sync`, then `under_the_adapter`
for the lifecycle class), and its test classes subclass the `...Suite` classes here, which read the
module's `lifecycle_run` fixture (each rank's `TrainerRun.out`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.framework_source import error_of, group_counts
from tests.helpers.slime_source import model_checksum


def lifecycle_trainer(mixin: Any, actor_class: Any, memory: Callable[[Any], Any] | None = None) -> Any:
    """What a user writes (`mixin` over the framework's class), plus fault injection and the CUDA major
    this CPU torch lacks: the memory backend is `memory(self)`, by default slime's for CUDA 13."""
    from actor_integration.frameworks.slime import slime_memory_backend
    from lifecycle.faults import FaultInjector, with_faults

    class LifecycleTrainer(mixin, actor_class):
        def lifecycle_memory(self) -> Any:
            if memory is not None:
                return memory(self)
            return slime_memory_backend(cuda_major=13)  # os.environ is the launcher's

        def lifecycle_hooks(self) -> Any:
            self.faults = FaultInjector()
            return with_faults(self.faults, super().lifecycle_hooks())

    return LifecycleTrainer


def steps_of(result: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
    """A run's steps as (name, state after it, the error's type or None)."""
    return [(s["step"], s["state"], s["error"] and s["error"].split(":")[0]) for s in result["steps"]]


@dataclass
class TrainerRun:
    """One rank's run of a framework's trainer as its suite's worker drives it. Each call is a step
    in `out["steps"]` (its name, the machine's state after it, its error as "Type: message", the
    saver's pause count); the groups (`group_counts(framework)`), weights and records the checks
    read are in `out` too."""

    actor: Any
    framework: str
    saver: Any
    rollout: Callable[[int], Any]
    out: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.setdefault("steps", [])

    def step(self, name: str, call: Callable[[], Any]) -> None:
        error = error_of(call)
        machine = getattr(self.actor, "_lifecycle", None)
        state = machine.state.value if machine is not None else None
        self.out["steps"].append(
            {"step": name, "state": state, "error": error, "pauses": self.saver.pause_count}
        )

    def groups(self) -> dict[str, int]:
        return group_counts(self.framework)

    def train(self, rollout_id: int) -> Callable[[], Any]:
        return lambda: self.actor.train(rollout_id, self.rollout(rollout_id))

    def to_the_first_sync(self, init: Callable[[], Any], rollout_manager: Any) -> None:
        """init → train → save → update_weights, the groups and the weights after init recorded."""
        actor = self.actor
        self.step("init", init)
        actor.set_rollout_manager(rollout_manager)
        self.out["groups_init"] = self.groups()
        self.out["weights_init"] = model_checksum(actor.model)
        self.step("train", self.train(0))
        self.step("save", lambda: actor.save_model(0))
        self.step("update_weights", actor.update_weights)

    def under_the_adapter(
        self, awake: Callable[[], dict[str, Any]], end: Callable[[], dict[str, Any]]
    ) -> None:
        """After `to_the_first_sync`: sleep x2 → wake x2 → a train whose closing sleep fails (injected) →
        recover → train → save → wake; the framework's own figures `awake()` after the wakes, `end()` last."""
        actor, step, out = self.actor, self.step, self.out
        step("sleep", actor.sleep)
        step("sleep", actor.sleep)
        step("wake_up", actor.wake_up)
        step("wake_up", actor.wake_up)
        out["weights_after_wake"] = model_checksum(actor.model)
        out["groups_awake"] = self.groups()
        out.update(awake())
        actor.faults.arm("process_groups.destroy")  # the sleep that ends the next train fails on every rank
        step("train", self.train(1))
        out["failure"] = actor.lifecycle_state()["failure"]
        step("recover", lambda: actor.lifecycle_recover("PAUSED"))
        step("train", self.train(2))
        step("save", lambda: actor.save_model(2))
        out["groups_end"] = self.groups()
        step("wake_up", actor.wake_up)
        out["groups_awake_end"] = self.groups()
        out["stand_in_calls"] = actor.lifecycle_stand_in_calls()
        out.update(end())

    def finish(self, record: dict[str, list[Any]], keys: tuple[str, ...]) -> dict[str, Any]:
        """The run's result: the stand-ins' `record` under `keys`, the saver's pauses and resumes."""
        self.out["record"] = {k: record[k] for k in keys}
        self.out["pauses"], self.out["resumes"] = self.saver.pause_count, self.saver.resume_count
        return self.out


def drive_the_group(
    group: Any, actor: Any, rollout: Callable[[int], Any], record: dict[str, Any]
) -> dict[str, Any]:
    """A RayTrainGroup of one rank (`actor`) as slime's train loop drives it: a train step, a save, a sync,
    offload x2, onload x2. The memory backend's hook mode, the state before, after the offloads and after
    the onloads, and what the stand-ins saw."""
    out: dict[str, Any] = {"hook_mode": actor.lifecycle.hooks.memory.hook_mode}
    out["states"] = [actor.lifecycle_state()["state"]]
    group.async_train(0, rollout(0))
    group.save_model(0)
    group.update_weights()
    group.offload()
    group.offload()
    out["states"].append(actor.lifecycle_state()["state"])
    group.onload()
    group.onload()
    out["states"].append(actor.lifecycle_state()["state"])
    out["record"] = {k: record[k] for k in ("trained", "saved", "engine")}
    return out


def check_driven_through_the_group(result: dict[str, Any]) -> None:
    """`drive_the_group`'s run under the adapter: in the launcher's preload mode, asleep after init and
    the offloads, awake after the onloads; each save and the sync saw the weights of the train before."""
    assert result["env_vars"]["TMS_INIT_ENABLE"] == "1"
    assert result["hook_mode"] == "preload"
    assert result["states"] == ["PAUSED", "PAUSED", "AWAKE"]
    record = result["record"]
    assert record["saved"] == record["trained"] == [e["checksum"] for e in record["engine"]]


def check_the_plain_sleep_after_a_sync_double_pauses(plain_run: list[dict[str, Any]]) -> None:
    """The framework's own class (slime #1895): init, train, save and update_weights run; the driver's sleep
    after update_weights pauses paused memory (TMS exits: the fake raises ProtocolViolation)."""
    for result in plain_run:
        steps = [(s["step"], s["error"] and s["error"].split(":")[0]) for s in result["steps"]]
        assert steps[:4] == [("init", None), ("train", None), ("save", None), ("update_weights", None)]
        assert steps[4] == ("sleep", "ProtocolViolation")


class UnderTheAdapterSuite:
    """init → train → save → update_weights → sleep x2 → wake x2 → injected failure → recover → train →
    save → wake (`TrainerRun.under_the_adapter`), read from the suite module's `lifecycle_run`."""

    def test_states(self, lifecycle_run: list[dict[str, Any]]) -> None:
        for result in lifecycle_run:
            assert steps_of(result) == [
                ("init", "PAUSED", None),
                ("train", "PAUSED", None),
                ("save", "PAUSED", None),
                ("update_weights", "PAUSED", None),
                ("sleep", "PAUSED", None),
                ("sleep", "PAUSED", None),
                ("wake_up", "AWAKE", None),
                ("wake_up", "AWAKE", None),
                ("train", "FAILED", "InjectedFault"),
                ("recover", "PAUSED", None),
                ("train", "PAUSED", None),
                ("save", "PAUSED", None),
                ("wake_up", "AWAKE", None),
            ]
            assert result["failure"]["hook"] == "process_groups.destroy"

    def test_save_sync_and_wake_see_the_trained_weights(self, lifecycle_run: list[dict[str, Any]]) -> None:
        for result in lifecycle_run:
            trained, saved, engine = (result["record"][k] for k in ("trained", "saved", "engine"))
            assert trained[0] != result["weights_init"]
            assert saved == [trained[0], trained[2]]  # each save after the train before it, never older
            assert [e["checksum"] for e in engine] == [trained[0]]  # the sync read the refreshed backup
            assert result["weights_after_wake"] == trained[0]  # the wake restored the trained weights

    def test_the_plans_own_the_resources(self, lifecycle_run: list[dict[str, Any]]) -> None:
        for result in lifecycle_run:
            assert result["stand_in_calls"] == [
                ["sync", "reload_process_groups"],
                ["sync", "torch_memory_saver.disable"],
                ["sync", "destroy_process_groups"],
            ]
            # Paused by init, train, save, recover (the failed sleep), train, save; resumed by train,
            # save, wake, train, save, wake: one call per transition, none by the framework's bodies.
            assert (result["pauses"], result["resumes"]) == (6, 6)

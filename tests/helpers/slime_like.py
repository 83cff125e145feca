"""A slime-shaped trainer actor on the recording fakes of `lifecycle.testing`, with and without the mixin.

`SlimeLikeActor` has the method names and bodies of slime's `MegatronTrainRayActor` (624b824a)
in colocate + offload_train mode, and reaches its resources the way slime does: through this
module's globals `torch_memory_saver`, `reload_process_groups()` and `destroy_process_groups()`
(process-wide, one actor per process as in a Ray worker; `build()` installs the actor's fakes),
and a CPU weight backup refreshed after every train step (`_switch_model` restores from it). So
tests can show the upstream failures on it, the failures of a plain `LifecycleMixin` over it
(the ones the real class shows), and their absence under `SlimeLifecycleMixin`.
No torch: the "model" is the fake memory plus an int standing for the trained weights.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from actor_integration.actors.mixin import LifecycleMixin
from actor_integration.frameworks.slime import SlimeLifecycleMixin
from lifecycle import Hooks, LifecyclePolicy
from lifecycle.testing import CallLog, FakeMemorySaver, FakeProcessGroups, ProtocolViolation, RecordingHook

# slime's actor module reaches these as globals; SlimeLifecycleMixin replaces them while bodies run.
torch_memory_saver = FakeMemorySaver()
_groups = FakeProcessGroups()


def reload_process_groups() -> None:
    """slime's: rebuild the groups that are destroyed; live ones are left alone."""
    if not _groups.alive:
        _groups.reload()


def destroy_process_groups() -> None:
    """slime's: destroy the live groups; destroyed ones are skipped."""
    if _groups.alive:
        _groups.destroy()


class SlimeLikeActor:
    """slime's actor shape: init ends asleep; train/save_model wake, work, sleep; update_weights syncs."""

    def init(self, *, rank: int = 0, offload_train: bool = True, use_routing_replay: bool = True) -> int:
        self.build(rank=rank, offload_train=offload_train, use_routing_replay=use_routing_replay)
        if self.args.offload_train:
            self._switch_model("actor")
            self.sleep()
        return 0

    def build(self, *, rank: int, offload_train: bool, use_routing_replay: bool) -> None:
        global torch_memory_saver, _groups
        self.rank = rank
        self.role = "actor"
        self.args = argparse.Namespace(
            offload_train=offload_train,
            colocate=True,
            use_routing_replay=use_routing_replay,
            use_critic=False,
        )
        self.calls = CallLog()
        self.tms = torch_memory_saver = FakeMemorySaver(log=self.calls)
        self.groups = _groups = FakeProcessGroups(log=self.calls)
        self.routing_replay = RecordingHook("routing_replay.clear", log=self.calls)
        self.clear_memory = RecordingHook("clear_memory", log=self.calls)
        self.saved: list[int] = []
        self.saved_weights: list[int] = []
        self.weights = 0  # the trained weights: +1 per train step
        self.backups = {"actor": self.weights}  # slime's weights_backuper (CPU copies per model tag)
        self.pushed: list[int] = []  # the weights update_weights sent to the engine
        self.weight_version = 0

    # slime's own sleep / wake_up (replaced by the plans under the mixin)
    def sleep(self) -> None:
        self.clear_memory()
        destroy_process_groups()
        torch_memory_saver.pause()

    def wake_up(self) -> None:
        torch_memory_saver.resume()
        self.clear_memory()
        reload_process_groups()
        self._switch_model("actor")

    def _switch_model(self, target_tag: str) -> None:
        self.calls.add("switch_model", "", target_tag)
        if target_tag not in self.backups:
            raise ValueError(f"Cannot switch to unknown model tag: {target_tag}")
        self.weights = self.backups[target_tag]

    def train(self, rollout_id: int) -> dict[str, Any]:
        if self.args.offload_train:
            self.wake_up()
        self.tms.touch()  # forward/backward on the model
        self.groups.use()  # gradient all-reduce
        self.weights += 1
        self.calls.add("body", "train", str(rollout_id))
        self.backups["actor"] = self.weights  # slime: update the cpu actor weight to the latest model
        if self.args.offload_train:
            self.sleep()
        return {"rollout_id": rollout_id}

    def save_model(self, rollout_id: int) -> None:
        # slime >= #1888: wake_up before the save, sleep after.
        if self.args.offload_train:
            self.wake_up()
        self._save(rollout_id)
        if self.args.offload_train:
            self.sleep()

    def save_model_before_1888(self, rollout_id: int) -> None:
        """slime before #1888: the save ran on whatever memory train() left behind."""
        self._save(rollout_id)

    def _save(self, rollout_id: int) -> None:
        self.tms.touch()  # torch.distributed checkpoint reads the parameters...
        self.groups.use()  # ...and may communicate
        self.calls.add("body", "save", str(rollout_id))
        self.saved.append(rollout_id)
        self.saved_weights.append(self.weights)

    def update_weights(self) -> int:
        """slime's shape: reload the groups, push under disable(), destroy the groups."""
        if self.args.offload_train:
            reload_process_groups()
        with torch_memory_saver.disable() if self.args.offload_train else contextlib.nullcontext():
            self.groups.use()
            if not self.tms.disabled:
                raise ProtocolViolation(
                    "weight buckets allocated inside memory-saver regions cannot be IPC-exported"
                )
            self.weight_version += 1
            self.pushed.append(self.backups["actor"])  # the sync reads the CPU copy (model memory paused)
            self.calls.add("body", "sync", str(self.weight_version))
        if self.args.offload_train:
            destroy_process_groups()
        return self.weight_version


def slime_lifecycle_config(actor: SlimeLikeActor) -> dict[str, Any]:
    """`configure_lifecycle` arguments for a slime-shaped actor built by `SlimeLikeActor.build`."""
    return {
        "policy": LifecyclePolicy.from_args(actor.args),
        "hooks": Hooks(
            memory=actor.tms,
            process_groups=actor.groups,
            routing_replay=actor.routing_replay,
            clear_memory=actor.clear_memory,
            switch_model=actor._switch_model,
        ),
        "rank": actor.rank,
        "role": "actor",
    }


class PlainMixinSlimeActor(LifecycleMixin, SlimeLikeActor):
    """The generic mixin alone: its plans and slime's update_weights both own memory and groups."""

    def lifecycle_config(self) -> dict[str, Any]:
        return slime_lifecycle_config(self)


class LifecycleSlimeActor(SlimeLifecycleMixin, SlimeLikeActor):
    """The same actor under the slime adapter, its bodies and init unchanged: the `self.sleep()` that
    ends slime's init configures the lifecycle (`lifecycle_config`) and then sleeps through it."""

    def lifecycle_config(self) -> dict[str, Any]:
        return slime_lifecycle_config(self)

    def calls_made(self) -> list[str]:
        """For remote tests: the backend calls so far."""
        return self.calls.names()

    def configure_logs(self, path: str) -> None:
        import lifecycle

        lifecycle.configure_logging(json_path=path)

    def flush_logs(self) -> bool:
        import lifecycle

        return lifecycle.flush_logs()

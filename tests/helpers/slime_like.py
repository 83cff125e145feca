"""A slime-shaped trainer actor on the recording fakes of `lifecycle.testing`, with and without the mixin.

`SlimeLikeActor` has the method names and bodies of slime's `MegatronTrainRayActor` in colocate +
offload_train mode (its own `sleep`/`wake_up` call the backends directly, the way slime does), so
tests can show the upstream failures on it and their absence under `LifecycleMixin`.
No torch: the "model" is the fake memory, and every body checks what a real one would need.
"""

from __future__ import annotations

import argparse
from typing import Any

from actor_integration.mixin import LifecycleMixin
from lifecycle import Hooks, LifecyclePolicy
from lifecycle.testing import CallLog, FakeMemorySaver, FakeProcessGroups, ProtocolViolation, RecordingHook


class SlimeLikeActor:
    """slime's actor shape: init ends asleep; train/save_model wake, work, sleep; update_weights syncs."""

    def init(self, *, rank: int = 0, offload_train: bool = True, use_routing_replay: bool = True) -> int:
        self.build(rank=rank, offload_train=offload_train, use_routing_replay=use_routing_replay)
        if self.args.offload_train:
            self.sleep()
        return 0

    def build(self, *, rank: int, offload_train: bool, use_routing_replay: bool) -> None:
        self.rank = rank
        self.args = argparse.Namespace(
            offload_train=offload_train,
            colocate=True,
            use_routing_replay=use_routing_replay,
            use_critic=False,
        )
        self.calls = CallLog()
        self.tms = FakeMemorySaver(log=self.calls)
        self.groups = FakeProcessGroups(log=self.calls)
        self.routing_replay = RecordingHook("routing_replay.clear", log=self.calls)
        self.clear_memory = RecordingHook("clear_memory", log=self.calls)
        self.switch_model = RecordingHook("switch_model", log=self.calls)
        self.saved: list[int] = []
        self.weight_version = 0

    # slime's own sleep / wake_up (replaced by the plans under the mixin)
    def sleep(self) -> None:
        self.clear_memory()
        if self.groups.alive:  # slime's destroy_process_groups() skips groups already destroyed
            self.groups.destroy()
        self.tms.pause()

    def wake_up(self) -> None:
        self.tms.resume()
        self.clear_memory()
        self.groups.reload()
        self.switch_model("actor")

    def train(self, rollout_id: int) -> dict[str, Any]:
        if self.args.offload_train:
            self.wake_up()
        self.tms.touch()  # forward/backward on the model
        self.groups.use()  # gradient all-reduce
        self.calls.add("body", "train", str(rollout_id))
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

    def update_weights(self) -> int:
        """The weight push; under the mixin the groups and the saver's disable() come from the plan."""
        self.groups.use()
        if not self.tms.disabled:
            raise ProtocolViolation(
                "weight buckets allocated inside memory-saver regions cannot be IPC-exported"
            )
        self.weight_version += 1
        self.calls.add("body", "sync", str(self.weight_version))
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
            switch_model=actor.switch_model,
        ),
        "rank": actor.rank,
        "role": "actor",
    }


class LifecycleSlimeActor(LifecycleMixin, SlimeLikeActor):
    """The same actor under the mixin, its bodies and init unchanged: the `self.sleep()` that ends
    slime's init configures the lifecycle (`lifecycle_config`) and then sleeps through it."""

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

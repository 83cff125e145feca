"""What AReaL's `rl_trainer` and `RecoverHandler` do between the trainer and the rollout, from a driver.

AReaL orchestrates the colocated switch from its trainer process (`areal/trainer/rl_trainer.py`,
`areal/utils/recover.py` at cbff54d6): the rollout paused and offloaded before the actor's
onload, the actor's AWEX update, the rollout resumed after it; on recovery the same pause and
offload before the checkpoint load, and `resume()` in a `finally`. `ArealColocateDriver` makes
those calls with the trainer's ranks behind a `LifecycleGroup` (each a Ray actor of a class built
on `ArealTrainerMixin`: deadlines, dead ranks named, their states read back) and the rollout's
engine under `ArealRolloutMixin`:

    driver = ArealColocateDriver(LifecycleGroup(trainer_actors, role="trainer"), rollout)
    driver.to_trainer()            # rollout paused (abort, then in_place) and released; actor woken
    ...                            # AReaL's compute_logp, ppo_update, save, on every rank
    driver.update_weights(meta)    # the AWEX transfer; the rollout woken on the new version
    driver.to_rollout()            # the workflow admitted again
    driver.recover(load_meta, meta)  # RecoverHandler's colocate branch

`rollout` is the engine object, or `RayCalls(handle)` for an engine in a Ray actor.

Under AReaL's own single controller the same calls go through its `TrainController` and
`RolloutController`, which fan each one out to the workers' engines (built on the two mixins).
Only the transfer's report needs the controllers' help, since AReaL's rank-0 `RolloutCallback`
has no route for it: `ArealTrainControllerMixin.update_weights` tells the connected rollout
controller, whose `ArealRolloutControllerMixin` fans the report out to its workers.

    class LifecycleTrainController(ArealTrainControllerMixin, TrainController): ...
    class LifecycleRolloutController(ArealRolloutControllerMixin, RolloutController): ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Ray is the `ray` extra: the driver imports it only through the group it is given
    from actor_integration.actors.ray_group import LifecycleGroup

__all__ = ["ArealColocateDriver", "ArealRolloutControllerMixin", "ArealTrainControllerMixin", "RayCalls"]


class RayCalls:
    """A Ray actor handle whose method calls wait for their result (`ray.get`, with a deadline)."""

    def __init__(self, handle: Any, *, timeout_s: float = 300.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        import ray

        method = getattr(self.handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return ray.get(method.remote(*args, **kwargs), timeout=self.timeout_s)
            except ray.exceptions.RayTaskError as exc:  # the actor's own error, as a local call raises it
                if isinstance(exc.cause, BaseException):
                    raise exc.cause from None
                raise

        return call


class ArealColocateDriver:
    """rl_trainer's colocate switch and RecoverHandler's colocate branch, each call through a machine."""

    def __init__(self, trainer: LifecycleGroup, rollout: Any) -> None:
        missing = [
            name
            for name in ("lifecycle_before_weights_update", "lifecycle_weights_updated", "pause", "resume")
            if not callable(getattr(rollout, name, None))
        ]
        if missing:
            raise TypeError(
                f"ArealColocateDriver: the rollout ({type(rollout).__name__}) lacks {missing}; pass AReaL's engine "
                "built on ArealRolloutMixin (or RayCalls(handle) for one in a Ray actor)"
            )
        self.trainer = trainer
        self.rollout = rollout

    def to_trainer(self) -> dict[int, dict[str, Any]]:
        """rl_trainer's switch before training: the workflow paused, the rollout paused in place and
        its KV cache and weights released, then every trainer rank woken. Each rank's state after."""
        self.rollout.pause()
        self.rollout.lifecycle_before_weights_update()
        return self.trainer.wake_up()

    def update_weights(self, meta: Any) -> dict[int, Any]:
        """The AWEX update on every rank at once; the rollout then learns what the plugin resumed and
        loaded (`meta.version`) and generation continues. Each rank's result."""
        self.rollout.lifecycle_before_weights_update()
        results = self.trainer.call("update_weights", meta)
        self.rollout.lifecycle_weights_updated(getattr(meta, "version", None))
        return results

    def to_rollout(self) -> Any:
        """The workflow admitted again (refused on weights no update reloaded)."""
        return self.rollout.resume()

    def recover(self, load_meta: Any, meta: Any) -> None:
        """RecoverHandler's colocate branch: the rollout paused and released before the checkpoint load
        (on every rank: woken for the load, asleep again after), the update, and `resume()` in a
        `finally`: the rollout is woken, or admission is refused with what to do; it is never left
        paused with its memory released while the workflow submits."""
        self.rollout.pause()
        try:
            self.rollout.lifecycle_before_weights_update()
            self.trainer.call("load", load_meta)
            self.update_weights(meta)
        finally:
            self.to_rollout()


class ArealRolloutControllerMixin:
    """AReaL's `RolloutController`: the transfer's report fanned out to every worker's engine (each
    built on `ArealRolloutMixin`), as the controller fans out its own calls (`_collective_rpc`)."""

    _collective_rpc: Any

    def lifecycle_before_weights_update(self) -> None:
        self._collective_rpc("lifecycle_before_weights_update", http_timeout=120.0)

    def lifecycle_weights_updated(self, version: int | None) -> None:
        self._collective_rpc("lifecycle_weights_updated", version=version, http_timeout=120.0)


class ArealTrainControllerMixin:
    """AReaL's `TrainController`: an AWEX update prepared on the rollout first (asleep, paused in
    place) and reported to it after (the plugin's resume of `weights` and the version), through
    the rollout controller `connect_engine` stored."""

    rollout: Any

    def update_weights(self, meta: Any) -> Any:
        rollout: Any = getattr(self, "rollout", None)
        awex = getattr(meta, "type", None) == "awex" and callable(
            getattr(rollout, "lifecycle_weights_updated", None)
        )
        if awex:
            rollout.lifecycle_before_weights_update()
        result = super().update_weights(meta)  # type: ignore[misc]
        if awex:
            version = getattr(meta, "version", None)
            rollout.lifecycle_weights_updated(version if isinstance(version, int) else None)
        return result

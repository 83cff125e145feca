"""`LifecycleMixin`: route an existing actor class's slime-named methods through a `Lifecycle`.

    class MyTrainer(LifecycleMixin, MegatronTrainRayActor):
        def init(self, args, role, ...):
            super().init(args, role, ...)           # or build the model here
            self.configure_lifecycle(LifecyclePolicy.from_args(args), Hooks(memory=..., process_groups=...))

`sleep()` and `wake_up()` become transitions (the class's own versions are replaced by the plans);
`train()`, `save_model()` and `update_weights()` run the class's own bodies (via `super()`) as the
operations train, save and sync. Bodies that call `self.wake_up()`/`self.sleep()` themselves keep
working: those nested calls are absorbed. `lifecycle_hold()`/`lifecycle_release()` bracket a held
scope from a driver (one wake and one sleep for several phases of a step). Bodies that call a resource directly (slime's
`update_weights` reloads and destroys its groups and enters `torch_memory_saver.disable()`) get
those names replaced while they run (`lifecycle_body_globals`), so the machine and the body
never both own a resource; `actor_integration.frameworks.slime` does that for slime.

Each actor writes its lifecycle events to `<dir>/<role>-rank<rank>.jsonl` unless the process
configured logging itself (`lifecycle.configure_rank_log`; the directory is `log_dir`, else
`$RL_LIFECYCLE_LOG_DIR`, else `./lifecycle-logs`): `lifecycle check DIR` and `lifecycle timeline`
read them with no code of the user's.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.errors import LifecycleNotConfiguredError
from lifecycle.events import configure_rank_log, log_path


class LifecycleMixin:
    """Put this class first in the bases: `class MyActor(LifecycleMixin, ExistingActor)`."""

    _lifecycle: Lifecycle | None = None
    _lifecycle_log: Path | None = None

    def configure_lifecycle(
        self,
        policy: LifecyclePolicy,
        hooks: Hooks,
        *,
        rank: int | None = None,
        role: str | None = None,
        initial: State = State.AWAKE,
        log_dir: str | Path | None = None,
    ) -> Lifecycle:
        """Build this actor's machine; call it in `__init__` (or `init`) before the first sleep or train.

        Unless the process configured its logging itself, its events go to
        `<log_dir>/<role>-rank<rank>.jsonl` (`log_dir`, else `$RL_LIFECYCLE_LOG_DIR`, else
        `./lifecycle-logs`; "off" for none): the files `lifecycle check` and `timeline` read."""
        _refuse_async_actor(type(self))
        if self._lifecycle is not None:
            raise RuntimeError(
                f"{type(self).__name__}.configure_lifecycle was already called (state {self._lifecycle.state}); "
                "an actor has one lifecycle"
            )
        role = role or type(self).__name__
        self._lifecycle_log = configure_rank_log(role, rank, log_dir=log_dir)
        self._lifecycle = Lifecycle(policy, hooks, rank=rank, role=role, initial=initial)
        return self._lifecycle

    def lifecycle_log_path(self) -> str | None:
        """The JSON-lines file this actor's lifecycle events go to (None: not to a file)."""
        path = log_path()
        return None if path is None else str(path)

    def lifecycle_config(self) -> dict[str, Any] | None:
        """Override to configure lazily: return `configure_lifecycle`'s arguments as a dict
        (`policy`, `hooks`, and optionally `rank`, `role`, `initial`).

        Called the first time the lifecycle is needed if `configure_lifecycle` was not called, e.g. by
        the `self.sleep()` at the end of slime's `init`, when the model and process groups exist.
        """
        return None

    @property
    def lifecycle(self) -> Lifecycle:
        """This actor's machine, configured on first use through `lifecycle_config()` if need be."""
        if self._lifecycle is None and (config := self.lifecycle_config()) is not None:
            return self.configure_lifecycle(**config)
        if self._lifecycle is None:
            raise LifecycleNotConfiguredError(
                f"{type(self).__name__} has no lifecycle yet: call self.configure_lifecycle(policy, Hooks(memory=...)) "
                "in __init__ (or init) before sleep(), wake_up(), train(), save_model() or update_weights(), "
                "or override lifecycle_config() to configure on first use"
            )
        return self._lifecycle

    # --------------------------------------------------------------- slime's method names

    def sleep(self, tags: Iterable[str] | None = None) -> None:
        """Release `tags` (default: all) through the sleep plan; a logged no-op when asleep."""
        self.lifecycle.sleep(tags)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Resume `tags` (default: all) through the wake plan; a logged no-op when awake."""
        self.lifecycle.wake_up(tags)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The class's own `train`, run as the operation train (from PAUSED it wakes first)."""
        return self._run_body("train", "train", args, kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> Any:
        """The class's own `save_model`, run as the operation save (in SAVING, memory resident)."""
        return self._run_body("save", "save_model", args, kwargs)

    def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The class's own `update_weights`, run as the operation sync (in SYNCING)."""
        return self._run_body("sync", "update_weights", args, kwargs)

    def lifecycle_body_globals(self, operation: str) -> Mapping[str, Any]:
        """Override to hand the plans a resource a wrapped body reaches through a module global.

        Return {global name: stand-in} for a body of `operation` ("train", "save", "sync"): while
        the body runs, those names in the module that defines it are the stand-ins, and the
        originals again after. Each name must be a global of that module (an adapter replacing a
        name the body no longer uses would leave two owners unnoticed). Default: none.
        """
        return {}

    # --------------------------------------------------------------- for drivers (LifecycleGroup)

    def lifecycle_state(self) -> dict[str, Any]:
        """A picklable snapshot: state, residency, groups, rank, role, step, failure."""
        return self.lifecycle.snapshot()

    def lifecycle_recover(self, target: str = "AWAKE") -> dict[str, Any]:
        """Bring a FAILED actor to `target` ("AWAKE" or "PAUSED"); the snapshot after."""
        self.lifecycle.recover(State(target))
        return self.lifecycle.snapshot()

    def lifecycle_expect(self, need_bytes: int | None) -> dict[str, Any]:
        """Declare the next phase's need (bytes) for this actor's memory budget (`Lifecycle.expect`);
        a driver calls it on every rank with the rollout's `wake_need_bytes()`. Returns the snapshot."""
        self.lifecycle.expect(need_bytes)
        return self.lifecycle.snapshot()

    def lifecycle_hold(self) -> dict[str, Any]:
        """Take a hold: sleeps wait for the release of the last hold (`Lifecycle.hold`). A Ray driver
        cannot hold `lifecycle.held()` open inside an actor, so it calls this and `lifecycle_release`
        (`LifecycleGroup.held()` does, on every rank). Returns the snapshot."""
        self.lifecycle.hold()
        return self.lifecycle.snapshot()

    def lifecycle_release(self) -> dict[str, Any]:
        """Give a hold back; the last one runs the deferred sleep (`Lifecycle.release`). Returns the snapshot."""
        self.lifecycle.release()
        return self.lifecycle.snapshot()

    def lifecycle_place(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id, IP, hostname, pid, GPU ids (`LifecycleGroup.locate`)."""
        from actor_integration.actors.cluster import here

        return here()

    def lifecycle_peers_lost(self, lost: Mapping[str, Sequence[int]], reason: str) -> dict[str, Any]:
        """The driver found `lost` (role → ranks) gone with their node: every wait of this actor's
        process groups on them ends now (`actor_integration.actors.cluster.lose_peers`). In a threaded
        actor (`max_concurrency=2`) this reaches a rank blocked on those peers; returns the snapshot."""
        from actor_integration.actors.cluster import lose_peers

        return lose_peers(self.lifecycle, lost, reason)

    def _run_body(self, operation: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        lifecycle = self.lifecycle  # configured first: the stand-ins may need the hooks
        body, owner = self._super_method(name)
        stand_ins = self.lifecycle_body_globals(operation)
        if stand_ins:
            body = _with_globals(body, owner, stand_ins)
        return lifecycle.run(operation, body, *args, **kwargs)

    def _super_method(self, name: str) -> tuple[Callable[..., Any], type]:
        # The next class after LifecycleMixin in this instance's MRO that defines `name`.
        mro = type(self).__mro__
        for klass in mro[mro.index(LifecycleMixin) + 1 :]:
            if name in vars(klass):
                return getattr(super(), name), klass
        raise NotImplementedError(
            f"{type(self).__name__}.{name}() has no body to run: LifecycleMixin wraps an existing {name}() "
            f"of a class after it in the bases (class {type(self).__name__}(LifecycleMixin, YourActor))"
        )


def _with_globals(body: Callable[..., Any], owner: type, stand_ins: Mapping[str, Any]) -> Callable[..., Any]:
    """`body` run with `stand_ins` in place of the globals of `owner`'s module, restored after.

    The swap happens inside the machine's lock (the body runs there), so wrapped operations of
    other threads never see it half done.
    """
    namespace = vars(sys.modules[owner.__module__])
    missing = sorted(n for n in stand_ins if n not in namespace)
    if missing:
        raise TypeError(
            f"{owner.__name__}'s module {owner.__module__} has no globals {missing}, which the lifecycle adapter "
            f"replaces while {owner.__name__}'s bodies run: this version of the class calls its resources "
            "differently, so the adapter cannot keep them single-owned. Update the adapter for this version."
        )

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        saved = {name: namespace[name] for name in stand_ins}
        namespace.update(stand_ins)
        try:
            return body(*args, **kwargs)
        finally:
            namespace.update(saved)

    return run


def _refuse_async_actor(cls: type) -> None:
    """Ray runs every method of a class with any `async def` on one event loop: refuse those."""
    for name in dir(cls):
        member = getattr(cls, name, None)
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
            raise TypeError(
                f"LifecycleMixin does not support Ray async actors: {cls.__name__}.{name} is async, so Ray would "
                "run all methods as coroutines on one event-loop thread, where the lifecycle's per-thread lock "
                "cannot tell a concurrent call from a nested one. Make the methods sync; for concurrency use a "
                "threaded actor (ray.remote(max_concurrency=N)), whose calls wait on the lifecycle lock."
            )


__all__ = ["LifecycleMixin", "LifecycleNotConfiguredError"]

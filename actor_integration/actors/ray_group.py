"""`LifecycleGroup`: the driver's view of a group of mixin-wrapped Ray actors.

Every wait has a deadline and names the ranks that did not answer; a dead actor is reported with
its last known state, and the group refuses further fan-out until the caller decides what to do
with it (`forget(rank)` or `replace(rank, new_actor)`). `held()` holds every rank in one scope and
releases every rank at once: the scope's one sleep destroys the process groups collectively.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actor_integration.errors import (
    DeadActorsError,
    GroupCallError,
    GroupTimeoutError,
    InconsistentGroupError,
)
from lifecycle.events import LOG_DIR_ENV


def _describe(state: Mapping[str, Any] | None) -> str:
    if state is None:
        return "never observed"
    described = f"{state['state']} residency {state['residency']} groups {state.get('groups')}"
    contents = state.get("contents")
    if contents and any(c != "valid" for c in contents.values()):
        described += f" contents {contents}"
    if state.get("weight_version") is not None:
        described += f" weights v{state['weight_version']}"
    return described


def log_dir_runtime_env(log_dir: str | Path, runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`runtime_env` with `RL_LIFECYCLE_LOG_DIR` set to `log_dir` (made absolute): pass it to
    `ray.init(runtime_env=...)` or an actor's `.options(runtime_env=...)`, and every actor built on
    `LifecycleMixin` or `RolloutActor` writes its `<role>-rank<rank>.jsonl` there."""
    env = dict(runtime_env or {})
    env["env_vars"] = {
        **dict(env.get("env_vars") or {}),
        LOG_DIR_ENV: str(Path(log_dir).expanduser().resolve()),
    }
    return env


class LifecycleGroup:
    """Fan lifecycle calls out to actors built on `LifecycleMixin`, with a deadline on every wait."""

    def __init__(
        self, actors: Sequence[Any], *, ranks: Iterable[int] | None = None, timeout_s: float = 60.0
    ) -> None:
        rank_list = list(ranks) if ranks is not None else list(range(len(actors)))
        if len(rank_list) != len(actors) or len(set(rank_list)) != len(rank_list):
            raise ValueError(
                f"LifecycleGroup: need one distinct rank per actor, got ranks {rank_list} for {len(actors)} actors"
            )
        if timeout_s <= 0:
            raise ValueError(f"LifecycleGroup: timeout_s must be positive, got {timeout_s}")
        self.actors: dict[int, Any] = dict(zip(rank_list, actors, strict=True))
        self.timeout_s = timeout_s
        self.last_known: dict[int, dict[str, Any]] = {}
        self.dead: dict[int, dict[str, Any] | None] = {}

    # ------------------------------------------------------------------ fan-out

    def call(
        self,
        method: str,
        *args: Any,
        timeout_s: float | None = None,
        ranks: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Call `method` on every actor (or on `ranks`); rank → result. Raises naming the ranks that failed,
        died or hung."""
        self._refuse_if_dead(method)
        targets = self.actors if ranks is None else {r: self.actors[r] for r in ranks}
        refs = {rank: getattr(actor, method).remote(*args, **kwargs) for rank, actor in targets.items()}
        return self._gather(method, refs, timeout_s)

    def call_each(
        self, method: str, args_by_rank: Mapping[int, tuple[Any, ...]], *, timeout_s: float | None = None
    ) -> dict[int, Any]:
        """Call `method(*args_by_rank[rank])` on each of those ranks at once (each rank its own data)."""
        self._refuse_if_dead(method)
        refs = {rank: getattr(self.actors[rank], method).remote(*a) for rank, a in args_by_rank.items()}
        return self._gather(method, refs, timeout_s)

    def _refuse_if_dead(self, method: str) -> None:
        if self.dead:
            raise DeadActorsError(
                f"refusing {method}: ranks {sorted(self.dead)} are dead ("
                + "; ".join(f"rank {r}: last known {_describe(s)}" for r, s in sorted(self.dead.items()))
                + "). Decide first: forget(rank) to go on without it, or replace(rank, actor) with a new one.",
                dead=dict(self.dead),
            )

    def _gather(self, method: str, refs: dict[int, Any], timeout_s: float | None) -> dict[int, Any]:
        deadline = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=deadline)
        ready_set = set(ready)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        died: list[int] = []
        for rank, ref in refs.items():
            if ref not in ready_set:
                continue
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError:
                died.append(rank)
                self.dead[rank] = self.last_known.get(rank)
            except RayTaskError as exc:
                errors[rank] = exc.cause if exc.cause is not None else exc
            except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                pass
        waited = time.monotonic() - started
        if died:
            raise DeadActorsError(
                f"{method}: ranks {died} died ("
                + "; ".join(f"rank {r}: last known {_describe(self.dead[r])}" for r in died)
                + "). Further calls are refused until you forget(rank) or replace(rank, actor).",
                dead={r: self.dead[r] for r in died},
            )
        missing = sorted(rank for rank, ref in refs.items() if ref not in ready_set)
        if missing:
            raise GroupTimeoutError(
                f"{method}: ranks {missing} did not answer within {deadline:.1f} s (waited {waited:.1f} s); last known: "
                + "; ".join(f"rank {r}: {_describe(self.last_known.get(r))}" for r in missing)
                + ". Likely cause: the actor is blocked in a collective that another rank never joined, or a hook "
                "hangs; read that rank's lifecycle log (its last lifecycle.transition) and its stack (ray stack).",
                operation=method,
                missing=missing,
                waited_s=waited,
            )
        if errors:
            raise GroupCallError(
                f"{method} raised on ranks {sorted(errors)}: "
                + "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())),
                operation=method,
                errors=errors,
            )
        return results

    def recover(self, target: str = "AWAKE", *, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """`recover(target)` on every FAILED rank (the others are left alone); rank → state after."""
        failed = [
            rank for rank, state in self.states(timeout_s=timeout_s).items() if state["state"] == "FAILED"
        ]
        if failed:
            self.last_known.update(self.call("lifecycle_recover", target, ranks=failed, timeout_s=timeout_s))
        return {rank: self.last_known[rank] for rank in failed}

    def states(self, *, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """rank → {state, residency, groups, contents, weight_version, weights_valid, holds, deferred, rank, role,
        step, failure}."""
        result = self.call("lifecycle_state", timeout_s=timeout_s)
        self.last_known.update(result)
        return result

    def log_paths(self, *, timeout_s: float | None = None) -> dict[int, str | None]:
        """rank → the JSON-lines file its lifecycle events go to (None: not to a file), for
        `lifecycle check` and `lifecycle timeline` (`configure_rank_log` says where they are)."""
        paths: dict[int, str | None] = self.call("lifecycle_log_path", timeout_s=timeout_s)
        return paths

    def weight_versions(self, *, timeout_s: float | None = None) -> dict[int, int | None]:
        """rank → the weight version each actor has loaded (None: unknown, or its weights are not valid).

        A replaced or restarted rollout reports its checkpoint's version (or None) until it is synced;
        pass the trainer's version to `generate(..., min_weight_version=...)` to refuse serving from it.
        """
        return {
            rank: state.get("weight_version") if state.get("weights_valid", True) else None
            for rank, state in self.states(timeout_s=timeout_s).items()
        }

    def stale(self, version: int, *, timeout_s: float | None = None) -> dict[int, int | None]:
        """rank → loaded version, for the ranks that could not serve `version` now (older, unknown, invalid)."""
        return {
            rank: loaded
            for rank, loaded in self.weight_versions(timeout_s=timeout_s).items()
            if loaded is None or loaded < version
        }

    def sleep(
        self, tags: Iterable[str] | None = None, *, timeout_s: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """`sleep(tags)` on every rank; each rank's snapshot after."""
        self.call("sleep", list(tags) if tags is not None else None, timeout_s=timeout_s)
        return self.states(timeout_s=timeout_s)

    def wake_up(
        self, tags: Iterable[str] | None = None, *, timeout_s: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """`wake_up(tags)` on every rank; each rank's snapshot after."""
        self.call("wake_up", list(tags) if tags is not None else None, timeout_s=timeout_s)
        return self.states(timeout_s=timeout_s)

    def hold(self, *, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Take a hold on every rank at once; rank → state after. If some ranks refuse (a FAILED rank), the
        ranks that took it give it back before the error is raised, so no rank is left holding."""
        try:
            states = self.call("lifecycle_hold", timeout_s=timeout_s)
        except GroupCallError as exc:
            took = [rank for rank in self.actors if rank not in exc.errors]
            if took:
                self.last_known.update(self.call("lifecycle_release", ranks=took, timeout_s=timeout_s))
            raise
        self.last_known.update(states)
        return states

    def release(self, *, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Give every rank's hold back at once; the last release runs each rank's deferred sleep (its process
        groups go down together, as in `sleep()`). rank → state after."""
        states = self.call("lifecycle_release", timeout_s=timeout_s)
        self.last_known.update(states)
        return states

    @contextlib.contextmanager
    def held(self, *, timeout_s: float | None = None) -> Iterator[LifecycleGroup]:
        """A held scope on every rank: `hold()` on entry, `release()` on exit, also when the block raises.

            with group.held():
                group.wake_up()  # the one wake of the step
                group.call("train", rollout_id)  # offload_train: the sleep after it is deferred
                group.call("save_model", rollout_id)
            # here every rank sleeps, once

        A rank that fails in its final sleep is FAILED as after any sleep; the error names it.
        """
        self.hold(timeout_s=timeout_s)
        try:
            yield self
        finally:
            self.release(timeout_s=timeout_s)

    def assert_consistent(
        self, states: Mapping[int, Mapping[str, Any]] | None = None
    ) -> dict[int, dict[str, Any]]:
        """All ranks in one state with one residency; else raise naming the ranks of each view."""
        observed = dict(states) if states is not None else self.states()
        groups: dict[str, list[int]] = {}
        for rank, state in sorted(observed.items()):
            groups.setdefault(f"{state['state']} residency {state['residency']}", []).append(rank)
        if len(groups) > 1:
            raise InconsistentGroupError(
                "ranks disagree: " + "; ".join(f"{view}: ranks {ranks}" for view, ranks in groups.items()),
                groups=groups,
            )
        return {rank: dict(state) for rank, state in observed.items()}

    # ------------------------------------------------------------------ the caller's decisions

    def forget(self, rank: int) -> None:
        """Go on without a dead rank."""
        self.dead.pop(rank, None)
        self.actors.pop(rank, None)
        self.last_known.pop(rank, None)

    def replace(self, rank: int, actor: Any) -> None:
        """Put a new actor in a dead rank's place."""
        self.dead.pop(rank, None)
        self.last_known.pop(rank, None)
        self.actors[rank] = actor

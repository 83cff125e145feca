"""`LifecycleGroup`: the driver's view of a group of mixin-wrapped Ray actors.

Every wait has a deadline and names the ranks that did not answer; a dead actor is reported with
its last known state, and the group refuses further fan-out until the caller decides what to do
with it (`forget(rank)` or `replace(rank, new_actor)`). `held()` holds every rank in one scope and
releases every rank at once: the scope's one sleep destroys the process groups collectively.

Across nodes: `locate()` learns where each rank runs. A rank that dies on a node found lost (Ray
marked it dead, or its raylet refuses connections) ends the wait at once with `NodeLostError`,
naming the node and the ranks of every `link`ed group on it; the survivors are told first
(`lifecycle_peers_lost`: their process groups give up every wait on the lost ranks), and the
error says the state each ended in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actor_integration.actors.cluster import lost_nodes
from actor_integration.errors import (
    DeadActorsError,
    GroupCallError,
    GroupTimeoutError,
    InconsistentGroupError,
    NodeLostError,
)
from lifecycle.events import LOG_DIR_ENV

# Once ranks are located, waits run in slices this long: a rank that died with its node is
# noticed within one, not at the deadline.
_SLICE_S = 1.0
_STATE_S = 5.0  # how long a survivor gets to report its state once its call is over


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


# How a role's ranks are called in a NodeLostError.
_UNITS = {"rollout": "engines"}


def _cause(error: BaseException) -> str:
    """Ray's own words on why an actor died, the line that says it (an import error names the module)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "^^^" not in line]
    said = next(
        (line for line in reversed(lines) if "Error" in line.split(":")[0]), lines[0] if lines else ""
    )
    return f"Ray says {type(error).__name__}: {said[:300]}"


def _states(groups: Sequence[LifecycleGroup], method: str, until: float) -> dict[str, dict[int, str]]:
    """Each group's survivors, described: their calls in flight waited for, then their states, until `until`."""
    flights = {ref: g for g in groups for ref in g.unsettled.values()}
    if flights:
        done, _ = ray.wait(list(flights), num_returns=len(flights), timeout=_left(until))
        for ref in done:
            group = flights[ref]
            group.unsettled = {r: f for r, f in group.unsettled.items() if f != ref}
    asked = {
        (g, r): g.actors[r].lifecycle_state.remote()
        for g in groups
        for r in g.survivors
        if r not in g.unsettled
    }
    answered: set[Any] = set()
    if asked:
        # Asked once the calls are over (or given up on): a window of its own, not what is left.
        done, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=max(_left(until), _STATE_S))
        answered = set(done)
    out: dict[str, dict[int, str]] = {}
    for group in groups:
        described = out.setdefault(group.role, {})
        for rank in group.survivors:
            ref = asked.get((group, rank))
            if ref is None:
                described[rank] = (
                    f"still inside {method}, in a wait the lost ranks cannot cut short (torch.distributed's own "
                    "rendezvous, or a collective): it ends at its own deadline; settle() waits for it"
                )
                continue
            if ref not in answered:
                described[rank] = "did not answer with its state in time"
                continue
            try:
                state = ray.get(ref, timeout=0)
            except Exception as exc:  # a survivor that died too is named, not a second error
                described[rank] = f"no state ({type(exc).__name__})"
                continue
            group.last_known[rank] = state
            failure = state.get("failure")
            # The exception's type only: its words are in the rank's log.
            raised = (
                f" after {failure['hook']} raised {str(failure['error']).split('(', 1)[0]}" if failure else ""
            )
            described[rank] = _describe(state) + raised
    return out


def _left(until: float) -> float:
    return max(until - time.monotonic(), 0.0)


class LifecycleGroup:
    """Fan lifecycle calls out to actors built on `LifecycleMixin`, with a deadline on every wait."""

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        ranks: Iterable[int] | None = None,
        timeout_s: float = 60.0,
        role: str = "rank",
        node_grace_s: float = 5.0,
    ) -> None:
        """`role` names the ranks in a `NodeLostError` ("trainer", "rollout"); `node_grace_s` is how
        long, once a node is found lost, the survivors get to end their call and report their state."""
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
        self.role = role
        self.node_grace_s = node_grace_s
        self.places: dict[int, dict[str, Any]] = {}  # rank → where it runs (`locate`)
        self.unsettled: dict[int, Any] = {}  # survivor → its call in flight when a node was lost
        self._linked: list[LifecycleGroup] = [self]

    # ------------------------------------------------------------------ nodes

    def locate(self, *, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """rank → where each actor runs (`node_id`, `node_ip`, `hostname`, `pid`, `gpus`); kept, so
        that a rank that dies later is known by its node."""
        places: dict[int, dict[str, Any]] = self.call("lifecycle_place", timeout_s=timeout_s)
        self.places.update(places)
        return places

    def link(self, *others: LifecycleGroup) -> None:
        """Share node losses with `others` (the rollout group of the same job): whichever group finds
        a node lost, its error names every linked group's ranks there and all their survivors are told."""
        shared = list(dict.fromkeys([*self._linked, *(g for o in others for g in o._linked)]))
        for group in shared:
            group._linked = shared

    def ranks_on(self, nodes: Iterable[str]) -> list[int]:
        """The located ranks that run on `nodes` (node ids)."""
        wanted = set(nodes)
        return sorted(r for r, place in self.places.items() if place.get("node_id") in wanted)

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
        pending = dict(refs)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        died: list[int] = []
        causes: dict[int, str] = {}  # what Ray says killed each dead rank (a failed import, an OOM, ...)
        while pending:
            left = deadline - (time.monotonic() - started)
            if left <= 0:
                break
            window = min(left, _SLICE_S) if self.places else left
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=window)
            ready_set = set(ready)
            fresh = []
            for rank, ref in list(pending.items()):
                if ref not in ready_set:
                    continue
                del pending[rank]
                try:
                    results[rank] = ray.get(ref, timeout=0)
                except RayActorError as exc:
                    died.append(rank)
                    fresh.append(rank)
                    causes[rank] = _cause(exc)
                    self.dead[rank] = self.last_known.get(rank)
                except RayTaskError as exc:
                    errors[rank] = exc.cause if exc.cause is not None else exc
                except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                    pass
            # A rank that died is checked at once; the silent ones after a slice, so a node whose
            # raylet is gone is found before Ray reports its actors dead (seconds later).
            silent = [*fresh, *pending] if time.monotonic() - started >= _SLICE_S else fresh
            lost = self._lost_nodes(silent)
            if lost:
                raise self._node_lost(method, lost, pending, started)
        waited = time.monotonic() - started
        lost = self._lost_nodes([*died, *pending])  # at the deadline: are the silent ranks' nodes gone?
        if lost:
            raise self._node_lost(method, lost, pending, started)
        if died:
            raise DeadActorsError(
                f"{method}: ranks {died} died ("
                + "; ".join(f"rank {r}: last known {_describe(self.dead[r])}, {causes[r]}" for r in died)
                + "). Further calls are refused until you forget(rank) or replace(rank, actor).",
                dead={r: self.dead[r] for r in died},
            )
        missing = sorted(pending)
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

    # ------------------------------------------------------------------ a lost node

    def _lost_nodes(self, ranks: Iterable[int]) -> dict[str, str]:
        nodes = [self.places[r]["node_id"] for r in ranks if r in self.places]
        return lost_nodes(nodes) if nodes else {}

    def _node_lost(
        self, method: str, nodes: dict[str, str], pending: Mapping[int, Any], started: float
    ) -> NodeLostError:
        """Every linked group gives up its ranks on `nodes` and tells its survivors; the error says it all."""
        noticed = time.monotonic() - started
        groups = self._linked
        lost = {g.role: g.ranks_on(nodes) for g in groups}
        where = "; ".join(nodes.values())
        reason = f"node {where}: lost during {self.role} {method}"
        for group in groups:
            group._tell(nodes, lost, reason)
        until = time.monotonic() + self.node_grace_s
        # A told survivor ends its call in flight first (one blocked on a meeting at once), then reports.
        self.unsettled.update({r: ref for r, ref in pending.items() if r not in self.dead})
        survivors = _states(groups, method, until)
        waited = time.monotonic() - started
        gone = "; ".join(
            f"{role} {_UNITS.get(role, 'ranks')} {ranks}" for role, ranks in lost.items() if ranks
        )
        alive = "; ".join(
            f"{role} {rank}: {state}" for role, states in survivors.items() for rank, state in states.items()
        )
        return NodeLostError(
            f"{self.role} {method}: node {where} (noticed {noticed:.1f} s into the call): {gone} ran there and "
            f"are gone. Survivors, told first so that no meeting waits on the lost ranks, after {waited - noticed:.1f} "
            f"s more: {alive or 'none'}. "
            "A torch.distributed world cannot shrink, so the job cannot go on without them: end its actors "
            "(ray.kill, or let the driver exit), bring the node back or add one (`ray start --address ...`), "
            "restart from the last checkpoint, and gather the surviving nodes' logs (`lifecycle gather`).",
            nodes=nodes,
            lost=lost,
            survivors=survivors,
            operation=method,
            waited_s=round(waited, 3),
            dead={r: self.dead.get(r) for r in lost[self.role]},
        )

    def _tell(self, nodes: Mapping[str, str], lost: Mapping[str, Sequence[int]], reason: str) -> None:
        """Mark this group's ranks on `nodes` dead and tell every other rank (`lifecycle_peers_lost`)."""
        for rank in self.ranks_on(nodes):
            self.dead[rank] = self.last_known.get(rank)
            self.unsettled.pop(rank, None)
        for rank in self.survivors:
            self.actors[rank].lifecycle_peers_lost.remote(dict(lost), reason)

    @property
    def survivors(self) -> list[int]:
        """The ranks not dead."""
        return [r for r in sorted(self.actors) if r not in self.dead]

    def settle(self, *, timeout_s: float | None = None, kill: bool = False) -> dict[int, str]:
        """After a `NodeLostError`: wait (up to `timeout_s`, default the group's) for the survivors
        still inside their call to end it, then rank → how each survivor ended. A survivor inside a
        wait the lost ranks cannot cut short (torch.distributed's own rendezvous of a new group, a
        collective) ends at its own deadline, FAILED with that error; one still inside after
        `timeout_s` (blocked past its own deadlines) is killed with `kill=True`, and counted dead."""
        started = time.monotonic()
        until = started + (self.timeout_s if timeout_s is None else timeout_s)
        states = _states([self], "its call", until)[self.role]
        if kill:
            for rank in sorted(self.unsettled):
                ray.kill(self.actors[rank])
                del self.unsettled[rank]
                self.dead[rank] = self.last_known.get(rank)
                states[rank] = (
                    f"killed by the driver: still inside its call after {time.monotonic() - started:.0f} s of "
                    "settling (blocked on the lost ranks past its own deadlines)"
                )
        return states

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

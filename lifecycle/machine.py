"""`Lifecycle`: the per-actor machine, built on `transitions` and driven by `lifecycle.table`.

Its parts are in `lifecycle._machine`: the hook runner, the held scope, refusals, failures and
recovery, the backends' descriptions and the `transitions` machine itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from lifecycle import events
from lifecycle._machine.backends import describe_backends
from lifecycle._machine.budgeted import BudgetedSleep
from lifecycle._machine.failures import Failure, resolve_unknown
from lifecycle._machine.held import HeldScope
from lifecycle._machine.hook_runner import HookRecord, HookRunner, Stages, bind_hook, bind_tags, hook_dicts
from lifecycle._machine.refusals import failed_error, refusal, stale_weights
from lifecycle._machine.state_machine import StateMachine
from lifecycle.errors import IllegalTransitionError, LifecycleFailedError
from lifecycle.hooks import Hooks
from lifecycle.logs import Event
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import (
    ASLEEP,
    ASLEEP_GROUPS,
    BODY_OPERATIONS,
    GROUPS_DOWN,
    GROUPS_UP,
    LIFECYCLE_CALLS,
    OPERATIONS,
    PARTIAL_WAKE,
    SLEEP,
    WAKE,
    Call,
    Communicators,
    Contents,
    Edge,
    Groups,
    Hook,
    Residency,
    Row,
    State,
    apply_call,
    body_ready,
    initial_contents,
    invalid_weights,
    mark_unknown,
    row_edges,
    select_row,
    update_contents,
)

__all__ = ["Failure", "Lifecycle"]

T = TypeVar("T")

_INFO = events.LEVELS["info"]
_MEMORY_HOOKS = frozenset({Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME})
_RESOURCE_HOOKS = _MEMORY_HOOKS | {Hook.PROCESS_GROUPS_DESTROY, Hook.PROCESS_GROUPS_RELOAD}


class Lifecycle:
    """The lifecycle of one actor: state, per-tag residency and contents, and the guarded hook plans.

    Contents say whether a tag's data is still meaningful (a release without backup discards it,
    see `LifecyclePolicy.discard_on_release`); `weight_version` is the version of the weights
    loaded, as the receiving side declares it (`note_weights`). `generate` is refused unless the
    weight tags are valid (and, when asked, at least a given version).

    Every operation takes one re-entrant lock, so calls from other threads wait. Calls to
    `sleep()`/`wake_up()` made from inside a running body on the same thread are absorbed as
    logged no-ops; any other nested call is refused.

    `held()` (or `hold()` ... `release()`) is a scope in which no sleep runs: the sleeps the calls
    inside it ask for are deferred, and the release of the last hold runs one sleep of the tags
    those calls would have left released without the scope.

    A hook that raises puts the machine in FAILED and fails the call with the hook's own error;
    with `typed_failures` set, with `LifecycleFailedError` instead (the hook's error its cause),
    which names the machine (role, rank), the failing transition and what is resident: for a driver
    that neither recovers nor reads the machine's state, where that error is all it prints (a
    framework's own driver under the launch switch). Its log is flushed first.
    """

    typed_failures: bool = False

    def __init__(
        self,
        policy: LifecyclePolicy,
        hooks: Hooks,
        *,
        rank: int | None = None,
        role: str | None = None,
        initial: State = State.AWAKE,
        weight_version: int | None = None,
    ) -> None:
        if not isinstance(policy, LifecyclePolicy):
            raise TypeError(f"Lifecycle needs a LifecyclePolicy, got {type(policy).__name__}")
        if not isinstance(hooks, Hooks):
            raise TypeError(
                f"Lifecycle needs its hooks as lifecycle.Hooks(memory=..., ...), got {type(hooks).__name__}"
            )
        initial = State(initial)
        if initial not in (State.AWAKE, State.PAUSED):
            raise ValueError(f"Lifecycle: initial must be State.AWAKE or State.PAUSED, got {initial}")

        self.policy = policy
        self.hooks = hooks
        self._observers: list[Callable[[str, dict[str, Any]], None]] = []
        self.observer_errors = 0  # observers that raised (the machine goes on)
        self._view = policy.view()
        self._tags = policy.tags
        self._present = hooks.present

        start = Residency.RESIDENT if initial is State.AWAKE else Residency.RELEASED
        self._residency: dict[str, Residency] = dict.fromkeys(self._tags, start)
        self._groups: Groups | None = None
        # What a process_groups.destroy leaves (destroyed, suspended or kept): the backend declares it.
        self._communicators = hooks.communicators or Communicators.DESTROY
        # The ways the groups offer (the configured one first); under a budget each sleep may take
        # another (`_take_way`). `_way`: what the groups' last destroy did, so what their reload undoes.
        self._ways = hooks.communicators_ways
        self._way = self._communicators
        if hooks.process_groups is not None:
            destroyed = initial is State.PAUSED and policy.destroy_process_groups
            self._groups = ASLEEP[self._communicators] if destroyed else Groups.ALIVE
        self._failure: Failure | None = None
        self._contents = initial_contents(self._view, self._tags, initial)
        if weight_version is not None and (
            isinstance(weight_version, bool) or not isinstance(weight_version, int)
        ):
            raise ValueError(f"Lifecycle: weight_version must be an int or None, got {weight_version!r}")
        self._weight_version = weight_version

        # Hooks a plan declares independent run together only where the memory backend says its
        # pause/resume may overlap a process-group teardown/rebuild (not TMS preload mode, where
        # NCCL's own buffers are saver memory).
        overlap = policy.overlap_hooks and bool(getattr(hooks.memory, "may_overlap_process_groups", False))
        self._callables: dict[Call, Callable[[], Any]] = {}
        self._runner = HookRunner(
            self._callable, overlap=overlap, bind_tags=lambda hook, tags: bind_tags(hook, tags, self.hooks)
        )
        self._budget: BudgetedSleep | None = None
        if (policy.memory_budget is None) != (hooks.budget is None):
            raise ValueError(
                "Lifecycle: a memory budget needs both LifecyclePolicy(memory_budget=MemoryBudget(...)) and "
                "Hooks(budget=<a MemoryProbe>, ...); "
                + (
                    "the hooks have no budget probe"
                    if hooks.budget is None
                    else "the policy has no memory_budget"
                )
            )
        if policy.memory_budget is not None and hooks.budget is not None:
            self._budget = BudgetedSleep(policy.memory_budget, hooks.budget, self._emit)
        self._budget_learns = False  # the running edge's hook timings teach the budget's estimates
        self._sync_reloaded = True  # the open sync reloaded the groups: its groups_down undoes that

        self._lock = threading.RLock()
        self._owner: int | None = None  # thread running an operation
        self._running: str | None = None  # that operation
        self._in_body = False
        self._scope = HeldScope(self._view, functools.partial(self._emit, "info"))
        self._context: dict[str, Any] = {"rank": rank, "role": role}
        self.step: int | None = None

        self._states = StateMachine(initial)
        self._edges: dict[Row, tuple[Edge, ...]] = {}

        self._emit(
            "info",
            Event.CONFIGURED,
            {
                "policy": policy.to_dict(),
                "hooks": sorted(h.value for h in self._present),
                "state": initial,
                "residency": self._residency_view(),
                "groups": self._groups,
                "contents": self._contents_view(),
                "weight_version": weight_version,
                **describe_backends(hooks, self._communicators),
            },
        )

    # ------------------------------------------------------------------ read-only views

    @property
    def state(self) -> State:
        """The state the machine is in: AWAKE, PAUSED, SAVING, SYNCING or FAILED."""
        return self._states.state

    @property
    def residency(self) -> dict[str, Residency]:
        """Tag → resident / released / unknown. The key is "*" when the policy tracks all memory."""
        return dict(self._residency)

    @property
    def contents(self) -> dict[str, Contents]:
        """Tag → valid / discarded / unknown: whether the tag's data is still meaningful."""
        return dict(self._contents)

    @property
    def weight_version(self) -> int | None:
        """The weight version loaded, as the last sync declared it (None: not known)."""
        return self._weight_version

    @property
    def groups(self) -> Groups | None:
        """alive / destroyed / suspended / kept / unknown, or None when the actor gave no process groups."""
        return self._groups

    @property
    def failure(self) -> Failure | None:
        """What put the machine in FAILED (None outside FAILED)."""
        return self._failure

    @property
    def holds(self) -> int:
        """How many holds are taken (0: no held scope)."""
        return self._scope.holds

    @property
    def deferred(self) -> tuple[str, ...]:
        """The tags whose sleep the held scope deferred: the release of the last hold sleeps them."""
        return self._scope.deferred(self._residency)

    @property
    def context(self) -> dict[str, Any]:
        """The fields every event of this actor carries: rank, role and the current step."""
        return {**self._context, "step": self.step}

    def snapshot(self) -> dict[str, Any]:
        """Plain, picklable data for drivers: state, residency, groups, contents, weight_version,
        weights_valid (whether generate may read the weight tags), holds, deferred (held scopes),
        rank, role, step, failure."""
        failure = self._failure
        return {
            "state": self.state.value,
            "residency": self._residency_view(),
            "groups": self._groups.value if self._groups is not None else None,
            "contents": self._contents_view(),
            "weight_version": self._weight_version,
            "weights_valid": not invalid_weights(self._view, self._contents),
            "holds": self._scope.holds,
            "deferred": list(self.deferred),
            "rank": self._context.get("rank"),
            "role": self._context.get("role"),
            "step": self.step,
            "failure": None
            if failure is None
            else {
                "operation": failure.operation,
                "phase": failure.phase,
                "hook": failure.hook,
                "tag": failure.tag,
                "error": failure.error,
            },
        }

    def bind(self, **context: Any) -> None:
        """Add fields (slot, engine id, ...) to every later event of this machine."""
        self._context.update(context)

    def observe(self, observer: Callable[[str, dict[str, Any]], None]) -> None:
        """Call `observer(event, fields)` for every event this machine emits from now on.

        `fields` are the event's as logged (with rank, role and step), whether or not logging is on,
        so a framework can feed its own metrics from them (slime's timers: `frameworks.slime`). An
        observer that raises is counted in `observer_errors` and never fails the machine.
        """
        if not callable(observer):
            raise TypeError(f"Lifecycle.observe needs a callable (event, fields), got {observer!r}")
        self._observers.append(observer)

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        """Log an event of a layer above the machine (weight sync, demo) with this actor's context."""
        if self._budget is not None:
            self._budget.observe_event(name, fields)  # the release audit's bytes, for the next plan
        self._emit(level, name, fields)

    def expect(self, need_bytes: int | None) -> None:
        """Declare what the next phase's wake needs free on this device (bytes; None: not known).

        Under `LifecyclePolicy(memory_budget=...)` every later sleep releases only what leaves that
        free (`lifecycle.budget`), and checks it is free after; without a need, a sleep releases
        everything. Every rank of a group declares the same need (their sleeps agree collectively).
        """
        if self._budget is None:
            raise ValueError(
                f"{self._who()}: expect() needs a memory budget: LifecyclePolicy(memory_budget=MemoryBudget()) "
                "and Hooks(budget=...)"
            )
        with self._lock:
            self._budget.expect(need_bytes)

    @property
    def need_bytes(self) -> int | None:
        """The need declared with `expect` (None: none, or no budget)."""
        return None if self._budget is None else self._budget.need_bytes

    def may(self, operation: str, *, tags: Iterable[str] | None = None) -> bool:
        """Whether `operation` would be accepted now (it may still fail in a hook)."""
        _check_operation(operation)
        state = self.state
        if self._owner == threading.get_ident():
            return self._in_body and operation in LIFECYCLE_CALLS
        if state is State.FAILED:
            return operation == "recover" or (operation == "release" and self._scope.holds > 0)
        targets = self.deferred if operation == "release" else self._targets(tags)
        row = select_row(
            operation, state, self._view, self._residency, targets, None, self._contents, self._scope.holds
        )
        return row is not None

    # ------------------------------------------------------------------ operations

    def sleep(self, tags: Iterable[str] | None = None) -> None:
        """Release memory (all tags, or the given ones). Idempotent."""
        self._operate("sleep", tags, None, (), {}, None)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore memory (all tags, or the given ones). Idempotent."""
        self._operate("wake_up", tags, None, (), {}, None)

    def hold(self) -> None:
        """Take a hold: until the last hold is released, no sleep runs (`held()` pairs it with release).

        Holds are counted for the whole machine, whatever thread takes them; refused on a FAILED
        machine. The machine is not woken: the first wake inside the scope is the caller's, and real.
        """
        self._operate("hold", None, None, (), {}, None)

    def release(self) -> None:
        """Give a hold back; the release of the last one runs the deferred sleep, once, on this thread.

        It sleeps the tags the calls since the first hold would have left released without the
        scope, with the sleep plan's hooks and failure handling. On a FAILED machine it only gives
        the hold back. Releasing with no hold taken raises `IllegalTransitionError`.
        """
        self._operate("release", None, None, (), {}, None)

    @contextlib.contextmanager
    def held(self) -> Iterator[Lifecycle]:
        """A held scope: `hold()` on entry, `release()` on exit, also when the block raises.

            with lc.held():
                lc.wake_up()  # the one real wake
                lc.run("train", train_step)  # offload_train: its sleep is deferred
                lc.run("save", save)  # AWAKE: no wake, no pause
            # here the one sleep runs

        A block that raises still ends with the deferred sleep, and its error propagates; a hook
        failing in that sleep leaves FAILED and its error reaches the `with` (chained to the block's).
        """
        self.hold()
        try:
            yield self
        finally:
            self.release()

    def run(
        self,
        operation: str,
        body: Callable[..., T],
        /,
        *args: Any,
        min_weight_version: int | None = None,
        **kwargs: Any,
    ) -> T:
        """Run `body(*args, **kwargs)` as `operation` ("train", "save", "sync", "generate").

        `min_weight_version` (generate only; consumed here, not passed to the body): refuse unless
        the loaded weights are at least this version, e.g. the trainer's current one.
        """
        if min_weight_version is not None:
            if operation != "generate":
                raise ValueError(
                    f"Lifecycle.run({operation!r}, min_weight_version=...): only generate reads the weights "
                    "it would check"
                )
            if isinstance(min_weight_version, bool) or not isinstance(min_weight_version, int):
                raise ValueError(
                    f"Lifecycle.run: min_weight_version must be an int, got {min_weight_version!r}"
                )
        if operation not in BODY_OPERATIONS:
            raise ValueError(
                f"Lifecycle.run: {operation!r} is not a body operation; use one of {list(BODY_OPERATIONS)} "
                "(sleep/wake_up/recover have their own methods)"
            )
        if not callable(body):
            raise TypeError(f"Lifecycle.run({operation!r}): body must be callable, got {type(body).__name__}")
        result: T = self._operate(operation, None, body, args, kwargs, None, min_weight_version)
        return result

    def note_weights(self, contents: Contents | str, version: int | None = None, *, reason: str) -> None:
        """Declare what a sync body did to the weight tags; only the receiving side calls this, inside it.

        `Contents.UNKNOWN` before the first write into the weights (a failure from then on leaves
        them part old, part new), `Contents.VALID` with the version once the final round is in.
        A body that never calls this left the weights as they were (a refusal before any write).
        """
        contents = Contents(contents)
        if contents is Contents.DISCARDED:
            raise ValueError("note_weights: a sync never discards weights; declare UNKNOWN or VALID")
        if contents is Contents.VALID and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"note_weights(VALID): give the version loaded as an int, got {version!r}")
        if not (self._in_body and self._running == "sync" and self._owner == threading.get_ident()):
            raise IllegalTransitionError(
                f"{self._who()}: note_weights is called by the receiving side inside its sync body "
                f"(Lifecycle.run('sync', ...)); now {self._running or 'no operation'} is running, state "
                f"{self.state}. Move the call into the body that loads the weights.",
                state=self.state,
                operation="note_weights",
                allowed=(),
            )
        for tag in self._view.weight_tags:
            self._contents[tag] = contents
        self._weight_version = version if contents is Contents.VALID else self._weight_version
        self._emit(
            "info",
            Event.CONTENTS,
            {
                "operation": "sync",
                "contents": self._contents_view(),
                "weight_version": self._weight_version,
                "declared": contents,
                "version": version,
                "reason": reason,
            },
        )

    def recover(self, target: State = State.AWAKE) -> None:
        """Leave FAILED for `target` (AWAKE or PAUSED), running only the hooks the residency needs."""
        target = State(target)
        if target not in (State.AWAKE, State.PAUSED):
            raise ValueError(f"Lifecycle.recover: target must be State.AWAKE or State.PAUSED, got {target}")
        self._operate("recover", None, None, (), {}, target)

    # ------------------------------------------------------------------ engine

    def _operate(
        self,
        operation: str,
        tags: Iterable[str] | None,
        body: Callable[..., Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recover_target: State | None,
        min_weight_version: int | None = None,
    ) -> Any:
        targets = self._targets(tags)
        me = threading.get_ident()
        if me in self._runner.threads:
            return self._nested(operation)
        with self._lock:
            if self._owner == me:
                return self._nested(operation)
            state = self.state
            if state is State.FAILED and operation not in ("recover", "release"):
                raise self._failed_error(operation)
            if operation == "recover" and state is State.FAILED:
                self._resolve_unknown()
            if operation == "release":
                targets = self.deferred  # the release's sleep, if it runs, is of these
            row = select_row(
                operation,
                state,
                self._view,
                self._residency,
                targets,
                recover_target,
                self._contents,
                self._scope.holds,
            )
            if row is None:
                raise refusal(
                    self._who(),
                    operation,
                    state,
                    targets,
                    view=self._view,
                    residency=self._residency,
                    contents=self._contents,
                    holds=self._scope.holds,
                    weight_version=self._weight_version,
                    refused=self._refused,
                )
            if min_weight_version is not None and (
                self._weight_version is None or self._weight_version < min_weight_version
            ):
                raise stale_weights(
                    self._who(), operation, state, self._weight_version, min_weight_version, self._refused
                )
            if operation == "hold":
                self._scope.take(self.state, self._residency)
                return None
            if operation == "release" and row.noop:
                self._scope.give_back(self.state, targets)
                return None
            if row.noop:
                self._emit(
                    "info",
                    Event.NOOP,
                    {
                        "operation": operation,
                        "state": state,
                        "reason": "held" if row.held else "idempotent",
                        "targets": list(targets),
                    },
                )
                self._scope.track(operation, targets, self.state, self._residency, self.deferred)
                return None
            deferred = self.deferred
            self._owner, self._running = me, operation
            try:
                return self._execute(row, targets, body, args, kwargs)
            finally:
                self._owner = self._running = None
                if operation == "release":
                    self._scope.give_back(
                        self.state, targets
                    )  # also when its sleep failed: the hold is given back
                else:
                    self._scope.track(operation, targets, self.state, self._residency, deferred)

    def _execute(
        self,
        row: Row,
        targets: tuple[str, ...],
        body: Callable[..., Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        edges = self._edges.get(row)
        if edges is None:
            edges = self._edges[row] = row_edges(row)
        if row.body_state is None:
            self._fire(edges[0], targets)
            if row.operation == "recover":
                self._failure = None
            return None
        assert body is not None
        enter = next((e for e in edges if e.phase == "enter"), None)
        exit_ = next((e for e in edges if e.phase == "exit"), None)
        if enter is not None:
            self._fire(enter, self._tags)
        if not body_ready(row.operation, self._view, self._residency):
            # The table guarantees this; reaching here means a table bug, not a user error.
            raise AssertionError(f"{row.operation} body would run on released memory: {self._residency}")
        t0, p0 = time.time(), time.perf_counter()
        self._in_body = True
        try:
            context = (
                self.hooks.memory.disable()
                if row.body_context == "memory.disable"
                else contextlib.nullcontext()
            )
            with context:
                result = body(*args, **kwargs)
        except BaseException as exc:
            self._body_done(row, t0, p0, exc)
            if exit_ is not None:
                # Leave SAVING/SYNCING (and re-pause) even when the body failed.
                self._fire(exit_, self._tags)
            raise
        self._body_done(row, t0, p0, None)
        if exit_ is not None:
            self._fire(exit_, self._tags)
        return result

    def _body_done(self, row: Row, t0: float, p0: float, error: BaseException | None) -> None:
        """The body returned (`error` None) or raised `error`: log it."""
        self._in_body = False
        fields: dict[str, Any] = {
            "operation": row.operation,
            "state": row.body_state,
            "t": t0,
            "duration_ms": round((time.perf_counter() - p0) * 1e3, 4),
            "ok": error is None,
        }
        if error is not None:
            fields["error"] = repr(error)
        self._emit("info" if error is None else "error", Event.BODY, fields)

    def _fire(self, edge: Edge, targets: tuple[str, ...]) -> None:
        """Run the edge's plan stage by stage, then let `transitions` move the state."""
        stages: Stages = ()
        if edge.plan is not None:
            view, planned, present = self._view, targets, self._present
            if self._budget is not None and edge.plan is SLEEP and edge.operation != "recover":
                # recover releases the rest: never narrowed.
                view, planned, present = self._budget.narrowed(
                    view, targets, present, self._residency, self._groups, [w.value for w in self._ways]
                )
                self._take_way(self._budget.communicators_way)
            elif edge.plan is SLEEP:
                self._take_way(None)
            elif self._budget is not None and edge.plan is GROUPS_UP:
                self._sync_reloaded = self._groups in ASLEEP_GROUPS
            elif self._budget is not None and edge.plan is GROUPS_DOWN and not self._sync_reloaded:
                # The budget's last sleep kept the groups: the sync found them alive and leaves them so.
                view = dataclasses.replace(view, destroy_process_groups=False)
            stages = self._runner.stages(edge.plan, view, self._residency, self._groups, planned, present)
        t0 = time.time()
        p0 = time.perf_counter()
        # The budget learns a round trip's cost from sleeps and wakes only: a sync's groups down
        # destroys groups whose communicators were never created (no collective ran), which would
        # teach it that destroying live ones is nearly free.
        self._budget_learns = edge.plan in (SLEEP, WAKE, PARTIAL_WAKE)
        records, failed = self._runner.run(stages, p0, self._record)
        if failed is not None:
            self._enter_failed(edge, failed[0], records, failed[1], targets)
            if self.typed_failures and isinstance(failed[1], Exception):
                events.flush_logs(timeout=2.0)  # the driver may end the process on this error
                raise failed_error(
                    self._who(),
                    edge.operation,
                    self._failure,
                    "recover(target=State.AWAKE) or recover(target=State.PAUSED) brings it back; a driver "
                    "that does not recover must stop here",
                    self._residency,
                    self._groups,
                    lambda fields: None,  # the failure is logged (lifecycle.failed), nothing was refused
                ) from failed[1]
            raise failed[1]
        self._states.move(edge)
        if self._observers or events.enabled(_INFO):
            self._emit(
                "info",
                Event.TRANSITION,
                {
                    "src": edge.source,
                    "dst": edge.dest,
                    "operation": edge.operation,
                    "phase": edge.phase,
                    "plan": None if edge.plan is None else edge.plan.name,
                    "targets": list(targets),
                    "t": t0,
                    "duration_ms": round((time.perf_counter() - p0) * 1e3, 4),
                    "hooks": hook_dicts(records),
                    "residency": self._residency_view(),
                    "groups": self._groups,
                    "contents": self._contents_view(),
                },
            )

    def _take_way(self, chosen: str | None) -> None:
        """Before a sleep with the groups alive: the way their destroy takes, the plan's `chosen` one
        where the backend offers it, else the configured one. Told to a backend offering several."""
        if self._groups is not Groups.ALIVE:
            return  # asleep (or unknown) already: their reload undoes the way they went with
        way = next((w for w in self._ways if w.value == chosen), self._communicators)
        if len(self._ways) > 1:
            self.hooks.process_groups.use_communicators(way.value)  # type: ignore[union-attr]
        self._way = way

    def _record(self, record: HookRecord) -> None:
        """A hook call's effect on contents and process groups (the table's rules)."""
        if record.call.hook in _MEMORY_HOOKS:
            update_contents(record.call, record.ok, self._view, self._contents)
        if self._budget is not None and record.ok and self._budget_learns:
            self._budget.observe_hook(record.call.hook, record.call.tag, record.seconds, self._way.value)
        if not record.ok:
            self._groups = mark_unknown(record.call, self._residency, self._groups)
        elif record.call.hook in _RESOURCE_HOOKS:
            self._groups = apply_call(record.call, self._residency, self._groups, self._way)

    def _callable(self, call: Call) -> Callable[[], Any]:
        """The zero-argument callable for one hook call, built on first use."""
        fn = self._callables.get(call)
        if fn is None and call.hook is Hook.BUDGET_CHECK:
            budget = self._budget
            assert budget is not None  # the hook is present only with a budget
            fn = self._callables[call] = lambda: budget.check(self._residency, self._groups)
        if fn is None:
            fn = self._callables[call] = bind_hook(call, self.hooks, self.policy.model_tag)
        return fn

    def _enter_failed(
        self,
        edge: Edge,
        call: Call,
        records: list[HookRecord],
        exc: BaseException,
        targets: tuple[str, ...],
    ) -> None:
        self._failure = Failure(
            operation=edge.operation,
            state=edge.source,
            phase=edge.phase,
            hook=call.hook.value,
            tag=call.tag,
            error=repr(exc),
            hooks=tuple(hook_dicts(records)),
            residency=dict(self._residency),
            groups=self._groups,
            contents=dict(self._contents),
        )
        self._in_body = False
        self._scope.drop()  # a held scope's deferred sleep is dropped: recover decides where to go
        self._states.fail()
        self._emit(
            "error",
            Event.FAILED,
            {
                "t": self._failure.time,
                "operation": edge.operation,
                "src": edge.source,
                "dst": State.FAILED,
                "phase": edge.phase,
                "targets": list(targets),
                "hook": call.hook.value,
                "tag": call.tag,
                "error": repr(exc),
                "hooks": list(self._failure.hooks),
                "residency": self._residency_view(),
                "groups": self._groups,
                "contents": self._contents_view(),
            },
        )

    def _resolve_unknown(self) -> None:
        """Ask the backends what a failed hook left behind (`_machine.failures`), and log it."""
        self._groups, resolved = resolve_unknown(
            self.hooks,
            self._view,
            self._residency,
            self._contents,
            self._groups,
            self._way,
            lambda reason: self._failed_error("recover", reason),
        )
        if resolved:
            self._emit("info", Event.RESOLVED, {"resolved": resolved, "contents": self._contents_view()})

    def _nested(self, operation: str) -> None:
        running = self._running
        if self._in_body and operation in LIFECYCLE_CALLS:
            self._emit(
                "info",
                Event.NOOP,
                {"operation": operation, "state": self.state, "reason": f"nested in {running}"},
            )
            return None
        state = self.state
        where = "body" if self._in_body else "hooks"
        error = IllegalTransitionError(
            f"cannot {operation} while {running} is running on this thread (state {state}, inside its {where}); "
            f"only sleep()/wake_up() are absorbed there. Call {operation} after {running} returns.",
            state=state,
            operation=operation,
            allowed=LIFECYCLE_CALLS if self._in_body else (),
        )
        self._emit("warning", Event.REFUSED, {"operation": operation, "state": state, "reason": str(error)})
        raise error

    # ------------------------------------------------------------------ errors

    def _failed_error(self, operation: str, reason: str | None = None) -> LifecycleFailedError:
        return failed_error(
            self._who(), operation, self._failure, reason, self._residency, self._groups, self._refused
        )

    def _refused(self, fields: dict[str, Any]) -> None:
        self._emit("warning", Event.REFUSED, fields)

    def _targets(self, tags: Iterable[str] | None) -> tuple[str, ...]:
        if tags is None:
            return self._tags
        if isinstance(tags, str):
            tags = (tags,)
        given = tuple(dict.fromkeys(tags))
        if self.policy.memory_tags is None:
            raise ValueError(
                f"tags={list(given)} given, but this policy tracks all memory as one unit (memory_tags=None); "
                "call without tags, or list the tags in LifecyclePolicy.memory_tags"
            )
        unknown = [t for t in given if t not in self._tags]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; this actor's tags are {list(self._tags)}")
        if not given:
            raise ValueError("tags=() names no tag; pass None for all tags")
        return tuple(t for t in self._tags if t in given)

    # ------------------------------------------------------------------ logging

    def _who(self) -> str:
        rank, role = self._context.get("rank"), self._context.get("role")
        parts = [p for p in (role, None if rank is None else f"rank {rank}") if p]
        return f"lifecycle of {' '.join(parts)}" if parts else "lifecycle"

    def _residency_view(self) -> dict[str, str]:
        return {tag: r.value for tag, r in self._residency.items()}

    def _contents_view(self) -> dict[str, str]:
        return {tag: c.value for tag, c in self._contents.items()}

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        logged = events.enabled(events.LEVELS[level])
        if not (logged or self._observers):
            return
        full = {**self._context, "step": self.step, **fields}
        if logged:
            events.emit(level, event, full)
        for observer in self._observers:
            try:
                observer(str(event), full)
            except Exception:  # an observer's metrics never block the actor
                self.observer_errors += 1

    def __repr__(self) -> str:
        return (
            f"<Lifecycle {self._who()} {self.state} residency={self._residency_view()} groups={self._groups}>"
        )


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; operations are {list(OPERATIONS)}")

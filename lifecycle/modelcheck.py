"""Exhaustive model check of a trainer machine and a rollout machine sharing one GPU slot.

Both machines are the real transition table (`select_row`, `row_edges`, `plan_calls`,
`apply_call`); each runs the colocated loop of `lifecycle demo` as a small program of operations
with waits on the other side. An operation is not atomic across the two actors: each edge of a row
and each body is its own step, so the other actor may move between them. Every interleaving is
explored breadth-first and three properties are checked in every reachable state:

- exclusion: the trainer's model memory and the rollout's memory are never resident together;
- freshness: the rollout never generates with weights older than the trainer's (each step's sync
  completes before the rollout serves again);
- valid weights: the rollout never runs a generate body while its weight tags' contents are
  discarded or unknown (its release has no backup); with the table's contents guard such a
  generate is refused instead, which the check reports as the driver's error (`refused`);
- progress: every state that is not the end of both programs has a successor (no deadlock);
- held: no operation inside a held scope pauses memory (only the release of the last hold does).

`contents_guard=False` explores the same programs with the guard taken out of the table's rows,
to show the valid-weights property is checked, not assumed.

`held=True` runs the trainer's step inside a held scope (reef #202): hold, wake (the slot restore),
train, save, sleep, release, so the one sleep of the step is the release of the hold. The same
properties must hold, with hook failures anywhere (the scope's final sleep included).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from lifecycle.policy import LifecyclePolicy
from lifecycle.table import (
    Contents,
    Groups,
    Hook,
    Residency,
    Row,
    State,
    apply_call,
    deferred_tags,
    initial_contents,
    invalid_weights,
    plan_calls,
    row_edges,
    select_row,
    unheld_residency,
    update_contents,
)

TRAINER = LifecyclePolicy(offload_train=True, memory_tags=("model",))
ROLLOUT = LifecyclePolicy(
    memory_tags=("weights", "kv_cache"),
    sync_requires=("weights",),
    discard_on_release=("weights", "kv_cache"),  # SGLang's release: no backup
    model_tag=None,
    destroy_process_groups=False,
)
# No memory budget here: its check is one more hook that may fail at a sleep's end, like the pause
# before it; left out to keep the explored state space (and CI time) as it was.
_TRAINER_HOOKS = frozenset(Hook) - {
    Hook.GENERATION_PAUSE,
    Hook.GENERATION_RESUME,
    Hook.ROUTING_REPLAY_CLEAR,
    Hook.BUDGET_CHECK,
}
_ROLLOUT_HOOKS = frozenset(
    {Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME, Hook.GENERATION_PAUSE, Hook.GENERATION_RESUME}
)


@dataclass(frozen=True)
class Machine:
    """One actor's lifecycle as data: state, residency (in tag order), groups, and the running row."""

    state: State
    residency: tuple[Residency, ...]
    groups: Groups | None
    pending: tuple[str, ...] = ()  # the steps left of the operation in progress ("edge:i", "body")
    row: Row | None = None
    recover_to: State | None = None  # set while FAILED: where the failed operation was going
    contents: tuple[Contents, ...] = ()  # in tag order
    holds: int = 0  # holds taken (a held scope)
    targets: tuple[str, ...] | None = None  # a release's sleep targets: the deferred tags
    unheld: tuple[Residency, ...] | None = None  # the residency the scope's calls leave without it


@dataclass(frozen=True)
class World:
    trainer: Machine
    rollout: Machine
    t_pc: int  # index into the trainer's program
    r_pc: int
    step: int  # the trainer's loop iteration (the rollout follows its own counter)
    r_step: int
    trainer_version: int  # weights the trainer has trained
    rollout_version: int  # weights the rollout holds
    synced_version: int  # the last version a completed sync delivered
    released: int  # the rollout released its memory for this step
    trainer_ready: int  # the trainer is asleep and ready to sync for this step
    weights_up: int  # the rollout's weights are resident for this step's sync
    synced: int  # this step's sync completed
    faults_left: int = 0  # hook failures still to inject somewhere (each one is explored everywhere)


def _start(policy: LifecyclePolicy, initial: State, groups: bool) -> Machine:
    res = Residency.RESIDENT if initial is State.AWAKE else Residency.RELEASED
    g = None
    if groups:
        g = Groups.DESTROYED if initial is State.PAUSED and policy.destroy_process_groups else Groups.ALIVE
    contents = initial_contents(policy.view(), policy.tags, initial)
    return Machine(
        initial, tuple(res for _ in policy.tags), g, contents=tuple(contents[t] for t in policy.tags)
    )


def _contents(m: Machine, policy: LifecyclePolicy) -> dict[str, Contents]:
    return dict(zip(policy.tags, m.contents, strict=True))


def _deferred(m: Machine, policy: LifecyclePolicy) -> tuple[str, ...]:
    if m.unheld is None:
        return ()
    memory = dict(zip(policy.tags, m.residency, strict=True))
    return deferred_tags(memory, dict(zip(policy.tags, m.unheld, strict=True)))


def _replay_unheld(m: Machine, policy: LifecyclePolicy, op: str, targets: tuple[str, ...]) -> Machine:
    """An operation finished inside a held scope: replay it on the rows outside one (the machine's rule)."""
    if not m.holds or m.state is State.FAILED:
        return m
    if op == "recover" or m.unheld is None:
        return replace(m, unheld=m.residency)
    unheld = unheld_residency(op, targets, policy.view(), dict(zip(policy.tags, m.unheld, strict=True)))
    return replace(m, unheld=tuple(unheld[t] for t in policy.tags))


def _begin(
    m: Machine, policy: LifecyclePolicy, op: str, targets: tuple[str, ...] | None, guard: bool = True
) -> Machine | None:
    """Start an operation: choose its row (None if refused) and queue its edge and body steps.

    `guard=False` selects rows without the contents guard (the ablation of `contents_guard`). A hold
    or a release counts at once; a release's sleep, when it runs, is its one step."""
    tags = policy.tags if targets is None else targets
    if op == "release":
        tags = _deferred(m, policy)
    memory = dict(zip(policy.tags, m.residency, strict=True))
    contents = _contents(m, policy) if guard else None
    row = select_row(op, m.state, policy.view(), memory, tags, None, contents, m.holds)
    if row is None:
        return None
    if op == "hold":
        return replace(m, holds=m.holds + 1, unheld=m.unheld if m.holds else m.residency)
    if op == "release":
        m = replace(m, holds=m.holds - 1, unheld=m.unheld if m.holds > 1 else None)
    if row.noop:
        return _replay_unheld(replace(m, pending=(), row=None), policy, op, tags)
    if op == "release":
        m = replace(m, targets=tags)
    steps: list[str] = []
    edges = row_edges(row)
    for i, edge in enumerate(edges):
        if edge.phase == "exit":
            steps.append("body")
        steps.append(f"edge:{i}")
    if row.body_state is not None and "body" not in steps:
        steps.append("body")
    return replace(m, pending=tuple(steps), row=row)


def _advance(
    m: Machine,
    policy: LifecyclePolicy,
    hooks: frozenset[Hook],
    targets: tuple[str, ...] | None,
    fail_at: int | None,
) -> Machine | None:
    """Run the next step of the operation in progress (an edge with its plan, or the body).

    With `fail_at=k` the k-th hook call of the edge raises before its effect: the machine goes
    FAILED (the backend query of `recover` would report the residency as it is). None if the edge
    has no k-th call.
    """
    assert m.row is not None and m.pending
    head, rest = m.pending[0], m.pending[1:]
    if head == "body":
        if fail_at is not None:
            return None
        done = replace(m, pending=rest, row=m.row if rest else None)
        return done if rest else _replay_unheld(done, policy, m.row.operation, policy.tags)
    edge = row_edges(m.row)[int(head.split(":")[1])]
    memory = dict(zip(policy.tags, m.residency, strict=True))
    groups = m.groups
    calls = []
    if edge.plan is not None:
        plan_targets = (m.targets or targets or policy.tags) if edge.phase == "move" else policy.tags
        calls = plan_calls(edge.plan, policy.view(), memory, groups, plan_targets, hooks)
    if fail_at is not None and fail_at >= len(calls):
        return None
    contents = _contents(m, policy)
    for call in calls[:fail_at]:
        groups = apply_call(call, memory, groups)
        update_contents(call, True, policy.view(), contents)
    if fail_at is not None:
        update_contents(calls[fail_at], False, policy.view(), contents)
    residency = tuple(memory[t] for t in policy.tags)
    held = tuple(contents[t] for t in policy.tags)
    if fail_at is not None:
        goal = m.row.dest if m.row.operation != "recover" else (m.recover_to or m.row.dest)
        # A failure drops what a held scope deferred; the holds stay taken until released.
        return Machine(
            State.FAILED,
            residency,
            groups,
            recover_to=goal if goal is not State.FAILED else None,
            contents=held,
            holds=m.holds,
        )
    moved = replace(
        m, state=edge.dest, residency=residency, groups=groups, pending=rest, row=m.row if rest else None
    )
    moved = replace(moved, contents=held, recover_to=None, targets=m.targets if rest else None)
    if rest or m.row.operation == "release":
        return moved
    return _replay_unheld(moved, policy, m.row.operation, targets or policy.tags)


# A program instruction: (name, guard on the world, the operation it starts or an effect).
Instr = tuple[str, Callable[[World], bool], str]


def _trainer_program(save_every: int, broken: str | None = None, held: bool = False) -> list[Instr]:
    skip = broken == "skip_sync"  # a driver that forgets the sync of step 1 but still says it synced
    late = broken == "release_after_sync"  # a driver that holds the trainer across the rollout's sync
    step: list[Instr] = [
        ("train", lambda w: True, "train"),
        ("save", lambda w: w.step % save_every == 0, "save"),
        ("sleep", lambda w: True, "sleep"),
    ]
    release: list[Instr] = [("release", lambda w: True, "release")]
    if held or late:  # reef #202: one wake (the slot restore) and one sleep (the release) per step
        step = [("hold", lambda w: True, "hold"), ("wake (slot restore)", lambda w: True, "wake_up"), *step]
    return [
        ("wait rollout released", lambda w: w.released >= w.step, "wait"),
        *step,
        *(release if held and not late else []),
        ("ready to sync", lambda w: True, "signal:trainer_ready"),
        ("wait rollout weights", lambda w: w.weights_up >= w.step, "wait"),
        ("sync", lambda w: not (skip and w.step == 1), "sync"),
        ("synced", lambda w: True, "signal:synced"),
        *(release if late else []),
    ]


BROKEN = ("wake_before_trainer_sleeps", "serve_before_sync", "skip_sync", "release_after_sync")


def _rollout_program(broken: str | None) -> list[Instr]:
    early_wake, early_serve = broken == BROKEN[0], broken == BROKEN[1]
    return [
        ("generate", lambda w: True, "generate"),
        ("sleep", lambda w: True, "sleep"),
        ("released", lambda w: True, "signal:released"),
        ("wait trainer asleep", lambda w: early_wake or w.trainer_ready >= w.r_step, "wait"),
        ("wake weights", lambda w: True, "wake_up:weights"),
        ("weights up", lambda w: True, "signal:weights_up"),
        ("wait synced", lambda w: early_serve or w.synced >= w.r_step, "wait"),
        ("wake kv", lambda w: True, "wake_up:kv_cache"),
    ]


@dataclass
class Report:
    states: int
    transitions: int
    violations: list[str]
    deadlocks: int
    completed: int

    @property
    def ok(self) -> bool:
        return not self.violations and self.deadlocks == 0 and self.completed > 0


def _holds(m: Machine) -> bool:
    return any(r is not Residency.RELEASED for r in m.residency)


def _violations(w: World) -> Iterator[str]:
    if _holds(w.trainer) and _holds(w.rollout):
        yield (
            f"exclusion: trainer {w.trainer.state} {w.trainer.residency} and rollout {w.rollout.state} "
            f"{w.rollout.residency} both hold memory (trainer step {w.step}, rollout step {w.r_step})"
        )


def _successors(
    w: World, steps: int, t_prog: list[Instr], r_prog: list[Instr], contents_guard: bool = True
) -> Iterator[tuple[str, World]]:
    yield from _side(w, "trainer", steps, t_prog, contents_guard)
    yield from _side(w, "rollout", steps, r_prog, contents_guard)


def _side(
    w: World, side: str, steps: int, prog: list[Instr], contents_guard: bool = True
) -> Iterator[tuple[str, World]]:
    trainer = side == "trainer"
    m = w.trainer if trainer else w.rollout
    policy, hooks = (TRAINER, _TRAINER_HOOKS) if trainer else (ROLLOUT, _ROLLOUT_HOOKS)
    pc, loop = (w.t_pc, w.step) if trainer else (w.r_pc, w.r_step)
    if loop > steps:
        return
    if m.state is State.FAILED and not m.pending:  # only recover is legal; then the instruction is retried
        assert m.recover_to in (State.AWAKE, State.PAUSED)
        memory = dict(zip(policy.tags, m.residency, strict=True))
        row = select_row("recover", m.state, policy.view(), memory, policy.tags, m.recover_to)
        assert row is not None
        steps_ = tuple(f"edge:{i}" for i in range(len(row_edges(row))))
        started = replace(m, pending=steps_, row=row)
        yield (
            f"{side}: begin recover({m.recover_to})",
            replace(w, trainer=started) if trainer else replace(w, rollout=started),
        )
        return
    if m.pending:  # an operation in progress: its next step
        assert m.row is not None
        op = m.row.operation
        targets = _targets(prog[pc][2])
        nxt = _advance(m, policy, hooks, targets, None)
        assert nxt is not None
        if m.holds and op not in ("release", "recover") and _paused(m, nxt):
            yield f"held: {side} {op} {m.pending[0]} paused memory inside a held scope (step {loop})", w
            return
        world = replace(w, trainer=nxt) if trainer else replace(w, rollout=nxt)
        if not nxt.pending and op != "recover":
            world = _finish(world, side, op, prog, steps)
        yield f"{side}: {op} {m.pending[0]}", world
        for k in range(4 if w.faults_left else 0):
            failed = _advance(m, policy, hooks, targets, k)
            if failed is not None:
                world = replace(w, trainer=failed) if trainer else replace(w, rollout=failed)
                if op == "release":
                    world = _next(world, side, prog)  # the hold was given back: recover, then go on
                yield (
                    f"{side}: {op} {m.pending[0]} hook {k} raised",
                    replace(world, faults_left=w.faults_left - 1),
                )
        return
    name, guard, action = prog[pc]
    if not guard(w):
        if action == "wait" or not name.startswith(("save", "sync")):
            return
        yield f"{side}: skip {name}", _next(w, side, prog)  # a guarded operation not due this step
        return
    if action == "wait":
        yield f"{side}: {name}", _next(w, side, prog)
        return
    if action.startswith("signal:"):
        flag = action.split(":", 1)[1]
        signalled: World = replace(w, **{flag: loop})  # type: ignore[arg-type]
        yield f"{side}: {name}", _next(signalled, side, prog)
        return
    op = action.split(":", 1)[0]
    if op == "generate" and not trainer:
        invalid = invalid_weights(ROLLOUT.view(), _contents(m, ROLLOUT))
        if invalid and m.state is State.AWAKE:
            what = ", ".join(f"{t} {c.value}" for t, c in invalid.items())
            if contents_guard:
                yield (
                    f"refused: rollout generate refused on invalid weights ({what}) at rollout step {w.r_step}",
                    w,
                )
            else:
                yield (
                    f"valid weights: rollout generates on invalid weights ({what}) at rollout step {w.r_step}",
                    w,
                )
            return
    if op == "generate" and w.rollout_version < w.trainer_version:
        yield (
            (
                f"freshness: rollout generates with weights v{w.rollout_version} while the trainer has "
                f"v{w.trainer_version} (rollout step {w.r_step})"
            ),
            w,
        )
        return
    begun = _begin(m, policy, op, _targets(action), contents_guard)
    if begun is None:
        return  # refused: the program is stuck here (a deadlock, if nothing else can move)
    moved = replace(w, trainer=begun) if trainer else replace(w, rollout=begun)
    yield f"{side}: begin {action}", moved if begun.pending else _finish(moved, side, op, prog, steps)


def _paused(before: Machine, after: Machine) -> bool:
    return any(
        a is Residency.RESIDENT and b is Residency.RELEASED
        for a, b in zip(before.residency, after.residency, strict=True)
    )


def _targets(action: str) -> tuple[str, ...] | None:
    return (action.split(":", 1)[1],) if ":" in action and not action.startswith("signal") else None


def _finish(w: World, side: str, op: str, prog: list[Instr], steps: int) -> World:
    if side == "trainer" and op == "train":
        w = replace(w, trainer_version=w.trainer_version + 1)
    if side == "trainer" and op == "sync":
        # The trainer's sync body is the rollout's load: the rollout must be able to receive, and
        # its final round makes the weight tags valid (RolloutActor's note_weights).
        loaded = _contents(w.rollout, ROLLOUT)
        for tag in ROLLOUT.view().weight_tags:
            loaded[tag] = Contents.VALID
        w = replace(
            w,
            rollout=replace(w.rollout, contents=tuple(loaded[t] for t in ROLLOUT.tags)),
            rollout_version=w.trainer_version,
            synced_version=w.trainer_version,
        )
    return _next(w, side, prog)


def _next(w: World, side: str, prog: list[Instr]) -> World:
    if side == "trainer":
        pc = w.t_pc + 1
        return replace(w, t_pc=pc % len(prog), step=w.step + (pc == len(prog)))
    pc = w.r_pc + 1
    return replace(w, r_pc=pc % len(prog), r_step=w.r_step + (pc == len(prog)))


def explore(
    steps: int = 3,
    save_every: int = 2,
    *,
    faults: int = 0,
    broken: str | None = None,
    contents_guard: bool = True,
    held: bool = False,
    limit: int = 2_000_000,
) -> Report:
    """Breadth-first over every interleaving of `steps` loop iterations of both actors.

    `faults` hook failures are injected at every possible hook call (each followed by `recover`
    and a retry); `broken` breaks one program (a dropped wait, a skipped sync, a held scope
    released after the sync), to show the check fails; `held` runs the trainer's step in a held scope.
    """
    if broken is not None and broken not in BROKEN:
        raise ValueError(f"explore: broken must be one of {BROKEN} or None, got {broken!r}")
    t_prog, r_prog = _trainer_program(save_every, broken, held), _rollout_program(broken)
    start = World(
        trainer=_start(TRAINER, State.PAUSED, groups=True),  # slime's init ends asleep
        rollout=_start(ROLLOUT, State.AWAKE, groups=False),
        t_pc=0,
        r_pc=0,
        step=1,
        r_step=1,
        trainer_version=0,
        rollout_version=0,
        synced_version=0,
        released=0,
        trainer_ready=0,
        weights_up=0,
        synced=0,
        faults_left=faults,
    )
    seen = {start}
    queue = deque([start])
    violations: list[str] = []
    transitions = deadlocks = completed = 0
    while queue:
        w = queue.popleft()
        violations += [v for v in _violations(w) if v not in violations]
        moves = list(_successors(w, steps, t_prog, r_prog, contents_guard))
        for label, nxt in moves:
            if label.startswith(("freshness", "refused", "valid weights", "held")):
                if label not in violations:
                    violations.append(label)
                continue
            transitions += 1
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
                if len(seen) > limit:
                    raise RuntimeError(f"model check: more than {limit} states; lower `steps`")
        if not moves:
            if w.step > steps and w.r_step > steps:
                completed += 1
            else:
                deadlocks += 1
                if deadlocks <= 3:
                    violations.append(
                        f"deadlock: trainer at {t_prog[w.t_pc][0]!r} (step {w.step}, {w.trainer.state}), rollout at "
                        f"{r_prog[w.r_pc][0]!r} (step {w.r_step}, {w.rollout.state})"
                    )
    return Report(len(seen), transitions, violations, deadlocks, completed)


if __name__ == "__main__":
    for scoped in (False, True):
        for injected in (0, 1):
            report = explore(faults=injected, held=scoped)
            print(
                f"{'trainer step in a held scope, ' if scoped else ''}{injected} hook failure(s) anywhere: "
                f"{report.states} states, {report.transitions} transitions, {report.completed} terminal, "
                f"{report.deadlocks} deadlocks; violations: {report.violations or 'none'}"
            )

"""The transition table: the one source of truth for states, operations, hook plans and guards.

The machine (`lifecycle.machine`), the diagrams (`lifecycle.diagram`) and the log checker all read
this module; nothing else restates which operation may run where or which hooks run in which order.
Everything here is plain data plus pure functions over it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple


class State(str, enum.Enum):
    """Macro state of one actor."""

    AWAKE = "AWAKE"
    PAUSED = "PAUSED"
    SAVING = "SAVING"
    SYNCING = "SYNCING"
    FAILED = "FAILED"

    def __str__(self) -> str:
        return self.value


class Residency(str, enum.Enum):
    """What the machine knows about one memory tag."""

    RESIDENT = "resident"
    RELEASED = "released"
    UNKNOWN = "unknown"  # a hook touching it raised: never guess (vLLM's rule)


class Contents(str, enum.Enum):
    """What the machine knows about the data in one tag (residency says only where it is).

    A tag released without a backup (SGLang's `weights` and `kv_cache`, vLLM's level-2 sleep) comes
    back holding fresh, meaningless memory: its contents are discarded until a sync writes them.
    """

    VALID = "valid"
    DISCARDED = "discarded"  # released without a backup: a wake maps memory, not the old data
    UNKNOWN = "unknown"  # a hook touching it raised, or a sync stopped after writing part of it


class Groups(str, enum.Enum):
    """What the machine knows about the actor's process groups.

    Asleep they are destroyed, suspended or kept, as the process-group backend declares
    (`Communicators`); each needs a reload before the next collective.
    """

    ALIVE = "alive"
    DESTROYED = "destroyed"  # communicators destroyed: memory freed, rebuilt on reload
    SUSPENDED = "suspended"  # communicators suspended: NCCL memory released, resumed on reload
    KEPT = "kept"  # communicators kept as they were: memory held, collectives refused until reload
    UNKNOWN = "unknown"


class Communicators(str, enum.Enum):
    """How a process-group backend treats its communicators on `process_groups.destroy`.

    The backend declares it as its `communicators` attribute (read once, when the machine is
    built, and logged in `lifecycle.configured`); a backend without one destroys them.
    """

    DESTROY = "destroy"
    SUSPEND = "suspend"
    KEEP = "keep"

    def __str__(self) -> str:
        return self.value


# The groups' state a `process_groups.destroy` leaves, per declared way.
ASLEEP: Mapping[Communicators, Groups] = {
    Communicators.DESTROY: Groups.DESTROYED,
    Communicators.SUSPEND: Groups.SUSPENDED,
    Communicators.KEEP: Groups.KEPT,
}
ASLEEP_GROUPS: frozenset[Groups] = frozenset(ASLEEP.values())


# The residency key used when the policy tracks all memory as one unit (`memory_tags=None`):
# the backend is then called with `tag=None`, which torch_memory_saver reads as "every tag".
ALL_TAGS = "*"


class Hook(str, enum.Enum):
    """The hook slots a plan can call, named as they appear in logs and in `--inject-fault`."""

    GENERATION_PAUSE = "generation.pause"
    ROUTING_REPLAY_CLEAR = "routing_replay.clear"
    CLEAR_MEMORY = "clear_memory"
    PROCESS_GROUPS_DESTROY = "process_groups.destroy"
    MEMORY_PAUSE = "memory.pause"
    MEMORY_RESUME = "memory.resume"
    PROCESS_GROUPS_RELOAD = "process_groups.reload"
    SWITCH_MODEL = "switch_model"
    GENERATION_RESUME = "generation.resume"
    BUDGET_CHECK = "memory.budget_check"

    def __str__(self) -> str:
        return self.value


# When each hook runs inside a plan. The machine and the checker both call `plan_calls`,
# which applies exactly these rules; the strings are for the generated docs.
HOOK_RULES: Mapping[Hook, str] = {
    Hook.GENERATION_PAUSE: "if a generation hook is given (rollout: pause generation, flush cache)",
    Hook.ROUTING_REPLAY_CLEAR: "if `use_routing_replay` and a routing-replay hook is given",
    Hook.CLEAR_MEMORY: "if a clear-memory hook is given",
    Hook.PROCESS_GROUPS_DESTROY: (
        "if `destroy_process_groups` and the groups are alive; they are left destroyed, suspended or "
        "kept, as the backend's `communicators` declares"
    ),
    Hook.MEMORY_PAUSE: "once per targeted tag that is resident, in policy order",
    Hook.MEMORY_RESUME: "once per targeted tag that is released, in policy order",
    Hook.PROCESS_GROUPS_RELOAD: "if the groups are asleep (destroyed, suspended or kept)",
    Hook.SWITCH_MODEL: "if `model_tag` is set and a switch-model hook is given",
    Hook.GENERATION_RESUME: "if a generation hook is given (rollout: continue generation)",
    Hook.BUDGET_CHECK: (
        "if a memory budget is configured (`lifecycle.budget`): the next phase's need is free, else "
        "`MemoryBudgetShortError` (FAILED; `recover` releases the rest)"
    ),
}


# What a held scope does, in words, for the generated docs; `unheld_residency` and the rows marked
# `held` are the rule itself.
HELD_RULE = (
    "between `hold()` and the release of the last hold (`Lifecycle.held()`; holds are counted for the "
    "whole machine) no sleep runs: rows marked *held* replace the rows marked *not held*, and each "
    "operation is also replayed on the rows outside a scope, without hooks; the release of the last "
    "hold sleeps the tags resident now that the replay left released (the *deferred* tags), once, "
    "with the `sleep` plan. A hook failure drops the deferred tags: `recover` decides where to go"
)


@dataclass(frozen=True)
class Plan:
    """The hook slots run on one edge, as ordered stages.

    The hooks of one stage do not depend on each other: the machine may run them together (each
    in its own thread, each still logged on its own), and runs the stages one after another.
    `steps` is the plain order, used when a stage runs sequentially.
    """

    name: str
    stages: tuple[tuple[Hook, ...], ...]
    doc: str

    @property
    def steps(self) -> tuple[Hook, ...]:
        return tuple(hook for stage in self.stages for hook in stage)


SLEEP = Plan(
    "sleep",
    (
        (Hook.GENERATION_PAUSE,),
        (Hook.ROUTING_REPLAY_CLEAR,),  # caches hold device tensors: clear before the pause (slime)
        (Hook.CLEAR_MEMORY,),
        # NCCL frees its communicators' own memory while the saver copies the model's memory to
        # host: independent work, the slowest of a sleep when serial, so it runs together
        # (docs/measurements.md#serial-process-group-teardown-2026-12-01).
        (Hook.PROCESS_GROUPS_DESTROY, Hook.MEMORY_PAUSE),
        # Under a memory budget: the need is free before the other phase wakes, or a typed error
        # here, where recover can still release the rest (not an OOM inside the engine).
        (Hook.BUDGET_CHECK,),
    ),
    "release memory: stop generation, clear caches, destroy process groups and pause tags together",
)
WAKE = Plan(
    "wake",
    (
        # Re-creating communicators does not touch the model's memory being restored.
        (Hook.MEMORY_RESUME, Hook.PROCESS_GROUPS_RELOAD),
        (Hook.SWITCH_MODEL,),  # the active model tag is lost with the paused weights (slime)
        (Hook.GENERATION_RESUME,),
    ),
    "restore memory: resume tags and reload process groups together, restore the model tag",
)
PARTIAL_WAKE = Plan(
    "partial_wake",
    ((Hook.MEMORY_RESUME,),),
    "resume some tags only (rollout: weights before a sync, kv cache after)",
)
GROUPS_UP = Plan(
    "groups_up",
    ((Hook.PROCESS_GROUPS_RELOAD,),),
    "reload process groups for a weight sync while model memory stays paused",
)
GROUPS_DOWN = Plan(
    "groups_down",
    ((Hook.PROCESS_GROUPS_DESTROY,),),
    "destroy the process groups reloaded for the sync",
)

PLANS: tuple[Plan, ...] = (SLEEP, WAKE, PARTIAL_WAKE, GROUPS_UP, GROUPS_DOWN)


class When(str, enum.Enum):
    """Row guards. `guard_holds` evaluates them; the strings are for docs and error messages."""

    ALWAYS = "always"
    OFFLOAD = "offload_train"
    NO_OFFLOAD = "not offload_train"
    AUTO_WAKE_OFFLOAD = "auto_wake and offload_train"
    AUTO_WAKE_NO_OFFLOAD = "auto_wake and not offload_train"
    AUTO_WAKE = "auto_wake"
    SOME_RESIDENT = "a targeted tag is resident"
    ALL_RELEASED = "every targeted tag is released"
    COMPLETES = "all tags resident afterwards"
    PARTIAL = "some tag stays released"
    SYNC_TAGS_RESIDENT = "the tags in sync_requires are resident"
    WEIGHTS_VALID = "the weight tags hold valid contents"
    TARGET_AWAKE = "target=AWAKE"
    TARGET_PAUSED = "target=PAUSED"
    RELEASE_SLEEPS = "the last hold, a sleep deferred"
    RELEASE_KEEPS = "another hold remains, or no sleep deferred"


class Row(NamedTuple):
    """One legal (operation, source) pair.

    `enter` runs on the edge source → `body_state`, the operation's body (if any) runs in
    `body_state`, and `exit` runs on the edge `body_state` → dest. Rows without a body have
    `body_state=None` and a single edge source → dest carrying `enter`. `held` limits a row to
    inside a held scope (True) or outside one (False); None: either.
    """

    operation: str
    source: State
    dest: State
    enter: Plan | None = None
    body_state: State | None = None
    exit: Plan | None = None
    when: When = When.ALWAYS
    noop: bool = False
    held: bool | None = None
    body_context: str | None = None  # "memory.disable": the body allocates outside saver regions
    doc: str = ""


S = State
TABLE: tuple[Row, ...] = (
    Row("sleep", S.AWAKE, S.PAUSED, enter=SLEEP, held=False, doc="release memory"),
    Row(
        "sleep",
        S.PAUSED,
        S.PAUSED,
        enter=SLEEP,
        when=When.SOME_RESIDENT,
        held=False,
        doc="release the targeted tags that a partial wake left resident",
    ),
    Row(
        "sleep",
        S.PAUSED,
        S.PAUSED,
        noop=True,
        when=When.ALL_RELEASED,
        doc="idempotent: a second sleep is a logged no-op (slime #1895: TMS would exit(1))",
    ),
    Row("wake_up", S.PAUSED, S.AWAKE, enter=WAKE, when=When.COMPLETES, doc="restore memory"),
    Row(
        "wake_up", S.PAUSED, S.PAUSED, enter=PARTIAL_WAKE, when=When.PARTIAL, doc="resume only the given tags"
    ),
    Row("wake_up", S.AWAKE, S.AWAKE, noop=True, doc="idempotent: already awake"),
    Row("train", S.AWAKE, S.AWAKE, body_state=S.AWAKE, when=When.NO_OFFLOAD, doc="train step"),
    Row(
        "train",
        S.AWAKE,
        S.PAUSED,
        body_state=S.AWAKE,
        exit=SLEEP,
        when=When.OFFLOAD,
        held=False,
        doc="train step, then sleep (slime offload_train, #1856)",
    ),
    Row(
        "train",
        S.PAUSED,
        S.AWAKE,
        enter=WAKE,
        body_state=S.AWAKE,
        when=When.AUTO_WAKE_NO_OFFLOAD,
        doc="auto-wake, train step",
    ),
    Row(
        "train",
        S.PAUSED,
        S.PAUSED,
        enter=WAKE,
        body_state=S.AWAKE,
        exit=SLEEP,
        when=When.AUTO_WAKE_OFFLOAD,
        held=False,
        doc="auto-wake, train step, sleep again",
    ),
    Row(
        "generate",
        S.AWAKE,
        S.AWAKE,
        body_state=S.AWAKE,
        when=When.WEIGHTS_VALID,
        doc="serve requests on valid weights (rollout; vllm #29341: a wake without a sync serves gibberish)",
    ),
    Row("save", S.AWAKE, S.AWAKE, body_state=S.SAVING, doc="checkpoint on resident memory"),
    Row(
        "save",
        S.PAUSED,
        S.PAUSED,
        enter=WAKE,
        body_state=S.SAVING,
        exit=SLEEP,
        when=When.AUTO_WAKE,
        held=False,
        doc="resume memory and groups, checkpoint, pause again (slime #1886/#1888)",
    ),
    Row("sync", S.AWAKE, S.AWAKE, body_state=S.SYNCING, body_context="memory.disable", doc="weight update"),
    Row(
        "sync",
        S.PAUSED,
        S.PAUSED,
        enter=GROUPS_UP,
        body_state=S.SYNCING,
        exit=GROUPS_DOWN,
        when=When.SYNC_TAGS_RESIDENT,
        body_context="memory.disable",
        doc="weight update with model memory paused: groups up for the duration (slime colocate)",
    ),
    Row(
        "recover",
        S.FAILED,
        S.AWAKE,
        enter=WAKE,
        when=When.TARGET_AWAKE,
        doc="re-run only the wake hooks the recorded residency still needs",
    ),
    Row(
        "recover",
        S.FAILED,
        S.PAUSED,
        enter=SLEEP,
        when=When.TARGET_PAUSED,
        doc="re-run only the sleep hooks the recorded residency still needs",
    ),
    # A held scope (`Lifecycle.held()`; reef #202: one wake and one sleep for a step's four phases).
    # While a hold is taken no sleep plan runs: the rows above that would sleep are replaced by
    # these, and the release of the last hold runs one sleep of the tags the same calls would have
    # left released without the scope (`unheld_residency`, `deferred_tags`).
    Row("hold", S.AWAKE, S.AWAKE, noop=True, doc="take a hold: sleeps wait for the release of the last hold"),
    Row("hold", S.PAUSED, S.PAUSED, noop=True, doc="take a hold; the first wake inside it is real"),
    Row("sleep", S.AWAKE, S.AWAKE, noop=True, held=True, doc="deferred to the release of the last hold"),
    Row(
        "sleep",
        S.PAUSED,
        S.PAUSED,
        noop=True,
        when=When.SOME_RESIDENT,
        held=True,
        doc="deferred to the release of the last hold",
    ),
    Row(
        "train",
        S.AWAKE,
        S.AWAKE,
        body_state=S.AWAKE,
        when=When.OFFLOAD,
        held=True,
        doc="train step; its sleep deferred",
    ),
    Row(
        "train",
        S.PAUSED,
        S.AWAKE,
        enter=WAKE,
        body_state=S.AWAKE,
        when=When.AUTO_WAKE_OFFLOAD,
        held=True,
        doc="auto-wake, train step; its sleep deferred",
    ),
    Row(
        "save",
        S.PAUSED,
        S.AWAKE,
        enter=WAKE,
        body_state=S.SAVING,
        when=When.AUTO_WAKE,
        held=True,
        doc="resume memory and groups, checkpoint; the pause deferred",
    ),
    Row(
        "release",
        S.AWAKE,
        S.PAUSED,
        enter=SLEEP,
        when=When.RELEASE_SLEEPS,
        held=True,
        doc="the scope's one sleep, of the deferred tags",
    ),
    Row(
        "release",
        S.PAUSED,
        S.PAUSED,
        enter=SLEEP,
        when=When.RELEASE_SLEEPS,
        held=True,
        doc="the scope's one sleep, of the deferred tags a partial wake left resident",
    ),
    Row("release", S.AWAKE, S.AWAKE, noop=True, when=When.RELEASE_KEEPS, held=True, doc="give the hold back"),
    Row(
        "release", S.PAUSED, S.PAUSED, noop=True, when=When.RELEASE_KEEPS, held=True, doc="give the hold back"
    ),
    Row(
        "release",
        S.FAILED,
        S.FAILED,
        noop=True,
        held=True,
        doc="give the hold back: the failure dropped the deferred sleep (recover decides where to go)",
    ),
)
del S

# Any hook that raises moves the machine here, from every state that runs hooks.
FAIL_SOURCES: tuple[State, ...] = (State.AWAKE, State.PAUSED, State.SAVING, State.SYNCING, State.FAILED)

OPERATIONS: tuple[str, ...] = tuple(dict.fromkeys(row.operation for row in TABLE))
BODY_OPERATIONS: tuple[str, ...] = tuple(dict.fromkeys(r.operation for r in TABLE if r.body_state))
LIFECYCLE_CALLS: tuple[str, ...] = ("sleep", "wake_up")  # absorbed when nested inside a body


class Edge(NamedTuple):
    """A state change the machine can make; derived from the rows."""

    source: State
    dest: State
    operation: str
    phase: str  # "move" (no body), "enter" or "exit"
    plan: Plan | None

    @property
    def trigger(self) -> str:
        return f"{self.operation}.{self.phase}:{self.source.value}>{self.dest.value}"


def row_edges(row: Row) -> tuple[Edge, ...]:
    """The edges one row fires, in order. A body run in its source state fires no enter edge."""
    if row.noop:
        return ()
    if row.body_state is None:
        return (Edge(row.source, row.dest, row.operation, "move", row.enter),)
    edges = []
    if row.body_state != row.source or row.enter is not None:
        edges.append(Edge(row.source, row.body_state, row.operation, "enter", row.enter))
    if row.body_state != row.dest or row.exit is not None:
        edges.append(Edge(row.body_state, row.dest, row.operation, "exit", row.exit))
    return tuple(edges)


EDGES: tuple[Edge, ...] = tuple(dict.fromkeys(e for row in TABLE for e in row_edges(row)))
FAIL_TRIGGER = "fail"


_ROWS: dict[tuple[str, State], tuple[Row, ...]] = {}
for _row in TABLE:
    _ROWS[(_row.operation, _row.source)] = (*_ROWS.get((_row.operation, _row.source), ()), _row)
del _row


def rows_for(operation: str, source: State) -> tuple[Row, ...]:
    """The rows of (operation, source), in table order, inside and outside a held scope."""
    return _ROWS.get((operation, source), ())


def allowed_operations(source: State) -> tuple[str, ...]:
    """Operations with at least one row from `source` (their guards may still refuse)."""
    return tuple(dict.fromkeys(r.operation for r in TABLE if r.source == source))


# ----------------------------------------------------------------------------------------------
# Pure evaluation, shared by the machine and the log checker.


@dataclass(frozen=True)
class PolicyView:
    """The policy fields the table reads. `LifecyclePolicy` and logged policies both provide them."""

    offload_train: bool
    auto_wake: bool
    use_routing_replay: bool
    destroy_process_groups: bool
    model_tag: str | None
    sync_requires: tuple[str, ...]
    discard_on_release: tuple[str, ...] = ()  # tags whose contents a release discards (no backup)
    weight_tags: tuple[str, ...] = ()  # tags whose contents `generate` reads (the sync's tags, else all)


def guard_holds(
    when: When,
    policy: PolicyView,
    memory: Mapping[str, Residency],
    targets: Iterable[str],
    recover_target: State | None = None,
    contents: Mapping[str, Contents] | None = None,
    holds: int = 0,
) -> bool:
    """Whether a row guard holds. `contents=None` (a caller that does not track contents) passes
    the contents guard: the log checker reports generation on invalid weights itself. `holds` is
    the number of holds taken; a release's `targets` are the deferred tags (`deferred_tags`)."""
    if when is When.ALWAYS:
        return True
    targets = tuple(targets)
    if when in (When.RELEASE_SLEEPS, When.RELEASE_KEEPS):
        sleeps = holds == 1 and any(memory[t] is Residency.RESIDENT for t in targets)
        return sleeps if when is When.RELEASE_SLEEPS else not sleeps
    if when is When.OFFLOAD:
        return policy.offload_train
    if when is When.NO_OFFLOAD:
        return not policy.offload_train
    if when is When.AUTO_WAKE:
        return policy.auto_wake
    if when is When.AUTO_WAKE_OFFLOAD:
        return policy.auto_wake and policy.offload_train
    if when is When.AUTO_WAKE_NO_OFFLOAD:
        return policy.auto_wake and not policy.offload_train
    if when is When.SOME_RESIDENT:
        return any(memory[t] is not Residency.RELEASED for t in targets)
    if when is When.ALL_RELEASED:
        return all(memory[t] is Residency.RELEASED for t in targets)
    if when is When.COMPLETES:
        return all(t in targets or r is Residency.RESIDENT for t, r in memory.items())
    if when is When.PARTIAL:
        return not all(t in targets or r is Residency.RESIDENT for t, r in memory.items())
    if when is When.SYNC_TAGS_RESIDENT:
        return all(memory[t] is Residency.RESIDENT for t in policy.sync_requires)
    if when is When.WEIGHTS_VALID:
        return contents is None or not invalid_weights(policy, contents)
    if when is When.TARGET_AWAKE:
        return recover_target is State.AWAKE
    if when is When.TARGET_PAUSED:
        return recover_target is State.PAUSED
    raise AssertionError(f"unhandled guard {when!r}")


def row_applies(
    row: Row,
    policy: PolicyView,
    memory: Mapping[str, Residency],
    targets: Iterable[str],
    recover_target: State | None = None,
    contents: Mapping[str, Contents] | None = None,
    holds: int = 0,
) -> bool:
    """Whether `row` applies: inside or outside a held scope as it says, and its guard holds."""
    if row.held is not None and row.held is not (holds > 0):
        return False
    return guard_holds(row.when, policy, memory, targets, recover_target, contents, holds)


def select_row(
    operation: str,
    source: State,
    policy: PolicyView,
    memory: Mapping[str, Residency],
    targets: Iterable[str],
    recover_target: State | None = None,
    contents: Mapping[str, Contents] | None = None,
    holds: int = 0,
) -> Row | None:
    """The first row for (operation, source) that applies, or None. `holds`: holds taken (0: no scope)."""
    targets = targets if isinstance(targets, tuple) else tuple(targets)
    for row in rows_for(operation, source):
        if row_applies(row, policy, memory, targets, recover_target, contents, holds):
            return row
    return None


class Call(NamedTuple):
    """One hook invocation inside a plan; `tag` is set for memory calls only."""

    hook: Hook
    tag: str | None = None


def plan_calls(
    plan: Plan,
    policy: PolicyView,
    memory: Mapping[str, Residency],
    groups: Groups | None,
    targets: Iterable[str],
    present: frozenset[Hook],
) -> list[Call]:
    """The exact hook calls `plan` makes from the given residency.

    `present` names the hook slots the actor supplied; memory is always present. Steps whose
    resource is already in the target state are skipped, which is what makes a second sleep
    harmless and lets `recover` re-run only what the recorded residency still needs.
    """
    targets = tuple(targets)
    calls: list[Call] = []
    for hook in plan.steps:
        if hook is Hook.MEMORY_PAUSE:
            calls.extend(Call(hook, t) for t in targets if memory[t] is Residency.RESIDENT)
        elif hook is Hook.MEMORY_RESUME:
            calls.extend(Call(hook, t) for t in targets if memory[t] is Residency.RELEASED)
        elif hook not in present:
            continue
        elif hook is Hook.ROUTING_REPLAY_CLEAR:
            if policy.use_routing_replay:
                calls.append(Call(hook))
        elif hook is Hook.PROCESS_GROUPS_DESTROY:
            if policy.destroy_process_groups and groups is Groups.ALIVE:
                calls.append(Call(hook))
        elif hook is Hook.PROCESS_GROUPS_RELOAD:
            if groups in ASLEEP_GROUPS:
                calls.append(Call(hook))
        elif hook is Hook.SWITCH_MODEL:
            if policy.model_tag is not None:
                calls.append(Call(hook))
        else:
            calls.append(Call(hook))
    return calls


def hooks_used(policy: PolicyView, tags: Iterable[str], present: frozenset[Hook]) -> tuple[Hook, ...]:
    """Every hook some plan calls for an actor with this policy, memory tags and hook slots, in
    `Hook` order: what a fault may be injected into (`lifecycle demo --inject-fault`)."""
    tags = tuple(tags)
    used: set[Hook] = set()
    for plan in PLANS:
        for residency in (Residency.RESIDENT, Residency.RELEASED):
            memory = dict.fromkeys(tags, residency)
            for groups in (None, Groups.ALIVE, *sorted(ASLEEP_GROUPS)):
                used.update(c.hook for c in plan_calls(plan, policy, memory, groups, tags, present))
    return tuple(hook for hook in Hook if hook in used)


def plan_stages(plan: Plan, calls: Iterable[Call]) -> list[list[list[Call]]]:
    """`calls` (from `plan_calls`) grouped as the plan runs them: per stage, one branch per hook slot.

    The calls of one branch run in order; the branches of a stage may run together. Stages and
    branches with no call are left out.
    """
    stage_of = {hook: index for index, stage in enumerate(plan.stages) for hook in stage}
    stages: dict[int, dict[Hook, list[Call]]] = {}
    for call in calls:
        stages.setdefault(stage_of[call.hook], {}).setdefault(call.hook, []).append(call)
    return [list(branches.values()) for _, branches in sorted(stages.items())]


def failed_run(plan: Plan, calls: list[Call], logged: list[tuple[Call, bool]]) -> bool:
    """Whether `logged` ((call, returned) in plan order) is what running `calls` records when hooks raise.

    The stages before the failing one ran whole; in the failing stage each branch ran a prefix of
    its calls, ending at its failure, or all of them, or (run one after another) none after a
    failed branch; at least one call raised; no later stage ran.
    """
    if not logged or all(ok for _, ok in logged):
        return False
    position = 0
    for stage in plan_stages(plan, calls):
        stage_calls = [c for branch in stage for c in branch]
        ran = logged[position : position + len(stage_calls)]
        if [c for c, _ in ran] == stage_calls and all(ok for _, ok in ran):
            position += len(stage_calls)
            continue
        for branch in stage:  # the failing stage
            taken = 0
            while taken < len(branch) and position < len(logged) and logged[position][0] == branch[taken]:
                taken += 1
                position += 1
                if not logged[position - 1][1]:
                    break
            if taken > 0 and logged[position - 1][1] and taken < len(branch):
                return False  # a branch stopped without a failure
        return position == len(logged)
    return False


def apply_call(
    call: Call,
    memory: dict[str, Residency],
    groups: Groups | None,
    communicators: Communicators = Communicators.DESTROY,
) -> Groups | None:
    """Update `memory` in place for a call that returned normally; return the new groups state.

    `communicators` is the process-group backend's declared way: which state a destroy leaves.
    """
    if call.hook is Hook.MEMORY_PAUSE:
        assert call.tag is not None
        memory[call.tag] = Residency.RELEASED
    elif call.hook is Hook.MEMORY_RESUME:
        assert call.tag is not None
        memory[call.tag] = Residency.RESIDENT
    elif call.hook is Hook.PROCESS_GROUPS_DESTROY:
        return ASLEEP[communicators]
    elif call.hook is Hook.PROCESS_GROUPS_RELOAD:
        return Groups.ALIVE
    return groups


def mark_unknown(call: Call, memory: dict[str, Residency], groups: Groups | None) -> Groups | None:
    """Update `memory` in place for a call that raised; return the new groups state."""
    if call.hook in (Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME):
        assert call.tag is not None
        memory[call.tag] = Residency.UNKNOWN
    elif call.hook in (Hook.PROCESS_GROUPS_DESTROY, Hook.PROCESS_GROUPS_RELOAD):
        return Groups.UNKNOWN
    return groups


def unheld_residency(
    operation: str, targets: Iterable[str], policy: PolicyView, memory: Mapping[str, Residency]
) -> dict[str, Residency]:
    """The residency `operation` leaves outside a held scope, from `memory`: a replay, no hook runs.

    Inside a held scope the machine runs the held rows, which never pause; the scope replays the
    same calls here on the rows outside a scope, from the residency they would have left. A call
    those rows refuse leaves it as it was. Body operations act on all tags (`targets` is ignored
    on their enter and exit edges, as the machine does).
    """
    after = dict(memory)
    state = State.AWAKE if all(r is Residency.RESIDENT for r in after.values()) else State.PAUSED
    targets = tuple(targets)
    row = select_row(operation, state, policy, after, targets)
    if row is None:
        return after
    for edge in row_edges(row):
        if edge.plan is not None:
            edge_targets = targets if edge.phase == "move" else tuple(after)
            for call in plan_calls(edge.plan, policy, after, None, edge_targets, frozenset()):
                apply_call(call, after, None)
    return after


def deferred_tags(memory: Mapping[str, Residency], unheld: Mapping[str, Residency] | None) -> tuple[str, ...]:
    """The tags whose sleep a held scope deferred: resident now, released by the same calls without it."""
    if unheld is None:
        return ()
    return tuple(
        t for t, r in memory.items() if r is Residency.RESIDENT and unheld.get(t) is Residency.RELEASED
    )


def body_ready(operation: str, policy: PolicyView, memory: Mapping[str, Residency]) -> bool:
    """Whether the memory an operation's body touches is resident (never run a body on released memory)."""
    if operation == "sync":
        return all(memory[t] is Residency.RESIDENT for t in policy.sync_requires)
    return all(r is Residency.RESIDENT for r in memory.values())


# ----------------------------------------------------------------------------------------------
# Contents: what a tag's memory holds, beside where it is.


def initial_contents(policy: PolicyView, tags: Iterable[str], initial: State) -> dict[str, Contents]:
    """An actor built AWAKE holds what it loaded; one built PAUSED holds nothing in the tags a release discards."""
    paused = initial is State.PAUSED
    return {
        t: Contents.DISCARDED if paused and t in policy.discard_on_release else Contents.VALID for t in tags
    }


def update_contents(call: Call, ok: bool, policy: PolicyView, contents: dict[str, Contents]) -> None:
    """Update `contents` in place for one memory hook call (`ok`: it returned; else it raised).

    A pause of a tag the policy declares discarded on release discards its contents; a pause or
    resume that raised leaves contents unknown (never guess), except contents already discarded,
    which no memory call can bring back. Other hooks do not touch contents.
    """
    if call.hook not in (Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME):
        return
    assert call.tag is not None
    if contents[call.tag] is Contents.DISCARDED:
        return
    if not ok:
        contents[call.tag] = Contents.UNKNOWN
    elif call.hook is Hook.MEMORY_PAUSE and call.tag in policy.discard_on_release:
        contents[call.tag] = Contents.DISCARDED


def resolve_contents(
    tag: str, residency: Residency, policy: PolicyView, contents: dict[str, Contents]
) -> None:
    """After `recover` learned an unknown tag's residency: a released tag without backup holds nothing."""
    if residency is Residency.RELEASED and tag in policy.discard_on_release:
        contents[tag] = Contents.DISCARDED


def invalid_weights(policy: PolicyView, contents: Mapping[str, Contents]) -> dict[str, Contents]:
    """The weight tags whose contents are not valid (empty: `generate` may read them)."""
    return {
        t: contents[t] for t in policy.weight_tags if contents.get(t, Contents.VALID) is not Contents.VALID
    }

"""The memory budget: per sleep, the cheapest releases that leave the next phase's need free.

    budget = MemoryBudget(margin_bytes=1 << 30)
    plan = plan_releases(BudgetInputs(need_bytes=..., free_bytes=..., margin_bytes=..., items=(...)))

Each releasable item (a memory tag, the process groups' communicators) offers ways with what
they free and what their round trip (release now, restore at the next wake) costs: a tag keep or
release; the communicators keep, or each way the backend offers (destroy, suspend). The plan picks
one way per item: the least total cost that frees `need + margin - free` bytes; nothing when the
need already fits; each item's full way (today's full sleep) when even that cannot free enough.
Ties go to fewer releases, then to the earlier item kept (so equal inputs give one plan).

Ranks agree before acting: `agree` reduces the inputs of every rank (the least free memory, the
largest need, each way's smallest frees and largest cost; a way some rank lacks is dropped), and
every rank plans from the reduced inputs, so a collective teardown is chosen on all ranks or none,
the same way on all. `Estimates` learns the figures
from previous cycles (the hooks' timings, the release audit's bytes), per way of the
communicators; before a measurement an item (a way) is assumed to free nothing, so the first sleep that needs memory is the full sleep, which
measures everything. Pure: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.table import Hook, PolicyView

__all__ = [
    "COMMUNICATORS",
    "BudgetInputs",
    "BudgetPlan",
    "Estimates",
    "MemoryBudget",
    "Releasable",
    "Slot",
    "Way",
    "agree",
    "narrow",
    "plan_releases",
]

GIB = 1 << 30
COMMUNICATORS = "process_groups"  # the item name of the communicators (no memory tag may use it)
KEEP = "keep"
COMMUNICATOR_WAYS = ("destroy", "suspend")
RELEASE = "release"
# Stated defaults before any measurement (docs/measurements.md, H200): a tag's round trip through
# a retained pinned backup moves its bytes down and up at ~45 GB/s each way; the concurrent destroy
# of Megatron's groups and their rebuild take 0.77 s + 0.41 s.
DEFAULT_BANDWIDTH = 45e9
DEFAULT_COMMUNICATORS_S = 1.2


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """Turn the budget on: a sleep releases only what the next phase's declared need requires.

    margin_bytes: kept free beyond the need (allocator rounding, fragmentation, a CUDA context).
    bandwidth: bytes/s each way assumed for a tag's round trip before it was measured.
    communicators_s: round trip assumed for the communicators' release before it was measured.
    communicator_ways: figures for the communicators' ways before they were measured, as
        `(way, frees_bytes, round_trip_s)` ("destroy" or "suspend"), e.g. from an earlier run's
        `lifecycle.budget` events. Without one, a way never run frees nothing, so a backend's
        other way (`ReloadableProcessGroups(ways=...)`) is only chosen once declared here.
    """

    margin_bytes: int = GIB
    bandwidth: float = DEFAULT_BANDWIDTH
    communicators_s: float = DEFAULT_COMMUNICATORS_S
    communicator_ways: tuple[tuple[str, int, float], ...] = ()

    def __post_init__(self) -> None:
        if (
            isinstance(self.margin_bytes, bool)
            or not isinstance(self.margin_bytes, int)
            or self.margin_bytes < 0
        ):
            raise ValueError(f"MemoryBudget.margin_bytes must be an int >= 0, got {self.margin_bytes!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"MemoryBudget.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.communicators_s >= 0:
            raise ValueError(f"MemoryBudget.communicators_s must be >= 0 s, got {self.communicators_s!r}")
        ways = []
        for entry in self.communicator_ways:
            way, frees, seconds = _declared_way(entry)
            ways.append((way, frees, seconds))
        names = [w for w, _, _ in ways]
        if len(set(names)) != len(names):
            raise ValueError(f"MemoryBudget.communicator_ways declares a way twice: {names}")
        object.__setattr__(self, "communicator_ways", tuple(ways))  # lists from a log become tuples

    def declared_way(self, way: str) -> tuple[int, float] | None:
        """(frees_bytes, round_trip_s) declared for a communicators' way, or None."""
        return next(((f, c) for w, f, c in self.communicator_ways if w == way), None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MemoryBudget | None:
        """The budget `LifecyclePolicy.to_dict` wrote (None: no budget)."""
        return None if data is None else cls(**data)


def _declared_way(entry: Any) -> tuple[str, int, float]:
    try:
        way, frees, seconds = entry
    except (TypeError, ValueError):
        raise ValueError(
            f"MemoryBudget.communicator_ways: each entry is (way, frees_bytes, round_trip_s), got {entry!r}"
        ) from None
    if way not in COMMUNICATOR_WAYS:
        raise ValueError(
            f"MemoryBudget.communicator_ways: way {way!r} is not one of {list(COMMUNICATOR_WAYS)}"
        )
    if isinstance(frees, bool) or not isinstance(frees, int) or frees < 0:
        raise ValueError(
            f"MemoryBudget.communicator_ways: {way} frees_bytes must be an int >= 0, got {frees!r}"
        )
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"MemoryBudget.communicator_ways: {way} round_trip_s must be >= 0, got {seconds!r}")
    return str(way), frees, float(seconds)


@dataclass(frozen=True)
class Way:
    """One way of treating an item on sleep: what it frees and what its round trip costs."""

    name: str  # "keep", "release" (a tag), or the communicators' way ("destroy", "suspend")
    frees_bytes: int
    cost_s: float

    @property
    def cost_us(self) -> int:
        # Integer microseconds: sums are exact, so equal plans tie on every rank and in the checker.
        return max(0, round(self.cost_s * 1e6))


@dataclass(frozen=True)
class Releasable:
    """An item a sleep may release; `ways[0]` is keep, `full` the way today's full sleep takes."""

    name: str
    ways: tuple[Way, ...]
    full: str

    @classmethod
    def tag(cls, name: str, frees_bytes: int, cost_s: float) -> Releasable:
        """A memory tag: keep it resident, or release it."""
        return cls(name, (Way(KEEP, 0, 0.0), Way(RELEASE, frees_bytes, cost_s)), RELEASE)

    @classmethod
    def communicators(cls, way: str, frees_bytes: int, cost_s: float, *others: Way) -> Releasable:
        """The process groups: keep them alive, release them the backend's configured `way` (the
        full sleep's), or any of the `others` it also offers ("destroy", "suspend")."""
        names = [way, *(w.name for w in others)]
        if KEEP in names[1:] or len(set(names)) != len(names):
            raise ValueError(
                f"Releasable.communicators: ways {names} repeat a way or offer {KEEP!r} besides the "
                "configured one (keep is always offered)"
            )
        return cls(COMMUNICATORS, (Way(KEEP, 0, 0.0), Way(way, frees_bytes, cost_s), *others), way)

    def way(self, name: str) -> Way:
        return next(w for w in self.ways if w.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "full": self.full, "ways": [dataclasses.asdict(w) for w in self.ways]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Releasable:
        ways = tuple(Way(str(w["name"]), int(w["frees_bytes"]), float(w["cost_s"])) for w in data["ways"])
        return cls(str(data["name"]), ways, str(data["full"]))


@dataclass(frozen=True)
class BudgetInputs:
    """What one plan is made from: the next phase's need, the device's free bytes, the items."""

    need_bytes: int
    free_bytes: int
    margin_bytes: int
    items: tuple[Releasable, ...]

    @property
    def required_bytes(self) -> int:
        """What the releases must free: need + margin beyond what is free already (<= 0: nothing)."""
        return self.need_bytes + self.margin_bytes - self.free_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "need_bytes": self.need_bytes,
            "free_bytes": self.free_bytes,
            "margin_bytes": self.margin_bytes,
            "items": [i.to_dict() for i in self.items],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BudgetInputs:
        return cls(
            int(data["need_bytes"]),
            int(data["free_bytes"]),
            int(data["margin_bytes"]),
            tuple(Releasable.from_dict(i) for i in data["items"]),
        )


@dataclass(frozen=True)
class BudgetPlan:
    """The way chosen per item, and the figures behind the choice."""

    choices: tuple[tuple[str, str], ...]  # (item, way) in item order
    feasible: bool  # False: even the full sleep cannot free the need (then the full sleep runs)
    freed_bytes: int  # what the chosen ways are expected to free
    cost_s: float  # their expected round trip
    short_bytes: int  # infeasible: what the full sleep is expected to leave missing; else 0

    def way(self, item: str) -> str:
        """The way chosen for `item` (an item the plan does not list is released: the full sleep)."""
        return dict(self.choices).get(item, RELEASE)

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(name for name, way in self.choices if way != KEEP)

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(name for name, way in self.choices if way == KEEP)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": dict(self.choices),
            "released": list(self.released),
            "kept": list(self.kept),
            "feasible": self.feasible,
            "freed_bytes": self.freed_bytes,
            "cost_s": round(self.cost_s, 6),
            "short_bytes": self.short_bytes,
        }


def _key(cost_us: int, released: int, choice: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    return (cost_us, released, choice)


def plan_releases(inputs: BudgetInputs) -> BudgetPlan:
    """The least-cost choice of one way per item that frees `inputs.required_bytes` (exact).

    A frontier of partial choices (cost, releases, choice) → bytes freed, each kept only while no
    cheaper one frees as much; bytes are capped at what is required, since more buys nothing.
    """
    items = inputs.items
    names = [i.name for i in items]
    if len(set(names)) != len(names):
        raise ValueError(f"plan_releases: items named more than once in {names}")
    required = inputs.required_bytes
    if required <= 0:
        return BudgetPlan(tuple((n, KEEP) for n in names), True, 0, 0.0, 0)
    # frontier: (key, freed) sorted by key, freed strictly rising
    frontier: list[tuple[tuple[int, int, tuple[int, ...]], int]] = [(_key(0, 0, ()), 0)]
    for item in items:
        grown = [
            (
                _key(k[0] + w.cost_us, k[1] + (w.name != KEEP), (*k[2], j)),
                min(required, freed + max(0, w.frees_bytes)),
            )
            for k, freed in frontier
            for j, w in enumerate(item.ways)
        ]
        grown.sort()
        frontier, best = [], -1
        for key, freed in grown:
            if freed > best:
                frontier.append((key, freed))
                best = freed
    key, freed = frontier[-1]
    if freed < required:
        return _full_plan(inputs)
    winner = next(k for k, f in frontier if f >= required)
    ways = [item.ways[j] for item, j in zip(items, winner[2], strict=True)]
    return BudgetPlan(
        tuple((item.name, w.name) for item, w in zip(items, ways, strict=True)),
        True,
        sum(max(0, w.frees_bytes) for w in ways),
        sum(w.cost_us for w in ways) / 1e6,
        0,
    )


def _full_plan(inputs: BudgetInputs) -> BudgetPlan:
    ways = [item.way(item.full) for item in inputs.items]
    freed = sum(max(0, w.frees_bytes) for w in ways)
    return BudgetPlan(
        tuple((item.name, item.full) for item in inputs.items),
        False,
        freed,
        sum(w.cost_us for w in ways) / 1e6,
        max(0, inputs.required_bytes - freed),
    )


def agree(views: Sequence[BudgetInputs]) -> BudgetInputs:
    """The inputs every rank plans from: least free, largest need and margin, per way least frees
    and largest cost. A way that some rank does not offer (a communicators' way its backend cannot
    take) is offered by none. Ranks must offer the same items, with the same full way (else
    ValueError: they would act apart)."""
    if not views:
        raise ValueError("agree: no ranks' inputs given")
    first = views[0]
    shape = [(i.name, i.full) for i in first.items]
    for rank, view in enumerate(views[1:], start=1):
        other = [(i.name, i.full) for i in view.items]
        if other != shape:
            raise ValueError(
                f"agree: rank 0 offers {shape}, rank {rank} offers {other}; every rank of a group must offer "
                "the same tags and communicators, or their sleeps would release different things"
            )
    items = []
    for i, item in enumerate(first.items):
        offered = [_ways_by_name(v.items[i]) for v in views]
        ways = []
        for key in _ways_by_name(item):
            each = [o[key] for o in offered if key in o]
            if len(each) == len(views):
                ways.append(Way(key[0], min(w.frees_bytes for w in each), max(w.cost_s for w in each)))
        items.append(Releasable(item.name, tuple(ways), item.full))
    return BudgetInputs(
        max(v.need_bytes for v in views),
        min(v.free_bytes for v in views),
        max(v.margin_bytes for v in views),
        tuple(items),
    )


def _ways_by_name(item: Releasable) -> dict[tuple[str, int], Way]:
    """An item's ways by (name, how many of that name came before): a way is matched across ranks
    by its name (a communicators' way configured as keep is named like the keep way before it)."""
    seen: dict[str, int] = {}
    out = {}
    for way in item.ways:
        n = seen[way.name] = seen.get(way.name, -1) + 1
        out[(way.name, n)] = way
    return out


def narrow(
    plan: BudgetPlan, view: PolicyView, targets: Iterable[str], present: frozenset[Hook]
) -> tuple[PolicyView, tuple[str, ...], frozenset[Hook]]:
    """What a sleep's plan calls under the budget: the tags it releases, the groups only when their
    way is not keep, and no cache clearing when nothing is released (nothing would be freed by it)."""
    targets = tuple(t for t in targets if plan.way(t) != KEEP)
    if plan.way(COMMUNICATORS) == KEEP:
        view = dataclasses.replace(view, destroy_process_groups=False)
    if not plan.released:
        present = present - {Hook.CLEAR_MEMORY, Hook.ROUTING_REPLAY_CLEAR}
    return view, targets, present


Slot = tuple[str, str]  # (item, way): what one figure of the estimates is about


class Estimates:
    """What each item's way freed and what its round trip cost on previous cycles (the latest figure).

    Figures are kept per (item, way): a tag's release, and each way of the communicators apart
    (destroy + reload, suspend + resume). Bytes come from the release audit (`memory.released`:
    `observe_freed`) or, for what it does not measure, from the free memory before and after a
    sleep split over what that sleep released (`observe_sleep`); seconds from the hooks' timings
    (`observe_hook`). Before a figure exists a tag frees what its backend declares it holds
    (`declared`, may be None: nothing) and moves at `budget.bandwidth`; each communicators' way
    frees nothing (so a way never measured is never chosen over one measured) and takes
    `budget.communicators_s`.
    """

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.freed: dict[Slot, int] = {}
        self.audited: set[Slot] = set()  # what the release audit measured
        self.release_s: dict[Slot, float] = {}
        self.restore_s: dict[Slot, float] = {}

    def observe_hook(self, hook: Hook, tag: str | None, seconds: float, way: str = "destroy") -> None:
        """One hook call's duration: a pause/destroy is the release half, a resume/reload the restore;
        `way` is what the process groups' destroy did (or what their reload undid)."""
        if hook is Hook.MEMORY_PAUSE and tag is not None:
            self.release_s[(tag, RELEASE)] = seconds
        elif hook is Hook.MEMORY_RESUME and tag is not None:
            self.restore_s[(tag, RELEASE)] = seconds
        elif hook is Hook.PROCESS_GROUPS_DESTROY:
            self.release_s[(COMMUNICATORS, way)] = seconds
        elif hook is Hook.PROCESS_GROUPS_RELOAD:
            self.restore_s[(COMMUNICATORS, way)] = seconds

    def observe_freed(self, item: str, freed_bytes: int) -> None:
        """The release audit measured what releasing tag `item` freed."""
        self.freed[(item, RELEASE)] = max(0, int(freed_bytes))
        self.audited.add((item, RELEASE))

    def observe_sleep(self, released: Sequence[Slot], freed_bytes: int, prior: Mapping[Slot, int]) -> None:
        """A sleep that released `released` (item, way) raised the free memory by `freed_bytes`.
        What the audit did not measure goes first to those with an estimate (`prior`: what the plan
        assumed), the rest evenly to those without one; less than the estimates scales them down."""
        audited = sum(self.freed.get(i, 0) for i in released if i in self.audited)
        rest = [i for i in released if i not in self.audited]
        if not rest:
            return
        left = max(0, int(freed_bytes) - audited)
        known = {i: prior.get(i, 0) for i in rest if prior.get(i, 0) > 0}
        unknown = [i for i in rest if i not in known]
        total = sum(known.values())
        if unknown and left >= total:
            self.freed.update(known)
            for i in unknown:
                self.freed[i] = (left - total) // len(unknown)
        elif total:
            for i, w in known.items():
                self.freed[i] = left * w // total
            for i in unknown:
                self.freed[i] = 0
        else:
            for i in rest:
                self.freed[i] = left // len(rest)

    def cost(self, slot: Slot, frees_bytes: int) -> float:
        if slot in self.release_s and slot in self.restore_s:
            return self.release_s[slot] + self.restore_s[slot]
        if slot[0] == COMMUNICATORS:
            declared = self.budget.declared_way(slot[1])
            return self.budget.communicators_s if declared is None else declared[1]
        return 2 * frees_bytes / self.budget.bandwidth

    def items(
        self,
        tags: Iterable[str],
        declared: Mapping[str, int | None],
        communicators: str | Sequence[str] | None,
    ) -> tuple[Releasable, ...]:
        """The releasable items: the given tags (resident ones), then the communicators' ways (None:
        no groups to release; the first way is the backend's configured one, the full sleep's)."""
        out: list[Releasable] = []
        for tag in tags:
            frees = self.freed.get((tag, RELEASE), declared.get(tag) or 0)
            out.append(Releasable.tag(tag, frees, self.cost((tag, RELEASE), frees)))
        if communicators is not None:
            names = (communicators,) if isinstance(communicators, str) else tuple(communicators)
            ways = []
            for name in names:
                declared_way = self.budget.declared_way(name)
                frees = self.freed.get((COMMUNICATORS, name), 0 if declared_way is None else declared_way[0])
                ways.append(Way(name, frees, self.cost((COMMUNICATORS, name), frees)))
            full = ways[0]
            out.append(Releasable.communicators(full.name, full.frees_bytes, full.cost_s, *ways[1:]))
        return tuple(out)

"""The memory budget inside a machine: plans each sleep, checks the need after it, learns the figures.

The planner is `lifecycle.budget`; this part reads the probe (`Hooks(budget=...)`), agrees the
inputs over the ranks when the probe can, logs `lifecycle.budget` before the sleep's hooks and
`lifecycle.budget_checked` after them, and raises `MemoryBudgetShortError` when the need is not free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lifecycle.budget import (
    COMMUNICATORS,
    KEEP,
    BudgetInputs,
    BudgetPlan,
    Estimates,
    MemoryBudget,
    Slot,
    narrow,
    plan_releases,
)
from lifecycle.errors import MemoryBudgetShortError
from lifecycle.hooks import MemoryProbe
from lifecycle.logs import Event
from lifecycle.table import ALL_TAGS, Groups, Hook, PolicyView, Residency

MIB = 1 << 20
Emit = Callable[[str, str, dict[str, Any]], None]


class BudgetedSleep:
    """One machine's budget: the need declared (`expect`), the running sleep's plan, the estimates."""

    def __init__(self, budget: MemoryBudget, probe: MemoryProbe, emit: Emit) -> None:
        self.budget = budget
        self.probe = probe
        self.estimates = Estimates(budget)
        self.need_bytes: int | None = None
        self._emit = emit
        self._plan: BudgetPlan | None = None
        self._free_before: int | None = None  # this rank's, when the running sleep was planned
        self._prior: dict[Slot, int] = {}  # what the plan assumed each released (item, way) frees

    def expect(self, need_bytes: int | None) -> None:
        if need_bytes is not None and (
            isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0
        ):
            raise ValueError(f"Lifecycle.expect: need_bytes must be an int >= 0 or None, got {need_bytes!r}")
        self.need_bytes = need_bytes

    def narrowed(
        self,
        view: PolicyView,
        targets: tuple[str, ...],
        present: frozenset[Hook],
        residency: Mapping[str, Residency],
        groups: Groups | None,
        communicators: Sequence[str],
    ) -> tuple[PolicyView, tuple[str, ...], frozenset[Hook]]:
        """The sleep's plan inputs under the budget (unchanged where it cannot plan: no need declared,
        free memory unknown on some rank). `communicators`: the ways the process groups offer, the
        configured one first; `communicators_way` then says which one the plan chose."""
        self._plan = self._free_before = None
        local = _free(self.probe)
        resident = [t for t in targets if residency[t] is Residency.RESIDENT]
        way = (
            communicators
            if view.destroy_process_groups
            and groups is Groups.ALIVE
            and Hook.PROCESS_GROUPS_DESTROY in present
            else None
        )
        declared = {t: self._declared(t) for t in resident}
        items = self.estimates.items(resident, declared, way)
        if self.need_bytes is None:
            # No need declared: the full sleep, which still teaches the estimates what each item frees.
            # The rank still takes part in the agreement, as one that cannot plan (free -1), so that
            # ranks which declared a need do not wait for it and sleep fully too.
            self._agree(BudgetInputs(0, -1, 0, items))
            full = BudgetPlan(tuple((i.name, i.full) for i in items), False, 0, 0.0, 0)
            self._remember(BudgetInputs(0, local, 0, items), full, local)
            return view, targets, present
        inputs = BudgetInputs(self.need_bytes, local, self.budget.margin_bytes, items)
        agreed = self._agree(inputs)
        if agreed.free_bytes < 0:  # some rank cannot plan: every rank sleeps fully, none plans
            self._emit(
                "info",
                Event.BUDGET,
                {
                    "need_bytes": self.need_bytes,
                    "reason": "a rank cannot plan (its free memory is unknown, or it declared no need)",
                },
            )
            return view, targets, present
        plan = plan_releases(agreed)
        self._remember(inputs, plan, local)
        self._emit(
            "info",
            Event.BUDGET,
            {
                **agreed.to_dict(),
                "local_free_bytes": local,
                **plan.to_dict(),
                "why": _reasons(agreed, plan),
            },
        )
        return narrow(plan, view, targets, present)

    @property
    def communicators_way(self) -> str | None:
        """The way the running sleep's plan chose for the communicators (None: no plan, or none offered)."""
        if self._plan is None:
            return None
        return dict(self._plan.choices).get(COMMUNICATORS)

    def _remember(self, inputs: BudgetInputs, plan: BudgetPlan, local: int) -> None:
        self._plan, self._free_before = plan, local
        self._prior = {(i.name, plan.way(i.name)): i.way(plan.way(i.name)).frees_bytes for i in inputs.items}

    def check(self, residency: Mapping[str, Residency], groups: Groups | None) -> None:
        """After the sleep's releases: the need is free on every rank, or `MemoryBudgetShortError`."""
        plan, before = self._plan, self._free_before
        self._plan = self._free_before = None
        local = _free(self.probe)
        if plan is not None and before is not None and before >= 0 and local >= 0:
            released = [(name, way) for name, way in plan.choices if way != KEEP]
            self.estimates.observe_sleep(released, local - before, self._prior)
        if self.need_bytes is None:
            self._agree(BudgetInputs(0, -1, 0, ()))  # as in `narrowed`: take part, as one that cannot judge
            return
        agreed = self._agree(BudgetInputs(self.need_bytes, local, 0, ()))
        need, free = agreed.need_bytes, agreed.free_bytes
        if free < 0:  # some rank cannot tell: nothing to judge
            return
        resident = tuple(t for t, r in residency.items() if r is Residency.RESIDENT)
        short = max(0, need - free)
        fields: dict[str, Any] = {
            "need_bytes": need,
            "free_bytes": free,
            "local_free_bytes": local,
            "met": short == 0,
            "short_bytes": short,
            "resident": list(resident),
            "groups": groups,
            "raised": short > 0,
        }
        self._emit("info" if short == 0 else "error", Event.BUDGET_CHECKED, fields)
        if short:
            alive = " and the process groups' communicators" if groups is Groups.ALIVE else ""
            raise MemoryBudgetShortError(
                f"memory budget: after the sleep {free / MIB:.0f} MiB are free, the next phase declared "
                f"{need / MIB:.0f} MiB: {short / MIB:.0f} MiB short; still resident: {list(resident)}{alive}. "
                "Another process took memory, or the need is larger than declared. The machine is FAILED: "
                "recover(State.PAUSED) releases the rest; declare the real need with Lifecycle.expect.",
                short_bytes=short,
                need_bytes=need,
                free_bytes=free,
                resident=resident,
                groups=groups,
            )

    def observe_hook(self, hook: Hook, tag: str | None, seconds: float, way: str) -> None:
        self.estimates.observe_hook(hook, tag, seconds, way)

    def observe_event(self, name: str, fields: Mapping[str, Any]) -> None:
        """The release audit's `memory.released` says what one tag's release freed."""
        if name == Event.MEMORY_RELEASED and isinstance(fields.get("freed_bytes"), int):
            tag = fields.get("tag")
            self.estimates.observe_freed(ALL_TAGS if tag is None else str(tag), fields["freed_bytes"])

    def _agree(self, inputs: BudgetInputs) -> BudgetInputs:
        agree = getattr(self.probe, "agree", None)
        return inputs if agree is None else agree(inputs)

    def _declared(self, tag: str) -> int | None:
        expected = getattr(self.probe, "expected_bytes", None)
        if expected is None:
            return None
        value = expected(None if tag == ALL_TAGS else tag)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _free(probe: MemoryProbe) -> int:
    """The probe's free bytes; -1 where it cannot tell, so the ranks' least free says "unknown" to all
    of them (each rank still takes part in every agreement: a rank skipping one would hang the rest)."""
    free = probe.free_bytes()
    return -1 if free is None else free


def _reasons(inputs: BudgetInputs, plan: BudgetPlan) -> dict[str, str]:
    """Why each item is kept or released, in words, for the sleep's event."""
    required = inputs.required_bytes
    if required <= 0:
        why = f"the need fits: {inputs.free_bytes / MIB:.0f} MiB free >= need + margin"
        return {i.name: why for i in inputs.items}
    if not plan.feasible:
        why = f"full sleep: releasing everything frees less than the {required / MIB:.0f} MiB required"
        return {i.name: why for i in inputs.items}
    out = {}
    for item in inputs.items:
        way = plan.way(item.name)
        if way == KEEP:
            out[item.name] = "kept: the releases chosen free the need at less cost"
        else:
            w = item.way(way)
            what = "communicators" if item.name == COMMUNICATORS else "tag"
            out[item.name] = (
                f"{what} {way}: frees {w.frees_bytes / MIB:.0f} MiB for {w.cost_s:.3f} s round trip"
            )
    return out

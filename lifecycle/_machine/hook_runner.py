"""Running an edge's hook plan: its stages in order, a stage's branches one after another or together,
each call timed; and the `hooks` list the transition and failure events carry."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from lifecycle.hooks import Hooks
from lifecycle.table import (
    ALL_TAGS,
    PLANS,
    Call,
    Groups,
    Hook,
    Plan,
    PolicyView,
    Residency,
    plan_calls,
    plan_stages,
)

Stages = tuple[tuple[tuple[Call, ...], ...], ...]  # stage → branch → calls, in plan order
Outcome = tuple[list["HookRecord"], "BaseException | None"]  # a branch's calls, and the error it stopped at


class HookRecord(NamedTuple):
    """One hook call of a transition: when it started (s after the edge began), how long, whether it returned."""

    call: Call
    at: float
    seconds: float
    ok: bool


class HookRunner:
    """Runs the stages of a machine's hook plans; where `overlap`, a stage's branches run together.

    `bind` gives the zero-argument callable of a call; `bind_tags` the one call of a branch's run
    of memory pauses (or resumes) of named tags, or None where the backend takes one tag a call;
    `threads` are the pool threads running a hook now (a hook calling back into the machine from
    one is refused, not deadlocked).
    """

    def __init__(
        self,
        bind: Callable[[Call], Callable[[], Any]],
        *,
        overlap: bool,
        bind_tags: Callable[[Hook, tuple[str, ...]], Callable[[], Any] | None] | None = None,
    ) -> None:
        self._bind = bind
        self._bind_tags = bind_tags
        self._overlap = overlap
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stages: dict[tuple[Any, ...], Stages] = {}
        self.threads: set[int] = set()

    def stages(
        self,
        plan: Plan,
        view: PolicyView,
        residency: Mapping[str, Residency],
        groups: Groups | None,
        targets: tuple[str, ...],
        present: frozenset[Hook],
    ) -> Stages:
        """The plan's calls for this residency, grouped in stages of branches (cached)."""
        key = (plan, view, present, targets, tuple(residency.values()), groups)
        cached = self._stages.get(key)
        if cached is None:
            calls = plan_calls(plan, view, residency, groups, targets, present)
            cached = self._stages[key] = tuple(
                tuple(tuple(branch) for branch in stage) for stage in plan_stages(plan, calls)
            )
        return cached

    def run(
        self, stages: Stages, p0: float, record: Callable[[HookRecord], None]
    ) -> tuple[list[HookRecord], tuple[Call, BaseException] | None]:
        """Run the stages in order, handing each stage's records to `record` in plan order once the
        stage is over; stop after the first stage in which a call raised, and return it with its error."""
        records: list[HookRecord] = []
        for stage in stages:
            if len(stage) > 1 and self._overlap:
                outcomes = self._run_together(stage, p0)
            else:
                outcomes = []
                for branch in stage:
                    outcomes.append(self._run_branch(branch, p0))
                    if outcomes[-1][1] is not None:
                        break  # run one after another, nothing runs after a failure
            failed: tuple[Call, BaseException] | None = None
            for branch_records, error in outcomes:  # in plan order, whatever finished first
                records += branch_records
                for one in branch_records:
                    record(one)
                if error is not None and failed is None:
                    failed = (branch_records[-1].call, error)
            if failed is not None:
                return records, failed
        return records, None

    def _run_branch(self, branch: tuple[Call, ...], p0: float) -> Outcome:
        """Run one branch's calls in order; stop at the first that raises and return its error.

        A run of consecutive memory pauses (or resumes) of named tags is one call where the backend
        takes tags together (`MemoryBatches`): its first tag's record carries the call, the others
        follow it (a failed call stops at its first tag, as one call per tag would)."""
        records: list[HookRecord] = []
        index = 0
        while index < len(branch):
            run = branch[index : index + _batch_length(branch, index)]
            batch = None
            if len(run) > 1 and self._bind_tags is not None:
                batch = self._bind_tags(run[0].hook, tuple(str(call.tag) for call in run))
            fn = self._bind(run[0]) if batch is None else batch
            if batch is None:
                run = run[:1]
            start = time.perf_counter()
            try:
                fn()
            except BaseException as exc:
                records.append(HookRecord(run[0], start - p0, time.perf_counter() - start, False))
                return records, exc
            seconds = time.perf_counter() - start
            records.append(HookRecord(run[0], start - p0, seconds, True))
            records += [HookRecord(call, start + seconds - p0, 0.0, True) for call in run[1:]]
            index += len(run)
        return records, None

    def _run_together(self, stage: tuple[tuple[Call, ...], ...], p0: float) -> list[Outcome]:
        """Run a stage's branches at once: the first on this thread, the others on the hook pool.

        Every branch finishes (or fails) before this returns, so a failure never leaves a hook running.
        """
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(len(s) for p in PLANS for s in p.stages) - 1,
                thread_name_prefix="lifecycle-hooks",
            )
        futures = [self._pool.submit(self._run_pooled, branch, p0) for branch in stage[1:]]
        first = self._run_branch(stage[0], p0)
        return [first, *(future.result() for future in futures)]

    def _run_pooled(self, branch: tuple[Call, ...], p0: float) -> Outcome:
        me = threading.get_ident()
        self.threads.add(me)  # a hook calling back into the machine is refused, not deadlocked
        try:
            return self._run_branch(branch, p0)
        finally:
            self.threads.discard(me)


_BATCHED = (Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME)


def _batch_length(branch: tuple[Call, ...], index: int) -> int:
    """How many calls from `index` on are memory pauses (or resumes) of named tags, as `index`'s."""
    first = branch[index]
    if first.hook not in _BATCHED or first.tag in (None, ALL_TAGS):
        return 1
    end = index + 1
    while end < len(branch) and branch[end].hook is first.hook and branch[end].tag not in (None, ALL_TAGS):
        end += 1
    return end - index


def bind_tags(hook: Hook, tags: tuple[str, ...], hooks: Hooks) -> Callable[[], Any] | None:
    """The one call pausing (or resuming) `tags` together, where the memory backend offers it."""
    name = "pause_tags" if hook is Hook.MEMORY_PAUSE else "resume_tags"
    method = getattr(hooks.memory, name, None)
    return None if method is None else functools.partial(method, tags)


def bind_hook(call: Call, hooks: Hooks, model_tag: str | None) -> Callable[[], Any]:
    """The zero-argument callable for one hook call of these backends."""
    hook = call.hook
    tag = None if call.tag == ALL_TAGS else call.tag
    fn: Callable[[], Any]
    if hook is Hook.MEMORY_PAUSE:
        fn = functools.partial(hooks.memory.pause, tag=tag)
    elif hook is Hook.MEMORY_RESUME:
        fn = functools.partial(hooks.memory.resume, tag=tag)
    elif hook is Hook.PROCESS_GROUPS_DESTROY:
        assert hooks.process_groups is not None
        fn = hooks.process_groups.destroy
    elif hook is Hook.PROCESS_GROUPS_RELOAD:
        assert hooks.process_groups is not None
        fn = hooks.process_groups.reload
    elif hook is Hook.CLEAR_MEMORY:
        assert hooks.clear_memory is not None
        fn = hooks.clear_memory
    elif hook is Hook.ROUTING_REPLAY_CLEAR:
        assert hooks.routing_replay is not None
        fn = hooks.routing_replay
    elif hook is Hook.SWITCH_MODEL:
        assert hooks.switch_model is not None and model_tag is not None
        fn = functools.partial(hooks.switch_model, model_tag)
    elif hook is Hook.GENERATION_PAUSE:
        assert hooks.generation is not None
        fn = hooks.generation.pause
    elif hook is Hook.GENERATION_RESUME:
        assert hooks.generation is not None
        fn = hooks.generation.resume
    else:  # pragma: no cover - the enum is closed
        raise AssertionError(f"unhandled hook {hook}")
    return fn


def hook_dicts(records: list[HookRecord]) -> list[dict[str, Any]]:
    """The records as the transition and failure events log them."""
    out = []
    for call, at, seconds, ok in records:
        entry: dict[str, Any] = {
            "name": call.hook.value,
            "ms": round(seconds * 1e3, 4),
            "at_ms": round(at * 1e3, 4),
            "ok": ok,
        }
        if call.tag is not None:
            entry["tag"] = call.tag
        out.append(entry)
    return out

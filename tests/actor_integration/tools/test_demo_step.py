"""The demo's step driver: a fault armed in a trainer hook the memory budget skips gets a full sleep."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from actor_integration.tools.demo.step import StepDriver


class Group:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def call(self, name: str, *args: Any) -> dict[int, Any]:
        self.calls.append((name, args))
        return {}


def driver(faults: list[tuple[str, str, int]]) -> tuple[StepDriver, Group]:
    trainers = Group()
    placed = SimpleNamespace(vocab=32, engine="reference", trainer_group=trainers, rollout_group=Group())
    args = argparse.Namespace(seed=0, inject_fault=faults, skip_sync=[], corrupt_sync=[])
    log = SimpleNamespace(note=lambda text: None)
    made = StepDriver(placed=placed, args=args, log=log)  # type: ignore[arg-type]
    made._need = 5 << 20  # what prepare() learned from the rollout
    return made, trainers


def needs(faults: list[tuple[str, str, int]], steps: int = 6) -> dict[int, Any]:
    made, trainers = driver(faults)
    declared = {}
    for step in range(1, steps + 1):
        trainers.calls.clear()
        made.declare_need(step)
        for name, args in trainers.calls:
            if name == "lifecycle_expect":
                declared[step] = args[0]
    return declared


def test_a_pause_fault_gets_a_full_sleep_at_its_step_and_the_need_back_after():
    assert needs([("trainer", "memory.pause", 3)]) == {3: None, 4: 5 << 20}


def test_a_wake_fault_gets_a_full_sleep_the_step_before_so_its_wake_restores_something():
    assert needs([("trainer", "memory.resume", 3)]) == {2: None, 4: 5 << 20}
    assert needs([("trainer", "process_groups.reload", 5)], steps=5) == {4: None}


def test_rollout_faults_and_hooks_the_budget_runs_anyway_leave_the_need_alone():
    assert needs([("rollout", "memory.pause", 2), ("trainer", "switch_model", 3)]) == {}


def test_without_a_budget_nothing_is_declared():
    made, trainers = driver([("trainer", "memory.pause", 2)])
    made._need = None
    for step in range(1, 4):
        made.declare_need(step)
    assert trainers.calls == []

"""What a sleep does to the communicators (destroy, suspend, keep): table, machine, checker, timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lifecycle import (
    Communicators,
    Groups,
    Hooks,
    Lifecycle,
    LifecyclePolicy,
    State,
    capture_events,
)
from lifecycle.checker import check_files
from lifecycle.table import ASLEEP, WAKE, Call, Hook, Residency, apply_call, plan_calls
from lifecycle.testing import FakeMemorySaver, FakeProcessGroups, InjectedFault, recording_lifecycle
from lifecycle.timeline import build_trace, read_lanes
from tests.helpers.checker_corpus import json_log

WAYS = list(Communicators)
POLICY = LifecyclePolicy()


def cycle_log(path: Path, way: Communicators, initial: State = State.AWAKE) -> Path:
    """A trainer that sleeps, syncs from PAUSED, wakes, trains and sleeps again with offload."""
    with json_log(path):
        lc, _ = recording_lifecycle(POLICY, communicators=way, initial=initial, rank=0, role="actor")
        if initial is State.AWAKE:
            lc.sleep()
        lc.run("sync", lambda: None)
        lc.wake_up()
        lc.run("train", lambda: None)
        lc.sleep()
    return path


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def dump(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class TestTable:
    @pytest.mark.parametrize("way", WAYS)
    def test_a_destroy_leaves_the_state_the_backend_declares(self, way: Communicators) -> None:
        destroy = Call(Hook.PROCESS_GROUPS_DESTROY)
        assert apply_call(destroy, {}, Groups.ALIVE, way) is ASLEEP[way]
        assert apply_call(destroy, {}, Groups.ALIVE) is Groups.DESTROYED  # no declaration: destroy

    @pytest.mark.parametrize("asleep", [Groups.DESTROYED, Groups.SUSPENDED, Groups.KEPT])
    def test_a_wake_reloads_the_groups_from_every_way_of_sleeping(self, asleep: Groups) -> None:
        present = frozenset({Hook.PROCESS_GROUPS_DESTROY, Hook.PROCESS_GROUPS_RELOAD})
        memory = {"*": Residency.RELEASED}
        calls = plan_calls(WAKE, POLICY.view(), memory, asleep, ("*",), present)
        assert Call(Hook.PROCESS_GROUPS_RELOAD) in calls
        awake = plan_calls(WAKE, POLICY.view(), memory, Groups.ALIVE, ("*",), present)
        assert Call(Hook.PROCESS_GROUPS_RELOAD) not in awake


class TestMachine:
    @pytest.mark.parametrize("way", WAYS)
    def test_sleep_and_wake_move_the_groups_through_the_declared_state(self, way: Communicators) -> None:
        lc, rec = recording_lifecycle(POLICY, communicators=way)
        lc.sleep()
        assert lc.groups is ASLEEP[way] and rec.process_groups.state == ASLEEP[way].value
        assert lc.snapshot()["groups"] == ASLEEP[way].value
        lc.wake_up()
        assert lc.groups is Groups.ALIVE and rec.process_groups.state == "alive"
        groups_calls = [name for name in rec.log.names() if name.startswith("process_groups")]
        assert groups_calls == ["process_groups.destroy", "process_groups.reload"]

    def test_a_backend_without_a_declaration_destroys(self) -> None:
        class Plain:
            def destroy(self) -> None: ...

            def reload(self) -> None: ...

        lc = Lifecycle(POLICY, Hooks(memory=FakeMemorySaver(), process_groups=Plain()))
        lc.sleep()
        assert lc.groups is Groups.DESTROYED

    def test_an_unknown_declaration_is_refused_when_the_hooks_are_built(self) -> None:
        groups = FakeProcessGroups()
        groups.communicators = "pause"
        with pytest.raises(TypeError, match=r"declares communicators='pause'.*'destroy', 'suspend', 'keep'"):
            Hooks(memory=FakeMemorySaver(), process_groups=groups)

    @pytest.mark.parametrize("way", WAYS)
    def test_an_actor_built_asleep_starts_in_the_declared_state(self, way: Communicators) -> None:
        lc, rec = recording_lifecycle(POLICY, communicators=way, initial=State.PAUSED)
        assert lc.groups is ASLEEP[way]
        lc.wake_up()
        assert lc.groups is Groups.ALIVE and rec.process_groups.reload_count == 1

    def test_the_configured_event_says_the_way_and_what_kept_communicators_hold(self) -> None:
        with capture_events("info") as events:
            Lifecycle(
                POLICY,
                Hooks(
                    memory=FakeMemorySaver(),
                    process_groups=FakeProcessGroups(communicators="keep", held_bytes=6 << 30),
                ),
            )
            Lifecycle(POLICY, Hooks(memory=FakeMemorySaver(), process_groups=FakeProcessGroups()))
            Lifecycle(POLICY, Hooks(memory=FakeMemorySaver()))
        keep, destroy, none = [e for e in events if e["event"] == "lifecycle.configured"]
        assert keep["communicators"] == "keep" and keep["communicators_held_bytes"] == 6 << 30
        assert destroy["communicators"] == "destroy" and "communicators_held_bytes" not in destroy
        assert "communicators" not in none

    @pytest.mark.parametrize("way", WAYS)
    def test_recover_resolves_unknown_groups_to_the_declared_state(self, way: Communicators) -> None:
        lc, rec = recording_lifecycle(POLICY, communicators=way)
        rec.faults.arm(Hook.PROCESS_GROUPS_DESTROY, after_effect=True)
        with pytest.raises(InjectedFault):
            lc.sleep()
        assert lc.groups is Groups.UNKNOWN
        lc.recover(State.PAUSED)
        assert lc.groups is ASLEEP[way]

    def test_a_collective_on_sleeping_fake_groups_says_how_they_sleep(self) -> None:
        lc, rec = recording_lifecycle(POLICY, communicators="suspend")
        lc.sleep()
        with pytest.raises(AssertionError, match="collective on suspended process groups"):
            rec.process_groups.use()


class TestChecker:
    @pytest.mark.parametrize("initial", [State.AWAKE, State.PAUSED])
    @pytest.mark.parametrize("way", WAYS)
    def test_logs_of_each_way_replay_clean(self, tmp_path: Path, way: Communicators, initial: State) -> None:
        path = cycle_log(tmp_path / f"{way.value}.jsonl", way, initial)
        assert check_files([path]) == []

    def test_a_transition_that_logs_the_wrong_sleeping_state_is_reported(self, tmp_path: Path) -> None:
        lines = load(cycle_log(tmp_path / "suspend.jsonl", Communicators.SUSPEND))
        index = next(i for i, d in enumerate(lines) if d.get("groups") == "suspended" and "src" in d)
        lines[index]["groups"] = "destroyed"
        (finding,) = check_files([dump(tmp_path / "edited.jsonl", lines)])
        assert finding.line == index + 1
        assert "logged process groups destroyed, replay says suspended" in finding.message

    def test_logs_written_before_the_ways_replay_as_destroy(self, tmp_path: Path) -> None:
        lines = load(cycle_log(tmp_path / "destroy.jsonl", Communicators.DESTROY))
        for d in lines:
            d.pop("communicators", None)
        assert check_files([dump(tmp_path / "old.jsonl", lines)]) == []

    def test_a_configured_sleeping_state_that_is_not_the_declared_way_is_reported(
        self, tmp_path: Path
    ) -> None:
        lines = load(cycle_log(tmp_path / "suspend.jsonl", Communicators.SUSPEND, State.PAUSED))
        lines[0]["groups"] = "kept"
        findings = check_files([dump(tmp_path / "edited.jsonl", lines)])
        assert any(
            f.line == 1 and "declares communicators=suspend, whose sleep leaves them suspended" in f.message
            for f in findings
        ), findings


class TestTimeline:
    @pytest.mark.parametrize("way", WAYS)
    def test_groups_going_to_sleep_are_marked_with_their_way(
        self, tmp_path: Path, way: Communicators
    ) -> None:
        (lane,) = read_lanes([cycle_log(tmp_path / f"{way.value}.jsonl", way)])
        kinds = [m.kind for m in lane.marks if m.kind.startswith("groups_")]
        # sleep, the sync's groups down, the offload sleep after train: each time the way of that sleep
        assert kinds == [f"groups_{ASLEEP[way].value}"] * 3
        names = {e["name"] for e in build_trace([lane])["traceEvents"] if e.get("ph") == "i"}
        assert f"groups {ASLEEP[way].value}" in names

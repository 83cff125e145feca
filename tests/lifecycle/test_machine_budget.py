"""A machine under a memory budget: each sleep releases only what the next phase's need requires."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from lifecycle import Hooks, Lifecycle, LifecyclePolicy, MemoryBudget, MemoryBudgetShortError, State
from lifecycle.budget import COMMUNICATORS
from lifecycle.checker import check_lines
from lifecycle.events import capture_events
from lifecycle.table import Groups, Residency
from lifecycle.testing import (
    CallLog,
    FakeAgreement,
    FakeDevice,
    FakeMemorySaver,
    FakeProcessGroups,
    RecordingHook,
)

GIB = 1 << 30
TAGS = ("weights", "optimizer")
SIZES = {"weights": 2 * GIB, "optimizer": 6 * GIB}


def trainer(
    total: int = 20 * GIB,
    groups_bytes: int = 4 * GIB,
    margin: int = 0,
    agreement: FakeAgreement | None = None,
    rank: int | None = None,
) -> tuple[Lifecycle, FakeDevice, CallLog]:
    log = CallLog()
    memory = FakeMemorySaver(TAGS, log=log)
    groups = FakeProcessGroups(log=log)
    device = FakeDevice(total, memory, SIZES, groups=groups, groups_bytes=groups_bytes, agreement=agreement)
    policy = LifecyclePolicy(
        memory_tags=TAGS, model_tag=None, memory_budget=MemoryBudget(margin_bytes=margin)
    )
    hooks = Hooks(
        memory=memory,
        process_groups=groups,
        clear_memory=RecordingHook("clear_memory", log=log),
        budget=device,
    )
    return Lifecycle(policy, hooks, rank=rank, role="trainer"), device, log


def findings(events: list[dict[str, Any]]) -> list[str]:
    return [str(f) for f in check_lines([json.dumps(e) for e in events], "trainer.jsonl")]


def budget_event(events: list[dict[str, Any]], nth: int = -1) -> dict[str, Any]:
    return [e for e in events if e["event"] == "lifecycle.budget"][nth]


class TestBudgetedSleep:
    def test_a_need_that_fits_releases_nothing(self) -> None:
        """8 GiB free, 5 GiB needed: the sleep pauses no tag, keeps the groups and clears nothing."""
        with capture_events() as events:
            lc, _device, log = trainer()
            lc.expect(5 * GIB)
            lc.sleep()
            lc.wake_up()
        assert log.names() == []
        assert lc.state is State.AWAKE
        event = budget_event(events)
        assert event["released"] == [] and set(event["kept"]) == {*TAGS, COMMUNICATORS}
        assert "the need fits" in event["why"]["weights"]
        assert findings(events) == []

    def test_a_partial_need_releases_only_the_planned_tag(self) -> None:
        """Needing 11 GiB with 8 GiB free releases the 6 GiB optimizer alone."""
        with capture_events() as events:
            lc, _device, log = trainer()
            lc.expect(11 * GIB)
            lc.sleep()
        assert log.names() == ["clear_memory", "memory.pause[optimizer]"]
        assert "memory.pause[weights]" not in log.names() and "process_groups.destroy" not in log.names()
        assert lc.residency == {"weights": Residency.RESIDENT, "optimizer": Residency.RELEASED}
        assert lc.groups is Groups.ALIVE
        checked = [e for e in events if e["event"] == "lifecycle.budget_checked"]
        assert checked[0]["met"] and checked[0]["free_bytes"] == 14 * GIB
        with capture_events() as more:
            lc.wake_up()
        assert log.names()[-1] == "memory.resume[optimizer]"
        assert findings(events + more) == []

    def test_without_a_need_the_sleep_releases_everything(self) -> None:
        """No need declared: today's full sleep."""
        lc, _device, log = trainer()
        lc.sleep()
        assert {"memory.pause[weights]", "memory.pause[optimizer]", "process_groups.destroy"} <= set(
            log.names()
        )

    def test_the_first_sleep_needing_the_groups_is_full_and_measures_them(self) -> None:
        """Unmeasured communicators count as freeing nothing, so a need beyond the tags is the full
        sleep; it measures them, and the next such need releases only what it must."""
        with capture_events() as events:
            lc, _device, log = trainer(total=20 * GIB, groups_bytes=4 * GIB)
            lc.expect(17 * GIB)  # free 8, tags 8 more: 9 needs the groups (4 GiB), the weights may stay
            lc.sleep()
            first = budget_event(events)
            assert not first["feasible"] and first["released"] == [*TAGS, COMMUNICATORS]
            lc.wake_up()
            log.clear()
            lc.sleep()
        second = budget_event(events)
        assert second["feasible"] and second["released"] == ["optimizer", COMMUNICATORS]
        assert "memory.pause[weights]" not in log.names()
        assert findings(events) == []

    def test_a_full_sleep_before_any_need_teaches_the_estimates(self) -> None:
        """The init's sleep (no need yet) measures the groups: the first planned sleep is not full."""
        lc, _device, log = trainer(total=20 * GIB, groups_bytes=4 * GIB)
        lc.sleep()
        lc.wake_up()
        lc.expect(17 * GIB)
        log.clear()
        with capture_events() as events:
            lc.sleep()
        plan = budget_event(events)
        assert plan["feasible"] and plan["released"] == ["optimizer", COMMUNICATORS]
        assert "memory.pause[weights]" not in log.names()

    def test_a_sync_after_a_sleep_that_kept_the_groups_leaves_them_alive(self) -> None:
        """The colocated sync from PAUSED brings the groups up and down again; when the budget kept
        them, it neither reloads nor destroys them (else the kept communicators go at every sync)."""
        with capture_events() as events:
            lc, _device, log = trainer()
            lc.expect(11 * GIB)  # the optimizer alone: the groups stay
            lc.sleep()
            log.clear()
            lc.run("sync", lambda: None)
            assert log.names() == ["memory.disable"] and lc.groups is Groups.ALIVE
            lc.expect(None)  # the full sleep: the sync reloads the groups and destroys them after
            lc.wake_up()
            lc.sleep()
            log.clear()
            lc.run("sync", lambda: None)
        assert log.names() == ["process_groups.reload", "memory.disable", "process_groups.destroy"]
        assert findings(events) == []

    def test_a_sync_does_not_teach_the_communicators_cost(self) -> None:
        """A sync's groups down destroys groups no collective ran on (cheap); the estimate of the
        communicators' round trip stays the one the sleep and wake measured."""
        lc, _device, _log = trainer()
        lc.sleep()  # the full sleep: destroys the groups, measured
        budget = lc._budget
        assert budget is not None
        destroyed = budget.estimates.release_s[(COMMUNICATORS, "destroy")]
        lc.run("sync", lambda: None)  # groups up, down again
        assert budget.estimates.release_s[(COMMUNICATORS, "destroy")] == destroyed
        lc.wake_up()
        assert (COMMUNICATORS, "destroy") in budget.estimates.restore_s


def two_way_trainer() -> tuple[Lifecycle, FakeProcessGroups, CallLog]:
    """A trainer whose groups can be destroyed (configured: 8 GiB freed) or suspended (6 GiB freed, 2
    stay), on a 20 GiB device: 4 GiB free while awake. The first sleep (no need: full) measures the
    tags and destroy; the communicators' figures are then set: destroy 1.2 s, suspend 6 GiB 0.5 s."""
    log = CallLog()
    memory = FakeMemorySaver(TAGS, log=log)
    groups = FakeProcessGroups(log=log, ways=("suspend",))
    device = FakeDevice(20 * GIB, memory, SIZES, groups=groups, groups_bytes=8 * GIB, suspended_bytes=2 * GIB)
    policy = LifecyclePolicy(memory_tags=TAGS, model_tag=None, memory_budget=MemoryBudget(margin_bytes=0))
    hooks = Hooks(memory=memory, process_groups=groups, budget=device)
    lc = Lifecycle(policy, hooks, role="trainer")
    lc.sleep()
    lc.wake_up()
    assert lc._budget is not None
    est = lc._budget.estimates
    destroy, suspend = (COMMUNICATORS, "destroy"), (COMMUNICATORS, "suspend")
    assert est.freed[destroy] == 8 * GIB and suspend not in est.freed  # suspend never ran: unmeasured
    est.release_s[destroy], est.restore_s[destroy] = 0.7, 0.5
    est.freed[suspend], est.release_s[suspend], est.restore_s[suspend] = 6 * GIB, 0.2, 0.3
    log.clear()
    return lc, groups, log


class TestCommunicatorsWays:
    def test_a_sleep_that_chose_suspend_suspends_and_its_wake_resumes(self) -> None:
        """Needing 13 GiB more: both tags (8) and the suspend (6) do, cheaper than the destroy; the
        backend is told the way, the groups sleep suspended, the wake undoes the suspend; then a need
        of 15 GiB more is only met by destroying."""
        with capture_events() as events:
            lc, groups, log = two_way_trainer()
            lc.expect(17 * GIB)
            lc.sleep()
            assert budget_event(events)["plan"][COMMUNICATORS] == "suspend"
            names = log.names()
            assert names.index("process_groups.use_suspend") < names.index("process_groups.destroy")
            assert lc.groups is Groups.SUSPENDED and groups.state == "suspended"
            lc.wake_up()
            assert lc.groups is Groups.ALIVE and groups.alive and groups.way == "suspend"
            lc.expect(19 * GIB)
            lc.sleep()
            assert budget_event(events)["plan"][COMMUNICATORS] == "destroy"
            assert "process_groups.use_destroy" in log.names()
            assert lc.groups is Groups.DESTROYED and groups.state == "destroyed"
            lc.wake_up()
        assert findings(events) == []

    def test_the_checker_replays_the_way_the_plan_chose(self) -> None:
        """A logged plan whose way its inputs do not give is a finding, and so is a suspended sleep
        logged as destroyed."""
        with capture_events() as events:
            lc, _groups, _log = two_way_trainer()
            lc.expect(17 * GIB)
            lc.sleep()
        tampered = [dict(e) for e in events]
        budget_event(tampered)["plan"] = {**budget_event(tampered)["plan"], COMMUNICATORS: "destroy"}
        assert any("is not the plan its inputs give" in f for f in findings(tampered))
        last = [e for e in events if e["event"] == "lifecycle.transition"][-1]
        assert last["groups"] == "suspended"
        last["groups"] = "destroyed"
        assert findings(events) != []

    def test_a_backend_of_one_way_is_told_nothing_and_logs_one_way(self) -> None:
        """Without other ways the items and the hook calls are today's: keep or the configured way."""
        with capture_events() as events:
            lc, _device, log = trainer(total=20 * GIB, groups_bytes=4 * GIB)
            lc.sleep()
            lc.wake_up()
            lc.expect(17 * GIB)
            lc.sleep()
        (groups,) = [i for i in budget_event(events)["items"] if i["name"] == COMMUNICATORS]
        assert [w["name"] for w in groups["ways"]] == ["keep", "destroy"] and groups["full"] == "destroy"
        assert not any("use_" in name for name in log.names())
        assert "communicators_ways" not in events[0]
        assert findings(events) == []

    def test_ways_without_a_way_to_take_them_are_refused(self) -> None:
        class Declares(FakeProcessGroups):
            communicators_ways = ("destroy", "suspend")
            use_communicators = None  # type: ignore[assignment]

        with pytest.raises(TypeError, match="use_communicators"):
            Hooks(memory=FakeMemorySaver(), process_groups=Declares())


class TestShortfall:
    def test_memory_taken_meanwhile_is_a_typed_error_before_the_wake(self) -> None:
        """Another process takes 4 GiB after the plan: the check names the bytes short and the
        resident tags; the machine is FAILED, and recover releases the rest."""
        with capture_events() as events:
            lc, device, _log = trainer()
            lc.expect(11 * GIB)
            real_pause = device.memory.pause

            def pause_then_taken(tag: str | None = None) -> None:
                real_pause(tag)
                device.taken_bytes = 4 * GIB

            device.memory.pause = pause_then_taken  # type: ignore[method-assign]
            with pytest.raises(MemoryBudgetShortError) as raised:
                lc.sleep()
            assert lc.state is State.FAILED
            assert raised.value.short_bytes == 1 * GIB and raised.value.resident == ("weights",)
            assert "1024 MiB short" in str(raised.value) and "weights" in str(raised.value)
            device.memory.pause = real_pause  # type: ignore[method-assign]
            lc.recover(State.PAUSED)
        assert lc.state is State.PAUSED
        assert lc.residency == {"weights": Residency.RELEASED, "optimizer": Residency.RELEASED}
        assert lc.groups is Groups.DESTROYED
        assert findings(events) == []

    def test_a_need_beyond_the_device_fails_after_the_full_sleep(self) -> None:
        """Needing more than the card holds: the full sleep runs, then the typed error."""
        lc, _device, log = trainer(total=20 * GIB)
        lc.expect(30 * GIB)
        with pytest.raises(MemoryBudgetShortError, match="10240 MiB short"):
            lc.sleep()
        assert {"memory.pause[weights]", "memory.pause[optimizer]", "process_groups.destroy"} <= set(
            log.names()
        )


class TestRanks:
    def test_ranks_disagreeing_about_free_memory_release_the_same(self) -> None:
        """Rank 1 has 3 GiB less free (another process): both ranks release the weights and destroy
        nothing, as rank 1 alone would decide; rank 0 alone would keep everything."""
        agreement = FakeAgreement(2)
        machines = [trainer(agreement=agreement, rank=r) for r in (0, 1)]
        machines[1][1].taken_bytes = 3 * GIB
        for lc, _, _ in machines:
            lc.expect(7 * GIB)  # rank 0: 8 GiB free, fits; rank 1: 5 GiB free, short
        errors: list[BaseException] = []

        def sleep(lc: Lifecycle) -> None:
            try:
                lc.sleep()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=sleep, args=(lc,)) for lc, _, _ in machines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == []
        assert [lc.residency["weights"] for lc, _, _ in machines] == [Residency.RELEASED] * 2
        assert [lc.residency["optimizer"] for lc, _, _ in machines] == [Residency.RESIDENT] * 2
        assert [lc.groups for lc, _, _ in machines] == [Groups.ALIVE] * 2

    def test_a_rank_without_a_declared_need_does_not_stall_the_others(self) -> None:
        """Rank 1 declared no need: it still takes part in both agreements, as a rank that cannot
        plan, so rank 0 does not wait for it; both sleep fully, as neither can plan for the group."""
        agreement = FakeAgreement(2, timeout=3.0)
        machines = [trainer(agreement=agreement, rank=r) for r in (0, 1)]
        machines[0][0].expect(1 * GIB)
        errors: list[BaseException] = []

        def sleep(lc: Lifecycle) -> None:
            try:
                lc.sleep()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        with capture_events() as events:
            threads = [threading.Thread(target=sleep, args=(lc,)) for lc, _, _ in machines]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        assert errors == []
        for lc, _, _ in machines:
            assert lc.state is State.PAUSED
            assert set(lc.residency.values()) == {Residency.RELEASED}
        (planned,) = [e for e in events if e["event"] == "lifecycle.budget" and e.get("rank") == 0]
        assert "cannot plan" in planned["reason"]


class TestConfiguration:
    def test_the_budget_round_trips_through_the_logged_policy(self) -> None:
        """to_dict / from_dict keep the budget (the checker replays from it)."""
        policy = LifecyclePolicy(memory_tags=TAGS, memory_budget=MemoryBudget(margin_bytes=GIB))
        assert LifecyclePolicy.from_dict(policy.to_dict()) == policy

    def test_a_budget_needs_its_probe(self) -> None:
        """A policy budget without Hooks(budget=...) is refused at construction, and vice versa."""
        memory = FakeMemorySaver(TAGS)
        with pytest.raises(ValueError, match="no budget probe"):
            Lifecycle(LifecyclePolicy(memory_tags=TAGS, memory_budget=MemoryBudget()), Hooks(memory=memory))
        with pytest.raises(ValueError, match="no memory_budget"):
            Lifecycle(
                LifecyclePolicy(memory_tags=TAGS), Hooks(memory=memory, budget=FakeDevice(GIB, memory, {}))
            )


class TestChecker:
    def run_partial(self) -> list[dict[str, Any]]:
        with capture_events() as events:
            lc, _device, _log = trainer()
            lc.expect(11 * GIB)
            lc.sleep()
        return list(events)

    def test_a_plan_the_inputs_do_not_give_is_a_finding(self) -> None:
        """A budget event whose plan differs from what its logged inputs give is reported."""
        events = self.run_partial()
        budget_event(events)["plan"]["weights"] = "release"
        assert any("is not the plan its inputs give" in f for f in findings(events))

    def test_the_sleep_must_release_what_the_plan_says(self) -> None:
        """Replayed with the plan, a sleep that paused a kept tag has the wrong hooks."""
        events = self.run_partial()
        budget_event(events)["plan"]["optimizer"] = "keep"
        budget_event(events)["plan"]["weights"] = "release"
        assert findings(events) != []

    def test_a_short_check_that_did_not_raise_is_a_finding(self) -> None:
        """The need not free after the sleep, and nothing raised: the other phase would OOM."""
        events = self.run_partial()
        checked = next(e for e in events if e["event"] == "lifecycle.budget_checked")
        checked["free_bytes"] = checked["need_bytes"] - GIB
        assert any("1024 MiB short), and nothing raised" in f for f in findings(events))

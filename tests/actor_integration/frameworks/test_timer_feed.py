"""`TimerFeed`: the lifecycle's transitions into a framework's own timer (slime's `Timer().add`)."""

from __future__ import annotations

from typing import Any

import pytest

from actor_integration.frameworks.timer_feed import TimerFeed
from lifecycle import LifecyclePolicy, State
from lifecycle.testing import recording_lifecycle


class RecordingTimer:
    """slime's `Timer` as `log_perf_data` reads it: names to summed seconds."""

    def __init__(self) -> None:
        self.timers: dict[str, float] = {}

    def add(self, name: str, elapsed_time: float) -> None:
        self.timers[name] = self.timers.get(name, 0.0) + elapsed_time


@pytest.fixture
def fed() -> tuple[Any, RecordingTimer, list[str]]:
    lc, _ = recording_lifecycle(LifecyclePolicy(offload_train=True), initial=State.PAUSED)
    timer, printed = RecordingTimer(), []
    lc.observe(TimerFeed(lambda: timer, after_plan=printed.append))
    return lc, timer, printed


class TestTimerFeed:
    def test_the_wake_and_sleep_inside_train_reach_slimes_timers(self, fed: Any) -> None:
        """slime's train calls its timed wake_up and sleep; under the lifecycle they are the train
        operation's enter and exit plans, which its decorators never see."""
        lc, timer, printed = fed
        lc.run("train", lambda: None)
        assert {"sleep", "wake_up", "lifecycle_sleep", "lifecycle_wake"} <= set(timer.timers)
        assert timer.timers["sleep"] == timer.timers["lifecycle_sleep"]
        assert (
            "lifecycle_sleep_memory_pause" in timer.timers and "lifecycle_wake_memory_resume" in timer.timers
        )
        assert "save_model" not in timer.timers  # train has no slime timer of its own
        assert printed == ["wake", "sleep"]

    def test_a_saves_wake_and_sleep_count_in_save_model_as_slimes_decorator_does(self, fed: Any) -> None:
        lc, timer, _ = fed
        lc.run("save", lambda: None)
        assert timer.timers["save_model"] == pytest.approx(timer.timers["wake_up"] + timer.timers["sleep"])

    def test_a_syncs_groups_count_in_update_weights(self, fed: Any) -> None:
        lc, timer, _ = fed
        lc.run("sync", lambda: None)
        assert timer.timers["update_weights"] == pytest.approx(
            timer.timers["lifecycle_groups_up"] + timer.timers["lifecycle_groups_down"]
        )
        assert "sleep" not in timer.timers and "wake_up" not in timer.timers
        assert "lifecycle_groups_up_process_groups_reload" in timer.timers

    def test_a_no_op_sleep_records_nothing(self, fed: Any) -> None:
        lc, timer, printed = fed
        lc.sleep()  # already asleep: no plan ran
        assert timer.timers == {} and printed == []

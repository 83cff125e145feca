"""`RL_LIFECYCLE_CHECK_WEIGHTS=every`: slime's weight-update check at every push, not only the first.

The variable and the launch check here, and `checked_push` against a real Ray actor with the
interface of slime's `RolloutManager.check_weights(action)` over engines that hold named tensors
and answer `/weights_checker`'s snapshot, reset_tensors and compare as SGLang's `WeightChecker`
does (a compare that finds a difference raises). The wrapped trainer's `update_weights` calling it,
on slime's own source: test_slime_source.py (`TestWeightsCheck`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import pytest

from actor_integration.errors import EngineWeightsCheckError, LaunchConfigError
from actor_integration.frameworks.slime.weights_check import (
    CHECK_TIMER,
    CHECK_VARIABLE,
    check_mode,
    check_setting,
    checked_push,
)


class TestTheVariable:
    def test_unset_empty_or_off_is_off(self) -> None:
        assert (
            check_mode({})
            == check_mode({CHECK_VARIABLE: " "})
            == check_mode({CHECK_VARIABLE: "OFF"})
            == "off"
        )

    def test_every_in_any_case(self) -> None:
        assert check_mode({CHECK_VARIABLE: " Every "}) == "every"

    def test_another_value_is_refused_saying_what_to_use(self) -> None:
        with pytest.raises(LaunchConfigError, match=r"RL_LIFECYCLE_CHECK_WEIGHTS='1': use 'every'") as caught:
            check_mode({CHECK_VARIABLE: "1"})
        assert caught.value.fields == {"variable": CHECK_VARIABLE}


class TestTheLaunchCheck:
    def test_off_says_nothing(self) -> None:
        assert (
            check_setting({}) is None and check_setting({CHECK_VARIABLE: "off"}, argparse.Namespace()) is None
        )

    def test_the_first_push_is_left_to_slimes_own_check_when_it_is_on(self) -> None:
        on = check_setting({CHECK_VARIABLE: "every"}, argparse.Namespace(check_weight_update_equal=True))
        off = check_setting({CHECK_VARIABLE: "every"}, argparse.Namespace(check_weight_update_equal=False))
        assert on is not None and "the first by slime's own --check-weight-update-equal" in on
        assert off is not None and "the first one included" in off

    @pytest.mark.parametrize("flag", ["debug_train_only", "debug_rollout_only"])
    def test_a_job_that_pushes_nothing_is_refused(self, flag: str) -> None:
        with pytest.raises(LaunchConfigError, match="pushes none"):
            check_setting({CHECK_VARIABLE: "every"}, argparse.Namespace(**{flag: True}))


class _Engines:
    """slime's RolloutManager as `checked_push` reaches it (`check_weights(action)`, one answer per
    engine), over engines holding named tensors; `push(values, skip)` is the trainer's push."""

    def __init__(self, engines: int = 2) -> None:
        rng = np.random.default_rng(0)
        self.weights = [
            {n: rng.standard_normal(8) for n in ("embed", "qkv", "lm_head")} for _ in range(engines)
        ]
        self.snapshots: list[dict[str, np.ndarray]] | None = None
        self.calls: list[str] = []

    def check_weights(self, action: str) -> list[Any]:
        self.calls.append(action)
        if action == "snapshot":
            self.snapshots = [{n: t.copy() for n, t in w.items()} for w in self.weights]
        elif action == "reset_tensors":
            rng = np.random.default_rng(len(self.calls))
            for w in self.weights:
                for name in w:
                    w[name] = rng.standard_normal(8)
        elif action == "compare":
            assert self.snapshots is not None
            for w, snap in zip(self.weights, self.snapshots, strict=True):
                bad = [n for n in w if not np.array_equal(w[n], snap[n])]
                if bad:  # SGLang answers 400; slime's _make_request raises HTTPError with the text
                    raise RuntimeError(f"400 Client Error: weights differ: {bad}")
        else:
            raise ValueError(f"Unsupported action={action!r}")
        return [None] * len(self.weights)

    def push(self, values: dict[str, float], skip: tuple[str, ...] = ()) -> None:
        for w in self.weights:
            for name in w:
                if name not in skip:
                    w[name] = np.full(8, values[name])

    def actions(self) -> list[str]:
        return self.calls


class _Timer:
    """slime's `Timer` as the check reads and corrects it (`log_dict`, `add`)."""

    def __init__(self) -> None:
        self.timers: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.timers[name] = self.timers.get(name, 0.0) + seconds

    def log_dict(self) -> dict[str, float]:
        return self.timers


@pytest.fixture
def engines(ray_cluster: Any) -> Any:
    # This test module is not importable in Ray's workers: its classes travel by value.
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    manager = ray_cluster.remote(_Engines).remote()
    yield manager
    ray_cluster.kill(manager)


VALUES = {"embed": 1.0, "qkv": 2.0, "lm_head": 3.0}


def _pusher(ray: Any, manager: Any, timer: _Timer, skip: tuple[str, ...] = ()) -> Any:
    def push() -> str:
        ray.get(manager.push.remote(VALUES, skip))
        timer.add("update_weights", 0.25)  # what slime's @timer adds for a push
        timer.add("lifecycle_sync", 0.05)  # and the lifecycle's own figure through its TimerFeed
        return "pushed"

    return push


class TestCheckedPush:
    def test_a_push_that_writes_every_tensor_is_equal_and_slimes_timers_keep_the_first_push(
        self, ray_cluster: Any, engines: Any, capsys: pytest.CaptureFixture[str]
    ) -> None:
        timer = _Timer()
        push = _pusher(ray_cluster, engines, timer)
        push()  # the update the check follows
        result = checked_push(push, manager=engines, lead=True, version=3, timer=timer)
        assert result == "pushed"
        assert ray_cluster.get(engines.actions.remote()) == ["snapshot", "reset_tensors", "compare"]
        assert timer.timers["update_weights"] == pytest.approx(0.25)
        assert timer.timers["lifecycle_sync"] == pytest.approx(0.05)
        assert timer.timers[CHECK_TIMER] > 0
        assert "[rl-lifecycle] weights check, update 3: equal" in capsys.readouterr().err

    def test_a_push_that_leaves_a_tensor_unwritten_stops_with_the_version(
        self, ray_cluster: Any, engines: Any
    ) -> None:
        timer = _Timer()
        push = _pusher(ray_cluster, engines, timer, skip=("lm_head",))
        push()
        with pytest.raises(
            EngineWeightsCheckError, match=r"weight update 4: .*weights differ: \['lm_head'\]"
        ) as caught:
            checked_push(push, manager=engines, lead=True, version=4, timer=timer)
        assert caught.value.fields == {"version": 4}

    def test_a_push_that_is_not_deterministic_is_found(self, ray_cluster: Any, engines: Any) -> None:
        pushes = iter([VALUES, {**VALUES, "qkv": 2.5}])

        def push() -> None:
            ray_cluster.get(engines.push.remote(next(pushes)))

        push()
        with pytest.raises(EngineWeightsCheckError, match=r"\['qkv'\]"):
            checked_push(push, manager=engines, lead=True, version=1)

    def test_a_rank_that_does_not_lead_only_pushes(
        self, ray_cluster: Any, engines: Any, capsys: pytest.CaptureFixture[str]
    ) -> None:
        timer = _Timer()
        checked_push(
            _pusher(ray_cluster, engines, timer), manager=engines, lead=False, version=2, timer=timer
        )
        assert ray_cluster.get(engines.actions.remote()) == []
        assert timer.timers["update_weights"] == 0 and CHECK_TIMER in timer.timers
        assert "weights check" not in capsys.readouterr().err

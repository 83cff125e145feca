"""slime's rollouts under the launch switch's engine watch, on modules shaped as slime's (CI has no
slime source): `record_servers` keeps what `start_rollout_servers` started in the rollout manager's
process, `watch_rollouts` runs `call_rollout_fn` under `watch_engines` over those servers' engines.
The whole job, with the server killed mid-rollout, is in test_slime_job_source.py."""

from __future__ import annotations

import types
from typing import Any

import pytest

from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.slime import rollout


def _modules() -> tuple[types.ModuleType, types.ModuleType, list[Any]]:
    """slime.ray.rollout's start_rollout_servers and slime.rollout.base_types' call_rollout_fn, as slime's."""
    calls: list[Any] = []
    ray_rollout = types.ModuleType("slime.ray.rollout")
    base_types = types.ModuleType("slime.rollout.base_types")
    server = types.SimpleNamespace(engines=["engine0", None])

    def start_rollout_servers(args: Any, pg: Any) -> tuple[dict[str, Any], list[Any]]:
        return {"model": server}, ["init"]

    def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
        calls.append((args, evaluation))
        return fn(*args, evaluation=evaluation, **kwargs)

    ray_rollout.start_rollout_servers = start_rollout_servers  # type: ignore[attr-defined]
    base_types.call_rollout_fn = call_rollout_fn  # type: ignore[attr-defined]
    return ray_rollout, base_types, calls


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What `watch_engines` was asked to run under (it runs the rollout at once here)."""
    asked: list[dict[str, Any]] = []

    def watch_engines(run: Any, engines: Any, **kwargs: Any) -> Any:
        asked.append({"engines": engines(), **kwargs})
        return run()

    monkeypatch.setattr(rollout, "_STARTED", [])
    monkeypatch.setattr(rollout, "watch_engines", watch_engines)
    return asked


def _rollout_fn(args: Any, rollout_id: int, data_source: Any, *, evaluation: bool) -> str:
    return f"samples {rollout_id}"


def test_a_rollout_runs_watched_over_the_engines_started_in_this_process(
    watched: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    ray_rollout, base_types, calls = _modules()
    rollout.record_servers(ray_rollout)
    rollout.watch_rollouts(base_types)
    rollout.record_servers(ray_rollout)  # idempotent
    rollout.watch_rollouts(base_types)
    args = types.SimpleNamespace(use_fault_tolerance=False)
    assert base_types.call_rollout_fn(_rollout_fn, args, 2, None, evaluation=False) == "samples 2"
    assert watched == []  # no server started in this process: nothing to watch
    servers, handles = ray_rollout.start_rollout_servers(args, None)
    assert handles == ["init"] and [servers] == rollout._STARTED
    assert base_types.call_rollout_fn(_rollout_fn, args, 3, None, evaluation=False) == "samples 3"
    assert base_types.call_rollout_fn(_rollout_fn, args, 4, None, evaluation=True) == "samples 4"
    assert [w["what"] for w in watched] == ["slime's rollout 3 (generate)", "slime's rollout 4 (eval)"]
    assert watched[0]["engines"] == ["engine0", None] and "--use-fault-tolerance" in watched[0]["advice"]
    assert len(calls) == 3  # slime's own call_rollout_fn, each time
    err = capsys.readouterr().err
    assert (
        "[rl-lifecycle] slime's rollout 3 (generate): watching 2 engine(s) for a dead server, every 1 s"
        in err
    )


def test_slimes_own_fault_tolerance_restarts_dead_engines_instead(watched: list[dict[str, Any]]) -> None:
    ray_rollout, base_types, _ = _modules()
    rollout.record_servers(ray_rollout)
    rollout.watch_rollouts(base_types)
    args = types.SimpleNamespace(use_fault_tolerance=True)
    ray_rollout.start_rollout_servers(args, None)
    assert base_types.call_rollout_fn(_rollout_fn, args, 0, None, evaluation=False) == "samples 0"
    assert watched == []


@pytest.mark.parametrize("name", ["start_rollout_servers", "call_rollout_fn"])
def test_a_slime_laid_out_differently_is_refused(name: str) -> None:
    module = types.ModuleType("slime.moved")
    patch = rollout.record_servers if name == "start_rollout_servers" else rollout.watch_rollouts
    with pytest.raises(
        LaunchConfigError, match=f"slime.moved has no {name}, where the lifecycle's launch switch"
    ):
        patch(module)

"""The one line that wraps the rollout half: `install()` replaces `SGLangEngine` in the module the
rollout manager reads it from, once; run as Ray's setup hook, it reaches an actor created with a
runtime_env of its own (slime's and miles' rollout manager is one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actor_integration.engines.sglang.actor import SGLangActorLifecycle
from actor_integration.frameworks.miles import rollout as miles_rollout
from actor_integration.frameworks.slime import rollout as slime_rollout
from actor_integration.rollout.server_actor import ServerActorLifecycle
from tests.helpers import rollout_module_like

ROOT = Path(__file__).resolve().parents[3]


class TestInstall:
    def test_install_wraps_the_modules_class_once(self, monkeypatch):
        original = rollout_module_like.SGLangEngine
        monkeypatch.setattr(rollout_module_like, "SGLangEngine", original)
        wrapped = rollout_module_like.install()
        assert rollout_module_like.SGLangEngine is wrapped
        assert wrapped.__mro__[1:4] == (
            slime_rollout.SlimeRolloutMixin,
            SGLangActorLifecycle,
            ServerActorLifecycle,  # the engine-agnostic part
        )
        assert wrapped.__mro__[4] is original
        assert rollout_module_like.install() is wrapped  # idempotent

    def test_lifecycle_engine_builds_one_class_per_engine_class(self):
        class Engine:
            pass

        assert slime_rollout.lifecycle_engine(Engine) is slime_rollout.lifecycle_engine(Engine)
        assert issubclass(miles_rollout.lifecycle_engine(Engine), miles_rollout.MilesRolloutMixin)

    def test_the_install_targets_are_where_the_frameworks_create_their_engines(self):
        assert slime_rollout.ROLLOUT_MODULE == "slime.ray.rollout"
        assert miles_rollout.ROLLOUT_MODULE == "miles.ray.rollout.server_group"


@pytest.mark.ray
def test_rays_setup_hook_reaches_an_actor_with_its_own_runtime_env(tmp_path):
    """The driver's one line, in a fresh Ray job: the rollout manager-like actor (created with
    `runtime_env={"env_vars": ...}`, as slime's `create_rollout_manager` does) sees the wrapped class."""
    script = textwrap.dedent(
        f"""
        import ray
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={{
            "worker_process_setup_hook": "tests.helpers.rollout_module_like.install",
            "env_vars": {{"PYTHONPATH": {str(ROOT)!r}, "RL_LIFECYCLE_LOG_DIR": "off"}},
        }})

        @ray.remote
        class RolloutManager:
            def engine_bases(self):
                import tests.helpers.rollout_module_like as m
                return [c.__name__ for c in m.SGLangEngine.__mro__]

        manager = RolloutManager.options(runtime_env={{"env_vars": {{"RAY_USE_UVLOOP": "0"}}}}).remote()
        print("BASES", ray.get(manager.engine_bases.remote(), timeout=120))
        ray.shutdown()
        """
    )
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"
    }  # a job of its own, not the tests' cluster
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    line = next((out for out in proc.stdout.splitlines() if out.startswith("BASES")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "SlimeRolloutMixin" in line and "LifecycleSGLangEngine" in line, line

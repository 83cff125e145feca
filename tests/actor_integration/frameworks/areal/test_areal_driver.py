"""rl_trainer's colocate switch through `ArealColocateDriver`: the trainer's ranks as Ray actors behind a
LifecycleGroup, the rollout's engine in a Ray actor of its own, a server answering as SGLang 0.5.17
with AReaL's AWEX plugin (tests/helpers/areal_like.py), a real local Ray cluster."""

from __future__ import annotations

import pytest

from actor_integration.actors.ray_group import LifecycleGroup, log_dir_runtime_env
from actor_integration.frameworks.areal import ArealColocateDriver, RayCalls
from lifecycle.checker import check_files
from lifecycle.errors import InvalidWeightsError
from tests.actor_integration.frameworks.areal.test_areal_rollout import request
from tests.helpers.areal_like import LifecycleRemoteEngineLike, Meta, TrainerRank, awex_fake_server, http_send

pytestmark = pytest.mark.ray

RANKS = 2


@pytest.fixture
def colocated(ray_cluster, tmp_path):
    """(driver, trainer group, rollout, server): the actor offloaded, as rl_trainer leaves it at init;
    every actor logs into this test's own directory."""
    server = awex_fake_server()
    env = log_dir_runtime_env(tmp_path)
    rollout_actor = ray_cluster.remote(LifecycleRemoteEngineLike).options(runtime_env=env)
    rollout = RayCalls(rollout_actor.remote([server.url], http_send))
    actors = [
        ray_cluster.remote(TrainerRank)
        .options(runtime_env=env)
        .remote(rank, server.url, rollout if rank == 0 else None)
        for rank in range(RANKS)
    ]
    group = LifecycleGroup(actors, role="trainer", timeout_s=60)
    group.sleep()
    yield ArealColocateDriver(group, rollout), group, rollout, server
    for actor in actors:
        ray_cluster.kill(actor)
    ray_cluster.kill(rollout.handle)
    server.close()


class TestColocatedStep:
    def test_two_steps_serve_each_version_and_every_log_checks_clean(self, colocated):
        driver, group, rollout, server = colocated
        for step in (1, 2):
            states = driver.to_trainer()
            assert {s["state"] for s in states.values()} == {"AWAKE"}
            group.call("train_batch")
            group.call("save", Meta(type="dcp"))
            driver.update_weights(Meta(version=step))
            driver.to_rollout()
            assert request(server) == "served"
            assert server.served[-1]["labels"] == dict.fromkeys(server.names, str(step))
        assert {s["state"] for s in group.states().values()} == {"PAUSED"}
        assert rollout.lifecycle_state()["weight_version"] == 2
        logs = [p for p in group.log_paths().values() if p] + [rollout.lifecycle_log_path()]
        group.call("flush_logs")
        rollout.flush_logs()
        assert len(logs) == RANKS + 1 and check_files(logs) == []

    def test_a_recover_without_a_checkpoint_refuses_admission_instead_of_hanging(self, colocated):
        """RecoverHandler's colocate branch: the load fails on every rank, and the finally's resume()
        says so rather than letting the workflow submit to a paused server with its memory released."""
        driver, group, rollout, server = colocated
        with pytest.raises(InvalidWeightsError):
            driver.recover(Meta(type="dcp", exists=False), Meta(version=3))
        # every tag resident (nothing reads released memory), generation held: no version to serve
        assert server.released == set() and server.paused
        assert rollout.lifecycle_state()["contents"]["weights"] == "discarded"
        assert {s["state"] for s in group.states().values()} == {"PAUSED"}

    def test_a_rollout_without_the_wrap_is_refused(self, colocated):
        _driver, group, _rollout, _server = colocated
        with pytest.raises(TypeError, match="ArealRolloutMixin"):
            ArealColocateDriver(group, object())

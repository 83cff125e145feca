"""AReaL's single controller: its TrainController and RolloutController fan each call out to the
workers' engines (tests/helpers/areal_like.py); the engines carry the adapters, and the controllers
carry the AWEX transfer's report, which AReaL's rank-0 RolloutCallback has no route for."""

from __future__ import annotations

import pytest

from actor_integration.errors import SGLangServerError
from lifecycle import State
from lifecycle.errors import InvalidWeightsError
from tests.actor_integration.frameworks.areal.test_areal_rollout import request
from tests.helpers.areal_like import (
    LifecycleEngineLike,
    LifecycleRolloutController,
    LifecycleTrainController,
    MegatronEngineLike,
    Meta,
    RolloutControllerLike,
    TrainControllerLike,
    awex_fake_server,
    http_rollout,
    publish_to,
    recover_like,
)


@pytest.fixture
def server():
    made = awex_fake_server()
    yield made
    made.close()


def controllers(server, *, engines_wrapped: bool, controllers_wrapped: bool):
    rollout_engine = http_rollout(server, wrapped=engines_wrapped)
    trainer_engine = (LifecycleEngineLike if engines_wrapped else MegatronEngineLike)()
    trainer_engine.publish = publish_to(server.url)
    trainer_engine.offload()
    rollout = (LifecycleRolloutController if controllers_wrapped else RolloutControllerLike)([rollout_engine])
    trainer = (LifecycleTrainController if controllers_wrapped else TrainControllerLike)([trainer_engine])
    trainer.connect_engine(rollout, Meta())
    return trainer, rollout, rollout_engine


class TestRecoverThroughControllers:
    def test_wrapped_a_recover_with_its_checkpoint_serves_the_pushed_version(self, server):
        trainer, rollout, engine = controllers(server, engines_wrapped=True, controllers_wrapped=True)
        recover_like(trainer, rollout, 9)
        assert server.alive and server.transfers == [9]
        assert engine.lifecycle.state is State.AWAKE and engine.lifecycle.weight_version == 9
        assert request(server) == "served"

    def test_wrapped_engines_need_the_controllers_report(self, server):
        """Without it the engine cannot know the plugin resumed `weights` in the scheduler: the
        recover's resume() resumes them again, and SGLang's KeyError kills the server. The trainer
        controller's mixin is what tells it."""
        trainer, rollout, _engine = controllers(server, engines_wrapped=True, controllers_wrapped=False)
        with pytest.raises(SGLangServerError, match="without answering"):
            recover_like(trainer, rollout, 9)
        assert "KeyError" in server.deaths[0]

    def test_plain_areal_recovers_too(self, server):
        trainer, rollout, _engine = controllers(server, engines_wrapped=False, controllers_wrapped=False)
        recover_like(trainer, rollout, 9)
        assert server.alive and request(server) == "served"

    def test_wrapped_a_recover_without_its_checkpoint_refuses_admission(self, server):
        trainer, rollout, engine = controllers(server, engines_wrapped=True, controllers_wrapped=True)
        with pytest.raises(InvalidWeightsError):
            recover_like(trainer, rollout, 9, checkpoint=False)
        assert server.alive and server.released == set() and engine.lifecycle.state is State.AWAKE

    def test_plain_a_recover_without_its_checkpoint_leaves_requests_hanging(self, server):
        trainer, rollout, _engine = controllers(server, engines_wrapped=False, controllers_wrapped=False)
        recover_like(trainer, rollout, 9, checkpoint=False)
        assert request(server) == "hung"


class TestStepThroughControllers:
    def test_rl_trainers_step_twice(self, server):
        trainer, rollout, engine = controllers(server, engines_wrapped=True, controllers_wrapped=True)
        for step in (1, 2):
            rollout.pause()
            rollout.pause_generation_sync()
            rollout.offload(tags=["kv_cache"])
            rollout.offload(tags=["weights"])
            trainer.onload()
            trainer.engines[0].train_batch()
            trainer.update_weights(Meta(version=step))
            rollout.resume()
            assert request(server) == "served"
        assert server.transfers == [1, 2] and engine.lifecycle.weight_version == 2

"""The rollout side: the engine interface, the lifecycle adapters, a reference engine, SGLang, the actor.

from actor_integration.rollout import ReferenceEngine, RolloutActor

rollout = ray.remote(RolloutActor).remote(ReferenceEngine)   # a factory: built in the actor
ray.get(rollout.sleep.remote())
ray.get(rollout.wake_up.remote(["weights"]))
# trainer: WeightSender(..., engine_call=lambda v, p: ray.get(rollout.update_weights.remote(v, p)))
ray.get(rollout.wake_up.remote(["kv_cache"]))
"""

from actor_integration.rollout.actor import ROLLOUT_POLICY, RolloutActor
from actor_integration.rollout.engine import (
    ENGINE_TAGS,
    GENERATION_MODES,
    EngineGeneration,
    EngineMemory,
    RolloutEngine,
)
from actor_integration.rollout.reference import ReferenceEngine
from actor_integration.rollout.sglang import SGLangEngine

__all__ = [
    "ENGINE_TAGS",
    "GENERATION_MODES",
    "ROLLOUT_POLICY",
    "EngineGeneration",
    "EngineMemory",
    "ReferenceEngine",
    "RolloutActor",
    "RolloutEngine",
    "SGLangEngine",
]

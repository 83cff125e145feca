"""The rollout side, engine-agnostic: the engine interface, the actor, a reference engine, the registry.

from actor_integration.rollout import ReferenceEngine, RolloutActor

rollout = ray.remote(RolloutActor).remote(ReferenceEngine)   # a factory: built in the actor
ray.get(rollout.sleep.remote())
ray.get(rollout.wake_up.remote(["weights"]))
# trainer: WeightSender(..., engine_call=lambda v, p: ray.get(rollout.update_weights.remote(v, p)))
ray.get(rollout.wake_up.remote(["kv_cache"]))

Each engine is a package of its own (`actor_integration.engines.<name>`; SGLang's is
`engines.sglang`), registered by name in `registry`. The names below are imported on first use,
so that `rollout.registry` (the CLI's engine choices) pulls in neither torch nor an engine;
`SGLangEngine` is still importable from here, as 0.1 had it (from `actor_integration.engines.sglang`
it is typed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # SGLangEngine is left out: rollout/ imports no engine (it resolves through _LAZY)
    from actor_integration.rollout.actor import ROLLOUT_POLICY, RolloutActor
    from actor_integration.rollout.engine import (
        ENGINE_TAGS,
        GENERATION_MODES,
        EngineGeneration,
        EngineMemory,
        RolloutEngine,
    )
    from actor_integration.rollout.reference import ReferenceEngine

_LAZY = {
    "ENGINE_TAGS": "actor_integration.rollout.engine",
    "GENERATION_MODES": "actor_integration.rollout.engine",
    "ROLLOUT_POLICY": "actor_integration.rollout.actor",
    "EngineGeneration": "actor_integration.rollout.engine",
    "EngineMemory": "actor_integration.rollout.engine",
    "ReferenceEngine": "actor_integration.rollout.reference",
    "RolloutActor": "actor_integration.rollout.actor",
    "RolloutEngine": "actor_integration.rollout.engine",
    "SGLangEngine": "actor_integration.engines.sglang.engine",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

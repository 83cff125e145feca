"""slime under the lifecycle: its trainer actor and its SGLang engine actor, one module each.

- `trainer`: slime's `MegatronTrainRayActor` (`SlimeLifecycleMixin`): its memory, process groups
  and model tag under the trainer's transition table.
- `budget`: `RL_LIFECYCLE_MEMORY_BUDGET=rollout`, the trainer's sleep freeing only what the colocated
  engines need (opt-in; read by `SlimeLifecycleMixin`).
- `rollout`: slime's `SGLangEngine` Ray actor (`SlimeRolloutMixin`, `lifecycle_engine`, `install`):
  the rollout's transition table in front of its calls.

    from actor_integration.frameworks.slime import SlimeLifecycleMixin, SLIME_COMMIT
"""

from actor_integration.frameworks.slime.rollout import SlimeRolloutMixin
from actor_integration.frameworks.slime.trainer import (
    RETAIN_VARIABLE,
    SLIME_COMMIT,
    SlimeLifecycleMixin,
    SlimeProcessGroups,
    slime_memory_backend,
)

__all__ = [
    "RETAIN_VARIABLE",
    "SLIME_COMMIT",
    "SlimeLifecycleMixin",
    "SlimeProcessGroups",
    "SlimeRolloutMixin",
    "slime_memory_backend",
]

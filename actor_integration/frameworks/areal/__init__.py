"""AReaL's colocated training (AWEX: the Megatron actor and SGLang time-sharing GPUs) under the lifecycle.

One adapter per outside system:

- `trainer`: AReaL's `MegatronEngine` with its AWEX adapter (`ArealTrainerMixin`): its tag offload
  and onload (`optimizer`, `weights`) as the trainer's sleep and wake, the gradient-buffer release
  as the sleep's `clear_memory` hook, the AWEX transfer as the sync, its residency changes recorded.
- `rollout`: AReaL's `RemoteSGLangEngine` (`ArealRolloutMixin`): pause (abort, then in_place),
  release, resume and continue under the rollout table, the AWEX plugin's resume of `weights` in
  the scheduler recorded, admission refused on weights nothing reloaded.
- `driver`: what AReaL's `rl_trainer` and `RecoverHandler` do between the two, through
  `LifecycleGroup` for the trainer's ranks (`ArealColocateDriver`), and the transfer's report
  through AReaL's own controllers (`ArealTrainControllerMixin`, `ArealRolloutControllerMixin`).

Read from AReaL `AREAL_COMMIT` (its main on 2026-08-22; #1500, which added the colocate path, is
`AREAL_PR1500_COMMIT`): docs/frameworks/areal.md says which file does what.
"""

from actor_integration.frameworks.areal.driver import (
    ArealColocateDriver,
    ArealRolloutControllerMixin,
    ArealTrainControllerMixin,
    RayCalls,
)
from actor_integration.frameworks.areal.rollout import (
    IDLE_POLL_ENV,
    ROLLOUT_TAGS,
    ArealRolloutMixin,
    areal_rollout_policy,
)
from actor_integration.frameworks.areal.trainer import (
    TRAINER_TAGS,
    ArealTrainerMixin,
    AwexMemory,
    GradBufferRelease,
    areal_trainer_policy,
)

AREAL_COMMIT = "cbff54d6"  # the AReaL these adapters are read from and tested against
AREAL_PR1500_COMMIT = "76138cb3"  # "support AWEX colocated actor-rollout training" (#1500)

__all__ = [
    "AREAL_COMMIT",
    "AREAL_PR1500_COMMIT",
    "IDLE_POLL_ENV",
    "ROLLOUT_TAGS",
    "TRAINER_TAGS",
    "ArealColocateDriver",
    "ArealRolloutControllerMixin",
    "ArealRolloutMixin",
    "ArealTrainControllerMixin",
    "ArealTrainerMixin",
    "AwexMemory",
    "GradBufferRelease",
    "RayCalls",
    "areal_rollout_policy",
    "areal_trainer_policy",
]

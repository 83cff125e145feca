"""miles under the lifecycle: its trainer actor and its SGLang engine actor, one module each.

- `trainer`: miles' `MegatronTrainRayActor` (`MilesLifecycleMixin`), its per-tag memory layouts.
- `rollout`: miles' `SGLangEngine` Ray actor (`MilesRolloutMixin`, `lifecycle_engine`, `install`).

    from actor_integration.frameworks.miles import MilesLifecycleMixin, MILES_COMMIT
"""

from actor_integration.frameworks.miles.rollout import MilesRolloutMixin
from actor_integration.frameworks.miles.trainer import (
    ALL_MEMORY,
    LORA_ROLLOUT,
    MILES_COMMIT,
    REMATERIALIZE,
    MilesLifecycleMixin,
    MilesProcessGroups,
    MilesTagLayout,
    MilesVersionError,
    OffloadTrainRequiredError,
    check_miles_backup_fits,
    miles_memory_backend,
    miles_tag_layout,
)

__all__ = [
    "ALL_MEMORY",
    "LORA_ROLLOUT",
    "MILES_COMMIT",
    "REMATERIALIZE",
    "MilesLifecycleMixin",
    "MilesProcessGroups",
    "MilesRolloutMixin",
    "MilesTagLayout",
    "MilesVersionError",
    "OffloadTrainRequiredError",
    "check_miles_backup_fits",
    "miles_memory_backend",
    "miles_tag_layout",
]

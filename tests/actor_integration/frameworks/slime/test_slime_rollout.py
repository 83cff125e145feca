"""The rollout suite (`rollout_source_suite`) on a slime-shaped `SGLangEngine`, in CI: slime's
source is not reachable there. `test_slime_rollout_source.py` runs the same tests on slime's own
class; the shaped class (`tests/helpers/slime_engine_like.py`) makes the same calls."""

from __future__ import annotations

from typing import Any

from tests.actor_integration.frameworks.rollout_source_suite import RolloutSourceSuite
from tests.helpers.engine_source import slime_like_installed
from tests.helpers.rollout_calls import SLIME_REPRODUCTIONS


class TestSlimeShapedRollout(RolloutSourceSuite):
    framework = "slime"
    version = "0.5.17"
    source = None
    reproductions = SLIME_REPRODUCTIONS

    def installed(self, tree: Any) -> Any:
        return slime_like_installed()

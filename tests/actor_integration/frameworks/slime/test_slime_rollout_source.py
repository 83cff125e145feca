"""slime's real `SGLangEngine` (its source at the pinned commit) under `SlimeRolloutMixin`, against
a local server that answers as SGLang 0.5.17's does (the suite is `rollout_source_suite`).

Needs slime's source: CI has no network, so the suite skips there; run it with

    RL_LIFECYCLE_SLIME_SOURCE=/path/to/slime python -m pytest -s tests/actor_integration/frameworks/slime/test_slime_rollout_source.py

(`-s` prints the model check: per kind of damage, the count and a shortest sequence of the job's calls).
"""

from __future__ import annotations

from tests.actor_integration.frameworks.rollout_source_suite import RolloutSourceSuite
from tests.helpers.framework_source import suite_source
from tests.helpers.rollout_calls import SLIME_REPRODUCTIONS
from tests.helpers.slime_source import SlimeSource

SOURCE, pytestmark, _source_readable = suite_source(SlimeSource, "slime's")


class TestSlimeRollout(RolloutSourceSuite):
    framework = "slime"
    version = "0.5.17"
    source = SOURCE
    reproductions = SLIME_REPRODUCTIONS

    def test_slimes_get_weight_version_fails_on_0_5_17(self, world):
        """slime's own `get_weight_version` asks `/get_weight_version`, which 0.5.17 answers with 404
        (use /model_info); the wrap reads `/model_info` for its version check."""
        import requests

        try:
            world.engine.get_weight_version()
        except requests.exceptions.HTTPError as exc:
            assert exc.response.status_code == 404
        else:
            raise AssertionError("slime's get_weight_version answered on 0.5.17")
        assert world.engine.lifecycle_state()["served_version"] == world.server.weight_version

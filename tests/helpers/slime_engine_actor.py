"""slime's `SGLangEngine` classes as the GPU tests' Ray actors create them (tests only).

Importing this module runs slime's `slime/backends/sglang_utils/sglang_engine.py` from its source
(`RL_LIFECYCLE_SLIME_SOURCE`, the commit the trainer suites use) against the installed SGLang, and
keeps it installed for the life of the process: the test's driver and every Ray worker that
unpickles one of the classes below import it the same way (Ray pickles a class of an importable
module by reference), as a worker of a slime job imports slime.

- `WrappedSlimeEngine`: `lifecycle_engine(SGLangEngine)`, what `slime_rollout.install()` makes slime's
  rollout manager create, plus two reads a test needs from outside the actor;
- `PlainSlimeEngine`: slime's class as it is, pointed at a running server (`point_at`), for
  slime's own calls on the same server.
"""

from __future__ import annotations

import contextlib

from actor_integration.frameworks.slime.rollout import lifecycle_engine
from tests.helpers.engine_actor_reads import ActorReads, PointAt
from tests.helpers.engine_source import installed
from tests.helpers.slime_source import SlimeSource

_kept = contextlib.ExitStack()
module, _launched = _kept.enter_context(installed("slime", SlimeSource.find(), server_fields=None))


class WrappedSlimeEngine(ActorReads, lifecycle_engine(module.SGLangEngine)):  # type: ignore[misc]
    """slime's engine under the rollout lifecycle (`SlimeRolloutMixin`), as a Ray actor."""


class PlainSlimeEngine(PointAt, module.SGLangEngine):  # type: ignore[misc]
    """slime's engine, unwrapped, sending its HTTP calls to a server another actor launched."""

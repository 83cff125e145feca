"""miles' `SGLangEngine` classes as the GPU tests' Ray actors create them (tests only).

Importing this module runs miles' `miles/backends/sglang_utils/sglang_engine.py` from its source
(`RL_LIFECYCLE_MILES_SOURCE`, the commit the trainer suites use) against the installed SGLang
(0.5.17 on the GPU machine: every server argument miles computes at that commit is one of 0.5.17's;
its trainer's weight-update session, `/begin_weight_update`, is not, and no test here opens one),
and keeps it installed for the life of the process: the test's driver and every Ray worker that
unpickles one of the classes below import it the same way (Ray pickles a class of an importable
module by reference), as a worker of a miles job imports miles.

- `WrappedMilesEngine`: `lifecycle_engine(SGLangEngine)`, what `miles_rollout.install()` makes miles'
  rollout manager create, plus two reads a test needs from outside the actor;
- `PlainMilesEngine`: miles' class as it is, pointed at a running server (`point_at`), for
  miles' own calls on the same server.
"""

from __future__ import annotations

import contextlib

from actor_integration.frameworks.miles.rollout import lifecycle_engine
from tests.helpers.engine_actor_reads import ActorReads, PointAt
from tests.helpers.engine_source import installed
from tests.helpers.miles_source import MilesSource

_kept = contextlib.ExitStack()
module, _launched = _kept.enter_context(installed("miles", MilesSource.find(), server_fields=None))


class WrappedMilesEngine(ActorReads, lifecycle_engine(module.SGLangEngine)):  # type: ignore[misc]
    """miles' engine under the rollout lifecycle (`MilesRolloutMixin`), as a Ray actor."""


class PlainMilesEngine(PointAt, module.SGLangEngine):  # type: ignore[misc]
    """miles' engine, unwrapped, sending its HTTP calls to a server another actor launched."""

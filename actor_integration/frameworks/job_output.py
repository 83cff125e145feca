"""What a framework job's workers say about the lifecycle: one line on stderr, which Ray forwards to the job's output.

    from actor_integration.frameworks.job_output import say
    say("slime: ... runs as LifecycleSGLangEngine ...")   # "[rl-lifecycle] slime: ..."

Its own module so that the launch switch and the adapters it installs (`frameworks/slime/rollout.py`'s
rollout watch) both speak through it without importing each other.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["say"]

_log = logging.getLogger("rl_lifecycle.launch")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The process's stderr at each line (a test's capture, a Ray worker's log), not the one at creation."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def say(message: str) -> None:
    """One line on the worker's stderr, which Ray forwards to the job's output ("[rl-lifecycle] ...")."""
    if not _log.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("[rl-lifecycle] %(message)s"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)
        _log.propagate = False
    _log.info("%s", message)

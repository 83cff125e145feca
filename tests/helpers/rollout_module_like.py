"""Stands in for the module a framework's rollout manager reads `SGLangEngine` from
(`slime.ray.rollout`), for testing Ray's setup hook without the framework installed (tests only)."""

from __future__ import annotations

from typing import Any


class SGLangEngine:
    """The framework's engine class, as `ServerGroup.start_engines` finds it in its module."""


def install() -> Any:
    """What `actor_integration.frameworks.slime.rollout.install` does, on this module."""
    import sys

    from actor_integration.frameworks.slime.rollout import install_into, lifecycle_engine

    return install_into(sys.modules[__name__], lifecycle_engine)

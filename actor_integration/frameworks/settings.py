"""A job's opt-in settings, read from the variables its runtime env sets (`RL_LIFECYCLE_MEMORY_BUDGET`,
`RL_LIFECYCLE_CHECK_WEIGHTS`): one of a few words, `off` when unset, any other value refused."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from actor_integration.errors import LaunchConfigError

__all__ = ["choice"]


def choice(variable: str, choices: Sequence[str], use: str, environ: Mapping[str, str] | None = None) -> str:
    """`variable`'s value among `choices` (case and spaces ignored; unset or empty: "off", which `choices`
    holds). Another value is a `LaunchConfigError` whose message goes on with `use` (what to set)."""
    env = os.environ if environ is None else environ
    value = env.get(variable, "").strip().lower() or "off"
    if value not in choices:
        raise LaunchConfigError(f"{variable}={env.get(variable)!r}: {use}", variable=variable)
    return value

"""Environments for torch_memory_saver tests."""

from __future__ import annotations

from actor_integration.backends.tms_env import preload_library


def preload_env(major: int = 13, **extra: str) -> dict[str, str]:
    """An environment with the TMS preload library for CUDA `major` in LD_PRELOAD."""
    return {"LD_PRELOAD": preload_library(major), **extra}

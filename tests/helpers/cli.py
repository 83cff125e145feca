"""Run the `lifecycle` command in a subprocess, as a user types it (tests only)."""

from __future__ import annotations

import subprocess
import sys


def lifecycle(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m actor_integration.tools.cli ARGS`: its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "actor_integration.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )

"""Where GPU tests put their figures: printed, and written as JSON under $LIFECYCLE_GPU_OUT when set."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def record(name: str, figures: Any) -> None:
    """Print `figures` and write them to `$LIFECYCLE_GPU_OUT/<name>.json` (scripts/gpu_suite.sh sets it)."""
    print(f"[{name}] {json.dumps(figures, default=str)}", flush=True)
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))

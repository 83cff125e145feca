"""vLLM as a rollout engine (vllm 0.26.0, an optional extra: `pip install 'rl-lifecycle[vllm]'`).

- `VLLMEngine` adapts an offline `vllm.LLM`, `VLLMHTTPEngine` a `vllm serve` server; both implement
  `RolloutEngine` (and `LoadsPayloads`, `ReportsQueue` where they can) behind `SleepGuard`, which
  refuses, before vLLM is called, what the field reports vLLM crashing, hanging or answering with
  gibberish on (see guards.py and docs/frameworks/vllm.md).
- `VLLMRolloutActor` puts either under the rollout lifecycle.
- `LifecycleWorkerExtension` (`WORKER_EXTENSION`) receives the lifecycle's weight rounds inside
  vLLM's workers.

Names are imported lazily: `import actor_integration.engines.vllm` pulls in neither vLLM nor torch
(the worker extension, the guards and the HTTP client need neither). The engine registry registers
`make_engine` under `ENGINE_NAME`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actor_integration.engines.vllm.actor import VLLMMemory, VLLMRolloutActor
    from actor_integration.engines.vllm.base import VLLMAdapter, WeightUpdate
    from actor_integration.engines.vllm.guards import PAUSE_MODES, SLEEP_LEVELS, VLLM_TAGS, SleepGuard
    from actor_integration.engines.vllm.http_engine import VLLMHTTPEngine
    from actor_integration.engines.vllm.offline import SUPPORTED_VERSION, VLLMEngine
    from actor_integration.engines.vllm.worker import WORKER_EXTENSION, LifecycleWorkerExtension

ENGINE_NAME = "vllm"

_EXPORTS = {
    "VLLMMemory": "actor",
    "VLLMRolloutActor": "actor",
    "VLLMAdapter": "base",
    "WeightUpdate": "base",
    "PAUSE_MODES": "guards",
    "SLEEP_LEVELS": "guards",
    "VLLM_TAGS": "guards",
    "SleepGuard": "guards",
    "VLLMHTTPEngine": "http_engine",
    "SUPPORTED_VERSION": "offline",
    "VLLMEngine": "offline",
    "WORKER_EXTENSION": "worker",
    "LifecycleWorkerExtension": "worker",
}


def make_engine(*, url: str | None = None, **kwargs: Any) -> VLLMAdapter:
    """A vLLM rollout engine: `VLLMHTTPEngine(url, **kwargs)` with `url`, else `VLLMEngine(**kwargs)`
    (an `llm=` to adapt, or `vllm.LLM`'s arguments such as `model=`)."""
    if url is not None:
        from actor_integration.engines.vllm.http_engine import VLLMHTTPEngine

        return VLLMHTTPEngine(url, **kwargs)
    from actor_integration.engines.vllm.offline import VLLMEngine

    return VLLMEngine(**kwargs)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "ENGINE_NAME",
    "PAUSE_MODES",
    "SLEEP_LEVELS",
    "SUPPORTED_VERSION",
    "VLLM_TAGS",
    "WORKER_EXTENSION",
    "LifecycleWorkerExtension",
    "SleepGuard",
    "VLLMAdapter",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "VLLMMemory",
    "VLLMRolloutActor",
    "WeightUpdate",
    "make_engine",
]

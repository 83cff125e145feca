"""The demo's rollout actor: the reference torch engine behind `RolloutActor`, with per-rank logs and
fault injection at the engine calls the lifecycle hooks make."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actor_integration.rollout.actor import RolloutActor
from actor_integration.rollout.reference import ReferenceEngine
from actor_integration.tiny_model import TinyLMConfig
from lifecycle import configure_logging, flush_logs
from lifecycle.faults import FaultInjector

# The engine call each lifecycle hook of the rollout ends in.
_HOOK_OF_CALL = {
    "release_memory_occupation": "memory.pause",
    "resume_memory_occupation": "memory.resume",
    "pause_generation": "generation.pause",
    "continue_generation": "generation.resume",
}


class FaultyEngine:
    """Delegates to a `ReferenceEngine`; the injector can fail the calls the rollout's hooks make."""

    def __init__(self, engine: ReferenceEngine, faults: FaultInjector) -> None:
        self._engine, self._faults = engine, faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        hook = _HOOK_OF_CALL.get(name)
        if hook is None:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._faults.check(hook, after_effect=False)
            return attr(*args, **kwargs)

        return call


class DemoRollout(RolloutActor):
    """A `RolloutActor` over the reference engine (use with `ray.remote`)."""

    def __init__(self, *, model: dict[str, Any], devices: Sequence[str], rank: int, out: str) -> None:
        configure_logging(json_path=Path(out) / "logs" / f"rollout-rank{rank}.jsonl")
        self.faults = FaultInjector()
        engine = FaultyEngine(ReferenceEngine(TinyLMConfig(**model), devices=list(devices)), self.faults)
        super().__init__(engine, rank=rank, max_new_tokens=16)
        self.lifecycle.bind(devices=list(devices))

    def lifecycle_step(self, step: int) -> None:
        self.lifecycle.step = step

    def arm_fault(self, hook: str) -> None:
        self.faults.arm(hook)

    def flush_logs(self) -> bool:
        return flush_logs()

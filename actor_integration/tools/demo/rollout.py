"""The demo's rollout actors: the reference torch engine, or a real `sglang.Engine`, behind
`RolloutActor`, with per-rank logs and fault injection at the engine calls the lifecycle hooks make."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actor_integration.actors.cluster import here
from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout.actor import RolloutActor
from actor_integration.rollout.reference import ReferenceEngine
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
    """Delegates to an engine; the injector can fail the calls the rollout's hooks make."""

    def __init__(self, engine: Any, faults: FaultInjector) -> None:
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


class _DemoActor(RolloutActor):
    """What the driver calls on either rollout actor, beside `RolloutActor`'s own methods."""

    faults: FaultInjector

    def lifecycle_step(self, step: int) -> None:
        self.lifecycle.step = step

    def arm_fault(self, hook: str) -> None:
        self.faults.arm(hook)

    def flush_logs(self) -> bool:
        return flush_logs()


class DemoRollout(_DemoActor):
    """A `RolloutActor` over the reference engine (use with `ray.remote`)."""

    def __init__(
        self, *, model: dict[str, Any], devices: Sequence[str], rank: int, out: str, world_size: int = 1
    ) -> None:
        configure_logging(json_path=Path(out) / "logs" / f"rollout-rank{rank}.jsonl")
        self.faults = FaultInjector()
        engine = FaultyEngine(ReferenceEngine(TinyLMConfig(**model), devices=list(devices)), self.faults)
        super().__init__(engine, rank=rank, max_new_tokens=16)
        # world_size: how many engines the run has (`lifecycle check` names the ones with no log).
        self.lifecycle.bind(devices=list(devices), world_size=world_size, node=here()["node_id"])


class DemoSGLangRollout(_DemoActor):
    """A `RolloutActor` over a real `sglang.Engine` on this actor's GPU (use with `ray.remote`).

    The engine starts with dummy weights (SGLang's `load_format="dummy"`): it serves nothing
    meaningful until the trainer's first sync. Its scheduler process gets torch_memory_saver's
    preload library from SGLang itself; this actor's process must not preload it."""

    def __init__(
        self, *, config_dir: str, rank: int, out: str, mem_fraction: float, seed: int, timeout_s: float
    ) -> None:
        configure_logging(json_path=Path(out) / "logs" / f"rollout-rank{rank}.jsonl")
        from actor_integration.engines.sglang.engine import SGLangEngine

        self.faults = FaultInjector()
        self.sglang = SGLangEngine(
            model_path=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_memory_saver=True,
            mem_fraction_static=mem_fraction,
            attention_backend="triton",
            sampling_backend="pytorch",
            context_length=2048,
            dtype="bfloat16",
            tp_size=1,
            random_seed=seed,
            call_timeout_s=timeout_s,
        )
        super().__init__(FaultyEngine(self.sglang, self.faults), rank=rank, max_new_tokens=16)
        self.lifecycle.bind(devices=["cuda:0"])

    def describe_engine(self) -> dict[str, Any]:
        return self.sglang.describe()

    def kill_scheduler(self) -> int:
        """SIGKILL SGLang's scheduler (the demo's --kill-engine); its pid."""
        pid = (
            self.sglang.scheduler_pids[0]
            if self.sglang.scheduler_pids
            else self.sglang.describe()["processes"]["scheduler_0"]
        )
        os.kill(pid, signal.SIGKILL)
        return int(pid)

    def close(self) -> None:
        self.sglang.shutdown()

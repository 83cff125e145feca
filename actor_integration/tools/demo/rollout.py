"""The demo's rollout actors: the reference torch engine, a real `sglang.Engine` or a real offline
`vllm.LLM`, behind `RolloutActor` (vLLM's behind `VLLMRolloutActor`), with per-rank logs and fault
injection at the engine calls the lifecycle hooks make.

The two real engines share one actor (`_EngineRollout`: the trainer's Qwen model served with dummy
weights until the first sync, one GPU each, the kill of `--kill-engine`, the shutdown); each names
only the engine it starts, how it describes it, and which process the kill ends (SGLang's
scheduler, vLLM's EngineCore)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from actor_integration.actors.cluster import here
from actor_integration.engines.vllm.actor import VLLMRolloutActor
from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout.actor import RolloutActor
from actor_integration.rollout.reference import ReferenceEngine
from actor_integration.rollout.server_watch import pid_alive
from actor_integration.tools.demo.options import PROMPT_LEN, PROMPTS
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
    """Delegates to an engine (`wrapped`); the injector can fail the calls the rollout's hooks make."""

    def __init__(self, engine: Any, faults: FaultInjector) -> None:
        self.wrapped, self._faults = engine, faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.wrapped, name)
        hook = _HOOK_OF_CALL.get(name)
        if hook is None:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._faults.check(hook, after_effect=False)
            return attr(*args, **kwargs)

        return call


class _DemoActor(RolloutActor):
    """What the driver calls on every rollout actor, beside `RolloutActor`'s own methods. Its
    constructor configures the rank's log first, then builds the engine (`build`), behind the
    fault injector."""

    faults: FaultInjector

    def __init__(self, build: Callable[[], Any], *, rank: int, out: str, **kwargs: Any) -> None:
        configure_logging(json_path=Path(out) / "logs" / f"rollout-rank{rank}.jsonl")
        self.faults = FaultInjector()
        self.served = build()  # the engine itself, behind `self.engine` (its fault injector)
        super().__init__(FaultyEngine(self.served, self.faults), rank=rank, max_new_tokens=16, **kwargs)

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
        config = TinyLMConfig(**model)
        super().__init__(lambda: ReferenceEngine(config, devices=list(devices)), rank=rank, out=out)
        # world_size: how many engines the run has (`lifecycle check` names the ones with no log).
        self.lifecycle.bind(devices=list(devices), world_size=world_size, node=here()["node_id"])


class _EngineRollout(_DemoActor):
    """A real engine on this actor's one GPU, serving the trainer's Qwen model: it starts with dummy
    weights (`load_format="dummy"`) and serves nothing meaningful until the trainer's first sync."""

    def __init__(self, build: Callable[[], Any], *, rank: int, out: str) -> None:
        super().__init__(build, rank=rank, out=out)
        self.lifecycle.bind(devices=["cuda:0"])

    def describe_engine(self) -> dict[str, Any]:
        """The engine as the driver shows it: `engine`, `version`, `memory_tags`, `weights_via`,
        `cuda_graphs`, beside what the engine's own `describe()` says."""
        raise NotImplementedError

    def engine_process(self) -> tuple[str, int]:
        """(name, pid) of the process `--kill-engine` kills."""
        raise NotImplementedError

    def kill_engine(self, wait_s: float = 10.0) -> dict[str, Any]:
        """SIGKILL the engine's process (the demo's --kill-engine) and wait up to `wait_s` for it to be
        gone, so that the next call meets a dead engine: its name and pid."""
        name, pid = self.engine_process()
        os.kill(pid, signal.SIGKILL)
        until = time.monotonic() + wait_s
        while pid_alive(pid) and time.monotonic() < until:
            time.sleep(0.01)
        return {"process": name, "pid": pid}

    def close(self) -> None:
        self.served.shutdown()


class DemoSGLangRollout(_EngineRollout):
    """A `RolloutActor` over a real `sglang.Engine` on this actor's GPU (use with `ray.remote`). Its
    scheduler process gets torch_memory_saver's preload library from SGLang itself; this actor's
    process must not preload it."""

    def __init__(
        self, *, config_dir: str, rank: int, out: str, mem_fraction: float, seed: int, timeout_s: float
    ) -> None:
        def build() -> Any:
            from actor_integration.engines.sglang.engine import SGLangEngine

            arguments = sglang_arguments(config_dir, mem_fraction=mem_fraction, seed=seed)
            return SGLangEngine(call_timeout_s=timeout_s, **arguments)

        super().__init__(build, rank=rank, out=out)

    def describe_engine(self) -> dict[str, Any]:
        described: dict[str, Any] = self.served.describe()
        return {**described, "version": described["sglang"]}

    def engine_process(self) -> tuple[str, int]:
        pids = self.served.scheduler_pids
        return "scheduler", int(pids[0] if pids else self.served.describe()["processes"]["scheduler_0"])


def sglang_arguments(config_dir: str, *, mem_fraction: float, seed: int) -> dict[str, Any]:
    """`sglang.Engine`'s arguments for the demo: the trainer's Qwen model with dummy weights, the
    memory saver on, `mem_fraction` of the GPU (`mem_fraction_static`), the triton attention and
    pytorch sampling backends (no kernel JIT at start), CUDA graphs captured for the demo's batches
    only (`PROMPTS`, `PROMPT_LEN`)."""
    return {
        "model_path": config_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "mem_fraction_static": mem_fraction,
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "context_length": 2048,
        "dtype": "bfloat16",
        "tp_size": 1,
        "random_seed": seed,
        "cuda_graph_max_bs_decode": PROMPTS,
        "cuda_graph_max_bs_prefill": PROMPTS * PROMPT_LEN,
    }


def vllm_arguments(config_dir: str, *, mem_fraction: float, seed: int) -> dict[str, Any]:
    """`VLLMEngine`'s arguments for the demo (`vllm.LLM`'s, and the sleep level): the trainer's Qwen
    model with dummy weights, eager (no CUDA graphs), `mem_fraction` of the GPU for vLLM's weights
    and KV cache (`gpu_memory_utilization`), level-2 sleep (weights discarded, the sync reloads them)."""
    return {
        "model": config_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "gpu_memory_utilization": mem_fraction,
        "max_model_len": 2048,
        "dtype": "bfloat16",
        "tensor_parallel_size": 1,
        "seed": seed,
        "sleep_level": 2,
    }


class DemoVLLMRollout(_EngineRollout, VLLMRolloutActor):
    """A `VLLMRolloutActor` over a real offline `vllm.LLM` on this actor's GPU (use with `ray.remote`):
    weights through the lifecycle's sender into vLLM's workers (`LifecycleWorkerExtension`), sleep at
    level 2. `engine` builds the adapter from `vllm_arguments(...)` (default `VLLMEngine`; the CPU
    tests pass one over the fake vLLM)."""

    def __init__(
        self,
        *,
        config_dir: str,
        rank: int,
        out: str,
        mem_fraction: float,
        seed: int,
        engine: Callable[..., Any] | None = None,
    ) -> None:
        arguments = vllm_arguments(config_dir, mem_fraction=mem_fraction, seed=seed)

        def build() -> Any:
            from actor_integration.engines.vllm.offline import VLLMEngine

            return (engine or VLLMEngine)(**arguments)

        super().__init__(build, rank=rank, out=out)

    def describe_engine(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("vllm")
        except PackageNotFoundError:  # the CPU tests' fake
            installed = "not installed"
        return {**self.served.describe(), "version": installed, "cuda_graphs": False}

    def engine_process(self) -> tuple[str, int]:
        processes = self.served.engine_processes()
        if not processes:
            raise RuntimeError(
                "--kill-engine: vLLM runs its EngineCore in this actor's process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0): there is no engine process to kill apart from the actor"
            )
        name, pid = next(iter(processes.items()))
        return name, pid

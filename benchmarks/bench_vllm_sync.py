"""Weight sync into a real `vllm.LLM` (0.26.0) on the trainer's GPU: the lifecycle's sender next to
vLLM's own IPC weight transfer, with the device-to-device ceiling, at two shapes, in one run.

    python benchmarks/bench_vllm_sync.py [--shapes qwen2-0.5b,qwen2-7b] [--iters 5] [--out FILE]

Run on an H100 on 2026-12-06 (docs/measurements.md: at 7B ours 41.11 ms, vLLM's 148.67 ms). Per
shape (a config in configs/, vLLM's dummy weights, eager: the load path is the same with CUDA
graphs): the trainer's tensors are the checkpoint's (`ModelShape.from_hf_config`: names, shapes,
bf16), on the same GPU as the engine. The engine sleeps (level 2) and wakes its weights only, the
colocated sync's state. Paths, each timed warm (median of `--iters` after one cold sync) from the
first byte packed to the engine's answer:

  ours   `WeightSender` (cuda_ipc, 512 MiB buckets, checksums) -> `VLLMRolloutActor.update_weights`
         -> the lifecycle's worker extension in vLLM's worker: it opens the trainer's staging
         buffers, verifies every bucket, and loads through vLLM's own `model.load_weights`.
  vllm   vLLM's own weight transfer as its docs run it colocated: `start_weight_update`,
         `IPCWeightTransferEngine.trainer_send_weights` (packed, CUDA IPC) calling `update_weights`
         per chunk, `finish_weight_update` (`VLLMEngine.load_weights`).
  d2d    one copy of the same bytes, device to device: the ceiling for a path that copies once.

Both paths are verified: the workers' checksum of vLLM's parameters (`lifecycle_checksum`) after
ours equals the one after vLLM's, so both loaded the same bytes. Exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
# vLLM's share of the GPU (weights, activations, KV cache) beside the trainer's copies and staging.
MEMORY_UTILIZATION = {"qwen2-0.5b": 0.15, "qwen2-7b": 0.35}


@functools.cache
def _sglang_bench() -> Any:
    """bench_sglang_sync's helpers (`timed`, `d2d`, `trainer_tensors`, `colocated_sender`,
    `path_figures`): torch and the project only, no SGLang."""
    spec = importlib.util.spec_from_file_location(
        "bench_sglang_sync", REPO / "benchmarks" / "bench_sglang_sync.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_sglang_sync", module)
    spec.loader.exec_module(module)
    return module


def engine_arguments(name: str) -> dict[str, Any]:
    """How the bench starts vLLM for a shape in configs/ (`VLLMEngine`'s keyword arguments)."""
    return {
        "model": str(REPO / "configs" / name),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "gpu_memory_utilization": MEMORY_UTILIZATION.get(name, 0.3),
        "max_model_len": 4096,
        "dtype": "bfloat16",
        "seed": 0,
        "sleep_level": 2,
    }


def run_shape(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from actor_integration.engines.vllm import VLLMEngine, VLLMRolloutActor

    helpers = _sglang_bench()
    # vLLM's own path pickles CUDA IPC handles to EngineCore, which reads this when it starts.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    started = time.monotonic()
    engine = VLLMEngine(**engine_arguments(name))
    row: dict[str, Any] = {"shape": name, "engine_start_s": round(time.monotonic() - started, 1)}
    sender = None
    try:
        weights = helpers.trainer_tensors(REPO / "configs" / name)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        row.update({"tensors": len(weights), "gb": round(nbytes / GB, 3)})
        actor = VLLMRolloutActor(engine)
        actor.sleep()
        actor.wake_up(["weights"])  # the colocated sync: weights resident, KV cache released
        sender = helpers.colocated_sender(actor.update_weights, args.bucket_mib)
        version = iter(range(1, 10_000))
        reports: list[Any] = []
        ours = helpers.timed(lambda: reports.append(sender.send(next(version), weights.items())), args.iters)
        ours_sum = engine.weights_checksum()
        # Where our time goes: the sender's phases, the workers' (verify, load), and the floor any
        # update call pays: a worker call that moves nothing (collective_rpc round trip).
        engine_ms = actor.engine_timings()
        nothing = helpers.timed(lambda: engine._rpc("lifecycle_hello", "{}"), args.iters)
        row["ours_breakdown_ms"] = {
            **{k: round(v, 2) for k, v in reports[-1].phases_ms.items()},
            **{f"engine_{k}": v for k, v in engine_ms.items()},
            "empty_worker_call_ms": round(statistics.median(nothing) * 1e3, 2),
        }
        # The workers let go of the trainer's staging before the sender frees it, as the rollout's
        # sleep does; vLLM's path then runs without our staging copy on the GPU.
        engine.release_payload_handles()
        sender.close()
        sender = None
        torch.cuda.empty_cache()

        def theirs_once() -> None:
            engine.load_weights(next(version), [list(weights.items())], round_index=0, final=True)

        theirs = helpers.timed(theirs_once, args.iters)
        vllm_sum = engine.weights_checksum()
        torch.cuda.empty_cache()
        ceiling = helpers.d2d(nbytes, args.iters)
        row.update(helpers.path_figures(nbytes, ours=ours, vllm=theirs, d2d=ceiling))
        row["identical_engine_weights"] = ours_sum == vllm_sum
        row["ours_over_vllm"] = round(row["vllm_ms"] / row["ours_ms"], 2)
    finally:
        if sender is not None:
            sender.close()
        engine.shutdown()
        torch.cuda.empty_cache()
    return row


def _gpu_with_vllm() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    helpers = _sglang_bench()
    args = helpers.parse_sync_arguments((__doc__ or "").split("\n")[0], argv)
    if not _gpu_with_vllm():
        print(
            "bench_vllm_sync: needs a CUDA GPU and vllm 0.26.0 (scripts/gpu_vllm.sh sets them up on the GPU "
            "machine: its `bench` step runs this)",
            file=sys.stderr,
        )
        return 2
    return int(helpers.run_shapes(args, run_shape, "vllm", "vllm", _vllm_version))


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":  # vLLM's EngineCore is a spawned process: keep the work under main
    sys.exit(main())

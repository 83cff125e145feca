"""Weight sync into a real `sglang.Engine` on the trainer's GPU: ours next to slime's own way, with the
device-to-device ceiling, at two shapes, in one run.

    python benchmarks/bench_sglang_sync.py [--shapes qwen2-0.5b,qwen2-7b] [--iters 5] [--out FILE]

Per shape (a config in configs/, SGLang's dummy weights, CUDA graphs off: the load path is the
same with them): the trainer's tensors are the checkpoint's (`ModelShape.from_hf_config`: names,
shapes, bf16), on the same GPU as the engine. Paths, each timed warm (median of `--iters` after one
cold sync) from the first byte packed to the engine's answer:

  ours   `WeightSender` (cuda_ipc, 512 MiB buckets, checksums) -> `RolloutActor.update_weights` ->
         SGLang's schedulers, which open the trainer's staging buffers (handles cached across
         syncs), verify every bucket and load through SGLang's own weight loaders: one engine call
         per version, whatever the bucket count.
  slime  slime's colocated push: tensors in order into chunks of 512 MiB, one FlattenedTensorBucket
         per dtype (a fresh flattened copy), serialized with a fresh CUDA IPC handle, one
         `update_weights_from_tensor(load_format="flattened_bucket")` per bucket, `ipc_collect()`.
  d2d    one copy of the same bytes, device to device: the ceiling for a path that copies once.

Both paths are verified: SGLang's own checksum of its parameters after ours equals the one after
slime's (`check_weights`), so both loaded the same bytes. A shape's whole update in one round
means the trainer holds one staging copy of the model (15.2 GB at 7B); SGLang's side holds none
(its loaders read the trainer's buffers in place), where `flattened_bucket` payloads handed over
whole would need a second copy there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
MEM_FRACTION = {"qwen2-0.5b": 0.15, "qwen2-7b": 0.35}  # weights + a KV pool, beside the trainer's copies


def _bench_sync() -> Any:
    spec = importlib.util.spec_from_file_location("bench_sync", REPO / "benchmarks" / "bench_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_sync", module)
    spec.loader.exec_module(module)
    return module


def trainer_tensors(config_dir: Path) -> dict[str, torch.Tensor]:
    from actor_integration.weight_sync.checkpoint_layouts import ModelShape, materialize, tensor_specs

    shape = ModelShape.from_hf_config(config_dir)
    return materialize(tensor_specs(shape), "cuda", seed=1)


def engine_arguments(name: str) -> dict[str, Any]:
    """How the bench starts SGLang for a shape in configs/: dummy weights, CUDA graphs off (the
    load path is the same with them), a KV pool beside the trainer's copies."""
    return {
        "model_path": str(REPO / "configs" / name),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "mem_fraction_static": MEM_FRACTION.get(name, 0.3),
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "context_length": 4096,
        "dtype": "bfloat16",
        "random_seed": 0,
    }


def timed(fn: Any, iters: int) -> list[float]:
    """Seconds per call, after one cold call (handles opened, kernels compiled)."""
    fn()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def d2d(nbytes: int, iters: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters + 1):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return times[1:]


def colocated_sender(engine_call: Any, bucket_mib: int, transport: Any = None) -> Any:
    """The trainer's one-rank sender into `engine_call` (a rollout actor's `update_weights`) on the
    same GPU: cuda_ipc (or `transport`), `bucket_mib` buckets, checksums, a 600 s deadline."""
    from actor_integration.weight_sync import RankSlot, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    return WeightSender(
        RankSlot.single(0),
        None,
        CudaIpcSender(device=0) if transport is None else transport,
        rank=0,
        engine_call=engine_call,
        bucket_bytes=bucket_mib << 20,
        deadline_s=600,
    )


def path_figures(nbytes: int, **paths: list[float]) -> dict[str, Any]:
    """Each path's median ms, GB/s and every sync's ms, from its seconds per sync (`ours=[...]`)."""
    out: dict[str, Any] = {}
    for name, seconds in paths.items():
        median = statistics.median(seconds)
        out[f"{name}_ms"] = round(median * 1e3, 2)
        out[f"{name}_gbps"] = round(nbytes / median / GB, 1)
    out.update({f"{name}_all_ms": [round(t * 1e3, 2) for t in seconds] for name, seconds in paths.items()})
    return out


def run_shape(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from actor_integration.rollout import RolloutActor, SGLangEngine

    config = REPO / "configs" / name
    started = time.monotonic()
    engine = SGLangEngine(**engine_arguments(name))
    row: dict[str, Any] = {"shape": name, "engine_start_s": round(time.monotonic() - started, 1)}
    try:
        weights = trainer_tensors(config)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        row.update({"tensors": len(weights), "gb": round(nbytes / GB, 3)})
        actor = RolloutActor(engine)
        actor.sleep()
        actor.wake_up(["weights"])  # the colocated sync: weights resident, KV cache released
        sender = colocated_sender(actor.update_weights, args.bucket_mib)
        version = iter(range(1, 10_000))
        reports: list[Any] = []
        ours = timed(lambda: reports.append(sender.send(next(version), weights.items())), args.iters)
        ours_sum = actor.weights_checksum()
        # Where our time goes: the sender's phases and the engine's (inside SGLang's scheduler), and
        # the floor any update call pays: a receiver call that moves nothing, and SGLang's own
        # lightest round trip to the scheduler (flush_cache) on the same engine.
        engine_ms = actor.engine_timings()
        nothing = timed(lambda: engine._scheduler("hello", timeout_s=60), args.iters)
        flush = timed(lambda: engine.engine.flush_cache(), args.iters)
        row["ours_breakdown_ms"] = {
            **{k: round(v, 2) for k, v in reports[-1].phases_ms.items()},
            **{f"engine_{k}": v for k, v in engine_ms.items()},
            "empty_receiver_call_ms": round(statistics.median(nothing) * 1e3, 2),
            "sglang_flush_round_trip_ms": round(statistics.median(flush) * 1e3, 2),
        }

        bench_sync = _bench_sync()
        groups = [g for chunk in bench_sync.slime_buckets(weights, args.bucket_mib << 20) for g in chunk]
        raw = engine.engine
        sessions = callable(getattr(raw, "begin_weight_update", None))

        def slime() -> None:
            if sessions:
                raw.begin_weight_update()
            for group in groups:
                bucket = FlattenedTensorBucket(named_tensors=[(n, weights[n]) for n in group])
                payload = MultiprocessingSerializer.serialize(
                    {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
                    output_str=True,
                )
                ok, message = raw.update_weights_from_tensor(
                    named_tensors=[payload], load_format="flattened_bucket", flush_cache=False
                )
                assert ok, message
                del bucket, payload
                torch.cuda.ipc_collect()
            if sessions:
                raw.end_weight_update()

        theirs = timed(slime, args.iters)
        slime_sum = actor.weights_checksum()
        # The schedulers let go of the trainer's staging before the sender frees it, as the
        # rollout's sleep does (benchmarks/probe_sglang_release_order.py runs the other order).
        engine.release_payload_handles()
        sender.close()
        torch.cuda.empty_cache()
        ceiling = d2d(nbytes, args.iters)
        row.update(path_figures(nbytes, ours=ours, slime=theirs, d2d=ceiling))
        row.update({"slime_buckets": len(groups), "identical_engine_weights": ours_sum == slime_sum})
        row["ours_over_slime"] = round(row["slime_ms"] / row["ours_ms"], 2)
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()
    return row


def parse_sync_arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    """A sync bench's arguments, checked before any GPU work (a wrong shape or count is the parser's
    error); `shape_list` holds the shapes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--shapes", default="qwen2-0.5b,qwen2-7b", help="configs/ directories, comma-separated"
    )
    parser.add_argument("--iters", type=int, default=5, help="warm syncs per path (after one cold one)")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.shape_list = [s for s in args.shapes.split(",") if s]
    missing = [s for s in args.shape_list if not (REPO / "configs" / s / "config.json").is_file()]
    if missing or not args.shape_list:
        known = sorted(p.parent.name for p in (REPO / "configs").glob("*/config.json"))
        parser.error(
            f"unknown shapes {missing or args.shapes!r}: give directories of configs/ ({', '.join(known)})"
        )
    if args.iters < 1 or args.bucket_mib < 1:
        parser.error(f"--iters ({args.iters}) and --bucket-mib ({args.bucket_mib}) must be at least 1")
    return args


def print_rows(rows: list[dict[str, Any]], theirs: str) -> None:
    """The table of a sync bench's rows (ours, `theirs`, the d2d ceiling), then where our time goes."""
    print(
        f"{'shape':<11} {'GB':>6} {'ours ms':>8} {theirs + ' ms':>9} {'d2d ms':>7} {'ours GB/s':>10} "
        f"{theirs + ' GB/s':>11} {'d2d GB/s':>9} {'ours/' + theirs:>10} same"
    )
    for r in rows:
        print(
            f"{r['shape']:<11} {r['gb']:>6} {r['ours_ms']:>8} {r[theirs + '_ms']:>9} {r['d2d_ms']:>7} "
            f"{r['ours_gbps']:>10} {r[theirs + '_gbps']:>11} {r['d2d_gbps']:>9} "
            f"{r['ours_over_' + theirs]:>9}x {r['identical_engine_weights']}"
        )
    for r in rows:
        print(f"{r['shape']} ours, where the time goes (ms): {r['ours_breakdown_ms']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_sync_arguments(__doc__.split("\n")[0], argv)
    if not torch.cuda.is_available():
        print(
            "bench_sglang_sync: needs a GPU and sglang (the sglang extra; scripts/gpu_sglang.sh sets it up on "
            "the GPU machine)",
            file=sys.stderr,
        )
        return 2
    return run_shapes(args, run_shape, "slime", "sglang", _version)


def run_shapes(
    args: argparse.Namespace,
    shape_run: Callable[[str, argparse.Namespace], dict[str, Any]],
    baseline: str,
    engine: str,
    version: Callable[[], str],
) -> int:
    """A sync bench's run on GPU 0 (this one's and bench_vllm_sync's): each shape's row, the table
    beside `baseline`, the JSON (`--out`, with the engine's version under `engine`); 1 where an
    engine's weights differ from the trainer's."""
    torch.cuda.set_device(0)
    rows = [shape_run(s, args) for s in args.shape_list]
    print_rows(rows, baseline)
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, engine: version()}, indent=2))
    return 0 if all(r["identical_engine_weights"] for r in rows) else 1


def _version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


if __name__ == "__main__":  # SGLang starts its scheduler with the spawn method
    sys.exit(main())

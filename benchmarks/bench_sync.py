"""Weight-sync throughput on one GPU: trainer process → rollout process, next to a D2D copy.

    python benchmarks/bench_sync.py --out out/bench_sync.json [--gib 8] [--bucket-mib 512]

Paths, each in fresh processes (a producer and a consumer on the same GPU, joined by a pipe) so
no path inherits another's cached handles or warmed allocator:

  d2d         one process copies the bytes device to device: the ceiling.
  cuda_ipc    ours: staging buffers exported once, handles opened once and reused.
  cuda_ipc+v  the same with the receiver verifying every bucket's checksum (the default).
  shm         ours: one host bucket in /dev/shm, one bucket per round.
  slime       slime-style: a fresh flattened bucket and a fresh IPC handle per bucket (opened,
              copied, closed, then `ipc_collect`); slime's per-bucket `empty_cache` is left out,
              which only flatters this baseline.

Two timed regions per path, reported separately:
  handoff     from handing the (already packed) buckets over to the consumer's acknowledgement:
              descriptors through the pipe, open (or cached lookup), optional verification, the
              consumer's copy into its weights, its synchronize. Medians over warm iterations
              (the first, cold iteration is reported apart for cuda_ipc: it opens the handles).
  end_to_end  the same plus the sender packing its weights into the buckets.

GB/s are payload bytes per second (a D2D copy moves each byte twice: read and write).
`checksum` compares int16 word sums of the sender's and the receiver's weights after the last
iteration (a sanity check; the tests prove bit-exactness).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_GBPS = 1600.0
TARGET_VS_SLIME = 4.5


def make_weights(gib: float, tensor_mib: int) -> dict[str, torch.Tensor]:
    count = max(1, int(gib * 1024 // tensor_mib))
    numel = tensor_mib * (1 << 20) // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(numel, generator=g, device="cuda", dtype=torch.float32).to(
            torch.bfloat16
        )
        for i in range(count)
    }


def word_sum(tensors: dict[str, torch.Tensor]) -> int:
    return sum(int(t.view(torch.int16).sum(dtype=torch.int64)) for t in tensors.values())


# ------------------------------------------------------------------ d2d ceiling


def run_d2d(args: argparse.Namespace, results: Any) -> None:
    src = make_weights(args.gib, args.tensor_mib)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    times = []
    for _ in range(args.iters + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    results.put({"path": "d2d", "bytes": nbytes, "handoff": times[1:], "end_to_end": times[1:]})


# ------------------------------------------------------------------ our transports


def ours_producer(args: argparse.Namespace, transport_name: str, conn: Any, results: Any) -> None:
    from actor_integration.weight_sync import RankPayload, iter_buckets
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from actor_integration.weight_sync.shm import ShmSender

    torch.cuda.set_device(0)
    weights = make_weights(args.gib, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    sender = CudaIpcSender(device=0) if transport_name == "cuda_ipc" else ShmSender()
    per_round = None if transport_name == "cuda_ipc" else 1
    handoff, end_to_end = [], []
    conn.send(("expect", word_sum(weights)))
    for iteration in range(args.iters + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        buckets = list(iter_buckets(weights, args.bucket_mib << 20))
        rounds = [buckets] if per_round is None else [[b] for b in buckets]
        waited = 0.0
        for round_index, members in enumerate(rounds):
            sender.begin_round(iteration + 1, round_index)
            exported = [sender.export(position, b) for position, b in enumerate(members)]
            sender.ready()
            payload = RankPayload(
                iteration + 1,
                round_index,
                round_index == len(rounds) - 1,
                0,
                0,
                sender.name,
                sender.sender_id,
                sender.gpu,
                tuple(m for m, _ in exported),
                tuple(d for _, d in exported),
            )
            t0 = time.perf_counter()
            conn.send(("round", payload))
            assert conn.recv() == "ack"
            waited += time.perf_counter() - t0
        end_to_end.append(time.perf_counter() - start)
        handoff.append(waited)
    conn.send(("done", None))
    checksum_match = conn.recv()
    sender.close()
    row = {"bytes": nbytes, "checksum_match": checksum_match, "cold_handoff": handoff[0]}
    results.put({"path": transport_name, "handoff": handoff[1:], "end_to_end": end_to_end[1:], **row})


def ours_consumer(args: argparse.Namespace, verify: bool, conn: Any) -> None:
    from actor_integration.weight_sync import WeightReceiver

    torch.cuda.set_device(0)
    receiver = WeightReceiver(verify=verify)
    dst: dict[str, torch.Tensor] = {}
    expect = None
    while True:
        kind, value = conn.recv()
        if kind == "expect":
            expect = value
        elif kind == "round":
            with receiver.open([value]) as received:
                for name, view in received.shards[0]:
                    target = dst.get(name)
                    if target is None:
                        target = dst[name] = torch.empty(view.shape, dtype=view.dtype, device="cuda")
                    target.copy_(view, non_blocking=True)
                torch.cuda.synchronize()
            conn.send("ack")
        else:
            conn.send(word_sum(dst) == expect)
            receiver.release()
            return


# ------------------------------------------------------------------ slime-style: fresh handle per bucket


def slime_producer(args: argparse.Namespace, conn: Any, results: Any) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    weights = make_weights(args.gib, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    names = list(weights)
    per_bucket = max(1, (args.bucket_mib << 20) // (weights[names[0]].numel() * 2))
    groups = [names[i : i + per_bucket] for i in range(0, len(names), per_bucket)]
    conn.send(("expect", word_sum(weights)))

    def flatten(group: list[str]) -> torch.Tensor:
        return torch.cat([weights[n].reshape(-1) for n in group])  # a fresh allocation, as slime's bucket

    handoff, end_to_end = [], []
    for _ in range(args.iters + 1):
        # handoff: buckets packed beforehand, each shared with a fresh handle and opened once.
        packed = [flatten(g) for g in groups]
        torch.cuda.synchronize()
        waited = 0.0
        for group, bucket in zip(groups, packed, strict=True):
            t0 = time.perf_counter()
            conn.send(("bucket", (group, reduce_tensor(bucket))))
            assert conn.recv() == "ack"
            waited += time.perf_counter() - t0
        del packed, bucket
        torch.cuda.ipc_collect()
        handoff.append(waited)
        # end to end: pack, share, hand over, free, per bucket.
        torch.cuda.synchronize()
        start = time.perf_counter()
        for group in groups:
            bucket = flatten(group)
            conn.send(("bucket", (group, reduce_tensor(bucket))))
            assert conn.recv() == "ack"
            del bucket
            torch.cuda.ipc_collect()
        end_to_end.append(time.perf_counter() - start)
    conn.send(("done", None))
    checksum_match = conn.recv()
    results.put(
        {
            "path": "slime",
            "bytes": nbytes,
            "handoff": handoff[1:],
            "end_to_end": end_to_end[1:],
            "checksum_match": checksum_match,
        }
    )


def slime_consumer(args: argparse.Namespace, conn: Any) -> None:
    torch.cuda.set_device(0)
    dst: dict[str, torch.Tensor] = {}
    expect = None
    while True:
        kind, value = conn.recv()
        if kind == "expect":
            expect = value
        elif kind == "bucket":
            group, (rebuild, rebuild_args) = value
            bucket = rebuild(*rebuild_args)  # opens a fresh handle
            offset = 0
            for name in group:
                target = dst.get(name)
                n = (args.tensor_mib << 20) // 2
                if target is None:
                    target = dst[name] = torch.empty(n, dtype=torch.bfloat16, device="cuda")
                target.copy_(bucket[offset : offset + n], non_blocking=True)
                offset += n
            torch.cuda.synchronize()
            del bucket  # closes the handle
            conn.send("ack")
        else:
            conn.send(word_sum(dst) == expect)
            return


# ------------------------------------------------------------------ driver


def _collect(results: Any, procs: list[Any], what: str) -> dict[str, Any]:
    """The row a path's producer puts on the queue, or an error row if a process died first."""
    while True:
        try:
            row: dict[str, Any] = results.get(timeout=5)
            return row
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (None, 0)]
            if dead:
                return {"path": what, "error": f"process exited with code {dead[0].exitcode}"}


def run_pair(
    what: str, producer: Any, producer_args: tuple[Any, ...], consumer: Any, consumer_args: tuple[Any, ...]
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ours, theirs = ctx.Pipe()
    consumer_proc = ctx.Process(target=consumer, args=(*consumer_args, theirs), daemon=True)
    producer_proc = ctx.Process(target=producer, args=(*producer_args, ours, results), daemon=True)
    consumer_proc.start()
    producer_proc.start()
    result = _collect(results, [producer_proc, consumer_proc], what)
    for proc in (producer_proc, consumer_proc):
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return result


def run_alone(what: str, target: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results), daemon=True)
    proc.start()
    result = _collect(results, [proc], what)
    proc.join(60)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bf16 weight bytes to move (GiB)")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--tensor-mib", type=int, default=256, help="size of each weight tensor")
    parser.add_argument("--iters", type=int, default=5, help="warm iterations (one cold one runs first)")
    parser.add_argument("--shm-iters", type=int, default=2, help="warm iterations for the slow host path")
    parser.add_argument("--paths", default="d2d,cuda_ipc,cuda_ipc+v,shm,slime")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sync: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tensor_mib > args.bucket_mib:
        parser.error("--tensor-mib must not exceed --bucket-mib")
    paths = args.paths.split(",")
    rows: list[dict[str, Any]] = []
    for path in paths:
        print(f"running {path} ...", flush=True)
        if path == "d2d":
            result = run_alone(path, run_d2d, (args,))
        elif path in ("cuda_ipc", "cuda_ipc+v", "shm"):
            transport = "shm" if path == "shm" else "cuda_ipc"
            path_args = argparse.Namespace(
                **{**vars(args), "iters": args.shm_iters if path == "shm" else args.iters}
            )
            result = run_pair(
                path, ours_producer, (path_args, transport), ours_consumer, (path_args, path != "cuda_ipc")
            )
            result["path"] = path
        elif path == "slime":
            result = run_pair(path, slime_producer, (args,), slime_consumer, (args,))
        else:
            parser.error(f"unknown path {path!r}")
        if "error" in result:
            print(f"  {path} failed: {result['error']}", flush=True)
        rows.append(result)
    failed = [row for row in rows if "error" in row]
    rows = [row for row in rows if "error" not in row]

    def gbps(row: dict[str, Any], region: str) -> float:
        return float(row["bytes"] / statistics.median(row[region]) / 1e9)

    by_path = {row["path"]: row for row in rows}
    ceiling = gbps(by_path["d2d"], "handoff") if "d2d" in by_path else None
    slime = by_path.get("slime")
    table = []
    header = f"{'path':<12} {'timed region':<12} {'GiB':>6} {'seconds':>9} {'GB/s':>8} {'x D2D':>7} {'x slime':>8}  checksum"
    print(header)
    print("-" * len(header))
    for row in rows:
        for region in ("handoff", "end_to_end"):
            if row["path"] == "d2d" and region == "end_to_end":
                continue
            value = gbps(row, region)
            entry = {
                "path": row["path"],
                "region": region,
                "bytes": row["bytes"],
                "seconds": statistics.median(row[region]),
                "gbps": value,
                "vs_d2d": value / ceiling if ceiling else None,
                "vs_slime": value / gbps(slime, region) if slime else None,
                "checksum_match": row.get("checksum_match"),
                "samples": row[region],
            }
            if "cold_handoff" in row and region == "handoff":
                entry["cold_seconds"] = row["cold_handoff"]
            table.append(entry)
            print(
                f"{row['path']:<12} {region:<12} {row['bytes'] / 2**30:>6.2f} {entry['seconds']:>9.4f} {value:>8.1f} "
                f"{entry['vs_d2d'] or float('nan'):>7.2f} {entry['vs_slime'] or float('nan'):>8.2f}  {row.get('checksum_match', '-')}"
            )
    verdict = {}
    ours = next((e for e in table if e["path"] == "cuda_ipc" and e["region"] == "handoff"), None)
    if ours is not None:
        verdict["cuda_ipc_gbps_target"] = TARGET_GBPS
        verdict["cuda_ipc_meets_gbps"] = ours["gbps"] >= TARGET_GBPS
        if ours["vs_slime"] is not None:
            verdict["cuda_ipc_vs_slime_target"] = TARGET_VS_SLIME
            verdict["cuda_ipc_meets_vs_slime"] = ours["vs_slime"] >= TARGET_VS_SLIME
        print(
            f"target: cuda_ipc handoff >= {TARGET_GBPS:.0f} GB/s payload and >= {TARGET_VS_SLIME}x slime-style: "
            f"{ours['gbps']:.0f} GB/s, {ours['vs_slime'] or float('nan'):.2f}x"
        )
    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "timed_regions": {
            "handoff": "descriptors to the consumer, open or cached lookup, optional checksum verification, "
            "consumer copy into its weights, synchronize, acknowledgement; buckets already packed",
            "end_to_end": "handoff plus the sender packing its weights into the buckets (and slime's fresh "
            "allocation per bucket)",
        },
        "rows": table,
        "failed": failed,
        "verdict": verdict,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

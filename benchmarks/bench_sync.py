"""Weight-sync throughput on one GPU: trainer process -> rollout process, next to a D2D copy.

    python benchmarks/bench_sync.py --out out/bench_sync.json [--gib 8] [--layout uniform|dense|moe]
        [--tensor-mib 32] [--bucket-mib 512] [--paths d2d_flat,slime,cuda_ipc+v,...]

Layouts (`--layout`):
  uniform      N equal bf16 tensors of `--tensor-mib` (the default).
  dense        Qwen3-4B, from its public config (hidden 2560, 36 layers, 32 q / 8 kv heads of 128,
               intermediate 9728, vocab 151936), with an lm_head of its own (Qwen3-4B ties it; 8B and
               up do not): 399 bf16 tensors from 256-byte q/k norms to a 742 MiB embedding and head,
               both larger than a 512 MiB bucket; the whole model is 8.2 GiB.
  moe          Qwen3-30B-A3B, from its public config (hidden 2048, 48 layers, 32 q / 4 kv heads of 128,
               128 experts of moe_intermediate 768, vocab 151936, untied), cut to the layers that fit
               `--gib` (8: 6 layers, 2,367 tensors, 8.1 GiB): 3 MiB experts, a 594 MiB embedding and
               head, and an fp32 router bias per layer (DeepSeek-V3 style; Qwen3-MoE itself is bf16).
  Shapes and names: `actor_integration.weight_sync.checkpoint_layouts`.

Paths, each in fresh processes (a producer and a consumer on the same GPU, joined by a pipe) so
no path inherits another's cached handles, compiled kernels in memory or warmed allocator:

  d2d          one process copies tensor by tensor, device to device (launch-bound for small tensors).
  d2d_flat     one process copies the same bytes as one flat buffer: the bandwidth ceiling.
  cuda_ipc+v   ours, the default: `WeightSender` (one round, staging exported once, one fused
               gather+checksum kernel per bucket, the checksums left in the buffers, handed over
               without waiting for the device) -> `RolloutActor` whose engine loads in place: its
               stream waits on the sender's event, every bucket is verified in one launch and the
               one scatter kernel straight into the engine's tensors is gated by the verdict
               (three passes; a corrupt round leaves the previous weights).
  cuda_ipc+2p  ours, verified in two passes (`WeightReceiver(keep_previous=False)`): the copy into
               the engine's tensors checksums what it reads and the round is compared after it (a
               corrupt round leaves the weights invalid until the sender's re-send loads).
  cuda_ipc     the same without verification on the receiver.
  stream+v     ours, memory-bounded: one bucket per round, one staging buffer (the engine's
               weights are unknown until the last round: a direct-writing engine that does not stage).
  pipe+v       the same, pipelined: two staging buffers, round r + 1 packed while round r loads.
  arena+v      ours: the trainer writes into `sender.arena(...)` (outside the timed region, as
               its gather/convert would), so the sender only checksums.
  arena+2p     the same, verified in two passes on the receiver.
  arena        the same without checksums or verification: one copy end to end.
  shm          ours, the host path: GPU pack with checksum, one DMA into a pinned /dev/shm file,
               one DMA up on the receiver, verify, scatter; one bucket per round.
  slime        slime-style: tensors in order into buckets of `--bucket-mib` (a new bucket when the
               next tensor would overflow it, a larger tensor alone), each bucket flattened per
               dtype into a fresh tensor shared with a fresh IPC handle (opened, copied into the
               engine's tensors, closed, then `ipc_collect`); slime's per-bucket `empty_cache` is
               left out, which only flatters this baseline.

Two timed regions per path:
  end_to_end  `sender.send(version, weights)`: from "the trainer has new weights" to "the engine
              acknowledged them" (layout, packing, checksums, hand-off, verification, copy).
  handoff     the part of it spent waiting for the engine: from handing the round over to the
              acknowledgement (for slime: the same, buckets packed beforehand). Ours hands over
              while the packing still runs on the device, so its handoff includes that remainder.
Medians over warm iterations (the first, cold one compiles kernels and opens handles). GB/s are
payload bytes per second (a D2D copy moves each byte twice: read and write). "bit-exact" compares
every tensor of the engine with the trainer's after the last sync (a position-weighted checksum
per tensor). `phases` break the warm syncs down (sender: pack / ready / engine wait; receiver:
open / verify / copy), and `--profile DIR` writes a torch.profiler trace of one sync per side.
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

PATHS = (
    "d2d",
    "d2d_flat",
    "cuda_ipc+v",
    "cuda_ipc+2p",
    "cuda_ipc",
    "stream+v",
    "pipe+v",
    "arena+v",
    "arena+2p",
    "arena",
    "shm",
    "slime",
)
LAYOUT_NAMES = ("uniform", "dense", "moe")
PATH_TIMEOUT_S = 240.0


def layout_specs(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor the run sends."""
    if args.layout == "uniform":
        count = max(1, int(args.gib * 1024 // args.tensor_mib))
        numel = int(args.tensor_mib * (1 << 20)) // 2
        return [(f"layers.{i}.weight", (numel,), torch.bfloat16) for i in range(count)]
    from actor_integration.weight_sync.checkpoint_layouts import LAYOUTS, layers_within, tensor_specs

    shape = LAYOUTS[args.layout]
    return tensor_specs(shape, layers=layers_within(shape, int(args.gib * 2**30)))


def describe_layout(args: argparse.Namespace) -> str:
    specs = layout_specs(args)
    sizes = [_nbytes(shape, dtype) for _name, shape, dtype in specs]
    dtypes = sorted({str(dtype).removeprefix("torch.") for _n, _s, dtype in specs})
    over = sum(1 for n in sizes if n > args.bucket_mib << 20)
    what = f"{args.tensor_mib:g} MiB bf16 tensors"
    if args.layout != "uniform":
        from actor_integration.weight_sync.checkpoint_layouts import LAYOUTS, layers_within

        shape = LAYOUTS[args.layout]
        layers = layers_within(shape, int(args.gib * 2**30))
        what = f"{shape.name}-shaped, {layers} of its {shape.layers} layers ({shape.note or 'as its config'})"
    return (
        f"layout {args.layout}: {what}; {len(specs)} tensors, {sum(sizes) / 2**30:.2f} GiB, "
        f"{min(sizes)} B to {max(sizes) / 2**20:.1f} MiB, {over} larger than a {args.bucket_mib} MiB bucket, "
        f"dtypes {', '.join(dtypes)}"
    )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def make_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from actor_integration.weight_sync.checkpoint_layouts import materialize

    return materialize(layout_specs(args), "cuda", seed=0)


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's WSUM64 (position-weighted word sums): compared name by name, bit-exact."""
    from actor_integration.weight_sync.buckets import WSUM64, checksum

    out = {}
    for name, tensor in tensors.items():
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        out[name] = checksum(data, data.numel(), WSUM64)
    return out


def mismatches(got: dict[str, torch.Tensor], expected: dict[str, int]) -> int:
    """How many tensors differ from the trainer's (missing ones count)."""
    have = fingerprints(got)
    return sum(1 for name, value in expected.items() if have.get(name) != value)


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ------------------------------------------------------------------ d2d ceilings


def run_d2d(args: argparse.Namespace, flat: bool, results: Any) -> None:
    src = make_weights(args)
    nbytes = nbytes_of(src)
    if flat:
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        pairs = [(b, a)]
    else:
        pairs = [(torch.empty_like(v), v) for v in src.values()]
    times = []
    for _ in range(args.iters + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, s in pairs:
            dst.copy_(s)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    results.put(
        {
            "path": "d2d_flat" if flat else "d2d",
            "bytes": nbytes,
            "handoff": times[1:],
            "end_to_end": times[1:],
        }
    )


# ------------------------------------------------------------------ ours: WeightSender -> RolloutActor


class BenchEngine:
    """A `RolloutEngine` that loads in place into preallocated tensors (the engine's weights)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        from actor_integration.weight_sync import WeightTargets

        self.weights = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
        self.weight_version = 0
        self.stages_weights = False
        self._one_round = WeightTargets([self.weights], complete=True)
        self._streamed = WeightTargets([self.weights])

    def weight_targets(self, version: int, *, round_index: int, final: bool) -> Any:
        return self._one_round if round_index == 0 and final else self._streamed

    def weights_written(self, version: int, names: Any, *, round_index: int, final: bool) -> None:
        if final:
            self.weight_version = version

    def load_weights(self, version: int, shards: Any, *, round_index: int, final: bool) -> None:
        for name, view in shards[0]:
            self.weights[name].copy_(view)

    def generate(self, prompts: Any, *, max_new_tokens: int) -> list[list[int]]:
        return [[] for _ in prompts]

    def release_memory_occupation(self, tags: Any = None) -> None: ...

    def resume_memory_occupation(self, tags: Any = None) -> None: ...

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> bool:
        return True

    def weights_checksum(self) -> str:
        return ""


def _log_like_production(args: argparse.Namespace, side: str) -> None:
    """Lifecycle events as a deployment writes them: JSON lines to a file, not the console."""
    import tempfile

    import lifecycle

    lifecycle.configure_logging(
        json_path=Path(tempfile.gettempdir()) / f"bench_sync-{args.label}{side}.jsonl"
    )


def ours_producer(args: argparse.Namespace, path: str, conn: Any, results: Any) -> None:
    from actor_integration.weight_sync import RankSlot, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from actor_integration.weight_sync.shm import ShmSender

    _log_like_production(args, f"{path}-sender")
    torch.cuda.set_device(0)
    weights = make_weights(args)
    conn.send(("shapes", {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}))
    conn.recv()

    calls: list[float] = []  # the engine call's round trip, as the sender's thread sees it

    def engine_call(version: int, payloads: Any) -> Any:
        t0 = time.perf_counter()
        conn.send(("update_weights", (version, payloads)))
        status, value = conn.recv()
        calls.append(time.perf_counter() - t0)
        if status == "error":
            raise value
        return value

    transport = ShmSender() if path == "shm" else CudaIpcSender(device=0)
    sender = WeightSender(
        RankSlot.single(0),
        None,
        transport,
        rank=0,
        engine_call=engine_call,
        bucket_bytes=args.bucket_mib << 20,
        deadline_s=300.0,
        round_buckets=1 if path in ("stream+v", "pipe+v") else -1,
        checksums=path != "arena",
        corrupt_resends=0,  # a corrupt round is a failed run here, not a re-send to time
        pipelined=path == "pipe+v",
    )
    source: Any = weights
    if path.startswith("arena"):
        arena = sender.arena(weights)
        for name, tensor in weights.items():  # the trainer's convert writing in place (not timed)
            arena[name].copy_(tensor)
        source = arena
    iters = args.shm_iters if path == "shm" else args.iters
    handoff, end_to_end, phases, receiver_phases = [], [], [], []
    profiled = args.profile is not None and path in args.profile_paths.split(",")
    for iteration in range(iters + 1 + profiled):
        profile = profiled and iteration == iters + 1  # one more sync, left out of the figures
        if profile:
            conn.send(("profile", True))
            conn.recv()
        torch.cuda.synchronize()
        context: Any = _profiler() if profile else _null()
        with context as prof:
            report = sender.send(iteration + 1, source)
        if profile:
            prof.export_chrome_trace(str(Path(args.profile) / f"{args.label}{path}-sender.json"))
            print(_kernel_table(prof, f"{path} sender"), flush=True)
            conn.send(("timings", None))
            conn.recv()
            continue
        end_to_end.append(report.duration_s)
        handoff.append(report.phases_ms.get("engine_ms", 0.0) / 1e3)
        phases.append({**report.phases_ms, "call_ms": sum(calls) * 1e3})
        calls.clear()
        conn.send(("timings", None))
        receiver_phases.append(conn.recv()[1])
    conn.send(("done", fingerprints(weights)))
    differing = conn.recv()
    sender.close()
    results.put(
        {
            "path": path,
            "bytes": nbytes_of(weights),
            "handoff": handoff[1:],
            "end_to_end": end_to_end[1:],
            "cold_end_to_end": end_to_end[0],
            "checksum_match": differing == 0,
            "differing_tensors": differing,
            "phases": _median_phases(phases[1:]),
            "receiver_phases": _median_phases(receiver_phases[1:]),
            "buckets": report.buckets,
            "rounds": report.rounds,
        }
    )


def ours_consumer(args: argparse.Namespace, path: str, conn: Any) -> None:
    from actor_integration.rollout import RolloutActor
    from actor_integration.weight_sync import WeightReceiver

    _log_like_production(args, f"{path}-receiver")
    torch.cuda.set_device(0)
    _kind, shapes = conn.recv()
    engine = BenchEngine(shapes)
    receiver = WeightReceiver(
        verify=path.endswith(("+v", "+2p")) or path == "shm", keep_previous=not path.endswith("+2p")
    )
    actor = RolloutActor(engine, receiver=receiver)
    conn.send("ready")
    profile_next = False
    summed: dict[str, float] = {}  # receiver phases over the rounds of one sync
    while True:
        kind, value = conn.recv()
        if kind == "update_weights":
            context: Any = _profiler() if profile_next else _null()
            t0 = time.perf_counter()
            try:
                with context as prof:
                    result = actor.update_weights(*value)
                summed["actor_ms"] = summed.get("actor_ms", 0.0) + (time.perf_counter() - t0) * 1e3
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", exc))
            for key, ms in receiver.last_timings.items():
                summed[key] = summed.get(key, 0.0) + ms
            if profile_next and value[1][0].final:
                prof.export_chrome_trace(str(Path(args.profile) / f"{args.label}{path}-receiver.json"))
                print(_kernel_table(prof, f"{path} receiver"), flush=True)
                profile_next = False
        elif kind == "timings":
            conn.send(("ok", summed))
            summed = {}
        elif kind == "profile":
            profile_next = True
            conn.send("ok")
        else:
            conn.send(mismatches(engine.weights, value))
            receiver.release()
            return


def _median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in rows for k in row})
    return {k: round(statistics.median(row.get(k, 0.0) for row in rows), 3) for k in keys}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _kernel_table(prof: Any, title: str) -> str:
    return f"--- profile: {title}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)


# ------------------------------------------------------------------ slime-style: fresh handle per bucket


def slime_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[list[str]]]:
    """slime's bucketing: tensors in order into chunks of at most `bucket_bytes` (a new chunk when
    the next tensor would overflow, a larger tensor alone), each chunk split by dtype into
    flattened buckets (its `FlattenedTensorBucket` takes one dtype). Per chunk, its buckets' names."""
    chunks: list[list[str]] = []
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunks and size + nbytes <= bucket_bytes:
            chunks[-1].append(name)
            size += nbytes
        else:
            chunks.append([name])
            size = nbytes
    out = []
    for chunk in chunks:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in chunk:
            by_dtype.setdefault(weights[name].dtype, []).append(name)
        out.append(list(by_dtype.values()))
    return out


def slime_producer(args: argparse.Namespace, conn: Any, results: Any) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    weights = make_weights(args)
    nbytes = nbytes_of(weights)
    groups = [group for chunk in slime_buckets(weights, args.bucket_mib << 20) for group in chunk]
    conn.send(("shapes", {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}))

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
    conn.send(("done", fingerprints(weights)))
    differing = conn.recv()
    results.put(
        {
            "path": "slime",
            "bytes": nbytes,
            "handoff": handoff[1:],
            "end_to_end": end_to_end[1:],
            "checksum_match": differing == 0,
            "differing_tensors": differing,
            "buckets": len(groups),
        }
    )


def slime_consumer(args: argparse.Namespace, conn: Any) -> None:
    torch.cuda.set_device(0)
    _kind, shapes = conn.recv()
    dst = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}  # the engine's weights
    while True:
        kind, value = conn.recv()
        if kind == "bucket":
            group, (rebuild, rebuild_args) = value
            bucket = rebuild(*rebuild_args)  # opens a fresh handle
            offset = 0
            for name in group:
                target = dst[name]
                target.copy_(bucket[offset : offset + target.numel()].view(target.shape), non_blocking=True)
                offset += target.numel()
            torch.cuda.synchronize()
            del bucket  # closes the handle
            conn.send("ack")
        else:
            conn.send(mismatches(dst, value))
            return


# ------------------------------------------------------------------ kernel shapes


SWEEP = (
    "1024,16,4",
    "2048,16,8",
    "2048,32,8",
    "4096,16,8",
    "1024,32,4",
    "1024,64,4",
    "4096,8,8",
    "2048,64,8",
)


def _timed(fn: Any, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(args: argparse.Namespace) -> str:
    """Gather, verify and scatter in one process for each kernel shape (block, iters, warps), over
    the same tensors as the sync; prints GB/s and returns the fastest shape (summed time)."""
    from actor_integration.weight_sync import kernels
    from actor_integration.weight_sync.buckets import ALIGN, iter_buckets, padded

    device = torch.device("cuda", 0)
    weights = make_weights(args)
    total = nbytes_of(weights)
    buckets = list(iter_buckets(weights, args.bucket_mib << 20, align=ALIGN))
    regions = [torch.empty(padded(b.nbytes, ALIGN), dtype=torch.uint8, device=device) for b in buckets]
    targets = [[torch.empty_like(t) for t in b.tensors] for b in buckets]
    sizes = [b.nbytes for b in buckets]
    print(f"kernel shapes, {describe_layout(args)} (GB/s of payload)")
    print(f"{'block,iters,warps':<18} {'gather':>8} {'verify':>8} {'scatter':>8}")
    best, best_time = SWEEP[0], float("inf")
    for shape in SWEEP:
        block, iters, warps = (int(v) for v in shape.split(","))
        kernels.set_tuning(block=block, iters=iters, warps=warps)
        packer = kernels.DevicePacker(device)

        def gather(packer: Any = packer) -> None:
            for k, (b, r) in enumerate(zip(buckets, regions, strict=True)):
                packer.pack(k, r, b)
            packer.seal()

        plan = kernels.plan_scatter(
            [(r, b.entries, ts) for b, r, ts in zip(buckets, regions, targets, strict=True)], device
        )
        times = (
            _timed(gather),
            _timed(lambda: kernels.verify(regions, sizes, device)),
            _timed(lambda plan=plan: kernels.scatter(plan, regions, device)),
        )
        print(f"{shape:<18} " + " ".join(f"{total / t / 1e9:>8.0f}" for t in times), flush=True)
        if sum(times) < best_time:
            best, best_time = shape, sum(times)
    block, iters, warps = best.split(",")
    return f"block={block},iters={iters},warps={warps}"


# ------------------------------------------------------------------ driver


def _collect(results: Any, procs: list[Any], what: str) -> dict[str, Any]:
    """The row a path's producer puts on the queue, or an error row if a process died first."""
    deadline = time.monotonic() + PATH_TIMEOUT_S
    while True:
        try:
            row: dict[str, Any] = results.get(timeout=5)
            return row
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (None, 0)]
            if dead:
                return {"path": what, "error": f"process exited with code {dead[0].exitcode}"}
            if time.monotonic() > deadline:
                return {"path": what, "error": f"no result within {PATH_TIMEOUT_S:.0f} s"}


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
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return result


def run_alone(what: str, target: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results), daemon=True)
    proc.start()
    result = _collect(results, [proc], what)
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    return result


def gbps(row: dict[str, Any], region: str) -> float:
    return float(row["bytes"] / statistics.median(row[region]) / 1e9)


Verdict = tuple[str, str, "float | None", str, "bool | None"]  # (issue, what, measured, target, met)


def verdicts(
    by_path: dict[str, dict[str, Any]], layout: str, uniform_default: float | None = None
) -> list[Verdict]:
    """The issues' targets for this run: (issue, what, measured, target, met). Issue 12's are
    for uniform tensors; issue 24's for every layout (`uniform_default`: the verified default's
    end to end in a uniform-tensor run, for the dense and MoE layouts to be within 5% of)."""

    def get(path: str, region: str = "end_to_end") -> float | None:
        row = by_path.get(path)
        return gbps(row, region) if row is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    rows: list[Verdict] = []

    def add(issue: str, what: str, value: float | None, target: float, unit: str = "GB/s") -> None:
        rows.append((issue, what, value, f">= {target:g} {unit}", None if value is None else value >= target))

    default, slime = get("cuda_ipc+v"), get("slime")
    if layout == "uniform":
        add("12", "default (cuda_ipc+v) end to end", default, 700)
        add("12", "default end to end / slime-style end to end", ratio(default, slime), 1.6, "x")
        add("12", "cuda_ipc (no verification) end to end", get("cuda_ipc"), 900)
        add("12", "cuda_ipc (no verification) handoff", get("cuda_ipc", "handoff"), 1600)
        add("12", "arena (no checksums) end to end", get("arena"), 1400)
        add("12", "shm end to end", get("shm"), 10)
    else:
        add(
            "24", "default end to end / its uniform-tensor figure", ratio(default, uniform_default), 0.95, "x"
        )
        add("24", "default end to end / slime-style end to end", ratio(default, slime), 1.6, "x")
    add("24", "two-pass verified (cuda_ipc+2p) end to end", get("cuda_ipc+2p"), 1000)
    add("24", "arena+v end to end / default end to end", ratio(get("arena+v"), default), 1.0, "x")
    return rows


def uniform_default_from(path: Path | None) -> float | None:
    """The verified default's end to end GB/s in an earlier run's JSON (`--out` of a uniform run)."""
    if path is None:
        return None
    report = json.loads(path.read_text())
    for row in report["rows"]:
        if row["path"] == "cuda_ipc+v" and row["region"] == "end_to_end":
            return float(row["gbps"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--gib",
        type=float,
        default=8.0,
        help="weight bytes to move (GiB); the dense and MoE layouts keep the most layers within 5%% over it",
    )
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--layout",
        choices=LAYOUT_NAMES,
        default="uniform",
        help=(
            "uniform: equal bf16 tensors of --tensor-mib; dense: Qwen3-4B (public config, lm_head "
            "untied, 399 tensors, 8.2 GiB whole); moe: Qwen3-30B-A3B (public config, cut to the "
            "layers within --gib: 6 of 48 at 8 GiB, 2,367 tensors, fp32 router biases added)"
        ),
    )
    parser.add_argument("--tensor-mib", type=float, default=32, help="size of each tensor (uniform layout)")
    parser.add_argument(
        "--uniform-json",
        type=Path,
        default=None,
        help="the --out JSON of a uniform run: the dense/MoE default is then compared with its figure",
    )
    parser.add_argument("--iters", type=int, default=5, help="warm iterations (one cold one runs first)")
    parser.add_argument("--shm-iters", type=int, default=2, help="warm iterations for the slow host path")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--profile", default=None, help="write torch.profiler traces of one extra sync here")
    parser.add_argument("--profile-paths", default="cuda_ipc+v", help="the paths to profile")
    parser.add_argument("--kernel", default=None, help="kernel tuning, as WEIGHT_SYNC_KERNEL")
    parser.add_argument(
        "--sweep", action="store_true", help="time the kernel shapes in one process, print the best"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sync: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.layout == "uniform" and args.tensor_mib > args.bucket_mib:
        parser.error("--tensor-mib must not exceed --bucket-mib")
    if args.kernel is not None:
        import os

        os.environ["WEIGHT_SYNC_KERNEL"] = args.kernel  # the spawned processes read it at import
    if args.sweep:
        print(sweep(args))
        return 0
    args.label = f"t{args.tensor_mib:g}-" if args.layout == "uniform" else f"{args.layout}-"
    unknown = [p for p in args.paths.split(",") if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {list(PATHS)}")
    layout_line = describe_layout(args)
    print(layout_line, flush=True)
    if args.profile is not None:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    paths = args.paths.split(",")
    rows: list[dict[str, Any]] = []
    for path in paths:
        print(f"running {path} ...", flush=True)
        if path in ("d2d", "d2d_flat"):
            result = run_alone(path, run_d2d, (args, path == "d2d_flat"))
        elif path == "slime":
            result = run_pair(path, slime_producer, (args,), slime_consumer, (args,))
        elif path in PATHS:
            result = run_pair(path, ours_producer, (args, path), ours_consumer, (args, path))
        else:
            parser.error(f"unknown path {path!r}; choose from {list(PATHS)}")
        if "error" in result:
            print(f"  {path} failed: {result['error']}", flush=True)
        rows.append(result)
    return summarize(args, rows, layout_line)


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]], layout_line: str) -> int:
    """Print the table, the phases and the targets; write `--out`. Non-zero if a path failed or
    a path's engine did not end bit-exact."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    failed = [row for row in rows if "error" in row]
    rows = [row for row in rows if "error" not in row]
    by_path = {row["path"]: row for row in rows}
    ceiling = gbps(by_path["d2d_flat"], "handoff") if "d2d_flat" in by_path else None
    slime = by_path.get("slime")
    table = []
    print(f"\n{layout_line}")
    print(
        f"{args.bucket_mib} MiB buckets, {device}, kernel {args.kernel or 'default'}; "
        f"D2D ceiling and slime-style measured in this run"
    )
    header = f"{'path':<11} {'timed region':<12} {'GiB':>6} {'seconds':>9} {'GB/s':>8} {'x D2D':>7} {'x slime':>8}  bit-exact"
    print(header)
    print("-" * len(header))
    for row in rows:
        for region in ("handoff", "end_to_end"):
            if row["path"].startswith("d2d") and region == "end_to_end":
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
            table.append(entry)
            print(
                f"{row['path']:<11} {region:<12} {row['bytes'] / 2**30:>6.2f} {entry['seconds']:>9.4f} {value:>8.1f} "
                f"{entry['vs_d2d'] or float('nan'):>7.2f} {entry['vs_slime'] or float('nan'):>8.2f}  {row.get('checksum_match', '-')}"
            )
    print(
        "\nphases (ms, medians of warm syncs). sender: pack (host), ready (waiting for the device), engine"
        " wait = the engine call's round trip (call) + the rest; receiver: update_weights (actor) ="
        " open + verify + copy + close + the rest"
    )
    print(
        f"{'path':<11} {'pack':>7} {'ready':>7} {'engine':>7} {'call':>7}  | {'actor':>7} {'open':>7}"
        f" {'verify':>7} {'copy':>7} {'close':>7}"
    )
    for row in rows:
        if "phases" in row:
            s, r = row["phases"], row["receiver_phases"]
            sender_cols = ("pack_ms", "ready_ms", "engine_ms", "call_ms")
            receiver_cols = ("actor_ms", "open_ms", "verify_ms", "copy_ms", "close_ms")
            print(
                f"{row['path']:<11} "
                + " ".join(f"{s.get(k, 0):>7.2f}" for k in sender_cols)
                + "  | "
                + " ".join(f"{r.get(k, 0):>7.2f}" for k in receiver_cols)
                + f"   cold e2e {row['cold_end_to_end'] * 1e3:.0f} ms, {row['buckets']} buckets in {row['rounds']} rounds"
            )
    uniform_default = uniform_default_from(args.uniform_json)
    checks = verdicts(by_path, args.layout, uniform_default)
    print(f"\ntargets ({args.layout} layout; 'n/a': a path not run, or no --uniform-json):")
    for issue, what, value, target, met in checks:
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = "met" if met else "NOT met" if met is False else "-"
        print(f"  issue {issue}: {what:<50} {shown:>9}  {target:<12} {verdict}")
    inexact = [row["path"] for row in rows if row.get("checksum_match") is False]
    if inexact:
        print(
            f"\nNOT BIT-EXACT: {inexact} (tensors differing: {[by_path[p]['differing_tensors'] for p in inexact]})"
        )
    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "device": device,
        "torch": torch.__version__,
        "ceiling_gbps": ceiling,
        "rows": table,
        "phases": {
            row["path"]: {"sender": row.get("phases"), "receiver": row.get("receiver_phases")} for row in rows
        },
        "layout": layout_line,
        "uniform_default_gbps": uniform_default,
        "targets": [{"issue": i, "what": w, "value": v, "target": t, "met": m} for i, w, v, t, m in checks],
        "not_bit_exact": inexact,
        "failed": failed,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed or inexact else 0


if __name__ == "__main__":
    sys.exit(main())

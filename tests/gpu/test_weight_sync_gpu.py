"""Weight sync on real GPUs. Run on a GPU host: `python -m pytest -m gpu tests/gpu/test_weight_sync_gpu.py -x -q -s`.

1. slime #2188 reproduced: a producer under torch_memory_saver's preload hook (`TMS_INIT_ENABLE=1`)
   cannot export a weight bucket the legacy way (`_share_cuda_()` → CUDA "invalid argument"), and
   in the same process our `cuda_ipc` sender exports it and a plain consumer receives it bit-exact.
2. One GPU: versioned updates into a RolloutActor in another process through `cuda_ipc`; handles
   are opened once per staging buffer across versions, dropped when the rollout sleeps, and the
   trainer's staging memory comes back after `release()`. A staging buffer exported 1,100 times
   still exports without waiting for the stream (torch's 1,000-event limit).
3. Two GPUs (only if present): TP=2 trainer ranks in one 2-GPU slot, real gloo slot group, the
   engine process started with CUDA_VISIBLE_DEVICES="1,0" so handles must be mapped by GPU id.
4. The fused Triton kernel against torch, bit for bit, on awkward tensors; its bandwidth next to a
   flat D2D copy; whether it compiled to 16-byte vector loads.
5. Integrity: a staging buffer corrupted after packing, and a bucket truncated, are refused by the
   rollout in another process and its previous weights stay loaded; streamed (pipelined) rounds,
   the arena and the shm host path from GPU tensors arrive bit-exact.
6. A real checkpoint layout (Qwen3-30B-A3B-shaped, scaled down: an embedding and a head larger
   than the bucket, 256-byte q/k norms, fp32 router biases among bf16 tensors) arrives bit-exact on
   every path: the default, two-pass verification, the arena (both ways), streamed rounds, shm.
7. Two-pass verification (`WeightReceiver(keep_previous=False)`) under a corrupted staging buffer:
   the round is written, the weights are unknown and generation refused, the sender re-sends the
   round and it loads; a round corrupt every time fails with CorruptBucketError; an arena's round
   is not re-sent; the weight version only ever records whole rounds.

Measured figures are printed and, when LIFECYCLE_GPU_OUT is set, written there as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from actor_integration.models.tiny import TinyLMConfig  # noqa: E402 - after the importorskip
from tests.helpers.engine_pipe import EngineClient, serve_rollout, serve_tensors_rollout  # noqa: E402
from tests.helpers.models import perturbed  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HERE = Path(__file__).resolve().parent
AUTH = b"weight-sync-gpu-test"


def record(name: str, result: dict) -> None:
    print(f"[{name}] " + json.dumps(result, default=str), flush=True)
    out = os.environ.get("LIFECYCLE_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"weight_sync_{name}.json").write_text(json.dumps(result, indent=2, default=str))


def tms_preload_library() -> str:
    tms = pytest.importorskip("torch_memory_saver")
    from torch_memory_saver.utils import get_binary_path_from_package

    try:
        return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except Exception as exc:
        pytest.skip(
            f"torch_memory_saver preload library not found ({exc}); version {getattr(tms, '__version__', '?')}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# 1. slime #2188: TMS preload + legacy IPC fails; our cuda_ipc works in the same process.


def tms_producer_main(address: str) -> None:
    """Runs under LD_PRELOAD=<TMS preload .so>, TMS_INIT_ENABLE=1 (started by the test)."""
    import torch
    import torch_memory_saver
    from torch.multiprocessing.reductions import reduce_tensor

    from actor_integration.weight_sync import RankPayload, iter_buckets
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=AUTH)
    result: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"layer{i}.weight": torch.randn(2048, 4096, generator=g, device="cuda", dtype=torch.float32).to(
            torch.bfloat16
        )
        for i in range(4)
    }  # 64 MiB allocated under the saver: cuMem virtual memory
    torch.cuda.synchronize()
    bucket = torch.cat([w.reshape(-1) for w in weights.values()])  # a legacy flattened bucket
    for name, attempt in (
        ("share_cuda", lambda: bucket.untyped_storage()._share_cuda_()),
        ("reduce_tensor", lambda: reduce_tensor(bucket)),  # what MultiprocessingSerializer does
    ):
        try:
            attempt()
            result[f"legacy_{name}"] = "exported"
        except Exception as exc:
            result[f"legacy_{name}"] = f"failed: {str(exc).splitlines()[0]}"
    from actor_integration.weight_sync import select_transport

    # `auto` probes the way the sender allocates: plain memory is saver memory here, so without
    # the memory backend it must fall back to shm, with it it can pick cuda_ipc.
    result["auto_without_memory"] = select_transport("auto", colocated=True)
    result["auto_with_memory"] = select_transport(
        "auto", colocated=True, memory=torch_memory_saver.torch_memory_saver
    )
    sender = CudaIpcSender(memory=torch_memory_saver.torch_memory_saver)
    sender.begin_round(1, 0)
    planned = iter_buckets(weights, 32 << 20, align=sender.align)
    descriptors = [sender.export(position, bucket) for position, bucket in enumerate(planned)]
    manifests = sender.ready()
    payload = RankPayload(
        1, 0, True, 0, 0, "cuda_ipc", sender.sender_id, sender.gpu, tuple(manifests), tuple(descriptors)
    )
    from actor_integration.models.tiny import weights_checksum

    result["producer_checksum"] = weights_checksum(weights)
    conn.send((result, payload))
    conn.recv()  # the consumer is done with the handles
    sender.release()
    conn.send("released")
    conn.close()


def test_tms_preload_breaks_legacy_ipc_and_cuda_ipc_works_in_the_same_process():
    library = tms_preload_library()
    from actor_integration.models.tiny import weights_checksum
    from actor_integration.weight_sync import WeightReceiver

    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    address = f"127.0.0.1:{listener.address[1]}"
    root = str(HERE.parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(
        os.environ, LD_PRELOAD=library, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", PYTHONPATH=path
    )
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_weight_sync_gpu as t; t.tms_producer_main({address!r})"
    producer = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        conn = listener.accept()
        result, payload = conn.recv()
        receiver = WeightReceiver()
        start = time.perf_counter()
        with receiver.open([payload]) as received:
            got = {name: t.clone() for name, t in received.shards[0]}
        result["receive_s"] = time.perf_counter() - start
        result["consumer_checksum"] = weights_checksum(got)
        receiver.release()
        conn.send("done")
        assert conn.recv() == "released"
        assert producer.wait(60) == 0
    finally:
        if producer.poll() is None:
            producer.kill()
        listener.close()
    record("tms_preload", result)
    # The failure slime #2188 reports, reproduced:
    assert (
        result["legacy_share_cuda"].startswith("failed") and "invalid argument" in result["legacy_share_cuda"]
    )
    assert result["legacy_reduce_tensor"].startswith("failed")
    # ... and the same process exports through cuda_ipc, bit-exact on the other side.
    assert result["consumer_checksum"] == result["producer_checksum"]
    assert (result["auto_without_memory"], result["auto_with_memory"]) == ("shm", "cuda_ipc")


# ----------------------------------------------------------------------------------------------
# 2. One GPU: versioned updates, handle reuse, release on sleep.


CONFIG = TinyLMConfig(
    vocab_size=4096, dim=512, n_layers=4, n_heads=8, max_seq_len=64, dtype="bfloat16", seed=5
)


def trained_model(device: str, seed: int):
    return perturbed(CONFIG, seed, scale=0.05, device=device)


def test_cuda_ipc_updates_reuse_handles_and_release_them_on_sleep():
    import torch.multiprocessing as mp

    from actor_integration.models.tiny import weights_checksum
    from actor_integration.weight_sync import RankSlot, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    server = spawn.Process(target=serve_rollout, args=(theirs, CONFIG, ["cuda:0"]), daemon=True)
    server.start()
    rollout = EngineClient(ours)
    result: dict = {}
    try:
        from actor_integration.weight_sync import select_transport

        assert select_transport("auto", colocated=True) == "cuda_ipc"
        torch.cuda.set_device(0)
        transport = CudaIpcSender(device=0)
        sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=rollout,
            bucket_bytes=4 << 20,
            deadline_s=120.0,
        )
        prompts = [[1, 2, 3], [7, 8]]
        timings = []
        for version in (1, 2, 3):
            model = trained_model("cuda:0", version)
            report = sender.send(version, model.named_weights())
            timings.append(report.duration_s)
            assert rollout.call("weights_checksum") == weights_checksum(model.named_weights())
            assert rollout.call("generate", prompts, 6) == model.generate(prompts, max_new_tokens=6)
        result["buckets"] = report.buckets
        result["bytes"] = report.nbytes
        result["sync_s"] = timings
        result["staging_buffers"] = transport.allocations
        result["handles_opened_after_3_versions"] = rollout.call("handles_opened")
        assert result["handles_opened_after_3_versions"] == transport.allocations == report.buckets
        result["staging_bytes"] = staging = transport.staging_bytes
        del model
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()

        # While the rollout still maps the buffers, releasing them cannot give the memory back.
        sender.release()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        result["freed_with_rollout_awake"] = before - torch.cuda.memory_reserved()
        rollout.call("sleep")  # drops the rollout's handles
        assert rollout.call("open_handles") == 0
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        result["freed_after_rollout_sleep"] = before - torch.cuda.memory_reserved()
        assert result["freed_after_rollout_sleep"] >= 0.9 * staging  # nothing left pinned (slime #1731)

        rollout.call("wake_up", ["weights"])
        model = trained_model("cuda:0", 4)
        sender.send(4, model.named_weights())
        rollout.call("wake_up", ["kv_cache"])
        assert rollout.call("weights_checksum") == weights_checksum(model.named_weights())
        result["handles_opened_after_reopen"] = rollout.call("handles_opened")
        assert result["handles_opened_after_reopen"] == 2 * report.buckets
        sender.close()
    finally:
        ours.send(None)
        server.join(60)
    record("one_gpu", result)


def test_a_staging_buffer_exported_1100_times_still_exports_without_waiting_for_the_stream():
    """torch's `_share_cuda_()` leaves one record with an interprocess event on the storage it is
    called on, for that storage's life; past 1,000 such events in a process it synchronises the
    stream on every export instead. The sender exports through a storage made per export, so
    after 1,100 updates of one staging buffer (grants given back, as a receiver does) an export
    still returns while the device is busy: here behind ~0.5 s of `torch.cuda._sleep`."""
    from actor_integration.weight_sync.buckets import ALIGN, iter_buckets
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    torch.cuda.set_device(0)
    transport = CudaIpcSender(device=0)
    (bucket,) = iter_buckets({"w": torch.ones(4096, device="cuda")}, 1 << 20, align=ALIGN)

    def export(version: int) -> float:
        start = time.perf_counter()
        transport.begin_round(version, 0)
        descriptor = transport.export(0, bucket)
        transport.ready()
        elapsed = time.perf_counter() - start
        transport.abandon([descriptor])  # the receiver's release of this export's grant
        return elapsed

    for version in range(1, 1101):
        export(version)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(1_000_000_000)
    torch.cuda.synchronize()
    sleep_s = time.perf_counter() - start
    torch.cuda._sleep(1_000_000_000)  # the stream is busy for sleep_s from here
    busy_export_s = export(1101)
    torch.cuda.synchronize()
    result = {
        "exports": 1101,
        "through_own_storage": transport.alias_exports,
        "staging_allocations": transport.allocations,
        "device_busy_s": round(sleep_s, 3),
        "export_while_busy_s": round(busy_export_s, 4),
    }
    transport.release()
    record("exports_past_1000", result)
    assert transport.allocations == 1 and result["through_own_storage"] == 1101, result
    assert sleep_s > 0.2 and busy_export_s < sleep_s / 4, result


# ----------------------------------------------------------------------------------------------
# 3. Two GPUs: a 2-GPU slot fed by TP=2 trainer ranks.


def two_gpu_trainer(rank: int, port: int, conn, out: str) -> None:
    from actor_integration.models.tiny import weights_checksum
    from actor_integration.weight_sync import SlotTopology, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    torch.cuda.set_device(rank)
    topology = SlotTopology.plan(2, [2])
    groups = topology.create_groups(torch.distributed.new_group)
    me = topology.for_rank(rank)
    sender = WeightSender(
        me,
        groups[me.slot],
        CudaIpcSender(device=rank),
        rank=rank,
        engine_call=EngineClient(conn) if me.is_coordinator else None,
        bucket_bytes=8 << 20,
        deadline_s=120.0,
    )
    checksums, seconds = [], []
    for version in (1, 2):
        # TP=2 ranks hold the same full (gathered) tensors, each on its own GPU.
        model = trained_model(f"cuda:{rank}", version)
        report = sender.send(version, model.named_weights())
        checksums.append(weights_checksum(model.named_weights()))
        seconds.append(report.duration_s)
    sender.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"checksums": checksums, "seconds": seconds}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_slot_with_remapped_devices(tmp_path):
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    # The engine sees the GPUs in the other order: its cuda:0 is GPU 1. Engine rank i must live on
    # the GPU of slot rank i (GPU i), so its replicas go to cuda:1 and cuda:0.
    server = spawn.Process(target=serve_rollout, args=(theirs, CONFIG, ["cuda:1", "cuda:0"]), daemon=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"  # inherited at start, before the child touches CUDA
    try:
        server.start()
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        mp.spawn(two_gpu_trainer, args=(free_port(), ours, str(tmp_path)), nprocs=2)
        engine_checksum = EngineClient(ours).call("weights_checksum")
        engine_visible = EngineClient(ours).call("visible_devices")
    finally:
        ours.send(None)
        server.join(60)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    result = {"seconds": [r["seconds"] for r in ranks], "engine_checksum": engine_checksum}
    record("two_gpu", result)
    assert engine_visible == "1,0"
    assert ranks[0]["checksums"] == ranks[1]["checksums"]
    assert engine_checksum == ranks[0]["checksums"][-1]


# ----------------------------------------------------------------------------------------------
# 4. The fused kernel: bit-exact against torch, and its speed.


def test_fused_kernels_agree_with_torch_on_awkward_tensors():
    from actor_integration.weight_sync import kernels

    assert kernels.fused(torch.device("cuda")), "Triton should be importable with the CUDA build of torch"
    assert kernels.self_check("cuda", large=True) == []
    assert kernels.self_check("cuda", large=False, seed=7) == []


def test_a_cached_layout_follows_a_tensor_transposed_in_place():
    """The packer reuses its kernel plan while the layout cache's metadata guard vouches for the
    strides; a tensor whose strides change under the same address and shape must leave the kernel
    (which copies storage order) for torch's copy, and the packed bytes stay torch's."""
    from actor_integration.weight_sync import LayoutCache, iter_buckets, kernels
    from actor_integration.weight_sync.buckets import ALIGN, WSUM64, checksum, pack_into, padded

    base = torch.arange(256 * 256, dtype=torch.float32, device="cuda").view(256, 256)
    named = {"square": base, **{f"w{i}": torch.randn(1000 + i, device="cuda") for i in range(50)}}
    cache, packer = LayoutCache(), kernels.DevicePacker(torch.device("cuda"))
    region = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")

    def packed(update):
        (bucket,) = iter_buckets(update, 1 << 30, align=ALIGN, cache=cache)
        packer.pack("kept", region, bucket)
        (value,) = packer.seal()
        reference = torch.zeros_like(region)
        pack_into(reference, bucket)
        end = padded(bucket.nbytes, ALIGN)
        same = torch.equal(region[:end], reference[:end])
        return same and value == checksum(reference, bucket.nbytes, WSUM64), bucket

    assert packed(named)[0] and packed(dict(named))[0]
    assert packer.plans_built == 1  # the second update reused the plan
    ok, bucket = packed({**named, "square": base.t()})
    assert bucket.tensors[0].data_ptr() == base.data_ptr()
    assert ok, "a transposed tensor was packed in storage order"
    assert packer.plans_built == 2 and packer._plans["kept"].slow == [0]


def _time(fn, repeat=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _flat_copy_gbps(total):
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return total / _time(lambda: dst.copy_(src)) / 1e9


def _kernel_gbps(total, tensor_mib):
    from actor_integration.weight_sync import kernels
    from actor_integration.weight_sync.buckets import ALIGN, iter_buckets, padded

    device = torch.device("cuda")
    count = total // (tensor_mib << 20)
    named = {
        f"w{i}": torch.empty(tensor_mib << 19, dtype=torch.bfloat16, device=device) for i in range(count)
    }
    buckets = list(iter_buckets(named, 512 << 20, align=ALIGN))
    regions = [torch.empty(padded(b.nbytes, ALIGN), dtype=torch.uint8, device=device) for b in buckets]
    sizes = [b.nbytes for b in buckets]
    targets = [[torch.empty_like(t) for t in b.tensors] for b in buckets]
    packer = kernels.DevicePacker(device)

    def gather():
        for k, (b, r) in enumerate(zip(buckets, regions, strict=True)):
            packer.pack(k, r, b)
        packer.seal()

    def per_tensor():
        for b, ts in zip(buckets, targets, strict=True):
            for d, t in zip(ts, b.tensors, strict=True):
                d.copy_(t)

    plan = kernels.plan_scatter(
        [(r, b.entries, ts) for b, r, ts in zip(buckets, regions, targets, strict=True)], device
    )
    row = {
        "gather_gbps": total / _time(gather) / 1e9,
        "verify_gbps": total / _time(lambda: kernels.verify(regions, sizes, device)) / 1e9,
        "scatter_gbps": total / _time(lambda: kernels.scatter(plan, regions, device)) / 1e9,
        "per_tensor_copy_gbps": total / _time(per_tensor) / 1e9,
    }
    return {k: round(v, 1) for k, v in row.items()}


def test_fused_kernel_bandwidth_next_to_a_flat_copy():
    from actor_integration.weight_sync import kernels

    total = 4 << 30
    result: dict = {"tuning": kernels.TUNING, "d2d_flat_gbps": round(_flat_copy_gbps(total), 1)}
    torch.cuda.empty_cache()
    for tensor_mib in (32, 1):
        result[f"{tensor_mib}MiB"] = _kernel_gbps(total, tensor_mib)
        torch.cuda.empty_cache()
    device = torch.device("cuda")
    module = kernels.triton_module(device)
    compiled = module.segments_kernel.warmup(
        torch.zeros(4, dtype=torch.int32, device=device),
        torch.zeros((1, 4), dtype=torch.int64, device=device),
        torch.zeros(2, dtype=torch.int64, device=device),
        torch.ones(1, dtype=torch.int32, device=device),
        MODE=0,
        BLOCK=kernels.TUNING["block"],
        ITERS=kernels.TUNING["iters"],
        GATED=False,
        num_warps=kernels.TUNING["warps"],
        grid=(1,),
    )
    ptx = compiled.asm["ptx"]
    result["ptx_v4_loads"] = ptx.count("ld.global.v4")
    result["ptx_v4_stores"] = ptx.count("st.global.v4")
    record("kernel_bandwidth", result)
    assert result["32MiB"]["gather_gbps"] > 0


# ----------------------------------------------------------------------------------------------
# 5. Integrity and the other paths, into a RolloutActor in another process.


def rollout_process():
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    server = spawn.Process(target=serve_rollout, args=(theirs, CONFIG, ["cuda:0"]), daemon=True)
    server.start()
    return server, ours, EngineClient(ours)


def single_sender(rollout, transport, **kwargs):
    from actor_integration.weight_sync import RankSlot, WeightSender

    options = {"bucket_bytes": 2 << 20, "deadline_s": 120.0}
    options.update(kwargs)
    return WeightSender(RankSlot.single(0), None, transport, rank=0, engine_call=rollout, **options)


def test_a_corrupted_staging_buffer_or_a_truncated_bucket_leaves_the_previous_weights():
    import dataclasses

    from actor_integration.models.tiny import weights_checksum
    from actor_integration.weight_sync import CorruptBucketError, WeightSyncError
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    server, conn, rollout = rollout_process()
    result: dict = {}
    try:
        torch.cuda.set_device(0)
        transport = CudaIpcSender(device=0)
        sender = single_sender(rollout, transport)
        good = trained_model("cuda:0", 1)
        sender.send(1, good.named_weights())
        loaded = rollout.call("weights_checksum")
        assert loaded == weights_checksum(good.named_weights())

        def corrupt(version, payloads):
            staging = transport._staging["r0p1"].tensor  # bucket 1, packed and checksummed already
            staging[17] ^= 0x40
            torch.cuda.synchronize()
            return rollout(version, payloads)

        sender.engine_call = corrupt
        with pytest.raises(WeightSyncError, match="checksum") as info:
            sender.send(2, trained_model("cuda:0", 2).named_weights())
        assert isinstance(info.value.__cause__, CorruptBucketError)
        result["corrupt"] = str(info.value.__cause__).splitlines()[0]
        assert rollout.call("weights_checksum") == loaded and rollout.call("weight_version") == 1
        assert rollout.call("generate", [[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4)

        def truncate(version, payloads):
            p = payloads[0]
            longer = dataclasses.replace(p.buckets[0], nbytes=p.descriptors[0].capacity + 4096)
            return rollout(version, [dataclasses.replace(p, buckets=(longer, *p.buckets[1:]))])

        sender.engine_call = truncate
        with pytest.raises(WeightSyncError, match="truncated") as info:
            sender.send(3, trained_model("cuda:0", 3).named_weights())
        assert isinstance(info.value.__cause__, CorruptBucketError)
        result["truncated"] = str(info.value.__cause__).splitlines()[0]
        assert rollout.call("weights_checksum") == loaded and rollout.call("weight_version") == 1

        sender.engine_call = rollout
        fresh = trained_model("cuda:0", 4)
        sender.send(4, fresh.named_weights())
        assert rollout.call("weights_checksum") == weights_checksum(fresh.named_weights())
        sender.close()
    finally:
        conn.send(None)
        server.join(60)
    record("integrity", result)


def test_streamed_rounds_arena_and_shm_from_gpu_arrive_bit_exact():
    from actor_integration.models.tiny import weights_checksum
    from actor_integration.weight_sync import WSUM64
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from actor_integration.weight_sync.shm import ShmSender

    server, conn, rollout = rollout_process()
    result: dict = {}
    try:
        torch.cuda.set_device(0)
        # One bucket per round, sequential (the default): one staging buffer reused by every round.
        # Pipelined rounds (pipelined=True, two buffers) lost on one GPU, where the two processes
        # time-slice it (bench_sync: stream+v).
        streamed = CudaIpcSender(device=0)
        sender = single_sender(rollout, streamed, round_buckets=1)
        for version in (1, 2):
            model = trained_model("cuda:0", version)
            report = sender.send(version, model.named_weights())
            assert rollout.call("weights_checksum") == weights_checksum(model.named_weights())
        result["streamed"] = {
            "rounds": report.rounds,
            "staging_buffers": streamed.allocations,
            "phases": report.phases_ms,
        }
        assert report.rounds == report.buckets > 2 and streamed.allocations == 1
        sender.close()

        arena_sender = single_sender(rollout, CudaIpcSender(device=0))
        model = trained_model("cuda:0", 30)
        arena = arena_sender.arena(model.named_weights())
        for name, tensor in model.named_weights().items():
            arena[name].copy_(tensor)
        arena_sender.send(30, arena)
        assert rollout.call("weights_checksum") == weights_checksum(model.named_weights())
        arena_sender.close()

        shm = ShmSender()
        shm_sender = single_sender(rollout, shm)
        model = trained_model("cuda:0", 40)
        seen = []

        def call(version, payloads):
            seen.extend(m.checksum_kind for p in payloads for m in p.buckets)
            return rollout(version, payloads)

        shm_sender.engine_call = call
        shm_sender.send(40, model.named_weights())
        assert rollout.call("weights_checksum") == weights_checksum(model.named_weights())
        assert set(seen) == {WSUM64} and shm._files[0].pinned
        result["shm"] = {"buckets": len(seen), "pinned": shm._files[0].pinned}
        shm_sender.close()
    finally:
        conn.send(None)
        server.join(60)
    record("paths", result)


# ----------------------------------------------------------------------------------------------
# 6. A real checkpoint layout on every path.


def layout_specs():
    """Qwen3-30B-A3B's tensors (names, shapes, dtypes) with 8 experts, a 32768-token vocabulary
    and 2 layers: 0.5 GB, its embedding and head (128 MiB each) larger than a 64 MiB bucket."""
    import dataclasses

    from actor_integration.weight_sync.checkpoint_layouts import QWEN3_30B_A3B, specs_nbytes, tensor_specs

    specs = tensor_specs(dataclasses.replace(QWEN3_30B_A3B, experts=8, vocab=32768), layers=2)
    sizes = [specs_nbytes([s]) for s in specs]
    assert max(sizes) > LAYOUT_BUCKET and min(sizes) < 1024
    assert {d for _, _, d in specs} == {torch.bfloat16, torch.float32}
    return specs


LAYOUT_BUCKET = 64 << 20


def tensors_rollout_process(specs):
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    server = spawn.Process(target=serve_tensors_rollout, args=(theirs, specs, "cuda:0"), daemon=True)
    server.start()
    return server, ours, EngineClient(ours)


def test_a_real_checkpoint_layout_arrives_bit_exact_on_every_path():
    from actor_integration.weight_sync.checkpoint_layouts import materialize
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from actor_integration.weight_sync.shm import ShmSender
    from tests.helpers.weight_sync_doubles import fingerprints

    specs = layout_specs()
    server, conn, rollout = tensors_rollout_process(specs)
    result: dict = {}
    try:
        torch.cuda.set_device(0)
        paths = ("default", "two-pass", "arena", "arena, two-pass", "streamed", "streamed, two-pass", "shm")
        for version, path in enumerate(paths, start=1):
            rollout.call("keep_previous", "two-pass" not in path)
            transport = ShmSender() if path == "shm" else CudaIpcSender(device=0)
            sender = single_sender(
                rollout,
                transport,
                bucket_bytes=LAYOUT_BUCKET,
                round_buckets=1 if path.startswith("streamed") else -1,
            )
            weights = materialize(specs, "cuda:0", seed=version)
            source = weights
            if path.startswith("arena"):
                source = sender.arena(weights)
                for name, tensor in weights.items():
                    source[name].copy_(tensor)
            report = sender.send(version, source)
            got = rollout.call("fingerprints")
            differing = [name for name, value in fingerprints(weights).items() if got.get(name) != value]
            result[path] = {"buckets": report.buckets, "rounds": report.rounds, "differing": len(differing)}
            assert differing == [], f"{path}: {differing[:5]}"
            assert rollout.call("weight_version") == version and rollout.call("contents") == "valid"
            sender.close()
    finally:
        conn.send(None)
        server.join(60)
    record("layouts", result)


# ----------------------------------------------------------------------------------------------
# 7. Two-pass verification under corruption.


def test_two_pass_verification_resends_a_corrupt_round_and_keeps_the_version_history():
    from actor_integration.weight_sync import CorruptBucketError
    from actor_integration.weight_sync.checkpoint_layouts import materialize
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from lifecycle import InvalidWeightsError
    from tests.helpers.weight_sync_doubles import fingerprints

    specs = layout_specs()
    server, conn, rollout = tensors_rollout_process(specs)
    result: dict = {}
    try:
        torch.cuda.set_device(0)
        rollout.call("keep_previous", False)
        transport = CudaIpcSender(device=0)
        sender = single_sender(rollout, transport, bucket_bytes=LAYOUT_BUCKET)
        first = materialize(specs, "cuda:0", seed=1)
        sender.send(1, first)
        assert rollout.call("fingerprints") == fingerprints(first)
        calls: list[dict] = []

        def corrupt_first(version, payloads):
            if not calls:
                staging = transport._staging["r0p1"].tensor  # bucket 1, packed and checksummed already
                staging[17] ^= 0x40
                torch.cuda.synchronize()
                calls.append({"corrupted": True})
            else:  # the re-send: the corrupt round was written, and nothing may serve it
                state = {
                    "contents": rollout.call("contents"),
                    "versions": [rollout.call("weight_version"), rollout.call("lifecycle_version")],
                }
                try:
                    rollout.call("generate", [[1, 2]], 4)
                    state["generate"] = "served"
                except InvalidWeightsError as exc:
                    state["generate"] = f"refused: {str(exc).splitlines()[0][:120]}"
                state["overwritten"] = rollout.call("fingerprints") != fingerprints(first)
                calls.append(state)
            return rollout(version, payloads)

        sender.engine_call = corrupt_first
        second = materialize(specs, "cuda:0", seed=2)
        report = sender.send(2, second)
        result["resent"] = {"resends": report.resends, "between": calls[1]}
        assert report.resends == 1 and len(calls) == 2
        assert calls[1]["contents"] == "unknown" and calls[1]["versions"] == [1, 1]
        assert calls[1]["generate"].startswith("refused") and calls[1]["overwritten"]
        assert rollout.call("fingerprints") == fingerprints(second)
        assert rollout.call("weight_version") == 2 and rollout.call("contents") == "valid"

        def corrupt_always(version, payloads):
            calls.append({"corrupted": True})
            transport._staging["r0p1"].tensor[17] ^= 0x40
            torch.cuda.synchronize()
            return rollout(version, payloads)

        calls.clear()
        sender.engine_call = corrupt_always
        with pytest.raises(CorruptBucketError, match="sent again 1 time") as info:
            sender.send(3, materialize(specs, "cuda:0", seed=3))
        result["every_time"] = str(info.value).splitlines()[0][:300]
        assert len(calls) == 2 and rollout.call("contents") == "unknown"
        assert rollout.call("weight_version") == 2 and rollout.call("lifecycle_version") == 2
        sender.close()

        arena_transport = CudaIpcSender(device=0)
        arena_sender = single_sender(rollout, arena_transport, bucket_bytes=LAYOUT_BUCKET)
        fourth = materialize(specs, "cuda:0", seed=4)
        arena = arena_sender.arena(fourth)
        for name, tensor in fourth.items():
            arena[name].copy_(tensor)
        calls.clear()

        def corrupt_arena(version, payloads):
            calls.append({"corrupted": True})
            arena_transport._staging["a1"].tensor[17] ^= 0x40  # the arena is the only copy
            torch.cuda.synchronize()
            return rollout(version, payloads)

        arena_sender.engine_call = corrupt_arena
        with pytest.raises(CorruptBucketError) as info:
            arena_sender.send(4, arena)
        assert len(calls) == 1 and "resends" not in info.value.fields  # not re-sent
        arena_transport._staging["a1"].tensor[17] ^= 0x40  # repaired: the next version loads
        arena_sender.engine_call = rollout
        arena_sender.send(5, arena)
        assert rollout.call("fingerprints") == fingerprints(fourth)
        assert rollout.call("weight_version") == 5 and rollout.call("contents") == "valid"
        arena_sender.close()
    finally:
        conn.send(None)
        server.join(60)
    record("two_pass_faults", result)

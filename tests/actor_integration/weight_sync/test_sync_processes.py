"""The protocol across processes: real gloo slot groups between spawned trainer ranks, and the
RolloutActor (ReferenceEngine) in a process of its own, reached through a pipe the way Ray's
`ray.get(actor.update_weights.remote(...))` would reach it. Comparisons are bit-exact.
"""

import datetime
import json
import os
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actor_integration.models.tiny import TinyLMConfig, weights_checksum
from actor_integration.weight_sync import (
    RankSlot,
    SlotTopology,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)
from actor_integration.weight_sync.disk import DiskSender
from actor_integration.weight_sync.nccl import NcclReceiver, NcclSender
from actor_integration.weight_sync.shm import ShmSender
from tests.actor_integration.forked_ranks import fork_server
from tests.helpers.engine_pipe import EngineClient, serve_rollout
from tests.helpers.models import perturbed

CONFIG = TinyLMConfig(vocab_size=61, dim=16, n_layers=2, n_heads=2, max_seq_len=32, seed=3)
SPAWN = mp.get_context("spawn")
# The trainer ranks and the engine of the slot and broadcast runs: forked from one import of torch
# (tests/actor_integration/forked_ranks.py). The host-memory run keeps SPAWN: its peak RSS is measured.
FORKED = fork_server()


def trained(seed):
    return perturbed(CONFIG, seed, scale=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def write(out: Path, rank: int, result: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def read(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# ------------------------------------------------------------------ the engine process


def start_engine(devices):
    ours, theirs = FORKED.Pipe()
    process = FORKED.Process(target=serve_rollout, args=(theirs, CONFIG, devices), daemon=True)
    process.start()
    return process, EngineClient(ours), ours


def stop_engine(process, conn) -> None:
    conn.send(None)
    process.join(30)


# ------------------------------------------------------------------ three trainer ranks, one run


def trainer_main(rank, world, port, conn, out, disk_dir) -> None:
    """Three phases over the same three processes; each phase has its own slot groups.

    A: ranks 0,1 share the engine, rank 2 is outside: shm v1, disk v2, a replayed v2, shm v3.
    B: ranks 0,1,2 share a slot and rank 2 never calls send(): a missing rank.
    C: ranks 1,2 share a slot and rank 1, the coordinator, never calls send().
    """
    init_gloo(rank, world, port)
    result: dict = {"reports": [], "errors": [], "timeouts": {}}

    # Phase A
    topology = SlotTopology.plan(world, [2])
    made = []

    def new_group(*, ranks, backend):
        made.append([ranks, backend])
        return dist.new_group(ranks=ranks, backend=backend)

    groups = topology.create_groups(new_group)
    result["groups_made"] = made
    me = topology.for_rank(rank)
    # Phase A passes a handle whose `.group` is the live group, as ReloadableProcessGroups returns.
    group = SimpleNamespace(group=groups[me.slot]) if me.colocated else None
    engine = EngineClient(conn) if me.is_coordinator else None

    def sender(transport, **kwargs):
        return WeightSender(
            me, group, transport, rank=rank, engine_call=engine, bucket_bytes=4096, deadline_s=20.0, **kwargs
        )

    def record(report):
        result["reports"].append(
            [report.version, report.transport, report.rounds, report.buckets, report.nbytes]
        )

    shm = sender(ShmSender())
    record(shm.send(1, trained(1).named_weights()))
    disk = sender(DiskSender(disk_dir))
    record(disk.send(2, trained(2).named_weights()))
    replay = sender(ShmSender())  # a restarted trainer with its version counter back at 2
    try:
        replay.send(2, trained(5).named_weights())
    except WeightSyncError as exc:
        result["errors"].append([type(exc).__name__, str(exc)])
    record(shm.send(3, trained(3).named_weights()))
    # The engine finds the follower's bucket of v4's first round damaged after it was packed:
    # every rank of the slot packs that round again and sends it once more.
    attempts = []

    def damaging(version, payloads):
        attempts.append(payloads[0].round)
        if len(attempts) == 1:
            with open(payloads[1].descriptors[0].path, "r+b") as f:
                f.write(b"\xff\xfe\xfd")
        return engine(version, payloads)

    if me.is_coordinator:
        shm.engine_call = damaging
    report = shm.send(4, trained(4).named_weights())
    result["resent"] = [report.version, report.resends, report.rounds, attempts]
    for s in (shm, disk, replay):
        s.close()
    dist.barrier()

    # Phases B and C: deadlines
    for phase, (counts, offsets, absent) in {"B": ([3], [0], 2), "C": ([2], [1], 1)}.items():
        topology = SlotTopology.plan(world, counts, offsets)
        groups = topology.create_groups(dist.new_group)
        me = topology.for_rank(rank)
        if me.colocated and rank != absent:
            timed = WeightSender(
                me,
                groups[me.slot],
                ShmSender(),
                rank=rank,
                engine_call=lambda v, p: None,
                bucket_bytes=1 << 20,
                deadline_s=1.5,
                engine_deadline_s=1.0,
            )
            start = time.monotonic()
            try:
                timed.send(10, trained(1).named_weights())
                result["timeouts"][phase] = None
            except WeightSyncError as exc:
                details = exc.fields
                result["timeouts"][phase] = {
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "missing": details.get("missing"),
                    "awaited": details.get("awaited"),
                    "seconds": time.monotonic() - start,
                }
            timed.transport.close()
        dist.barrier()  # the world group is untouched by a broken slot group
    write(out, rank, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("three_ranks")
    engine, client, conn = start_engine(["cpu", "cpu"])
    try:
        args = (3, free_port(), conn, out, str(out / "disk"))
        mp.start_processes(trainer_main, args=args, nprocs=3, start_method="forkserver")
        engine_view = {
            "checksum": client.call("weights_checksum"),
            "version": client.call("weight_version"),
            "seen_ranks": client.call("seen_ranks"),
        }
    finally:
        stop_engine(engine, conn)
    return read(out, 3), engine_view, out


class TestSlotOfTwoRanks:
    def test_the_engine_holds_the_last_version_bit_exact(self, three_ranks):
        _results, engine, _out = three_ranks
        assert engine["checksum"] == weights_checksum(trained(4).named_weights())
        assert engine["version"] == 4

    def test_a_round_the_engine_found_corrupt_is_sent_again_by_every_rank_of_the_slot(self, three_ranks):
        results, _engine, _out = three_ranks
        version, resends, rounds, attempts = results[0]["resent"]
        assert (version, resends) == (4, 1) and results[1]["resent"][:3] == [4, 1, rounds]
        assert attempts == [0, *range(rounds)]  # round 0 twice, then the others once

    def test_the_coordinator_passes_one_payload_per_slot_rank_in_rank_order(self, three_ranks):
        _results, engine, _out = three_ranks
        assert engine["seen_ranks"] and all(ranks == [0, 1] for ranks in engine["seen_ranks"])

    def test_every_rank_creates_every_slot_group_in_the_same_order(self, three_ranks):
        results, _engine, _out = three_ranks
        assert all(r["groups_made"] == [[[0, 1], "gloo"]] for r in results)

    def test_shm_sends_a_bucket_per_round_and_disk_all_in_one(self, three_ranks):
        results, _engine, out = three_ranks
        shm, disk, _shm3 = results[0]["reports"]
        assert shm[1] == "shm" and shm[2] == shm[3] > 1
        assert disk[1] == "disk" and disk[2] == 1
        assert results[0]["reports"] == results[1]["reports"]
        assert not list((out / "disk").glob("*.safetensors"))  # deleted after the acknowledgement

    def test_a_rank_outside_the_slot_sends_nothing(self, three_ranks):
        results, _engine, _out = three_ranks
        assert [report[4] for report in results[2]["reports"]] == [0, 0, 0]
        assert results[2]["errors"] == []

    def test_a_replayed_version_is_refused_on_every_slot_rank(self, three_ranks):
        results, _engine, _out = three_ranks
        for rank in (0, 1):
            (error,) = results[rank]["errors"]
            assert error[0] == "WeightSyncError" and "refused version 2" in error[1]
            assert "strictly increase" in error[1]


class TestDeadlines:
    def test_the_coordinator_names_the_rank_that_did_not_arrive(self, three_ranks):
        results, _engine, _out = three_ranks
        timeout = results[0]["timeouts"]["B"]
        assert timeout["type"] == "WeightSyncTimeout" and timeout["missing"] == [2]
        assert timeout["awaited"] == "the slot ranks to call send()"
        message = timeout["message"]
        assert "slot 0" in message and "version 10" in message and "ranks [0, 1, 2]" in message
        assert "did not call send()" in message and "arrived: [0, 1]" in message
        assert 1.5 <= timeout["seconds"] < 10

    def test_a_rank_that_arrived_gets_the_diagnosis_instead_of_hanging(self, three_ranks):
        results, _engine, _out = three_ranks
        timeout = results[1]["timeouts"]["B"]
        assert timeout["type"] == "WeightSyncTimeout" and timeout["missing"] == [2]
        assert timeout["seconds"] < 10

    def test_a_missing_coordinator_is_named_by_the_waiting_rank(self, three_ranks):
        results, _engine, _out = three_ranks
        timeout = results[2]["timeouts"]["C"]
        assert timeout["type"] == "WeightSyncTimeout" and timeout["missing"] == [1]
        assert "coordinator" in timeout["awaited"] and "slot 0" in timeout["message"]
        assert timeout["seconds"] < 15


# ------------------------------------------------------------------ nccl (broadcast; gloo on CPU)


def broadcast_main(rank, world, port, conn, out) -> None:
    init_gloo(rank, world, port)
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    if rank == 1:  # the engine process joins the broadcast group
        serve_rollout(
            conn, CONFIG, ["cpu"], receiver=WeightReceiver(transports={"nccl": NcclReceiver(group, src=0)})
        )
        write(out, rank, {})
    else:
        sender = WeightSender(
            RankSlot.single(0),
            None,
            NcclSender(group, src=0, device="cpu"),
            rank=0,
            engine_call=EngineClient(conn),
            bucket_bytes=4096,
            deadline_s=20.0,
        )
        result = {"checksums": []}
        for version in (1, 2):
            sender.send(version, trained(version).named_weights())
            result["checksums"].append(EngineClient(conn).call("weights_checksum"))
        conn.send(None)
        sender.close()
        write(out, rank, result)
    dist.barrier()
    dist.destroy_process_group()


class TestBroadcast:
    def test_the_broadcast_transport_moves_each_version_bit_exact(self, tmp_path):
        trainer_end, engine_end = FORKED.Pipe()
        port = free_port()
        procs = [
            FORKED.Process(target=broadcast_main, args=(rank, 2, port, conn, tmp_path))
            for rank, conn in ((0, trainer_end), (1, engine_end))
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        result = json.loads((tmp_path / "rank0.json").read_text())
        assert result["checksums"] == [weights_checksum(trained(v).named_weights()) for v in (1, 2)]


# ------------------------------------------------------------------ host memory bound


def _vm(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def serve_sink(conn) -> None:
    """A receiver that opens and verifies every bucket, then drops it: any tensor names go."""
    receiver = WeightReceiver()
    while True:
        message = conn.recv()
        if message is None:
            return
        _method, (version, payloads) = message
        try:
            with receiver.open(payloads) as received:
                checked = sum(t.numel() * t.element_size() for shard in received.shards for _, t in shard)
            conn.send(("ok", {"version": version, "bytes": checked}))
        except Exception as exc:
            conn.send(("error", exc))


def rss_main(conn, out, disk_dir, bucket_bytes, tensors, tensor_bytes) -> None:
    g = torch.Generator().manual_seed(0)
    named = {f"w{i}": torch.randn(tensor_bytes // 4, generator=g) for i in range(tensors)}
    result = {}
    for version, transport in enumerate((ShmSender(), DiskSender(disk_dir)), start=1):
        sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=EngineClient(conn),
            bucket_bytes=bucket_bytes,
            deadline_s=60.0,
        )
        sender.send(10 * version, {"w0": named["w0"][:256]})  # warm up code paths, not buffers
        before = _vm("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        report = sender.send(10 * version + 1, named)
        peak = _vm("VmHWM")
        sender.close()
        result[transport.name] = {"growth": peak - before, "bytes": report.nbytes, "buckets": report.buckets}
    write(out, 0, result)


class TestHostMemory:
    def test_peak_rss_during_a_sync_stays_within_one_bucket_plus_a_constant(self, tmp_path):
        bucket, tensors, tensor_bytes = 8 << 20, 24, 8 << 20  # 192 MiB of weights, 8 MiB buckets
        ours, theirs = SPAWN.Pipe()
        sink = SPAWN.Process(target=serve_sink, args=(theirs,), daemon=True)
        sink.start()
        try:
            child = SPAWN.Process(
                target=rss_main, args=(ours, tmp_path, str(tmp_path / "disk"), bucket, tensors, tensor_bytes)
            )
            child.start()
            child.join(120)
            assert child.exitcode == 0
        finally:
            stop_engine(sink, ours)
        (result,) = read(tmp_path, 1)
        for transport in ("shm", "disk"):
            measured = result[transport]
            assert measured["bytes"] == tensors * tensor_bytes and measured["buckets"] == tensors
            growth = measured["growth"]
            print(
                f"{transport}: peak RSS growth {growth / 2**20:.1f} MiB while sending {tensors * tensor_bytes >> 20} MiB"
            )
            # Staging the whole state dict would add 192 MiB; the bound is one bucket plus a small constant.
            assert growth <= bucket + (16 << 20), (transport, growth)

"""CudaIpcReceiver's bookkeeping of torch's IPC grants, on a machine without CUDA.

Every export is one `_share_cuda_()` grant the consumer must release exactly once (by closing
the mapping it opened with it, or at once on a cache hit or a discard); a grant never released
keeps the sender's buffer in torch's IPC limbo forever. The two torch entry points the receiver
calls are replaced by recorders with the same signatures; the GPU tests run the real ones.
"""

import contextlib

import pytest
import torch

from actor_integration.weight_sync import BucketManifest, CorruptBucketError, RankPayload, WeightReceiver
from actor_integration.weight_sync.buckets import SUM32
from actor_integration.weight_sync.cuda_ipc import CudaIpcReceiver, IpcBuffer


class TorchIpc:
    """Records `_new_shared_cuda(device, handle, size, offset, rc, rc_offset, event, sync)` and
    `_release_ipc_counter_cuda(rc, rc_offset)`; opened storages are host memory here."""

    def __init__(self, monkeypatch):
        self.opened = []
        self.released = []
        self.calls = 0
        self.fail_at = None  # the n-th open (from 1) raises
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", self.new_shared_cuda, raising=False)
        monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", self.release, raising=False)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def new_shared_cuda(self, device, handle, size, offset, rc_handle, rc_offset, event, sync):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA error: invalid argument")
        self.opened.append((device, rc_offset))
        return torch.UntypedStorage(size)

    def release(self, rc_handle, rc_offset):
        self.released.append(rc_offset)


grant_counter = iter(range(1_000_000))


def export(buffer_id, capacity=4096):
    """One export of a buffer: a fresh grant (ref-counter slot), as `_share_cuda_()` returns."""
    share = (0, b"h" * 64, capacity, 0, b"/torch_rc", next(grant_counter), b"e" * 64, False)
    return IpcBuffer(buffer_id, share, capacity)


def manifest(index=0, nbytes=64):
    return BucketManifest(index, nbytes, (), 0, SUM32)


@pytest.fixture
def ipc(monkeypatch):
    return TorchIpc(monkeypatch)


class TestGrants:
    def test_a_buffer_is_opened_once_and_later_grants_are_released_at_once(self, ipc):
        receiver = CudaIpcReceiver()
        first = [export("s:0:0"), export("s:1:1")]
        for d in first:
            receiver.open(manifest(), d, gpu=0)
        second = [export("s:0:0"), export("s:1:1")]
        for d in second:
            receiver.open(manifest(), d, gpu=0)
        receiver.settle()
        assert [offset for _, offset in ipc.opened] == [d.share[5] for d in first]
        assert ipc.released == [d.share[5] for d in second]
        assert receiver.handles_opened == 2 and receiver.open_handles == 2

    def test_a_reallocated_position_drops_the_stale_mapping(self, ipc):
        receiver = CudaIpcReceiver()
        receiver.open(manifest(), export("s:0:0"), gpu=0)
        receiver.open(manifest(), export("s:0:7"), gpu=0)
        assert receiver.handles_opened == 2 and receiver.open_handles == 1

    def test_a_failed_open_gives_its_grant_back(self, ipc):
        receiver = CudaIpcReceiver()
        ipc.fail_at = 1
        d = export("s:0:0")
        with pytest.raises(RuntimeError, match="invalid argument"):
            receiver.open(manifest(), d, gpu=0)
        assert ipc.released == [d.share[5]] and receiver.open_handles == 0

    def test_discard_releases_the_grant_without_opening(self, ipc):
        receiver = CudaIpcReceiver()
        d = export("s:0:0")
        receiver.discard(d)
        assert ipc.opened == [] and ipc.released == [d.share[5]]

    def test_release_closes_every_mapping(self, ipc):
        receiver = CudaIpcReceiver()
        receiver.open(manifest(), export("s:0:0"), gpu=0)
        receiver.open(manifest(), export("s:0:0"), gpu=0)
        receiver.release()
        assert receiver.open_handles == 0 and len(ipc.released) == 1

    def test_the_gpu_id_is_mapped_to_this_process_device(self, ipc, monkeypatch):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        CudaIpcReceiver().open(manifest(), export("s:0:0"), gpu=3)
        assert ipc.opened[0][0] == 0  # GPU 3 is this process's cuda:0

    def test_a_bucket_larger_than_the_buffer_is_refused(self, ipc):
        with pytest.raises(CorruptBucketError, match="needs 8192"):
            CudaIpcReceiver().open(manifest(nbytes=8192), export("s:0:0", capacity=4096), gpu=0)


class TestWeightReceiverAccounting:
    def payload(self, descriptors, version=1):
        manifests = tuple(manifest(i) for i in range(len(descriptors)))
        return RankPayload(version, 0, True, 0, 0, "cuda_ipc", "s", 0, manifests, tuple(descriptors))

    def test_when_an_open_fails_the_buckets_after_it_are_discarded(self, ipc):
        receiver = WeightReceiver(verify=False)
        descriptors = [export(f"s:{i}:{i}") for i in range(4)]
        ipc.fail_at = 2
        with (
            pytest.raises(RuntimeError, match="invalid argument"),
            receiver.open([self.payload(descriptors)]),
        ):
            pass
        # bucket 0 mapped (its grant goes with the mapping); 1 failed and gave its grant back;
        # 2 and 3 were never opened and were discarded.
        assert sorted(ipc.released) == sorted(d.share[5] for d in descriptors[1:])


class TestChecksumsLeftOnTheDevice:
    """`wsum64-device`: the sender leaves each bucket's (s1, s2) in the 16 bytes after it; the
    receiver compares them with its own verification before any write (here the mapped
    "device" buffers are host memory, so the torch path computes the sums)."""

    def round(self, ipc, monkeypatch, corrupt=None):
        from actor_integration.weight_sync import WeightTargets, iter_buckets
        from actor_integration.weight_sync.buckets import (
            ALIGN,
            CHECKSUM_TRAILER,
            WSUM64_DEVICE,
            pack_into,
            padded,
            wsum64_sums,
        )

        named = {f"w{i}": torch.randn(50 + i) for i in range(6)}
        buckets = list(iter_buckets(named, 512, align=ALIGN))
        storages = {}
        descriptors, manifests = [], []
        for k, b in enumerate(buckets):
            end = padded(b.nbytes, ALIGN)
            region = torch.zeros(end + CHECKSUM_TRAILER, dtype=torch.uint8)
            pack_into(region, b)
            region[end:].view(torch.int64).copy_(wsum64_sums(region, b.nbytes))
            if corrupt == k:
                region[3] ^= 0x40  # after the checksum: corrupted in transit
            handle = b"h%d" % k
            storages[handle] = region.untyped_storage()
            share = (0, handle, region.numel(), 0, b"/torch_rc", next(grant_counter), b"e" * 64, False)
            descriptors.append(IpcBuffer(f"s:{k}:0", share, region.numel()))
            manifests.append(b.manifest(0, WSUM64_DEVICE))
        monkeypatch.setattr(
            torch.UntypedStorage,
            "_new_shared_cuda",
            lambda device, handle, *rest: storages[handle],
            raising=False,
        )
        payload = RankPayload(1, 0, True, 0, 0, "cuda_ipc", "s", 0, tuple(manifests), tuple(descriptors))
        engine = {n: torch.zeros_like(t) for n, t in named.items()}
        return named, engine, payload, WeightTargets([engine], complete=True)

    def test_a_round_verified_against_the_trailers_is_written(self, ipc, monkeypatch):
        named, engine, payload, targets = self.round(ipc, monkeypatch)
        WeightReceiver(verify=True).load_into([payload], targets)
        assert all(torch.equal(engine[n], named[n]) for n in named)

    def test_a_bucket_corrupted_after_its_checksum_is_refused_and_nothing_is_written(self, ipc, monkeypatch):
        _named, engine, payload, targets = self.round(ipc, monkeypatch, corrupt=1)
        with pytest.raises(
            CorruptBucketError, match=r"bucket 1 of version 1 .* fails its wsum64-device checksum"
        ):
            WeightReceiver(verify=True).load_into([payload], targets)
        assert all(not t.any() for t in engine.values())

    def test_a_buffer_without_room_for_the_trailer_is_refused_as_truncated(self, ipc):
        from actor_integration.weight_sync.buckets import WSUM64_DEVICE

        short = BucketManifest(0, 4096, (), 0, WSUM64_DEVICE)
        with pytest.raises(CorruptBucketError, match="needs 4112: truncated"):
            CudaIpcReceiver().open(short, export("s:0:0", capacity=4096), gpu=0)


class TestSenderExports:
    """Where the sender's export puts torch's record of the grant. `_share_cuda_()` wraps the
    storage it is called on in one more record (with an interprocess event) for as long as that
    storage lives; on a staging buffer kept all job long they would pile up, and past 1,000 events
    torch synchronises the stream on every export. Here `_share_cuda_` is a recorder (no CUDA);
    tests/gpu/test_weight_sync_gpu.py checks the real one."""

    @pytest.fixture
    def shared(self, monkeypatch):
        calls = []

        def share_cuda(storage):
            calls.append((storage._cdata, storage.data_ptr()))
            return (0, b"h" * 64, storage.nbytes(), 0, b"/torch_rc", len(calls), b"e" * 64, True)

        monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", share_cuda, raising=False)
        return calls

    @staticmethod
    def sender():
        from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

        sender = CudaIpcSender.__new__(CudaIpcSender)  # no CUDA here: only the export's host part
        sender._alias_exports, sender.alias_exports = True, 0
        return sender

    def test_each_export_shares_a_storage_of_its_own_over_the_same_memory(self, shared):
        sender, staging = self.sender(), torch.zeros(4096, dtype=torch.uint8)
        shares = [sender._share(staging) for _ in range(3)]
        own = staging.untyped_storage()._cdata
        assert [ptr for _, ptr in shared] == [staging.data_ptr()] * 3
        assert own not in {cdata for cdata, _ in shared}  # the buffer's own storage never wrapped
        assert sender.alias_exports == 3 and [s[5] for s in shares] == [1, 2, 3]
        assert all(s[2] == 4096 for s in shares)

    def test_the_export_keeps_the_memory_alive_after_the_buffer_is_dropped(self, shared, monkeypatch):
        kept = []
        real = torch.utils.dlpack.from_dlpack
        monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", lambda t: kept.append(real(t)) or kept[-1])
        sender, staging = self.sender(), torch.full((64,), 7, dtype=torch.uint8)
        sender._share(staging)
        del staging
        assert int(kept[0].sum()) == 7 * 64  # the export's storage still reads the buffer's bytes

    def test_a_torch_that_cannot_make_the_storage_shares_the_buffers_own(self, shared, monkeypatch):
        def refuse(tensor):
            raise RuntimeError("DLPack export is not supported for this tensor")

        monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", refuse)
        sender, staging = self.sender(), torch.zeros(64, dtype=torch.uint8)
        sender._share(staging)
        sender._share(staging)
        assert [cdata for cdata, _ in shared] == [staging.untyped_storage()._cdata] * 2
        assert sender.alias_exports == 0 and sender._alias_exports is False

    def test_an_export_torch_refuses_on_its_own_storage_is_made_on_the_buffers(self, shared, monkeypatch):
        own = torch.zeros(64, dtype=torch.uint8)
        record = torch.UntypedStorage._share_cuda_

        def picky(storage):
            if storage._cdata != own.untyped_storage()._cdata:
                raise RuntimeError("CUDA error: invalid argument")
            return record(storage)

        monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", picky, raising=False)
        sender = self.sender()
        assert sender._share(own)[2] == 64
        assert sender._alias_exports is False and sender.alias_exports == 0

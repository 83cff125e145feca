"""Transport selection and the host transports (shm, disk) end to end inside one process.

Moving bytes between processes is covered in test_sync_processes.py; here each transport's
sender and receiver objects meet directly, so failures point at the transport itself.
"""

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from actor_integration.weight_sync import (
    CorruptBucketError,
    RankPayload,
    WeightReceiver,
    WeightSyncError,
    configure_sender,
    iter_buckets,
    probe_cuda_ipc,
    select_transport,
)
from actor_integration.weight_sync.disk import DiskReceiver, DiskSender
from actor_integration.weight_sync.shm import ShmReceiver, ShmSender
from lifecycle import capture_events


def tensors(seed=0, scale=1):
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.0.w": torch.randn(64 * scale, 32, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(32, generator=g),
        "layer.1.w": torch.randn(48, 16 * scale, generator=g),
        "steps": torch.tensor(7, dtype=torch.int64),
    }


def export_round(sender, named, *, version=1, bucket_bytes=1 << 20):
    sender.begin_round(version, 0)
    buckets = iter_buckets(named, bucket_bytes, align=sender.align)
    descriptors = [sender.export(position, bucket) for position, bucket in enumerate(buckets)]
    manifests = sender.ready()
    return RankPayload(
        version=version,
        round=0,
        final=True,
        slot=0,
        rank=0,
        transport=sender.name,
        sender=sender.sender_id,
        gpu=sender.gpu,
        buckets=tuple(manifests),
        descriptors=tuple(descriptors),
    )


def receive(receiver, payload):
    with receiver.open([payload]) as received:
        return {name: t.clone() for name, t in received.shards[0]}


def assert_bit_exact(got, want):
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )


class TestSelection:
    def test_nccl_toward_a_colocated_engine_is_refused_with_what_to_use(self):
        with pytest.raises(ValueError, match="Duplicate GPU detected") as info:
            select_transport("nccl", colocated=True)
        assert "cuda_ipc" in str(info.value) and "shm" in str(info.value)

    def test_cuda_ipc_toward_a_remote_engine_is_refused(self):
        with pytest.raises(ValueError, match="only open on the GPUs"):
            select_transport("cuda_ipc", colocated=False)

    def test_unknown_names_are_refused_with_the_choices(self):
        with pytest.raises(ValueError, match=r"auto.*cuda_ipc.*shm.*disk.*nccl"):
            select_transport("rdma", colocated=True)

    def test_auto_on_a_machine_without_cuda_picks_shm_and_logs_why(self):
        with capture_events() as events:
            chosen = select_transport("auto", colocated=True)
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA; the GPU tests cover auto → cuda_ipc")
        assert chosen == "shm"
        (event,) = [e for e in events if e["event"] == "weight_sync.transport"]
        assert event["requested"] == "auto" and event["chosen"] == "shm"
        assert "CUDA is not available" in event["reason"]

    def test_auto_for_a_remote_engine_picks_nccl(self):
        assert select_transport("auto", colocated=False) == "nccl"

    def test_the_probe_runs_once_per_process(self):
        assert probe_cuda_ipc() is probe_cuda_ipc()

    def test_configure_sender_builds_what_was_chosen(self, tmp_path):
        shm = configure_sender("auto", colocated=True, directory=tmp_path)
        disk = configure_sender("disk", colocated=True, directory=tmp_path / "d")
        try:
            assert shm.name == ("cuda_ipc" if torch.cuda.is_available() else "shm")
            assert isinstance(disk, DiskSender) and (tmp_path / "d").is_dir()
        finally:
            shm.close()
            disk.close()

    def test_cuda_ipc_without_cuda_is_refused_at_configuration(self):
        if torch.cuda.is_available():
            pytest.skip("CUDA present")
        with pytest.raises(ValueError, match="needs CUDA"):
            configure_sender("cuda_ipc", colocated=True)

    def test_disk_needs_a_directory(self):
        with pytest.raises(ValueError, match="needs a directory"):
            configure_sender("disk", colocated=True)

    def test_nccl_needs_its_group(self):
        with pytest.raises(ValueError, match="process group"):
            configure_sender("nccl", colocated=False)

    def test_a_directory_that_cannot_be_created_is_refused(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(ValueError, match="cannot be created"):
            configure_sender("disk", colocated=True, directory=blocker / "weights")

    def test_a_directory_that_is_not_writable_is_refused(self, tmp_path):
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = locked if not os.access(locked, os.W_OK) else Path("/proc/self")  # root ignores modes
        try:
            with pytest.raises(ValueError, match="not writable"):
                configure_sender("disk", colocated=True, directory=target)
            with pytest.raises(ValueError, match="not writable"):
                ShmSender(directory=target)
        finally:
            locked.chmod(0o700)


class TestShm:
    def test_a_state_dict_round_trips_bit_exact_and_files_go_on_release(self):
        named = tensors()
        sender = ShmSender()
        payload = export_round(sender, named, bucket_bytes=4096)
        assert len(payload.buckets) > 1
        paths = sender.paths
        assert all(p.startswith("/dev/shm/") and os.path.exists(p) for p in paths)
        receiver = WeightReceiver()
        assert_bit_exact(receive(receiver, payload), named)
        sender.release()
        assert not any(os.path.exists(p) for p in paths)
        receiver.release()

    def test_the_receiver_maps_each_file_once_across_updates(self):
        sender, receiver = ShmSender(), ShmReceiver()
        wrapper = WeightReceiver(transports={"shm": receiver})
        try:
            for version in (1, 2, 3):
                named = tensors(seed=version)
                assert_bit_exact(receive(wrapper, export_round(sender, named, version=version)), named)
            assert receiver.files_opened == 1 and sender.allocations == 1
            bigger = tensors(seed=9, scale=256)  # outgrows the file: the sender allocates a new one
            payload = export_round(sender, bigger, version=4, bucket_bytes=8 << 20)
            assert_bit_exact(receive(wrapper, payload), bigger)
            assert sender.allocations == 2 and receiver.files_opened == 2
            assert receiver.open_handles == 1  # the stale mapping was dropped
            wrapper.release()
            assert receiver.open_handles == 0
        finally:
            sender.close()

    def test_a_corrupted_bucket_is_caught_by_its_checksum(self):
        sender = ShmSender()
        try:
            payload = export_round(sender, tensors(), bucket_bytes=4096)
            with open(payload.descriptors[1].path, "r+b") as f:
                f.seek(5)
                byte = f.read(1)
                f.seek(5)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises(
                CorruptBucketError, match=r"bucket 1 of version 1 from rank 0.*crc32 checksum"
            ):
                receive(WeightReceiver(), payload)
        finally:
            sender.close()

    def test_a_truncated_file_is_refused_before_it_is_read(self):
        sender = ShmSender()
        try:
            payload = export_round(sender, tensors())
            os.truncate(payload.descriptors[0].path, 10)
            with pytest.raises(CorruptBucketError, match="truncated"):
                receive(WeightReceiver(), payload)
        finally:
            sender.close()

    def test_a_released_sender_is_reported_not_crashed_on(self):
        sender = ShmSender()
        payload = export_round(sender, tensors())
        sender.release()
        with pytest.raises(WeightSyncError, match="is gone"):
            receive(WeightReceiver(), payload)


class TestDisk:
    def test_every_bucket_is_a_valid_safetensors_file(self, tmp_path):
        named = tensors()
        sender = DiskSender(tmp_path, keep_files=True)
        payload = export_round(sender, named, version=5, bucket_bytes=4096)
        loaded = {}
        for descriptor in payload.descriptors:
            loaded.update(safetensors.torch.load_file(descriptor.path))
            with safetensors.safe_open(descriptor.path, "pt") as f:
                assert f.metadata()["version"] == "5"
        assert_bit_exact(loaded, named)

    def test_round_trip_and_cleanup_after_the_round(self, tmp_path):
        named = tensors()
        sender = DiskSender(tmp_path)
        payload = export_round(sender, named, bucket_bytes=4096)
        assert_bit_exact(receive(WeightReceiver(), payload), named)
        sender.end_round()
        assert not list(tmp_path.glob("*.safetensors"))

    def test_a_truncated_file_is_refused(self, tmp_path):
        sender = DiskSender(tmp_path)
        payload = export_round(sender, tensors())
        path = payload.descriptors[0].path
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(CorruptBucketError, match="truncated"):
            receive(WeightReceiver(), payload)

    def test_a_flipped_data_byte_fails_the_checksum(self, tmp_path):
        sender = DiskSender(tmp_path)
        payload = export_round(sender, tensors())
        path = payload.descriptors[0].path
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptBucketError, match="checksum"):
            receive(WeightReceiver(), payload)

    def test_a_header_that_disagrees_with_the_manifest_is_refused(self, tmp_path):
        sender = DiskSender(tmp_path)
        payload = export_round(sender, tensors())
        other = export_round(DiskSender(tmp_path / "x"), {"other": torch.zeros(3)})
        os.replace(other.descriptors[0].path, payload.descriptors[0].path)
        with pytest.raises(CorruptBucketError, match="holds tensors"):
            receive(WeightReceiver(), payload)

    def test_a_missing_file_says_the_directory_must_be_shared(self, tmp_path):
        sender = DiskSender(tmp_path)
        payload = export_round(sender, tensors())
        sender.end_round()
        with pytest.raises(WeightSyncError, match="shared filesystem"):
            DiskReceiver().open(payload.buckets[0], payload.descriptors[0], gpu=None)

"""Tags restored by this process's own copy (`TorchMemorySaverBackend(device_restore=[...])`), on CPU.

The fake torch_memory_saver of test_memory_saver.py, given the region pools torch_memory_saver
0.0.10 keeps per (tag, CPU backup, disk backup, backup backend, device): each allocation made in a
region is a block of that pool's `snapshot()`. A pause destroys a tag's contents (the fake fills
them with -7) unless something keeps them; here the backend's own copy does, moved with memmove
on CPU (tests/gpu/test_memory_saver_gpu.py runs the copy kernel on the real library).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from actor_integration.backends.device_restore import ALIGN, DeviceRestore, layout, live_extents
from actor_integration.backends.memory_saver import (
    MemorySaverConfigError,
    MemoryStateError,
    TorchMemorySaverBackend,
    select_memory_backend,
)
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.testing import InjectedFault
from tests.actor_integration.backends.test_memory_saver import FakeTorchMemorySaver

TAGS = ("params", "optimizer")


class FakePool:
    """A region pool: `snapshot()` as torch's MemPool gives it, one segment per allocation."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.freed: set[int] = set()

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "address": t.data_ptr(),
                "total_size": t.untyped_storage().nbytes(),
                "blocks": [
                    {
                        "address": t.data_ptr(),
                        "size": t.untyped_storage().nbytes(),
                        "state": "inactive" if id(t) in self.freed else "active_allocated",
                    }
                ],
            }
            for t in self.tensors
        ]


class PooledSaver(FakeTorchMemorySaver):
    """The fake with torch_memory_saver's per-region pools (`_impl._mem_pools`)."""

    def _ensure_initialized(self) -> None:
        super()._ensure_initialized()
        if not hasattr(self._impl, "_mem_pools"):
            self._impl._mem_pools = {}

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        with super().region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
            key = self.pool_key(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
            self._local.pool = self._impl._mem_pools.setdefault(key, FakePool())
            try:
                yield
            finally:
                self._local.pool = None

    def pool_key(self, tag: str, cpu_backup: bool, disk_backup: bool, backend: str | None) -> tuple[Any, ...]:
        """torch_memory_saver 0.0.10's key: (tag, CPU backup, disk backup, backend, device)."""
        return (tag, cpu_backup, disk_backup, backend or "", 0)

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        pool = getattr(self._local, "pool", None)
        if pool is not None:
            pool.tensors.append(tensor)
        return super().allocate(tensor)

    def free(self, tensor: torch.Tensor) -> None:
        """What freeing a tensor does to its block: the allocator keeps it, inactive."""
        for pool in self._impl._mem_pools.values():
            if any(t is tensor for t in pool.tensors):
                pool.freed.add(id(tensor))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host chunks of 1 KiB: the tensors here span several, so runs are split across them."""
    from actor_integration.backends import device_restore

    monkeypatch.setattr(device_restore, "HOST_CHUNK", 1024)


def backend(**kwargs: Any) -> tuple[TorchMemorySaverBackend, PooledSaver]:
    saver = PooledSaver({})
    options: dict[str, Any] = {"tags": TAGS, "device_restore": ["params"], "cpu_backup": ["optimizer"]}
    options.update(kwargs)
    return TorchMemorySaverBackend(environ={}, saver=saver, **options), saver


def allocate(
    memory: TorchMemorySaverBackend, saver: PooledSaver, tag: str, *values: float
) -> list[torch.Tensor]:
    with memory.region(tag):
        return [saver.allocate(torch.full((300 + 37 * i,), v)) for i, v in enumerate(values)]


class TestContents:
    def test_a_device_restore_tag_comes_back_intact_without_torch_memory_saver_keeping_it(self) -> None:
        memory, saver = backend()
        params = allocate(memory, saver, "params", 1.5, -2.0, 3.25)
        (state,) = allocate(memory, saver, "optimizer", 9.0)
        assert [c[2] for c in saver.calls if c[0] == "region"] == [False, True]  # TMS backs up optimizer only
        for _ in range(3):
            memory.pause()
            assert all(bool((t == -7).all()) for t in [*params, state])  # the fake released them
            memory.resume()
            assert [float(t[0]) for t in params] == [1.5, -2.0, 3.25]
            assert all(bool((t == t[0]).all()) for t in params) and float(state[0]) == 9.0
        restore = memory._restore
        assert restore is not None and restore.copies == 6  # one save and one restore per cycle
        live = layout(live_extents(saver._impl._mem_pools[("params", False, False, "", 0)].snapshot()))[1]
        assert live <= restore.held_bytes("params") < live + 1024  # whole 1 KiB chunks
        assert len(restore._host["params"]) > 1  # the runs were split across chunks

    def test_the_host_copy_is_kept_and_grows_with_the_tag(self) -> None:
        memory, saver = backend()
        allocate(memory, saver, "params", 1.0)
        memory.pause("params")
        memory.resume("params")
        assert memory._restore is not None
        first = list(memory._restore._host["params"])
        memory.pause("params")
        memory.resume("params")
        assert all(a is b for a, b in zip(memory._restore._host["params"], first, strict=True))  # kept
        (grown,) = allocate(memory, saver, "params", 4.0)
        memory.pause("params")
        memory.resume("params")
        chunks = memory._restore._host["params"]
        assert len(chunks) > len(first) and all(a is b for a, b in zip(chunks, first, strict=False))  # grown
        assert bool((grown == 4.0).all())

    def test_a_freed_block_is_not_copied(self) -> None:
        memory, saver = backend()
        kept, dropped = allocate(memory, saver, "params", 1.0, 2.0)
        saver.free(dropped)
        memory.pause("params")
        assert memory._restore is not None
        (extent,) = memory._restore._saved["params"]
        assert (extent.address, extent.nbytes) == (kept.data_ptr(), kept.untyped_storage().nbytes())
        memory.resume("params")
        assert bool((kept == 1.0).all())

    def test_a_pause_torch_memory_saver_fails_leaves_the_tag_resident_and_the_copy_dropped(self) -> None:
        memory, saver = backend()
        (param,) = allocate(memory, saver, "params", 5.0)
        saver.fail_before.add("pause")
        with pytest.raises(InjectedFault):
            memory.pause("params")
        assert not memory.is_paused("params") and memory._restore is not None
        assert not memory._restore.is_saved("params")
        memory.pause("params")
        memory.resume("params")
        assert bool((param == 5.0).all())

    def test_a_failed_copy_back_says_the_contents_are_lost(self, monkeypatch: pytest.MonkeyPatch) -> None:
        memory, saver = backend()
        allocate(memory, saver, "params", 5.0)
        memory.pause("params")
        assert memory._restore is not None

        def broken(tag: str) -> int:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(memory._restore, "restore", broken)
        with pytest.raises(MemoryStateError, match=r"'params' was resumed.*holds other bytes.*checkpoint"):
            memory.resume("params")
        assert not memory.is_paused("params")  # what is true: torch_memory_saver mapped it again

    def test_a_lifecycle_sleeps_and_wakes_it_with_the_contents(self) -> None:
        memory, saver = backend()
        params = allocate(memory, saver, "params", 0.5, 7.0)
        lifecycle = Lifecycle(LifecyclePolicy(memory_tags=TAGS, model_tag=None), Hooks(memory=memory))
        lifecycle.sleep()
        assert lifecycle.state is State.PAUSED and bool((params[0] == -7).all())
        lifecycle.wake_up()
        assert [float(t[0]) for t in params] == [0.5, 7.0]


class TestCpuCopy:
    def test_cpu_backup_of_a_paused_device_tag_reads_the_saved_bytes(self) -> None:
        memory, saver = backend()
        (param,) = allocate(memory, saver, "params", 3.0)
        assert memory.cpu_backup(param, tag="params") is None  # resident: no copy held, as TMS says
        memory.pause("params")
        copy = memory.cpu_backup(param, tag="params")
        assert copy is not None and copy.shape == param.shape and bool((copy == 3.0).all())
        with pytest.raises(MemoryStateError, match=r"tags \['params'\] are paused.*pass tag="):
            memory.cpu_backup(param)  # TMS would exit(1) looking for a backup it does not hold
        memory.resume("params")

    def test_a_tensor_outside_the_tag_is_refused(self) -> None:
        memory, saver = backend()
        allocate(memory, saver, "params", 3.0)
        memory.pause("params")
        with pytest.raises(ValueError, match="no live block of tag 'params' holds the tensor"):
            memory.cpu_backup(torch.ones(4), tag="params")
        memory.resume("params")


class TestConfiguration:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"tags": None, "cpu_backup": False}, "device_restore needs named tags"),
            ({"device_restore": ["params", "kv"]}, r"unknown tags \['kv'\]"),
            ({"device_restore": "params"}, r"a bool or a collection of tags.*\['params'\]"),
        ],
    )
    def test_bad_input_is_refused_at_construction(self, options: dict[str, Any], message: str) -> None:
        with pytest.raises(MemorySaverConfigError, match=message):
            backend(**options)

    def test_device_restore_true_names_every_tag_and_keeps_their_contents(self) -> None:
        memory, _ = backend(device_restore=True, cpu_backup=False)
        assert memory._device_tags == frozenset(TAGS) and memory.is_backed_up("optimizer")
        assert "device_restore=['optimizer', 'params']" in memory.describe()
        assert "cpu_backup=none" in memory.describe()

    def test_a_saver_without_region_pools_is_refused_at_the_first_region(self) -> None:
        saver = FakeTorchMemorySaver({})
        memory = TorchMemorySaverBackend(tags=TAGS, device_restore=["params"], environ={}, saver=saver)
        refused = pytest.raises(MemorySaverConfigError, match=r"keeps no region pools.*cpu_backup instead")
        with refused, memory.region("params"):
            pass
        with memory.region("optimizer"):  # the other tags are untouched
            pass

    def test_select_memory_backend_passes_it_on(self) -> None:
        memory = select_memory_backend(
            "tms", tags=TAGS, device_restore=["params"], saver=PooledSaver({}), environ={}
        )
        assert isinstance(memory, TorchMemorySaverBackend) and memory._device_tags == {"params"}

    def test_the_backend_option_of_torch_memory_saver_needs_a_tag_it_backs_up(self) -> None:
        with pytest.raises(MemorySaverConfigError, match="cpu_backup_backend='pinned' needs cpu_backup on"):
            backend(cpu_backup=False, cpu_backup_backend="pinned")


class TestHostMemory:
    def test_prepare_allocates_the_copy_without_a_pause_and_without_retain(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import psutil

        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 << 30))
        memory, saver = backend(cpu_backup=False)
        allocate(memory, saver, "params", 1.0, 2.0)
        figures = memory.prepare_cpu_backup(ranks_per_node=1)
        assert not [c for c in saver.calls if c[0] in ("pause", "resume")]
        live = sum(
            size
            for _, size in live_extents(saver._impl._mem_pools[("params", False, False, "", 0)].snapshot())
        )
        assert figures["backup_bytes"] == live == memory.backup_bytes()
        assert memory._restore is not None and memory._restore.held_bytes("params") >= live
        assert memory.check_host_memory(ranks_per_node=1)["needed_bytes"] <= 0  # held already


class TestExtents:
    def test_live_blocks_merge_when_adjacent_and_lay_out_aligned(self) -> None:
        segments = [
            {
                "blocks": [
                    {"address": 4096, "size": 512, "state": "active_allocated"},
                    {"address": 4608, "size": 1024, "state": "active_pending_free"},
                    {"address": 5632, "size": 512, "state": "inactive"},
                    {"address": 6144, "size": 100, "state": "active_allocated"},
                ]
            },
            {"blocks": [{"address": 1024, "size": 512, "state": "active_allocated"}]},
        ]
        runs = live_extents(segments)
        assert runs == [(1024, 512), (4096, 1536), (6144, 100)]
        extents, total = layout(runs)
        assert [e.offset for e in extents] == [0, 512, 2048] and total == 2048 + ALIGN

    def test_restoring_what_was_not_saved_is_refused(self) -> None:
        restore = DeviceRestore(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="no saved copy"):
            restore.restore("params")
        tensor = torch.ones(8)
        block = {"address": tensor.data_ptr(), "size": 32, "state": "active_allocated"}
        restore.save("params", [{"blocks": [block]}])
        with pytest.raises(RuntimeError, match="saved already"):
            restore.save("params", [{"blocks": [block]}])
        with pytest.raises(RuntimeError, match="saved and not restored"):
            restore.release()


class KeyedOtherwise(PooledSaver):
    """A torch_memory_saver that keys its region pools another way (the device as an object)."""

    def pool_key(self, tag: str, cpu_backup: bool, disk_backup: bool, backend: str | None) -> tuple[Any, ...]:
        return (tag, cpu_backup, "cpu:0")


def test_a_saver_whose_pools_do_not_match_the_tag_is_refused_before_anything_is_allocated() -> None:
    """Were it let through, the pause would save no block and the resume would bring `params`
    back holding other bytes, silently."""
    memory = TorchMemorySaverBackend(
        tags=TAGS, device_restore=["params"], environ={}, saver=KeyedOtherwise({})
    )
    allocated = []
    refused = pytest.raises(MemorySaverConfigError, match=r"no region pool of torch_memory_saver matches it")
    with refused, memory.region("params"):
        allocated.append(torch.ones(4))
    assert not allocated

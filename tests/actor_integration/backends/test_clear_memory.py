"""ClearMemory: garbage first, CUDA caches only where CUDA is initialised, host heap with host=True."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from actor_integration.backends import clear_memory
from actor_integration.backends.clear_memory import ClearMemory

REPO = Path(__file__).resolve().parents[3]


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def fresh_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with nothing frozen and leaves nothing frozen (the freeze is process-wide)."""
    monkeypatch.setattr(clear_memory, "_frozen", False)
    yield
    gc.unfreeze()


def _tracked(obj: object) -> bool:
    """Whether the collector still looks at `obj` (frozen objects are out of gc.get_objects())."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the torch.cuda calls ClearMemory makes (the real ones are no-ops on a CPU build)."""
    calls: list[str] = []
    for name in ("synchronize", "empty_cache", "ipc_collect"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host_empty_cache"), raising=False)
    return calls


class TestClearMemory:
    def test_unreachable_cycles_are_collected(self) -> None:
        """Cycles holding tensors are freed before the caches are emptied."""
        gc.disable()
        try:
            ref = weakref.ref(_Cycle())
            assert ref() is not None
            ClearMemory()()
            assert ref() is None
        finally:
            gc.enable()

    def test_cpu_process_makes_no_cuda_call(self, cuda_calls: list[str]) -> None:
        ClearMemory(host=True)()
        assert cuda_calls == []
        assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]

    def test_initialised_cuda_is_synchronised_then_emptied(
        self, cuda_calls: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        ClearMemory()()
        assert cuda_calls == ["synchronize", "empty_cache", "ipc_collect"]
        cuda_calls.clear()
        ClearMemory(host=True)()
        assert cuda_calls == ["synchronize", "empty_cache", "ipc_collect", "host_empty_cache"]

    def test_host_must_be_a_bool(self) -> None:
        with pytest.raises(TypeError, match=r"host=\.\.\.\) must be a bool"):
            ClearMemory(host="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"freeze_heap=\.\.\.\) must be a bool"):
            ClearMemory(freeze_heap=1)  # type: ignore[arg-type]

    def test_each_part_is_timed(self, cuda_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        """timings_ms names every part the last call ran, in milliseconds."""
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        clear = ClearMemory(host=True)
        clear()
        expected = ["gc", "synchronize", "empty_cache", "ipc_collect", "host_empty_cache"]
        assert list(clear.timings_ms)[:5] == expected
        assert all(ms >= 0 for ms in clear.timings_ms.values())


class TestFrozenHeap:
    """The first call freezes the heap that survives it, so later calls walk only younger objects."""

    def test_what_survives_the_first_call_is_frozen(self) -> None:
        survivor = _Cycle()
        assert _tracked(survivor)
        ClearMemory()()
        assert not _tracked(survivor) and gc.get_freeze_count() > 0

    def test_cycles_made_after_the_freeze_are_still_collected(self) -> None:
        clear = ClearMemory()
        clear()
        gc.disable()
        try:
            ref = weakref.ref(_Cycle())
            assert ref() is not None
            clear()
            assert ref() is None
        finally:
            gc.enable()

    def test_the_heap_is_frozen_once_per_process(self) -> None:
        ClearMemory()()
        later = _Cycle()
        ClearMemory()()  # another instance: the freeze is not repeated
        assert _tracked(later)

    def test_the_price_a_cycle_frozen_alive_is_not_collected_later(self) -> None:
        """A cycle alive at the first call and dropped afterwards waits for gc.unfreeze()."""
        gc.disable()
        try:
            cycle = _Cycle()
            ref = weakref.ref(cycle)
            clear = ClearMemory()
            clear()
            del cycle
            clear()
            assert ref() is not None
            gc.unfreeze()
            gc.collect()
            assert ref() is None
        finally:
            gc.enable()

    def test_freeze_heap_false_never_freezes(self) -> None:
        survivor = _Cycle()
        ClearMemory(freeze_heap=False)()
        assert _tracked(survivor) and gc.get_freeze_count() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_host_true_returns_freed_heap_to_the_os() -> None:
    """Freed heap held behind live small blocks stays in RSS until malloc_trim(0) (host=True) returns it."""
    script = textwrap.dedent(
        """
        import psutil
        from actor_integration.backends.clear_memory import ClearMemory

        process = psutil.Process()
        rss = lambda: process.memory_info().rss / 2**20
        big, small = [], []
        for _ in range(2048):  # 64 MiB of heap blocks, each pinned in place by a small live neighbour
            big.append(bytearray(32 * 1024))
            small.append(bytearray(600))
        del big
        freed = rss()
        assert ClearMemory(host=True).trims_heap
        ClearMemory(host=False)()
        kept = rss()
        ClearMemory(host=True)()
        trimmed = rss()
        print(f"{freed:.1f} {kept:.1f} {trimmed:.1f}")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    freed, kept, trimmed = map(float, result.stdout.split())
    assert kept > freed - 16, f"host=False released memory already: {freed} -> {kept} MiB"
    assert trimmed < kept - 32, f"host=True did not return the freed 64 MiB: {kept} -> {trimmed} MiB"

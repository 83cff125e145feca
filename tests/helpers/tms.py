"""Environments and savers for torch_memory_saver tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from actor_integration.backends.tms_env import preload_library
from lifecycle.testing import FakeMemorySaver


def preload_env(major: int = 13, **extra: str) -> dict[str, str]:
    """An environment with the TMS preload library for CUDA `major` in LD_PRELOAD."""
    return {"LD_PRELOAD": preload_library(major), **extra}


class ForkMemorySaver(FakeMemorySaver):
    """`FakeMemorySaver` with the Python API of slime's pinned fork (zhuzilin/torch_memory_saver at
    8d30c59c, read from its entrypoint.py): no `retain_cpu_backup` property (assigning one only sets
    an attribute nothing reads) and no `cpu_backup_backend` on `region()`."""

    retain_cpu_backup = None  # type: ignore[assignment]  # the fork's class has no such property

    margin_bytes = 0

    @contextlib.contextmanager
    def region(  # type: ignore[override]
        self, tag: str = "default", enable_cpu_backup: bool = False, enable_disk_backup: bool = False
    ) -> Iterator[None]:
        with super().region(tag, enable_cpu_backup, enable_disk_backup):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self, cuda_graph: Any, pool: Any = None, stream: Any = None, **kwargs: Any
    ) -> Iterator[None]:
        yield

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        return None

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self.margin_bytes = value


class BatchMemory(FakeMemorySaver):
    """A memory backend that also takes a stage's tags in one call (`MemoryBatches`, as an engine
    server's `ServerMemory` does): each batch is recorded, then paused (or resumed) tag by tag."""

    def __init__(self, fail: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.batches: list[tuple[str, tuple[str, ...]]] = []
        self.fail = fail

    def pause_tags(self, tags: tuple[str, ...]) -> None:
        self.batches.append(("pause", tags))
        if self.fail:
            raise RuntimeError("the server refused the release")
        for tag in tags:
            self.pause(tag)

    def resume_tags(self, tags: tuple[str, ...]) -> None:
        self.batches.append(("resume", tags))
        for tag in tags:
            self.resume(tag)

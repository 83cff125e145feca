"""Tearing down every process group torch knows in this process: subgroups together, WORLD last."""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# At most this many communicators go down (or connect) at once; any bound is deadlock-free, as
# every rank submits its groups in the same (creation) order: see `each_at_once`.
MAX_THREADS = 64


def registered_groups() -> list[ProcessGroup]:
    """Every process group torch knows in this process, in creation order (the same on every rank)."""
    pg_map: dict[ProcessGroup, Any] = dist.distributed_c10d._world.pg_map
    return list(pg_map)


def nccl_backend(pg: ProcessGroup) -> Any:
    """The group's NCCL backend, or None for gloo (and other) groups."""
    if "nccl" not in str(dist.get_backend(pg)):
        return None
    return pg._get_backend(torch.device("cuda"))


def each_at_once(fn: Callable[[Any], object], items: list[Any]) -> None:
    """`fn(item)` for every item, each in its own thread; the first error is raised once all ended.

    Items are taken in the order given. Every rank passes its groups in creation order, so even
    with fewer threads than groups the earliest unfinished group is running on all of its ranks:
    collective teardowns (and connects) cannot wait on each other in a cycle. The list is
    consumed: a worker holds the only reference the caller gave, so a group's destructor (which
    joins its threads: ~10 ms for a gloo group) runs in that worker too, not one by one here.
    """
    if not items:
        return
    pending = collections.deque(items)
    items.clear()
    workers = min(len(pending), MAX_THREADS)
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            try:
                item = pending.popleft()
            except IndexError:
                return
            try:
                fn(item)
            except BaseException as exc:  # the others still go down; the first error is raised after
                errors.append(exc)
            del item

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="process-groups"
    ) as pool:
        for _ in range(workers):
            pool.submit(work)
    if errors:
        raise errors[0]


def destroy_registered_groups() -> int:
    """Destroy every registered group: subgroups at once, then WORLD. Returns how many went down.

    Every subgroup registered in torch goes down in its own thread, WORLD once and last: a
    communicator's teardown waits only on the same communicator's on its peers, and every rank
    starts all of its own at once, so no wait can close a cycle (torch shuts them down one by one,
    in name order, because ncclCommAbort once was collective).
    """
    if not dist.is_initialized():
        return 0
    world = dist.distributed_c10d._get_default_group()
    subgroups = [pg for pg in registered_groups() if pg is not world]
    count = len(subgroups) + 1
    try:
        each_at_once(dist.destroy_process_group, subgroups)  # takes the references with it
    finally:
        dist.destroy_process_group()  # WORLD once and last, after every subgroup's thread ended
    return count


def quiesce(backend: str, device_id: torch.device | None) -> None:
    """Finish this rank's device work before a communicator goes down.

    A collective still running when its communicator goes down hangs or faults: done before the
    rendezvous, so once every rank has met none has one in flight.
    """
    if "nccl" in backend and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(device_id)

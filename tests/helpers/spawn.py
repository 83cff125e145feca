"""Run a worker in one spawned process per rank around one TCP store, with a deadline (tests only).

A rank leaves with `os._exit` once its result is on disk. What a worker leaves behind holds gloo
process groups past `destroy_process_group()` (megatron-core's parallel_state keeps every group
it made; tests.helpers.fake_nccl kept its stand-ins): about 20 per rank in the PP=4 registry
tests. Interpreter finalization then runs their C++ destructors with their threads still up,
which torch does not make safe (pytorch/pytorch#179291, #190489). Once in a CI run (stop 43,
2026-12-05) rank 0 of such a test died of SIGABRT, "terminate called without an active
exception"; the run did not say whether its result was written yet (run_world now says), and it
did not recur here in 131 runs. What is under test is the worker's result, not torch's teardown.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import lifecycle

Worker = Callable[..., dict[str, Any]]
_RETURNED = "rl-lifecycle/spawn/returned"
_ALL_RETURNED = "rl-lifecycle/spawn/all-returned"


def run_world(worker: Worker, world_size: int, *args: Any, deadline_s: float = 60.0) -> list[dict[str, Any]]:
    """Run `worker(rank, world_size, store, *args)` in one spawned process per rank; kill them at the deadline.

    Returns each rank's result; a rank that raised reports {"crash": traceback} (see `no_crash`).
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry,
            args=(worker, world_size, store.port, out, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        end = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > end:
                    for process in context.processes:
                        process.kill()
                    pytest.fail(f"ranks still running after {deadline_s} s: a rendezvous hung")
        except mp.ProcessExitedException as exc:
            wrote = [rank for rank in range(world_size) if (Path(out) / f"rank{rank}.json").exists()]
            pytest.fail(f"{exc} (ranks that had written their result: {wrote})")
        results = []
        for rank in range(world_size):
            path = Path(out) / f"rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no result"
            results.append(json.loads(path.read_text()))
    return results


def no_crash(results: list[dict[str, Any]]) -> None:
    crashes = {r: res["crash"] for r, res in enumerate(results) if "crash" in res}
    assert not crashes, crashes


def _entry(rank: int, worker: Worker, world_size: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    try:
        result = worker(rank, world_size, store, *args)
    except BaseException as exc:
        result = {"crash": f"{exc!r}\n{traceback.format_exc()}"}
    finally:
        _leave_together(store, world_size)
        if dist.is_initialized():
            dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: see the module's docstring


def _leave_together(store: dist.TCPStore, world_size: int) -> None:
    """Wait (the launcher's store's 30 s at most) until every rank's worker has returned.

    Rank 0's process hosts the default group's store, which its `destroy_process_group()` and its exit
    take down, while a peer may not yet have seen the end of its last meeting on that store (the
    lifecycle's rendezvous): that peer then "lost the rendezvous store". slime's generic-mixin run
    (its update_weights fails on both ranks) lost a rank so about one run in eight once a garbage
    collection on the peer fell in that window; none with collection off or with the ranks leaving
    together. A rank that never returns is the deadline's to end.
    """
    if store.add(_RETURNED, 1) == world_size:
        store.set(_ALL_RETURNED, "1")
    with contextlib.suppress(dist.DistError):
        store.wait([_ALL_RETURNED])

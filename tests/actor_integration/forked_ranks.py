"""`run_world`'s ranks forked from one interpreter that has imported torch and megatron-core once.

`tests.helpers.spawn.run_world` starts every rank with the "spawn" method: a fresh interpreter per
rank that imports torch (about 2.5 s of CPU) and, in the Megatron tests, megatron-core (about 4.5 s
more) before its worker runs: most of a 4-rank test's time on CI's 2 cores. A test module that
takes the `ranks_from_one_import` fixture runs the same `run_world` with the "forkserver" method:
multiprocessing's fork server imports those third-party modules once (the first time a rank is
started in this pytest process) and forks every rank from there. Each rank is still a process of
its own, its worker and arguments pickled to it as before, forked before anything ran: nothing of
torch.distributed or megatron's parallel state is set up in it and none of the project is imported
(the server imports only what `PRELOAD` names). run_world's store, deadline, result files and crash
reports are its own, unchanged.

Two differences to mind where a module takes it: a rank has the environment the fork server started
with, not a later change to `os.environ` (no module that takes it sets one for its ranks); and a rank
holds megatron-core's objects even where it never imports it, so a full garbage collection walks
about twice as many objects (0.19 s instead of 0.10 s). test_process_groups.py collects in each of its
50 cycles on 4 ranks, which would cost more than the imports save: that fixture keeps "spawn", its
other run_world calls take `ranks_forked()`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch.multiprocessing as torch_mp

from tests.helpers import spawn

# Third-party only, imported by the fork server before its first fork; one that is not installed is
# skipped there (multiprocessing ignores its ImportError) and imported by the rank that needs it.
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state"]


class _ForkServerRanks:
    """What run_world uses of `torch.multiprocessing`, with its ranks started by the fork server."""

    ProcessExitedException = torch_mp.ProcessExitedException

    @staticmethod
    def start_processes(fn: Any, args: tuple[Any, ...] = (), nprocs: int = 1, **kwargs: Any) -> Any:
        assert kwargs.pop("start_method", "spawn") == "spawn", kwargs  # run_world's own method
        return torch_mp.start_processes(fn, args, nprocs, start_method="forkserver", **kwargs)


def fork_server() -> Any:
    """multiprocessing's "forkserver" context, the server's preload `PRELOAD` (for a test's own processes)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # the same list wherever set: the first start wins
    return multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def ranks_forked() -> Iterator[None]:
    """run_world inside forks its ranks from the fork server (started once per pytest process)."""
    fork_server()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spawn, "mp", _ForkServerRanks)
        yield


@pytest.fixture(scope="module")
def ranks_from_one_import() -> Iterator[None]:
    """run_world in this module (its module-scoped fixtures too) forks its ranks from the fork server;
    `spawn` again after the module."""
    with ranks_forked():
        yield

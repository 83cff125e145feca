"""run_world itself: a rank that dies is reported with the ranks whose results were on disk."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers.spawn import run_world


def _worker(rank: int, world_size: int, store: Any, dying: int) -> dict[str, Any]:
    if rank == dying:
        os.abort()  # SIGABRT before its result is written, as rank 0 died in one CI run
    return {"rank": rank}


def test_every_rank_returns_its_result() -> None:
    assert run_world(_worker, 2, -1, deadline_s=60) == [{"rank": 0}, {"rank": 1}]


def test_a_rank_killed_by_a_signal_is_named_with_the_ranks_that_had_written() -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_world(_worker, 2, 1, deadline_s=60)
    message = str(failed.value)
    assert "process 1 terminated with signal SIGABRT" in message, message
    assert "ranks that had written their result: [" in message and "1]" not in message, message

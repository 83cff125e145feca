"""Ranks lost with their node: a teardown waiting on them is given up at once, not at its deadline."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import Store

from actor_integration.backends.process_groups import LIFECYCLE_CAUSE, Meeting, ReloadableProcessGroups
from actor_integration.errors import PeersLostError
from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)


class TestMeeting:
    def test_a_wait_is_given_up_within_a_poll_of_abandon_and_later_ones_at_once(self) -> None:
        meeting = Meeting(dist.HashStore(), rank=0, world_size=3)
        threading.Timer(0.3, meeting.abandon, ([2, 1], "node 8f1459e0 lost")).start()
        started = time.monotonic()
        with pytest.raises(
            PeersLostError, match=r"rank 0 gave up destroy\(generation 0\): ranks \[1, 2\]"
        ) as info:
            meeting.meet("destroy(generation 0)", timedelta(seconds=30), LIFECYCLE_CAUSE)
        assert time.monotonic() - started < 1.5
        assert info.value.lost == (1, 2) and info.value.reason == "node 8f1459e0 lost"
        assert "close()" in str(info.value) and "checkpoint" in str(info.value)
        started = time.monotonic()
        with pytest.raises(PeersLostError):
            meeting.meet("reload(generation 1)", timedelta(seconds=30), LIFECYCLE_CAUSE)
        assert time.monotonic() - started < 0.1

    def test_a_meeting_that_everyone_reaches_is_not_slowed_by_the_polling(self) -> None:
        meeting = Meeting(dist.HashStore(), rank=0, world_size=1)
        started = time.monotonic()
        for i in range(20):
            meeting.meet(f"barrier({i})", timedelta(seconds=5), LIFECYCLE_CAUSE)
        assert time.monotonic() - started < 1.0


def _lost_rank_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    """Rank 3 leaves without its teardown (its node died); the others are told 0.5 s into theirs."""
    groups = ReloadableProcessGroups.init(
        backend="gloo", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=30)
    )
    groups.new_group([0, 1, 2, 3], name="slot0")
    if rank == 3:
        return {}
    threading.Timer(0.5, groups.abandon, ([3], "node b lost")).start()
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        groups.destroy()
    except PeersLostError as exc:
        out.update(error=str(exc), lost=list(exc.lost))
    out["waited_s"] = time.monotonic() - started
    started = time.monotonic()
    groups.close()
    out["close_s"] = time.monotonic() - started
    out["state"] = groups.state
    return out


class TestLostRanks:
    def test_the_survivors_give_up_their_teardown_and_close_without_waiting(self) -> None:
        results = run_world(_lost_rank_worker, 4, deadline_s=60)
        no_crash(results)
        for res in results[:3]:
            assert res["lost"] == [3] and "node b lost" in res["error"], res
            assert res["waited_s"] < 3, res  # not the 30 s deadline
            assert res["close_s"] < 3 and res["state"] == "closed", res

"""The host-time helper the GPU tests use to tell a caller's waiting from its work."""

import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import pytest

from tests.helpers.host_time import HostTime, Scheduling, scheduling, thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def spin(seconds: float) -> None:
    """Burn `seconds` of this thread's CPU time (not wall time: on a loaded machine the thread
    waits for a CPU between its slices, and the CPU it gets is what the tests measure)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_thread_burning_cpu_while_the_caller_sleeps_is_named_with_its_cpu_time():
    done, leave = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (spin(0.3), done.set(), leave.wait(5)), name="burner")
    host = HostTime(profile=True)
    with host.measure():
        worker.start()
        done.wait(5)
        time.sleep(0.05)
    leave.set()
    worker.join()
    summary = host.summary()
    burner = [t for t in summary["threads"] if t["thread"] == "burner"]
    assert burner and burner[0]["cpu_ms"] >= 200, summary["threads"]
    assert summary["wall_ms"] >= 300
    assert summary["caller_cpu_ms"] < 100, summary  # the caller waited
    assert any("sleep" in line or "wait" in line for line in summary["profile"]), summary["profile"]


def test_the_caller_working_is_its_own_cpu_time_and_blocks_add_up():
    host = HostTime()
    for _ in range(2):
        with host.measure():
            spin(0.15)
    summary = host.summary()
    assert summary["caller_cpu_ms"] >= 200 and summary["wall_ms"] >= 300
    assert summary["profile"] == []  # not asked for
    assert threading.get_native_id() in thread_cpu()


def _burn_then_wait(seconds: float, burnt: Any, leave: Any) -> None:
    spin(seconds)
    burnt.set()
    leave.wait(30)  # alive at the end of the block: /proc still lists it


def _burn_on(cpu: int, started: Any, leave: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    started.set()
    while not leave.is_set():
        spin(0.01)


def test_another_process_burning_cpu_is_named_with_its_cpu_and_the_caller_counts_as_blocked():
    context = multiprocessing.get_context("spawn")
    burnt, leave = context.Event(), context.Event()
    burner = context.Process(target=_burn_then_wait, args=(0.5, burnt, leave))
    host = HostTime()
    with host.measure():
        burner.start()
        assert burnt.wait(30)
    leave.set()
    burner.join(30)
    summary = host.summary()
    found = [p for p in summary["processes"] if p["pid"] == burner.pid]
    assert found and found[0]["cpu_ms"] >= 300, summary["processes"]
    assert summary["machine_busy_pct"] is not None and summary["machine_busy_pct"] > 0, summary
    assert (
        0
        <= summary["machine_steal_pct"]
        <= summary["machine_busy_pct"] + summary["machine_steal_pct"]
        <= 100.1
    )
    # The caller waited for its child: its wall time is neither CPU nor a wait for a CPU.
    assert summary["caller_blocked_ms"] >= 300 and summary["caller_cpu_ms"] < 300, summary
    if summary["caller_switches"]["voluntary"] is not None:
        assert summary["caller_switches"]["voluntary"] >= 1, summary


def test_scheduling_reads_the_calling_thread_or_says_it_is_not_kept():
    spin(0.05)
    now = scheduling()
    if now.run_wait_s is not None:
        assert now.run_wait_s >= 0
    if now.voluntary is not None:
        assert now.voluntary + (now.involuntary or 0) >= 1
    zero = now.plus(now, -1)
    assert {zero.run_wait_s, zero.voluntary, zero.involuntary} <= {0, None}, zero
    assert Scheduling(1.0, 2, None).plus(Scheduling(0.5, 1, 3)) == Scheduling(1.5, 3, None)


@pytest.mark.skipif(
    scheduling().run_wait_s is None or not hasattr(os, "sched_setaffinity"),
    reason="this kernel keeps no scheduler statistics (gVisor)",
)
def test_a_caller_sharing_its_cpu_with_two_burners_waits_in_the_run_queue():
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    context = multiprocessing.get_context("spawn")
    started, leave = [context.Event() for _ in range(2)], context.Event()
    burners = [context.Process(target=_burn_on, args=(cpu, s, leave)) for s in started]
    for burner in burners:
        burner.start()
    os.sched_setaffinity(0, {cpu})
    try:
        assert all(s.wait(60) for s in started)
        host = HostTime()
        with host.measure():
            end = time.thread_time() + 0.2
            while time.thread_time() < end:  # 0.2 s of CPU on a CPU shared three ways
                pass
    finally:
        os.sched_setaffinity(0, mine)
        leave.set()
        for burner in burners:
            burner.join(30)
    summary = host.summary()
    assert summary["caller_run_queue_ms"] >= 100, summary


def test_garbage_collections_inside_the_blocks_are_counted_with_their_time():
    import gc

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    keep = [Node() for _ in range(200_000)]
    host = HostTime()
    with host.measure():
        gc.collect()
        gc.collect(0)
    gc.collect()  # outside: not counted
    del keep
    summary = host.summary()
    assert summary["gc"]["collections"] == [1, 0, 1], summary["gc"]
    assert summary["gc"]["ms"][2] > summary["gc"]["ms"][0] >= 0, summary["gc"]
    assert gc.callbacks.count(host._on_gc) == 0


def test_call_times_split_wall_from_cpu_per_method_and_reset_at_take():
    from tests.helpers.host_time import CallTimes

    class Worker:
        def work(self) -> int:
            spin(0.03)
            return 1

        def wait(self) -> None:
            time.sleep(0.05)

    worker, other = Worker(), Worker()
    calls = CallTimes().wrap(worker, ["work", "wait"], prefix="w")
    assert worker.work() == 1 and worker.work() == 1
    worker.wait()
    other.wait()  # another instance: not wrapped
    rows = calls.take()
    assert set(rows) == {"w.work", "w.wait"}, rows
    assert rows["w.work"]["calls"] == 2 and rows["w.work"]["cpu_ms"] >= 50, rows
    assert rows["w.wait"]["calls"] == 1 and rows["w.wait"]["ms"] >= 45 and rows["w.wait"]["cpu_ms"] < 20, rows
    assert calls.take() == {}
    with pytest.raises(AttributeError):
        CallTimes().wrap(worker, ["missing"])

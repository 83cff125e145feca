"""The host-time helper the GPU tests use to tell a caller's waiting from its work."""

import sys
import threading
import time

import pytest

from tests.helpers.host_time import HostTime, thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
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

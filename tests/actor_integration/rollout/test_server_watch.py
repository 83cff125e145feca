"""An engine server that dies: its processes watched where the engine actor launched them
(`ServerProcesses`), the framework's rollout ended by `EngineDiedError` within about a poll
(`watch_engines`), never a wait on a dead server; and a job class's fault on the rollout half."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from actor_integration.errors import EngineDiedError
from actor_integration.rollout.server_watch import ServerProcesses, died_error, pid_alive, watch_engines


def _server(ready: Any) -> None:
    """A server process with a child of its own, as SGLang's launch_server starts its scheduler.
    It outlives its child (reaped, as a server's loop would), so that only the watch's kill ends it:
    exiting on the child's death would race the test's look at the exit code."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ready.put(child.pid)
    child.wait()
    time.sleep(120)


@pytest.fixture
def server() -> Iterator[tuple[Any, int]]:
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    root = context.Process(target=_server, args=(ready,), daemon=True)
    root.start()
    child = ready.get(timeout=60)
    try:
        yield root, child
    finally:
        for pid in (child, root.pid):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        root.join(10)


class TestServerProcesses:
    def test_a_dead_child_of_the_engines_own_is_named_and_the_rest_killed(self, server: Any) -> None:
        root, child = server
        assert ServerProcesses.of(root) == ServerProcesses(root, [])  # no title of the engine's own
        watched = ServerProcesses.of(root, own="python")  # as SGLang's "sglang::" titles its scheduler
        assert watched is not None and [pid for _, pid in watched.children] == [child]
        assert watched.dead() is None
        os.kill(child, signal.SIGKILL)  # the scheduler killed
        deadline = time.monotonic() + 10
        while watched.dead() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        title, pid, code = watched.dead() or ("", 0, 0)
        assert (pid, code) == (child, None) and title  # not our child: no exit code to read
        assert root.pid in watched.kill()
        assert not root.is_alive() and root.exitcode == -signal.SIGKILL

    def test_the_server_process_itself_dead_is_named_with_its_exit_code(self, server: Any) -> None:
        root, child = server
        watched = ServerProcesses.of(root, own="python")
        assert watched is not None
        os.kill(root.pid, signal.SIGKILL)  # its child lives on, orphaned
        root.join(10)
        assert watched.dead() == ("server", root.pid, -signal.SIGKILL)
        assert watched.kill() == [child]  # the tree's leftovers too: nothing of the server runs
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child)

    @pytest.mark.parametrize("pid", [-1000, 0, pytest.param(os.getpid(), id="this-process"), None, "12"])
    def test_a_process_that_is_not_a_servers_own_is_never_watched(self, pid: Any) -> None:
        """The in-process stand-ins' pids (negative), this process, no pid: nothing watched, nothing killed."""
        assert ServerProcesses.of(types.SimpleNamespace(pid=pid, is_alive=lambda: False)) is None


FOUND = {"process": "sglang::scheduler_TP0", "pid": 4242, "exitcode": None, "rank": 0, "url": "http://h:1"}


class TestWatchEngines:
    def test_a_rollout_with_every_server_alive_returns_its_result(self) -> None:
        asked: list[int] = []

        def ask(engines: Any, answer_s: float) -> None:
            asked.append(len(engines))

        assert watch_engines(lambda: 7, lambda: ["e0", None], what="rollout 0", advice="", ask=ask) == 7
        assert asked == [2]  # once more after the rollout ended

    def test_a_server_that_dies_mid_rollout_ends_it_within_a_poll(self) -> None:
        hang, dead_at = threading.Event(), time.monotonic() + 0.5

        def ask(engines: Any, answer_s: float) -> dict[str, Any] | None:
            return dict(FOUND, label="SGLang") if time.monotonic() > dead_at else None

        with pytest.raises(EngineDiedError) as died:
            watch_engines(
                hang.wait, lambda: ["e0"], what="slime's rollout 1", advice="Stop.", poll_s=0.1, ask=ask
            )
        hang.set()
        error = died.value
        assert time.monotonic() - dead_at < 2
        assert str(error).startswith(
            "SGLang's sglang::scheduler_TP0 process (pid 4242, exit code None) of rollout engine 0 at http://h:1 "
            "died; noticed during slime's rollout 1 after "
        )
        assert str(error).endswith("Stop.") and error.fields["call"] == "slime's rollout 1"
        assert (error.fields["pid"], error.fields["engine"]) == (4242, 0)

    def test_the_rollouts_own_error_is_the_cause_when_the_server_died(self) -> None:
        def run() -> None:
            raise ConnectionError("router: 502")

        with pytest.raises(EngineDiedError) as died:
            watch_engines(run, lambda: ["e0"], what="r", advice="", ask=lambda e, a: dict(FOUND))
        assert isinstance(died.value.__cause__, ConnectionError)

    def test_the_rollouts_own_error_is_raised_as_it_is_while_the_servers_live(self) -> None:
        def run() -> None:
            raise KeyError("no prompts")

        with pytest.raises(KeyError, match="no prompts"):
            watch_engines(run, lambda: ["e0"], what="r", advice="", ask=lambda e, a: None)

    def test_an_engine_actor_that_died_is_named_as_such(self) -> None:
        error = died_error(
            {"rank": 1, "process": None, "pid": None, "exitcode": None, "error": "actor died"},
            call="slime's rollout 0",
            waited_s=1.0,
            advice="",
        )
        assert str(error).startswith("the actor of rollout engine 1 (actor died) died; noticed during")


def test_a_rollout_fault_of_the_job_fails_the_engines_sleep_typed() -> None:
    """`RL_LIFECYCLE_FAULT=rollout:generation.pause@1` as the launch switch arms it on slime's engine
    class: the first sleep's generation pause raises, and the call fails with the machine's typed error."""
    from actor_integration.frameworks.launch import JobLifecycle, job_class
    from actor_integration.frameworks.slime.rollout import lifecycle_engine
    from lifecycle.errors import InjectedFault, LifecycleFailedError
    from lifecycle.faults import Fault
    from tests.helpers.engine_source import engine_args, slime_like_installed, start_engine
    from tests.helpers.sglang_server import FakeRouter

    router = FakeRouter()
    try:
        with slime_like_installed() as (module, _servers):
            cls = job_class(lifecycle_engine(module.SGLangEngine), Fault("rollout", "generation.pause", 1))
            assert issubclass(cls, JobLifecycle) and cls.__name__ == "LifecycleSGLangEngine"
            engine = start_engine(cls, engine_args("slime", router=router), router=router)
            try:
                assert engine.lifecycle_check_server() is None  # an in-process stand-in: nothing to watch
                with pytest.raises(LifecycleFailedError) as failed:
                    engine.release_memory_occupation()
                assert str(failed.value).startswith(
                    "lifecycle of rollout rank 0 is FAILED since hook generation.pause raised InjectedFault("
                )
                assert isinstance(failed.value.__cause__, InjectedFault)
                assert engine.lifecycle_faults.fired == ["generation.pause"]
            finally:
                engine.shutdown()
    finally:
        router.close()

"""An engine server that died, found and reported as `EngineDiedError` within a deadline, not a hang.

A framework's engine actor launches its server in a child process (slime's and miles'
`SGLangEngine`: `launch_server` in a `multiprocessing.Process`, which starts SGLang's scheduler and
detokenizer). Rollout requests never pass through that actor: the rollout function sends them to
the router. When the scheduler dies mid-rollout (killed, or out of memory), SGLang's HTTP front
either takes its whole process tree down with it or stays up with no scheduler behind it; either
way the rollout's requests fail and are retried (slime: 60 tries a second apart, per request) or
wait with no deadline (slime's HTTP client has none), and the job's driver learns nothing typed.

Two halves, both under the launch switch's rollout wrap:

- `ServerProcesses`, in the engine actor: the server process and the engine's own processes under
  it (those it titles, e.g. `sglang::scheduler_TP0`) as they were once the server was up; `dead()`
  names the first that exited, `kill()` ends what is left of the tree. Helpers that come and go (a
  resource tracker, compile workers) are not watched. The actor checks them before each call it
  drives (`ServerActorLifecycle`) and on the rollout manager's request.
- `watch_engines(run, engines, ...)`, in the rollout manager: the framework's rollout (`run`) on a
  helper thread while the engines are asked every `poll_s` whether their server lives (and once
  more when it ends); a death, or an engine actor that died, is raised as `EngineDiedError` naming
  the engine, the process, its pid and exit code, and the rollout. The rollout's thread is left
  to the process's end: the job stops on the error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from actor_integration.errors import EngineDiedError

__all__ = [
    "ENGINE_POLL_S",
    "ServerProcesses",
    "died_error",
    "pid_alive",
    "watch_engines",
]

T = TypeVar("T")

ENGINE_POLL_S = 1.0  # how often the rollout manager asks its engines whether their server lives
ANSWER_S = 10.0  # how long one engine's answer is waited for (a busy actor is asked again next poll)


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped, does not)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _title(process: Any) -> str:
    """What a process calls itself: its title where it set one (SGLang's `sglang::scheduler_TP0`),
    else its executable's name."""
    try:
        argv = process.cmdline()
    except Exception:  # gone, or not ours to read: its name still says something
        argv = []
    first = argv[0].split()[0] if argv and argv[0].strip() else ""
    if first and "/" not in first:
        return first
    try:
        return str(process.name())
    except Exception:
        return f"pid {process.pid}"


@dataclass
class ServerProcesses:
    """The processes of one engine server: `root`, the process the framework launched (a
    `multiprocessing.Process`), and the engine's own processes under it once the server was up,
    as (title, pid)."""

    root: Any
    children: list[tuple[str, int]]

    @classmethod
    def of(cls, root: Any, *, own: str = "") -> ServerProcesses | None:
        """The processes of the server `root` and, where the engine titles its own (`own`, a title's
        start: SGLang's "sglang::"), those of its descendants (None: no process of its own to watch,
        e.g. an external server, or a stand-in whose pid is no process's)."""
        pid = getattr(root, "pid", None)
        if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
            return None
        import psutil

        try:
            found = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        titled = [(_title(p), p.pid) for p in found]
        return cls(root, sorted(c for c in titled if own and c[0].startswith(own)))

    def dead(self) -> tuple[str, int, int | None] | None:
        """(title, pid, exit code) of the first watched process that exited (its exit code where
        this process is its parent: the root's), or None while all run."""
        for title, pid in self.children:
            if not pid_alive(pid):
                return title, pid, None
        root = self.root
        alive = root.is_alive() if hasattr(root, "is_alive") else pid_alive(root.pid)
        if not alive:
            return "server", int(root.pid), getattr(root, "exitcode", None)
        return None

    def kill(self) -> list[int]:
        """SIGKILL what is left of the server's tree (its descendants now and those watched, then
        the root, reaped where this process is its parent); the pids signalled."""
        import psutil

        pids: list[int] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            pids = [p.pid for p in psutil.Process(self.root.pid).children(recursive=True)]
        pids += [pid for _, pid in self.children if pid not in pids]
        signalled = []
        for pid in pids:
            if pid > 0 and pid != os.getpid() and pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    signalled.append(pid)
        root = self.root
        if hasattr(root, "is_alive") and hasattr(root, "kill"):  # a multiprocessing.Process: ours to reap
            if root.is_alive():
                root.kill()
                signalled.append(int(root.pid))
            with contextlib.suppress(Exception):
                root.join(timeout=5)
        elif pid_alive(root.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(root.pid, signal.SIGKILL)
                signalled.append(int(root.pid))
        return signalled


def died_error(
    found: Mapping[str, Any], *, call: str, waited_s: float | None, advice: str
) -> EngineDiedError:
    """The `EngineDiedError` for what an engine actor found dead (`ServerActorLifecycle`'s
    `lifecycle_check_server()`): the process, its pid and exit code, the engine, the call."""
    where = f"rollout engine {found.get('rank')}" + (f" at {found['url']}" if found.get("url") else "")
    process, pid = found.get("process"), found.get("pid")
    what = (
        f"{found.get('label', 'the engine')}'s {process} process (pid {pid}, exit code {found.get('exitcode')}) "
        f"of {where}"
        if pid is not None
        else f"the actor of {where} ({found.get('error', 'its process is gone')})"
    )
    noticed = f" after {waited_s:.1f} s" if waited_s is not None else ""
    return EngineDiedError(
        f"{what} died; noticed during {call}{noticed}: the engine can neither serve nor release "
        f"memory any more, and what was left of its server was killed. {advice}",
        process=process,
        pid=pid,
        exitcode=found.get("exitcode"),
        call=call,
        waited_s=None if waited_s is None else round(waited_s, 3),
        engine=found.get("rank"),
        url=found.get("url"),
    )


def watch_engines(
    run: Callable[[], T],
    engines: Callable[[], Sequence[Any]],
    *,
    what: str,
    advice: str,
    poll_s: float = ENGINE_POLL_S,
    answer_s: float = ANSWER_S,
    ask: Callable[[Sequence[Any], float], dict[str, Any] | None] | None = None,
) -> T:
    """`run()` on a helper thread while every engine actor of `engines()` (Ray handles with
    `lifecycle_check_server`; None entries skipped) is asked every `poll_s` whether its server
    lives, and once more after `run` ends. Returns `run`'s result or raises its error, unless an
    engine's server (or the engine actor itself) died: then `EngineDiedError` (from `run`'s error,
    if it had one), within about `poll_s` of the death. `ask(engines, answer_s)` is how they are
    asked (default: over Ray, each answer waited for `answer_s` at most)."""
    asking = _dead_engine if ask is None else ask
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # handed to the caller's thread, raised there
            box["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=target, name=f"rl-lifecycle {what}", daemon=True)
    thread.start()
    while True:
        thread.join(poll_s)
        done = not thread.is_alive()
        found = asking(engines(), answer_s)
        if found is not None:
            raise died_error(
                found, call=what, waited_s=time.monotonic() - started, advice=advice
            ) from box.get("error")
        if done:
            break
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _dead_engine(engines: Sequence[Any], answer_s: float) -> dict[str, Any] | None:
    """What the first engine whose server died reported (an actor gone: its error), or None."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    asked = [(i, e, e.lifecycle_check_server.remote()) for i, e in enumerate(engines) if e is not None]
    deadline = time.monotonic() + answer_s
    for index, _engine, ref in asked:
        try:
            found = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except GetTimeoutError:
            continue  # busy with another call: asked again at the next poll
        except RayActorError as exc:
            return {"rank": index, "process": None, "pid": None, "exitcode": None, "error": str(exc)}
        if found:
            return dict(found)
    return None

"""Where a process's host time goes while a call runs (tests and GPU diagnostics only).

`HostTime` records, around the calls made inside it, the CPU time of every thread of this process
(Linux's /proc/self/task: a thread that burns CPU while the caller waits for the GIL shows here)
and, with `profile=True`, a cProfile of the caller's thread (functions by their own time). The
slime GPU test uses it to tell the sender's waiting from its work (`pack_ms` against
`pack_cpu_ms`) and to name what the waiting was for.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[int, tuple[str, float]]:
    """{thread id: (name, CPU seconds so far)} of this process's threads; {} where /proc is not.
    The name is the Python thread's where there is one, else the kernel's (`comm`: threads that
    C++ started, Ray's and CUDA's, name themselves there). A thread that ended is not listed."""
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    found: dict[int, tuple[str, float]] = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return found
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
        utime, stime = int(fields[11]), int(fields[12])
        tid = int(task.name)
        found[tid] = (python.get(tid, name), (utime + stime) / _TICKS)
    return found


class HostTime:
    """Accumulates, over the `with host.measure():` blocks, each thread's CPU and the wall time
    (a thread that ends inside a block is missed: /proc lists it no more)."""

    def __init__(self, *, profile: bool = False) -> None:
        self.wall_s = 0.0
        self.cpu_s: dict[tuple[int, str], float] = {}
        self._profile = cProfile.Profile() if profile else None
        self._caller: int | None = None  # the measuring thread's kernel id

    @contextmanager
    def measure(self) -> Iterator[None]:
        self._caller = threading.get_native_id()
        before, start = thread_cpu(), time.perf_counter()
        if self._profile is not None:
            self._profile.enable()
        try:
            yield
        finally:
            if self._profile is not None:
                self._profile.disable()
            self.wall_s += time.perf_counter() - start
            for tid, (name, cpu) in thread_cpu().items():
                spent = cpu - before.get(tid, (name, 0.0))[1]
                if spent > 0:
                    self.cpu_s[(tid, name)] = self.cpu_s.get((tid, name), 0.0) + spent

    def threads(self, top: int = 12) -> list[dict[str, Any]]:
        """The threads that used CPU inside the blocks, most first: name, thread id, ms."""
        rows = sorted(self.cpu_s.items(), key=lambda item: -item[1])[:top]
        return [{"thread": name, "tid": tid, "cpu_ms": round(s * 1e3, 1)} for (tid, name), s in rows]

    def summary(self, top: int = 12) -> dict[str, Any]:
        main = self._caller
        return {
            "wall_ms": round(self.wall_s * 1e3, 1),
            "caller_cpu_ms": round(sum(s for (tid, _), s in self.cpu_s.items() if tid == main) * 1e3, 1),
            "all_threads_cpu_ms": round(sum(self.cpu_s.values()) * 1e3, 1),
            "threads": self.threads(top),
            "profile": self.profile(top),
        }

    def profile(self, top: int = 25) -> list[str]:
        """The caller's functions by own time (cProfile's table rows), or [] without profiling."""
        if self._profile is None:
            return []
        text = io.StringIO()
        pstats.Stats(self._profile, stream=text).sort_stats("tottime").print_stats(top)
        lines = text.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        return [line.rstrip() for line in lines[start:] if line.strip()]

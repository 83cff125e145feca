"""Where a process's host time goes while a call runs (tests and GPU diagnostics only).

`HostTime` records, around the calls made inside it:

- the CPU time of every thread of this process (Linux's /proc/self/task: a thread that burns CPU
  while the caller waits for the GIL shows here);
- for the calling thread, what the kernel's scheduler kept (`schedstat`, `status`): the time it was
  runnable but waited for a CPU (the machine short of CPUs, or a CPU quota throttling the
  processes), and how often it gave the CPU up (blocked: the GIL, a lock, a device wait with
  blocking sync, I/O) or was preempted. Wall time that is neither its CPU nor its wait for a CPU
  was spent blocked (`caller_blocked_ms`);
- the machine's: how busy its CPUs were and how much of their time the hypervisor took (steal,
  /proc/stat), and the processes that used the most CPU meanwhile (a server's scheduler spinning
  shows here);
- Python's garbage collections in the process (`gc.callbacks`): count and time per generation (a
  full collection in a process holding Ray's, SGLang's and torch's objects can take tens of ms,
  charged to whatever call allocated last);
- with `profile=True`, a cProfile of the caller's thread (functions by their own time; a C call
  that blocks has the time as its own).

The slime GPU test uses it to tell the sender's waiting from its work (`pack_ms` against
`pack_cpu_ms`) and to name what the waiting was for. Where the kernel keeps no scheduler
statistics (gVisor reads zeros), those fields are None.
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the thread or process ended meanwhile, or /proc is not there
        return None


def _cpu_of(stat: str) -> float:
    """utime + stime of a /proc .../stat line, in seconds."""
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / _TICKS


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
        name, stat = _read(task / "comm"), _read(task / "stat")
        if name is None or stat is None:
            continue
        tid = int(task.name)
        found[tid] = (python.get(tid, name.strip()), _cpu_of(stat))
    return found


@dataclass(frozen=True)
class Scheduling:
    """What the kernel's scheduler kept for one thread so far (None: it keeps nothing here)."""

    run_wait_s: float | None  # runnable, waiting for a CPU (schedstat's second field)
    voluntary: int | None  # switches where it gave the CPU up: it blocked
    involuntary: int | None  # switches where it was preempted

    def plus(self, other: Scheduling, sign: int = 1) -> Scheduling:
        """Field by field `self + sign * other`; None where either is None."""

        def add(a: Any, b: Any) -> Any:
            return None if a is None or b is None else a + sign * b

        return Scheduling(
            add(self.run_wait_s, other.run_wait_s),
            add(self.voluntary, other.voluntary),
            add(self.involuntary, other.involuntary),
        )


def scheduling(tid: int | None = None) -> Scheduling:
    """The scheduler's figures for thread `tid` of this process (default: the calling thread).
    A kernel that keeps none (gVisor: zeros throughout) gives None fields."""
    task = Path("/proc/self/task") / str(tid if tid is not None else threading.get_native_id())
    run_wait: float | None = None
    schedstat = _read(task / "schedstat")
    if schedstat:
        on_cpu_ns, wait_ns = (int(v) for v in schedstat.split()[:2])
        run_wait = wait_ns / 1e9 if on_cpu_ns else None  # no time on a CPU at all: not kept
    switches: dict[str, int] = {}
    for line in (_read(task / "status") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            switches[key] = int(value)
    voluntary, involuntary = (
        switches.get("voluntary_ctxt_switches"),
        switches.get("nonvoluntary_ctxt_switches"),
    )
    if not voluntary and not involuntary:
        voluntary = involuntary = None  # a thread that ran has switched at least once: not kept
    return Scheduling(run_wait, voluntary, involuntary)


def machine_cpu() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU seconds of the whole machine so far, from /proc/stat (None:
    unreadable). Steal is time a virtual machine's CPUs were runnable but the hypervisor ran
    something else: in a guest it shows in no process's CPU time nor run-queue wait."""
    text = _read(Path("/proc/stat"))
    if not text or not text.startswith("cpu "):
        return None
    values = [int(v) for v in text.splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    steal = values[7] if len(values) > 7 else 0
    total = sum(values[:8])  # guest time is already in user
    return (total - idle - steal) / _TICKS, steal / _TICKS, total / _TICKS


def process_cpu() -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds so far)} of the processes this one can see."""
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        stat = _read(entry / "stat")
        if stat is None:
            continue
        found[int(entry.name)] = (stat[stat.index("(") + 1 : stat.rindex(")")], _cpu_of(stat))
    return found


def _grew(
    after: dict[int, tuple[str, float]],
    before: dict[int, tuple[str, float]],
    into: dict[tuple[int, str], float],
) -> None:
    for key, (name, cpu) in after.items():
        spent = cpu - before.get(key, (name, 0.0))[1]
        if spent > 0:
            into[(key, name)] = into.get((key, name), 0.0) + spent


class HostTime:
    """Accumulates, over the `with host.measure():` blocks, each thread's CPU, the caller's
    scheduling, the machine's CPU and each process's, and the wall time (a thread or process
    that ends inside a block is missed: /proc lists it no more)."""

    def __init__(self, *, profile: bool = False) -> None:
        self.wall_s = 0.0
        self.caller_cpu_s = 0.0  # the measuring thread's, from the clock (ns), not /proc's ticks
        self.blocks = 0
        self.cpu_s: dict[tuple[int, str], float] = {}
        self.process_s: dict[tuple[int, str], float] = {}
        self.caller = Scheduling(0.0, 0, 0)
        self.machine_busy_s = self.machine_steal_s = self.machine_total_s = 0.0
        self._machine_kept = True
        self.gc_s = [0.0, 0.0, 0.0]  # per generation: seconds collecting inside the blocks
        self.gc_count = [0, 0, 0]
        self._gc_started: float | None = None
        self._profile = cProfile.Profile() if profile else None

    @contextmanager
    def measure(self) -> Iterator[None]:
        processes, machine = process_cpu(), machine_cpu()
        before, sched = thread_cpu(), scheduling()
        own = time.thread_time()
        gc.callbacks.append(self._on_gc)
        start = time.perf_counter()
        if self._profile is not None:
            self._profile.enable()
        try:
            yield
        finally:
            if self._profile is not None:
                self._profile.disable()
            gc.callbacks.remove(self._on_gc)
            self.wall_s += time.perf_counter() - start
            self.caller_cpu_s += time.thread_time() - own
            self.caller = self.caller.plus(scheduling().plus(sched, -1))
            _grew(thread_cpu(), before, self.cpu_s)
            machine_after = machine_cpu()
            _grew(process_cpu(), processes, self.process_s)
            self.blocks += 1
            if machine is None or machine_after is None:
                self._machine_kept = False
            else:
                self.machine_busy_s += machine_after[0] - machine[0]
                self.machine_steal_s += machine_after[1] - machine[1]
                self.machine_total_s += machine_after[2] - machine[2]

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            generation = min(int(info.get("generation", 0)), 2)
            self.gc_s[generation] += time.perf_counter() - self._gc_started
            self.gc_count[generation] += 1
            self._gc_started = None

    def threads(self, top: int = 12) -> list[dict[str, Any]]:
        """The threads that used CPU inside the blocks, most first: name, thread id, ms."""
        rows = sorted(self.cpu_s.items(), key=lambda item: -item[1])[:top]
        return [{"thread": name, "tid": tid, "cpu_ms": round(s * 1e3, 1)} for (tid, name), s in rows]

    def processes(self, top: int = 8) -> list[dict[str, Any]]:
        """The machine's processes that used CPU inside the blocks, most first (this one
        included): pid, name, ms."""
        rows = sorted(self.process_s.items(), key=lambda item: -item[1])[:top]
        return [{"pid": pid, "process": name, "cpu_ms": round(s * 1e3, 1)} for (pid, name), s in rows]

    def summary(self, top: int = 12) -> dict[str, Any]:
        caller_cpu = self.caller_cpu_s
        run_wait = self.caller.run_wait_s
        kept = self._machine_kept and self.machine_total_s > 0
        return {
            "wall_ms": round(self.wall_s * 1e3, 1),
            "blocks": self.blocks,
            "caller_cpu_ms": round(caller_cpu * 1e3, 1),
            # the caller runnable but without a CPU; then the rest of the wall time: blocked (the
            # three are read at slightly different instants: a few µs either way, never below 0)
            "caller_run_queue_ms": None if run_wait is None else round(run_wait * 1e3, 1),
            "caller_blocked_ms": round(max(self.wall_s - caller_cpu - (run_wait or 0.0), 0.0) * 1e3, 1),
            "caller_switches": {"voluntary": self.caller.voluntary, "involuntary": self.caller.involuntary},
            "all_threads_cpu_ms": round(sum(self.cpu_s.values()) * 1e3, 1),
            "gc": {"collections": list(self.gc_count), "ms": [round(s * 1e3, 2) for s in self.gc_s]},
            "threads": self.threads(top),
            "machine_busy_pct": round(100 * self.machine_busy_s / self.machine_total_s, 1) if kept else None,
            "machine_steal_pct": round(100 * self.machine_steal_s / self.machine_total_s, 1)
            if kept
            else None,
            "machine_cpus": os.cpu_count(),
            "processes": self.processes(),
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


class CallTimes:
    """Wall and thread-CPU time of calls, per name, until `take()` (thread-safe).

    `CallTimes().wrap(obj, ["export", "ready"])` replaces those methods on that instance with
    timed ones (the class is untouched); a call inside another wrapped call counts in both.
    `timed(fn, name)` times any callable; `name` is a string or a function of the call's
    arguments (`engine_actor_reads.RequestTimes` names each HTTP request by method and path)."""

    def __init__(self) -> None:
        self._rows: dict[str, list[tuple[float, float]]] = {}  # name: [(wall s, cpu s) per call]
        self._lock = threading.Lock()

    def wrap(self, obj: Any, names: list[str], prefix: str | None = None) -> CallTimes:
        label = prefix if prefix is not None else type(obj).__name__
        for name in names:
            original = getattr(obj, name)  # AttributeError here, not at the first call
            setattr(obj, name, self.timed(original, f"{label}.{name}"))
        return self

    def timed(self, original: Callable[..., Any], name: str | Callable[..., str]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                sample = (time.perf_counter() - wall, time.thread_time() - cpu)
                key = name if isinstance(name, str) else name(*args, **kwargs)
                with self._lock:
                    self._rows.setdefault(key, []).append(sample)

        return timed

    def take(self) -> dict[str, dict[str, float]]:
        """{name: calls, wall ms in all, median and longest call ms, its thread's CPU ms in all},
        by name, since the last take."""
        with self._lock:
            rows, self._rows = self._rows, {}
        taken: dict[str, dict[str, float]] = {}
        for key, samples in sorted(rows.items()):
            walls = [wall for wall, _cpu in samples]
            taken[key] = {
                "calls": len(samples),
                "ms": round(sum(walls) * 1e3, 3),
                "median_ms": round(statistics.median(walls) * 1e3, 3),
                "max_ms": round(max(walls) * 1e3, 3),
                "cpu_ms": round(sum(cpu for _wall, cpu in samples) * 1e3, 3),
            }
        return taken

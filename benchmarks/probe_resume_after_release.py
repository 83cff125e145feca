"""Probe: why a trainer's resume runs at a third of PCIe speed right after the rollout released most of the card.

    python benchmarks/probe_resume_after_release.py [--move-gib 2.22] [--release-gib 30,119] [--out probe.json]

`bench_phase_switch.py`'s budget columns (docs/measurements.md, Memory budget) saw the trainer's
`memory.resume` of torch_memory_saver's retained CPU backup run at 16 GB/s whenever it came right
after the rollout process had released 119-134 GiB, against 45 GB/s otherwise. One guess: the
driver scrubs memory another process freed before handing it out again, in the background and
with the copy engines, so host-to-device copies issued meanwhile wait for them. This probe tells
that guess from the others by timing the same bytes moved four ways right after another process
released R GiB, and again after waiting S seconds:

- `resume`: torch_memory_saver resumes a tag with a retained CPU backup (map + host-to-device copy);
- `map`: it resumes a tag without a backup (map only, nothing copied);
- `h2d`: a plain pinned host-to-device `copy_` into memory mapped all along (a copy engine);
- `h2d_sm`: the same bytes read from the same pinned buffer by a Triton kernel (the SMs read host
  memory over PCIe; no copy engine);
- `d2d`: a device-to-device `copy_` of the same bytes (no PCIe).

If the scrub is it: `resume` and `h2d` are slow at S = 0 and recover as S grows, with R; `map` is
fast (pages come scrubbed or not at all, it copies nothing); `h2d_sm` and `d2d` are not slowed, or
far less. If `map` is slow, it is the allocation; if every kind is slow, it is the memory system.

The rollout is a second process (spawned) holding R GiB in torch_memory_saver tags, as SGLang's
KV cache is held; both processes use the torch hook mode, as the bench does. Needs a CUDA GPU and
torch_memory_saver; Triton for `h2d_sm` (left out without it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
KINDS = ("resume", "map", "h2d", "h2d_sm", "d2d")
PCIE_KINDS = ("resume", "h2d", "h2d_sm")  # the kinds whose bytes cross PCIe


# ---------------------------------------------------------------------------------------------- report


def summarize(trials: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Per kind: the median seconds with nothing released (the baseline) and, per released size and
    wait, the median and its ratio to the baseline; `recovered_after_s`: the shortest wait whose
    median is within 25% of the baseline (None: none was)."""
    out: dict[str, Any] = {}
    for kind in sorted({t["kind"] for t in trials}, key=lambda k: KINDS.index(k) if k in KINDS else 99):
        mine = [t for t in trials if t["kind"] == kind]
        base_times = [t["seconds"] for t in mine if t["released_gib"] == 0]
        if not base_times:
            continue
        base = statistics.median(base_times)
        rows: dict[str, Any] = {}
        for released in sorted({t["released_gib"] for t in mine if t["released_gib"] > 0}):
            waits: dict[str, Any] = {}
            recovered = None
            for wait in sorted({t["wait_s"] for t in mine if t["released_gib"] == released}):
                times = [t["seconds"] for t in mine if t["released_gib"] == released and t["wait_s"] == wait]
                median = statistics.median(times)
                waits[f"{wait:g}"] = {
                    "s": round(median, 4),
                    "gbps": round(nbytes / 1e9 / median, 1) if median > 0 else None,
                    "x_baseline": round(median / base, 2) if base > 0 else None,
                }
                if recovered is None and median <= 1.25 * base:
                    recovered = wait
            rows[f"{released:g}"] = {"waits": waits, "recovered_after_s": recovered}
        out[kind] = {
            "baseline_s": round(base, 4),
            "baseline_gbps": round(nbytes / 1e9 / base, 1) if base > 0 else None,
            "released": rows,
        }
    return out


def verdict(summary: dict[str, Any]) -> str:
    """One line: which kinds the release slowed at once (>= 1.5x the baseline at wait 0, the largest release)."""

    def slowed(kind: str) -> bool | None:
        rows = summary.get(kind, {}).get("released") or {}
        if not rows:
            return None
        largest = rows[max(rows, key=float)]
        first = largest["waits"].get("0")
        return None if first is None else first["x_baseline"] >= 1.5

    flags = {kind: slowed(kind) for kind in KINDS}
    slow = [k for k, v in flags.items() if v]
    fast = [k for k, v in flags.items() if v is False]
    if not slow:
        return f"nothing was slowed by the other process's release ({', '.join(fast)} at their baselines)"
    cause = "unexplained by this probe"
    if flags["map"]:
        cause = "mapping new memory waits (the allocation itself)"
    elif flags["h2d"] and flags["h2d_sm"] is False and not flags["d2d"]:
        cause = (
            "copy-engine transfers wait while SM reads of the same host memory do not: consistent with the "
            "driver scrubbing the freed memory with the copy engines"
        )
    elif flags["h2d"] and flags["h2d_sm"] and not flags["d2d"]:
        cause = "every transfer over PCIe waits, whatever moves it"
    elif flags["d2d"]:
        cause = "device memory itself is busy (device-to-device copies wait too)"
    return f"slowed right after the release: {', '.join(slow)}; not: {', '.join(fast) or '-'}; {cause}"


def print_report(report: dict[str, Any]) -> None:
    summary = report["summary"]
    print(
        f"\nresume after another process's release ({report['device']}, {report['move_gib']} GiB moved per "
        f"trial, median of {report['repeat']}); seconds (GB/s), x = over the baseline with nothing released"
    )
    waits = report["waits"]
    header = f"{'kind':8} {'released':>9} " + " ".join(
        f"{'wait ' + format(w, 'g') + ' s':>20}" for w in waits
    )
    print(header)
    print("-" * len(header))
    for kind, row in summary.items():
        print(f"{kind:8} {'0 GiB':>9} {row['baseline_s']:>9.4f} ({row['baseline_gbps']:>6} GB/s)")
        for released, cells in row["released"].items():
            parts = []
            for wait in waits:
                cell = cells["waits"].get(f"{wait:g}")
                parts.append(
                    f"{'-':>20}"
                    if cell is None
                    else f"{cell['s']:>8.4f} {cell['x_baseline']:>5.2f}x {cell['gbps']:>5}"
                )
            print(f"{'':8} {released + ' GiB':>9} " + " ".join(parts))
    print(f"rollout's release (pause of its tags), median s by GiB: {report['release_s']}")
    print(f"contents after every resume intact: {report['intact']}")
    print(f"verdict: {report['verdict']}")


# ---------------------------------------------------------------------------------------------- rollout


def rollout_main(sizes_gib: list[float], conn: Any) -> None:
    """Holds `sizes_gib` cumulatively in tags kv0, kv1, ...: releasing R GiB pauses the tags up to R."""
    import os

    import torch
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"
    torch.cuda.set_device(0)
    tags: list[tuple[str, float]] = []
    held = []
    previous = 0.0
    for index, size in enumerate(sizes_gib):
        tag = f"kv{index}"
        with saver.region(tag):
            chunk = torch.empty(int((size - previous) * GIB), dtype=torch.uint8, device="cuda")
            chunk.fill_(1)  # touched, as a KV pool that has served requests
        held.append(chunk)
        tags.append((tag, size))
        previous = size
    torch.cuda.synchronize()
    conn.send(("ok", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        method, size = message
        picked = [tag for tag, upto in tags if upto <= size + 1e-9]
        start = time.perf_counter()
        for tag in picked:
            getattr(saver, method)(tag)
        torch.cuda.synchronize()
        conn.send(("ok", time.perf_counter() - start))
    conn.close()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- trainer


def sm_copy() -> Any:
    """A Triton kernel that reads pinned host memory through its device-visible address (SMs, no copy engine)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    class Pointer:  # Triton takes any object with data_ptr() and dtype as a pointer argument
        def __init__(self, tensor: Any) -> None:
            self.dtype, self._ptr = tensor.dtype, tensor.data_ptr()

        def data_ptr(self) -> int:
            return self._ptr

    def copy(dst: Any, src_pinned: Any) -> None:
        n = dst.numel()
        block = 8192
        _copy[(triton.cdiv(n, block),)](Pointer(src_pinned), dst, n, BLOCK=block, num_warps=16)

    return copy


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"
    saver.retain_cpu_backup = True
    torch.cuda.set_device(0)
    nbytes = int(args.move_gib * GIB) // 16 * 16
    words = nbytes // 8
    free, total = torch.cuda.mem_get_info()
    # the trainer: two tags of the moved size (one with a backup), a plain buffer pair, its context
    room = free / GIB - 4 * args.move_gib - 4.0
    sizes = sorted(min(s, room) for s in args.release_gib)
    if sizes[-1] < 1:
        raise SystemExit(f"probe_resume_after_release: only {free / GIB:.1f} GiB free; lower --move-gib")

    with saver.region("params", enable_cpu_backup=True):
        params = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, device="cuda")
    with saver.region("mapped"):
        _mapped = torch.empty(words, dtype=torch.int64, device="cuda")  # held until the end
    plain = torch.empty(words, dtype=torch.int64, device="cuda")
    other = torch.empty(words, dtype=torch.int64, device="cuda")
    host = torch.empty(words, dtype=torch.int64, pin_memory=True)
    host.copy_(params)
    expected = int(params[:: max(1, words // 4096)].sum())
    torch.cuda.synchronize()
    saver.pause("params")  # the first pause allocates the retained backup
    saver.pause("mapped")
    kinds = list(KINDS)
    copy_sm = None
    try:
        copy_sm = sm_copy()
        copy_sm(plain, host)
        torch.cuda.synchronize()
        if not torch.equal(plain, other.copy_(host)):
            raise RuntimeError("the SM copy read other bytes than the copy engine")
    except Exception as exc:  # no Triton, or it refuses the host pointer: that kind is left out
        print(f"h2d_sm left out: {exc!r}", file=sys.stderr)
        kinds.remove("h2d_sm")

    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    rollout = ctx.Process(target=rollout_main, args=(sizes, theirs), daemon=True)
    rollout.start()
    status, _ = conn.recv()
    assert status == "ok"

    def rollout_call(method: str, size: float) -> float:
        conn.send((method, size))
        status, value = conn.recv()
        assert status == "ok", value
        return float(value)

    ops = {
        "resume": lambda: saver.resume("params"),
        "map": lambda: saver.resume("mapped"),
        "h2d": lambda: plain.copy_(host, non_blocking=True),
        "h2d_sm": lambda: copy_sm(plain, host) if copy_sm else None,
        "d2d": lambda: other.copy_(plain),
    }
    undo = {"resume": lambda: saver.pause("params"), "map": lambda: saver.pause("mapped")}
    trials: list[dict[str, Any]] = []
    releases: dict[str, list[float]] = {}
    intact = True
    plan = [(kind, 0.0, 0.0) for kind in kinds]
    plan += [(kind, size, wait) for size in sizes for wait in args.waits for kind in kinds]
    for kind in kinds:  # warm-up: each kind once, nothing released
        ops[kind]()
        torch.cuda.synchronize()
        if kind in undo:
            undo[kind]()
    for _ in range(args.repeat):
        for kind, size, wait in plan:
            if size > 0:
                releases.setdefault(f"{size:g}", []).append(rollout_call("pause", size))
            if wait > 0:
                time.sleep(wait)
            torch.cuda.synchronize()
            start = time.perf_counter()
            ops[kind]()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if kind == "resume":
                intact = intact and int(params[:: max(1, words // 4096)].sum()) == expected
            if kind in undo:
                undo[kind]()
                torch.cuda.synchronize()
            if size > 0:
                rollout_call("resume", size)
            trials.append({"kind": kind, "released_gib": size, "wait_s": wait, "seconds": seconds})
    conn.send(None)
    rollout.join(30)
    summary = summarize(trials, nbytes)
    return {
        "device": torch.cuda.get_device_name(0),
        "move_gib": round(nbytes / GIB, 2),
        "repeat": args.repeat,
        "waits": args.waits,
        "released_gib": sizes,
        "card_gib": round(total / GIB, 1),
        "release_s": {k: round(statistics.median(v), 4) for k, v in releases.items()},
        "intact": intact,
        "summary": summary,
        "verdict": verdict(summary),
        "trials": trials,
    }


def floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--move-gib", type=float, default=2.22, help="bytes moved per trial (the bench's params)"
    )
    parser.add_argument(
        "--release-gib", type=floats, default=[30.0, 119.0], help="what the other process releases (GiB)"
    )
    parser.add_argument("--waits", type=floats, default=[0.0, 0.05, 0.15, 0.4, 1.0], help="seconds after it")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.move_gib <= 0 or args.repeat < 1 or not any(s > 0 for s in args.release_gib):
        parser.error("--move-gib and a --release-gib must be positive, --repeat at least 1")
    args.release_gib = [s for s in args.release_gib if s > 0]
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        gpu = False
    if not gpu:
        print("probe_resume_after_release: needs a CUDA GPU, torch and torch_memory_saver", file=sys.stderr)
        return 2
    report = run(args)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

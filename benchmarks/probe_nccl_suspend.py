"""Probe: can NCCL release a communicator's memory without backing its contents up, and what does the backup cost?

    python benchmarks/probe_nccl_suspend.py --nccl-lib /path/to/nvidia/nccl/lib/libnccl.so.2

What NCCL 2.30.7's source says (src/mem_manager.cc, src/include/mem_manager.h, nccl.h): suspend
handles each tracked allocation by its kind, fixed where it is allocated. `ncclMemScratch` is
released without a copy; `ncclMemOffload` is copied into freshly allocated pinned host memory
(cudaHostAlloc + a synchronous cudaMemcpy per allocation) and copied back on resume;
`ncclMemPersist` (NVLS buffers among them) is never released. The transports' buffers (p2p,
channels) are allocated as Offload, and no allocation in the source is Scratch. The only flag is
NCCL_SUSPEND_MEM (0x01); the only variable of the memory manager is NCCL_DISABLE_MEM_MANAGER,
which makes suspend refuse. So nothing skips the backup; what can change its size is how much
the buffers take (NCCL_BUFFSIZE, channels, protocols), and with NCCL_CUMEM_ENABLE=0 the buffers are
plain cudaMalloc memory that the manager does not track (nothing to release).

Each variant runs in a fresh process (NCCL reads its variables once): one rank, WORLD + N
subgroups, each warmed by an all_reduce, then suspend and resume every communicator through
`actor_integration.backends.process_groups` (the same calls `communicators="suspend"` makes), timed one
by one. NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=ALLOC logs, per suspend, how many bytes were
scratch (released) and offload (copied to host): summed here. The same bytes are then allocated
as pinned host memory and copied device to host outside NCCL, to show what the backup alone
costs. Needs a GPU and NCCL 2.29.7+ (`--nccl-lib`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = 1 << 20
# variant -> the NCCL variables it sets
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "buffsize-1MiB": {"NCCL_BUFFSIZE": str(1 << 20)},  # 4 MiB by default: a quarter of the Simple buffers
    "cumem-off": {"NCCL_CUMEM_ENABLE": "0"},  # plain cudaMalloc buffers, not tracked by the manager
    "mem-manager-off": {"NCCL_DISABLE_MEM_MANAGER": "1"},  # the manager's one variable
}
# nccl/src/mem_manager.cc, INFO(NCCL_ALLOC, ...) at the end of a suspend
SUSPENDED_LINE = re.compile(
    r"MemManager: rank \d+ suspended (\d+) local \+ (\d+) peer entries \(scratch=(\d+), offload=(\d+), "
    r"peerImport=(\d+), cpuBackup=(\d+)\)"
)


def parse_suspend_lines(text: str) -> dict[str, int]:
    """Sum NCCL's per-suspend INFO lines: entries, scratch (released) and offload (backed up) bytes."""
    totals = {"suspends": 0, "entries": 0, "scratch_bytes": 0, "offload_bytes": 0, "peer_import_bytes": 0}
    for match in SUSPENDED_LINE.finditer(text):
        local, peer, scratch, offload, peer_import, _backup = (int(g) for g in match.groups())
        totals["suspends"] += 1
        totals["entries"] += local + peer
        totals["scratch_bytes"] += scratch
        totals["offload_bytes"] += offload
        totals["peer_import_bytes"] += peer_import
    return totals


# ---------------------------------------------------------------------------------------------- child


def child(variant: str, groups: int, cycles: int, log_dir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from actor_integration.backends.process_groups import _nccl, loaded_nccl, nccl_suspend_support

    torch.cuda.set_device(0)
    result: dict[str, Any] = {"variant": variant, "env": VARIANTS[variant]}
    loaded = loaded_nccl()
    result["nccl"] = None if loaded is None else ".".join(map(str, loaded.version))
    support = nccl_suspend_support("nccl")
    result["support"] = support.reason
    if not support.available:
        return result

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    pgs = [dist.group.WORLD, *(dist.new_group([0]) for _ in range(groups))]
    ones = torch.ones(1 << 20, device="cuda")

    def collectives_ok() -> bool:
        ok = True
        for pg in pgs:
            x = ones.clone()
            dist.all_reduce(x, group=pg)
            ok = ok and bool(torch.all(x == 1.0))
        torch.cuda.synchronize()
        return ok

    collectives_ok()
    communicators = [_nccl.communicator_of(pg) for pg in pgs]
    assert all(c is not None and c.created() for c in communicators)
    try:
        stats = [c.stats() for c in communicators if c is not None]
    except Exception as exc:  # mem-manager-off: ncclCommMemStats refuses too
        stats, result["memstats_error"] = [None], repr(exc)
    result["memstats_mib"] = None
    if all(s is not None for s in stats):
        result["memstats_mib"] = {
            key: round(sum(getattr(s, key) for s in stats if s is not None) / MIB, 1)
            for key in ("suspendable", "persistent", "total")
        }
    result["cycles"] = []
    for _ in range(cycles):
        awake = used()
        per_comm: list[float] = []
        error = None
        t0 = time.perf_counter()
        try:
            for communicator in communicators:
                assert communicator is not None
                start = time.perf_counter()
                communicator.suspend()
                per_comm.append(time.perf_counter() - start)
        except Exception as exc:  # mem-manager-off: refused
            error = repr(exc)
        suspend_s = time.perf_counter() - t0
        asleep = used()
        resumed = len(per_comm)
        t0 = time.perf_counter()
        for communicator in communicators[:resumed]:
            assert communicator is not None
            communicator.resume()
        resume_s = time.perf_counter() - t0
        result["cycles"].append(
            {
                "suspend_s": round(suspend_s, 4),
                "per_comm_s": [round(t, 4) for t in per_comm],
                "resume_s": round(resume_s, 4),
                "freed_mib": round((awake - asleep) / MIB, 1),
                "collectives_ok": collectives_ok(),
                "error": error,
            }
        )
        if error:
            break
    for pg in pgs[1:]:
        dist.destroy_process_group(pg)
    dist.destroy_process_group()
    logged = "".join(p.read_text(errors="replace") for p in log_dir.glob("nccl.*.log"))
    result["nccl_log"] = parse_suspend_lines(logged)
    offload = result["nccl_log"]["offload_bytes"] // max(result["nccl_log"]["suspends"], 1) * len(pgs)
    result["backup_outside_nccl"] = backup_cost(offload if offload else 0)
    return result


def backup_cost(nbytes: int) -> dict[str, Any]:
    """What copying `nbytes` to fresh pinned host memory costs outside NCCL (alloc, copy, free)."""
    import torch

    if nbytes <= 0:
        return {"bytes": 0}
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    host.copy_(device)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    del host
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {
        "bytes": nbytes,
        "pinned_alloc_s": round(alloc_s, 4),
        "d2h_copy_s": round(copy_s, 4),
        "d2h_gbps": round(nbytes / 1e9 / copy_s, 1),
    }


# ---------------------------------------------------------------------------------------------- parent


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            **VARIANTS[variant],
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "ALLOC",
            "NCCL_DEBUG_FILE": f"{tmp}/nccl.%p.log",
        }
        if args.nccl_lib:
            env["LD_PRELOAD"] = ":".join(
                p for p in (str(args.nccl_lib), os.environ.get("LD_PRELOAD", "")) if p
            )
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", variant, "--groups", str(args.groups)]
        command += ["--cycles", str(args.cycles), "--child-out", str(out), "--log-dir", tmp]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not out.exists():
            return {"variant": variant, "error": (proc.stdout + proc.stderr)[-2000:]}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print(
        "ncclCommSuspend / ncclCommResume, one rank, WORLD + subgroups warmed; seconds, MiB; median of cycles"
    )
    header = (
        f"{'variant':<16} {'NCCL':>7} {'suspendable':>11} {'freed':>8} {'offload':>8} {'scratch':>8} "
        f"{'suspend':>8} {'resume':>7} {'ok':>4}  backup outside NCCL (pinned alloc + D2H)"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r or not r.get("cycles"):
            print(f"{r['variant']:<16} {r.get('error') or r.get('support')}")
            continue
        cycles = r["cycles"]

        def med(key: str, cycles: list[dict[str, Any]] = cycles) -> float:
            return float(statistics.median(c[key] for c in cycles))

        log, memstats = r["nccl_log"], r.get("memstats_mib") or {}
        per = max(log["suspends"], 1)
        offload = log["offload_bytes"] / per * (len(cycles[0]["per_comm_s"]) or 1) / MIB
        scratch = log["scratch_bytes"] / per * (len(cycles[0]["per_comm_s"]) or 1) / MIB
        backup = r.get("backup_outside_nccl") or {}
        outside = (
            f"{backup['pinned_alloc_s']:.3f} + {backup['d2h_copy_s']:.3f} s ({backup['d2h_gbps']} GB/s)"
            if backup.get("bytes")
            else "-"
        )
        errors = [c["error"] for c in cycles if c.get("error")]
        print(
            f"{r['variant']:<16} {r['nccl']:>7} {memstats.get('suspendable', '-'):>11} {med('freed_mib'):>8.0f} "
            f"{offload:>8.0f} {scratch:>8.0f} {med('suspend_s'):>8.3f} {med('resume_s'):>7.3f} "
            f"{all(c['collectives_ok'] for c in cycles)!s:>4}  {outside}"
            + (f"  refused: {errors[0][:160]}" if errors else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nccl-lib", type=Path, help="libnccl.so.2 of NCCL 2.29.7+ (LD_PRELOAD in each variant)"
    )
    parser.add_argument("--groups", type=int, default=16, help="subgroups besides WORLD")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per variant, seconds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, args.groups, args.cycles, args.log_dir)
        args.child_out.write_text(json.dumps(result, default=str))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("probe_nccl_suspend needs a CUDA GPU and NCCL 2.29.7+ (--nccl-lib)", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    started = time.perf_counter()
    results = []
    for variant in variants:
        print(f"variant {variant} {VARIANTS[variant] or ''} ...", flush=True)
        results.append(run_variant(variant, args))
    print_table(results)
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Probe: where the cuda_ipc sender's host time goes before the hand-over (its `pack_ms`).

    python benchmarks/probe_sender_pack.py [--model-config configs/qwen2-0.5b] [--syncs 8] [--out probe.json]

On the H200 (docs/measurements.md, "slime's rollout actor: a hung server, the radix cache, the
sender's timing") the lifecycle's `WeightSender` spent 93-130 ms of host time per sync laying out,
packing and exporting the two 512 MiB buckets of a Qwen2-0.5B-shaped model (290 tensors, 0.99 GB),
against a whole sync of 12.1 ms into the offline engine on the same shape. That test alternated two
weight sets at different addresses, so the packer rebuilt its chunk tables every sync. This probe
runs the sender's transport alone in one process (no engine: each round is exported and its
grants given back, as a receiver does) for the same set every sync, for two sets alternating, and
for two alternating while another Python thread of this process burns CPU (a GIL convoy). It
prints per sync the host time of the export, the CPU time the exporting thread spent in it, and
the device time the packing then took, and a profile of the alternating syncs (functions by their
own time): whether the time is the table rebuild, the export of the CUDA IPC handles, a host sync,
waiting for the GIL, or something else. Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from actor_integration.models.qwen2 import QwenConfig, QwenLM
    from actor_integration.weight_sync.buckets import LayoutCache, iter_buckets
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from tests.helpers.host_time import HostTime

    torch.cuda.set_device(0)
    config = QwenConfig.from_json(args.model_config)
    sets = [QwenLM(config, seed=seed, device="cuda").named_weights() for seed in (1, 2)]
    transport = CudaIpcSender(device=0)
    layouts = LayoutCache()
    version = 0

    def one(named: dict[str, Any]) -> tuple[float, float, float]:
        nonlocal version
        version += 1
        start, cpu = time.perf_counter(), time.thread_time()
        transport.begin_round(version, 0)
        exported = [
            transport.export(position, bucket)
            for position, bucket in enumerate(
                iter_buckets(named.items(), args.bucket_mib << 20, align=transport.align, cache=layouts)
            )
        ]
        transport.ready()
        host, host_cpu = time.perf_counter(), time.thread_time()
        torch.cuda.synchronize()
        transport.abandon(exported)  # what the receiver does with a grant it no longer needs
        return (host - start) * 1e3, (time.perf_counter() - host) * 1e3, (host_cpu - cpu) * 1e3

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "tensors": len(sets[0]),
        "gb": round(sum(t.numel() * t.element_size() for t in sets[0].values()) / 1e9, 3),
    }
    # "rebuild": four copies of a set at other addresses, in turn: no kept plan fits, so every sync
    # builds its chunk tables (a trainer whose converted tensors land elsewhere each update).
    copies = [{n: t.clone() for n, t in sets[0].items()} for _ in range(4)]
    pool = [*sets, *copies]
    variants = (
        ("same", lambda i: 0),
        ("alternate", lambda i: i % 2),
        ("busy", lambda i: i % 2),
        ("rebuild", lambda i: 2 + i % 4),
    )
    for label, pick in variants:
        # "busy": alternating again, with another Python thread of this process burning CPU (a
        # GIL convoy: each call that lets the GIL go may wait a switch interval to get it back).
        stop = threading.Event()
        burner = threading.Thread(target=_burn, args=(stop,), daemon=True) if label == "busy" else None
        if burner is not None:
            burner.start()
        host, built = HostTime(), transport._packer.plans_built
        try:
            with host.measure():
                rows = [one(pool[pick(i)]) for i in range(args.syncs)]
        finally:
            stop.set()
            if burner is not None:
                burner.join()
        report[label] = {
            "host_ms": [round(h, 2) for h, _, _ in rows],
            "host_cpu_ms": [round(c, 2) for _, _, c in rows],
            "device_wait_ms": [round(d, 2) for _, d, _ in rows],
            "host_median_ms": round(statistics.median(h for h, _, _ in rows[1:]), 2),
            "plans_built": transport._packer.plans_built - built,
            # the syncs' thread: CPU, waiting for a CPU, blocked; the machine's busiest processes
            "scheduling": {k: v for k, v in host.summary(top=6).items() if k != "profile"},
        }

    def profiled(pick: Any) -> str:
        """`args.syncs` more syncs of `pool[pick(i)]` under cProfile: functions by own time."""
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.syncs):
            one(pool[pick(i)])
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        return text.getvalue()

    report["profile"] = profiled(lambda i: i % 2)
    report["rebuild_profile"] = profiled(lambda i: 2 + i % 4)
    if args.then_import:
        # What test 5's process holds besides the sender: SGLang's modules (slime's push imports
        # them) and a Ray driver. Then the rebuilding syncs again, timed and profiled.
        import ray
        import sglang.srt.utils
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401

        ray.init(num_cpus=4, include_dashboard=False)
        times = [one(pool[2 + i % 4]) for i in range(args.syncs)]
        report["rebuild_after_imports"] = {
            "host_ms": [round(h, 2) for h, _, _ in times],
            "host_cpu_ms": [round(c, 2) for _, _, c in times],
            "torch_threads": torch.get_num_threads(),
            "profile": profiled(lambda i: 2 + i % 4),
        }
        ray.shutdown()
    report["plans_built"] = transport._packer.plans_built
    report["staging_allocations"] = transport.allocations
    report["exports_through_own_storage"] = transport.alias_exports
    transport.release()
    return report


def _burn(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=Path, default=REPO / "configs" / "qwen2-0.5b")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--syncs", type=int, default=8, help="syncs per variant (the first is reported apart)"
    )
    parser.add_argument("--top", type=int, default=20, help="profile rows")
    parser.add_argument(
        "--then-import",
        action="store_true",
        help="then import SGLang's modules and start a Ray driver, and time the rebuilding syncs again",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.syncs < 2 or args.bucket_mib < 1 or args.top < 1:
        parser.error("--syncs must be at least 2, --bucket-mib and --top at least 1")
    if not (args.model_config / "config.json").is_file():
        parser.error(f"--model-config: no config.json in {args.model_config}")
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        print(
            "probe_sender_pack: needs a CUDA GPU (the cuda_ipc transport and its Triton kernel)",
            file=sys.stderr,
        )
        return 2
    report = run(args)
    for label in ("same", "alternate", "busy", "rebuild"):
        row = report[label]
        print(
            f"{label:9} host ms per sync {row['host_ms']}  (median after the first {row['host_median_ms']})"
        )
        print(f"{'':9} its CPU ms        {row['host_cpu_ms']}")
        print(f"{'':9} device wait ms    {row['device_wait_ms']}")
        sched = row["scheduling"]
        print(
            f"{'':9} all syncs: wall {sched['wall_ms']} ms = CPU {sched['caller_cpu_ms']} + waiting for a CPU "
            f"{sched['caller_run_queue_ms']} + blocked {sched['caller_blocked_ms']}; switches {sched['caller_switches']}"
        )
    print(
        f"plans built {report['plans_built']}, staging allocations {report['staging_allocations']}, "
        f"exports through their own storage {report['exports_through_own_storage']}"
    )
    print(report["profile"][-6000:])
    after = report.get("rebuild_after_imports")
    if after:
        print(
            f"rebuild after importing SGLang and starting Ray: host ms {after['host_ms']}, CPU ms {after['host_cpu_ms']}"
        )
        print(after["profile"][-5000:])
    print("every sync rebuilding its tables:")
    print(report["rebuild_profile"][-6000:])
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

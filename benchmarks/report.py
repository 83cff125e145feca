"""One benchmark report: FSM overhead, host RSS during a sync, and on a GPU host sleep/wake and sync bandwidth.

    python benchmarks/report.py [--out out/bench.json]

Each part runs in its own process and prints its figures next to the ceiling or baseline it
measured in the same run; this script collects them into one JSON and one summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _run(script: str, out: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE / script), "--out", str(out), *extra], text=True)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"{script} exited with {proc.returncode}"}
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def host_rss(bucket_mib: int = 8, tensors: int = 24, tensor_mib: int = 8) -> dict[str, Any]:
    """Peak host RSS growth of a sender during a shm and a disk sync, against one bucket (the ceiling).

    Uses the measurement of the weight-sync process tests (a sender process, a verifying receiver in
    another process), so the figure here and the test's bound come from one piece of code.
    """
    sys.path.insert(0, str(ROOT / "tests" / "actor_integration" / "weight_sync"))
    import test_sync_processes as sync

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = sync.SPAWN.Pipe()
        sink = sync.SPAWN.Process(target=sync.serve_sink, args=(theirs,), daemon=True)
        sink.start()
        try:
            child = sync.SPAWN.Process(
                target=sync.rss_main,
                args=(ours, Path(tmp), str(Path(tmp) / "disk"), bucket_mib << 20, tensors, tensor_mib << 20),
            )
            child.start()
            child.join(300)
        finally:
            sync.stop_engine(sink, ours)
        (result,) = sync.read(Path(tmp), 1)
    return {
        transport: {
            "sent_mib": r["bytes"] / 2**20,
            "peak_rss_growth_mib": round(r["growth"] / 2**20, 1),
            "one_bucket_mib": bucket_mib,
        }
        for transport, r in result.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent
    report: dict[str, Any] = {"fsm": _run("bench_fsm.py", work / "bench_fsm.json")}
    report["host_rss_during_sync"] = host_rss()
    import torch

    if torch.cuda.is_available():
        report["sleep_wake"] = _run("bench_sleep_wake.py", work / "bench_sleep_wake.json")
        report["sync"] = _run("bench_sync.py", work / "bench_sync.json")
    else:
        report["gpu"] = "skipped: no CUDA GPU (sleep/wake and sync bandwidth need one)"
    args.out.write_text(json.dumps(report, indent=2))
    print("\nhost RSS during a sync (ceiling: one bucket):")
    for transport, r in report["host_rss_during_sync"].items():
        print(
            f"  {transport:5} sent {r['sent_mib']:.0f} MiB: peak RSS growth {r['peak_rss_growth_mib']} MiB, "
            f"one bucket {r['one_bucket_mib']} MiB"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

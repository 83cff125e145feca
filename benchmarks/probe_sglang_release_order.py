"""Which order of the sync bench's last steps ends SGLang's scheduler (issue 46), on one engine.

    python benchmarks/probe_sglang_release_order.py [--out FILE]

`bench_sglang_sync.py` at 4b4cbeb died with "CUDA error: an illegal memory access" in the scheduler
inside a release. Two of its steps differ from what the rollout and the tests do, and this probe
takes them one at a time on a real `sglang.Engine` (0.5B shape, dummy weights, CUDA graphs off,
as the bench starts it), printing one line per stage:

  1. `sleep_at_start`: the rollout's sleep (pause, flush, release weights and KV cache) right
     after start, before anything was generated (the bench's first sleep; the tests generate first).
  2. `sync`: weights woken, one version through the lifecycle's sender (the schedulers open the
     trainer's staging by CUDA IPC handle and keep the handles cached across syncs).
  3. `sender_closed_first`: the sender frees its staging (`WeightSender.close`) while the
     schedulers still hold their cached handles, then the schedulers are told to let go
     (`release_payload_handles`): the bench's order before the fix.
  4. `sleep_after`: the KV cache woken, the rollout's sleep again.
  5. `generate_after`: wake, sync again (a new sender), generate.

A stage that raises is printed with its error; the scheduler's own traceback is in this
process's output (SGLang's scheduler writes to it). Exit code 0 if every stage passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[11, 12, 13, 14], [100, 2000, 30000]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", help="a config directory in configs/")
    parser.add_argument("--out", type=Path, default=None, help="write the stages as JSON here")
    args = parser.parse_args(argv)
    if not (REPO / "configs" / args.shape / "config.json").is_file():
        parser.error(f"unknown shape {args.shape!r} (see configs/)")
    if not torch.cuda.is_available():
        parser.error("needs a GPU and sglang (scripts/gpu_sglang.sh sets them up on the GPU machine)")
    torch.cuda.set_device(0)

    from actor_integration.rollout import RolloutActor, SGLangEngine
    from actor_integration.weight_sync import RankSlot, WeightSender
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender

    sys.path.insert(0, str(REPO))  # run as a script: the repository's benchmarks/ as a package
    from benchmarks.bench_sglang_sync import engine_arguments, trainer_tensors

    engine = SGLangEngine(**engine_arguments(args.shape))  # as the bench starts it
    weights = trainer_tensors(REPO / "configs" / args.shape)
    actor = RolloutActor(engine)
    versions = iter(range(1, 100))

    def new_sender() -> Any:
        return WeightSender(
            RankSlot.single(0),
            None,
            CudaIpcSender(device=0),
            rank=0,
            engine_call=actor.update_weights,
            bucket_bytes=512 << 20,
            deadline_s=300,
        )

    senders: list[Any] = []

    def sync() -> None:
        senders.append(new_sender())
        senders[-1].send(next(versions), weights.items())

    def sender_closed_first() -> None:
        senders[-1].close()
        torch.cuda.empty_cache()
        engine.release_payload_handles()

    def generate_after() -> None:
        actor.wake_up(["weights"])
        sync()
        actor.wake_up(["kv_cache"])
        out = actor.generate(PROMPTS)
        assert all(len(o) == 8 for o in out), out

    def sleep_at_start() -> None:
        actor.sleep()
        actor.wake_up(["weights"])

    def sleep_after() -> None:
        actor.wake_up(["kv_cache"])
        actor.sleep()

    stages = [
        ("sleep_at_start", sleep_at_start),
        ("sync", sync),
        ("sender_closed_first", sender_closed_first),
        ("sleep_after", sleep_after),
        ("generate_after", generate_after),
    ]
    results: list[dict[str, Any]] = []
    try:
        for name, stage in stages:
            started = time.perf_counter()
            try:
                stage()
            except Exception as exc:  # each stage's error is the finding
                results.append({"stage": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
                print(f"probe {name}: FAILED {results[-1]['error']}", flush=True)
                break
            results.append({"stage": name, "ok": True, "ms": round((time.perf_counter() - started) * 1e3, 1)})
            print(f"probe {name}: ok ({results[-1]['ms']} ms)", flush=True)
    finally:
        for sender in senders[1:]:
            sender.close()
        engine.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps({"stages": results}, indent=2))
    return 0 if all(r["ok"] for r in results) and len(results) == len(stages) else 1


if __name__ == "__main__":  # SGLang starts its scheduler with the spawn method
    sys.exit(main())

"""The sender's host time per update on a real checkpoint layout, on a machine without a GPU.

    python benchmarks/bench_sync_host.py --layout dense moe [--updates 7]

The GPU's part is left out on purpose: `CudaIpcSender` runs with its CUDA calls stubbed (IPC
export, events, the kernel launch a no-op) and host staging buffers, so what is timed is the host
work a real sync does per update (layouts, plan and table lookups, manifests) for the default
path and the arena. This is how the arena's 12.2 ms on the Qwen3-4B layout (H200 host, against
0.9 ms for Qwen3-30B-A3B) was found: a table cache that held 16 of its 17 buckets.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lifecycle
from actor_integration.weight_sync import RankSlot, WeightSender, cuda_ipc, kernels
from actor_integration.weight_sync.buckets import WSUM64_DEVICE
from actor_integration.weight_sync.checkpoint_layouts import (
    LAYOUTS,
    layers_within,
    tensor_specs,
)


class HostIpcSender(cuda_ipc.CudaIpcSender):
    """`CudaIpcSender` on host memory: its host code runs, its device calls do nothing."""

    def __init__(self) -> None:
        cuda_ipc.SenderTransport.__init__(self)
        self.device = torch.device("cpu")
        self._memory, self._pool, self._generation = None, None, 0
        self._staging: dict[str, Any] = {}
        self._packer = kernels.DevicePacker(self.device)
        self._exports: list[Any] = []
        self._events: dict[int, Any] = {}
        self.allocations, self._gpu = 0, 0
        self._alias_exports, self.alias_exports = True, 0

    def _event(self) -> Any:
        return (None, b"event")

    def ready(self) -> Any:
        buckets, self._exports = self._exports, []
        return [b.manifest(0, WSUM64_DEVICE) for b in buckets]

    def _buffer(self, key: str, need: int) -> Any:
        current = self._staging.get(key)
        if current is None or current.capacity < need:
            tensor = torch.empty(need, dtype=torch.uint8)
            current = self._staging[key] = cuda_ipc._Staging(
                tensor, f"{self.sender_id}:{key}:{self._generation}", need
            )
            self._generation += 1
        return current

    def release(self) -> None:
        self._staging.clear()
        self._packer.clear()


def stub_device_calls() -> None:
    kernels._module = type("Launcher", (), {"launch": staticmethod(lambda *a, **k: None)})
    kernels.INTERPRET_ON_CPU = True
    torch.UntypedStorage._share_cuda_ = lambda self: (0, b"h", self.nbytes(), 0, b"rc", 0, b"e", False)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--updates", type=int, default=7, help="updates per path (the first is cold)")
    parser.add_argument(
        "--ray-driver",
        action="store_true",
        help="also time the default path in a Ray driver (a local cluster, log_to_driver), idle and "
        "while an actor logs without pause: whether the driver's threads slow the sender's host work",
    )
    args = parser.parse_args(argv)
    lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    stub_device_calls()
    for name in args.layout:
        shape = LAYOUTS[name]
        specs = tensor_specs(shape, layers=layers_within(shape, int(args.gib * 2**30)))
        meta = {n: torch.empty(d, dtype=t, device="meta") for n, d, t in specs}
        sender = WeightSender(
            RankSlot.single(0),
            None,
            HostIpcSender(),
            rank=0,
            engine_call=lambda v, p: None,
            bucket_bytes=args.bucket_mib << 20,
            deadline_s=60,
        )
        # Never written, so never backed by memory: the stubbed launches only read addresses.
        weights = {n: torch.empty(d, dtype=t) for n, d, t in specs}
        arena = sender.arena(meta)
        for what, source in (("default", weights), ("arena", arena)):
            start = 1 if what == "default" else args.updates + 1
            packs = [sender.send(v, source).phases_ms["pack_ms"] for v in range(start, start + args.updates)]
            print(
                f"{name} ({shape.name}, {len(specs)} tensors, {len(arena.buckets)} buckets): {what}, sender "
                f"host pack {statistics.median(packs[1:]):.2f} ms per warm update (cold {packs[0]:.0f} ms)",
                flush=True,
            )
        if args.ray_driver:
            ray_driver(sender, weights, args.updates, start=2 * args.updates + 1)
        sender.close()
        del arena, weights
    return 0


def ray_driver(sender: WeightSender, weights: dict[str, torch.Tensor], updates: int, start: int) -> None:
    """The default path again in this process made a Ray driver, idle and beside an actor that
    logs without pause (its lines reach the driver through Ray's log thread)."""
    import time

    import ray

    def packs(first: int) -> float:
        times = [sender.send(v, weights).phases_ms["pack_ms"] for v in range(first, first + updates)]
        return statistics.median(times[1:])

    plain = packs(start)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        idle = packs(start + updates)

        @ray.remote(num_cpus=0.1)
        class Talker:
            def talk(self, seconds: float) -> int:
                end, lines = time.monotonic() + seconds, 0
                while time.monotonic() < end:
                    print("log line " + "x" * 100, file=sys.stderr, flush=True)
                    lines += 1
                return lines

        talker = Talker.remote()  # type: ignore[attr-defined]
        ray.get(talker.talk.remote(0.5))  # started and logging
        talking = talker.talk.remote(5)
        busy = packs(start + 2 * updates)
        lines = ray.get(talking)
    finally:
        ray.shutdown()
    print(
        f"  default path, host pack per warm update: {plain:.2f} ms plain, {idle:.2f} ms in a Ray driver, "
        f"{busy:.2f} ms while an actor logged {lines} lines to it",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

"""Per-transition overhead of the machine, next to a bare `transitions` trigger and a bare call.

    python benchmarks/bench_fsm.py [--n 20000] [--out results.json]

Each figure is the median of several rounds, measured in this run. Targets (issue #2):
with logging filtered ≤ 2x a bare transitions trigger; with a JSON line per transition ≤ 50 µs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transitions import Machine

import lifecycle
from lifecycle import Hooks, Lifecycle, LifecyclePolicy


class NoopSaver:
    """No-op hooks with torch_memory_saver's interface."""

    def pause(self, tag: str | None = None) -> None:
        pass

    def resume(self, tag: str | None = None) -> None:
        pass

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield


class NoopGroups:
    def destroy(self) -> None:
        pass

    def reload(self) -> None:
        pass


def interleaved_us(
    loops: dict[str, Callable[[int], None]], n: int, rounds: int = 9
) -> dict[str, list[float]]:
    """µs per transition (2 per iteration) for each loop, rounds interleaved so load hits all alike."""
    for loop in loops.values():
        loop(min(n, 2000))  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            t0 = time.perf_counter()
            loop(n)
            samples[name].append((time.perf_counter() - t0) / (n * 2) * 1e6)
    return samples


def bare_call(n: int) -> None:
    def f() -> None:
        pass

    for _ in range(n):
        f()
        f()


def bare_transitions() -> Callable[[int], None]:
    class Model:
        pass

    model = Model()
    machine = Machine(model=model, states=["AWAKE", "PAUSED"], initial="AWAKE", auto_transitions=False)
    machine.add_transition("sleep", "AWAKE", "PAUSED")
    machine.add_transition("wake_up", "PAUSED", "AWAKE")

    def loop(n: int) -> None:
        for _ in range(n):
            model.sleep()  # type: ignore[attr-defined]
            model.wake_up()  # type: ignore[attr-defined]

    return loop


def machine_loop() -> Callable[[int], None]:
    lc = Lifecycle(
        LifecyclePolicy(use_routing_replay=True),
        Hooks(
            memory=NoopSaver(),
            process_groups=NoopGroups(),
            routing_replay=lambda: None,
            clear_memory=lambda: None,
            switch_model=lambda tag: None,
        ),
        rank=0,
        role="actor",
    )

    def loop(n: int) -> None:
        for _ in range(n):
            lc.sleep()
            lc.wake_up()

    return loop


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=20000, help="sleep+wake pairs per round")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    filtered = interleaved_us(
        {
            "bare_call_us": bare_call,
            "transitions_trigger_us": bare_transitions(),
            "machine_filtered_us": machine_loop(),
        },
        args.n,
    )
    with tempfile.TemporaryDirectory() as tmp:
        lifecycle.configure_logging(json_path=Path(tmp) / "bench.jsonl", level="info")
        json_line = interleaved_us(
            {"transitions_trigger_us": bare_transitions(), "machine_json_us": machine_loop()}, args.n // 4
        )
        lifecycle.flush_logs(30)
        lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    results = {name: statistics.median(values) for name, values in filtered.items()}
    results["machine_json_us"] = statistics.median(json_line["machine_json_us"])
    # The ratio of each round's pair, so a load spike inflates both sides of one ratio alike.
    results["filtered_ratio"] = statistics.median(
        m / t
        for m, t in zip(filtered["machine_filtered_us"], filtered["transitions_trigger_us"], strict=True)
    )

    ratio = results["filtered_ratio"]
    checks = {
        "filtered_le_2x_transitions": ratio <= 2.0,
        "json_le_50us": results["machine_json_us"] <= 50.0,
    }
    print(f"{'what':44} {'µs/transition':>14}  {'vs transitions':>14}")
    rows = [
        ("bare method call", "bare_call_us"),
        ("bare transitions.Machine trigger", "transitions_trigger_us"),
        ("Lifecycle, 4 no-op hooks, logging filtered", "machine_filtered_us"),
        ("Lifecycle, 4 no-op hooks, one JSON line", "machine_json_us"),
    ]
    for label, key in rows:
        print(f"{label:44} {results[key]:14.2f}  {results[key] / results['transitions_trigger_us']:13.2f}x")
    print(
        f"target: filtered ≤ 2.00x transitions → {ratio:.2f}x {'OK' if checks['filtered_le_2x_transitions'] else 'MISSED'}"
    )
    print(
        f"target: JSON line ≤ 50 µs → {results['machine_json_us']:.1f} µs {'OK' if checks['json_le_50us'] else 'MISSED'}"
    )
    report = {"results": results, "checks": checks}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""One step of the demo's colocated RL loop, and how the driver recovers within it.

A hook that raises leaves ranks FAILED: the phase shows it, recovers them and retries (`run_phase`).
A generation the lifecycle refuses on invalid weights (`InvalidWeightsError`, after a skipped
sync) is recovered by what the refusal names: a sync, then the generation again.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actor_integration.demo.placement import VOCAB, Placement
from actor_integration.demo.progress import Progress
from actor_integration.ray_group import LifecycleGroup
from lifecycle.errors import GroupCallError, InvalidWeightsError

PROMPTS, PROMPT_LEN = 8, 8


@dataclass
class StepDriver:
    """Runs the loop one step at a time and keeps what the report needs: per-step records, the faults
    seen and recovered, the refusals, and the checksum comparisons per (role, rank)."""

    placed: Placement
    args: argparse.Namespace
    log: Progress
    version: int = 0
    ok: bool = True  # False once a checksum or a checkpoint reload failed
    records: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, Any]] = field(default_factory=list)
    checksums: dict[tuple[str, int], list[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.args.seed)
        self.prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
        self._faults_by_step: dict[int, list[tuple[str, str]]] = {}
        for role, hook, step in self.args.inject_fault:
            self._faults_by_step.setdefault(step, []).append((role, hook))
        self._skip_sync = set(self.args.skip_sync)

    def run(self, step: int) -> dict[str, Any]:
        """Run step `step` (from 1) and return its record."""
        started = time.monotonic()
        trainers, rollouts, log = self.placed.trainer_group, self.placed.rollout_group, self.log
        n = self.placed.trainers
        record: dict[str, Any] = {"step": step}
        trainers.call("lifecycle_step", step)
        rollouts.call("lifecycle_step", step)
        for role, hook in self._faults_by_step.get(step, []):
            (trainers if role == "trainer" else rollouts).call("arm_fault", hook)
            log.note(f"[yellow]step {step}: armed a fault in {hook} on every {role} rank[/]")

        log.phase(step, "rollout generates")
        samples = self._generate(step)
        batch = [p + s for p, s in zip(self.prompts, samples[0], strict=True)]
        log.phase(step, "rollout sleeps (pause generation, flush, release weights + kv_cache)")
        self._phase("rollout sleep", rollouts, rollouts.sleep, "PAUSED", step)
        log.phase(step, "trainer wakes, trains, sleeps")
        # Data parallel: each rank trains on its share of the batch.
        shares = [batch[r::n] or batch for r in range(n)]
        train = functools.partial(trainers.call_each, "train", {r: (step, shares[r]) for r in range(n)})
        results = self._phase("train", trainers, train, "PAUSED", step)
        record["loss"] = sum(r["loss"] for r in results.values()) / len(results) if results else None
        if step % self.args.save_every == 0:
            log.phase(step, "checkpoint from PAUSED (resume, save, re-pause)")
            save = functools.partial(trainers.call, "save_model", step)
            saved = self._phase("save", trainers, save, "PAUSED", step)
            record["checkpoint_reload_ok"] = saved is None or all(s["reload_ok"] for s in saved.values())
            self.ok = self.ok and record["checkpoint_reload_ok"]
        log.phase(step, "trainer sleeps (already asleep: a logged no-op)")
        self._phase("trainer sleep", trainers, trainers.sleep, "PAUSED", step)
        log.phase(step, "rollout wakes its weights")
        wake_weights = functools.partial(rollouts.wake_up, ["weights"])
        self._phase("rollout wake weights", rollouts, wake_weights, "PAUSED", step)
        if step in self._skip_sync:
            log.phase(step, "weight sync skipped (--skip-sync): the rollout's weights stay discarded")
            record["sync_skipped"] = True
            synced = None
        else:
            synced = self._sync(step)
        record["version"] = self.version
        record["bytes"] = sum(s["bytes"] for s in synced.values()) if synced else None
        record["peak_rss_growth_mib"] = (
            {rank: s["peak_rss_growth_mib"] for rank, s in synced.items()} if synced else None
        )
        log.phase(step, "rollout wakes its kv cache")
        wake_kv = functools.partial(rollouts.wake_up, ["kv_cache"])
        self._phase("rollout wake kv_cache", rollouts, wake_kv, "AWAKE", step)
        self._compare_weights(step, record)
        trainers.assert_consistent()
        rollouts.assert_consistent()
        record["wall_s"] = round(time.monotonic() - started, 4)
        self.records.append(record)
        log.done(step)
        return record

    # ------------------------------------------------------------------ phases

    def _sync(self, step: int) -> dict[int, Any] | None:
        def call() -> dict[int, Any]:
            self.version += 1  # a failed version is never reused: the engine's gate refuses repeats
            return self.placed.trainer_group.call("update_weights", self.version)

        self.log.phase(step, f"weight sync through {self.placed.transport}")
        result: dict[int, Any] | None = self._phase("sync", self.placed.trainer_group, call, "PAUSED", step)
        return result

    def _generate(self, step: int) -> dict[int, Any]:
        """Generate at the trainer's version; a refusal on invalid weights is recovered by a sync."""
        rollouts = self.placed.rollout_group
        try:
            return rollouts.call("generate", self.prompts, min_weight_version=self.version)
        except GroupCallError as exc:
            refused = {r: e for r, e in exc.errors.items() if isinstance(e, InvalidWeightsError)}
            if not refused or len(refused) != len(exc.errors):
                raise
            first = next(iter(refused.values()))
            assert isinstance(first, InvalidWeightsError)
            self.log.note(
                f"[bold red]step {step}: generate refused on rollout ranks {sorted(refused)}: "
                f"InvalidWeightsError: {first}[/]"
            )
            self.log.note(
                f"[yellow]step {step}: recovery: {first.fix} version {self.version + 1}, then generate[/]"
            )
            self._sync(step)
            samples = rollouts.call("generate", self.prompts, min_weight_version=self.version)
            self.log.note(f"[green]step {step}: generate at version {self.version}: ok after the sync[/]")
            self.refusals.append(
                {
                    "step": step,
                    "ranks": sorted(refused),
                    "error": type(first).__name__,
                    "tags": dict(first.tags),
                    "weight_version": first.weight_version,
                    "required_version": first.required_version,
                    "recovered_by": f"{first.fix} v{self.version}",
                }
            )
            return samples

    def _phase(
        self, name: str, group: LifecycleGroup, call: Callable[[], Any], recover_to: str, step: int
    ) -> Any:
        result, fault = run_phase(name, group, call, recover_to, step, self.log)
        if fault is not None:
            self.faults.append(fault)
        return result

    def _compare_weights(self, step: int, record: dict[str, Any]) -> None:
        """Every rollout's weights bit-equal to trainer rank 0's; after a skipped sync, show who is stale."""
        trainers, rollouts = self.placed.trainer_group, self.placed.rollout_group
        trainer_sums = trainers.call("weights_checksum")
        reference = trainer_sums[0]
        for rank, value in trainer_sums.items():
            self.checksums.setdefault(("trainer", rank), []).append(value == reference)
        if record.get("sync_skipped"):
            stale = rollouts.stale(self.version)
            record["stale_rollouts"] = stale
            record["checksum_ok"] = None
            self.log.note(
                f"[yellow]step {step}: sync skipped: rollout ranks {sorted(stale)} cannot serve version "
                f"{self.version} (loaded: {stale}; None = not valid)[/]"
            )
            return
        engine_sums = rollouts.call("weights_checksum")
        for rank, value in engine_sums.items():
            self.checksums.setdefault(("rollout", rank), []).append(value == reference)
        record["checksum_ok"] = all(v == reference for v in engine_sums.values())
        if not record["checksum_ok"]:
            self.ok = False
            self.log.note(f"[bold red]step {step}: rollout weights differ from the trainer's[/]")


def run_phase(
    name: str, group: LifecycleGroup, call: Callable[[], Any], recover_to: str, step: int, log: Progress
) -> tuple[Any, dict[str, Any] | None]:
    """Run one phase; if ranks went FAILED, show it, recover them to `recover_to`, and retry once
    (unless the failure came after the body: then the work is done and the result is None).
    Returns the result and, after a recovery, what failed and how it was recovered."""
    try:
        return call(), None
    except GroupCallError:
        states = group.states()
        failed = {r: s for r, s in states.items() if s["state"] == "FAILED"}
        if not failed:
            raise
        first = next(iter(failed.values()))["failure"]
        log.note(
            f"[bold red]step {step}: {name}: {first['hook']} raised on ranks {sorted(failed)} "
            f"({first['error']}) → FAILED[/]"
        )
        recovered = group.recover(recover_to)
        log.note(
            f"[yellow]step {step}: recover(target={recover_to}) on ranks {sorted(recovered)} → "
            f"{sorted({s['state'] for s in recovered.values()})}[/]"
        )
        # A failure after the body (leaving AWAKE/SAVING/SYNCING) needs no retry: the work was done.
        redo = first["phase"] != "exit"
        fault = {
            "step": step,
            "phase": name,
            "hook": first["hook"],
            "ranks": sorted(failed),
            "recovered_to": recover_to,
            "retried": redo,
        }
        return (call() if redo else None), fault

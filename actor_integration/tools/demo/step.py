"""One step of the demo's colocated RL loop, and how the driver recovers within it.

A hook that raises leaves ranks FAILED: the phase shows it, recovers them and retries (`run_phase`).
A generation the lifecycle refuses on invalid weights (`InvalidWeightsError`, after a skipped
sync) is recovered by what the refusal names: a sync, then the generation again.

On a real engine (`--engine sglang` or `vllm`) the rollout's weights cannot be read back as the
trainer's tensors (the engine fuses and shards them), so each step checks what the weights do
instead: generation is refused between the release and the sync; after a re-sync of the same
trainer weights (a new version, equal contents) the greedy tokens are bit-identical to those
before the sleep, and so is the engine's own checksum of its parameters; after training the
tokens change. Both engines run the same steps: what differs is inside their actors (`rollout.py`).
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actor_integration.actors.ray_group import LifecycleGroup
from actor_integration.errors import EngineDiedError, GroupCallError, NodeLostError
from actor_integration.tools.demo.options import ENGINE_NAMES, PROMPT_LEN, PROMPTS
from actor_integration.tools.demo.placement import Placement
from actor_integration.tools.demo.progress import Progress
from lifecycle.errors import IllegalTransitionError, InvalidWeightsError

# The trainer's hooks a memory budget skips when the rollout's need fits (nothing released, no
# clear_memory, the communicators kept), and of those the ones a wake runs.
WAKE_HOOKS = frozenset({"memory.resume", "process_groups.reload"})
BUDGET_SKIPS = frozenset({"clear_memory", "process_groups.destroy", "memory.pause"}) | WAKE_HOOKS


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
    killed: dict[str, Any] | None = None  # what the killed engine answered (--kill-engine)
    node_lost: dict[str, Any] | None = None  # the NodeLostError that ended the run, as data

    def __post_init__(self) -> None:
        rng = random.Random(self.args.seed)
        self.prompts = [[rng.randrange(self.placed.vocab) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
        self._faults_by_step: dict[int, list[tuple[str, str]]] = {}
        for role, hook, step in self.args.inject_fault:
            self._faults_by_step.setdefault(step, []).append((role, hook))
        # A fault in a hook the memory budget skips (it releases nothing when the rollout fits) needs
        # a sleep that releases: those steps' trainer sleeps are full ones; a wake's hook, the step's
        # before too (the wake restores what the last sleep released).
        self._full_sleeps: set[int] = set()
        for role, hook, step in self.args.inject_fault:
            if role == "trainer" and hook in BUDGET_SKIPS:
                self._full_sleeps.update((step - 1, step) if hook in WAKE_HOOKS else (step,))
        self._need: int | None = None
        self._skip_sync = set(self.args.skip_sync)
        self._corrupt = set(getattr(self.args, "corrupt_sync", ()))
        self._real = self.placed.engine in ENGINE_NAMES  # a real engine serving the trainer's Qwen model
        self._last_samples: dict[int, Any] | None = None

    def lost_node(self, step: int, error: NodeLostError) -> None:
        """A node died mid-run: show the error, let the survivors still inside a call end it (at
        their own deadline at most), keep how each ended, and run nothing more."""
        self.ok = False
        self.log.console.print(f"[bold red]step {step}: {type(error).__name__}: {error}[/]", soft_wrap=True)
        started = time.monotonic()
        groups = (self.placed.trainer_group, self.placed.rollout_group)
        # A survivor inside torch.distributed's own rendezvous ends at its deadline (--timeout-s from
        # when it began to wait, before the loss was noticed): a margin past it, then it is killed.
        settled = {g.role: g.settle(timeout_s=self.args.timeout_s + 10, kill=True) for g in groups}
        self.log.note(
            f"[yellow]step {step}: the survivors settled in {time.monotonic() - started:.1f} s: {settled}[/]"
        )
        self.node_lost = {
            "step": step,
            "error": f"{type(error).__name__}: {error}",
            "nodes": error.nodes,
            "lost": error.lost,
            "survivors": {
                role: {str(r): s for r, s in states.items()} for role, states in error.survivors.items()
            },
            "settled": {role: {str(r): s for r, s in states.items()} for role, states in settled.items()},
            "operation": error.operation,
            "noticed_s": error.waited_s,
        }

    def prepare(self) -> None:
        """Before step 1: the trainer learns the rollout's wake need (its memory budget plans from it);
        a real engine starts with dummy weights, so the trainer's are synced first."""
        if not getattr(self.args, "no_memory_budget", False):
            needs = [n for n in self.placed.rollout_group.call("wake_need_bytes").values() if n is not None]
            if needs:
                self._need = max(needs)
                self.placed.trainer_group.call("lifecycle_expect", self._need)
                self.log.note(f"memory budget: the rollout's wake needs {max(needs) / 2**20:.0f} MiB")
        if not self._real:
            return
        rollouts = self.placed.rollout_group
        name = ENGINE_NAMES[self.placed.engine]
        self.log.note(f"initial sync: {name} started with dummy weights; the trainer's go in first")
        rollouts.sleep()
        rollouts.wake_up(["weights"])
        self.version += 1
        self.placed.trainer_group.call("update_weights", self.version)
        rollouts.wake_up(list(self.placed.wake_rest))

    def declare_need(self, step: int) -> None:
        """Before step `step`: the trainer's need for its sleep, changed only where it changes (the
        rollout's need; none, so a full sleep, for a step whose armed fault needs one)."""
        if self._need is None or (step in self._full_sleeps) == (step - 1 in self._full_sleeps):
            return
        full = step in self._full_sleeps
        self.placed.trainer_group.call("lifecycle_expect", None if full else self._need)
        if full:
            self.log.note(
                f"[yellow]step {step}: the trainer sleeps fully (no need declared): a fault is armed[/]"
            )

    def run(self, step: int) -> dict[str, Any]:
        """Run step `step` (from 1) and return its record."""
        started = time.monotonic()
        trainers, rollouts, log = self.placed.trainer_group, self.placed.rollout_group, self.log
        n = self.placed.trainers
        record: dict[str, Any] = {"step": step}
        trainers.call("lifecycle_step", step)
        rollouts.call("lifecycle_step", step)
        self.declare_need(step)
        for role, hook in self._faults_by_step.get(step, []):
            (trainers if role == "trainer" else rollouts).call("arm_fault", hook)
            log.note(f"[yellow]step {step}: armed a fault in {hook} on every {role} rank[/]")

        if step == getattr(self.args, "kill_engine", None):
            self._kill_engine(step)  # the run ends here: nothing may run on a dead engine
            record.update(killed=self.killed, loss=None, wall_s=round(time.monotonic() - started, 4))
            self.records.append(record)
            return record
        log.phase(step, "rollout generates")
        samples = self._generate(step)
        continuations = samples[0]
        if self._real:
            if self._last_samples is not None:
                record["tokens_changed"] = samples != self._last_samples  # the trainer trained since
            self._last_samples = samples
            record["trainer_agreement"] = self._agreement(samples[0])
            self._resync(step, samples, record)
            # Training on its own greedy samples only sharpens them: the greedy tokens could stay as
            # they were and prove nothing about the sync. So the loop trains toward a shifted
            # continuation (each sampled token + 1), which the next generation must move toward.
            continuations = [[(t + 1) % self.placed.vocab for t in s] for s in samples[0]]
        batch = [p + s for p, s in zip(self.prompts, continuations, strict=True)]
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
        if self._real:
            record["refused_before_sync"] = self._refused(step)
        if step in self._skip_sync:
            log.phase(step, "weight sync skipped (--skip-sync): the rollout's weights stay discarded")
            record["sync_skipped"] = True
            synced = None
        else:
            if step in self._corrupt:
                trainers.call("corrupt_next_sync")
                log.note(f"[yellow]step {step}: the sync's first bucket will fail its checksum on arrival[/]")
            synced = self._sync(step)
            if step in self._corrupt:
                record["corrupt_resends"] = sum(s["resends"] for s in synced.values()) if synced else 0
                log.note(
                    f"[yellow]step {step}: the corrupt round was refused (nothing written) and sent again: "
                    f"{record['corrupt_resends']} resend(s)[/]"
                )
        record["version"] = self.version
        record["bytes"] = sum(s["bytes"] for s in synced.values()) if synced else None
        record["peak_rss_growth_mib"] = (
            {rank: s["peak_rss_growth_mib"] for rank, s in synced.items()} if synced else None
        )
        rest = list(self.placed.wake_rest)
        log.phase(step, f"rollout wakes {' + '.join(rest)}")
        wake_kv = functools.partial(rollouts.wake_up, rest)
        self._phase("rollout wake " + "+".join(rest), rollouts, wake_kv, "AWAKE", step)
        self._compare_weights(step, record)
        trainers.assert_consistent()
        rollouts.assert_consistent()
        record["wall_s"] = round(time.monotonic() - started, 4)
        self.records.append(record)
        log.done(step)
        return record

    # ------------------------------------------------------------------ checks on a real engine

    def _refused(self, step: int) -> bool:
        """Whether generation is refused now (after the release, before the sync), on every rank."""
        try:
            self.placed.rollout_group.call("generate", self.prompts[:1])
        except GroupCallError as exc:
            if all(isinstance(e, IllegalTransitionError) for e in exc.errors.values()):
                return True
            raise
        self.ok = False
        self.log.note(f"[bold red]step {step}: the rollout generated between its release and the sync[/]")
        return False

    def _agreement(self, tokens: list[list[int]]) -> dict[str, float]:
        """How many of the engine's greedy tokens the trainer's own model generates too, from the same
        weights (all tokens, and each prompt's first, which comes from the prefill alone)."""
        ours = self.placed.trainer_group.call("greedy", self.prompts, len(tokens[0]))[0]
        same = sum(a == b for x, y in zip(tokens, ours, strict=True) for a, b in zip(x, y, strict=True))
        first = sum(x[0] == y[0] for x, y in zip(tokens, ours, strict=True))
        return {
            "tokens": round(same / sum(map(len, tokens)), 3),
            "first_tokens": round(first / len(tokens), 3),
        }

    def _resync(self, step: int, samples: dict[int, Any], record: dict[str, Any]) -> None:
        """Sleep, re-sync the same trainer weights as a new version, wake: the same tokens and checksum."""
        rollouts, trainers = self.placed.rollout_group, self.placed.trainer_group
        before = rollouts.call("weights_checksum")
        self.log.phase(step, "re-sync check: rollout sleeps, the same weights are synced again, it wakes")
        self._phase("rollout sleep (re-sync)", rollouts, rollouts.sleep, "PAUSED", step)
        self._phase(
            "rollout wake weights (re-sync)",
            rollouts,
            functools.partial(rollouts.wake_up, ["weights"]),
            "PAUSED",
            step,
        )
        record["refused_before_resync"] = self._refused(step)
        self.version += 1
        trainers.call("update_weights", self.version)
        rest = functools.partial(rollouts.wake_up, list(self.placed.wake_rest))
        self._phase("rollout wake (re-sync)", rollouts, rest, "AWAKE", step)
        again = rollouts.call("generate", self.prompts, min_weight_version=self.version)
        after = rollouts.call("weights_checksum")
        record["resync_identical"] = again == samples and after == before
        if not record["resync_identical"]:
            self.ok = False
            self.log.note(
                f"[bold red]step {step}: after re-syncing the same weights the engine generated other tokens "
                f"({again == samples}) or holds other weights ({after == before})[/]"
            )

    def _kill_engine(self, step: int) -> None:
        """Kill every engine's process (SGLang's scheduler, vLLM's EngineCore), then generate: a typed
        error within the deadline, no hang (`killed` records what came back)."""
        killed = self.placed.rollout_group.call("kill_engine", timeout_s=self.args.timeout_s)
        pids = [k["pid"] for _rank, k in sorted(killed.items())]
        self.log.note(
            f"[bold red]step {step}: killed {ENGINE_NAMES[self.placed.engine]}'s "
            f"{killed[min(killed)]['process']} (pids {pids}) (--kill-engine)[/]"
        )
        started = time.monotonic()
        try:
            self.placed.rollout_group.call("generate", self.prompts)
        except GroupCallError as exc:
            waited = time.monotonic() - started
            errors = list(exc.errors.values())
            typed = all(isinstance(e, EngineDiedError) for e in errors)
            self.killed = {
                "step": step,
                "pids": pids,
                "typed": typed,
                "error": f"{type(errors[0]).__name__}: {errors[0]}",
                "noticed_s": round(waited, 3),
            }
            self.ok = self.ok and typed and waited < self.args.timeout_s
            self.log.note(
                f"[yellow]step {step}: generate answered in {waited:.2f} s: {self.killed['error']}[/]"
            )
            return
        self.ok = False
        self.killed = {"step": step, "pids": pids, "typed": False, "error": "the killed engine generated"}

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
        if self._real and not record.get("sync_skipped"):
            # A real engine fuses and shards the tensors: its checksum is its own (compared across re-syncs).
            record["engine_checksum"] = rollouts.call("weights_checksum")
            return
        if record.get("sync_skipped"):
            stale = rollouts.stale(self.version)
            record["stale_rollouts"] = stale
            record["checksum_ok"] = None
            self.log.note(
                f"[yellow]step {step}: sync skipped: rollout ranks {sorted(stale)} cannot serve version "
                f"{self.version} (loaded: {stale}; None = not valid)[/]"
            )
            return
        if self._real:
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

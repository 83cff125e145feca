"""The log checker's corpus: real machine logs on the fakes (every row of the table, faults and
recoveries, held scopes, weight syncs, random walks), and the helpers that edit a copy of one
(tests/lifecycle/test_checker.py)."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle import (
    Contents,
    IllegalTransitionError,
    LifecycleFailedError,
    LifecyclePolicy,
    State,
    configure_logging,
    flush_logs,
)
from lifecycle.checker import Finding, check_files
from lifecycle.machine import Lifecycle
from lifecycle.testing import InjectedFault, Recorders, recording_lifecycle
from tests.helpers.bodies import make_body

TAGS = ("weights", "kv_cache", "cuda_graph")
SLOTS = {0: (0, 1), 1: (2, 3)}  # slot -> the trainer ranks that feed one rollout engine
VERSIONS = (1, 2, 3)


@contextlib.contextmanager
def json_log(path: Path) -> Iterator[Path]:
    """Send lifecycle events to `path` for the block, then close it and go back to quiet (as conftest)."""
    configure_logging(json_path=path)
    try:
        yield path
    finally:
        flush_logs()
        configure_logging(stream=io.StringIO(), level="warning")


def body(rec: Recorders, lc: Lifecycle, operation: str) -> Callable[[], Any]:
    return make_body(rec, lc, operation)


def expect(error: type[BaseException], call: Callable[[], Any]) -> None:
    with pytest.raises(error):
        call()


# ----------------------------------------------------------------------------------------------
# The clean corpus: real machines on the fakes, every row of the table, faults and recoveries.


def trainer_offload(path: Path) -> None:
    """slime's colocated trainer: starts asleep, sleeps after every train step."""
    with json_log(path):
        policy = LifecyclePolicy(offload_train=True, use_routing_replay=True)
        lc, rec = recording_lifecycle(policy, initial=State.PAUSED, rank=0, role="trainer")
        lc.run("train", body(rec, lc, "train"))  # PAUSED: wake, train, sleep
        lc.run("sync", body(rec, lc, "sync"))  # PAUSED: groups up, sync, groups down
        lc.run("save", body(rec, lc, "save"))  # PAUSED: wake, save, sleep
        lc.sleep()  # no-op
        lc.wake_up()
        lc.wake_up()  # no-op
        lc.run("save", body(rec, lc, "save"))
        lc.run("sync", body(rec, lc, "sync"))
        lc.run("generate", body(rec, lc, "generate"))
        lc.event("demo.step", step=3)  # another layer's event: ignored by the checker
        lc.run("train", body(rec, lc, "train"))  # AWAKE: train, sleep


def trainer_resident(path: Path) -> None:
    """A trainer without offload_train, with bodies that call sleep/wake_up (absorbed)."""
    with json_log(path):
        policy = LifecyclePolicy(offload_train=False, model_tag=None, destroy_process_groups=False)
        lc, rec = recording_lifecycle(policy, rank=1, role="trainer")

        def nested(operation: str) -> Callable[[], None]:
            def run() -> None:
                lc.sleep()
                lc.wake_up()
                expect(IllegalTransitionError, lambda: lc.run("save", body(rec, lc, "save")))
                rec.check_body(lc, operation)

            return run

        lc.run("train", body(rec, lc, "train"))
        lc.run("train", nested("train"))  # an in-place body: the no-ops come before its body event
        lc.sleep()
        lc.run("save", nested("save"))  # PAUSED: the no-ops come inside SAVING
        lc.run("train", body(rec, lc, "train"))  # PAUSED, auto-wake, stays AWAKE
        expect(IllegalTransitionError, lambda: lc.recover(State.AWAKE))  # refused: nothing to recover


def rollout_tags(path: Path) -> None:
    """A rollout engine with per-tag residency: partial wakes, partial sleeps, tag-wise no-ops."""
    with json_log(path):
        policy = LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",), model_tag=None)
        lc, rec = recording_lifecycle(policy, generation=True, rank=0, role="rollout")
        lc.run("generate", body(rec, lc, "generate"))
        lc.sleep()
        expect(IllegalTransitionError, lambda: lc.run("sync", body(rec, lc, "sync")))  # weights released
        lc.wake_up(tags=["weights"])  # partial
        lc.run("sync", body(rec, lc, "sync"))  # PAUSED, weights resident
        lc.sleep()  # PAUSED with weights resident: pauses weights only
        lc.sleep(tags=["kv_cache"])  # no-op
        lc.wake_up(tags=["weights"])
        lc.wake_up(tags=["kv_cache", "cuda_graph"])  # completes the wake
        lc.sleep(tags=["kv_cache"])  # AWAKE -> PAUSED releasing one tag
        lc.sleep(tags=["kv_cache"])  # no-op although weights are resident
        lc.wake_up()


def failures(path: Path) -> None:
    """Faults before and after a hook's effect, in every phase, and the recoveries."""
    with json_log(path):
        policy = LifecyclePolicy(offload_train=True, use_routing_replay=True)
        lc, rec = recording_lifecycle(policy, rank=2, role="trainer")
        rec.faults.arm("process_groups.destroy")
        expect(InjectedFault, lc.sleep)
        expect(LifecycleFailedError, lc.sleep)  # refused on FAILED
        lc.recover(State.PAUSED)  # re-runs destroy and pause only
        rec.faults.arm("memory.resume", after_effect=True)
        expect(InjectedFault, lc.wake_up)
        lc.recover(State.AWAKE)  # asks the backend (resolved), then reloads groups, switches model

        def broken() -> None:
            raise ValueError("loss is nan")

        expect(ValueError, lambda: lc.run("train", broken))  # body fails, exit still sleeps
        rec.faults.arm("switch_model")
        expect(InjectedFault, lambda: lc.run("save", body(rec, lc, "save")))  # enter edge fails
        lc.recover(State.AWAKE)
        rec.faults.arm("memory.pause")
        expect(InjectedFault, lambda: lc.run("train", body(rec, lc, "train")))  # exit edge fails
        rec.faults.arm("process_groups.reload", after_effect=True)
        expect(InjectedFault, lambda: lc.recover(State.AWAKE))  # recover itself fails
        lc.recover(State.PAUSED)
        rec.faults.arm("process_groups.destroy")
        expect(InjectedFault, lambda: lc.run("sync", body(rec, lc, "sync")))  # fails leaving SYNCING
        lc.recover(State.PAUSED)


def rollout_failures(path: Path) -> None:
    with json_log(path):
        policy = LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",), model_tag=None)
        lc, rec = recording_lifecycle(policy, generation=True, rank=1, role="rollout")
        rec.faults.arm("memory.pause", at=2, after_effect=True)  # kv_cache: the second tag paused
        expect(InjectedFault, lc.sleep)
        lc.recover(State.PAUSED)
        rec.faults.arm("generation.resume")
        expect(InjectedFault, lc.wake_up)
        lc.recover(State.AWAKE)


def held_scopes(path: Path) -> None:
    """Held scopes on a trainer: reef #202's step, nested holds, a failure inside one and in its final sleep."""
    with json_log(path):
        policy = LifecyclePolicy(offload_train=True, use_routing_replay=True)
        lc, rec = recording_lifecycle(policy, initial=State.PAUSED, rank=3, role="trainer")
        with lc.held():  # from PAUSED
            lc.run("train", body(rec, lc, "train"))  # auto-wake, train, its sleep deferred
            lc.run("save", body(rec, lc, "save"))
            lc.run("sync", body(rec, lc, "sync"))
        # the release slept: PAUSED
        with lc.held():
            lc.run("save", body(rec, lc, "save"))  # from PAUSED: wake, save, its pause deferred
            with lc.held():
                lc.sleep()  # deferred
                lc.run("train", body(rec, lc, "train"))  # from AWAKE, its sleep deferred
            lc.wake_up()  # cancels the deferred sleep
        lc.sleep()
        with lc.held():
            pass  # PAUSED: nothing to defer
        lc.hold()
        rec.faults.arm("memory.resume")
        expect(InjectedFault, lc.wake_up)  # a failure inside the scope
        lc.release()  # on FAILED: gives the hold back
        lc.recover(State.AWAKE)
        rec.faults.arm("memory.pause")
        with pytest.raises(InjectedFault), lc.held():
            lc.run("train", body(rec, lc, "train"))  # the final sleep fails
        lc.recover(State.PAUSED)
        expect(IllegalTransitionError, lc.release)  # no hold taken


def held_rollout(path: Path) -> None:
    """Held scopes over per-tag sleeps and partial wakes."""
    with json_log(path):
        policy = LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",), model_tag=None)
        lc, rec = recording_lifecycle(policy, generation=True, initial=State.PAUSED, rank=4, role="rollout")
        lc.wake_up(tags=["weights"])
        with lc.held():
            lc.sleep()  # PAUSED with weights resident: deferred
            lc.run("sync", body(rec, lc, "sync"))
        lc.wake_up()
        with lc.held():
            lc.sleep(tags=["kv_cache"])
            lc.wake_up(tags=["weights"])  # no-op; kv_cache stays deferred
            lc.run("generate", body(rec, lc, "generate"))
        lc.wake_up()


def weight_sync(directory: Path) -> list[Path]:
    """Four trainer ranks in two slots and two rollout engines, three versions."""
    out = []
    for slot, ranks in SLOTS.items():
        for rank in ranks:
            path = directory / f"trainer{rank}.jsonl"
            out.append(path)
            with json_log(path):
                policy = LifecyclePolicy(offload_train=True)
                lc, rec = recording_lifecycle(policy, initial=State.PAUSED, rank=rank, role="trainer")
                lc.event("weight_sync.transport", requested="auto", chosen="cuda_ipc", reason="colocated")
                for version in VERSIONS:
                    lc.run("train", body(rec, lc, "train"))

                    def update(
                        lc: Lifecycle = lc,
                        rec: Recorders = rec,
                        version: int = version,
                        slot: int = slot,
                        ranks: tuple[int, ...] = ranks,
                    ) -> None:
                        rec.check_body(lc, "sync")
                        lc.event(
                            "weight_sync.update",
                            slot=slot,
                            version=version,
                            transport="cuda_ipc",
                            coordinator=lc.context["rank"] == min(ranks),
                            ranks=list(ranks),
                            bytes=1 << 20,
                            buckets=2,
                            duration_ms=0.5,
                            gbps=2.1,
                            ok=True,
                        )

                    lc.run("sync", update)
        path = directory / f"engine{slot}.jsonl"
        out.append(path)
        with json_log(path):
            policy = LifecyclePolicy(
                memory_tags=TAGS, sync_requires=("weights",), discard_on_release=TAGS, model_tag=None
            )
            lc, rec = recording_lifecycle(policy, generation=True, rank=slot, role="rollout")
            for version in VERSIONS:
                lc.sleep()
                lc.wake_up(tags=["weights"])

                def load(lc: Lifecycle = lc, rec: Recorders = rec, version: int = version) -> None:
                    rec.check_body(lc, "sync")
                    lc.note_weights(Contents.UNKNOWN, version, reason="writing")
                    lc.note_weights(Contents.VALID, version, reason="loaded")
                    lc.event(
                        "weight_sync.loaded",
                        version=version,
                        bytes=2 << 20,
                        checksum_ok=True,
                        duration_ms=0.7,
                        transport="cuda_ipc",
                    )

                lc.run("sync", load)
                lc.wake_up()
                lc.run("generate", body(rec, lc, "generate"))
    return out


def random_walk(path: Path, seed: int) -> None:
    """Random operations, tags and faults on a random policy; errors are part of the walk."""
    rng = random.Random(seed)
    tagged = rng.random() < 0.5
    offload = rng.random() < 0.5
    policy = LifecyclePolicy(
        offload_train=offload,
        auto_wake=offload or rng.random() < 0.7,
        use_routing_replay=rng.random() < 0.5,
        memory_tags=TAGS if tagged else None,
        destroy_process_groups=rng.random() < 0.8,
        model_tag=rng.choice(("actor", None)),
        sync_requires=("weights",) if tagged and rng.random() < 0.7 else (),
    )
    hooks = [
        "memory.pause",
        "memory.resume",
        "process_groups.destroy",
        "process_groups.reload",
        "clear_memory",
    ]
    with json_log(path):
        lc, rec = recording_lifecycle(
            policy,
            initial=rng.choice((State.AWAKE, State.PAUSED)),
            generation=tagged,
            rank=seed,
            role="walker",
            overlap=seed % 2 == 1,  # half the walks run the teardown with the pause together
        )
        for _ in range(60):
            if rng.random() < 0.08:
                rec.faults.disarm()
                rec.faults.arm(rng.choice(hooks), at=rng.randint(1, 2), after_effect=rng.random() < 0.5)
            choice = rng.random()
            tags = list(rng.sample(TAGS, rng.randint(1, 3))) if tagged and rng.random() < 0.6 else None
            scope = rng.random()
            try:
                if scope < 0.06:
                    lc.hold()
                elif scope < 0.12:
                    lc.release()  # refused when no hold is taken
                elif lc.state is State.FAILED and choice < 0.7:
                    lc.recover(rng.choice((State.AWAKE, State.PAUSED)))
                elif choice < 0.25:
                    lc.sleep(tags)
                elif choice < 0.5:
                    lc.wake_up(tags)
                else:
                    operation = rng.choice(("train", "save", "sync", "generate"))
                    lc.run(operation, body(rec, lc, operation))
            except (IllegalTransitionError, LifecycleFailedError, InjectedFault):
                pass


def build_corpus(directory: Path) -> dict[str, Path]:
    """Every scenario's log under `directory`, by name (the weight syncs as "sync/<stem>", the walks "walk<seed>")."""
    files = {}
    for scenario in (
        trainer_offload,
        trainer_resident,
        rollout_tags,
        failures,
        rollout_failures,
        held_scopes,
        held_rollout,
    ):
        files[scenario.__name__] = directory / f"{scenario.__name__}.jsonl"
        scenario(files[scenario.__name__])
    for path in weight_sync(directory / "sync"):
        files[f"sync/{path.stem}"] = path
    for seed in range(24):
        files[f"walk{seed}"] = directory / "walks" / f"walk{seed}.jsonl"
        random_walk(files[f"walk{seed}"], seed)
    return files


# ----------------------------------------------------------------------------------------------
# Editing a log


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dump(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def find(lines: list[dict[str, Any]], event: str, nth: int = 0, **fields: Any) -> int:
    """Index of the nth event with these fields (a callable field value is a predicate)."""
    hits = [
        i
        for i, line in enumerate(lines)
        if line["event"] == event
        and all(v(line.get(k)) if callable(v) else line.get(k) == v for k, v in fields.items())
    ]
    assert len(hits) > nth, f"the corpus has no {event} with {fields}"
    return hits[nth]


def edited(corpus: dict[str, Path], name: str, tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    """A copy of one corpus file to edit, with its lines; the copy is clean before the edit."""
    path = tmp_path / Path(name).name
    path = Path(shutil.copy(corpus[name], tmp_path / f"{path.stem}.jsonl"))
    assert check_files([path]) == []
    return path, load(path)


def assert_finding(findings: list[Finding], path: Path, line: int, *phrases: str) -> Finding:
    for finding in findings:
        if finding.path == str(path) and finding.line == line and all(p in finding.message for p in phrases):
            return finding
    raise AssertionError(
        f"no finding at {path.name}:{line} with {phrases}; findings:\n" + "\n".join(map(str, findings))
    )


def hook_names(line: dict[str, Any]) -> list[str]:
    return [h["name"] for h in line["hooks"]]


def engine_died_log(path: Path, *, restart: bool) -> Path:
    """A rollout machine's log whose engine server died (`rollout.server_died`, as the server actors
    log it), and, with `restart`, whose machine was configured again after it."""
    from lifecycle.logs import Event

    policy = LifecyclePolicy(memory_tags=("weights", "kv_cache"), sync_requires=("weights",))
    with json_log(path):
        lc, _ = recording_lifecycle(policy, rank=3, role="rollout")
        lc.sleep()
        lc.event(
            Event.SERVER_DIED,
            "error",
            call="generate",
            killed=[],
            process="sglang::scheduler_TP0",
            pid=4242,
            exitcode=-9,
            rank=3,
            url="http://10.0.0.7:30000",
            label="SGLang",
        )
        if restart:
            recording_lifecycle(policy, rank=3, role="rollout")  # the restarted engine's machine
    return path

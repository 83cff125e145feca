"""The model check on vime's own trainer: every method sequence after init, plain vime and under the wrap.

Every sequence of sleep, wake_up, train, save_model and update_weights after init (which ends
asleep, as vime's init does with --offload-train), up to `DEPTH` calls, runs on a fresh actor of
vime's real class (its source files, tests/helpers/vime_source.py) over the strict fake
torch_memory_saver, one rank, breadth first (tests/helpers/method_sequences.py): a sequence that
hits a violation (torch_memory_saver's exits, a body on paused memory, a collective on destroyed
groups, a crash of vime's code) is counted and not extended. Plain vime breaks; under
`VimeLifecycleMixin` no sequence does (a call the lifecycle refuses with a typed error is not a
violation: the actor is as it was). `pytest -s` prints the counts and the shortest reproductions.
Needs vime's source folder (RL_LIFECYCLE_VIME_SOURCE); skips without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.framework_source import suite_source
from tests.helpers.spawn import no_crash, run_world
from tests.helpers.vime_source import VimeSource

SOURCE: VimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(VimeSource, "vime's")

DEPTH = 2
METHOD_NAMES = ("sleep", "wake_up", "train", "save_model", "update_weights")


def _search(rank: int, world_size: int, store: Any, location: str, depth: int = DEPTH) -> dict[str, Any]:
    from actor_integration.frameworks.slime import slime_memory_backend
    from actor_integration.frameworks.vime import VimeLifecycleMixin
    from lifecycle.errors import LifecycleError, ProtocolViolation
    from tests.helpers.framework_source import free_port, launcher_env
    from tests.helpers.method_sequences import explore, render
    from tests.helpers.vime_source import (
        RolloutManager,
        fresh_process_state,
        install,
        rollout,
        vime_args,
    )

    actor_module = install(VimeSource(Path(location), "manifest"))
    os.environ.update(launcher_env())

    class LifecycleTrainer(VimeLifecycleMixin, actor_module.MegatronTrainRayActor):
        def lifecycle_memory(self) -> Any:
            return slime_memory_backend(cuda_major=13)

    def fresh(cls: type) -> Any:
        for attempt in range(5):
            fresh_process_state()
            actor = cls(1, 0, "127.0.0.1", free_port())
            try:
                actor.init(vime_args(1), "actor")
            except RuntimeError as exc:  # the rendezvous port was taken meanwhile: another one
                if "EADDRINUSE" not in str(exc) or attempt == 4:
                    raise
                continue
            actor.set_rollout_manager(RolloutManager())
            return actor
        raise AssertionError("unreachable")

    def guarded(call: Any) -> Any:
        def run(actor: Any) -> None:
            try:
                call(actor)
            except LifecycleError:
                raise
            except Exception as exc:  # vime's own code crashed: a break as much as TMS's exits
                raise ProtocolViolation(f"{type(exc).__name__}: {exc}") from exc

        return run

    methods = {
        "sleep": guarded(lambda a: a.sleep()),
        "wake_up": guarded(lambda a: a.wake_up()),
        "train": guarded(lambda a: a.train(1, rollout(1))),
        "save_model": guarded(lambda a: a.save_model(1)),
        "update_weights": guarded(lambda a: a.update_weights()),
    }
    out: dict[str, Any] = {}
    for name, cls in (("vime", actor_module.MegatronTrainRayActor), ("lifecycle", LifecycleTrainer)):
        search = explore(lambda cls=cls: fresh(cls), methods, depth)
        out[name] = {
            "sequences": search.sequences,
            "violations": search.violations,
            "refusals": search.refusals,
            "report": render(f"{name} (vime's MegatronTrainRayActor)", search),
            "shortest": sorted(
                [finding.kind, list(finding.sequence)] for finding in search.shortest.values()
            ),
        }
    return out


@pytest.fixture(scope="module")
def searches() -> dict[str, Any]:
    assert SOURCE is not None
    (result,) = run_world(_search, 1, str(SOURCE.location), deadline_s=540.0)
    no_crash([result])
    return result


def test_report(searches: dict[str, Any]) -> None:
    print(f"\nvime's trainer, every method sequence after init up to length {DEPTH}:")
    for name in ("vime", "lifecycle"):
        print(searches[name]["report"])
    total = sum(len(METHOD_NAMES) ** n for n in range(1, DEPTH + 1))
    assert searches["lifecycle"]["sequences"] == total  # nothing breaks, so every sequence is extended


def test_plain_vime_breaks(searches: dict[str, Any]) -> None:
    """7 of the 30 sequences up to length 2 break plain vime, in four shortest ways."""
    plain = searches["vime"]
    paused, resident = (
        "pauses a paused tag (torch_memory_saver exits)",
        "resumes a resident tag (torch_memory_saver exits)",
    )
    assert plain["shortest"] == sorted(
        [
            [paused, ["sleep"]],
            [resident, ["wake_up", "save_model"]],
            [resident, ["wake_up", "train"]],
            [resident, ["wake_up", "wake_up"]],
        ]
    )
    assert (plain["sequences"], plain["violations"]) == (25, 7)  # "sleep" first is not extended


def test_no_sequence_breaks_under_the_wrap(searches: dict[str, Any]) -> None:
    wrapped = searches["lifecycle"]
    assert wrapped["violations"] == 0, wrapped["report"]


@pytest.mark.slow
def test_no_sequence_of_length_three_breaks_under_the_wrap() -> None:
    """Length 3 (about 7 minutes on one CPU rank): 29 of 95 break plain vime, none of 155 under the wrap."""
    assert SOURCE is not None
    (result,) = run_world(_search, 1, str(SOURCE.location), 3, deadline_s=1500.0)
    no_crash([result])
    print(f"\n{result['vime']['report']}\n{result['lifecycle']['report']}")
    assert (result["vime"]["sequences"], result["vime"]["violations"]) == (95, 29)
    assert result["lifecycle"]["violations"] == 0 and result["lifecycle"]["sequences"] == 155

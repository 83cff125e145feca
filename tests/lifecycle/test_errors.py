"""One error root, one pickling scheme, one name for who did not answer."""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

from lifecycle import errors
from lifecycle.errors import LifecycleError
from lifecycle.table import Groups, Residency, State

ROOT = Path(__file__).resolve().parents[2]
BUILT_IN = (RuntimeError, ValueError, TimeoutError, KeyError, AssertionError)

EXAMPLES: list[LifecycleError] = [
    errors.IllegalTransitionError("no", state=State.PAUSED, operation="generate", allowed=("wake_up",)),
    errors.LifecycleFailedError(
        "failed",
        hook="memory.pause",
        operation="sleep",
        residency={"model": Residency.UNKNOWN},
        groups=Groups.DESTROYED,
        error="boom",
    ),
    errors.RendezvousTimeoutError("late", what="destroy", missing=[1, 3], waited_s=2.5),
    errors.ProcessGroupsAsleepError("asleep", state="suspended", operation="group", group="tp"),
    errors.NcclError("ncclCommSuspend returned 5", call="ncclCommSuspend", code=5),
    errors.RendezvousMismatchError("apart", what="destroy", other_rank=2, other_what="reload"),
    errors.GroupTimeoutError("late", operation="sleep", missing=[1], waited_s=1.0),
    errors.DeadActorsError("dead", dead={1: None}),
    errors.InconsistentGroupError("differ", groups={"AWAKE": [0], "PAUSED": [1]}),
    errors.NodeLostError(
        "lost",
        nodes={"8f1459e0": "192.0.2.2"},
        lost={"trainer": [2, 3], "rollout": [1]},
        survivors={"trainer": {0: "FAILED", 1: "FAILED"}},
        operation="train",
        waited_s=2.5,
        dead={2: None, 3: None},
    ),
    errors.PeersLostError("lost", what="destroy(generation 3)", lost=[2, 3], reason="node lost"),
    errors.PlacementError("apart", slot=1, engine=1, ranks=[2, 3], nodes={"a": [2], "b": [3]}),
    errors.CrossNodeTransportError("no", requested="cuda_ipc", sender_node="a", receiver_node="b"),
    errors.WeightSyncTimeout("late", slot=0, version=3, missing=["engine"]),
    errors.CorruptBucketError("bad", version=3, rank=1, bucket=0),
    errors.UnknownModelTagError("no backup under 'actor'"),
    errors.MemorySaverConfigError("bad env"),
    errors.InvalidWeightsError(
        "discarded",
        state=State.AWAKE,
        operation="generate",
        allowed=("sync",),
        tags={"weights": "discarded"},
        weight_version=2,
        required_version=None,
        fix="sync",
    ),
    errors.EngineNotIdleError("busy", mode="abort", queued={"running": 1}, waited_s=1.5, attempts=4),
    errors.SGLangServerError("500", method="POST", path="/flush_cache", status=500, answer="busy"),
    errors.SGLangServerTimeout(
        "late", method="POST", path="/flush_cache", timeout_s=5.0, missing=["http://127.0.0.1:30000"]
    ),
]


def _library_classes() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    ]


class TestRoot:
    def test_every_library_error_derives_from_the_root_and_a_built_in(self) -> None:
        """Callers catch either LifecycleError or the built-in base they already catch."""
        for cls in _library_classes():
            assert issubclass(cls, LifecycleError), cls
            if cls is not LifecycleError:
                assert issubclass(cls, BUILT_IN), f"{cls.__name__} lost its built-in base"

    def test_no_other_module_defines_an_error_class(self) -> None:
        """Every public exception class lives in lifecycle/errors.py (private control flow excepted)."""
        offenders = []
        for path in [*ROOT.glob("lifecycle/**/*.py"), *ROOT.glob("actor_integration/**/*.py")]:
            if path.name == "errors.py" and path.parent.name == "lifecycle":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                    continue
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Violation", "Fault")) for b in bases):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
        assert not offenders, offenders

    @pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
    def test_pickling_keeps_type_message_and_fields(self, error: LifecycleError) -> None:
        """Ray ships exceptions between processes by pickling; nothing is lost."""
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error)
        assert str(again) == str(error)
        assert again.fields == error.fields
        for name, value in error.fields.items():
            assert getattr(again, name) == value

    def test_who_did_not_answer_is_always_missing(self) -> None:
        """One field name for the ranks (or parties) that did not answer."""
        for error in EXAMPLES:
            if isinstance(error, TimeoutError | errors.WeightSyncTimeout):
                assert "missing" in error.fields, type(error).__name__
                assert "ranks" not in error.fields

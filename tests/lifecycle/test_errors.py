"""One error root, one pickling scheme, one name for who did not answer: the core's errors
(`lifecycle.errors`) and the adapters' (`actor_integration.errors`), and 0.1's names of the latter."""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

import lifecycle
from actor_integration import errors as adapter_errors
from lifecycle import errors
from lifecycle.errors import LifecycleError
from lifecycle.table import Groups, Residency, State

ROOT = Path(__file__).resolve().parents[2]
BUILT_IN = (RuntimeError, ValueError, TimeoutError, KeyError, AssertionError, TypeError)

EXAMPLES: list[LifecycleError] = [
    errors.MemoryBudgetShortError(
        "short", short_bytes=1, need_bytes=3, free_bytes=2, resident=("weights",), groups=Groups.ALIVE
    ),
    errors.IllegalTransitionError("no", state=State.PAUSED, operation="generate", allowed=("wake_up",)),
    errors.LifecycleFailedError(
        "failed",
        hook="memory.pause",
        operation="sleep",
        residency={"model": Residency.UNKNOWN},
        groups=Groups.DESTROYED,
        error="boom",
    ),
    adapter_errors.RendezvousTimeoutError("late", what="destroy", missing=[1, 3], waited_s=2.5),
    adapter_errors.ProcessGroupsAsleepError("asleep", state="suspended", operation="group", group="tp"),
    adapter_errors.NcclError("ncclCommSuspend returned 5", call="ncclCommSuspend", code=5),
    adapter_errors.RendezvousMismatchError("apart", what="destroy", other_rank=2, other_what="reload"),
    adapter_errors.GroupTimeoutError("late", operation="sleep", missing=[1], waited_s=1.0),
    adapter_errors.DeadActorsError("dead", dead={1: None}),
    adapter_errors.InconsistentGroupError("differ", groups={"AWAKE": [0], "PAUSED": [1]}),
    adapter_errors.NodeLostError(
        "lost",
        nodes={"8f1459e0": "192.0.2.2"},
        lost={"trainer": [2, 3], "rollout": [1]},
        survivors={"trainer": {0: "FAILED", 1: "FAILED"}},
        operation="train",
        waited_s=2.5,
        dead={2: None, 3: None},
    ),
    adapter_errors.PeersLostError("lost", what="destroy(generation 3)", lost=[2, 3], reason="node lost"),
    adapter_errors.PlacementError("apart", slot=1, engine=1, ranks=[2, 3], nodes={"a": [2], "b": [3]}),
    adapter_errors.CrossNodeTransportError("no", requested="cuda_ipc", sender_node="a", receiver_node="b"),
    adapter_errors.WeightSyncTimeout("late", slot=0, version=3, missing=["engine"]),
    adapter_errors.CorruptBucketError("bad", version=3, rank=1, bucket=0),
    adapter_errors.UnknownModelTagError("no backup under 'actor'"),
    adapter_errors.MemorySaverConfigError("bad env"),
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
    adapter_errors.EngineNotIdleError("busy", mode="abort", queued={"running": 1}, waited_s=1.5, attempts=4),
    adapter_errors.SGLangServerError("500", method="POST", path="/flush_cache", status=500, answer="busy"),
    adapter_errors.SGLangServerTimeout(
        "late", method="POST", path="/flush_cache", timeout_s=5.0, missing=["http://127.0.0.1:30000"]
    ),
    adapter_errors.RouterError(
        "refused",
        router="http://127.0.0.1:3000",
        worker="http://127.0.0.1:15000",
        operation="remove",
        path="/workers",
        status=500,
        answer="boom",
    ),
    adapter_errors.StaleWeightsError("stale", url="http://127.0.0.1:15000", reported="default", expected="3"),
    adapter_errors.FollowerCallError("follower", node_rank=1, call="release_memory_occupation", leader=None),
]


def _library_classes() -> list[type[BaseException]]:
    return [
        cls
        for module in (errors, adapter_errors)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    ]


class TestRoot:
    def test_every_library_error_derives_from_the_root_and_a_built_in(self) -> None:
        """Callers catch either LifecycleError or the built-in base they already catch."""
        for cls in _library_classes():
            assert issubclass(cls, LifecycleError), cls
            if cls is not LifecycleError:
                assert issubclass(cls, BUILT_IN), f"{cls.__name__} lost its built-in base"

    def test_no_other_module_defines_an_error_class(self) -> None:
        """Every public exception class lives in lifecycle/errors.py or actor_integration/errors.py
        (private control flow excepted)."""
        offenders = []
        for path in [*ROOT.glob("lifecycle/**/*.py"), *ROOT.glob("actor_integration/**/*.py")]:
            if path.name == "errors.py" and path.parent.name in ("lifecycle", "actor_integration"):
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
            if isinstance(error, TimeoutError | adapter_errors.WeightSyncTimeout):
                assert "missing" in error.fields, type(error).__name__
                assert "ranks" not in error.fields


class TestMovedNames:
    """0.1 defined every error in `lifecycle.errors`; the adapters' still answer there for one release."""

    @pytest.mark.parametrize("name", sorted(errors.MOVED_TO_ADAPTERS))
    def test_an_old_name_is_the_moved_class_with_a_deprecation_warning(self, name: str) -> None:
        for module in (errors, lifecycle):
            with pytest.warns(DeprecationWarning, match=f"moved to actor_integration.errors.{name}"):
                old = getattr(module, name)
            assert old is getattr(adapter_errors, name)

    def test_the_moved_names_are_adapters_errors(self) -> None:
        assert set(adapter_errors.__all__) >= errors.MOVED_TO_ADAPTERS  # and the adapters' own since
        assert not errors.MOVED_TO_ADAPTERS & set(lifecycle.__all__)

    def test_from_import_of_an_old_name_works(self) -> None:
        with pytest.warns(DeprecationWarning):
            from lifecycle.errors import CorruptBucketError
        assert CorruptBucketError is adapter_errors.CorruptBucketError

    def test_an_unknown_name_is_still_an_attribute_error(self) -> None:
        with pytest.raises(AttributeError, match="no attribute 'NoSuchError'"):
            errors.NoSuchError  # noqa: B018
        with pytest.raises(AttributeError):
            lifecycle.NoSuchError  # noqa: B018

    def test_without_the_distribution_s_entry_point_the_old_name_says_where_to_look(
        self, monkeypatch
    ) -> None:
        """A checkout that was never installed declares no entry point: the error names the new module."""
        monkeypatch.setattr(errors.metadata, "entry_points", lambda **_: [])
        with pytest.raises(AttributeError, match=r"import it from actor_integration\.errors"):
            errors.CorruptBucketError  # noqa: B018

"""vime's adapter without vime's source: the #57 slot guard, vime's WORLD names, the launch switch's halves,
the rollout class.

vime #57's failure is an 8-GPU vLLM engine fed by eight trainer ranks of Megatron TP=4: the start
was gated on `tp_rank == 0` (ranks 0 and 4 both pass), and IPC handles were gathered over the TP
group (4 of the engine's 8 GPUs). Here each rank's sender runs that rule against one engine, with
and without `SlotStartGuard` between them.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from actor_integration.engines.vllm.server_actor import VLLMServerActorLifecycle
from actor_integration.errors import LaunchConfigError
from actor_integration.frameworks.vime import (
    ACCELERATOR_NAMES,
    NCCL_NAMES,
    CudaStackReset,
    vime_world_names,
)
from actor_integration.frameworks.vime.coordinator import (
    DuplicateWeightUpdateStartError,
    IncompleteSlotHandlesError,
    SlotStartGuard,
    WeightUpdateNotStartedError,
    guard_weight_updater,
)
from actor_integration.frameworks.vime.launch import VIME, install_vime
from actor_integration.frameworks.vime.rollout import VimeRolloutMixin, lifecycle_engine, vllm_wake_tags
from actor_integration.weight_sync.topology import SlotTopology
from lifecycle.logs import Event

WORLD, TP, ENGINE_GPUS = 8, 4, 8


@dataclass
class Engine:
    """One vLLM engine's weight-update entry points, refusing what vLLM's worker extension refuses."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    open_updates: int = 0
    errors: list[str] = field(default_factory=list)

    def start_weight_update(self, rank: int) -> None:
        self.calls.append(("start_weight_update", rank))
        self.open_updates += 1

    def update_weights_from_tensor(self, rank: int, ipc_handles: list[dict[str, Any]]) -> None:
        self.calls.append(("update_weights_from_tensor", rank))
        for gpu in range(ENGINE_GPUS):
            if any(f"gpu{gpu}" not in per_weight for per_weight in ipc_handles):
                self.errors.append(f"IPC handle not found for GPU gpu{gpu}")  # vime's receiver raises this

    def finish_weight_update(self, rank: int) -> None:
        self.calls.append(("finish_weight_update", rank))
        self.open_updates -= 1


class RankEngine:
    """The engine as one rank reaches it (each call says which rank made it)."""

    def __init__(self, engine: Engine, rank: int) -> None:
        self.engine, self.rank = engine, rank

    def start_weight_update(self, **kwargs: Any) -> None:
        self.engine.start_weight_update(self.rank)

    def update_weights_from_tensor(self, **kwargs: Any) -> None:
        self.engine.update_weights_from_tensor(self.rank, kwargs["ipc_handles"])

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update(self.rank)


def _sync(engines: list[Any], *, starts_on_tp_rank_zero: bool, gather_over_tp: bool) -> list[str | None]:
    """One sync of every rank's sender, phase by phase (start, chunk, finish), as vime's barriers order them."""
    coordinator = [(r % TP == 0) if starts_on_tp_rank_zero else r == 0 for r in range(WORLD)]
    outcome: list[str | None] = [None] * WORLD

    def each(phase: Any) -> None:
        for rank in range(WORLD):
            if outcome[rank] is None and coordinator[rank]:
                try:
                    phase(rank)
                except Exception as exc:
                    outcome[rank] = type(exc).__name__

    each(lambda r: engines[r].start_weight_update(is_checkpoint_format=True))

    def chunk(rank: int) -> None:
        ranks = range(rank - rank % TP, rank - rank % TP + TP) if gather_over_tp else range(WORLD)
        engines[rank].update_weights_from_tensor(names=["w"], ipc_handles=[{f"gpu{g}": "h" for g in ranks}])

    each(chunk)
    each(lambda r: engines[r].finish_weight_update())
    return outcome


def _guarded(engine: Engine) -> list[SlotStartGuard]:
    topology = SlotTopology.plan(WORLD, [ENGINE_GPUS])
    return [SlotStartGuard(topology.for_rank(r), RankEngine(engine, r)) for r in range(WORLD)]


class TestDuplicateStart:
    def test_plain_vimes_rule_starts_the_engine_twice(self) -> None:
        engine = Engine()
        _sync(
            [RankEngine(engine, r) for r in range(WORLD)], starts_on_tp_rank_zero=True, gather_over_tp=False
        )
        assert [rank for call, rank in engine.calls if call == "start_weight_update"] == [0, 4]
        assert [rank for call, rank in engine.calls if call == "update_weights_from_tensor"] == [0, 4]

    def test_two_would_be_coordinators_one_start_under_the_guard(self) -> None:
        engine = Engine()
        guards = _guarded(engine)
        outcome = _sync(guards, starts_on_tp_rank_zero=True, gather_over_tp=False)
        assert outcome == [None] * WORLD
        assert engine.calls == [
            ("start_weight_update", 0),
            ("update_weights_from_tensor", 0),
            ("finish_weight_update", 0),
        ]
        assert guards[4].absorbed == [
            "start_weight_update",
            "update_weights_from_tensor",
            "finish_weight_update",
        ]
        assert engine.open_updates == 0 and engine.errors == []

    def test_a_second_start_before_the_finish_is_refused(self) -> None:
        guard = _guarded(Engine())[0]
        guard.start_weight_update()
        with pytest.raises(DuplicateWeightUpdateStartError, match="one start per finish"):
            guard.start_weight_update()

    def test_an_update_or_a_finish_before_a_start_is_refused(self) -> None:
        guard = _guarded(Engine())[0]
        with pytest.raises(WeightUpdateNotStartedError):
            guard.update_weights_from_tensor(names=["w"], ipc_handles=[{f"gpu{g}": "h" for g in range(8)}])
        with pytest.raises(WeightUpdateNotStartedError):
            guard.finish_weight_update()


class TestHandlesOverTheSlot:
    def test_plain_vimes_tp_gather_leaves_half_the_engine_without_handles(self) -> None:
        engine = Engine()
        _sync([RankEngine(engine, r) for r in range(WORLD)], starts_on_tp_rank_zero=True, gather_over_tp=True)
        assert len(engine.errors) == 8  # each of the two updates misses four GPUs

    def test_under_the_guard_a_tp_gather_is_refused_before_anything_is_sent(self) -> None:
        engine = Engine()
        outcome = _sync(_guarded(engine), starts_on_tp_rank_zero=True, gather_over_tp=True)
        assert outcome[0] == outcome[4] == "IncompleteSlotHandlesError"
        assert [call for call, _ in engine.calls] == ["start_weight_update"]
        assert engine.errors == []

    def test_the_message_says_what_to_gather_over(self) -> None:
        guard = _guarded(Engine())[0]
        guard.start_weight_update()
        with pytest.raises(IncompleteSlotHandlesError, match=r"handles for \[4\] GPU\(s\).*spans 8"):
            guard.update_weights_from_tensor(names=["w"], ipc_handles=[{f"gpu{g}": "h" for g in range(4)}])


class Sender:
    """vime's colocated sender's fields as update_weight_from_tensor.py (01ea2336) sets them in connect."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.args = types.SimpleNamespace(rollout_num_gpus_per_engine=ENGINE_GPUS)
        self._ipc_engine: Any = None
        self._ipc_engine_coordinator = False

    def connect_rollout_engines(
        self, engines: Any, lock: Any, engine_gpu_counts: Any = None, **kwargs: Any
    ) -> None:
        self._ipc_engine = engines[0]
        self._ipc_engine_coordinator = self.rank % TP == 0  # the pre-#57 rule


class TestGuardWeightUpdater:
    def test_installed_after_every_connect_idempotently(self) -> None:
        engine = Engine()
        senders = [Sender(r) for r in range(WORLD)]
        for sender in senders:
            assert guard_weight_updater(sender, rank=sender.rank, world_size=WORLD)
            assert guard_weight_updater(sender, rank=sender.rank, world_size=WORLD)  # once only
            sender.connect_rollout_engines([RankEngine(engine, sender.rank)], "lock", engine_gpu_counts=[8])
        assert all(isinstance(s._ipc_engine, SlotStartGuard) for s in senders)
        assert [s._ipc_engine.slot.is_coordinator for s in senders] == [True] + [False] * 7
        assert (
            senders[4]._ipc_engine_coordinator is True
        )  # the sender's own flag stays: its path is unchanged
        for sender in senders:
            if sender._ipc_engine_coordinator:
                sender._ipc_engine.start_weight_update(is_checkpoint_format=True)
        assert engine.calls == [("start_weight_update", 0)]

    def test_a_remote_engine_beyond_the_trainer_is_left_alone(self) -> None:
        sender = Sender(0)
        guard_weight_updater(sender, rank=0, world_size=4)
        sender.connect_rollout_engines(["remote"], "lock", engine_gpu_counts=[8])
        assert sender._ipc_engine == "remote"

    def test_a_sender_without_connect_is_not_guarded(self) -> None:
        assert guard_weight_updater(object()) is False


class TestVimeNames:
    def _module(self, names: Any, *, fields: tuple[str, ...] | None = None) -> types.ModuleType:
        module = types.ModuleType("vime.utils.reloadable_process_group")
        for pair in names:
            setattr(module, pair.uses_backend, lambda backend: True)
        flags = fields if fields is not None else tuple(p.destroyed for p in names)
        module._DefaultProcessGroupState = type(
            "_DefaultProcessGroupState", (), {"__dataclass_fields__": dict.fromkeys(flags)}
        )
        return module

    def test_each_commits_names_are_read_from_the_module(self) -> None:
        assert vime_world_names(self._module([NCCL_NAMES])) == NCCL_NAMES
        assert vime_world_names(self._module([ACCELERATOR_NAMES])) == ACCELERATOR_NAMES

    def test_neither_or_half_a_pair_is_refused(self) -> None:
        with pytest.raises(TypeError, match="neither"):
            vime_world_names(self._module([]))
        with pytest.raises(TypeError, match="neither"):
            vime_world_names(self._module([NCCL_NAMES], fields=("accelerator_world_destroyed",)))


def test_the_stack_reset_follows_sleep_plans_only() -> None:
    resets: list[int] = []
    observer = CudaStackReset(lambda: resets.append(1))
    observer(Event.TRANSITION.value, {"plan": "wake"})
    observer(Event.TRANSITION.value, {"plan": "sleep"})
    observer(Event.MEMORY_RELEASED.value, {"plan": "sleep"})
    assert resets == [1] and observer.count == 1


class TestLaunchSwitch:
    def test_both_halves_are_replaced_where_vime_reads_them(self) -> None:
        assert VIME.halves() == ("trainer", "rollout")
        assert [(r.module, r.name) for r in VIME.replacements] == [
            ("vime.backends.megatron_utils.actor", "MegatronTrainRayActor"),
            ("vime.backends.vllm_utils.vllm_engine", "VLLMEngine"),
        ]

    def test_a_value_that_is_not_a_half_is_refused(self) -> None:
        with pytest.raises(LaunchConfigError, match="is not a half of the job"):
            install_vime({"RL_LIFECYCLE_WRAP": "engine"})

    def test_the_rollout_class_is_built_once_with_the_mixin_first(self) -> None:
        class VLLMEngine:
            pass

        built = lifecycle_engine(VLLMEngine)
        assert built is lifecycle_engine(VLLMEngine) and built.__name__ == "LifecycleVLLMEngine"
        assert built.__mro__[1:3] == (VimeRolloutMixin, VLLMServerActorLifecycle)
        assert vllm_wake_tags(["kv_cache", "cuda_graph"]) == ["kv_cache"]
        assert vllm_wake_tags(["cuda_graph"]) is None and vllm_wake_tags(None) is None

    def test_a_job_without_vime_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # pytest puts tests/actor_integration/frameworks on sys.path, where this suite's folder is named vime.
        monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "vime").is_dir()])
        with pytest.raises(LaunchConfigError, match="vime is not importable"):
            install_vime({"RL_LIFECYCLE_WRAP": "trainer"})

"""MegatronParallelState on real torch.distributed (gloo) and megatron-core's parallel_state, 2 ranks."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from actor_integration.backends.megatron import MegatronParallelState
from actor_integration.backends.process_groups import ReloadableProcessGroups
from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers.models import tiny_gpt_model
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


# find_spec, not an import: importing megatron.core costs ~6 s, and only the ranks need it.
requires_megatron = pytest.mark.skipif(
    not _megatron_installed(), reason="megatron-core is not installed (pip install rl-lifecycle[megatron])"
)
CYCLES = 10
Worker = Callable[..., dict[str, Any]]


def _tp_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import RowParallelLinear

    groups = ReloadableProcessGroups.init(
        backend="gloo", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=30)
    )
    state = MegatronParallelState(groups, tensor_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)

    def row_linear() -> RowParallelLinear:
        # 8 inputs split 4 per rank; all-ones weights, so each output is 8 only if the TP all_reduce ran.
        return RowParallelLinear(
            8,
            3,
            config=config,
            init_method=torch.nn.init.ones_,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    tracked, untracked = row_linear(), row_linear()
    state.register(tracked)
    out: dict[str, Any] = {"tp_sum": [], "row": [], "tracked_current": [], "untracked_registered": []}
    for _ in range(CYCLES):
        state.destroy()
        out.setdefault("alive_asleep", []).append(state.is_alive())
        out.setdefault("megatron_asleep", []).append(ps.model_parallel_is_initialized())
        state.reload()
        tp = ps.get_tensor_model_parallel_group()
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=tp)
        out["tp_sum"].append(value.item())
        result, _ = tracked(torch.ones(2, 4))
        out["row"].append(result[0].tolist())
        out["tracked_current"].append(tracked.tp_group is tp)
        out["untracked_registered"].append(
            dist.distributed_c10d._world.pg_map.get(untracked.tp_group) is not None
        )
    out["alive"] = state.is_alive()
    out["tp_world_size"] = ps.get_tensor_model_parallel_world_size()
    ps.destroy_model_parallel()
    groups.close()
    return out


@pytest.fixture(scope="module")
def tp_cycles() -> list[dict[str, Any]]:
    results = run_world(_tp_worker, 2, deadline_s=90)
    no_crash(results)
    return results


@requires_megatron
class TestTensorParallelCycles:
    """initialize_model_parallel(tensor_model_parallel_size=2), then 10 destroy/reload cycles."""

    def test_tp_group_all_reduce_is_correct_after_every_reload(self, tp_cycles: list[dict[str, Any]]) -> None:
        for res in tp_cycles:
            assert res["tp_sum"] == [3.0] * CYCLES
            assert res["tp_world_size"] == 2 and res["alive"] is True

    def test_destroy_forgets_megatron_groups(self, tp_cycles: list[dict[str, Any]]) -> None:
        for res in tp_cycles:
            assert res["alive_asleep"] == [False] * CYCLES
            assert res["megatron_asleep"] == [False] * CYCLES

    def test_registered_modules_follow_the_new_groups(self, tp_cycles: list[dict[str, Any]]) -> None:
        for res in tp_cycles:
            assert res["tracked_current"] == [True] * CYCLES
            assert res["row"] == [[8.0, 8.0, 8.0]] * CYCLES

    def test_unregistered_modules_keep_destroyed_groups(self, tp_cycles: list[dict[str, Any]]) -> None:
        # Why register() exists: under NCCL such a module would call an aborted communicator.
        for res in tp_cycles:
            assert res["untracked_registered"] == [False] * CYCLES


def _suspend_worker(rank: int, world_size: int, store: Store, fail: str | None) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from tests.helpers import fake_nccl

    fake_nccl.install(fail=[fail] if fail else [])  # gloo groups stand in for NCCL ones
    groups = ReloadableProcessGroups.init(
        backend="gloo",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=timedelta(seconds=30),
        communicators="suspend",
    )
    state = MegatronParallelState(groups, tensor_model_parallel_size=2)
    holder = {"tp": ps.get_tensor_model_parallel_group()}  # what a module caches at construction
    state.register(holder)
    out: dict[str, Any] = {"same_tp": [], "tp_sum": [], "held_current": [], "lost": []}
    for _ in range(3):
        before = ps.get_tensor_model_parallel_group()
        state.destroy()
        out["lost"].append(list(groups.lost_groups))
        out["initialised_asleep"] = ps.model_parallel_is_initialized()
        state.reload()
        tp = ps.get_tensor_model_parallel_group()
        out["same_tp"].append(tp is before)
        out["held_current"].append(holder["tp"] is tp)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=tp)
        out["tp_sum"].append(value.item())
        out.setdefault("registered", []).append(len(dist.distributed_c10d._world.pg_map))
    out["suspended"] = sorted(set(fake_nccl.calls("suspend")))
    ps.destroy_model_parallel()
    groups.close()
    return out


@requires_megatron
class TestSuspendedMegatronGroups:
    """communicators="suspend" (gloo groups standing in for NCCL ones), TP=2 on 2 ranks, 3 cycles."""

    def test_megatrons_groups_are_suspended_and_come_back_as_they_were(self) -> None:
        results = run_world(_suspend_worker, 2, None, deadline_s=90)
        no_crash(results)
        for res in results:
            assert res["same_tp"] == [True] * 3 and res["tp_sum"] == [3.0] * 3
            assert res["initialised_asleep"] is True  # Megatron keeps its groups while they sleep
            assert "TENSOR_MODEL_PARALLEL_GROUP" in res["suspended"] and res["lost"] == [[]] * 3

    def test_a_megatron_group_nccl_cannot_suspend_makes_the_wake_rebuild_megatrons_groups(self) -> None:
        results = run_world(_suspend_worker, 2, "TENSOR_MODEL_PARALLEL_GROUP", deadline_s=90)
        no_crash(results)
        for res in results:
            assert res["lost"] == [["TENSOR_MODEL_PARALLEL_GROUP"]] * 3
            assert res["same_tp"] == [False] * 3 and res["tp_sum"] == [3.0] * 3
            assert res["held_current"] == [True] * 3  # registered objects follow the rebuilt groups
            assert len(set(res["registered"])) == 1  # one set of Megatron's groups, not one more per wake


def _pp_worker(rank: int, world_size: int, store: Store) -> dict[str, Any]:
    """Megatron initialised by its owner (slime passes TP, PP, VPP, CP, EP, ETP, order), the groups adopted after."""
    from megatron.core import parallel_state as ps

    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    groups = ReloadableProcessGroups.adopt(untracked_subgroups=True, timeout=timedelta(seconds=30))
    out: dict[str, Any] = {}
    try:
        MegatronParallelState(groups, pipeline_model_parallel_size=1)
    except ValueError as exc:
        out["refused"] = str(exc)
    state = MegatronParallelState(groups, tensor_model_parallel_size=1)  # the README's old call: TP only
    out["init_kwargs"] = {k: v for k, v in state.init_kwargs.items() if k != "create_gloo_process_groups"}
    out["layouts"] = []
    for _ in range(3):
        state.destroy()
        state.reload()
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
        out["layouts"].append(
            {
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(),
                "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "pp_sum": value.item(),
            }
        )
    ps.destroy_model_parallel()
    groups.close()
    return out


@requires_megatron
class TestLayoutReadBack:
    """PP=2 on 2 gloo ranks: every reload rebuilds PP=2, not the DP=2 that TP-only arguments gave."""

    @pytest.fixture(scope="class")
    def runs(self) -> list[dict[str, Any]]:
        results = run_world(_pp_worker, 2, deadline_s=90)
        no_crash(results)
        return results

    def test_reload_keeps_the_pipeline_layout(self, runs: list[dict[str, Any]]) -> None:
        for rank, res in enumerate(runs):
            assert res["layouts"] == [{"pp": 2, "dp": 1, "pp_rank": rank, "pp_sum": 3.0}] * 3

    def test_the_layout_is_read_back(self, runs: list[dict[str, Any]]) -> None:
        for res in runs:
            assert res["init_kwargs"] == {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": None,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": 1,
                "order": "tp-cp-ep-dp-pp",
            }

    def test_a_different_size_is_refused(self, runs: list[dict[str, Any]]) -> None:
        for res in runs:
            assert "pipeline_model_parallel_size=1 (Megatron has 2)" in res["refused"]


class TestErrors:
    @pytest.fixture
    def groups(self) -> Iterator[ReloadableProcessGroups]:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        groups = ReloadableProcessGroups.init(
            backend="gloo", rank=0, world_size=1, store=store, timeout=timedelta(seconds=10)
        )
        yield groups
        groups.close()

    def test_missing_megatron_says_how_to_install(
        self, groups: ReloadableProcessGroups, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "megatron", None)
        monkeypatch.setitem(sys.modules, "megatron.core", None)
        with pytest.raises(ImportError, match=r"pip install rl-lifecycle\[megatron\]"):
            MegatronParallelState(groups, tensor_model_parallel_size=1)

    def test_needs_reloadable_groups(self) -> None:
        with pytest.raises(TypeError, match="needs ReloadableProcessGroups"):
            MegatronParallelState(object())  # type: ignore[arg-type]

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
    def test_tiny_gpt_model_needs_cuda(self) -> None:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            tiny_gpt_model()


def test_megatron_imported_after_torch_memory_saver_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """megatron-core 0.19 sets torch_memory_saver.hook_mode on import, which TMS refuses once initialised."""
    import actor_integration.backends.megatron as megatron_module
    from actor_integration.errors import MemorySaverConfigError

    # A megatron.core whose import fails the way 0.19.2's does after torch_memory_saver started.
    package = tmp_path / "megatron" / "core"
    package.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "raise AttributeError(\"'TorchMemorySaver' object has no attribute '_impl_ctor_kwargs'\")\n"
    )
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        MemorySaverConfigError, match=r"Import megatron.core, or build MegatronParallelState, before"
    ):
        megatron_module._parallel_state()

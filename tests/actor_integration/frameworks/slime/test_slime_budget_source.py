"""slime's real MegatronTrainRayActor under `RL_LIFECYCLE_MEMORY_BUDGET=rollout`, on two gloo ranks.

The colocated engines' need is `--sglang-mem-fraction-static` 0.4 of an 80 GiB device (32 GiB); the
device's free memory is what the test says it is (a CPU has none to read). Where it is plenty, no
sleep pauses memory or tears the groups down, and every call of slime's driver still runs (train,
save, the weight push, train again) with the trained weights; where it is short, each sleep is
slime's full sleep, as without the budget. The budget's plan is in each rank's log, and the ranks'
plans agree. Needs slime's source (tests/actor_integration/frameworks/slime/test_slime_source.py
says how); CI skips it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.framework_source import free_port, suite_source
from tests.helpers.slime_source import SlimeSource, slime_args
from tests.helpers.spawn import no_crash, run_world

SOURCE: SlimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(SlimeSource, "slime's")

GIB = 1 << 30
DEADLINE_S = 240.0


def _batch(step: int) -> Any:
    import torch
    from slime.utils.misc import Box

    tokens = torch.arange(8) + step
    return Box(
        {
            "tokens": [tokens],
            "loss_masks": [torch.ones(8)],
            "total_lengths": [8],
            "response_lengths": [4],
            "num_microbatches": [1],
            "global_batch_sizes": [1],
        }
    )


def _worker(
    rank: int, world_size: int, store: Any, location: str, commit: str, port: int, free_gib: int
) -> Any:
    from actor_integration.backends.tms_env import preload_library
    from actor_integration.frameworks.slime import SlimeLifecycleMixin, slime_memory_backend
    from actor_integration.frameworks.slime.budget import BUDGET_VARIABLE
    from tests.helpers.slime_source import RECORD, SAVER, RolloutManager, install, model_checksum

    actor_module = install(SlimeSource(Path(location), commit))
    os.environ.update(
        {"LD_PRELOAD": preload_library(13), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    )
    os.environ[BUDGET_VARIABLE] = "rollout"

    class BudgetedTrainer(SlimeLifecycleMixin, actor_module.MegatronTrainRayActor):
        def lifecycle_memory(self) -> Any:
            return slime_memory_backend(cuda_major=13)

        def lifecycle_device_total_bytes(self) -> int:
            return 80 * GIB

        def lifecycle_free_bytes(self) -> int | None:  # a released trainer frees 40 GiB
            return (free_gib + (40 if any(SAVER.paused.values()) else 0)) * GIB

    events: list[dict[str, Any]] = []
    actor = BudgetedTrainer(world_size, rank, "127.0.0.1", port)
    original = actor.configure_lifecycle

    def configure(*args: Any, **kwargs: Any) -> Any:  # the first sleep (end of init) configures it
        machine = original(*args, **kwargs)
        machine.observe(lambda event, fields: events.append({"event": event, **fields}))
        return machine

    actor.configure_lifecycle = configure  # type: ignore[method-assign]
    actor.init(slime_args(world_size, sglang_mem_fraction_static=0.4), "actor")
    actor.set_rollout_manager(RolloutManager())
    weights = {"init": model_checksum(actor.model)}
    actor.train(0, _batch(0))
    weights["trained"] = model_checksum(actor.model)
    actor.save_model(0)
    actor.update_weights()
    actor.train(1, _batch(1))
    plans = [e for e in events if e["event"] == "lifecycle.budget"]
    return {
        "need": actor.lifecycle.need_bytes,
        "pauses": SAVER.pause_count,
        "resumes": SAVER.resume_count,
        "state": actor.lifecycle.state.value,
        "plans": [{k: p.get(k) for k in ("released", "kept", "plan")} for p in plans],
        "short_errors": [
            e for e in events if e["event"] == "lifecycle.budget_checked" and e.get("short_bytes")
        ],
        "destroys": sum(
            1
            for e in events
            if e["event"] == "lifecycle.transition"
            for h in e.get("hooks", [])
            if h["name"] == "process_groups.destroy"
        ),
        "weights": weights,
        "saved": [round(float(x), 6) for x in RECORD["saved"]] if RECORD["saved"] else [],
        "engine": len(RECORD["engine"]),
    }


def _run(free_gib: int) -> list[dict[str, Any]]:
    assert SOURCE is not None
    results = run_world(
        _worker, 2, str(SOURCE.location), SOURCE.commit, free_port(), free_gib, deadline_s=DEADLINE_S
    )
    no_crash(results)
    return results


@pytest.fixture(scope="module")
def plenty() -> list[dict[str, Any]]:
    return _run(free_gib=60)  # 32 GiB needed + 1 GiB margin: fits without releasing anything


@pytest.fixture(scope="module")
def short() -> list[dict[str, Any]]:
    return _run(free_gib=8)


class TestMemoryBudget:
    def test_the_need_is_the_engines_fraction_on_every_rank(self, plenty: list[dict[str, Any]]) -> None:
        assert [r["need"] for r in plenty] == [int(0.4 * 80 * GIB)] * 2

    def test_where_the_need_fits_no_sleep_releases_anything(self, plenty: list[dict[str, Any]]) -> None:
        for rank in plenty:
            assert rank["pauses"] == 0 and rank["resumes"] == 0
            assert rank["destroys"] == 0
            assert rank["plans"] and all(not p["released"] for p in rank["plans"])
            assert rank["state"] == "PAUSED"

    def test_slimes_calls_all_ran_on_the_trained_weights(self, plenty: list[dict[str, Any]]) -> None:
        for rank in plenty:
            assert rank["weights"]["trained"] != rank["weights"]["init"]
            assert rank["engine"] >= 1  # the weight push reached the engine

    def test_the_ranks_plans_agree(self, plenty: list[dict[str, Any]], short: list[dict[str, Any]]) -> None:
        assert plenty[0]["plans"] == plenty[1]["plans"]
        assert short[0]["plans"] == short[1]["plans"]

    def test_where_it_is_short_each_sleep_is_slimes_full_sleep(self, short: list[dict[str, Any]]) -> None:
        for rank in short:
            assert rank["pauses"] >= 3 and rank["destroys"] >= 3
            assert rank["state"] == "PAUSED"
            assert rank["plans"] and all(p["released"] for p in rank["plans"])

"""The memory budget on one GPU, real torch_memory_saver: a wrong need is a typed error, never an OOM.

Run: python -m pytest -m gpu tests/gpu/test_memory_budget_gpu.py -x -q -s
A trainer's state in two torch_memory_saver tags (1 GiB weights, 2 GiB optimizer, CPU backup),
`DeviceMemoryProbe` reading the device's free memory, `LifecyclePolicy(memory_budget=...)`. The
need is set from the free memory measured in the test, so the figures hold on any card:

- memory another allocation takes between the sleep's plan and its check: the plan releases the
  optimizer alone, 1 GiB is taken meanwhile, the check raises `MemoryBudgetShortError` (the
  bytes short, the weights still resident); an allocation of the need would have run out of
  memory there; `recover(State.PAUSED)` releases the weights too and the need is then free;
- a need larger than everything the trainer can free: the full sleep, then the typed error, not
  the other phase's OOM.
Figures are printed and, when LIFECYCLE_GPU_OUT is set, written to memory_budget_*.json there.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests.helpers.gpu_results import record

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB, GIB = 2**20, 2**30
SIZES = {"weights": GIB, "optimizer": 2 * GIB}
MARGIN = 256 * MIB


class Thief:
    """A memory backend wrapper: after `tag`'s pause, another allocation takes `nbytes` (the probe's
    plan has been made; its check comes after the pause), as another process would meanwhile."""

    def __init__(self, memory: Any, tag: str, nbytes: int) -> None:
        self.memory, self.tag, self.nbytes = memory, tag, nbytes
        self.taken: list[Any] = []

    def pause(self, tag: str | None = None) -> None:
        self.memory.pause(tag)
        if tag == self.tag and not self.taken:
            self.taken.append(torch.empty(self.nbytes, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()

    def __getattr__(self, name: str) -> Any:
        if name == "memory":
            raise AttributeError(name)
        return getattr(self.memory, name)


def settle() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def would_oom(nbytes: int) -> bool:
    """Whether the other phase's wake allocating `nbytes` now runs out of memory (what the error spares it)."""
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        settle()
        return True
    del block
    settle()
    return False


def trainer(memory: Any, sizes: dict[str, int]) -> Any:
    from actor_integration import DeviceMemoryProbe
    from lifecycle import Hooks, Lifecycle, LifecyclePolicy, MemoryBudget

    probe = DeviceMemoryProbe(expected_bytes=lambda tag: sizes.get(tag) if tag else sum(sizes.values()))
    policy = LifecyclePolicy(
        memory_tags=tuple(sizes), model_tag=None, memory_budget=MemoryBudget(margin_bytes=MARGIN)
    )
    return Lifecycle(policy, Hooks(memory=memory, budget=probe), role="trainer")


def state(backend: Any, sizes: dict[str, int]) -> dict[str, Any]:
    tensors = {}
    for tag, nbytes in sizes.items():
        with backend.region(tag):
            tensors[tag] = torch.full((nbytes // 4,), 3.0, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    return tensors


def backend_for(tags: tuple[str, ...]) -> Any:
    pytest.importorskip("torch_memory_saver")
    from actor_integration.backends.memory_saver import TorchMemorySaverBackend

    return TorchMemorySaverBackend(tags=tags, cpu_backup=True, retain_cpu_backup=True, hook_mode="torch")


def test_memory_taken_between_the_plan_and_the_check_is_a_typed_error_not_an_oom() -> None:
    from lifecycle import MemoryBudgetShortError, State, capture_events
    from lifecycle.table import Residency

    settle()
    backend = backend_for(tuple(SIZES))
    tensors = state(backend, SIZES)
    thief = Thief(backend, "optimizer", GIB)
    lc = trainer(thief, SIZES)
    free0 = free()
    need = free0 + 3 * GIB // 2  # the optimizer's 2 GiB covers it (and the margin): the weights stay
    lc.expect(need)
    with capture_events() as events, pytest.raises(MemoryBudgetShortError) as caught:
        lc.sleep()
    error = caught.value
    plan = next(e for e in events if e["event"] == "lifecycle.budget")
    checked = next(e for e in events if e["event"] == "lifecycle.budget_checked")
    after_check = free()
    oom = would_oom(need)  # the wake the error came before
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "free_before_gib": round(free0 / GIB, 3),
        "need_gib": round(need / GIB, 3),
        "released": plan["released"],
        "kept": plan["kept"],
        "short_mib": round(error.short_bytes / MIB, 1),
        "resident": list(error.resident),
        "free_after_check_gib": round(after_check / GIB, 3),
        "allocating_the_need_ooms": oom,
    }
    assert plan["released"] == ["optimizer"] and plan["kept"] == ["weights"]
    assert checked["raised"] and not checked["met"]
    assert lc.state is State.FAILED and error.resident == ("weights",)
    assert error.need_bytes == need and error.free_bytes < need
    assert 0.3 * GIB < error.short_bytes < 0.7 * GIB  # ~0.5 GiB: 2 freed, 1 taken, 1.5 needed
    assert oom, "the need was not free, so the other phase's allocation of it must run out of memory"
    # recover releases what is still resident; the need is free then.
    with capture_events() as more:
        lc.recover(State.PAUSED)
    assert lc.state is State.PAUSED
    assert lc.residency == {"weights": Residency.RELEASED, "optimizer": Residency.RELEASED}
    rechecked = [e for e in more if e["event"] == "lifecycle.budget_checked"]
    assert rechecked and rechecked[-1]["met"]
    figures["after_recover_free_gib"] = round(free() / GIB, 3)
    figures["allocating_the_need_after_recover_ooms"] = would_oom(need)
    record("memory_budget_taken_meanwhile", figures)
    assert not figures["allocating_the_need_after_recover_ooms"]
    lc.expect(None)
    lc.wake_up()
    assert all(float(t[0]) == 3.0 and float(t[-1]) == 3.0 for t in tensors.values())  # backed up, intact
    thief.taken.clear()
    lc.sleep()  # no need: the full sleep, no check
    del tensors
    settle()


def test_a_need_beyond_what_the_trainer_can_free_is_a_typed_error_after_the_full_sleep() -> None:
    from lifecycle import MemoryBudgetShortError, State, capture_events
    from lifecycle.table import Residency

    settle()
    sizes = {"w2": GIB, "o2": 2 * GIB}  # tags of their own: torch_memory_saver's are process-wide
    backend = backend_for(tuple(sizes))
    tensors = state(backend, sizes)
    lc = trainer(backend, sizes)
    free0 = free()
    need = free0 + 4 * GIB  # the trainer holds 3 GiB: nothing it releases makes 4 free
    lc.expect(need)
    with capture_events() as events, pytest.raises(MemoryBudgetShortError) as caught:
        lc.sleep()
    plan = next(e for e in events if e["event"] == "lifecycle.budget")
    error = caught.value
    oom = would_oom(need)
    figures = {
        "device": torch.cuda.get_device_name(),
        "need_gib": round(need / GIB, 3),
        "feasible": plan["feasible"],
        "released": plan["released"],
        "short_mib": round(error.short_bytes / MIB, 1),
        "allocating_the_need_ooms": oom,
    }
    record("memory_budget_beyond_the_device", figures)
    assert not plan["feasible"] and plan["released"] == list(sizes)  # the full sleep
    assert lc.state is State.FAILED and lc.residency == dict.fromkeys(sizes, Residency.RELEASED)
    assert error.resident == () and 0.7 * GIB < error.short_bytes < 1.3 * GIB
    assert oom
    lc.expect(None)  # no need the trainer can meet: recover without one
    lc.recover(State.PAUSED)
    lc.wake_up()
    assert all(float(t[0]) == 3.0 for t in tensors.values())
    lc.sleep()
    del tensors
    settle()

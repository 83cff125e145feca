"""Release verification on one GPU: a real release frees about its tags' size, a release that frees nothing warns.

Run: python -m pytest -m gpu tests/gpu/test_release_audit_gpu.py -x -q -s
Figures are printed and, when LIFECYCLE_GPU_OUT is set, written to release_audit_*.json there.
The torch_memory_saver case runs first: its hook mode "torch" is chosen before this process uses CUDA.
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
# The reference engine's tags at a size where the allocator's 2 MiB / 20 MiB granularity is noise:
# 4 blocks of dim 2048 in fp32 (~770 MiB of weights) and a 512 MiB KV cache.
CONFIG = {"vocab_size": 97, "dim": 2048, "n_layers": 4, "n_heads": 16, "max_seq_len": 64, "seed": 0}
KV_TOKENS = 8192


def settle() -> None:
    """Hand back what earlier tests left in torch's cache, so that only this test's engine moves memory."""
    gc.collect()
    torch.cuda.empty_cache()


def audit_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] in ("memory.released", "memory.taken")]


def figures(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in audit_events(events):
        measured = e.get("freed_bytes", e.get("taken_bytes"))
        out.append(
            {
                "event": e["event"],
                "tag": e["tag"],
                "level": e["level"],
                "expected_mib": round(e["expected_bytes"] / MIB, 1),
                "measured_mib": round(measured / MIB, 1),
                "ratio": round(measured / e["expected_bytes"], 3),
                "ms": e["duration_ms"],
            }
        )
    return out


def test_a_torch_memory_saver_release_frees_its_region() -> None:
    """The trainer side: the adapter over real torch_memory_saver, audited; 1 GiB freed and taken back."""
    pytest.importorskip("torch_memory_saver")
    from actor_integration.backends.memory_saver import TorchMemorySaverBackend
    from actor_integration.backends.release_audit import AuditedMemory
    from lifecycle import Hooks, Lifecycle, LifecyclePolicy, capture_events

    backend = TorchMemorySaverBackend(tags=("model",), hook_mode="torch")
    with backend.region("model"):
        model = torch.ones(GIB // 4, dtype=torch.float32, device="cuda")
    memory = AuditedMemory(backend, expected_bytes=lambda tag: model.numel() * model.element_size())
    lifecycle = Lifecycle(
        LifecyclePolicy(memory_tags=("model",), model_tag=None), Hooks(memory=memory), role="trainer"
    )
    memory.sink = lifecycle
    with capture_events() as events:
        lifecycle.sleep()
        lifecycle.wake_up()
    seen = figures(events)
    record("release_audit_tms_1gib", {"device": torch.cuda.get_device_name(), "events": seen})
    assert [(f["event"], f["level"]) for f in seen] == [("memory.released", "info"), ("memory.taken", "info")]
    assert all(0.95 <= f["ratio"] <= 1.05 for f in seen), seen


def test_the_reference_engines_release_frees_about_its_tags_size() -> None:
    """The rollout side: RolloutActor over the reference engine on CUDA; every release and wake is
    measured against the engine's own tag sizes and none is short."""
    from actor_integration.models.tiny import TinyLMConfig
    from actor_integration.rollout import ReferenceEngine, RolloutActor
    from lifecycle import capture_events

    settle()
    engine = ReferenceEngine(TinyLMConfig(**CONFIG), devices=["cuda:0"], kv_cache_tokens=KV_TOKENS)
    actor = RolloutActor(engine, rank=0)
    actor.generate([[1, 2, 3]], max_new_tokens=4)
    torch.cuda.synchronize()
    with capture_events() as events:
        actor.sleep()
        actor.wake_up(["weights"])
        actor.wake_up(["kv_cache"])
    seen = figures(events)
    record(
        "release_audit_reference_engine",
        {
            "device": torch.cuda.get_device_name(),
            "weights_mib": round(engine.memory_bytes("weights") / MIB, 1),
            "kv_cache_mib": round(engine.memory_bytes("kv_cache") / MIB, 1),
            "events": seen,
        },
    )
    assert [(f["event"], f["tag"]) for f in seen] == [
        ("memory.released", "weights"),
        ("memory.released", "kv_cache"),
        ("memory.taken", "weights"),
        ("memory.taken", "kv_cache"),
    ]
    assert all(f["level"] == "info" for f in seen), seen
    assert all(0.9 <= f["ratio"] <= 1.1 for f in seen), seen


def test_a_release_that_frees_nothing_warns_with_the_numbers() -> None:
    """A live reference to the weights keeps their memory: the release returns, frees ~0, and warns."""
    from actor_integration.models.tiny import TinyLMConfig
    from actor_integration.rollout import ReferenceEngine, RolloutActor
    from lifecycle import capture_events

    settle()
    engine = ReferenceEngine(TinyLMConfig(**CONFIG), devices=["cuda:0"], kv_cache_tokens=KV_TOKENS)
    actor = RolloutActor(engine, rank=0)
    held = [p.data for model in engine.models for p in model.parameters()]  # the leak: tensors kept alive
    with capture_events() as events:
        actor.sleep(["weights"])
    (released,) = audit_events(events)
    record("release_audit_held_weights", {"device": torch.cuda.get_device_name(), "events": figures(events)})
    del held
    assert released["level"] == "warning" and released["short"] is True
    assert released["freed_bytes"] < 0.1 * released["expected_bytes"]
    assert "slime #579" in released["reason"]
    assert actor.lifecycle.state.value == "PAUSED"  # reported, not failed

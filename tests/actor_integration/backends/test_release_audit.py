"""AuditedMemory: each release logs the device memory it freed, each wake what it took; a short release warns."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from actor_integration.backends.release_audit import MIB, AuditedMemory, cuda_free_bytes
from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout import ReferenceEngine, RolloutActor
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State, capture_events
from lifecycle.hooks import MemoryBatches
from lifecycle.logs import Event
from lifecycle.testing import FakeMemorySaver, ProtocolViolation
from tests.helpers.tms import BatchMemory

CAPACITY = 80 * 1024 * MIB
SIZES = {"weights": 600 * MIB, "kv_cache": 200 * MIB}


class FakeDevice:
    """`torch.cuda.mem_get_info()[0]` of a device whose tags hold `sizes` while `resident(tag)`;
    `leaked` bytes of a tag stay allocated after its release (a live reference to its tensors)."""

    def __init__(self, resident: Callable[[str], bool], sizes: Mapping[str, int] = SIZES) -> None:
        self.resident, self.sizes = resident, dict(sizes)
        self.leaked: dict[str, int] = {}

    def free(self) -> int:
        used = sum(
            size if self.resident(tag) else self.leaked.get(tag, 0) for tag, size in self.sizes.items()
        )
        return CAPACITY - used


def expected(tag: str | None) -> int:
    return sum(SIZES.values()) if tag is None else SIZES[tag]


def audited(
    *, sink: bool = True, **options: object
) -> tuple[AuditedMemory, FakeMemorySaver, FakeDevice, Lifecycle]:
    saver = FakeMemorySaver(tags=tuple(SIZES))
    device = FakeDevice(lambda tag: not saver.paused[tag])
    memory = AuditedMemory(saver, expected_bytes=expected, free_bytes=device.free, **options)  # type: ignore[arg-type]
    policy = LifecyclePolicy(memory_tags=tuple(SIZES), model_tag=None)
    lifecycle = Lifecycle(policy, Hooks(memory=memory), rank=3, role="rollout")
    if sink:
        memory.sink = lifecycle
    return memory, saver, device, lifecycle


def audit_events(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e["event"] in (Event.MEMORY_RELEASED, Event.MEMORY_TAKEN)]


class TestMeasurement:
    def test_each_release_logs_what_it_freed_next_to_what_its_tag_holds(self):
        """One memory.released per tag with expected and freed bytes; a full release is info, not short."""
        _, _, _, lifecycle = audited()
        with capture_events() as events:
            lifecycle.sleep()
        released = audit_events(events)
        assert [(e["event"], e["tag"], e["level"]) for e in released] == [
            ("memory.released", "weights", "info"),
            ("memory.released", "kv_cache", "info"),
        ]
        assert [(e["freed_bytes"], e["expected_bytes"], e["short"]) for e in released] == [
            (SIZES["weights"], SIZES["weights"], False),
            (SIZES["kv_cache"], SIZES["kv_cache"], False),
        ]
        assert all(e["rank"] == 3 and e["role"] == "rollout" for e in released)  # the actor's context

    def test_each_wake_logs_the_memory_it_took(self):
        _, _, _, lifecycle = audited()
        lifecycle.sleep()
        with capture_events() as events:
            lifecycle.wake_up(["weights"])
        (taken,) = audit_events(events)
        assert taken["event"] == "memory.taken" and taken["tag"] == "weights"
        assert taken["taken_bytes"] == taken["expected_bytes"] == SIZES["weights"]

    def test_a_release_that_frees_much_less_than_its_tag_warns_with_the_numbers(self):
        """slime #579, miles #86: the release returned, the memory is still held; the warning says how much."""
        memory, _, device, lifecycle = audited()
        device.leaked["weights"] = SIZES["weights"] - 50 * MIB  # a live reference keeps most of it
        with capture_events() as events:
            lifecycle.sleep()
        weights, kv = audit_events(events)
        assert weights["level"] == "warning" and weights["short"] is True
        assert (weights["freed_bytes"], weights["expected_bytes"]) == (50 * MIB, 600 * MIB)
        assert "freed 50.0 MiB of the 600.0 MiB" in str(weights["reason"]) and "slime #579" in str(
            weights["reason"]
        )
        assert kv["level"] == "info" and kv["short"] is False
        assert [m.short for m in memory.measurements] == [True, False]
        assert lifecycle.state is State.PAUSED  # the audit reports; it never fails the hook

    def test_the_warning_threshold_is_a_fraction_of_the_tag(self):
        _, _, device, lifecycle = audited(warn_below=0.9)
        device.leaked["weights"] = 100 * MIB  # 500 of 600 MiB freed: 83%, below 90%
        with capture_events() as events:
            lifecycle.sleep(["weights"])
        (weights,) = audit_events(events)
        assert weights["short"] is True and weights["level"] == "warning"

    def test_a_tag_within_the_allocator_granularity_is_never_judged_short(self):
        memory, _, device, lifecycle = audited(warn_min_bytes=SIZES["kv_cache"] + 1)
        device.leaked["kv_cache"] = SIZES["kv_cache"]  # freed nothing, but 200 MiB is under the floor
        lifecycle.sleep(["kv_cache"])
        assert [(m.measured_bytes, m.short) for m in memory.measurements] == [(0, False)]

    def test_without_expected_sizes_releases_are_recorded_and_never_judged(self):
        saver = FakeMemorySaver(tags=tuple(SIZES))
        device = FakeDevice(lambda tag: not saver.paused[tag])
        device.leaked["weights"] = SIZES["weights"]
        memory = AuditedMemory(saver, free_bytes=device.free)
        memory.pause("weights")
        memory.pause("kv_cache")
        assert [(m.expected_bytes, m.measured_bytes, m.short) for m in memory.measurements] == [
            (None, 0, False),
            (None, SIZES["kv_cache"], False),
        ]


class TestBatches:
    """A backend that takes a stage's tags in one call keeps it under the audit."""

    def batched(self) -> tuple[AuditedMemory, BatchMemory, FakeDevice, Lifecycle]:
        saver = BatchMemory(tags=tuple(SIZES))
        device = FakeDevice(lambda tag: not saver.paused[tag])
        memory = AuditedMemory(saver, expected_bytes=expected, free_bytes=device.free)
        lifecycle = Lifecycle(LifecyclePolicy(memory_tags=tuple(SIZES), model_tag=None), Hooks(memory=memory))
        memory.sink = lifecycle
        return memory, saver, device, lifecycle

    def test_a_batch_is_one_call_to_the_backend_with_one_record_per_tag(self):
        """The sleep's two pauses reach the backend as one `pause_tags`; the first tag's record
        carries what the call freed against what both tags hold, the other follows with nothing."""
        memory, saver, _, lifecycle = self.batched()
        with capture_events() as events:
            lifecycle.sleep()
            lifecycle.wake_up()
        assert saver.batches == [("pause", tuple(SIZES)), ("resume", tuple(SIZES))]
        both = sum(SIZES.values())
        assert [
            (m.kind, m.tag, m.expected_bytes, m.measured_bytes, m.short) for m in memory.measurements
        ] == [
            ("release", "weights", both, both, False),
            ("release", "kv_cache", 0, 0, False),
            ("resume", "weights", both, both, False),
            ("resume", "kv_cache", 0, 0, False),
        ]
        assert [(e["event"], e["tag"]) for e in audit_events(events)] == [
            ("memory.released", "weights"),
            ("memory.released", "kv_cache"),
            ("memory.taken", "weights"),
            ("memory.taken", "kv_cache"),
        ]

    def test_a_short_batch_is_judged_on_all_its_tags(self):
        _, _, device, lifecycle = self.batched()
        device.leaked["weights"] = SIZES["weights"]  # only the KV cache's 200 of 800 MiB freed
        with capture_events() as events:
            lifecycle.sleep()
        first, second = audit_events(events)
        assert first["short"] is True and first["level"] == "warning"
        assert (first["freed_bytes"], first["expected_bytes"]) == (SIZES["kv_cache"], sum(SIZES.values()))
        assert second["short"] is False and second["level"] == "info"

    def test_a_single_tag_still_goes_through_pause(self):
        memory, saver, _, lifecycle = self.batched()
        lifecycle.sleep(["weights"])
        assert saver.batches == [] and [m.tag for m in memory.measurements] == ["weights"]

    def test_the_batch_calls_exist_only_where_the_backend_has_them(self):
        """Without them the lifecycle calls `pause` per tag, as before; the audit adds none."""
        assert isinstance(AuditedMemory(BatchMemory()), MemoryBatches)
        plain = AuditedMemory(FakeMemorySaver())
        assert not isinstance(plain, MemoryBatches)
        assert not hasattr(plain, "pause_tags") and not hasattr(plain, "resume_tags")

    def test_a_failed_batch_records_nothing_and_is_the_hooks_failure(self):
        saver = BatchMemory(fail=True, tags=tuple(SIZES))
        device = FakeDevice(lambda tag: not saver.paused[tag])
        memory = AuditedMemory(saver, expected_bytes=expected, free_bytes=device.free)
        with pytest.raises(RuntimeError, match="refused the release"):
            memory.pause_tags(tuple(SIZES))
        assert list(memory.measurements) == []


class TestNeverInTheWay:
    def test_without_cuda_nothing_is_measured_and_the_hook_runs(self):
        saver = FakeMemorySaver(tags=("weights",))
        memory = AuditedMemory(saver, expected_bytes=expected, free_bytes=lambda: None)
        memory.pause("weights")
        assert saver.paused["weights"] and list(memory.measurements) == []

    def test_a_failing_measurement_is_skipped_not_raised(self):
        saver = FakeMemorySaver(tags=("weights",))

        def broken() -> int:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        memory = AuditedMemory(saver, expected_bytes=lambda tag: 1 / 0, free_bytes=broken)  # type: ignore[arg-type,return-value]
        memory.pause("weights")
        memory.resume("weights")
        assert not saver.paused["weights"] and list(memory.measurements) == []

    def test_a_failing_pause_is_the_hooks_failure_and_records_nothing(self):
        memory, saver, _, _ = audited()
        saver.pause("weights")  # a paused tag: the fake raises where torch_memory_saver would exit(1)
        with pytest.raises(ProtocolViolation):
            memory.pause("weights")
        assert list(memory.measurements) == []

    def test_no_sink_still_keeps_the_measurements(self):
        memory, _, _, lifecycle = audited(sink=False)
        with capture_events() as events:
            lifecycle.sleep()
        assert audit_events(events) == [] and len(memory.measurements) == 2

    def test_it_wraps_only_a_memory_backend(self):
        with pytest.raises(TypeError, match="pause/resume/disable"):
            AuditedMemory(object())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="warn_below"):
            AuditedMemory(FakeMemorySaver(), warn_below=0.0)

    def test_the_wrapped_backends_capabilities_show_through_except_overlap(self):
        """is_paused (for recover) and the rest are the backend's; overlap is off: a teardown beside the
        pause would be counted as freed."""
        saver = FakeMemorySaver(tags=("weights",), may_overlap_process_groups=True)
        memory = AuditedMemory(saver)
        memory.pause("weights")
        assert memory.is_paused("weights") is True and memory.tags == ("weights",)
        assert memory.may_overlap_process_groups is False
        with memory.disable():
            assert saver.disabled

    def test_cuda_free_bytes_is_none_in_a_process_without_cuda(self):
        torch = pytest.importorskip("torch")
        if torch.cuda.is_initialized():
            pytest.skip("CUDA is initialised in this process")
        assert cuda_free_bytes() is None


class TestRolloutActor:
    CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)

    def test_the_rollout_audits_its_releases_with_the_engines_tag_sizes(self):
        """RolloutActor wraps its engine memory; its events carry the rollout's rank and role."""
        engine = ReferenceEngine(self.CONFIG)
        actor = RolloutActor(engine, rank=1)
        assert actor.lifecycle.hooks.memory is actor.memory_audit
        assert actor.memory_audit.sink is actor.lifecycle
        assert actor.memory_audit.expected_bytes == engine.memory_bytes
        assert engine.memory_bytes() == 0  # CPU ranks hold no device memory
        device = FakeDevice(lambda tag: engine.residency[tag])
        actor.memory_audit.free_bytes = device.free
        actor.memory_audit.expected_bytes = expected
        device.leaked["weights"] = SIZES["weights"]
        with capture_events() as events:
            actor.sleep()
            actor.wake_up()
        audit = audit_events(events)
        assert [(e["event"], e["tag"], e["level"], e["rank"], e["role"]) for e in audit] == [
            ("memory.released", "weights", "warning", 1, "rollout"),
            ("memory.released", "kv_cache", "info", 1, "rollout"),
            ("memory.taken", "weights", "info", 1, "rollout"),
            ("memory.taken", "kv_cache", "info", 1, "rollout"),
        ]
        assert audit[0]["freed_bytes"] == 0 and audit[0]["expected_bytes"] == SIZES["weights"]

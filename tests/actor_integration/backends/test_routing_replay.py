"""RoutingReplayClear over slime-shaped caches: after the hook the recorded tensors are freed."""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest
import torch

from actor_integration.backends.routing_replay import RoutingReplayCache, RoutingReplayClear
from lifecycle import Hooks, Lifecycle, LifecyclePolicy
from lifecycle.testing import FakeMemorySaver


class SlimeRoutingReplay:
    """slime's RoutingReplay as it is: a class-level list and a static clear_all()."""

    all_routing_replays: ClassVar[list[SlimeRoutingReplay]] = []

    def __init__(self) -> None:
        self.top_indices_list: list[torch.Tensor] = []
        SlimeRoutingReplay.all_routing_replays.append(self)

    def record(self, top_indices: torch.Tensor) -> None:
        self.top_indices_list.append(top_indices.clone())

    def clear(self) -> None:
        self.top_indices_list = []

    @staticmethod
    def clear_all() -> None:
        for replay in SlimeRoutingReplay.all_routing_replays:
            replay.clear()


def routed(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (128, 8), generator=torch.Generator().manual_seed(step))


class TestRoutingReplayCache:
    def test_records_host_copies_in_order(self) -> None:
        cache = RoutingReplayCache(layer=0, pin_memory=False)
        first, second = routed(1), routed(2)
        cache.record(first)
        cache.record(second)
        first.zero_()  # the cache holds its own copy
        assert torch.equal(cache.pop_forward(), routed(1))
        assert torch.equal(cache.pop_forward(), routed(2))
        with pytest.raises(IndexError, match=r"layer 0: 2 steps recorded, replay asked for step 3"):
            cache.pop_forward()

    def test_clear_all_reaches_every_live_cache(self) -> None:
        caches = [RoutingReplayCache(layer=i, pin_memory=False) for i in range(3)]
        for cache in caches:
            cache.record(routed(0))
        RoutingReplayCache.clear_all()
        assert [len(c) for c in caches] == [0, 0, 0]
        assert all(c.forward_index == 0 for c in caches)

    def test_discarded_caches_are_not_kept_alive(self) -> None:
        cache = RoutingReplayCache(pin_memory=False)
        ref = weakref.ref(cache)
        del cache
        gc.collect()
        assert ref() is None


class TestRoutingReplayClear:
    """The hook frees what the caches recorded: weak references to the recorded tensors die."""

    def test_clears_the_reference_cache_class(self) -> None:
        caches = [RoutingReplayCache(layer=i, pin_memory=False) for i in range(2)]
        for cache in caches:
            cache.record(routed(1))
        recorded = [weakref.ref(t) for c in caches for t in c.recorded]
        RoutingReplayClear(RoutingReplayCache)()
        gc.collect()
        assert all(r() is None for r in recorded)

    def test_clears_slime_routing_replay(self) -> None:
        layers = [SlimeRoutingReplay() for _ in range(2)]
        for layer in layers:
            layer.record(routed(3))
        recorded = [weakref.ref(t) for layer in layers for t in layer.top_indices_list]
        RoutingReplayClear(SlimeRoutingReplay)()
        gc.collect()
        assert all(r() is None for r in recorded)

    def test_clears_each_of_several_targets(self) -> None:
        ours = RoutingReplayCache(pin_memory=False)
        theirs = SlimeRoutingReplay()
        ours.record(routed(4))
        theirs.record(routed(4))
        refs = [weakref.ref(ours.recorded[0]), weakref.ref(theirs.top_indices_list[0])]
        RoutingReplayClear(
            iter([RoutingReplayCache, SlimeRoutingReplay])
        )()  # an iterator is read once, up front
        gc.collect()
        assert [r() for r in refs] == [None, None]

    def test_runs_before_the_pause_in_sleep(self) -> None:
        cache = RoutingReplayCache(pin_memory=False)
        cache.record(routed(5))
        ref = weakref.ref(cache.recorded[0])
        memory = FakeMemorySaver()
        seen_at_pause: list[bool] = []
        pause = memory.pause

        def pause_after_checking(tag: str | None = None) -> None:
            gc.collect()
            seen_at_pause.append(ref() is None)
            pause(tag)

        memory.pause = pause_after_checking  # type: ignore[method-assign]
        lifecycle = Lifecycle(
            LifecyclePolicy(use_routing_replay=True, model_tag=None),
            Hooks(memory=memory, routing_replay=RoutingReplayClear(RoutingReplayCache)),
        )
        lifecycle.sleep()
        assert seen_at_pause == [True]

    @pytest.mark.parametrize(
        ("target", "message"),
        [
            (object(), r"needs an object with clear_all\(\).*got object"),
            ([RoutingReplayCache, 3], r"\['int'\] have no clear_all\(\)"),
            ("RoutingReplay", r"got str"),
        ],
    )
    def test_bad_targets(self, target: object, message: str) -> None:
        with pytest.raises(TypeError, match=message):
            RoutingReplayClear(target)

    def test_empty_iterable(self) -> None:
        with pytest.raises(ValueError, match="empty; nothing would be cleared"):
            RoutingReplayClear([])

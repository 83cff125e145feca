"""SlimeLifecycleMixin over the slime-shaped actor: one owner per resource, and the trained weights kept.

The same class against slime's real actor source runs in test_slime_source.py (outside CI).
"""

import argparse

import pytest
import torch.distributed as dist

from actor_integration.errors import MemorySaverConfigError
from actor_integration.frameworks.slime import (
    SlimeLifecycleMixin,
    SlimeProcessGroups,
    slime_memory_backend,
)
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.errors import IllegalTransitionError, InjectedFault, LifecycleNotConfiguredError
from lifecycle.events import capture_events
from lifecycle.faults import FaultInjector, with_faults
from lifecycle.testing import FakeMemorySaver
from tests.helpers import slime_like
from tests.helpers.slime_like import LifecycleSlimeActor, PlainMixinSlimeActor
from tests.helpers.tms import preload_env

SYNC_FROM_PAUSED = ["process_groups.reload", "memory.disable", "body.sync[1]", "process_groups.destroy"]
BODY_RESOURCES = [
    ("sync", "reload_process_groups"),
    ("sync", "torch_memory_saver.disable"),
    ("sync", "destroy_process_groups"),
]


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def started(cls=LifecycleSlimeActor, **kw):
    actor = cls()
    actor.init(**kw)
    actor.calls.clear()
    return actor


class TestPlainMixinOverSlime:
    """What the issue saw: the generic mixin keeps slime's update_weights body, which owns the resources too."""

    def test_update_weights_asserts_on_the_nested_disable(self):
        actor = started(PlainMixinSlimeActor)
        with pytest.raises(AssertionError, match="disable\\(\\) should be called only when tms is active"):
            actor.update_weights()
        assert actor.pushed == []  # the weights never reached the engine


class TestOneOwnerPerResource:
    def test_update_weights_from_paused_runs_the_plan_once(self):
        actor = started()
        assert actor.update_weights() == 1
        assert actor.calls.names() == SYNC_FROM_PAUSED
        assert actor.lifecycle_stand_in_calls() == BODY_RESOURCES
        # init's sleep, then the sync plan's reload and destroy; the body's own calls added none.
        counts = (actor.tms.pause_count, actor.groups.reload_count, actor.groups.destroy_count)
        assert counts == (1, 1, 2)
        assert actor.lifecycle.state is State.PAUSED and not actor.groups.alive

    def test_update_weights_from_awake_leaves_the_groups_up(self):
        """The body's destroy_process_groups() would have torn down an awake actor's groups."""
        actor = started()
        actor.wake_up()
        actor.calls.clear()
        actor.update_weights()
        assert actor.calls.names() == ["memory.disable", "body.sync[1]"]
        assert actor.lifecycle.state is State.AWAKE and actor.groups.alive

    def test_the_module_globals_are_restored_after_the_body(self):
        actor = started()
        saver, reload = slime_like.torch_memory_saver, slime_like.reload_process_groups
        actor.update_weights()
        assert slime_like.torch_memory_saver is saver and slime_like.reload_process_groups is reload

    def test_a_body_that_pauses_memory_is_refused(self):
        class Pausing(LifecycleSlimeActor):
            def _save(self, rollout_id):
                slime_like.torch_memory_saver.pause()

        actor = started(Pausing)
        with pytest.raises(IllegalTransitionError, match=r"save body called torch_memory_saver.pause\(\)"):
            actor.save_model(1)
        # init's sleep and the save's exit plan; the body's own call paused nothing.
        assert actor.tms.pause_count == 2
        assert actor.lifecycle.state is State.PAUSED

    def test_an_adapter_for_names_the_body_no_longer_has_refuses(self):
        class Elsewhere:  # a class whose module has none of slime's resource globals
            def update_weights(self):
                return None

        class Wrapped(SlimeLifecycleMixin, Elsewhere):
            def lifecycle_config(self):
                actor = slime_like.SlimeLikeActor()
                actor.build(rank=0, offload_train=True, use_routing_replay=False)
                return slime_like.slime_lifecycle_config(actor)

        with pytest.raises(TypeError, match=r"has no globals \['destroy_process_groups'.*Update the adapter"):
            Wrapped().update_weights()


class TestTrainedWeightsSurvive:
    def test_train_sleep_wake_save_keeps_the_trained_weights(self):
        actor = started()
        actor.train(1)
        actor.sleep()
        actor.wake_up()
        actor.save_model(1)
        assert actor.saved_weights == [1] and actor.weights == 1

    def test_sync_pushes_the_trained_weights(self):
        actor = started()
        actor.train(1)
        actor.train(2)
        actor.update_weights()
        assert actor.pushed == [2]


class TestStepNumbers:
    def test_events_carry_slimes_rollout_id_from_its_train_on(self):
        """slime's `train(rollout_id)` names the step: the train (with the sleep that ends it) and the
        push after it carry it; `save_model(rollout_id=...)` sets its own; before the first train, none."""
        actor = started()  # slime's init ended asleep, before any rollout
        with capture_events() as events:
            actor.update_weights()
            actor.train(3)
            actor.update_weights()
            actor.save_model(rollout_id=4)
        moves = [
            (e["operation"], e["src"], e["dst"], e["step"])
            for e in events
            if e["event"] == "lifecycle.transition"
        ]
        assert moves == [
            ("sync", "PAUSED", "SYNCING", None),
            ("sync", "SYNCING", "PAUSED", None),
            ("train", "PAUSED", "AWAKE", 3),
            ("train", "AWAKE", "PAUSED", 3),
            ("sync", "PAUSED", "SYNCING", 3),
            ("sync", "SYNCING", "PAUSED", 3),
            ("save", "PAUSED", "SAVING", 4),
            ("save", "SAVING", "PAUSED", 4),
        ]
        assert {
            e["step"] for e in events if e["event"] == "lifecycle.body" and e["operation"] == "train"
        } == {3}


class FaultyHooksActor(LifecycleSlimeActor):
    def lifecycle_config(self):
        config = super().lifecycle_config()
        self.faults = FaultInjector()
        return {**config, "hooks": with_faults(self.faults, config["hooks"])}


class TestFullSequence:
    """init → train → save → update_weights → sleep x2 → wake x2 → injected failure → recover → train."""

    def test_sequence(self):
        actor = started(FaultyHooksActor)
        actor.train(1)
        actor.save_model(1)
        actor.update_weights()
        actor.sleep()
        actor.sleep()  # slime #1895: a no-op, not a second pause
        actor.wake_up()
        actor.wake_up()
        # Paused by init, train, save; resumed by train, save, wake.
        assert (actor.tms.pause_count, actor.tms.resume_count) == (3, 3)
        # The next pause fails after its effect: FAILED, with the truth asked of the backend on recover.
        actor.faults.arm("memory.pause", after_effect=True)
        with pytest.raises(InjectedFault):
            actor.train(2)
        assert actor.lifecycle_state()["failure"]["hook"] == "memory.pause"
        assert actor.lifecycle_recover("PAUSED")["state"] == "PAUSED"
        actor.train(3)
        assert actor.lifecycle.state is State.PAUSED
        assert (actor.saved_weights, actor.pushed, actor.weights) == ([1], [1], 3)
        assert actor.tms.paused == {"default": True} and not actor.groups.alive


class TestBackends:
    def test_memory_follows_the_launcher_environment(self):
        """RayTrainGroup sets LD_PRELOAD and TMS_INIT_ENABLE=1: preload mode, all memory as one unit."""
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        memory = slime_memory_backend(environ=env, saver=FakeMemorySaver(), cuda_major=13)
        assert memory.hook_mode == "preload" and memory.tags is None
        assert not memory.may_overlap_process_groups  # NCCL's buffers are saver memory there

    def test_retain_cpu_backup_comes_from_the_environment(self):
        env = preload_env(TMS_INIT_ENABLE="1", TMS_RETAIN_CPU_BACKUP="1")
        saver = FakeMemorySaver()
        slime_memory_backend(environ=env, saver=saver, cuda_major=13)
        assert saver.retain_cpu_backup is True

    def test_the_backup_is_retained_when_the_user_says_nothing(self):
        """slime's launcher sets no TMS_RETAIN_CPU_BACKUP: without retain every pause allocates the pinned
        backup again (5.75 s per cycle for 8.9 GiB on an H200 against 0.39 s retained)."""
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        saver = FakeMemorySaver()
        memory = slime_memory_backend(environ=env, saver=saver, cuda_major=13)
        assert saver.retain_cpu_backup is True and memory.is_backed_up()
        assert any("TMS_RETAIN_CPU_BACKUP unset; the adapter's default" in note for note in memory.notes)

    def test_a_users_choice_against_retain_is_honoured_and_said(self):
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_RETAIN_CPU_BACKUP="0")
        saver = FakeMemorySaver()
        memory = slime_memory_backend(environ=env, saver=saver, cuda_major=13)
        assert saver.retain_cpu_backup is False
        assert any("TMS_RETAIN_CPU_BACKUP='0', honoured" in note for note in memory.notes)
        assert memory.check_retained_backup() is None  # nothing retained: nothing to hold between steps

    def test_a_backup_the_host_cannot_hold_is_refused_before_the_first_pause(self, monkeypatch):
        """What torch_memory_saver will hold (the allocator's segments) x the ranks of the node, against host RAM."""
        import psutil
        import torch

        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        saver = FakeMemorySaver()
        memory = slime_memory_backend(environ=env, saver=saver, cuda_major=13)
        available = psutil.virtual_memory().available
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: available // 4 + (1 << 30))
        with pytest.raises(
            MemorySaverConfigError, match=r"GiB per rank x 4 ranks\) and .* GiB are available"
        ):
            memory.check_retained_backup(ranks_per_node=4)
        assert saver.pause_count == 0
        figures = memory.check_retained_backup(ranks_per_node=1)
        assert figures is not None and figures["backup_bytes"] == available // 4 + (1 << 30)
        assert any("host RAM checked for the retained backup" in note for note in memory.notes)

    def test_the_configured_event_says_what_was_chosen(self):
        """The retain choice is read from the run's own log, not from the code."""
        from lifecycle.testing import capture_events

        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        memory = slime_memory_backend(environ=env, saver=FakeMemorySaver(), cuda_major=13)
        with capture_events() as events:
            Lifecycle(LifecyclePolicy(), Hooks(memory=memory), rank=0, role="actor")
        (configured,) = [e for e in events if e["event"] == "lifecycle.configured"]
        assert "retain_cpu_backup=True" in configured["memory"]
        assert any("the adapter's default" in note for note in configured["memory_notes"])

    def test_process_groups_need_slimes_module(self):
        import types

        with pytest.raises(TypeError, match="lacks"):
            SlimeProcessGroups(types.ModuleType("slime.utils.reloadable_process_group"))

    def test_reload_primes_world_with_more_than_two_pipeline_stages(self, monkeypatch, one_rank_world):
        """slime's wake_up runs a WORLD barrier after the reload when PP > 2; the plan's reload does too."""
        import types

        import actor_integration.frameworks.slime.trainer as adapter

        calls = []
        module = types.ModuleType("slime.utils.reloadable_process_group")
        module.reload_process_groups = lambda: calls.append("reload")
        module.default_process_group_states = {}
        module.ReloadableProcessGroup = type("ReloadableProcessGroup", (), {"GROUPS": {}})
        module._uses_accelerator_backend = lambda backend: True
        module._new_default_process_group = lambda state, backend: None
        module.set_gloo_group = lambda group: None
        groups = SlimeProcessGroups(module)
        monkeypatch.setattr(adapter.dist, "get_backend", lambda: "gloo")
        monkeypatch.setattr(adapter.dist, "barrier", lambda **kw: calls.append("barrier"))
        for stages, expected in ((2, ["reload"]), (4, ["reload", "barrier"])):
            calls.clear()
            monkeypatch.setattr(adapter, "pipeline_parallel_size", lambda stages=stages: stages)
            groups.reload()
            assert calls == expected
        assert groups.is_alive()

    def test_a_failed_subgroup_teardown_still_leaves_slimes_stand_in_world(self, monkeypatch, one_rank_world):
        """WORLD goes down even when a subgroup's teardown raised: slime's gloo WORLD and its "destroyed"
        mark follow, so slime's reload rebuilds WORLD instead of skipping it."""
        import types

        import actor_integration.backends.process_groups._teardown as teardown

        made = []
        state = types.SimpleNamespace(
            backend="nccl", accelerator_world_destroyed=False, store=None, rank=0, world_size=1, timeout=None
        )
        module = types.ModuleType("slime.utils.reloadable_process_group")
        module.reload_process_groups = lambda: None
        module.default_process_group_states = {__import__("os").getpid(): state}
        module.ReloadableProcessGroup = type("ReloadableProcessGroup", (), {"GROUPS": {}})
        module._uses_accelerator_backend = lambda backend: True
        module.set_gloo_group = lambda group: made.append(("gloo group", group is not None))

        def new_world(state, backend):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            made.append(("world", backend))

        module._new_default_process_group = new_world
        state.store = dist.distributed_c10d._get_default_store()
        groups = SlimeProcessGroups(module)
        dist.new_group([0], backend="gloo")

        def failing(fn, items):
            items.clear()
            raise RuntimeError("a communicator's teardown failed")

        monkeypatch.setattr(teardown, "each_at_once", failing)
        with pytest.raises(RuntimeError, match="teardown failed"):
            groups.destroy()
        assert ("world", "gloo") in made and state.accelerator_world_destroyed
        assert not groups.is_alive()

    def test_the_mixin_hands_its_way_to_slimes_groups(self, monkeypatch, one_rank_world):
        """`lifecycle_communicators` on the class reaches SlimeProcessGroups: "keep" leaves WORLD and every
        wrapped group in place; a way that cannot work here is refused when the hooks are built."""
        import os
        import sys
        import types

        from lifecycle import Groups

        class Wrapper:
            def __init__(self, group):
                self.group = group

        module = types.ModuleType("slime.utils.reloadable_process_group")
        module.reload_process_groups = lambda: pytest.fail("a kept group is never rebuilt")
        module.default_process_group_states = {}
        module.ReloadableProcessGroup = type("ReloadableProcessGroup", (), {"GROUPS": {}})
        module._uses_accelerator_backend = lambda backend: True
        module._new_default_process_group = lambda state, backend: None
        module.set_gloo_group = lambda group: None
        module.ReloadableProcessGroup.GROUPS[os.getpid()] = wrappers = [Wrapper(dist.new_group([0]))]
        monkeypatch.setitem(sys.modules, "slime.utils.reloadable_process_group", module)
        actor = LifecycleSlimeActor()
        actor.build(rank=0, offload_train=True, use_routing_replay=False)
        actor.lifecycle_communicators = "keep"
        groups = SlimeLifecycleMixin.lifecycle_process_groups(actor)
        assert isinstance(groups, SlimeProcessGroups) and groups.communicators == "keep"
        group, world = wrappers[0].group, dist.distributed_c10d._get_default_group()
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
        machine.sleep()
        assert machine.groups is Groups.KEPT and wrappers[0].group is None and not groups.is_alive()
        machine.wake_up()
        assert wrappers[0].group is group and dist.distributed_c10d._get_default_group() is world
        actor.lifecycle_communicators = "suspend"
        with pytest.raises(ValueError, match=r"communicators='suspend' cannot work here: backend 'gloo'"):
            SlimeLifecycleMixin.lifecycle_process_groups(actor)

    def test_unsupported_setup_is_refused_before_any_work(self):
        actor = LifecycleSlimeActor()
        actor.build(rank=0, offload_train=True, use_routing_replay=False)
        actor.args.colocate, actor.args.use_critic = False, True
        with pytest.raises(ValueError, match="--use-critic with --offload-train and without --colocate"):
            SlimeLifecycleMixin.lifecycle_config(actor)


class SlimeActorInDebugRolloutOnly:
    """slime 624b824a's MegatronTrainRayActor under --debug-rollout-only, reduced to the path it runs:
    `init` sets `args` and returns 0 (before `role`, groups or a model); each body returns at once."""

    def init(self, args: argparse.Namespace, role: str) -> int:
        self.args = args
        return 0

    def train(self, rollout_id: int, rollout_data_ref: object, external_data: object = None) -> None:
        assert self.args.debug_rollout_only

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        assert self.args.debug_rollout_only

    def update_weights(self) -> None:
        assert self.args.debug_rollout_only


class WrappedInDebugRolloutOnly(SlimeLifecycleMixin, SlimeActorInDebugRolloutOnly):
    pass


class TestDebugRolloutOnly:
    def test_slimes_calls_run_as_slimes_own_with_no_lifecycle(self) -> None:
        """The first update_weights under the wrap raised AttributeError ('role'): slime's driver
        calls it right after creating the models."""
        actor = WrappedInDebugRolloutOnly()
        args = argparse.Namespace(debug_rollout_only=True, debug_train_only=False, offload_train=True)
        assert actor.init(args, "actor") == 0
        assert actor.update_weights() is None
        assert actor.train(0, None) is None and actor.save_model(0) is None
        assert actor.sleep() is None and actor.wake_up() is None
        assert actor._lifecycle is None
        with pytest.raises(LifecycleNotConfiguredError, match="no lifecycle under --debug-rollout-only"):
            actor.lifecycle_state()

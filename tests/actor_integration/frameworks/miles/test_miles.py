"""MilesLifecycleMixin over the miles-shaped actor: miles' tag layouts as per-tag residency, one owner per resource.

The same class against miles' real actor source runs in test_miles_source.py (outside CI); the
model check of miles' method sequences is test_miles_sequences.py.
"""

import os
import types
from argparse import Namespace
from typing import ClassVar

import pytest
import torch.distributed as dist

from actor_integration.errors import MemorySaverConfigError
from actor_integration.frameworks.miles import (
    ALL_MEMORY,
    LORA_ROLLOUT,
    REMATERIALIZE,
    MilesProcessGroups,
    check_miles_backup_fits,
    miles_memory_backend,
    miles_tag_layout,
)
from lifecycle import State
from lifecycle.errors import IllegalTransitionError, InjectedFault
from lifecycle.faults import FaultInjector, with_faults
from lifecycle.testing import FakeMemorySaver
from tests.helpers import miles_like
from tests.helpers.miles_like import CONFIGS, LifecycleMilesActor, check, machine_paused, started
from tests.helpers.tms import preload_env

SYNC_BODY = ["process_groups.reload", "memory.disable", "body.sync[1]", "process_groups.destroy"]


def fresh(config: str = "all memory", cls: type = LifecycleMilesActor) -> LifecycleMilesActor:
    actor = started(cls, config)
    actor.calls.clear()
    return actor


class TestTagLayouts:
    @pytest.mark.parametrize(
        ("flags", "role", "lora", "layout"),
        [
            ({}, "actor", False, ALL_MEMORY),
            ({"rematerialize_param_from_master_weight": True}, "actor", False, REMATERIALIZE),
            # miles' sleep keeps the params only for the actor; a critic pauses everything
            ({"rematerialize_param_from_master_weight": True}, "critic", False, ALL_MEMORY),
            ({}, "actor", True, LORA_ROLLOUT),
        ],
    )
    def test_the_layout_is_miles_own_choice(self, flags, role, lora, layout):
        assert miles_tag_layout(Namespace(**flags), role, lora_rollout=lora) is layout

    @pytest.mark.parametrize(
        ("config", "tags", "sync_requires"),
        [
            ("all memory", None, ()),
            ("rematerialize", ("grad_buffer", "default", "param_buffer"), ("param_buffer",)),
            ("lora rollout", ("default",), ()),
        ],
    )
    def test_the_policy_tracks_the_layouts_tags(self, config, tags, sync_requires):
        policy = fresh(config).lifecycle.policy
        assert (policy.memory_tags, policy.sync_requires) == (tags, sync_requires)
        # miles' train stays awake (its driver sleeps it after the save); replay data is host memory.
        assert not policy.offload_train and not policy.use_routing_replay

    def test_an_actor_module_without_miles_lora_rule_is_refused(self, monkeypatch):
        monkeypatch.delattr(miles_like, "lora_rollout_enabled")
        actor = LifecycleMilesActor()
        actor.build(miles_like.miles_args(), "actor")
        with pytest.raises(TypeError, match="has no lora_rollout_enabled"):
            actor.lifecycle_layout()


class TestPerTagResidency:
    def test_sleep_leaves_the_rematerialized_params_resident(self):
        actor = fresh("rematerialize")
        actor.wake_up()
        actor.calls.clear()
        actor.sleep()
        assert [c for c in actor.calls.names() if c.startswith("memory")] == [
            "memory.pause[grad_buffer]",
            "memory.pause[default]",
        ]
        assert actor.tms.paused == {"default": True, "grad_buffer": True, "param_buffer": False}

    def test_the_sync_releases_them_after_its_push(self):
        actor = fresh("rematerialize")
        actor.update_weights("info")
        assert actor.calls.names() == [*SYNC_BODY, "clear_memory", "memory.pause[param_buffer]"]
        assert actor.tms.paused == {"default": True, "grad_buffer": True, "param_buffer": True}
        assert actor.lifecycle_stand_in_calls()[2] == ("sync", "torch_memory_saver.pause(param_buffer)")

    def test_a_wake_resumes_only_the_released_tags(self):
        """Plain miles' resume() meets the resident params here: torch_memory_saver exits."""
        actor = fresh("rematerialize")
        actor.wake_up()
        assert [c for c in actor.calls.names() if c.startswith("memory")] == [
            "memory.resume[grad_buffer]",
            "memory.resume[default]",
        ]
        assert actor.lifecycle.state is State.AWAKE

    def test_a_sync_from_awake_keeps_the_params(self):
        """An awake actor holds all its memory; plain miles pauses the params and trains on them next."""
        actor = fresh("rematerialize")
        actor.wake_up()
        actor.update_weights("info")
        assert actor.lifecycle.state is State.AWAKE and not any(actor.tms.paused.values())
        actor.train(1)
        assert actor.params == 1

    def test_a_second_push_from_paused_is_refused_before_any_work(self):
        actor = fresh("rematerialize")
        actor.update_weights("info")
        actor.calls.clear()
        with pytest.raises(IllegalTransitionError, match=r"released after its push.*wake_up\(\) first"):
            actor.update_weights("info")
        assert actor.calls.names() == [] and actor.pushed == [0]

    def test_a_save_from_paused_keeps_the_params_for_the_next_push(self):
        actor = fresh("rematerialize")
        actor.save_model(1)
        assert actor.lifecycle.state is State.PAUSED
        assert actor.tms.paused == {"default": True, "grad_buffer": True, "param_buffer": False}
        actor.update_weights("info")
        assert actor.saved == [0] and actor.pushed == [0]

    def test_a_save_after_a_push_releases_the_params_again(self):
        """The push released the params; the save wakes (the wake rebuilds them from the master weights),
        saves and leaves every tag as it found it: the params are not held on the GPU until the next push."""
        actor = fresh("rematerialize")
        actor.update_weights("info")
        before = dict(actor.tms.paused)
        actor.calls.clear()
        actor.save_model(1)
        assert actor.lifecycle.state is State.PAUSED and actor.tms.paused == before
        assert [c for c in actor.calls.names() if c.startswith("memory.pause")] == [
            "memory.pause[grad_buffer]",
            "memory.pause[default]",
            "memory.pause[param_buffer]",
        ]
        assert actor.saved == [0] and check(actor) is None
        with pytest.raises(IllegalTransitionError, match=r"released after its push"):
            actor.update_weights("info")  # as before the save: wake first
        actor.wake_up()
        assert not any(actor.tms.paused.values()) and actor.params == 0

    def test_a_held_scope_releases_the_params_with_its_one_sleep(self):
        """A driver's held scope (one wake and one sleep per step): the push inside it asks for the
        param release as without the scope, and the scope's release makes it with the others."""
        actor = fresh("rematerialize")
        actor.lifecycle_hold()
        actor.train(1)
        actor.save_model(1)
        actor.sleep()  # deferred: the actor stays awake
        actor.update_weights("info")
        assert actor.lifecycle.state is State.AWAKE and actor.pushed == [1]
        actor.calls.clear()
        assert actor.lifecycle_release()["state"] == "PAUSED"
        assert [c for c in actor.calls.names() if c.startswith("memory.pause")] == [
            "memory.pause[grad_buffer]",
            "memory.pause[default]",
            "memory.pause[param_buffer]",
        ]
        assert machine_paused(actor.lifecycle.residency) == actor.tms.paused

    def test_lora_rollout_never_touches_the_adapters_buffers(self):
        actor = fresh("lora rollout")
        actor.train(1)
        actor.sleep()
        actor.update_weights("info")
        assert {c for c in actor.calls.names() if c.startswith("memory.")} <= {
            "memory.pause[default]",
            "memory.resume[default]",
            "memory.disable",
        }

    @pytest.mark.parametrize("config", list(CONFIGS))
    def test_the_machines_residency_is_the_savers_after_every_call(self, config):
        actor = fresh(config)
        for call in ("update_weights", "train", "save_model", "sleep", "sleep", "wake_up", "update_weights"):
            miles_like.METHODS[call](actor)
            assert machine_paused(actor.lifecycle.residency) == actor.tms.paused, call
            assert check(actor) is None, call


class TestOneOwnerPerResource:
    def test_update_weights_from_paused_runs_the_plan_once_and_passes_info_through(self):
        seen = []

        class Recording(LifecycleMilesActor):
            def update_weights(self, info=None):
                return super().update_weights(info)

        actor = fresh(cls=Recording)
        original = miles_like.MilesLikeActor.update_weights

        def body(self, info=None):
            seen.append(info)
            return original(self, info)

        miles_like.MilesLikeActor.update_weights = body
        try:
            actor.update_weights("engines and lock")
        finally:
            miles_like.MilesLikeActor.update_weights = original
        assert seen == ["engines and lock"]
        assert actor.calls.names() == SYNC_BODY
        assert actor.lifecycle_stand_in_calls() == [
            ("sync", "reload_process_groups"),
            ("sync", "torch_memory_saver.disable"),
            ("sync", "destroy_process_groups"),
        ]

    def test_miles_asleep_flag_reads_the_machine(self):
        actor = fresh("rematerialize")
        assert actor._asleep is True
        actor.wake_up()
        assert actor._asleep is False
        actor.update_weights("info")  # from AWAKE: miles' body takes its resident branch
        assert ("sync", "reload_process_groups") not in actor.lifecycle_stand_in_calls()
        actor.sleep()
        assert actor._asleep is True

    def test_a_body_pause_of_another_tag_is_refused(self):
        class PausingDefault(LifecycleMilesActor):
            def save_model(self, rollout_id):
                return super().save_model(rollout_id)

        actor = fresh("rematerialize", cls=PausingDefault)
        actor.wake_up()
        original = miles_like.MilesLikeActor.save_model
        miles_like.MilesLikeActor.save_model = lambda self, rollout_id: miles_like.torch_memory_saver.pause(
            tag="param_buffer"
        )
        try:
            with pytest.raises(IllegalTransitionError, match=r"save body called torch_memory_saver.pause"):
                actor.save_model(1)
        finally:
            miles_like.MilesLikeActor.save_model = original
        assert not any(actor.tms.paused.values())

    def test_sleep_and_wake_need_offload_train(self):
        """A typed error, still the ValueError callers caught, that says what to do; it pickles (Ray)."""
        import pickle

        from actor_integration.frameworks.miles import OffloadTrainRequiredError
        from lifecycle.errors import LifecycleError

        actor = fresh()
        actor.args.offload_train = False
        for method in ("sleep", "wake_up"):
            with pytest.raises(
                OffloadTrainRequiredError, match=r"needs --offload-train.*Launch with"
            ) as caught:
                getattr(actor, method)()
            assert isinstance(caught.value, LifecycleError) and isinstance(caught.value, ValueError)
            assert caught.value.method == method
            again = pickle.loads(pickle.dumps(caught.value))
            assert type(again) is OffloadTrainRequiredError and again.method == method


class TestMilesOwnLogsAndTimers:
    """miles' `@with_logs @timer` on sleep / wake_up and its CPU-memory metric, which the adapter's
    own sleep and wake_up replace: they run as in plain miles (MilesLikeActor carries them as miles does)."""

    def _driver(self, actor):
        """miles' train.py, colocated: the first push, then a step (train, save, offload, push)."""
        actor.update_weights("info")
        actor.train(1)
        actor.save_model(1)
        actor.sleep()
        actor.update_weights("info")
        return {k: list(v) for k, v in miles_like.MILES_LOGS.items()}

    @pytest.mark.parametrize("config", ["all memory", "rematerialize", "lora rollout"])
    def test_the_driver_order_logs_and_times_what_plain_miles_does(self, config):
        plain = self._driver(started(miles_like.MilesLikeActor, config))
        ours = self._driver(started(LifecycleMilesActor, config))
        assert (
            ours["timed"] == plain["timed"] == ["sleep", "wake_up", "sleep"]
        )  # init's, train's, the driver's
        assert [line[1:] for line in ours["logged"]] == [line[1:] for line in plain["logged"]]
        assert {line[0] for line in ours["logged"]} == {"LifecycleMilesActor"}
        assert ours["cpu_memory"] == plain["cpu_memory"] == [(1, "after_offload_train")]

    def test_a_sleep_that_releases_nothing_logs_no_memory(self):
        """A second sleep is timed (miles times its early return too); a sleep a held scope defers
        released nothing yet, so neither logs the memory after offload."""
        actor = fresh()
        actor.train(1)
        actor.sleep()
        actor.sleep()
        assert miles_like.MILES_LOGS["timed"][-2:] == ["sleep", "sleep"]
        assert miles_like.MILES_LOGS["cpu_memory"] == [(1, "after_offload_train")]
        actor.wake_up()
        actor.lifecycle_hold()
        actor.sleep()
        assert actor.lifecycle.state is State.AWAKE
        assert miles_like.MILES_LOGS["cpu_memory"] == [(1, "after_offload_train")]
        actor.lifecycle_release()

    def test_a_miles_without_them_is_refused_with_a_typed_error(self, monkeypatch):
        from actor_integration.frameworks.miles import MilesVersionError

        actor = fresh()
        actor.wake_up()
        monkeypatch.delattr(miles_like, "timer")
        with pytest.raises(MilesVersionError, match=r"has no timer, which decorate miles' sleep") as caught:
            actor.sleep()
        assert isinstance(caught.value, TypeError) and caught.value.missing == ["timer"]
        assert actor.lifecycle.state is State.AWAKE  # refused before any work


class FaultyMilesActor(LifecycleMilesActor):
    def lifecycle_hooks(self):
        self.faults = FaultInjector()
        return with_faults(self.faults, super().lifecycle_hooks())


class TestFullSequence:
    """init → train → save → update_weights → sleep x2 → wake x2 → injected failure → recover → train → save."""

    @pytest.mark.parametrize(
        ("config", "pauses", "resumes"),
        [
            # paused by the driver's sleep and the recover, resumed by train, wake, train (init's excluded)
            ("all memory", {None: 2}, {None: 3}),
            # the params: paused by the sync's release and the recover, resumed by the wakes after them
            (
                "rematerialize",
                {"grad_buffer": 2, "default": 2, "param_buffer": 2},
                {"grad_buffer": 3, "default": 3, "param_buffer": 2},
            ),
            ("lora rollout", {"default": 2}, {"default": 3}),
        ],
    )
    def test_sequence(self, config, pauses, resumes):
        actor = fresh(config, cls=FaultyMilesActor)
        actor.train(1)
        actor.save_model(1)
        actor.sleep()  # miles' driver: offload() after the save
        actor.update_weights("info")
        actor.sleep()
        actor.sleep()
        actor.wake_up()
        actor.wake_up()
        assert actor.params == 1  # the wake restored the trained params
        actor.faults.arm("process_groups.destroy")
        with pytest.raises(InjectedFault):
            actor.sleep()
        assert actor.lifecycle_state()["failure"]["hook"] == "process_groups.destroy"
        assert actor.lifecycle_recover("PAUSED")["state"] == "PAUSED"
        actor.train(2)
        actor.save_model(2)
        assert (actor.saved, actor.pushed, actor.lifecycle.state) == ([1, 2], [1], State.AWAKE)
        made = [(c[1], c[2]) for c in actor.calls.calls if c[0] == "memory" and c[1] in ("pause", "resume")]
        assert {tag: made.count(("pause", tag)) for tag in pauses} == pauses
        assert {tag: made.count(("resume", tag)) for tag in resumes} == resumes
        assert machine_paused(actor.lifecycle.residency) == actor.tms.paused


class TestBackends:
    def test_memory_follows_the_launcher_environment(self):
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        memory = miles_memory_backend(REMATERIALIZE, environ=env, saver=FakeMemorySaver(), cuda_major=13)
        assert memory.hook_mode == "preload" and memory.tags == REMATERIALIZE.memory_tags
        # Only "default" has a CPU backup: the param and grad buffers have none under --offload-train.
        assert "cpu_backup=['default']" in memory.describe()

    def test_all_memory_is_not_declared_backed_up(self):
        """A preparing pause of all memory would discard the param and grad buffers."""
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        memory = miles_memory_backend(ALL_MEMORY, environ=env, saver=FakeMemorySaver(), cuda_major=13)
        assert memory.tags is None and "cpu_backup=none" in memory.describe()

    @pytest.mark.parametrize(("given", "retained"), [(None, True), ("0", False), ("1", True)])
    def test_the_backup_is_retained_unless_the_environment_says_otherwise(self, given, retained):
        """As slime's adapter (docs/measurements.md#cpu-backup-retained-or-not-2026-12-01); a user's setting wins."""
        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        if given is not None:
            env["TMS_RETAIN_CPU_BACKUP"] = given
        saver = FakeMemorySaver()
        memory = miles_memory_backend(LORA_ROLLOUT, environ=env, saver=saver, cuda_major=13)
        assert saver.retain_cpu_backup is retained
        assert any(f"retain_cpu_backup={retained}" in note for note in memory.notes)

    @pytest.mark.parametrize(("role", "switches"), [("actor", True), ("critic", False)])
    def test_the_hooks_are_miles_own(self, role, switches):
        """miles' sleep clears host memory too; only the actor restores its params after a wake."""
        from actor_integration.backends.clear_memory import ClearMemory
        from actor_integration.frameworks.miles import MilesLifecycleMixin

        class Composed(LifecycleMilesActor):
            lifecycle_hooks = MilesLifecycleMixin.lifecycle_hooks

            def lifecycle_process_groups(self):
                return self.groups

            def lifecycle_memory(self):
                return FakeMemorySaver()

        actor = Composed()
        actor.build(miles_like.miles_args(), role)
        hooks = actor.lifecycle_hooks()
        assert isinstance(hooks.clear_memory, ClearMemory) and hooks.clear_memory.host
        assert (hooks.switch_model == actor._switch_model) is switches
        assert hooks.process_groups is actor.groups

    def test_without_offload_train_nothing_is_released(self):
        actor = LifecycleMilesActor()
        actor.build(miles_like.miles_args(), "actor")
        actor.args.offload_train = False
        from actor_integration.frameworks.miles import MilesLifecycleMixin

        assert "--offload-train is off" in MilesLifecycleMixin.lifecycle_memory(actor).describe()

    def test_the_host_check_counts_only_what_is_backed_up(self, monkeypatch):
        """The allocator's segments less Megatron's param and grad buffers (no backup under --offload-train),
        times the node's ranks, against host RAM: refused before the first pause when it cannot fit."""
        import psutil
        import torch

        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        saver = FakeMemorySaver()
        memory = miles_memory_backend(ALL_MEMORY, environ=env, saver=saver, cuda_major=13)
        available = psutil.virtual_memory().available
        buffers = types.SimpleNamespace(param_data=torch.empty(1024), grad_data=torch.empty(1024))
        model = [types.SimpleNamespace(buffers=[buffers], expert_parallel_buffers=[])]
        reserved = available // 4 + (1 << 30)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        with pytest.raises(MemorySaverConfigError, match=r"x 4 ranks\) and .* GiB are available"):
            check_miles_backup_fits(memory, model, ranks_per_node=4, environ=env)
        figures = check_miles_backup_fits(memory, model, ranks_per_node=1, environ=env)
        assert figures is not None and figures["backup_bytes"] == reserved - 2 * 1024 * 4
        assert saver.pause_count == 0
        env["TMS_INIT_ENABLE_CPU_BACKUP"] = "0"
        assert check_miles_backup_fits(memory, model, environ=env) is None  # nothing backed up

    def test_the_host_check_takes_plain_module_chunks(self, monkeypatch):
        """A model chunk that is a plain nn.Module (no DDP wrapper) has a `buffers()` method, not buffer
        lists: nothing is subtracted, and the check still runs."""
        import torch

        env = preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        memory = miles_memory_backend(ALL_MEMORY, environ=env, saver=FakeMemorySaver(), cuda_major=13)
        model = [torch.nn.Linear(4, 4)]
        assert check_miles_backup_fits(memory, model, environ=env) is None  # CUDA not initialised here
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 << 20)
        figures = check_miles_backup_fits(memory, model, ranks_per_node=1, environ=env)
        assert figures is not None and figures["backup_bytes"] == 1 << 20

    def test_process_groups_need_miles_module(self):
        with pytest.raises(TypeError, match="lacks"):
            MilesProcessGroups(types.ModuleType("miles.utils.reloadable_process_group"))


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class TestHookMode:
    """--train-memory-margin-bytes makes miles' init the saver's first use, after megatron.core's import
    left hook_mode="torch" pending: a torch-mode saver in miles' preloaded process pauses nothing."""

    def _args(self):
        args = miles_like.miles_args()
        args.train_memory_margin_bytes = 3 << 30  # miles' run_qwen3_4b.py
        return args

    def test_plain_miles_initialises_the_saver_in_torch_mode(self):
        actor = miles_like.MilesLikeActor()
        actor.init(self._args(), "actor")
        assert actor.tms.initialised_hook_mode == "torch"

    def test_the_adapter_sets_the_launchers_mode_before_miles_init(self):
        actor = LifecycleMilesActor()
        actor.init(self._args(), "actor")
        assert actor.tms.initialised_hook_mode == "preload" and actor.tms.margin == 3 << 30
        assert actor.lifecycle.state is State.PAUSED


class TestMilesProcessGroups:
    def _module(self):
        """miles' registry shape: wrappers holding `.group`, rebuilt from their arguments by reload."""
        module = types.ModuleType("miles.utils.reloadable_process_group")

        class ReloadableProcessGroup:
            GROUPS: ClassVar[dict[int, list]] = {}

            def __init__(self, ranks):
                self.group, self.ranks = dist.new_group(ranks), ranks
                self.GROUPS.setdefault(os.getpid(), []).append(self)

        def reload_process_groups():
            for wrapper in ReloadableProcessGroup.GROUPS[os.getpid()]:
                if wrapper.group is None:
                    wrapper.group = dist.new_group(wrapper.ranks)

        module.ReloadableProcessGroup = ReloadableProcessGroup
        module.reload_process_groups = reload_process_groups
        return module

    def test_destroy_frees_every_wrapped_group_and_leaves_world(self, one_rank_world):
        module = self._module()
        wrappers = [module.ReloadableProcessGroup([0]) for _ in range(3)]
        world = dist.distributed_c10d._get_default_group()
        groups = MilesProcessGroups(module)
        groups.destroy()
        assert [w.group for w in wrappers] == [None, None, None] and not groups.is_alive()
        assert len(dist.distributed_c10d._world.pg_map) == 1  # WORLD alone, as miles leaves it
        assert dist.distributed_c10d._get_default_group() is world
        groups.reload()
        assert groups.is_alive() and len(dist.distributed_c10d._world.pg_map) == 4

    def test_the_mixin_hands_its_way_to_miles_groups(self, monkeypatch, one_rank_world):
        """`lifecycle_communicators` on the class reaches MilesProcessGroups: "keep" hands every wrapper
        its own group back; an unknown way is refused when the hooks are built."""
        import sys

        from actor_integration.frameworks.miles import MilesLifecycleMixin
        from lifecycle import Groups, Hooks, Lifecycle, LifecyclePolicy

        module = self._module()
        monkeypatch.setitem(sys.modules, "miles.utils.reloadable_process_group", module)
        wrappers = [module.ReloadableProcessGroup([0]) for _ in range(2)]
        actor = LifecycleMilesActor()
        actor.build(miles_like.miles_args(), "actor")
        actor.lifecycle_communicators = "keep"
        groups = MilesLifecycleMixin.lifecycle_process_groups(actor)
        assert isinstance(groups, MilesProcessGroups) and groups.communicators == "keep"
        before = [w.group for w in wrappers]
        machine = Lifecycle(LifecyclePolicy(), Hooks(memory=FakeMemorySaver(), process_groups=groups))
        machine.sleep()
        assert machine.groups is Groups.KEPT and not groups.is_alive()
        assert [w.group for w in wrappers] == [None, None]
        machine.wake_up()
        assert [w.group for w in wrappers] == before and len(dist.distributed_c10d._world.pg_map) == 3
        actor.lifecycle_communicators = "pause"
        with pytest.raises(
            ValueError, match=r"communicators must be one of \['destroy', 'suspend', 'keep'\]"
        ):
            MilesLifecycleMixin.lifecycle_process_groups(actor)

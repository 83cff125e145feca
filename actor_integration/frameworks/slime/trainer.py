"""slime's `MegatronTrainRayActor` under the lifecycle, launched the way slime launches it.

    from actor_integration.frameworks.slime import SlimeLifecycleMixin
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.ray.actor_group import RayTrainGroup

    class LifecycleTrainer(SlimeLifecycleMixin, MegatronTrainRayActor):
        pass

    actor_model = RayTrainGroup(args, num_nodes, num_gpus_per_node, pg, actor_cls=LifecycleTrainer)

Who owns each resource (read from slime 624b824a, `slime/backends/megatron_utils/actor.py`):

- `sleep()` / `wake_up()` are the plans: clear memory (host too) → slime's `destroy_process_groups()`
  → `pause()` of all memory; `resume()` → slime's `reload_process_groups()` → slime's own
  `_switch_model("actor")`. Slime's own group functions keep the group objects Megatron cached
  valid (its wrappers re-point them), so the group count stays what plain slime has; re-running
  `initialize_model_parallel` instead (`MegatronParallelState`) would add a set per wake.
- `train()` and `save_model()` call `self.wake_up()` / `self.sleep()`: absorbed, the operation's
  plans do it.
- `update_weights()` calls `reload_process_groups()`, `torch_memory_saver.disable()` and
  `destroy_process_groups()` itself. While it runs as the sync operation those names in slime's
  actor module are the plan's: the groups are already up, memory already disabled (torch_memory_saver
  asserts on a nested `disable()`), and the exit plan destroys the groups it brought up. A body
  that pauses or resumes memory there is refused with an error.
- The model tag restored after a wake is slime's `_switch_model("actor")`, from the CPU copy
  slime refreshes after every train step: a wake never brings back older weights.
- Memory: all of it, as slime pauses it (`pause()` with no tag: every tag), in the hook mode the
  launcher's environment asks for (`RayTrainGroup` sets `LD_PRELOAD` and `TMS_INIT_ENABLE=1`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch.distributed as dist

from actor_integration.actors.mixin import LifecycleMixin
from actor_integration.backends.clear_memory import ClearMemory
from actor_integration.backends.memory_budget import DefaultStore, DeviceMemoryProbe
from actor_integration.backends.memory_saver import TorchMemorySaverBackend
from actor_integration.backends.release_audit import cuda_free_bytes
from actor_integration.backends.routing_replay import RoutingReplayClear
from actor_integration.backends.tms_env import is_true
from actor_integration.frameworks.registry_groups import RegistryProcessGroups, registry, require
from actor_integration.frameworks.slime.budget import budget_mode, rollout_need_bytes
from actor_integration.frameworks.slime.weights_check import check_mode, checked_push
from actor_integration.frameworks.stand_ins import (
    body_owner,
    pipeline_parallel_size,
    plan_owned_globals,
    stand_in_calls,
)
from actor_integration.frameworks.timer_feed import TimerFeed
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, MemoryBudget
from lifecycle.errors import LifecycleNotConfiguredError
from lifecycle.hooks import MemoryBackend, ProcessGroupsBackend
from lifecycle.table import Communicators

__all__ = [
    "SLIME_COMMIT",
    "SlimeLifecycleMixin",
    "SlimeProcessGroups",
    "slime_memory_backend",
]

SLIME_COMMIT = "624b824a"  # the slime these adapters are read from and tested against
GROUPS_MODULE = "slime.utils.reloadable_process_group"
RETAIN_VARIABLE = "TMS_RETAIN_CPU_BACKUP"


def slime_memory_backend(
    *, environ: Mapping[str, str] | None = None, saver: Any = None, cuda_major: int | None = None
) -> TorchMemorySaverBackend:
    """All of the trainer's memory as one unit, in the hook mode the environment asks for, its CPU backup retained.

    slime's launcher preloads torch_memory_saver with `TMS_INIT_ENABLE=1`, so every allocation is
    saver memory under tag "default" (CPU-backed with `TMS_INIT_ENABLE_CPU_BACKUP=1`), and slime's
    `sleep()` pauses all of it. Without retain, torch_memory_saver allocates that pinned backup in
    every pause and frees it in every resume, which costs most of a sleep + wake
    (docs/measurements.md#cpu-backup-retained-or-not-2026-12-01). So the backup is retained unless the
    user's `TMS_RETAIN_CPU_BACKUP` says otherwise (it is honoured whenever set); the first pause,
    the `sleep()` that ends slime's `init`, then allocates it once, off the step's critical path.
    `notes` says which was chosen and why.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    given = env.get(RETAIN_VARIABLE)
    retain = True if given is None else is_true(given)
    backup = is_true(env.get("TMS_INIT_ENABLE_CPU_BACKUP"))
    memory = TorchMemorySaverBackend(
        tags=None,
        cpu_backup=backup,
        hook_mode="auto",
        retain_cpu_backup=retain,
        environ=env,
        saver=saver,
        cuda_major=cuda_major,
    )
    if not backup:
        memory.notes.append(
            "TMS_INIT_ENABLE_CPU_BACKUP is off: a pause discards the trainer's memory (nothing to retain)"
        )
    elif retain and not memory.retain_cpu_backup:
        pass  # the backend noted (and logged) that this torch_memory_saver cannot retain it, and the cost
    elif given is None:
        memory.notes.append(
            f"retain_cpu_backup=True ({RETAIN_VARIABLE} unset; the adapter's default): the pinned backup is "
            "allocated by the first pause (the sleep that ends init) and reused by every later one"
        )
    else:
        memory.notes.append(
            f"retain_cpu_backup={retain} ({RETAIN_VARIABLE}={given!r}, honoured)"
            + ("" if retain else ": every pause allocates the pinned backup again and every resume frees it")
        )
    return memory


class SlimeProcessGroups(RegistryProcessGroups):
    """destroy()/reload()/is_alive() over slime's own reloadable process groups (one owner: the plans).

    The sleep frees the same communicators slime's `destroy_process_groups()` does (every wrapped
    subgroup and the accelerator WORLD, replaced by slime's temporary gloo WORLD), all at once on
    every rank between two meetings instead of torch's one-after-another shutdown (see
    `registry_groups`); the wake is slime's own `reload_process_groups()`, so the wrappers Megatron
    cached stay valid and the group count stays plain slime's. `module` is slime's
    `slime.utils.reloadable_process_group` (imported when not given). `communicators`: "suspend"
    or "keep" leave WORLD and every group in place instead (`RegistryProcessGroups`).
    """

    framework = "slime"

    def __init__(
        self,
        module: ModuleType | None = None,
        *,
        timeout: timedelta | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
    ) -> None:
        self.module = module if module is not None else importlib.import_module(GROUPS_MODULE)
        require(self.module, _SLIME_GROUP_NAMES, "SlimeProcessGroups", f"slime {SLIME_COMMIT}")
        state = self._world_state()
        super().__init__(
            store=None if state is None else state.store,
            rank=None if state is None else state.rank,
            world_size=None if state is None else state.world_size,
            timeout=timeout or (None if state is None else state.timeout),
            communicators=communicators,
            backend=None if state is None else str(state.backend),
        )

    def wrappers(self) -> list[Any]:
        """slime's registry of wrapped subgroups in this process (`ReloadableProcessGroup.GROUPS`)."""
        return registry(self.module)

    groups = wrappers

    def _world_state(self) -> Any:
        return self.module.default_process_group_states.get(os.getpid())

    def _tears_down_world(self) -> bool:
        # slime's rule: a registered accelerator WORLD goes down with the subgroups.
        state = self._world_state()
        return bool(
            state is not None
            and not state.accelerator_world_destroyed
            and self.module._uses_accelerator_backend(state.backend)
        )

    def _after_world_destroyed(self) -> None:
        # What slime's own teardown does after destroying WORLD, through its own functions: a
        # temporary gloo WORLD of the next generation, and slime's gloo group pointing at it.
        module, state = self.module, self._world_state()
        module.set_gloo_group(None)
        module._new_default_process_group(state, backend="gloo")
        module.set_gloo_group(dist.distributed_c10d._get_default_group())
        state.accelerator_world_destroyed = True

    def _reload(self) -> None:
        """slime's `reload_process_groups()`, then the WORLD barrier slime's wake_up runs with PP > 2."""
        self.module.reload_process_groups()
        # slime #2208: after a reload with PP=4 only the first stages reach the first P2P op on
        # WORLD, and NCCL's lazy init needs every rank; slime primes WORLD here.
        if pipeline_parallel_size() > 2:
            if dist.get_backend() == "nccl":
                import torch

                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()

    def is_alive(self) -> bool:
        """Whether WORLD is the accelerator one and every wrapped subgroup has a live group."""
        state = self._world_state()
        if state is not None and state.accelerator_world_destroyed:
            return False
        return super().is_alive()


_SLIME_GROUP_NAMES = (
    "ReloadableProcessGroup",
    "reload_process_groups",
    "default_process_group_states",
    "_uses_accelerator_backend",
    "_new_default_process_group",
    "set_gloo_group",
)


class SlimeLifecycleMixin(LifecycleMixin):
    """`LifecycleMixin` configured from a slime actor's own state; put it first in the bases.

    The lifecycle is built by the `self.sleep()` that ends slime's `init` (or the first wrapped
    call when `--offload-train` is off). `lifecycle_communicators` says what sleep does to the
    NCCL communicators ("destroy", "suspend" or "keep"; set it on your class). Override
    `lifecycle_memory()`, `lifecycle_process_groups()` or `lifecycle_hooks()` to change one piece.

    slime's own instrumentation stays: its `Timer` gets every sleep and wake the lifecycle runs
    (`perf/sleep_time`, `perf/wake_up_time`, also those inside train and save) and the lifecycle's
    per-plan and per-hook figures (`perf/lifecycle_*`), reported by slime's `log_perf_data` through
    its own tracking (`timer_feed`); its memory printout follows each sleep and wake. Where slime's
    bodies return at once (`--debug-rollout-only`: init built no model; `update_weights` under
    `--debug-train-only`) they run as slime's own, with no lifecycle.
    """

    lifecycle_communicators: Communicators | str = Communicators.DESTROY
    # The wrapped update_weights calls so far (the weights check leaves the first to slime's own).
    _lifecycle_pushes: int = 0

    # Set by slime's TrainRayActor.init / defined by MegatronTrainRayActor.
    args: Any
    role: str
    rollout_manager: Any
    _switch_model: Callable[[str], None]

    def configure_lifecycle(
        self, policy: LifecyclePolicy, hooks: Hooks, *, need_bytes: int | None = None, **kwargs: Any
    ) -> Lifecycle:
        """`need_bytes`: what each sleep leaves free under the policy's memory budget (`lifecycle_budget_need`)."""
        lifecycle = super().configure_lifecycle(policy, hooks, **kwargs)
        feed = self.lifecycle_timer_feed()
        if feed is not None:
            lifecycle.observe(feed)
        if need_bytes is not None:
            lifecycle.expect(need_bytes)
        return lifecycle

    def _slime_actor_globals(self) -> Mapping[str, Any]:
        """The globals of slime's actor module (its `Timer`, `print_memory`, ...)."""
        return vars(sys.modules[body_owner(self).__module__])

    def lifecycle_timer_feed(self) -> TimerFeed | None:
        """slime's `Timer` fed from the machine, and slime's memory printout after each sleep and wake
        (`print_memory("after offload model")`, `("after wake_up model")`); None where slime's actor
        module has no `Timer`."""
        namespace = self._slime_actor_globals()
        timer, print_memory = namespace.get("Timer"), namespace.get("print_memory")
        if timer is None:
            return None

        def after_plan(plan: str) -> None:
            label = {"sleep": "after offload model", "wake": "after wake_up model"}.get(plan)
            if label is not None and callable(print_memory):
                print_memory(label)

        return TimerFeed(timer, after_plan=after_plan)

    # ------------------------------------------------------------------ bodies slime skips

    def _slime_skips(self, method: str) -> bool:
        """slime's body returns at once: `--debug-rollout-only` (init returned before setting `role`
        or building a model), or `update_weights` under `--debug-train-only`."""
        args = getattr(self, "args", None)
        if getattr(args, "debug_rollout_only", False):
            return True
        return method == "update_weights" and bool(getattr(args, "debug_train_only", False))

    def sleep(self, tags: Iterable[str] | None = None) -> None:
        if self._slime_skips("sleep"):
            return None  # nothing was built, so nothing to release (slime's driver never asks here)
        return super().sleep(tags)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        if self._slime_skips("wake_up"):
            return None
        return super().wake_up(tags)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self._slime_skips("train"):
            return self._super_method("train")[0](*args, **kwargs)
        self._lifecycle_step_from(args, kwargs)
        return super().train(*args, **kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> Any:
        if self._slime_skips("save_model"):
            return self._super_method("save_model")[0](*args, **kwargs)
        self._lifecycle_step_from(args, kwargs)
        return super().save_model(*args, **kwargs)

    def _lifecycle_step_from(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """slime's `train(rollout_id, ...)` and `save_model(rollout_id, ...)` name the step: every
        lifecycle event from here on (the train, its sleep, the push after it) carries it as `step`."""
        rollout_id = kwargs.get("rollout_id", args[0] if args else None)
        if isinstance(rollout_id, int) and not isinstance(rollout_id, bool):
            self.lifecycle.step = rollout_id

    def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        if self._slime_skips("update_weights"):
            return self._super_method("update_weights")[0](*args, **kwargs)
        result = super().update_weights(*args, **kwargs)
        self._lifecycle_pushes += 1
        if self._lifecycle_checks_push():
            updater = getattr(self, "weight_updater", None)
            timer = self._slime_actor_globals().get("Timer")
            checked_push(
                lambda: super(SlimeLifecycleMixin, self).update_weights(*args, **kwargs),
                manager=self.rollout_manager,
                lead=dist.get_rank() == 0,
                version=int(getattr(updater, "weight_version", self._lifecycle_pushes)),
                timer=timer() if callable(timer) else None,
            )
        return result

    def _lifecycle_checks_push(self) -> bool:
        """`RL_LIFECYCLE_CHECK_WEIGHTS=every` (`frameworks.slime.weights_check`): the actor's pushes, but the
        first where slime's own `--check-weight-update-equal` checks it against the checkpoint."""
        if self.role != "actor" or check_mode() == "off":
            return False
        return self._lifecycle_pushes > 1 or not getattr(self.args, "check_weight_update_equal", False)

    # ------------------------------------------------------------------ configuration

    def lifecycle_config(self) -> dict[str, Any]:
        if getattr(self.args, "debug_rollout_only", False):
            raise LifecycleNotConfiguredError(
                f"{type(self).__name__} has no lifecycle under --debug-rollout-only: slime's init returned before "
                "building a model or setting the role, so there is nothing to release or restore"
            )
        _refuse_unsupported(self.args)
        return {
            "policy": self.lifecycle_policy(),
            "hooks": self.lifecycle_hooks(),
            "rank": dist.get_rank(),
            "role": self.role,
            "need_bytes": self.lifecycle_budget_need(),
        }

    def lifecycle_policy(self) -> LifecyclePolicy:
        """slime's flags (`--offload-train`, `--colocate`, `--use-routing-replay`, ...), all memory as one unit;
        a memory budget where `RL_LIFECYCLE_MEMORY_BUDGET=rollout` asks for one."""
        budget = MemoryBudget() if self.lifecycle_budget_need() is not None else None
        return LifecyclePolicy.from_args(self.args, role=self.role, memory_tags=None, memory_budget=budget)

    def lifecycle_budget_need(self) -> int | None:
        """What each sleep must leave free on this device (bytes): under `RL_LIFECYCLE_MEMORY_BUDGET=rollout`
        the colocated engines' `--sglang-mem-fraction-static` of it (`frameworks.slime.budget`); None (off:
        slime's full sleep) by default."""
        if budget_mode() == "off":
            return None
        return rollout_need_bytes(self.args, self.lifecycle_device_total_bytes())

    def lifecycle_device_total_bytes(self) -> int:
        """This rank's device memory, all of it (the engines' fraction is of this)."""
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def lifecycle_free_bytes(self) -> int | None:
        """Free bytes on this rank's device now, as the budget reads them (None: CUDA not initialised)."""
        return cuda_free_bytes()

    def lifecycle_budget_probe(self) -> DeviceMemoryProbe:
        """The budget's probe: this device's free memory, the ranks agreeing over the default group's store
        (looked up at each sleep: slime re-creates WORLD over its rendezvous store)."""
        world = dist.get_world_size()
        return DeviceMemoryProbe(
            free_bytes=self.lifecycle_free_bytes,
            store=DefaultStore() if world > 1 else None,
            rank=dist.get_rank(),
            world_size=world,
        )

    def lifecycle_memory(self) -> MemoryBackend:
        """slime's memory as one unit, its backup retained (`slime_memory_backend`), checked against host RAM."""
        memory = slime_memory_backend()
        memory.check_retained_backup(ranks_per_node=_ranks_per_node(self.args))
        return memory

    def lifecycle_process_groups(self) -> ProcessGroupsBackend:
        """slime's own groups (`SlimeProcessGroups`), their communicators treated as `lifecycle_communicators` says."""
        return SlimeProcessGroups(communicators=self.lifecycle_communicators)

    def lifecycle_hooks(self) -> Hooks:
        replay = self._slime_actor_globals().get("RoutingReplay") if self.args.use_routing_replay else None
        return Hooks(
            memory=self.lifecycle_memory(),
            process_groups=self.lifecycle_process_groups(),
            routing_replay=RoutingReplayClear(replay) if replay is not None else None,
            clear_memory=ClearMemory(host=True),  # slime's sleep: clear_memory(clear_host_memory=True)
            switch_model=self._switch_model if self.role == "actor" else None,
            budget=self.lifecycle_budget_probe() if self.lifecycle_budget_need() is not None else None,
        )

    def lifecycle_body_globals(self, operation: str) -> Mapping[str, Any]:
        return plan_owned_globals(self, operation)

    def lifecycle_stand_in_calls(self) -> list[tuple[str, str]]:
        """(operation, name) of every resource call a body made that the plans owned, oldest first."""
        return stand_in_calls(self)


def _ranks_per_node(args: Any) -> int | None:
    """The trainer ranks sharing this node's host RAM: slime's `--num-gpus-per-node`, at most the world."""
    per_node = getattr(args, "num_gpus_per_node", None)
    if not isinstance(per_node, int) or per_node < 1:
        return None
    return min(per_node, dist.get_world_size()) if dist.is_initialized() else per_node


def _refuse_unsupported(args: Any) -> None:
    offload, critic, colocate = (
        bool(getattr(args, n, False)) for n in ("offload_train", "use_critic", "colocate")
    )
    if offload and critic and not colocate:
        raise ValueError(
            "SlimeLifecycleMixin: --use-critic with --offload-train and without --colocate is not supported: slime's "
            "update_weights then calls self.wake_up() to reconnect the engines over NCCL with the model resident, "
            "while the sync plan keeps model memory paused. Use --colocate, or slime's own class for this setup."
        )

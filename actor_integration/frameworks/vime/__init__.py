"""vime's `MegatronTrainRayActor` under the lifecycle (vllm-project/vime, slime's fork on vLLM).

    from actor_integration.frameworks.vime import VimeLifecycleMixin
    from vime.backends.megatron_utils.actor import MegatronTrainRayActor

    class LifecycleTrainer(VimeLifecycleMixin, MegatronTrainRayActor):
        pass

or, with no edit of vime's source, the launch switch (`actor_integration.frameworks.vime.launch`).

vime's trainer is slime's nearly line for line, so the adapter is slime's (`SlimeLifecycleMixin`)
configured for vime. What vime's actor does differently, and how each is handled (read from the
files and commits in `VIME_FILES`; the index stores vime's files at mixed commits, each pinned):

- Its groups are `vime.utils.reloadable_process_group`, whose WORLD state names differ by commit:
  `nccl_world_destroyed` / `_uses_nccl` (3c06ae51, the one stored version with WORLD handling) and
  `accelerator_world_destroyed` / `_uses_accelerator_backend` (later vime, and slime 624b824a).
  `VimeProcessGroups` reads whichever the module has (`vime_world_names`) and refuses a module with
  neither or with half of a pair.
- Its sleep calls `reset_cuda_stack_size()` right after `torch_memory_saver.pause()` (2b83ea20):
  under the lifecycle every sleep plan (the driver's sleep and the sleeps that end train and save)
  is followed by vime's own `reset_cuda_stack_size` (`CudaStackReset`, an observer of the machine).
- It registers WORLD for teardown only with `--offload-train` and `VIME_DESTROY_WORLD_PROCESS_GROUP`
  not 0; without a registered WORLD the sleep frees the wrapped subgroups only, as vime's does.
- Its `update_weights` returns at once when no engine is updatable ("No updatable VLLM engines");
  the sync plans still bring the groups up and down around it.
- One `start_weight_update` per engine slot (vime #57): `coordinator.SlotStartGuard`, installed
  on the weight updater's engine handle after every `connect_rollout_engines` (`guard_weight_updater`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch.distributed as dist

from actor_integration.frameworks.registry_groups import RegistryProcessGroups
from actor_integration.frameworks.slime import SlimeLifecycleMixin, SlimeProcessGroups
from actor_integration.frameworks.stand_ins import body_owner
from actor_integration.frameworks.vime.coordinator import (
    DuplicateWeightUpdateStartError,
    SlotStartGuard,
    guard_weight_updater,
)
from lifecycle import Hooks, Lifecycle, LifecyclePolicy
from lifecycle.hooks import ProcessGroupsBackend
from lifecycle.logs import Event
from lifecycle.table import Communicators

__all__ = [
    "ACCELERATOR_NAMES",
    "NCCL_NAMES",
    "VIME_ACTOR_COMMIT",
    "VIME_FILES",
    "VIME_GROUPS_COMMIT",
    "CudaStackReset",
    "DuplicateWeightUpdateStartError",
    "SlotStartGuard",
    "VimeLifecycleMixin",
    "VimeProcessGroups",
    "WorldNames",
    "guard_weight_updater",
    "vime_world_names",
]

# The vime files this adapter is read from and tested against: path -> commit (the index's version).
VIME_FILES: dict[str, str] = {
    "vime/backends/megatron_utils/actor.py": "2b83ea209634051243693e8186f45f449acb4cd1",
    "vime/utils/memory_utils.py": "2b83ea209634051243693e8186f45f449acb4cd1",
    "vime/utils/reloadable_process_group.py": "3c06ae51482fab6362cf6e8bd8fa5bc9a079bea1",
    "vime/utils/distributed_utils.py": "3c06ae51482fab6362cf6e8bd8fa5bc9a079bea1",
    "vime/ray/train_actor.py": "3c06ae51482fab6362cf6e8bd8fa5bc9a079bea1",
    "vime/ray/actor_group.py": "20ad96300494c73c321f6e5a055de340fff2554d",
    "vime/utils/tensor_backper.py": "887ea48cd6d45f68e95461606c2011768bb765cc",
    "vime/observability/timer.py": "887ea48cd6d45f68e95461606c2011768bb765cc",
    # the rollout half (`rollout.py`): vime's vLLM engine actor, its groups' offload levels, its router client
    "vime/backends/vllm_utils/vllm_engine.py": "8c1c944bc44d99004f17d787a514826e1490b14a",
    "vime/backends/vllm_utils/engine_group.py": "8c1c944bc44d99004f17d787a514826e1490b14a",
    "vime/backends/vllm_utils/server_control.py": "8c1c944bc44d99004f17d787a514826e1490b14a",
}
VIME_ACTOR_COMMIT = VIME_FILES["vime/backends/megatron_utils/actor.py"][:8]
VIME_GROUPS_COMMIT = VIME_FILES["vime/utils/reloadable_process_group.py"][:8]
GROUPS_MODULE = "vime.utils.reloadable_process_group"


@dataclass(frozen=True)
class WorldNames:
    """What a reloadable_process_group module calls WORLD's "destroyed" flag and its backend rule."""

    destroyed: str  # the field of `_DefaultProcessGroupState`
    uses_backend: str  # the module function: does this backend's WORLD go down on sleep?


NCCL_NAMES = WorldNames("nccl_world_destroyed", "_uses_nccl")  # vime 3c06ae51
ACCELERATOR_NAMES = WorldNames(
    "accelerator_world_destroyed", "_uses_accelerator_backend"
)  # later vime, slime


def vime_world_names(module: ModuleType) -> WorldNames:
    """The names `module` (vime's reloadable_process_group) uses, read from the module itself."""
    state_class = getattr(module, "_DefaultProcessGroupState", None)
    fields = set(getattr(state_class, "__dataclass_fields__", {}))
    found = [n for n in (ACCELERATOR_NAMES, NCCL_NAMES) if callable(getattr(module, n.uses_backend, None))]
    found = [n for n in found if not fields or n.destroyed in fields]
    if len(found) != 1:
        raise TypeError(
            f"VimeProcessGroups: {getattr(module, '__name__', module)} has "
            + ("neither" if not found else "both")
            + f" of vime's WORLD name pairs ({NCCL_NAMES.destroyed}/{NCCL_NAMES.uses_backend} at "
            f"{VIME_GROUPS_COMMIT}, {ACCELERATOR_NAMES.destroyed}/{ACCELERATOR_NAMES.uses_backend} later): "
            "this vime lays WORLD's teardown out differently; update rl-lifecycle"
        )
    return found[0]


_VIME_GROUP_NAMES = (
    "ReloadableProcessGroup",
    "reload_process_groups",
    "default_process_group_states",
    "_new_default_process_group",
    "set_gloo_group",
)


class VimeProcessGroups(SlimeProcessGroups):
    """slime's `SlimeProcessGroups` over vime's `vime.utils.reloadable_process_group`, with its names.

    The sleep frees what vime's `destroy_process_groups()` frees (every wrapped subgroup and, when
    registered, the accelerator WORLD, replaced by vime's temporary gloo WORLD), all at once on every
    rank between two meetings; the wake is vime's own `reload_process_groups()`.
    """

    framework = "vime"

    def __init__(
        self,
        module: ModuleType | None = None,
        *,
        timeout: timedelta | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
    ) -> None:
        self.module = module if module is not None else importlib.import_module(GROUPS_MODULE)
        missing = [name for name in _VIME_GROUP_NAMES if not hasattr(self.module, name)]
        if missing:
            raise TypeError(
                f"VimeProcessGroups: {self.module.__name__} has no {missing}, which the adapter calls (written "
                f"for vime {VIME_GROUPS_COMMIT}); update rl-lifecycle"
            )
        self.names = vime_world_names(self.module)
        state = self._world_state()
        RegistryProcessGroups.__init__(
            self,
            store=None if state is None else state.store,
            rank=None if state is None else state.rank,
            world_size=None if state is None else state.world_size,
            timeout=timeout or (None if state is None else state.timeout),
            communicators=communicators,
            backend=None if state is None else str(state.backend),
        )

    def _world_destroyed(self, state: Any) -> bool:
        return bool(getattr(state, self.names.destroyed))

    def _tears_down_world(self) -> bool:
        # vime's rule: a registered WORLD of the accelerator backend goes down with the subgroups.
        state = self._world_state()
        uses_backend: Callable[[str], bool] = getattr(self.module, self.names.uses_backend)
        return bool(state is not None and not self._world_destroyed(state) and uses_backend(state.backend))

    def _after_world_destroyed(self) -> None:
        # What vime's own teardown does after destroying WORLD: a temporary gloo WORLD of the next
        # generation, and vime's gloo group pointing at it.
        module, state = self.module, self._world_state()
        module.set_gloo_group(None)
        module._new_default_process_group(state, backend="gloo")
        module.set_gloo_group(dist.distributed_c10d._get_default_group())
        setattr(state, self.names.destroyed, True)

    def is_alive(self) -> bool:
        state = self._world_state()
        if state is not None and self._world_destroyed(state):
            return False
        return RegistryProcessGroups.is_alive(self)


class CudaStackReset:
    """An observer (`Lifecycle.observe`): vime's `reset_cuda_stack_size()` after every sleep plan.

    vime's sleep calls it right after `torch_memory_saver.pause()`; under the lifecycle the pause is
    the sleep plan's last hook, so the reset follows each completed sleep plan (the driver's, and
    those that end train and save). A reset that raises (a CUDA driver error) is counted in the
    machine's `observer_errors`: the memory is already released, only the stack stays enlarged.
    """

    def __init__(self, reset: Callable[[], None]) -> None:
        self.reset = reset
        self.count = 0

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        if event == Event.TRANSITION.value and fields.get("plan") == "sleep":
            self.count += 1
            self.reset()


class VimeLifecycleMixin(SlimeLifecycleMixin):
    """`SlimeLifecycleMixin` for vime's actor; put it first in the bases.

    vime's groups (`VimeProcessGroups`), vime's `reset_cuda_stack_size()` after every sleep
    (`CudaStackReset`), and one `start_weight_update` per engine slot (vime #57, `guard_weight_updater`).
    Everything else is slime's adapter: the plans own the groups and memory inside train, save and
    update_weights; slime's flags and debug modes are vime's.
    """

    def configure_lifecycle(self, policy: LifecyclePolicy, hooks: Hooks, **kwargs: Any) -> Lifecycle:
        lifecycle = super().configure_lifecycle(policy, hooks, **kwargs)
        reset = vars(sys.modules[body_owner(self).__module__]).get("reset_cuda_stack_size")
        if callable(reset):
            self._lifecycle_stack_reset = CudaStackReset(reset)
            lifecycle.observe(self._lifecycle_stack_reset)
        return lifecycle

    def lifecycle_process_groups(self) -> ProcessGroupsBackend:
        """vime's own groups (`VimeProcessGroups`), their communicators treated as `lifecycle_communicators` says."""
        return VimeProcessGroups(communicators=self.lifecycle_communicators)

    def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        updater = getattr(self, "weight_updater", None)
        if updater is not None and not self._slime_skips("update_weights"):
            guard_weight_updater(updater)
        return super().update_weights(*args, **kwargs)

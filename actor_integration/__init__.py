"""Adapters between the lifecycle core and the outside systems: the actor mixin, Ray, torch_memory_saver,
torch.distributed, Megatron, SGLang and the weight transports (one module per system).

Names are imported lazily so that `import actor_integration` (e.g. for `lifecycle check`) pulls in
neither torch nor Ray; each is imported from its module on first use:

- actors: `LifecycleMixin`, `LifecycleNotConfiguredError` (`actor_integration.actors.mixin`)
- the driver's fan-out to Ray actors: `LifecycleGroup`, `DeadActorsError`, `GroupCallError`,
  `GroupTimeoutError`, `InconsistentGroupError` (`actor_integration.actors.ray_group`)
- across nodes: `place_slots` (each slot on one node), `gather_logs` (every node's logs in one
  directory), `NodeLostError` (`actor_integration.actors.cluster`); `NodeTopology` (the node and GPU of
  every rank and engine rank, the transport per pair of nodes: `actor_integration.weight_sync`)
- device memory: `TorchMemorySaverBackend`, `NoopMemory`, `select_memory_backend`,
  `MemorySaverConfigError`, `MemoryStateError` (`actor_integration.backends.memory_saver`),
  `validate_environment` (`actor_integration.backends.tms_env`), `AuditedMemory`
  (`actor_integration.backends.release_audit`), `ClearMemory` (`actor_integration.backends.clear_memory`),
  `DeviceMemoryProbe` (`actor_integration.backends.memory_budget`)
- hooks: `CpuWeightBackup`, `ModelTagSwitch` (`actor_integration.backends.model_tag`),
  `RoutingReplayCache`, `RoutingReplayClear` (`actor_integration.backends.routing_replay`)
- process groups: `ReloadableProcessGroups`, `GroupHandle`, `RendezvousMismatchError`,
  `RendezvousTimeoutError` (`actor_integration.backends.process_groups`), `MegatronParallelState`
  (`actor_integration.backends.megatron`)
- weight sync: `WeightSender`, `WeightReceiver`, `SlotTopology`, `configure_sender`,
  `select_transport`, `physical_gpu_id` (`actor_integration.weight_sync`)
- rollout engines: `RolloutActor`, `ReferenceEngine`, `SGLangEngine` (`actor_integration.rollout`)
"""

from __future__ import annotations

import importlib
from typing import Any

from actor_integration import _moved
from lifecycle import __version__ as __version__

_moved.install()  # 0.1's module paths keep working for one release

_EXPORTS = {
    "LifecycleMixin": "actor_integration.actors.mixin",
    "LifecycleNotConfiguredError": "actor_integration.actors.mixin",
    "LifecycleGroup": "actor_integration.actors.ray_group",
    "DeadActorsError": "actor_integration.actors.ray_group",
    "GroupCallError": "actor_integration.actors.ray_group",
    "GroupTimeoutError": "actor_integration.actors.ray_group",
    "InconsistentGroupError": "actor_integration.actors.ray_group",
    "ClearMemory": "actor_integration.backends.clear_memory",
    "AuditedMemory": "actor_integration.backends.release_audit",
    "DeviceMemoryProbe": "actor_integration.backends.memory_budget",
    "MemorySaverConfigError": "actor_integration.backends.memory_saver",
    "MemoryStateError": "actor_integration.backends.memory_saver",
    "NoopMemory": "actor_integration.backends.memory_saver",
    "TorchMemorySaverBackend": "actor_integration.backends.memory_saver",
    "select_memory_backend": "actor_integration.backends.memory_saver",
    "validate_environment": "actor_integration.backends.tms_env",
    "CpuWeightBackup": "actor_integration.backends.model_tag",
    "ModelTagSwitch": "actor_integration.backends.model_tag",
    "RoutingReplayCache": "actor_integration.backends.routing_replay",
    "RoutingReplayClear": "actor_integration.backends.routing_replay",
    "GroupHandle": "actor_integration.backends.process_groups",
    "ReloadableProcessGroups": "actor_integration.backends.process_groups",
    "RendezvousMismatchError": "actor_integration.backends.process_groups",
    "RendezvousTimeoutError": "actor_integration.backends.process_groups",
    "MegatronParallelState": "actor_integration.backends.megatron",
    "SlotTopology": "actor_integration.weight_sync",
    "WeightSender": "actor_integration.weight_sync",
    "WeightReceiver": "actor_integration.weight_sync",
    "configure_sender": "actor_integration.weight_sync",
    "select_transport": "actor_integration.weight_sync",
    "physical_gpu_id": "actor_integration.weight_sync",
    "RolloutActor": "actor_integration.rollout",
    "ReferenceEngine": "actor_integration.rollout",
    "SGLangEngine": "actor_integration.rollout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actor_integration' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The module's own names and the lazy ones, without importing them."""
    return sorted({*globals(), *_EXPORTS})

"""Adapters between the lifecycle core and the outside systems: the actor mixin, Ray, torch_memory_saver,
torch.distributed, Megatron, SGLang and the weight transports (one module per system).

Names are imported lazily so that `import actor_integration` (e.g. for `lifecycle check`) pulls in
neither torch nor Ray; each is imported from its module on first use:

- actors: `LifecycleMixin`, `LifecycleNotConfiguredError` (`actor_integration.mixin`)
- the driver's fan-out to Ray actors: `LifecycleGroup`, `DeadActorsError`, `GroupCallError`,
  `GroupTimeoutError`, `InconsistentGroupError` (`actor_integration.ray_group`)
- across nodes: `place_slots` (each slot on one node), `gather_logs` (every node's logs in one
  directory), `NodeLostError` (`actor_integration.cluster`); `NodeTopology` (the node and GPU of
  every rank and engine rank, the transport per pair of nodes: `actor_integration.weight_sync`)
- device memory: `TorchMemorySaverBackend`, `NoopMemory`, `select_memory_backend`,
  `MemorySaverConfigError`, `MemoryStateError` (`actor_integration.memory_saver`),
  `validate_environment` (`actor_integration.tms_env`), `AuditedMemory`
  (`actor_integration.release_audit`), `ClearMemory` (`actor_integration.clear_memory`)
- hooks: `CpuWeightBackup`, `ModelTagSwitch` (`actor_integration.model_tag`),
  `RoutingReplayCache`, `RoutingReplayClear` (`actor_integration.routing_replay`)
- process groups: `ReloadableProcessGroups`, `GroupHandle`, `RendezvousMismatchError`,
  `RendezvousTimeoutError` (`actor_integration.process_groups`), `MegatronParallelState`
  (`actor_integration.megatron`)
- weight sync: `WeightSender`, `WeightReceiver`, `SlotTopology`, `configure_sender`,
  `select_transport`, `physical_gpu_id` (`actor_integration.weight_sync`)
- rollout engines: `RolloutActor`, `ReferenceEngine`, `SGLangEngine` (`actor_integration.rollout`)
"""

from __future__ import annotations

import importlib
from typing import Any

from lifecycle import __version__ as __version__

_EXPORTS = {
    "LifecycleMixin": "actor_integration.mixin",
    "LifecycleNotConfiguredError": "actor_integration.mixin",
    "LifecycleGroup": "actor_integration.ray_group",
    "DeadActorsError": "actor_integration.ray_group",
    "GroupCallError": "actor_integration.ray_group",
    "GroupTimeoutError": "actor_integration.ray_group",
    "InconsistentGroupError": "actor_integration.ray_group",
    "place_slots": "actor_integration.cluster",
    "gather_logs": "actor_integration.cluster",
    "NodeLostError": "actor_integration.cluster",
    "NodeTopology": "actor_integration.weight_sync",
    "ClearMemory": "actor_integration.clear_memory",
    "AuditedMemory": "actor_integration.release_audit",
    "MemorySaverConfigError": "actor_integration.memory_saver",
    "MemoryStateError": "actor_integration.memory_saver",
    "NoopMemory": "actor_integration.memory_saver",
    "TorchMemorySaverBackend": "actor_integration.memory_saver",
    "select_memory_backend": "actor_integration.memory_saver",
    "validate_environment": "actor_integration.tms_env",
    "CpuWeightBackup": "actor_integration.model_tag",
    "ModelTagSwitch": "actor_integration.model_tag",
    "RoutingReplayCache": "actor_integration.routing_replay",
    "RoutingReplayClear": "actor_integration.routing_replay",
    "GroupHandle": "actor_integration.process_groups",
    "ReloadableProcessGroups": "actor_integration.process_groups",
    "RendezvousMismatchError": "actor_integration.process_groups",
    "RendezvousTimeoutError": "actor_integration.process_groups",
    "MegatronParallelState": "actor_integration.megatron",
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

"""The hook backends: one module per outside system a transition's hooks act on.

- `memory_saver`: device memory through torch_memory_saver (`TorchMemorySaverBackend`, `NoopMemory`);
  `tms_env` reads and checks its environment; `release_audit` verifies what a pause freed;
  `memory_budget` reads the free memory a `MemoryBudget` plans from and agrees it over the ranks.
- `process_groups`: torch.distributed groups torn down and rebuilt (`ReloadableProcessGroups`);
  `megatron` binds Megatron's parallel state to them.
- `clear_memory`, `routing_replay`, `model_tag`: the cache clear, MoE routing-replay clear and the
  model-tag restore hooks.
"""

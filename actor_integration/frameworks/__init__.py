"""One adapter per RL framework's trainer actor, side by side; what they share lives here once.

- `slime`: slime's `MegatronTrainRayActor` (`SlimeLifecycleMixin`).
- `miles`: miles' `MegatronTrainRayActor` (`MilesLifecycleMixin`), its per-tag memory layouts.
- `stand_ins`: the names a framework's bodies call resources through (its module globals
  `torch_memory_saver`, `reload_process_groups`, `destroy_process_groups`), replaced by the plans'
  while a body runs, so the machine and the body never both own a resource.
- `registry_groups`: process groups kept in a framework's own registry of reloadable wrappers,
  torn down concurrently on every rank at once and rebuilt through the framework's own reload.
- `areal`: AReaL's AWEX colocate path, one module per system (its trainer, its rollout engine,
  the driver between them).

The next framework is one module beside these.
"""

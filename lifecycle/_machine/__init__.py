"""The parts of `lifecycle.machine.Lifecycle`, one concern each: running an edge's hook plan
(`hook_runner`), held scopes (`held`), what a refusal says (`refusals`), a failure and what recover
asks the backends (`failures`), the backends' own descriptions (`backends`) and the `transitions`
machine over the table's edges (`state_machine`)."""

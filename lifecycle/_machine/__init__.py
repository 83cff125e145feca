"""The parts of `lifecycle.machine.Lifecycle`, one concern each: running an edge's hook plan
(`hook_runner`) and the `transitions` machine over the table's edges (`state_machine`)."""

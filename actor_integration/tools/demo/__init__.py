"""`lifecycle demo`: a colocated RL loop on Ray, trainer and rollout on the same devices.

Each step: generate → rollout sleeps (pause generation, flush, release tags) → trainer wakes and
trains (and sleeps again: offload_train) → checkpoint every k steps, from PAUSED → trainer sleep
(a logged no-op) → rollout wakes its weights → weight sync through the transport → rollout wakes
its KV cache → the rollout's weights are checked equal to the trainer's. On a GPU host every
trainer rank has its own GPU (NCCL refuses two ranks on one GPU) and shares it with a rollout
engine, fractional GPUs each, real torch_memory_saver and CUDA IPC; on a CPU machine gloo, a no-op
memory backend and shared memory. Per-rank JSON-lines logs, a Perfetto trace, a PNG timeline and
the `lifecycle check` verdict land in the output directory.

Modules: `options` (the command line; imports neither torch nor Ray), `placement` (Ray, devices,
the actors), `step` (one RL step and its recovery from failures and refusals), `report` (the logs
read once: the per-rank table, the check, the timeline, summary.json), `driver` (`run_demo`, the
three in order), `trainer` and `rollout` (the actors), `progress` (the console display).
"""

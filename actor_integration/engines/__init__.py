"""Rollout engines, one package each, behind the engine-agnostic interface in `rollout/`.

- `sglang`: SGLang's offline engine and its HTTP server, the in-engine receiver that loads the
  trainer's buffers in SGLang's schedulers, and a framework's SGLang engine actor (slime's, miles').
- `vllm`: vLLM's offline `LLM` and `vllm serve`, its sleep levels as tags, the guards that refuse the
  field's killers before vLLM is called, and the worker extension that receives the trainer's buffers.

An engine registers its name in `actor_integration.rollout.registry`.
"""

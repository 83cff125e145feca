"""SGLang as a rollout engine.

- `engine`: `SGLangEngine`, the `RolloutEngine` over SGLang's offline `sglang.Engine`.
- `http`: `SGLangHTTPEngine`, the same over an SGLang server's HTTP endpoints.
- `scheduler`: the calls that reach the lifecycle's receiver inside SGLang's schedulers.
- `receiver`: that receiver (SGLang's `custom_weight_loader`), run in the scheduler processes.
- `actor`: a framework's SGLang engine Ray actor (slime's, miles') under the rollout lifecycle.

Submodules are imported where they are used: importing this package loads none of them.
"""

"""Small models for tests: seeded "trained" TinyLMs and a megatron-core GPTModel."""

from __future__ import annotations

from typing import cast

import torch

from actor_integration.models.tiny import TinyLM, TinyLMConfig


def perturbed(config: TinyLMConfig, seed: int, *, scale: float, device: str = "cpu") -> TinyLM:
    """A `TinyLM` whose weights differ from a fresh one's by seeded noise: "trained" weights."""
    model = TinyLM(config).to(device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=generator) * scale).to(device=device, dtype=p.dtype))
    return model


def tiny_gpt_model(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    seed: int = 1234,
) -> torch.nn.Module:
    """A small megatron-core GPTModel on the local layer spec (no Transformer Engine), on CUDA.

    Needs CUDA and initialised model parallelism: megatron-core's attention allocates its buffer
    with `torch.cuda.current_device()` (measured with megatron-core 0.16.1 on a CPU build).
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "tiny_gpt_model needs CUDA: megatron-core's GPTModel attention allocates on "
            "torch.cuda.current_device(); run it on a GPU host"
        )
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "tiny_gpt_model: Megatron model parallelism is not initialised; build MegatronParallelState "
            "(or call initialize_model_parallel) first"
        )
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size {hidden_size} must be a multiple of num_attention_heads {num_attention_heads}"
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
    )
    return cast(torch.nn.Module, model.cuda())

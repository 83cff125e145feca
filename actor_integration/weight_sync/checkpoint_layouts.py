"""The tensors a real checkpoint sends, by name, shape and dtype: to test and measure a weight sync
on what a model's update looks like rather than on equal tensors.

    from actor_integration.weight_sync.checkpoint_layouts import LAYOUTS, layers_within, materialize, tensor_specs

    shape = LAYOUTS["moe"]  # Qwen3-30B-A3B
    specs = tensor_specs(shape, layers=layers_within(shape, 8 << 30))  # 6 layers: 2,367 tensors, 8.1 GiB
    weights = materialize(specs, "cuda")

Shapes are read from the models' public configs (`ModelShape.source`) and named as the Hugging
Face checkpoints name them, in module order (embedding, then per layer attention, norms and MLP or
experts, then the final norm and the head), which is the order a Megatron-to-HF conversion yields
them. What a real update mixes, and equal tensors do not: 256-byte q/k norms next to 47 MiB
projections, an embedding and a head larger than a 512 MiB bucket, thousands of 3 MiB experts.

`ModelShape.from_hf_config` reads any dense Qwen2/Qwen3 config.json (Qwen2: q/k/v biases, no q/k
norms), such as the repository's configs/ that SGLang serves with dummy weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actor_integration.models.qwen2 import QwenConfig

__all__ = [
    "LAYOUTS",
    "QWEN3_4B",
    "QWEN3_30B_A3B",
    "ModelShape",
    "layers_within",
    "materialize",
    "specs_nbytes",
    "tensor_specs",
]

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder checkpoint that decide its tensors (one dense or MoE MLP per layer)."""

    name: str
    source: str  # the public config the sizes come from
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0  # dense MLP width (0: every layer is MoE)
    experts: int = 0
    moe_intermediate: int = 0
    head: bool = True  # an lm_head tensor of its own (untied embeddings)
    router_bias_fp32: bool = False  # an fp32 per-expert router bias in every MoE layer
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = True  # a per-head RMSNorm of queries and keys (Qwen3)
    dtype: torch.dtype = torch.bfloat16
    note: str = ""  # where the layout departs from the config, and why

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, *, name: str | None = None) -> ModelShape:
        """The shape of a Hugging Face Qwen2/Qwen3 dense `config.json` (a mapping, the file or its
        directory), as `QwenConfig` reads and checks it; `name` defaults to the directory's name."""
        if isinstance(config, Mapping):
            parsed = QwenConfig.from_dict(config)
        else:
            parsed = QwenConfig.from_json(config)
            path = Path(config)
            name = name or (path.name if path.is_dir() else path.parent.name)
        return cls(
            name=name or parsed.model_type,
            source=parsed.source,
            hidden=parsed.hidden_size,
            layers=parsed.num_hidden_layers,
            heads=parsed.num_attention_heads,
            kv_heads=parsed.num_key_value_heads,
            head_dim=parsed.head_dim,
            vocab=parsed.vocab_size,
            intermediate=parsed.intermediate_size,
            head=not parsed.tie_word_embeddings,
            attention_bias=parsed.attention_bias,
            qk_norm=parsed.qk_norm,
            dtype=parsed.dtype,
        )


QWEN3_4B = ModelShape(
    name="Qwen3-4B",
    source="Qwen/Qwen3-4B config.json: hidden 2560, 36 layers, 32 q / 8 kv heads of 128, intermediate 9728, vocab 151936",
    hidden=2560,
    layers=36,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=151936,
    intermediate=9728,
    # Qwen3-4B ties its embeddings (tie_word_embeddings: true); its larger siblings (8B and up) do
    # not. The layout sends a head of its own, so two tensors (742 MiB each) exceed a 512 MiB bucket.
    note="lm_head untied (Qwen3-4B ties it; Qwen3-8B and larger do not), so two 742 MiB tensors exceed a bucket",
)

QWEN3_30B_A3B = ModelShape(
    name="Qwen3-30B-A3B",
    source=(
        "Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of "
        "moe_intermediate 768, vocab 151936, untied embeddings"
    ),
    hidden=2048,
    layers=48,
    heads=32,
    kv_heads=4,
    head_dim=128,
    vocab=151936,
    experts=128,
    moe_intermediate=768,
    # Qwen3-MoE checkpoints are bf16 throughout. DeepSeek-V3-style routers keep a per-expert
    # correction bias in fp32 (`e_score_correction_bias`); the layout adds one per layer so that an
    # update mixes dtypes as such checkpoints do (512-byte fp32 tensors among bf16 ones).
    router_bias_fp32=True,
    note="an fp32 router bias per layer added (DeepSeek-V3 style; Qwen3-MoE is bf16 throughout) to mix dtypes",
)

LAYOUTS: dict[str, ModelShape] = {"dense": QWEN3_4B, "moe": QWEN3_30B_A3B}


def _layer(shape: ModelShape, i: int) -> list[TensorSpec]:
    p, h, d = f"model.layers.{i}.", shape.hidden, shape.dtype
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs: list[TensorSpec] = [(p + "input_layernorm.weight", (h,), d)]
    for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
        specs.append((f"{p}self_attn.{proj}.weight", (width, h), d))
        if shape.attention_bias:
            specs.append((f"{p}self_attn.{proj}.bias", (width,), d))
    if shape.qk_norm:
        specs += [
            (p + "self_attn.q_norm.weight", (shape.head_dim,), d),
            (p + "self_attn.k_norm.weight", (shape.head_dim,), d),
        ]
    specs += [
        (p + "self_attn.o_proj.weight", (h, q_width), d),
        (p + "post_attention_layernorm.weight", (h,), d),
    ]
    if not shape.experts:
        width = shape.intermediate
        specs += [
            (p + "mlp.gate_proj.weight", (width, h), d),
            (p + "mlp.up_proj.weight", (width, h), d),
            (p + "mlp.down_proj.weight", (h, width), d),
        ]
        return specs
    specs.append((p + "mlp.gate.weight", (shape.experts, h), d))
    if shape.router_bias_fp32:
        specs.append((p + "mlp.gate.e_score_correction_bias", (shape.experts,), torch.float32))
    width = shape.moe_intermediate
    for e in range(shape.experts):
        q = f"{p}mlp.experts.{e}."
        specs += [
            (q + "gate_proj.weight", (width, h), d),
            (q + "up_proj.weight", (width, h), d),
            (q + "down_proj.weight", (h, width), d),
        ]
    return specs


def tensor_specs(shape: ModelShape, *, layers: int | None = None) -> list[TensorSpec]:
    """(name, shape, dtype) of every tensor of the checkpoint, with its first `layers` layers
    (default: all of them), in module order."""
    count = shape.layers if layers is None else layers
    if not 1 <= count <= shape.layers:
        raise ValueError(f"{shape.name} has {shape.layers} layers; layers={layers!r} is out of range")
    h, d = shape.hidden, shape.dtype
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (shape.vocab, h), d)]
    for i in range(count):
        specs += _layer(shape, i)
    specs.append(("model.norm.weight", (h,), d))
    if shape.head:
        specs.append(("lm_head.weight", (shape.vocab, h), d))
    return specs


def specs_nbytes(specs: Sequence[TensorSpec]) -> int:
    """The bytes of the tensors the specs describe."""
    total = 0
    for _name, dims, dtype in specs:
        numel = 1
        for n in dims:
            numel *= n
        total += numel * dtype.itemsize
    return total


def layers_within(shape: ModelShape, nbytes: int, *, over: float = 0.05) -> int:
    """The most layers (at least 1, at most the model's) whose checkpoint stays within `nbytes`
    plus `over` of it: an update of a given size class with the model's own tensors (the
    Qwen3-4B layout is whole at 8 GiB; Qwen3-30B-A3B has 6 of its 48 layers)."""
    fixed = specs_nbytes(tensor_specs(shape, layers=1))
    per_layer = specs_nbytes(_layer(shape, 0))
    fixed -= per_layer
    count = int((nbytes * (1 + over) - fixed) // per_layer)
    return max(1, min(shape.layers, count))


def materialize(
    specs: Sequence[TensorSpec], device: torch.device | str, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random tensors of the given specs on `device` (normal values, cast to each dtype)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dims, dtype in specs:
        values = torch.randn(dims, generator=g, device=device, dtype=torch.float32)
        out[name] = values if dtype == torch.float32 else values.to(dtype)
        del values
    return out

"""A Megatron layer spec for dense GPT models without Transformer Engine or apex, for slime's `--spec`.

slime (624b824a) builds its model from `--spec MODULE FUNCTION` when given
(`slime/backends/megatron_utils/model_provider.py` calls `FUNCTION(args, config, vp_stage)`). Megatron's
own local spec does not serve it: its core attention asserts that sequences are not packed, and slime
always packs them (THD, `PackedSeqParams`); its layers name their norms `input_layernorm` and
`pre_mlp_layernorm`, which slime's qwen2 converters (Megatron to HF for the weight push, HF to Megatron
for `--ref-load` of an HF directory) refuse; and slime calls it without `normalization`, so an RMSNorm
model would get LayerNorms. This spec keeps Megatron's local layer and changes three things:

- the QKV and FC1 linears carry the norm in front of them with Transformer Engine's parameter name
  (`layer_norm_weight`, `layer_norm_bias` for LayerNorm), as TE's `LayerNormColumnParallelLinear` does,
  and the layer's own norms are identities;
- core attention is torch's scaled-dot-product attention, per packed sequence in THD (the
  `cu_seqlens` of `PackedSeqParams`; the padding between a sequence's end and its padded end attends
  to nothing and comes out zero) and with the causal mask in the unpacked layout; grouped-query heads
  are repeated to the query heads;
- the norms follow the model's `normalization` (RMSNorm or LayerNorm) and epsilon.

Use: `--transformer-impl local --spec actor_integration.models.megatron_spec gpt_layer_spec`, with
Megatron's fusions off (`--no-rope-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion
--no-bias-dropout-fusion --no-masked-softmax-fusion`). Dense models only: MoE, multi-latent attention and
context parallelism are refused with a message before any model is built. It exists so that slime's own
job runs on a machine without Transformer Engine (`scripts/slime_e2e.sh`); it is not tuned for speed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


class NormColumnParallelLinear(ColumnParallelLinear):  # type: ignore[misc]  # megatron ships no types
    """`ColumnParallelLinear` with the layer's norm in front, its weight named `layer_norm_weight`
    (and `layer_norm_bias` for LayerNorm) as in Transformer Engine's fused layer, so that checkpoints
    and converters that know TE's names take it. The norm runs in float32 and returns the input's
    dtype; with sequence parallelism its parameters are marked for the gradient all-reduce as
    Megatron marks its own norms'."""

    def __init__(
        self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any
    ) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"NormColumnParallelLinear: normalization {config.normalization!r} is not supported; "
                f"use one of {list(NORMALIZATIONS)}"
            )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        dtype = config.params_dtype
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma(input_size, dtype=dtype))
        self.layer_norm_bias: torch.nn.Parameter | None = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm alone (tests compare it with torch's)."""
        h = x.float()
        weight = self.layer_norm_weight.float()
        if self.zero_centered_gamma:
            weight = weight + 1
        if self.normalization == "RMSNorm":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * weight).to(x.dtype)
        bias = None if self.layer_norm_bias is None else self.layer_norm_bias.float()
        return F.layer_norm(h, (h.shape[-1],), weight, bias, self.eps).to(x.dtype)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().forward(self.norm(input_), *args, **kwargs)


class PackedSDPA(MegatronModule):  # type: ignore[misc]
    """Core attention on `torch.nn.functional.scaled_dot_product_attention`, taking what Megatron's
    `SelfAttention` hands its core attention: `[t, np, hn]` per packed batch with THD
    `PackedSeqParams` (each sequence attends causally within itself), or `[sq, b, np, hn]` unpacked.
    Returns `[t, np * hn]` or `[sq, b, np * hn]`."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("PackedSDPA: context parallelism is not supported; use context_parallel_size 1")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedSDPA: attention_bias is not supported")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [sq, b, np, hn] -> [b, np, sq, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        k, v = _repeat_groups(k, q.shape[1]), _repeat_groups(v, q.shape[1])
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=self.softmax_scale
        )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, dropout: float
    ) -> torch.Tensor:
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        starts = padded.tolist()
        lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
        out = query.new_zeros(query.shape)
        for start, length in zip(starts[:-1], lengths, strict=True):
            if length == 0:
                continue
            # [L, np, hn] -> [np, L, hn]
            q = query[start : start + length].transpose(0, 1)
            k = _repeat_groups(key[start : start + length].transpose(0, 1), q.shape[0])
            v = _repeat_groups(value[start : start + length].transpose(0, 1), q.shape[0])
            seg = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale
            )
            out[start : start + length] = seg.transpose(0, 1)
        return out.reshape(query.shape[0], -1)


def _repeat_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads (dim -3) repeated to the query heads for grouped-query attention."""
    groups = t.shape[-3]
    if heads % groups:
        raise ValueError(f"PackedSDPA: {heads} query heads are not a multiple of {groups} key/value groups")
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=-3)


def gpt_layer_spec(args: Any, config: TransformerConfig, vp_stage: int | None = None) -> ModuleSpec:
    """slime's `--spec` function: Megatron's local GPT layer with the norm in the QKV and FC1 linears
    and `PackedSDPA` as core attention. Refuses what it does not build before any model exists."""
    refused = [
        what
        for what, on in (
            ("MoE (--num-experts)", getattr(args, "num_experts", None)),
            ("multi-latent attention", getattr(args, "multi_latent_attention", False)),
            ("context parallelism", config.context_parallel_size > 1),
        )
        if on
    ]
    if config.normalization not in NORMALIZATIONS:
        refused.append(f"normalization {config.normalization!r}")
    if refused:
        raise ValueError(
            f"actor_integration.models.megatron_spec.gpt_layer_spec builds dense GPT layers only; "
            f"{', '.join(refused)} asked for. Use Transformer Engine's spec for these, or drop the flag."
        )
    spec = get_gpt_layer_local_spec(
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)), normalization=config.normalization
    )
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    if hasattr(layer, "sharded_state_dict_keys_map"):
        layer.sharded_state_dict_keys_map = {}  # the norms' names are already TE's
    attention = layer.self_attention.submodules
    attention.linear_qkv = NormColumnParallelLinear
    attention.core_attention = PackedSDPA
    layer.mlp.submodules.linear_fc1 = NormColumnParallelLinear
    return spec

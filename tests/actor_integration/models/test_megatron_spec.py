"""The Megatron layer spec without Transformer Engine (`actor_integration.models.megatron_spec`), on CPU.

A megatron-core GPTModel built from it: its parameters carry Transformer Engine's names; packed (THD)
sequences give the logits each sequence gives alone; its logits equal the project's Qwen2 model's
(`QwenLM`, Hugging Face's names and maths) on the same weights; what it does not build is refused
before a model exists. With slime's source (`RL_LIFECYCLE_SLIME_SOURCE`), slime's own qwen2 converters
map every parameter both ways and the HF side they produce is the model that gives the same logits.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from actor_integration.models.qwen2 import QwenConfig, QwenLM

HIDDEN, HEADS, GROUPS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 101
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def megatron() -> Iterator[Any]:
    """World size 1 over gloo, Megatron's groups, and the one CUDA call of megatron-core's rotary
    embedding (it moves `inv_freq` to `torch.cuda.current_device()` at its first forward) on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    owned = not dist.is_initialized()
    if owned:
        from tests.helpers.framework_source import free_port

        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield ps
    ps.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()
    mp.undo()


def config(**overrides: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    values: dict[str, Any] = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**(values | overrides))


def slime_like_args(**overrides: Any) -> types.SimpleNamespace:
    values = dict(
        num_experts=None,
        multi_latent_attention=False,
        qk_layernorm=False,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
    )
    return types.SimpleNamespace(**(values | overrides))


def gpt(cfg: Any, seed: int = 0) -> Any:
    from megatron.core.models.gpt import GPTModel

    from actor_integration.models.megatron_spec import gpt_layer_spec

    torch.manual_seed(seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=gpt_layer_spec(slime_like_args(), cfg),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    )
    with torch.no_grad():  # norms away from 1, so a norm left out or applied twice shows
        for name, param in model.named_parameters():
            if "layer_norm" in name or "final_layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape))
    return model.eval()


def logits(
    model: Any, tokens: torch.Tensor, packed: Any = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    if positions is None:
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=None, packed_seq_params=packed)


def packed_params(lengths: list[int], padded: list[int] | None = None) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    def cumulative(values: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(values).cumsum(0).tolist()], dtype=torch.int32)

    cu = cumulative(lengths)
    cu_padded = None if padded is None else cumulative(padded)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded or lengths),
        max_seqlen_kv=max(padded or lengths),
    )


def test_parameters_carry_transformer_engines_names(megatron: Any) -> None:
    names = [name for name, _ in gpt(config()).named_parameters()]
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        layer_names = sorted(n[len(prefix) :] for n in names if n.startswith(prefix))
        assert layer_names == [
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.bias",
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.weight",
        ]
    assert "decoder.final_layernorm.weight" in names
    assert not [n for n in names if "input_layernorm" in n or "pre_mlp_layernorm" in n]


def test_packed_sequences_give_each_sequences_own_logits(megatron: Any) -> None:
    model = gpt(config())
    torch.manual_seed(1)
    a, b, c = (torch.randint(0, VOCAB, (1, n)) for n in (5, 9, 3))
    alone = [logits(model, t) for t in (a, b, c)]
    packed = logits(
        model,
        torch.cat([a, b, c], dim=1),
        packed_params([5, 9, 3]),
        torch.cat([torch.arange(n) for n in (5, 9, 3)]).unsqueeze(0),
    )
    for got, want in zip(packed.split([5, 9, 3], dim=1), alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the same batch attending across sequences (one causal sequence) differs: the split is real
    whole = logits(model, torch.cat([a, b, c], dim=1))
    assert not torch.allclose(whole[:, 5:14], alone[1], atol=1e-3)


def test_padding_between_packed_sequences_is_left_out(megatron: Any) -> None:
    """slime pads each sequence to a multiple (cu_seqlens_q_padded); the pads attend to nothing."""
    model = gpt(config())
    torch.manual_seed(2)
    a, b = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 6))
    pad = torch.zeros(1, 3, dtype=torch.long)
    tokens = torch.cat([a, pad, b, pad[:, :2]], dim=1)
    positions = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    out = logits(model, tokens, packed_params([5, 6], padded=[8, 8]), positions)
    torch.testing.assert_close(out[:, :5], logits(model, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 8:14], logits(model, b), rtol=1e-5, atol=1e-5)


def qwen_from_megatron(model: Any) -> QwenLM:
    """The project's Qwen2 model (Hugging Face's parameter names and maths) on the GPTModel's weights:
    the QKV rows are per group [q heads of the group, k, v], FC1 is [gate; up]."""
    cfg = QwenConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "intermediate_size": FFN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": GROUPS,
            "vocab_size": VOCAB,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 64,
            "torch_dtype": "float32",
        }
    )
    qwen = QwenLM(cfg)
    source = dict(model.named_parameters())
    hf: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": source["embedding.word_embeddings.weight"],
        "lm_head.weight": source["output_layer.weight"],
        "model.norm.weight": source["decoder.final_layernorm.weight"],
    }
    per_group = HEADS // GROUPS
    for i in range(LAYERS):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = source[p + "self_attention.linear_qkv.weight"].view(GROUPS, per_group + 2, HEAD_DIM, HIDDEN)
        bias = source[p + "self_attention.linear_qkv.bias"].view(GROUPS, per_group + 2, HEAD_DIM)
        for name, part in (("q", slice(0, per_group)), ("k", slice(per_group, per_group + 1))):
            hf[h + f"self_attn.{name}_proj.weight"] = qkv[:, part].reshape(-1, HIDDEN)
            hf[h + f"self_attn.{name}_proj.bias"] = bias[:, part].reshape(-1)
        hf[h + "self_attn.v_proj.weight"] = qkv[:, per_group + 1 :].reshape(-1, HIDDEN)
        hf[h + "self_attn.v_proj.bias"] = bias[:, per_group + 1 :].reshape(-1)
        hf[h + "self_attn.o_proj.weight"] = source[p + "self_attention.linear_proj.weight"]
        hf[h + "input_layernorm.weight"] = source[p + "self_attention.linear_qkv.layer_norm_weight"]
        gate, up = source[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"] = gate, up
        hf[h + "mlp.down_proj.weight"] = source[p + "mlp.linear_fc2.weight"]
        hf[h + "post_attention_layernorm.weight"] = source[p + "mlp.linear_fc1.layer_norm_weight"]
    missing, unexpected = qwen.load_state_dict({k: v.detach().clone() for k, v in hf.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return qwen.eval()


def qwen_logits(qwen: QwenLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = qwen(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_logits_equal_qwen2s_on_the_same_weights(megatron: Any) -> None:
    model = gpt(config())
    torch.manual_seed(3)
    tokens = torch.randint(0, VOCAB, (1, 11))
    torch.testing.assert_close(
        logits(model, tokens), qwen_logits(qwen_from_megatron(model), tokens), rtol=1e-4, atol=1e-4
    )


def test_layernorm_models_get_layernorms_with_a_bias(megatron: Any) -> None:
    from actor_integration.models.megatron_spec import NormColumnParallelLinear

    model = gpt(config(normalization="LayerNorm", layernorm_epsilon=1e-5))
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias" in names
    linear = model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(linear, NormColumnParallelLinear)
    x = torch.randn(3, 1, HIDDEN)
    want = torch.nn.functional.layer_norm(
        x, (HIDDEN,), linear.layer_norm_weight, linear.layer_norm_bias, 1e-5
    )
    torch.testing.assert_close(linear.norm(x), want)


@pytest.mark.parametrize(
    ("args", "overrides", "said"),
    [
        ({"num_experts": 8}, {}, "MoE"),
        ({"multi_latent_attention": True}, {}, "multi-latent attention"),
        ({}, {"normalization": "L2Norm"}, "normalization 'L2Norm'"),
    ],
)
def test_what_it_does_not_build_is_refused_before_a_model(
    megatron: Any, args: dict[str, Any], overrides: dict[str, Any], said: str
) -> None:
    from actor_integration.models.megatron_spec import gpt_layer_spec

    cfg = types.SimpleNamespace(context_parallel_size=1, normalization="RMSNorm") if overrides else config()
    if overrides:
        cfg.__dict__.update(overrides)
    with pytest.raises(ValueError, match=said) as raised:
        gpt_layer_spec(slime_like_args(**args), cfg)
    assert "dense GPT layers only" in str(raised.value)


@pytest.fixture(scope="module")
def slime_converters() -> Any:
    """slime's own qwen2 converter (Megatron to HF, what its weight push runs), from its source."""
    from tests.helpers.slime_source import SlimeSource, SlimeSourceUnavailable

    try:
        source = SlimeSource.find()
    except SlimeSourceUnavailable as exc:
        pytest.skip(str(exc))
    namespace: dict[str, Any] = {}
    code = source.read("slime/backends/megatron_utils/megatron_to_hf/qwen2.py")
    exec(compile(code, "slime/backends/megatron_utils/megatron_to_hf/qwen2.py", "exec"), namespace)
    return namespace["convert_qwen2_to_hf"]


def test_slimes_converter_maps_every_parameter_to_the_model_that_gives_the_same_logits(
    megatron: Any, slime_converters: Any
) -> None:
    model = gpt(config())
    converted: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        pairs = slime_converters(slime_like_args(), f"module.module.{name}", param.detach())
        assert pairs, f"slime's qwen2 converter has no HF name for {name}"
        converted.update(pairs)
    qwen = qwen_from_megatron(model)
    want = {k: v for k, v in qwen.state_dict().items() if "rotary" not in k}
    assert sorted(converted) == sorted(want)
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, want[name], msg=name)

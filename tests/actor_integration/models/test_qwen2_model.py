"""QwenLM: Hugging Face's Qwen2/Qwen3 names, shapes and logits; its config's checks; seeded init."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from actor_integration.models.qwen2 import QwenConfig, QwenLM

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def small(model_type: str = "qwen2", *, tied: bool = True, **overrides: Any) -> dict[str, Any]:
    """A config.json dict of a few-thousand-parameter model; qwen3's head_dim is not hidden/heads."""
    data: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "Qwen3ForCausalLM"],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 61,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 128,
        "torch_dtype": "float32",
    }
    if model_type == "qwen3":
        data |= {"head_dim": 16, "attention_bias": False}
    return data | overrides


def model(data: dict[str, Any], seed: int = 0, **kwargs: Any) -> QwenLM:
    return QwenLM(QwenConfig.from_dict(data), seed=seed, **kwargs)


def hf_names(
    model_type: str,
    *,
    tied: bool,
    layers: int,
    heads: int,
    kv: int,
    hd: int,
    hidden: int,
    width: int,
    vocab: int,
) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes of transformers' Qwen2/Qwen3ForCausalLM, written out."""
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (width, hidden),
            p + "mlp.up_proj.weight": (width, hidden),
            p + "mlp.down_proj.weight": (hidden, width),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if model_type == "qwen2":
            names |= {
                p + "self_attn.q_proj.bias": (heads * hd,),
                p + "self_attn.k_proj.bias": (kv * hd,),
                p + "self_attn.v_proj.bias": (kv * hd,),
            }
        else:
            names |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    names["model.norm.weight"] = (hidden,)
    if not tied:
        names["lm_head.weight"] = (vocab, hidden)
    return names


class TestNames:
    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    @pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
    def test_parameters_are_named_and_shaped_as_hugging_face_names_them(
        self, model_type: str, tied: bool
    ) -> None:
        hd = 8 if model_type == "qwen2" else 16
        expected = hf_names(
            model_type, tied=tied, layers=2, heads=4, kv=2, hd=hd, hidden=32, width=48, vocab=61
        )
        weights = model(small(model_type, tied=tied)).named_weights()
        assert {name: tuple(t.shape) for name, t in weights.items()} == expected

    def test_the_tiny_config_is_a_qwen2_of_head_dim_64_in_bfloat16(self) -> None:
        config = QwenConfig.from_json(CONFIGS / "qwen2-tiny")
        weights = QwenLM(config).named_weights()
        assert config.head_dim == 64 and config.attention_bias and not config.qk_norm
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}
        assert weights["model.layers.3.self_attn.k_proj.bias"].shape == (128,)
        assert "lm_head.weight" not in weights

    def test_the_repo_configs_build_on_the_meta_device_without_allocating(self) -> None:
        with torch.device("meta"):
            big = QwenLM(QwenConfig.from_json(CONFIGS / "qwen2-7b"))
        weights = big.named_weights()
        assert all(t.is_meta for t in weights.values())
        assert sum(t.numel() for t in weights.values()) == 7_615_616_512
        assert weights["lm_head.weight"].shape == (152064, 3584)

    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_tied_logits_read_the_embedding_matrix_and_untied_ones_the_head(self, tied: bool) -> None:
        net, tokens = model(small(tied=tied)), torch.tensor([1, 2, 3])
        before = net(tokens).detach()
        with torch.no_grad():
            net.model.embed_tokens.weight[5].add_(1.0)  # token 5 is not in the input
        changed = (net(tokens).detach() != before).any(dim=0).nonzero().flatten().tolist()
        assert changed == ([5] if tied else [])


class TestConfig:
    def test_qwen2_derives_head_dim_and_qwen3_reads_it(self) -> None:
        assert QwenConfig.from_dict(small("qwen2")).head_dim == 8
        assert QwenConfig.from_dict(small("qwen3")).head_dim == 16

    def test_the_0_5b_config_is_the_shared_engine_config(self) -> None:
        config = QwenConfig.from_json(CONFIGS / "qwen2-0.5b" / "config.json")
        assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (896, 24, 64)
        assert config.rope_theta == 1e6 and config.tie_word_embeddings

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"num_key_value_heads": 3}, r"num_key_value_heads=3 does not divide num_attention_heads=4"),
            ({"hidden_size": 30}, r"hidden_size=30 is not divisible by num_attention_heads=4.*set head_dim"),
            ({"model_type": "llama"}, r"unknown model_type='llama'.*'qwen2' or 'qwen3'"),
            ({"architectures": ["Qwen3ForCausalLM"]}, r"does not match model_type='qwen2'.*Qwen2ForCausalLM"),
            ({"vocab_size": 0}, r"vocab_size=0 must be a positive int"),
            ({"num_hidden_layers": 2.0}, r"num_hidden_layers=2.0 must be a positive int"),
            ({"torch_dtype": "int8"}, r"torch_dtype='int8' is not one of float32, bfloat16, float16"),
            ({"use_sliding_window": True}, r"use_sliding_window=True is not supported; .* set it false"),
            ({"rope_scaling": {"type": "yarn"}}, r"rope_scaling=.* is not supported"),
            ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
            ({"rope_parameters": {"rope_type": "yarn"}}, r"rope_parameters=.*yarn.* is not supported"),
            ({"num_attention_heads": "4"}, r"num_attention_heads='4' must be a positive int"),
        ],
    )
    def test_a_bad_field_is_refused_naming_the_field_and_the_value(
        self, overrides: dict[str, Any], message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            QwenConfig.from_dict(small() | overrides)

    def test_missing_fields_are_listed_together(self) -> None:
        data = {k: v for k, v in small("qwen3").items() if k not in ("head_dim", "rope_theta")}
        with pytest.raises(ValueError, match=r"missing 'rope_theta', 'head_dim'"):
            QwenConfig.from_dict(data)

    def test_qwen3_with_attention_biases_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"attention_bias=True is not supported"):
            QwenConfig.from_dict(small("qwen3", attention_bias=True))

    def test_errors_from_a_file_name_the_file(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text(json.dumps(small(num_attention_heads=5)))
        with pytest.raises(ValueError, match=rf"{tmp_path}/config.json: hidden_size=32 is not divisible"):
            QwenConfig.from_json(tmp_path)

    def test_transformers_5_keys_are_read(self) -> None:
        data = {k: v for k, v in small().items() if k not in ("rope_theta", "torch_dtype")}
        data |= {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "dtype": "bfloat16"}
        config = QwenConfig.from_dict(data)
        assert config.rope_theta == 5e5 and config.dtype == torch.bfloat16


class TestInit:
    def test_equal_seeds_give_equal_weights_and_others_differ(self) -> None:
        a, b, c = (model(small("qwen3"), seed=s).named_weights() for s in (7, 7, 8))
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])

    def test_the_global_rng_is_untouched(self) -> None:
        state = torch.random.get_rng_state()
        model(small())
        assert torch.equal(torch.random.get_rng_state(), state)

    def test_norms_are_ones_biases_zeros_and_matrices_small(self) -> None:
        weights = model(small()).named_weights()
        assert torch.equal(weights["model.norm.weight"], torch.ones(32))
        assert torch.equal(weights["model.layers.1.self_attn.q_proj.bias"], torch.zeros(32))
        std = float(weights["model.embed_tokens.weight"].std())
        assert 0.017 < std < 0.023

    def test_a_dtype_override_keeps_the_drawn_values(self) -> None:
        fp32 = model(small()).named_weights()
        bf16 = model(small(), dtype=torch.bfloat16).named_weights()
        assert all(torch.equal(bf16[n], fp32[n].to(torch.bfloat16)) for n in fp32)


class TestUse:
    def test_a_batch_gives_the_logits_of_each_sequence(self) -> None:
        net = model(small("qwen3"))
        tokens = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(0))
        batched = net(tokens)
        assert batched.shape == (3, 10, 61)
        torch.testing.assert_close(batched[1], net(tokens[1]), rtol=1e-5, atol=1e-6)

    def test_the_logits_are_causal(self) -> None:
        net = model(small())
        tokens = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(1))
        changed = tokens.clone()
        changed[8:] = (changed[8:] + 1) % 61
        torch.testing.assert_close(net(tokens)[:8], net(changed)[:8])

    def test_a_training_step_lowers_the_loss(self) -> None:
        net = model(small("qwen2", tied=False))
        tokens = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(2))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)

        def loss() -> torch.Tensor:
            logits = net(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), tokens[:, 1:].reshape(-1))

        losses = []
        for _ in range(5):
            value = loss()
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            losses.append(float(value.detach()))
        assert float(loss().detach()) < losses[0] - 0.5

    def test_greedy_generate_returns_max_new_tokens_per_prompt_and_is_deterministic(self) -> None:
        net = model(small("qwen3"))
        out = net.generate([[1, 2, 3], [4]], max_new_tokens=6)
        assert [len(new) for new in out] == [6, 6] and all(0 <= t < 61 for new in out for t in new)
        assert net.generate([[1, 2, 3]], max_new_tokens=6) == out[:1]
        assert out[0][0] == int(net(torch.tensor([1, 2, 3]))[-1].argmax())

    @pytest.mark.parametrize(
        ("prompts", "message"),
        [([[]], "empty prompt"), ([[1, 61]], r"token ids \[61\] are outside"), ([[1] * 120], "exceeds")],
    )
    def test_generate_refuses_prompts_it_cannot_continue(
        self, prompts: list[list[int]], message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            model(small()).generate(prompts, max_new_tokens=10)


class TestParityWithTransformers:
    """Our state dict loaded into transformers' own class gives the same logits (float32, CPU)."""

    @pytest.fixture(scope="class")
    def transformers(self) -> Any:
        return pytest.importorskip("transformers")

    @pytest.mark.parametrize(
        "data",
        [
            small("qwen2", tied=True),
            small("qwen2", tied=False),
            small("qwen3", tied=True),
            small("qwen3", tied=False),
            json.loads((CONFIGS / "qwen2-tiny" / "config.json").read_text()),
        ],
        ids=["qwen2-tied", "qwen2-untied", "qwen3-tied", "qwen3-untied", "qwen2-tiny-config"],
    )
    def test_logits_match_hugging_face_to_1e_4(self, transformers: Any, data: dict[str, Any]) -> None:
        ours = model(data, seed=3, dtype=torch.float32)
        # Seeded noise on every tensor: biases and norm weights away from zeros and ones, and
        # projections large enough that attention is far from uniform.
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
        classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
        config_cls, model_cls = (getattr(transformers, name) for name in classes[data["model_type"]])
        theirs = model_cls(config_cls(**data, attn_implementation="eager")).float().eval()
        result = theirs.load_state_dict(ours.state_dict(), strict=False)
        assert result.unexpected_keys == []
        assert result.missing_keys == (["lm_head.weight"] if data["tie_word_embeddings"] else [])
        if data["tie_word_embeddings"]:
            assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
        assert list(theirs.state_dict()) == list(ours.state_dict()) + result.missing_keys

        tokens = torch.randint(0, data["vocab_size"], (2, 40), generator=generator)
        with torch.no_grad():
            expected = theirs(input_ids=tokens).logits
            got = ours(tokens)
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error < 1e-4, error

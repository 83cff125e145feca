"""Checkpoint layouts taken from public configs, and a scaled-down one through the whole sync on CPU.

The GPU tests and `benchmarks/bench_sync.py --layout dense|moe` send the full-size layouts."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from actor_integration.models.qwen2 import QwenConfig, QwenLM
from actor_integration.rollout import RolloutActor
from actor_integration.weight_sync import RankSlot, WeightReceiver, WeightSender
from actor_integration.weight_sync.checkpoint_layouts import (
    LAYOUTS,
    QWEN3_4B,
    QWEN3_30B_A3B,
    ModelShape,
    layers_within,
    materialize,
    specs_nbytes,
    tensor_specs,
)
from actor_integration.weight_sync.disk import DiskSender
from actor_integration.weight_sync.shm import ShmSender
from tests.helpers.weight_sync_doubles import DeviceChecksumShm, TensorsEngine, fingerprints

MiB = 1 << 20
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
# Qwen/Qwen3-4B's config.json, the keys QwenConfig reads (tied, unlike the QWEN3_4B layout).
QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def sizes(specs):
    return {name: specs_nbytes([(name, shape, dtype)]) for name, shape, dtype in specs}


class TestPublicShapes:
    def test_the_dense_layout_is_qwen3_4b_whole_at_8_gib_with_two_tensors_larger_than_a_bucket(self):
        specs = tensor_specs(QWEN3_4B, layers=layers_within(QWEN3_4B, 8 << 30))
        nbytes = sizes(specs)
        assert LAYOUTS["dense"] is QWEN3_4B and len(specs) == 399 and len({n for n, _, _ in specs}) == 399
        assert round(sum(nbytes.values()) / 2**30, 1) == 8.2
        assert [n for n, b in nbytes.items() if b > 512 * MiB] == [
            "model.embed_tokens.weight",
            "lm_head.weight",
        ]
        assert nbytes["model.layers.0.self_attn.q_norm.weight"] == 256
        assert {d for _, _, d in specs} == {torch.bfloat16}

    def test_the_moe_layout_keeps_6_of_qwen3_30b_a3b_layers_at_8_gib_with_fp32_router_biases(self):
        layers = layers_within(QWEN3_30B_A3B, 8 << 30)
        specs = tensor_specs(QWEN3_30B_A3B, layers=layers)
        nbytes = sizes(specs)
        assert LAYOUTS["moe"] is QWEN3_30B_A3B and layers == 6 and len(specs) == 2367
        assert round(sum(nbytes.values()) / 2**30, 1) == 8.1
        assert nbytes["model.layers.5.mlp.experts.127.down_proj.weight"] == 3 * MiB
        biases = [(n, d) for n, _, d in specs if n.endswith("e_score_correction_bias")]
        assert len(biases) == layers and {d for _, d in biases} == {torch.float32}
        assert nbytes["model.embed_tokens.weight"] > 512 * MiB

    def test_a_layer_count_out_of_range_is_refused(self):
        with pytest.raises(ValueError, match="has 36 layers"):
            tensor_specs(QWEN3_4B, layers=37)

    def test_materialized_tensors_have_the_specs(self):
        tiny = dataclasses.replace(
            QWEN3_30B_A3B, hidden=8, heads=2, kv_heads=1, head_dim=4, experts=2, vocab=10
        )
        specs = tensor_specs(tiny, layers=1)
        made = materialize(specs, "cpu")
        assert [(n, tuple(t.shape), t.dtype) for n, t in made.items()] == specs


class TestFromHfConfig:
    """A layout read from a config.json names and shapes the tensors QwenLM (Hugging Face's names) has."""

    @pytest.mark.parametrize("config", ["qwen2-tiny", "qwen2-0.5b", "qwen2-7b", "qwen3-4b"])
    def test_the_specs_are_the_names_shapes_and_dtypes_of_the_model(self, config):
        source = (
            QWEN3_4B_CONFIG
            if config == "qwen3-4b"
            else json.loads((CONFIGS / config / "config.json").read_text())
        )
        with torch.device("meta"):
            weights = QwenLM(QwenConfig.from_dict(source)).named_weights()
        specs = tensor_specs(ModelShape.from_hf_config(source))
        assert len(specs) == len(weights)
        assert {n: (s, d) for n, s, d in specs} == {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}

    def test_qwen2_layers_carry_qkv_biases_after_each_weight_and_no_qk_norms(self):
        shape = ModelShape.from_hf_config(CONFIGS / "qwen2-0.5b" / "config.json")
        names = [n.removeprefix("model.layers.0.") for n, _, _ in tensor_specs(shape, layers=1)[1:-1]]
        assert names[:8] == [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.weight",
        ]
        assert not any("norm" in n and "layernorm" not in n for n in names)

    def test_qwen2_7b_is_15_gb_with_an_untied_head(self):
        specs = tensor_specs(ModelShape.from_hf_config(CONFIGS / "qwen2-7b"))
        assert len(specs) == 28 * 12 + 3 and specs[-1][0] == "lm_head.weight"
        assert round(specs_nbytes(specs) / 1e9, 1) == 15.2


# A Qwen3-30B-A3B-shaped layout scaled down: the embedding and the head are larger than the
# bucket, the q/k norms are 32 bytes, the router biases fp32 among bf16 tensors.
SMALL_MOE = dataclasses.replace(
    QWEN3_30B_A3B, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, moe_intermediate=32, vocab=500
)
BUCKET = 16 << 10


class TestThroughTheSync:
    @pytest.fixture
    def specs(self):
        specs = tensor_specs(SMALL_MOE, layers=2)
        assert max(sizes(specs).values()) > BUCKET and min(sizes(specs).values()) < 1024
        return specs

    @pytest.mark.parametrize(
        "path",
        ["shm", "shm, verified in two passes", "streamed in two passes", "disk"],
    )
    def test_every_tensor_arrives_bit_exact(self, specs, path, tmp_path):
        two_pass = "two passes" in path
        actor = RolloutActor(TensorsEngine(specs, "cpu"), receiver=WeightReceiver(keep_previous=not two_pass))
        transport = (
            DiskSender(tmp_path) if path == "disk" else DeviceChecksumShm() if two_pass else ShmSender()
        )
        sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=actor.update_weights,
            bucket_bytes=BUCKET,
            deadline_s=10.0,
            round_buckets=1 if path.startswith("streamed") or path == "shm" else None,
        )
        for version in (1, 2):
            weights = materialize(specs, "cpu", seed=version)
            report = sender.send(version, weights)
            assert actor.engine.fingerprints() == fingerprints(weights)
            assert actor.weight_version() == version
        assert report.buckets > 3
        sender.close()

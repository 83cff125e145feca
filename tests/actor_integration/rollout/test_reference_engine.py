"""ReferenceEngine and TinyLM: generation, SGLang-like memory semantics, staged versioned loads."""

import pytest
import torch

from actor_integration.models.tiny import TinyLM, TinyLMConfig, weights_checksum
from actor_integration.rollout import ReferenceEngine, RolloutEngine
from tests.helpers.models import perturbed

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


def load(engine, model, version, *, rounds=1):
    named = list(model.named_weights().items())
    size = -(-len(named) // rounds)
    for i in range(rounds):
        chunk = named[i * size : (i + 1) * size]
        engine.load_weights(version, [chunk] * engine.num_ranks, round_index=i, final=i == rounds - 1)


class TestTinyLM:
    def test_the_same_seed_gives_the_same_weights(self):
        assert weights_checksum(TinyLM(CONFIG).named_weights()) == weights_checksum(
            TinyLM(CONFIG).named_weights()
        )
        other = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=2)
        assert weights_checksum(TinyLM(other).named_weights()) != weights_checksum(
            TinyLM(CONFIG).named_weights()
        )

    def test_construction_leaves_the_global_rng_alone(self):
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        TinyLM(CONFIG)
        assert torch.equal(torch.rand(3), expected)

    def test_cached_decoding_matches_a_full_forward(self):
        model = perturbed(CONFIG, 3, scale=0.2)
        prompt = [5, 9, 2, 7]
        (new,) = model.generate([prompt], max_new_tokens=6)
        tokens = list(prompt)
        for expected in new:
            logits = model(torch.tensor(tokens))
            assert int(logits[-1].argmax()) == expected
            tokens.append(expected)

    def test_a_prompt_longer_than_the_model_is_refused(self):
        with pytest.raises(ValueError, match="max_seq_len"):
            TinyLM(CONFIG).generate([[1] * 20], max_new_tokens=8)

    def test_checksum_sees_one_changed_bit(self):
        named = perturbed(CONFIG, 1, scale=0.2).named_weights()
        before = weights_checksum(named)
        flat = named["head.weight"].view(-1).view(torch.int32)
        flat[0] ^= 1
        assert weights_checksum(named) != before

    def test_bad_configs_are_refused(self):
        with pytest.raises(ValueError, match="divisible"):
            TinyLMConfig(dim=10, n_heads=4)
        with pytest.raises(ValueError, match="dtype"):
            TinyLMConfig(dtype="int8")


class TestMemory:
    def test_it_satisfies_the_engine_protocol(self):
        assert isinstance(ReferenceEngine(CONFIG), RolloutEngine)

    def test_released_weights_lose_their_contents_unless_backed_up(self):
        engine = ReferenceEngine(CONFIG)
        engine.release_memory_occupation(["weights"])
        assert all(p.numel() == 0 for p in engine.models[0].parameters())  # memory really let go
        engine.resume_memory_occupation(["weights"])
        with pytest.raises(RuntimeError, match="sync weights before generating"):
            engine.generate([[1, 2]])
        load(engine, perturbed(CONFIG, 4, scale=0.2), 1)
        assert engine.generate([[1, 2]], max_new_tokens=3) == perturbed(CONFIG, 4, scale=0.2).generate(
            [[1, 2]], max_new_tokens=3
        )

    def test_with_a_backup_the_weights_come_back_bit_exact(self):
        engine = ReferenceEngine(CONFIG, weights_backup=True)
        before = engine.weights_checksum()
        engine.release_memory_occupation(None)
        engine.resume_memory_occupation(None)
        assert engine.weights_checksum() == before

    def test_double_release_and_resume_of_a_resident_tag_fail_like_sglang(self):
        engine = ReferenceEngine(CONFIG)
        with pytest.raises(KeyError, match="not released"):
            engine.resume_memory_occupation(["kv_cache"])
        engine.release_memory_occupation(["kv_cache"])
        with pytest.raises(RuntimeError, match="already released"):
            engine.release_memory_occupation(["kv_cache"])

    def test_generation_needs_both_tags_and_no_pause(self):
        engine = ReferenceEngine(CONFIG)
        engine.release_memory_occupation(["kv_cache"])
        with pytest.raises(RuntimeError, match=r"\['kv_cache'\] released"):
            engine.generate([[1]])
        engine.resume_memory_occupation(["kv_cache"])
        engine.pause_generation("retract")
        with pytest.raises(RuntimeError, match="paused"):
            engine.generate([[1]])
        engine.continue_generation()
        assert len(engine.generate([[1]], max_new_tokens=2)[0]) == 2

    def test_unknown_tags_and_modes_are_refused(self):
        engine = ReferenceEngine(CONFIG)
        with pytest.raises(ValueError, match="unknown memory tags"):
            engine.release_memory_occupation(["cuda_graph"])
        with pytest.raises(ValueError, match="mode"):
            engine.pause_generation("later")


class TestLoading:
    def test_a_version_loaded_over_several_rounds_lands_bit_exact_on_every_rank(self):
        engine = ReferenceEngine(CONFIG, devices=["cpu", "cpu"])
        model = perturbed(CONFIG, 7, scale=0.2)
        load(engine, model, 3, rounds=4)
        assert engine.weights_checksum() == weights_checksum(model.named_weights())
        assert engine.weight_version == 3

    def test_previous_weights_stay_until_the_final_round(self):
        engine = ReferenceEngine(CONFIG)
        before = engine.weights_checksum()
        named = list(perturbed(CONFIG, 8, scale=0.2).named_weights().items())
        engine.load_weights(1, [named[:3]], round_index=0, final=False)
        assert engine.weights_checksum() == before and engine.weight_version == 0

    def test_an_incomplete_version_is_refused_and_changes_nothing(self):
        engine = ReferenceEngine(CONFIG)
        before = engine.weights_checksum()
        named = list(perturbed(CONFIG, 8, scale=0.2).named_weights().items())
        with pytest.raises(ValueError, match="incomplete"):
            engine.load_weights(1, [named[:-1]], round_index=0, final=True)
        assert engine.weights_checksum() == before and engine.weight_version == 0

    def test_wrong_names_shapes_and_shard_counts_are_refused(self):
        engine = ReferenceEngine(CONFIG)
        with pytest.raises(ValueError, match="unknown tensor"):
            engine.load_weights(1, [[("nope", torch.zeros(1))]], round_index=0, final=True)
        with pytest.raises(ValueError, match="arrived as"):
            engine.load_weights(1, [[("head.weight", torch.zeros(2, 2))]], round_index=0, final=True)
        with pytest.raises(ValueError, match="disagree on the number of GPUs"):
            engine.load_weights(1, [[], []], round_index=0, final=True)

    def test_a_round_without_its_round_zero_is_refused(self):
        engine = ReferenceEngine(CONFIG)
        with pytest.raises(RuntimeError, match="without its round 0"):
            engine.load_weights(2, [[]], round_index=1, final=True)

    def test_loading_into_released_weights_is_refused(self):
        engine = ReferenceEngine(CONFIG)
        engine.release_memory_occupation(["weights"])
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            load(engine, perturbed(CONFIG, 1, scale=0.2), 1)

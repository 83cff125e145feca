"""vLLM 0.26.0's source, read from its pinned wheel (downloaded once into the cache; see
tests/helpers/vllm_source.py), and fakes bound to it."""

import pytest
import torch

from tests.helpers.vllm_fake import FakeLLM, FakeVLLM, sampling_params
from tests.helpers.vllm_source import open_tree


@pytest.fixture(scope="session")
def vllm_tree():
    tree = open_tree()
    yield tree
    tree.close()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),
    }


@pytest.fixture
def fake(vllm_tree):
    return FakeVLLM(vllm_tree, weights(0))


@pytest.fixture
def make_engine(fake, vllm_tree):
    from actor_integration.engines.vllm import VLLMEngine

    def make(**kwargs):
        kwargs.setdefault("ipc_sender", fake.ipc_sender)
        return VLLMEngine(FakeLLM(fake), sampling_params=sampling_params(vllm_tree), **kwargs)

    return make

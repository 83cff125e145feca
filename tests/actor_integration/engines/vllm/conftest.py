"""vLLM 0.26.0's source, read from its pinned wheel (downloaded once into the cache; see
tests/helpers/vllm_source.py), and fakes bound to it."""

import pytest

from tests.helpers.vllm_fake import FakeLLM, FakeVLLM, sampling_params, weights
from tests.helpers.vllm_source import open_tree


@pytest.fixture(scope="session")
def vllm_tree():
    tree = open_tree()
    yield tree
    tree.close()


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

"""The fixtures of the tests that drive the fake vLLM (`vllm_fake`): vLLM 0.26.0's source, read from
its pinned wheel (downloaded once into the cache; see `vllm_source`), a fake engine bound to it, and
the offline adapter over that fake. Imported by the conftest of each directory whose tests use them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.vllm_fake import FakeLLM, FakeVLLM, sampling_params, weights
from tests.helpers.vllm_source import open_tree


@pytest.fixture(scope="session")
def vllm_tree() -> Iterator[Any]:
    tree = open_tree()
    yield tree
    tree.close()


@pytest.fixture
def fake(vllm_tree: Any) -> Iterator[FakeVLLM]:
    """A fake vLLM serving `weights(0)`; the child process standing for its EngineCore, where a test
    started one, is ended after the test."""
    made = FakeVLLM(vllm_tree, weights(0))
    yield made
    if made.core is not None and made.core.is_alive():
        made.core.kill()
        made.core.join(timeout=5)


@pytest.fixture
def make_engine(fake: FakeVLLM, vllm_tree: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """The offline adapter over the fake, built where vLLM's own IPC path can run: with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (as a job using that path sets it; unset it before `make`
    to see the refusal)."""
    from actor_integration.engines.vllm import VLLMEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    def make(**kwargs: Any) -> VLLMEngine:
        kwargs.setdefault("ipc_sender", fake.ipc_sender)
        return VLLMEngine(FakeLLM(fake), sampling_params=sampling_params(vllm_tree), **kwargs)

    return make

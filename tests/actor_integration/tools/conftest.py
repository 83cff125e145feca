"""The demo's vLLM path runs on the fake vLLM (`tests/helpers/vllm_fixtures.py`)."""

from tests.helpers.vllm_fixtures import fake, vllm_tree

__all__ = ["fake", "vllm_tree"]

"""vLLM 0.26.0's source, read from its pinned wheel, and fakes bound to it (`tests/helpers/vllm_fixtures.py`)."""

from tests.helpers.vllm_fixtures import fake, make_engine, vllm_tree

__all__ = ["fake", "make_engine", "vllm_tree"]

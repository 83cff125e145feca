"""What the vLLM GPU tests share (tests/gpu/test_vllm_gpu.py, tests/gpu/test_vllm_http_gpu.py): the
model, the prompts, issue 48's freed-bytes target, the GPU's free bytes, the trainer's two weight sets
and our CUDA IPC sender (tests only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def needs_vllm_on_cuda() -> tuple[Any, list[Any]]:
    """(torch, the GPU test module's marks): called at a test module's top, it skips that module where
    torch or vllm is not installed (importorskip), and the marks skip its tests without CUDA."""
    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    return torch, marks


REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "configs" / "qwen2-tiny"
PROMPTS = [[11, 12, 13, 14], [100, 200, 300], [7] * 9, [151, 152, 153, 154, 155, 156]]
NEW_TOKENS = 16
FREED_AT_LEAST = 0.95  # issue 48's target: a level-2 sleep frees 95% of what vLLM reports


def free_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return int(free)


def weight_sets() -> dict[str, dict[str, Any]]:
    """A trainer's two weight sets on the GPU (QwenLM, seeds 1 and 2: the names and shapes vLLM's Qwen2 loads)."""
    from actor_integration.models.qwen2 import QwenConfig, QwenLM

    config = QwenConfig.from_json(MODEL)
    return {n: QwenLM(config, seed=s, device="cuda").named_weights() for n, s in (("A", 1), ("B", 2))}


def cuda_ipc_sender(engine_call: Callable[..., Any]) -> Any:
    """Our sender (CUDA IPC from GPU 0, one rank) into `engine_call` (a rollout actor's `update_weights`)."""
    from actor_integration.weight_sync.cuda_ipc import CudaIpcSender
    from tests.helpers.weight_sync_doubles import one_rank_sender

    return one_rank_sender(engine_call, CudaIpcSender(device=0), bucket_bytes=64 << 20, deadline_s=300)

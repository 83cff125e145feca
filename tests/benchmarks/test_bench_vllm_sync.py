"""benchmarks/bench_vllm_sync.py's host side: its arguments are refused before any GPU work, and the
engine it starts is one `VLLMEngine` accepts (sleep mode, the workers' receiver for our path and its
checksum). The syncs themselves run on the GPU machine (scripts/gpu_vllm.sh's `bench` step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actor_integration.engines.vllm.offline import llm_arguments
from actor_integration.engines.vllm.worker import WORKER_EXTENSION
from tests.helpers.benchmarks import load_benchmark

bench = load_benchmark("bench_vllm_sync")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--shapes", "qwen2-70b"], "unknown shapes ['qwen2-70b']"),
        (["--shapes", ","], "unknown shapes ','"),
        (["--iters", "0"], "--iters (0) and --bucket-mib (512) must be at least 1"),
        (["--bucket-mib", "0"], "--iters (5) and --bucket-mib (0) must be at least 1"),
    ],
)
def test_bad_arguments_are_the_parsers_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    if "unknown" in said:  # it names what there is
        assert "qwen2-0.5b" in err and "qwen2-7b" in err


def test_without_a_gpu_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--shapes", "qwen2-tiny", "--iters", "1"]) == 2
    assert "needs a CUDA GPU and vllm 0.26.0" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["qwen2-0.5b", "qwen2-7b"])
def test_the_engine_it_starts_has_sleep_mode_the_receiver_and_vllms_ipc_transfer(shape: str) -> None:
    kwargs = bench.engine_arguments(shape)
    assert Path(kwargs["model"], "config.json").is_file()
    assert kwargs.pop("sleep_level") == 2  # the colocated sync's state: weights rewoken, KV released
    llm = llm_arguments(kwargs, worker_receiver=True)
    assert llm["enable_sleep_mode"] is True
    assert llm["worker_extension_cls"] == WORKER_EXTENSION  # our path and the checksum need it
    assert llm["weight_transfer_config"] == {"backend": "ipc"}  # vLLM's own path
    assert 0 < llm["gpu_memory_utilization"] <= 0.35  # beside the trainer's copy of the weights

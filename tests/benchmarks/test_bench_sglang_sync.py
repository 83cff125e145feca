"""The host side of benchmarks/bench_sglang_sync.py that bench_vllm_sync.py shares: the trainer's
one-rank sender and each path's figures (the syncs themselves run on the GPU machine)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from actor_integration.weight_sync.shm import ShmSender
from tests.helpers.benchmarks import load_benchmark

bench = load_benchmark("bench_sglang_sync")


def test_path_figures_are_each_paths_median_rate_and_every_sync() -> None:
    figures = bench.path_figures(2_000_000_000, ours=[0.010, 0.030, 0.020], slime=[0.040])
    assert figures["ours_ms"] == 20.0 and figures["ours_gbps"] == 100.0
    assert figures["slime_ms"] == 40.0 and figures["slime_gbps"] == 50.0
    assert figures["ours_all_ms"] == [10.0, 30.0, 20.0] and figures["slime_all_ms"] == [40.0]
    assert set(figures) == {"ours_ms", "ours_gbps", "ours_all_ms", "slime_ms", "slime_gbps", "slime_all_ms"}


def test_the_colocated_sender_sends_a_version_into_the_engine_call_in_buckets_of_the_size_asked() -> None:
    calls: list[tuple[int, Any]] = []

    def engine_call(version: int, payloads: Any) -> dict[str, Any]:
        calls.append((version, payloads))
        return {}

    tensors = {f"layer.{i}": torch.full((300_000,), float(i)) for i in range(4)}  # 1.2 MB each
    sender = bench.colocated_sender(engine_call, bucket_mib=1, transport=ShmSender())
    try:
        sender.send(7, tensors.items())
    finally:
        sender.close()
    assert [version for version, _ in calls] == [7] * len(calls) and calls
    buckets = [b for _, payloads in calls for p in payloads for b in p.buckets]
    assert len(buckets) >= 4  # 1 MiB buckets: no two of the 1.2 MB tensors share one


def test_the_colocated_sender_needs_cuda_without_another_transport() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs CUDA"):
        bench.colocated_sender(lambda version, payloads: {}, bucket_mib=512)


def test_the_table_names_the_other_path_and_where_our_time_goes(capsys: pytest.CaptureFixture[str]) -> None:
    row = {
        "shape": "qwen2-7b",
        "gb": 15.231,
        "identical_engine_weights": True,
        "ours_breakdown_ms": {"pack_ms": 7.1},
    }
    row.update(bench.path_figures(15_231_000_000, ours=[0.046], slime=[0.0986], d2d=[0.0102]))
    row["ours_over_slime"] = 2.14
    bench.print_rows([row], "slime")
    header, line, where = capsys.readouterr().out.splitlines()
    assert header.split() == [
        "shape", "GB", "ours", "ms", "slime", "ms", "d2d", "ms", "ours", "GB/s", "slime", "GB/s", "d2d", "GB/s",
        "ours/slime", "same",
    ]  # fmt: skip
    assert line.split() == [
        "qwen2-7b",
        "15.231",
        "46.0",
        "98.6",
        "10.2",
        "331.1",
        "154.5",
        "1493.2",
        "2.14x",
        "True",
    ]
    assert where == "qwen2-7b ours, where the time goes (ms): {'pack_ms': 7.1}"


def test_a_wrong_shape_or_count_is_refused_before_any_gpu_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "qwen2-1t"])
    assert "unknown shapes ['qwen2-1t']: give directories of configs/ (qwen2-0.5b" in capsys.readouterr().err


@pytest.mark.parametrize(("same", "rc"), [(True, 0), (False, 1)])
def test_run_shapes_writes_each_row_with_the_engines_version_and_fails_on_differing_weights(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, same: bool, rc: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run both sync benches share: a row per shape, the table beside the baseline, the JSON with the
    engine's version under its name, and exit 1 where an engine's weights differ from the trainer's."""
    monkeypatch.setattr(bench.torch.cuda, "set_device", lambda index: None)  # the GPU's, on the machine
    args = bench.parse_sync_arguments("t", ["--shapes", "qwen2-0.5b", "--out", str(tmp_path / "out.json")])
    figures = {"gb": 1.0, "d2d_ms": 0.5, "d2d_gbps": 2.0, "ours_over_vllm": 2.0, "ours_breakdown_ms": {}}
    figures.update(bench.path_figures(1_000_000_000, ours=[0.002], vllm=[0.004]))

    def shape_run(shape: str, given: Any) -> dict[str, Any]:
        assert given is args
        return {"shape": shape, **figures, "identical_engine_weights": same}

    assert bench.run_shapes(args, shape_run, "vllm", "vllm", lambda: "0.26.0") == rc
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["vllm"] == "0.26.0" and [r["shape"] for r in written["rows"]] == ["qwen2-0.5b"]
    assert "vllm ms" in capsys.readouterr().out

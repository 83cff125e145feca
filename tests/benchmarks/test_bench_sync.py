"""bench_sync.py needs a GPU to run; its host-side parts are checked here so that they cannot rot
between the H200 runs: the layouts it sends, slime-style bucketing of any layout, the bit-exact
comparison, and the summary with the issues' targets (fed with made-up rows)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.helpers.benchmarks import load_benchmark

bench = load_benchmark("bench_sync", keep=True)


def options(**kwargs):
    values = {
        "gib": 8.0,
        "bucket_mib": 512,
        "tensor_mib": 32.0,
        "layout": "uniform",
        "kernel": None,
        "out": None,
    }
    values.update(kwargs)
    return argparse.Namespace(**values)


class TestLayouts:
    @pytest.mark.parametrize(
        ("layout", "count", "over", "dtypes"),
        [
            ("uniform", 256, 0, "bfloat16"),
            ("dense", 399, 2, "bfloat16"),
            ("moe", 2367, 2, "bfloat16, float32"),
        ],
    )
    def test_each_layout_says_what_it_sends(self, layout, count, over, dtypes):
        line = bench.describe_layout(options(layout=layout))
        assert f"{count} tensors" in line and f"{over} larger than a 512 MiB bucket" in line
        assert line.endswith(f"dtypes {dtypes}")
        if layout == "moe":
            assert "Qwen3-30B-A3B-shaped, 6 of its 48 layers" in line and "fp32 router bias" in line


class TestSlimeBuckets:
    def test_tensors_go_in_order_a_larger_one_alone_and_one_dtype_per_bucket(self):
        weights = {
            "a": torch.zeros(100, dtype=torch.bfloat16),  # 200 B
            "b": torch.zeros(10, dtype=torch.float32),  # 40 B
            "big": torch.zeros(1000, dtype=torch.bfloat16),  # 2000 B: larger than a bucket
            "c": torch.zeros(50, dtype=torch.bfloat16),
            "d": torch.zeros(60, dtype=torch.bfloat16),  # c + d = 220 B: fits
            "e": torch.zeros(40, dtype=torch.bfloat16),  # + 80 B: overflows, a new bucket
        }
        assert bench.slime_buckets(weights, 256) == [[["a"], ["b"]], [["big"]], [["c", "d"]], [["e"]]]
        assert bench.slime_buckets(weights, 4096) == [[["a", "big", "c", "d", "e"], ["b"]]]


class TestBitExact:
    def test_a_flipped_or_moved_word_counts_as_a_differing_tensor(self):
        weights = {"x": torch.arange(64, dtype=torch.int32), "y": torch.ones(3, dtype=torch.bfloat16)}
        expected = bench.fingerprints(weights)
        assert bench.mismatches({k: v.clone() for k, v in weights.items()}, expected) == 0
        moved = {"x": weights["x"].flip(0), "y": weights["y"]}
        assert bench.mismatches(moved, expected) == 1
        assert bench.mismatches({"x": weights["x"]}, expected) == 1  # a missing tensor counts


def row(path, seconds, *, exact=True):
    values = {"path": path, "bytes": 8 << 30, "handoff": [seconds * 0.8] * 3, "end_to_end": [seconds] * 3}
    if not path.startswith("d2d"):
        values["checksum_match"] = exact
        values["differing_tensors"] = 0 if exact else 3
    if path not in ("slime",) and not path.startswith("d2d"):
        values.update(phases={"pack_ms": 1.0}, receiver_phases={"copy_ms": 4.0}, cold_end_to_end=0.5)
        values.update(buckets=17, rounds=1)
    return values


class TestSummary:
    def test_the_dense_run_prints_every_path_next_to_the_ceiling_and_the_targets(self, tmp_path, capsys):
        uniform = tmp_path / "uniform.json"
        uniform.write_text(
            json.dumps({"rows": [{"path": "cuda_ipc+v", "region": "end_to_end", "gbps": 720.0}]})
        )
        args = options(layout="dense", uniform_json=uniform, out=tmp_path / "dense.json")
        rows = [
            row("d2d_flat", 0.004),
            row("slime", 0.02),
            row("cuda_ipc+v", 0.012),
            row("cuda_ipc+2p", 0.0085),
        ]
        rows.append(row("arena+v", 0.0095))
        status = bench.summarize(args, rows, bench.describe_layout(args))
        out = capsys.readouterr().out
        assert status == 0 and "399 tensors" in out
        for line in (
            "issue 24: default end to end / its uniform-tensor figure",
            "issue 24: default end to end / slime-style end to end",
            "issue 24: two-pass verified (cuda_ipc+2p) end to end",
            "issue 24: arena+v end to end / default end to end",
        ):
            assert line in out
        report = json.loads(args.out.read_text())
        met = {t["what"]: t["met"] for t in report["targets"]}
        assert met["two-pass verified (cuda_ipc+2p) end to end"] is True  # 8 GiB in 8.5 ms
        assert met["default end to end / its uniform-tensor figure"] is True  # 716 of 720
        assert report["rows"][0]["path"] == "d2d_flat" and report["not_bit_exact"] == []

    def test_a_path_that_is_not_bit_exact_fails_the_run(self, capsys):
        args = options(uniform_json=None)
        status = bench.summarize(
            args, [row("d2d_flat", 0.004), row("cuda_ipc+2p", 0.01, exact=False)], "layout"
        )
        assert status == 1 and "NOT BIT-EXACT: ['cuda_ipc+2p']" in capsys.readouterr().out

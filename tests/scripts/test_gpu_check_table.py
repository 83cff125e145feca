"""scripts/gpu_check_table.py: the `areal` step's row, from what gpu_sglang.sh and the GPU test leave in WORK."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_script


@pytest.fixture(scope="module")
def table() -> ModuleType:
    return load_script("gpu_check_table")


def ran(work: Path, figures: dict | None) -> None:
    (work / "summary.txt").write_text("test_areal_rollout_gpu rc=0 150s\nareal_rollout_check rc=0 3s\n")
    (work / "test_areal_rollout_gpu.log").write_text("======= 8 passed in 140.2s =======\n")
    (work / "areal_rollout_check.log").write_text(
        "lifecycle check: 1 file(s), 300 event(s), 2 machine(s): clean\n"
    )
    if figures is not None:
        (work / "areal_rollout_summary.json").write_text(json.dumps(figures))


def test_the_row_gives_the_switch_against_the_target_the_failures_and_the_plugin(table, tmp_path, capsys):
    ran(
        tmp_path,
        {
            "plain_switch_ms": 60.1,
            "wrapped_switch_ms": 64.5,
            "delta_ms": 4.4,
            "target_met": False,
            "1726_absorbed": True,
            "1737_refused_then_ordered": True,
            "1160_plain_held_wrapped_served": True,
            "idle_drained": False,
            "idle_ablation_refused": "EngineNotIdleError",
            "plugin_runs_on_this_sglang": False,
        },
    )
    assert table.main([str(tmp_path), "areal"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| areal | pass | 153 | 8 passed in 140.2s; ")
    assert "switch plain 60.1 ms, wrapped 64.5 ms (+4.4 ms, target <= 3: MISSED)" in row
    assert "#1726 ok, #1737 ok, #1160 ok, idle FAILED, in-place refused ok" in row
    assert "AWEX plugin fits this SGLang: False; lifecycle check: " in row


def test_without_the_figures_the_row_has_the_test_and_the_check_only(table, tmp_path, capsys):
    ran(tmp_path, None)
    table.main([str(tmp_path), "areal"])
    row = capsys.readouterr().out.splitlines()[2]
    assert row.endswith(
        "| 8 passed in 140.2s; lifecycle check: 1 file(s), 300 event(s), 2 machine(s): clean |"
    )


def test_the_kill_demos_row_names_the_process_the_demo_killed(table, tmp_path):
    """The demo's report line as it prints it (`killed SGLang's scheduler at step N: ...`)."""
    (tmp_path / "demo_sglang_kill.log").write_text(
        "step 2: killed SGLang's scheduler (pids [4242]) (--kill-engine)\n"
        "  rollouts at step 2: 0/1 steps\n"
        "killed SGLang's scheduler at step 2: EngineDiedError after 0.4 s\n"
        "demo OK\n"
    )
    headline = table.demo_headline(tmp_path, "demo_sglang_kill")
    assert headline.startswith("demo OK")
    assert headline.endswith("killed SGLang's scheduler at step 2: EngineDiedError after 0.4 s")

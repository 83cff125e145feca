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


def test_a_frameworks_row_gives_the_side_by_side_against_its_target_and_the_sync_ratio(
    table, tmp_path, capsys
):
    (tmp_path / "summary.txt").write_text("test_miles_rollout_gpu rc=0 200s\nmiles_rollout_check rc=0 1s\n")
    (tmp_path / "test_miles_rollout_gpu.log").write_text("======= 9 passed in 190.0s =======\n")
    (tmp_path / "miles_rollout_check.log").write_text(
        "lifecycle check: 1 file(s), 9 event(s), 1 machine(s): clean\n"
    )
    (tmp_path / "miles_rollout_side_by_side.json").write_text(
        json.dumps(
            {
                "own": {"sleep_wake_ms": 50.0},
                "wrapped": {"sleep_wake_ms": 54.25},
                "wrapped_minus_own_sleep_wake_ms": 4.25,
                "target_ms": 3.0,
                "target_met": False,
            }
        )
    )
    (tmp_path / "miles_rollout_our_sender.json").write_text(
        json.dumps({"ours_sync_ms": 20.0, "own_sync_ms": 41.0})
    )
    assert table.main([str(tmp_path), "miles"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith(
        "| miles | pass | 201 | 9 passed in 190.0s; sleep + wake own 50.0 ms, wrapped 54.25 ms "
    )
    assert (
        "(+4.25 ms, target <= 3.0: MISSED); sync ours 20.0 ms, own push 41.0 ms (2.05x); lifecycle check"
        in row
    )


def test_the_tests_row_gives_the_offline_engines_sleep_and_wake_beside_sglangs_own(table, tmp_path, capsys):
    (tmp_path / "summary.txt").write_text("test_sglang_gpu rc=0 70s\n")
    (tmp_path / "test_sglang_gpu.log").write_text("======= 5 passed in 65.0s =======\n")
    (tmp_path / "sglang_sleep_wake_vs_own.json").write_text(
        json.dumps({"ours_ms_median": 31.38, "sglang_own_ms_median": 38.93, "difference_ms": -7.55})
    )
    assert table.main([str(tmp_path), "tests"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.endswith("5 passed in 65.0s; sleep + wake ours 31.38 ms, SGLang's own 38.93 ms (-7.55 ms) |")


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


# --- joining the tables of several calls -----------------------------------------------------------
TREE = "code 0123456789ab (400 files)"


def table_file(path: Path, rows: list[str], code: str | None = TREE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["| step | result | s | headline |", "|---|---|---|---|", *rows]
    path.write_text("\n".join(lines + ([code] if code else [])) + "\n")
    return path


def test_tables_of_two_machines_on_the_same_code_join_and_pass(table, tmp_path):
    first = table_file(
        tmp_path / "3/gpu-check.md",
        [
            "| bench | pass | 100 | ours 21 ms |",
            "| demo | FAIL | 90 | demo FAILED |",
            "| slime | not run | | |",
        ],
    )
    second = table_file(
        tmp_path / "7/gpu-check.md",
        [
            "| demo | pass | 200 | demo OK |",
            "| slime | pass | 190 | 8 passed |",
            "| (install) | pass | 33 | |",
        ],
    )
    lines, ok = table.merge([first, second], ["bench", "demo", "slime"], TREE)
    assert ok
    assert lines[2] == "| bench | pass | 100 | ours 21 ms | 3/gpu-check.md |"
    assert lines[3] == "| demo | pass | 200 | demo OK | 7/gpu-check.md |"  # the later row wins
    assert lines[4] == "| slime | pass | 190 | 8 passed | 7/gpu-check.md |"
    assert lines[5].startswith(f"this tree: {TREE}; ")
    assert lines[-1] == "every step passed on this tree's code (3 steps, 2 table(s))"


def test_a_table_of_other_code_or_none_counts_for_nothing(table, tmp_path):
    good = table_file(tmp_path / "1/gpu-check.md", ["| bench | pass | 100 | x |"])
    other = table_file(
        tmp_path / "2/gpu-check.md", ["| demo | pass | 200 | y |"], code="code ffffffffffff (399 files)"
    )
    bare = table_file(tmp_path / "3/gpu-check.md", ["| kill | pass | 117 | z |"], code=None)
    lines, ok = table.merge([good, other, bare], ["bench", "demo", "kill"], TREE)
    assert not ok
    assert "| demo | not run | | | |" in lines and "| kill | not run | | | |" in lines
    assert f"{other}: ran code ffffffffffff (399 files), not this tree's" in lines
    assert f"{bare}: ran code not recorded, not this tree's" in lines
    assert lines[-1] == "NOT every step passed on this tree's code: not run on it demo kill"


def test_a_failed_step_fails_the_join_and_the_other_scripts_tables_join_too(table, tmp_path):
    vllm = tmp_path / "5/gpu-vllm.md"
    vllm.parent.mkdir()
    vllm.write_text(
        "| step | rc | seconds |\n| --- | --- | --- |\n| install | 0 | 10 |\n| tests | 0 | 81 |\n| vime | 1 | 68 |\n"
        f"| bench | not run | |\n    attention: FLASH_ATTN\n{TREE}\n"
    )
    lines, ok = table.merge([vllm], ["tests", "vime", "bench"], TREE)
    assert not ok
    assert "| tests | pass | 81 |  | 5/gpu-vllm.md |" in lines
    assert "| vime | FAIL (1) | 68 |  | 5/gpu-vllm.md |" in lines
    assert lines[-1] == "NOT every step passed on this tree's code: failed vime; not run on it bench"


def test_the_merge_command_compares_with_this_tree(table, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(table, "this_tree", lambda: TREE)
    path = table_file(tmp_path / "1/gpu-check.md", ["| bench | pass | 100 | x |"])
    assert table.main_merge(["--steps", "bench", str(path)]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "every step passed on this tree's code (1 steps, 1 table(s))"
    )
    assert table.main_merge(["--steps", "bench demo", str(path)]) == 1
    assert table.main_merge([str(tmp_path / "none.md")]) == 2


def test_the_table_on_the_machine_ends_with_the_code_that_ran(table, tmp_path, capsys):
    ran(tmp_path, None)
    table.main([str(tmp_path), "areal"])
    assert capsys.readouterr().out.splitlines()[-1] == "code: not recorded"
    (tmp_path / "code-id").write_text(TREE + "\n")
    table.main([str(tmp_path), "areal"])
    assert capsys.readouterr().out.splitlines()[-1] == TREE

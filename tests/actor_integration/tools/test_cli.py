"""The `lifecycle` command end to end on CPU: demo (real Ray), check, timeline, diagram, doctor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle import diagram
from tests.helpers.cli import lifecycle

pytestmark = pytest.mark.ray
TINY = str(Path(__file__).resolve().parents[3] / "configs" / "qwen2-tiny")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("demo")
    proc = lifecycle(
        "demo",
        "--steps",
        "3",
        "--save-every",
        "2",
        "--out",
        str(out),
        "--no-progress",
        "--inject-fault",
        "memory.pause@2",
        "--inject-fault",
        "rollout:generation.pause@3",
        "--skip-sync",
        "1",
        "--corrupt-sync",
        "3",
    )
    return out, proc


class TestDemo:
    def test_runs_the_colocated_loop(self, demo):
        out, proc = demo
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ok"] and summary["device"] == "cpu" and summary["transport"] == "shm"
        # The engine kind the demo's checks branch on (once rebound to the last slot's index, 0,
        # which made a SGLang run skip every SGLang check: issue 46).
        assert summary["engine"] == "reference" and summary["sglang"] is None
        # Step 1's sync is skipped: its weights are not compared, and step 2 starts with a refusal.
        assert [s["checksum_ok"] for s in summary["steps"]] == [None, True, True]
        assert summary["steps"][0]["sync_skipped"] and summary["steps"][0]["stale_rollouts"] == {"0": None}
        assert summary["steps"][1]["checkpoint_reload_ok"] is True
        assert [(f["step"], f["hook"]) for f in summary["faults"]] == [
            (2, "memory.pause"),
            (3, "generation.pause"),
        ]
        assert summary["findings"] == []
        rows = {(r["role"], r["rank"]): r for r in summary["ranks"]}
        assert set(rows) == {("trainer", 0), ("trainer", 1), ("rollout", 0)}
        assert all(
            rows[("trainer", r)]["checksum_ok"] == rows[("trainer", r)]["checksum_total"] == 3 for r in (0, 1)
        )
        assert rows[("rollout", 0)]["checksum_ok"] == rows[("rollout", 0)]["checksum_total"] == 2
        # Every load the rollout completed was read back where it was written, equal to what was
        # sent; the corrupt round (step 3) was refused before any write, so it is no failed read-back.
        assert rows[("rollout", 0)]["read_back_ok"] == rows[("rollout", 0)]["read_back_total"] >= 2
        assert rows[("trainer", 0)]["failures"] == 1 and rows[("trainer", 0)]["SAVING_s"] > 0
        assert rows[("rollout", 0)]["bytes_synced"] == 2 * rows[("trainer", 0)]["bytes_synced"] > 0
        assert "FAILED" in proc.stdout and "recover(target=PAUSED)" in proc.stdout
        assert "lifecycle demo: per rank" in proc.stdout and "demo OK" in proc.stdout

    def test_a_skipped_sync_is_refused_then_recovered(self, demo):
        """The generation after a skipped sync is refused by the lifecycle (typed), then sync → generate."""
        out, proc = demo
        summary = json.loads((out / "summary.json").read_text())
        (refusal,) = summary["refusals"]
        assert refusal["step"] == 2 and refusal["ranks"] == [0]
        assert refusal["error"] == "InvalidWeightsError" and refusal["tags"] == {"weights": "discarded"}
        assert refusal["recovered_by"] == "sync v1"
        assert "generate refused on rollout ranks [0]: InvalidWeightsError" in proc.stdout
        assert "generate at version 1: ok after the sync" in proc.stdout
        # The refusal is in the rollout's log (before any generate body ran on the discarded weights).
        lines = [json.loads(x) for x in (out / "logs" / "rollout-rank0.jsonl").read_text().splitlines()]
        refused = [x for x in lines if x["event"] == "lifecycle.refused" and x["operation"] == "generate"]
        assert len(refused) == 1 and refused[0]["step"] == 2 and "discarded" in refused[0]["reason"]
        # The timeline shows the weights' contents: discarded at each release, valid at each version.
        assert summary["timeline_marks"]["weights_valid"] >= 3
        assert summary["timeline_marks"]["weights_invalid"] >= 3

    def test_the_table_shows_the_lifecycle_cost_per_step(self, demo):
        """Seconds of transitions per step and their share of the step, per rank, from the logs."""
        out, proc = demo
        summary = json.loads((out / "summary.json").read_text())
        walls = sum(s["wall_s"] for s in summary["steps"])
        for row in summary["ranks"]:
            assert 0 < row["lifecycle_s_per_step"] * 3 < walls
            assert row["lifecycle_share"] == pytest.approx(row["lifecycle_s_per_step"] * 3 / walls, abs=2e-4)
        assert "lifecycle s/step" in proc.stdout and "% of step" in proc.stdout
        assert sorted(p.name for p in (out / "logs").glob("*.jsonl")) == [
            "rollout-rank0.jsonl",
            "trainer-rank0.jsonl",
            "trainer-rank1.jsonl",
        ]

    def test_a_corrupt_round_is_refused_then_sent_again_and_loads(self, demo):
        """Step 3's first bucket fails its checksum on arrival: the rollout refuses the round
        (CorruptBucketError, nothing written), both slot ranks send it again, and the weights
        match the trainer's."""
        out, proc = demo
        summary = json.loads((out / "summary.json").read_text())
        step3 = summary["steps"][2]
        assert step3["corrupt_resends"] == 2 and step3["checksum_ok"] is True
        assert "the corrupt round was refused (nothing written) and sent again" in proc.stdout
        lines = [json.loads(x) for x in (out / "logs" / "rollout-rank0.jsonl").read_text().splitlines()]
        refused = [x for x in lines if x["event"] == "weight_sync.loaded" and x.get("ok") is False]
        assert len(refused) == 1 and refused[0]["step"] == 3 and refused[0]["checksum_ok"] is False

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--engine", "sglang"], "--engine sglang needs --model-config DIR"),
            (
                ["--engine", "sglang", "--model-config", "/nonexistent"],
                "cannot read /nonexistent/config.json",
            ),
            (["--kill-engine", "2"], "--kill-engine is for --engine sglang"),
            (["--model-config", TINY], "--model-config is for --engine sglang"),
            (
                ["--steps", "3", "--skip-sync", "2", "--corrupt-sync", "2"],
                "--corrupt-sync 2: that step's sync never runs",
            ),
            (["--engine", "sglang", "--model-config", TINY, "--device", "cpu"], "needs a GPU"),
            (
                ["--engine", "sglang", "--model-config", TINY, "--kill-engine", "9"],
                "--kill-engine 9 never runs",
            ),
        ],
    )
    def test_sglang_and_fault_options_are_checked_before_anything_starts(self, tmp_path, args, message):
        proc = lifecycle("demo", "--out", str(tmp_path), *args, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "logs").exists()

    def test_a_config_the_trainer_cannot_build_is_refused(self, tmp_path):
        config = tmp_path / "llama"
        config.mkdir()
        (config / "config.json").write_text(json.dumps({"model_type": "llama"}))
        proc = lifecycle(
            "demo",
            "--out",
            str(tmp_path / "out"),
            "--engine",
            "sglang",
            "--model-config",
            str(config),
            timeout=60,
        )
        assert proc.returncode == 2 and "model_type is 'llama'" in proc.stderr

    def test_bad_fault_spec_is_refused_before_anything_starts(self, tmp_path):
        proc = lifecycle("demo", "--out", str(tmp_path), "--inject-fault", "memory.paws@2")
        assert proc.returncode == 2
        assert "expected [trainer:|rollout:]HOOK@STEP" in proc.stderr
        assert not (tmp_path / "logs").exists()

    def test_skip_sync_of_the_last_step_is_refused_before_anything_starts(self, tmp_path):
        proc = lifecycle("demo", "--out", str(tmp_path), "--steps", "3", "--skip-sync", "3")
        assert proc.returncode == 2
        assert "--skip-sync 3" in proc.stderr and "before the last one" in proc.stderr
        assert not (tmp_path / "logs").exists()

    def test_options_and_help_import_neither_torch_nor_ray(self):
        code = (
            "import sys\n"
            "from actor_integration.tools.cli import build_parser\n"
            "from actor_integration.tools.demo.options import add_demo_arguments\n"
            "try:\n"
            "    build_parser().parse_args(['demo', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "--skip-sync STEP" in proc.stdout and proc.stdout.strip().endswith("[]")

    def test_cuda_without_a_gpu_is_refused(self, tmp_path):
        proc = lifecycle("demo", "--out", str(tmp_path), "--device", "cuda")
        assert proc.returncode != 0 and "torch sees no GPU" in proc.stderr


class TestCheck:
    def test_clean_logs_pass(self, demo):
        out, _ = demo
        proc = lifecycle("check", *map(str, sorted((out / "logs").glob("*.jsonl"))))
        assert proc.returncode == 0, proc.stdout
        assert "clean" in proc.stderr

    def test_hand_edited_log_is_caught_with_its_line(self, demo, tmp_path):
        """Drop the process-group reload of the first sync from PAUSED: the checker names file and line."""
        out, _ = demo
        lines = (out / "logs" / "trainer-rank0.jsonl").read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            event = json.loads(line)
            if (
                event["event"] == "lifecycle.transition"
                and event["operation"] == "sync"
                and event["phase"] == "enter"
            ):
                event["hooks"] = [h for h in event["hooks"] if h["name"] != "process_groups.reload"]
                lines[number - 1] = json.dumps(event)
                break
        else:
            pytest.fail("no sync from PAUSED in the demo log")
        edited = tmp_path / "trainer-rank0.jsonl"
        edited.write_text("\n".join(lines) + "\n")
        proc = lifecycle("check", str(edited))
        assert proc.returncode == 1
        assert f"trainer-rank0.jsonl:{number}" in proc.stdout and "process_groups.reload" in proc.stdout

    def test_a_sleep_on_a_failed_actor_is_caught(self, demo, tmp_path):
        out, _ = demo
        lines = (out / "logs" / "trainer-rank1.jsonl").read_text().splitlines()
        failed_at = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "lifecycle.failed")
        sleep = next(
            json.loads(line)
            for line in lines
            if json.loads(line).get("operation") == "sleep"
            and json.loads(line)["event"] == "lifecycle.transition"
        )
        sleep["t"] = json.loads(lines[failed_at])["t"] + 1e-4
        lines.insert(failed_at + 1, json.dumps(sleep))
        edited = tmp_path / "trainer-rank1.jsonl"
        edited.write_text("\n".join(lines) + "\n")
        proc = lifecycle("check", str(edited))
        assert proc.returncode == 1 and f"trainer-rank1.jsonl:{failed_at + 2}" in proc.stdout

    def test_missing_file(self, tmp_path):
        proc = lifecycle("check", str(tmp_path / "nope.jsonl"))
        assert proc.returncode == 2 and "nope.jsonl" in proc.stderr


class TestTimeline:
    def test_trace_and_png(self, demo, tmp_path):
        out, _ = demo
        proc = lifecycle("timeline", str(out / "logs"), "-o", str(tmp_path / "run"))
        assert proc.returncode == 0, proc.stderr
        trace = json.loads((tmp_path / "run.json").read_text())
        events = trace["traceEvents"]
        assert all("ph" in e and "pid" in e for e in events)
        states = {e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "state"}
        assert {"AWAKE", "PAUSED", "SAVING", "SYNCING", "FAILED"} <= states
        assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class TestDiagramAndDoctor:
    def test_diagram_is_the_table(self):
        proc = lifecycle("diagram")
        assert proc.returncode == 0 and proc.stdout == diagram.mermaid()

    def test_doctor_on_cpu(self):
        proc = lifecycle("doctor", "--json")
        assert proc.returncode == 0, proc.stdout
        report = json.loads(proc.stdout)
        verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
        assert verdicts["CUDA IPC export"] == "skip" and verdicts["torch_memory_saver"] == "ok"
        assert report["transport"] == "shm"

    def test_doctor_flags_what_tms_would_die_on(self):
        import os

        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TMS_INIT_ENABLE": ""}
        proc = subprocess.run(
            [sys.executable, "-m", "actor_integration.tools.cli", "doctor", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 1
        failing = [c for c in json.loads(proc.stdout)["checks"] if c["verdict"] == "fail"]
        assert [c["name"] for c in failing] == ["TMS environment"]
        assert (
            "expandable_segments" in failing[0]["detail"]
            and "TMS_INIT_ENABLE is empty" in failing[0]["detail"]
        )


def test_lifecycle_check_names_an_engine_that_died_and_counts_it(tmp_path, capsys):
    from actor_integration.tools.cli import main
    from tests.helpers.checker_corpus import engine_died_log

    engine_died_log(tmp_path / "rollout.jsonl", restart=False)
    assert main(["check", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "its engine SGLang http://10.0.0.7:30000 died: sglang::scheduler_TP0 (pid 4242" in out
    assert err.strip().endswith("1 machine(s): clean; 1 engine(s) died")

"""The demo's report: its logs read once, the lifecycle's cost per step computed from them."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

import lifecycle
from actor_integration.tools.demo.report import RunLogs, finish, per_rank_rows
from actor_integration.weight_sync import NodeTopology, Place, SlotTopology
from lifecycle import LifecyclePolicy
from lifecycle import logs as lifecycle_logs
from lifecycle.testing import recording_lifecycle


@pytest.fixture
def run_logs(tmp_path: Path) -> Path:
    """Two ranks' logs: a transition before the loop (no step), then two steps of sleep and wake."""
    logs = tmp_path / "logs"
    for rank, role in ((0, "trainer"), (0, "rollout")):
        lifecycle.configure_logging(json_path=logs / f"{role}-rank{rank}.jsonl")
        try:
            lc, _ = recording_lifecycle(LifecyclePolicy(), rank=rank, role=role)
            lc.sleep()  # initialisation: not part of any step
            for step in (1, 2):
                lc.step = step
                lc.wake_up()
                lc.sleep()
            assert lifecycle.flush_logs()
        finally:
            lifecycle.configure_logging(stream=io.StringIO(), level="warning")
    return logs


def transition_seconds(path: Path, steps: set[int]) -> float:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return sum(
        x["duration_ms"] / 1e3
        for x in lines
        if x["event"] == "lifecycle.transition" and x.get("step") in steps
    )


class TestPerRankRows:
    def test_the_lifecycle_cost_per_step_is_the_transitions_of_those_steps(self, run_logs: Path):
        """Seconds of lifecycle.transition (their duration_ms) in the steps given, per step and as a share."""
        logs = RunLogs.read([run_logs])
        walls = {1: 2.0, 2: 3.0}
        rows = {(r["role"], r["rank"]): r for r in per_rank_rows(logs.lanes, {}, walls)}
        for role in ("trainer", "rollout"):
            spent = transition_seconds(run_logs / f"{role}-rank0.jsonl", {1, 2})
            assert spent > 0
            assert rows[(role, 0)]["lifecycle_s_per_step"] == round(spent / 2, 4)
            assert rows[(role, 0)]["lifecycle_share"] == round(spent / 5.0, 4)
            assert rows[(role, 0)]["transitions"] == 5  # the step-less one is counted, not costed

    def test_without_steps_there_is_no_cost_column(self, run_logs: Path):
        (row, *_) = per_rank_rows(RunLogs.read([run_logs]).lanes, {})
        assert row["lifecycle_s_per_step"] is None and row["lifecycle_share"] is None


def one_node_placement() -> SimpleNamespace:
    """What `finish` reads of a `Placement`: one trainer rank and its engine on one node, over shm."""
    topology = NodeTopology.plan(SlotTopology.plan(1, [1]), [Place("n0")], [[Place("n0")]])
    rows = topology.transport_table("shm")
    return SimpleNamespace(
        device="cpu",
        engine="reference",
        trainers=1,
        engine_gpu_counts=[1],
        transport="shm",
        nodes={"n0": "n0 (127.0.0.1)"},
        places={"trainer": {0: {"node_id": "n0"}}, "rollout": {0: {"node_id": "n0"}}},
        topology=topology,
        transports=rows,
        designed=rows,
    )


class TestFinish:
    def test_the_logs_are_read_once_for_the_table_the_check_and_the_timeline(
        self, run_logs: Path, monkeypatch: pytest.MonkeyPatch
    ):
        reads: list[str] = []
        real = lifecycle_logs.read_log

        def counting(path):  # type: ignore[no-untyped-def]
            reads.append(Path(path).name)
            return real(path)

        monkeypatch.setattr(lifecycle_logs, "read_log", counting)
        out = run_logs.parent
        args = SimpleNamespace(bucket_mb=64, inject_fault=[], skip_sync=[])
        placed = one_node_placement()
        driver = SimpleNamespace(
            ok=True,
            faults=[],
            refusals=[],
            checksums={},
            records=[{"step": 1, "wall_s": 2.0, "loss": 3.0}, {"step": 2, "wall_s": 3.0, "loss": 2.0}],
            node_lost=None,
        )
        console = Console(file=io.StringIO(), width=200)
        assert finish(out, console, args, placed, driver, wall=5.0) == 0  # type: ignore[arg-type]
        assert sorted(reads) == ["rollout-rank0.jsonl", "trainer-rank0.jsonl"]
        text = console.file.getvalue()  # type: ignore[attr-defined]
        assert "lifecycle check: clean (2 logs)" in text and "% of step" in text
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ok"] and {r["role"] for r in summary["ranks"]} == {"trainer", "rollout"}
        assert (out / "timeline.json").is_file() and (out / "timeline.png").is_file()

    def test_a_skipped_sync_without_its_refusal_fails_the_run(self, run_logs: Path):
        """The demo promises the refusal after each skipped sync; not seeing it is a failure."""
        args = SimpleNamespace(bucket_mb=64, inject_fault=[], skip_sync=[1])
        placed = one_node_placement()
        driver = SimpleNamespace(
            ok=True,
            faults=[],
            refusals=[],
            checksums={},
            records=[{"step": 1, "wall_s": 1.0, "loss": 1.0}],
            node_lost=None,
        )
        console = Console(file=io.StringIO(), width=200)
        assert finish(run_logs.parent, console, args, placed, driver, wall=1.0) == 1  # type: ignore[arg-type]
        assert "syncs skipped at steps [1]" in console.file.getvalue()  # type: ignore[attr-defined]


class TestEngineVerdicts:
    """The checks of a run on a real engine (SGLang's: the H200 runs them; vLLM's: not yet run on a
    GPU), on made-up step records."""

    @staticmethod
    def verdicts(records, *, corrupt=(), kill=None, killed=None, read_back=(True, True), engine="sglang"):
        import argparse
        import types

        from actor_integration.tools.demo.report import engine_verdicts

        args = argparse.Namespace(corrupt_sync=list(corrupt), kill_engine=kill)
        driver = types.SimpleNamespace(records=records, killed=killed)
        # The rollout's weight_sync.loaded marks, as the timeline reads them from its log.
        marks = [
            types.SimpleNamespace(
                kind="weight_sync", name="weight_sync.loaded", args={"ok": True, "digest_ok": digest}
            )
            for digest in read_back
        ]
        return engine_verdicts(args, driver, [types.SimpleNamespace(role="rollout", marks=marks)], engine)

    @pytest.mark.parametrize("engine", ["sglang", "vllm"])
    def test_a_clean_run_passes_every_check(self, engine):
        records = [
            {"step": 1, "refused_before_sync": True, "resync_identical": True},
            {
                "step": 2,
                "refused_before_sync": True,
                "resync_identical": True,
                "tokens_changed": True,
                "corrupt_resends": 1,
            },
        ]
        result = self.verdicts(
            records, corrupt=[2], engine=engine, read_back=(None, None) if engine == "vllm" else (True, True)
        )
        assert all(ok for _line, ok in result["lines"]) and len(result["lines"]) == 5
        name = {"sglang": "SGLang", "vllm": "vLLM"}[engine]
        assert sum(f"{name}'s" in line for line, _ok in result["lines"]) >= 2

    @pytest.mark.parametrize("read_back", [(True, False), (True, None), ()])
    def test_a_sync_not_read_back_as_sent_fails_the_run(self, read_back):
        """SGLang's schedulers confirm each sync held what was sent; a mismatch, a sync they could
        not read back, or none at all fails the run."""
        records = [{"step": 1, "refused_before_sync": True, "resync_identical": True}]
        lines = dict(self.verdicts(records, read_back=read_back)["lines"])
        (line,) = [k for k in lines if "read back" in k]
        assert (
            lines[line] is False
            and f"{sum(1 for d in read_back if d is True)}/{len(read_back)} syncs" in line
        )

    def test_tokens_that_differ_after_a_resync_fail_the_run_and_name_the_step(self):
        records = [{"step": 1, "refused_before_sync": True, "resync_identical": True}]
        records.append(
            {"step": 2, "refused_before_sync": True, "resync_identical": False, "tokens_changed": True}
        )
        lines = dict(self.verdicts(records)["lines"])
        (line,) = [k for k in lines if "re-syncing" in k]
        assert lines[line] is False and "1/2 steps, not at [2]" in line

    def test_a_corrupt_round_never_resent_and_an_untyped_kill_fail(self):
        records = [{"step": 1, "refused_before_sync": True, "resync_identical": True, "corrupt_resends": 0}]
        killed = {"step": 1, "typed": False, "error": "the killed engine generated", "noticed_s": None}
        lines = self.verdicts(records, corrupt=[1], kill=1, killed=killed)["lines"]
        assert [ok for line, ok in lines if "corrupt" in line or "killed" in line] == [False, False]

    def test_vllms_lines_name_its_workers_and_its_engine_core(self):
        """vLLM's workers read nothing back (a note that says so, not a pass); a kill names EngineCore."""
        records = [{"step": 1, "refused_before_sync": True, "resync_identical": True}]
        killed = {"step": 1, "typed": True, "error": "EngineDiedError: ...", "noticed_s": 0.01}
        lines = dict(self.verdicts(records, read_back=(None,), kill=1, killed=killed, engine="vllm")["lines"])
        assert lines[
            "vLLM's workers verified every bucket before loading; nothing read back after the load (1 syncs loaded)"
        ]
        assert lines["killed vLLM's EngineCore process at step 1: EngineDiedError: ... after 0.01 s"]
        assert not any("schedulers" in line or "SGLang" in line for line in lines)

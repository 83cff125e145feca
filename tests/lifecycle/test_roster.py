"""`lifecycle check` names the ranks a run lost instead of calling it clean (lifecycle.roster)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

import lifecycle
from lifecycle import LifecyclePolicy
from lifecycle.checker import check_files
from lifecycle.logs import Event
from lifecycle.testing import recording_lifecycle

WORLD = 4


def write_run(logs: Path, *, lost: dict[str, list[int]] | None = None) -> None:
    """Four trainer ranks' real logs (world_size bound into every event): init asleep, two steps of
    train; with `lost`, ranks 0 and 1 are then told those ranks were lost with their node."""
    for rank in range(WORLD):
        lifecycle.configure_logging(json_path=logs / f"trainer-rank{rank}.jsonl")
        try:
            lc, _ = recording_lifecycle(LifecyclePolicy(offload_train=True), rank=rank, role="trainer")
            lc.bind(world_size=WORLD)
            lc.sleep()
            for step in (1, 2):
                lc.step = step
                lc.run("train", lambda: None)
            if lost and rank in (0, 1):
                lc.event(
                    Event.RANKS_LOST, "error", lost=lost, reason="node 8f1459e0 (192.0.2.2) lost during train"
                )
            assert lifecycle.flush_logs()
        finally:
            lifecycle.configure_logging(stream=io.StringIO(), level="warning")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("run") / "logs"
    write_run(logs)
    return logs


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class TestMissingRanks:
    def test_every_rank_of_the_world_size_present_is_clean(self, run: Path) -> None:
        assert check_files([run]) == []

    def test_ranks_with_no_log_are_named_with_the_world_size(self, run: Path, tmp_path: Path) -> None:
        """A directory gathered from the surviving nodes only: ranks 2 and 3 are named, not passed over."""
        for rank in (0, 1):
            shutil.copy(run / f"trainer-rank{rank}.jsonl", tmp_path)
        (finding,) = check_files([tmp_path])
        assert finding.role == "trainer" and finding.line == 0
        assert "trainer ranks [2, 3] of world size 4" in finding.message
        assert "lifecycle gather" in finding.message

    def test_a_log_cut_inside_an_operation_is_named_at_its_enter_line(
        self, run: Path, tmp_path: Path
    ) -> None:
        """What a SIGKILLed rank leaves: its last line is the enter transition of step 2's train."""
        for path in run.glob("*.jsonl"):
            shutil.copy(path, tmp_path)
        cut = tmp_path / "trainer-rank3.jsonl"
        kept = lines(cut)
        enter = max(
            i
            for i, e in enumerate(kept)
            if e["event"] == Event.TRANSITION.value and e.get("phase") == "enter"
        )
        cut.write_text("".join(json.dumps(e) + "\n" for e in kept[: enter + 1]))
        (finding,) = check_files([tmp_path])
        assert (finding.path, finding.line, finding.rank) == (str(cut), enter + 1, 3)
        assert "the log ends inside train of step 2, entered here" in finding.message

    def test_a_logged_loss_is_a_finding_even_when_every_file_reads_clean(self, tmp_path: Path) -> None:
        """On a shared filesystem the lost ranks' files are all there and may end cleanly (they were
        idle when their node died): the survivors' `ranks.lost` still names them, once."""
        write_run(tmp_path, lost={"trainer": [2, 3], "rollout": [1]})
        (finding,) = check_files([tmp_path])
        assert finding.rank == 0 and finding.path.endswith("trainer-rank0.jsonl")
        assert "(and 1 other actor(s) were told)" in finding.message
        assert (
            "its driver found trainer ranks [2, 3]; rollout ranks [1] lost (node 8f1459e0" in finding.message
        )

    def test_logs_that_disagree_on_the_world_size_are_named(self, run: Path, tmp_path: Path) -> None:
        for path in run.glob("*.jsonl"):
            shutil.copy(path, tmp_path)
        edited = tmp_path / "trainer-rank1.jsonl"
        events = lines(edited)
        events[-1]["world_size"] = 2
        edited.write_text("".join(json.dumps(e) + "\n" for e in events))
        messages = [f.message for f in check_files([tmp_path])]
        assert any("disagree on the world size: 2 (" in m and ", 4 (" in m for m in messages), messages

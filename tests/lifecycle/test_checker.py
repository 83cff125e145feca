"""The log checker: real machine logs are clean, and each kind of hand edit is caught at its line."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lifecycle import LifecyclePolicy, State
from lifecycle.checker import Finding, LogChecker, check_files, check_lines
from lifecycle.logs import log_paths
from lifecycle.table import TABLE
from lifecycle.testing import recording_lifecycle
from tests.helpers.checker_corpus import (
    VERSIONS,
    assert_finding,
    body,
    build_corpus,
    dump,
    edited,
    engine_died_log,
    find,
    hook_names,
    json_log,
    load,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


# ----------------------------------------------------------------------------------------------


class TestCleanLogs:
    def test_real_logs_give_no_findings(self, corpus: dict[str, Path]) -> None:
        """Logs written by real machines over every scenario, fault and random walk are clean."""
        checker = LogChecker()
        for path in corpus.values():
            checker.feed(str(path), path.read_text().splitlines())
        findings = checker.finish()
        assert findings == [], "\n".join(map(str, findings))
        assert checker.events == sum(len(load(path)) for path in corpus.values()) > 2000
        assert check_files(corpus.values()) == []

    def test_every_row_of_the_table_is_exercised(self, corpus: dict[str, Path]) -> None:
        """The clean corpus replays every row of TABLE, so the checker is tested against all of it."""
        checker = LogChecker()
        for path in corpus.values():
            checker.feed(str(path), path.read_text().splitlines())
        assert checker.finish() == []
        missing = [
            f"{r.operation} {r.source}->{r.dest} ({r.when.value})" for r in TABLE if not checker.rows_seen[r]
        ]
        assert missing == []
        assert checker.machines == len(corpus)

    def test_the_corpus_has_what_the_checks_need(self, corpus: dict[str, Path]) -> None:
        """Failures, recoveries, resolutions, nested no-ops and weight-sync events are all in the corpus."""
        names = [line["event"] for path in corpus.values() for line in load(path)]
        reasons = {line.get("reason") for path in corpus.values() for line in load(path)}
        for event in ("lifecycle.failed", "lifecycle.resolved", "lifecycle.refused", "weight_sync.update"):
            assert event in names
        assert {"idempotent", "nested in train", "nested in save", "held"} <= reasons
        for event in ("lifecycle.hold", "lifecycle.release", "lifecycle.deferred"):
            assert event in names

    def test_a_directory_is_read_as_its_jsonl_files(self, corpus: dict[str, Path]) -> None:
        """Passing the log directory checks every *.jsonl in it (here: the cross-rank sync logs)."""
        directory = corpus["sync/trainer0"].parent
        assert len(log_paths([directory])) == 6
        assert check_files([directory]) == []


class TestReplayFindings:
    def test_dropped_hook(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sync from PAUSED whose process-group reload was removed is reported at its line."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sync", phase="enter", src="PAUSED")
        assert hook_names(lines[i]) == ["process_groups.reload"]
        lines[i]["hooks"] = []
        finding = assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 1,
            "sync from PAUSED did not reload the process groups",
        )
        assert str(finding).startswith(f"{path}:{i + 1} rank 0 trainer: sync from PAUSED")

    def test_swapped_hooks(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """Two hooks of a sleep in the wrong order: routing replay must be cleared before the pause."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="train", phase="exit")
        assert hook_names(lines[i])[0] == "routing_replay.clear"
        hooks = lines[i]["hooks"]
        hooks[0], hooks[-1] = hooks[-1], hooks[0]
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 1,
            "wrong order",
            "expected hooks [routing_replay.clear",
        )

    def test_missing_routing_replay_clear(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep that paused memory without clearing the routing replay first (slime) is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="train", phase="exit")
        lines[i]["hooks"] = [h for h in lines[i]["hooks"] if h["name"] != "routing_replay.clear"]
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, i + 1, "train (exit AWAKE→PAUSED) did not clear the routing replay")

    def test_missing_model_tag_restore(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A wake that did not restore the model tag (slime's lost _switch_model) is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="wake_up", src="PAUSED", dst="AWAKE")
        lines[i]["hooks"] = [h for h in lines[i]["hooks"] if h["name"] != "switch_model"]
        assert_finding(check_files([dump(path, lines)]), path, i + 1, "did not restore the model tag")

    def test_pause_of_a_released_tag(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep from PAUSED that pauses a tag already released (TMS would exit) is reported."""
        path, lines = edited(corpus, "rollout_tags", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep", src="PAUSED", dst="PAUSED")
        assert [h.get("tag") for h in lines[i]["hooks"] if h["name"] == "memory.pause"] == ["weights"]
        lines[i]["hooks"].append({"name": "memory.pause", "ms": 0.01, "ok": True, "tag": "kv_cache"})
        assert_finding(
            check_files([dump(path, lines)]), path, i + 1, "paused tag kv_cache, which was already released"
        )

    def test_changed_src(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A transition whose src differs from the replayed state: the log says AWAKE, the replay PAUSED."""
        path, lines = edited(corpus, "rollout_tags", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep", src="PAUSED", dst="PAUSED")
        lines[i]["src"] = "AWAKE"
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, i + 1, "log says src=AWAKE, replay says PAUSED")
        assert [f.line for f in findings] == [i + 1]  # the replay follows the log: no cascade

    def test_not_an_edge(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A transition the table has no edge for (sleep into SAVING) is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="wake_up")
        lines[i]["dst"] = "SAVING"
        assert_finding(
            check_files([dump(path, lines)]), path, i + 1, "wake_up move PAUSED→SAVING is not an edge"
        )

    def test_deleted_line(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """Deleting a sleep makes the next wake start from a state the replay is not in."""
        path, lines = edited(corpus, "trainer_resident", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep")
        assert lines[i + 1]["event"] == "lifecycle.transition" or lines[i + 1]["event"] == "lifecycle.noop"
        del lines[i]
        findings = check_files([dump(path, lines)])
        assert findings, "a deleted sleep must be noticed"
        assert findings[0].line == i + 1
        assert "replay says AWAKE" in findings[0].message

    def test_body_inserted_while_paused(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A train body logged right after a sleep, without a wake, is reported once, at its line."""
        path, lines = edited(corpus, "trainer_resident", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep")
        later = next(line["t"] for line in lines[i + 1 :] if "t" in line)
        inserted = dict(find_body(lines), t=(lines[i]["t"] + later) / 2, state="AWAKE", operation="train")
        lines.insert(i + 1, inserted)
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings,
            path,
            i + 2,
            "train body logged in AWAKE, but the replay is in PAUSED",
            "released memory",
        )
        assert len(findings) == 1, "\n".join(map(str, findings))

    def test_body_on_released_memory(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A body logged in PAUSED itself: no enter transition, released memory, not its body state."""
        path, lines = edited(corpus, "trainer_resident", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep")
        later = next(line["t"] for line in lines[i + 1 :] if "t" in line)
        lines.insert(
            i + 1, dict(find_body(lines), t=(lines[i]["t"] + later) / 2, state="PAUSED", operation="train")
        )
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings, path, i + 2, "train body ran on released memory: replayed residency {*: released}"
        )
        assert_finding(findings, path, i + 2, "train body without its enter transition")

    def test_body_in_the_wrong_state(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A save body logged in AWAKE instead of SAVING is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.body", operation="save")
        lines[i]["state"] = "AWAKE"
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 1,
            "save body logged in AWAKE",
            "runs save bodies in SAVING",
        )

    def test_flipped_residency(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A transition whose logged residency differs from what its hooks did is reported, once."""
        path, lines = edited(corpus, "rollout_tags", tmp_path)
        i = find(lines, "lifecycle.transition", operation="wake_up", dst="PAUSED")
        assert lines[i]["residency"]["weights"] == "resident"
        lines[i]["residency"]["weights"] = "released"
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings, path, i + 1, "logged residency differs", "weights: logged released, replay resident"
        )
        assert len(findings) == 1

    def test_flipped_groups(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep that logs its process groups alive after destroying them is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", operation="train", phase="exit")
        lines[i]["groups"] = "alive"
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 1,
            "logged process groups alive, replay says destroyed",
        )

    def test_noop_the_table_would_not_make(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep no-op right after a full wake (every tag resident) is reported."""
        path, lines = edited(corpus, "rollout_tags", tmp_path)
        i = find(lines, "lifecycle.transition", operation="wake_up", dst="AWAKE")
        noop = dict(
            lines[find(lines, "lifecycle.noop", reason="idempotent")], state="AWAKE", operation="sleep"
        )
        lines.insert(i + 1, noop)
        assert_finding(check_files([dump(path, lines)]), path, i + 2, "sleep from AWAKE is not a no-op here")

    def test_tagged_noop_needs_a_released_tag(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep no-op from PAUSED is fine while some tag is released, not when all are resident."""
        path, lines = edited(corpus, "rollout_tags", tmp_path)
        i = find(lines, "lifecycle.noop", operation="sleep", state="PAUSED", nth=1)  # weights still resident
        assert check_files([path]) == []
        lines[i]["targets"] = ["weights"]  # the field a machine may log: then no subset is guessed
        assert_finding(check_files([dump(path, lines)]), path, i + 1, "every targeted tag is released")

    def test_nested_noop_outside_a_body(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A 'nested in train' no-op with no train body running is reported."""
        path, lines = edited(corpus, "trainer_resident", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep")
        nested = dict(lines[find(lines, "lifecycle.noop", reason="nested in train")], state="PAUSED")
        lines.insert(i + 1, nested)
        assert_finding(
            check_files([dump(path, lines)]), path, i + 2, "'nested in train' outside a train body"
        )

    def test_operation_after_a_failure(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep logged after a failure, instead of a recover, is reported as a sleep on a FAILED actor."""
        path, lines = edited(corpus, "failures", tmp_path)
        i = find(lines, "lifecycle.failed", operation="sleep")
        recover = lines[find(lines, "lifecycle.transition", operation="recover")]
        sleep = dict(recover, operation="sleep", src="AWAKE", dst="PAUSED", t=recover["t"] - 1e-3)
        lines.insert(i + 1, sleep)
        assert_finding(
            check_files([dump(path, lines)]), path, i + 2, "sleep on a FAILED actor", f"line {i + 1}"
        )

    def test_body_after_a_failure(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "failures", tmp_path)
        i = find(lines, "lifecycle.failed")
        later = find(lines, "lifecycle.transition", operation="recover")
        lines.insert(i + 1, dict(find_body(lines), t=lines[later]["t"] - 1e-6))
        assert_finding(check_files([dump(path, lines)]), path, i + 2, "body on a FAILED actor")

    def test_recover_reran_hooks(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A recover that resumes memory the residency says is resident is reported."""
        path, lines = edited(corpus, "failures", tmp_path)
        i = find(lines, "lifecycle.transition", operation="recover", dst="AWAKE")
        assert "memory.resume" not in hook_names(lines[i])
        lines[i]["hooks"].insert(0, {"name": "memory.resume", "ms": 0.01, "ok": True, "tag": "*"})
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 1,
            "recover to AWAKE re-ran hooks the residency did not need",
            "resumed tag *",
        )

    def test_failure_hooks_not_a_prefix(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A failure whose logged calls are not the start of the plan is reported."""
        path, lines = edited(corpus, "failures", tmp_path)
        i = find(lines, "lifecycle.failed", hook="switch_model")
        assert hook_names(lines[i]) == ["memory.resume", "process_groups.reload", "switch_model"]
        del lines[i]["hooks"][0]
        assert_finding(check_files([dump(path, lines)]), path, i + 1, "its plan cannot have run")

    def test_unresolved_recover(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A recover from unknown residency with its lifecycle.resolved line deleted is reported."""
        path, lines = edited(corpus, "failures", tmp_path)
        i = find(lines, "lifecycle.resolved")
        del lines[i]
        assert_finding(
            check_files([dump(path, lines)]), path, i + 1, "recover ran with unknown", "no lifecycle.resolved"
        )

    def test_time_going_back(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A transition whose t is not after the previous event's t is reported."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", nth=3)
        lines[i]["t"] -= 10.0
        assert_finding(check_files([dump(path, lines)]), path, i + 1, "does not increase")

    def test_not_json(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A line that is not JSON (a cut write, an editor accident) is reported with its number."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        dump(path, lines)
        text = path.read_text().splitlines()
        text[4] = text[4][: len(text[4]) // 2]
        path.write_text("\n".join(text) + "\n")
        assert_finding(check_files([path]), path, 5, "line is not JSON")

    def test_event_before_configured(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        lines[0], lines[1] = lines[1], lines[0]
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            1,
            "comes before this machine's lifecycle.configured (line 2)",
        )

    def test_machine_without_configured(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        del lines[0]
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, 1, "no lifecycle.configured")
        assert len(findings) == 1

    def test_malformed_field(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A hand-typed state that is not a State is a finding, not a crash."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition")
        lines[i]["dst"] = "ASLEEP"
        assert_finding(
            check_files([dump(path, lines)]), path, i + 1, "malformed lifecycle.transition", "'ASLEEP'"
        )


class TestHeldFindings:
    def test_a_pause_inside_a_held_scope(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A sleep that ran its hooks while a hold was taken is reported at its line."""
        path, lines = edited(corpus, "trainer_resident", tmp_path)
        i = find(lines, "lifecycle.transition", operation="sleep", src="AWAKE")
        hold = {k: lines[i][k] for k in ("rank", "role", "step", "timestamp", "level")}
        lines.insert(i + 1, dict(hold, event="lifecycle.release", state="PAUSED", holds=0, deferred=[]))
        lines.insert(i, dict(hold, event="lifecycle.hold", state="AWAKE", holds=1))
        assert_finding(
            check_files([dump(path, lines)]),
            path,
            i + 2,
            "sleep from AWAKE on ['*'] ran hooks inside a held scope (held since line",
            "defers it to the release of the last hold",
        )

    def test_a_last_release_that_left_a_deferred_sleep(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A scope whose release ran no sleep although one was deferred (it left the actor AWAKE) is reported."""
        path, lines = edited(corpus, "held_scopes", tmp_path)
        i = find(lines, "lifecycle.transition", operation="release")
        assert lines[i + 1]["event"] == "lifecycle.release" and lines[i + 1]["deferred"] == ["*"]
        del lines[i]
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings, path, i + 1, "was released with the sleep of ['*'] deferred, but no sleep ran", "AWAKE"
        )

    def test_deferred_tags_that_differ_from_the_replay(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "held_rollout", tmp_path)
        i = find(lines, "lifecycle.deferred", deferred=["kv_cache"])
        lines[i]["deferred"] = ["weights", "kv_cache"]
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings,
            path,
            i + 1,
            "the log defers the sleep of ['weights', 'kv_cache'], the replay ['kv_cache']",
        )

    def test_a_release_with_no_hold(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "held_scopes", tmp_path)
        i = next(
            n
            for n, line in enumerate(lines[:-1])
            if line["event"] == "lifecycle.hold" and lines[n + 1]["event"] == "lifecycle.release"
        )
        del lines[i]
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, i + 1, "release with no hold taken")
        assert len(findings) == 1, "\n".join(map(str, findings))

    def test_a_held_no_op_outside_a_scope(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "held_rollout", tmp_path)
        i = find(lines, "lifecycle.noop", reason="held")
        noop = lines.pop(i)
        lines.insert(1, noop)
        assert_finding(check_files([dump(path, lines)]), path, 2, "no-op 'held' outside a held scope")


class TestContentsFindings:
    def test_generate_on_discarded_weights(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A driver that skipped a sync (its declarations gone) served discarded weights: reported at the
        generate, naming where the weights were discarded."""
        path, lines = edited(corpus, "sync/engine0", tmp_path)
        released = find(lines, "lifecycle.transition", 1, operation="sleep")
        assert lines[released]["contents"]["weights"] == "discarded"
        for nth in (3, 2):  # the second version's two declarations
            del lines[find(lines, "lifecycle.contents", nth)]
        generate = find(lines, "lifecycle.body", 1, operation="generate")
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings,
            path,
            generate + 1,
            "generate on invalid weights",
            f"tag 'weights' discarded since line {released + 1}",
        )

    def test_generate_after_a_sync_that_stopped_part_way(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        path, lines = edited(corpus, "sync/engine0", tmp_path)
        partial = find(lines, "lifecycle.contents", 0)
        del lines[find(lines, "lifecycle.contents", 1)]
        generate = find(lines, "lifecycle.body", 0, operation="generate")
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, generate + 1, f"tag 'weights' unknown since line {partial + 1}")

    def test_logged_contents_differ_from_the_replay(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "sync/engine0", tmp_path)
        i = find(lines, "lifecycle.transition", 0, operation="sleep")
        lines[i]["contents"]["weights"] = "valid"
        findings = check_files([dump(path, lines)])
        assert_finding(
            findings, path, i + 1, "logged contents differ", "weights: logged valid, replay discarded"
        )
        assert len(findings) == 1, "\n".join(map(str, findings))

    def test_weights_declared_outside_a_sync_body(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        path, lines = edited(corpus, "sync/engine0", tmp_path)
        i = find(lines, "lifecycle.contents", 1)
        moved = lines.pop(i)
        j = find(lines, "lifecycle.body", 0, operation="generate")
        moved["t"] = lines[j]["t"]
        lines.insert(j, moved)
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, j + 1, "weights declared valid outside a sync body")


class TestEditsAnywhere:
    """Single edits at random places of the random-walk logs are each caught at the edited line."""

    SAMPLES = 80

    def sites(
        self, corpus: dict[str, Path], keep: Callable[[dict[str, Any]], bool]
    ) -> list[tuple[Path, int]]:
        found = [
            (path, i)
            for name, path in corpus.items()
            if name.startswith("walk")
            for i, line in enumerate(load(path))
            if keep(line)
        ]
        random.Random(0).shuffle(found)
        assert len(found) >= self.SAMPLES
        return found[: self.SAMPLES]

    def test_any_dropped_hook(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        for path, i in self.sites(corpus, lambda line: line["event"] in _HOOKED and bool(line["hooks"])):
            lines = load(path)
            del lines[i]["hooks"][random.Random(i).randrange(len(lines[i]["hooks"]))]
            copy = dump(tmp_path / path.name, lines)
            assert any(f.line == i + 1 for f in check_files([copy])), f"{path.name}:{i + 1}"

    def test_any_flipped_residency(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        flip = {"resident": "released", "released": "resident", "unknown": "resident"}
        for path, i in self.sites(corpus, lambda line: line["event"] in _HOOKED):
            lines = load(path)
            tag = random.Random(i).choice(sorted(lines[i]["residency"]))
            lines[i]["residency"][tag] = flip[lines[i]["residency"][tag]]
            copy = dump(tmp_path / path.name, lines)
            assert any(f.line == i + 1 and "residency" in f.message for f in check_files([copy])), (
                f"{path.name}:{i + 1}"
            )

    def test_any_changed_src(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        for path, i in self.sites(corpus, lambda line: line["event"] in _HOOKED):
            lines = load(path)
            others = [s.value for s in State if s.value != lines[i]["src"]]
            lines[i]["src"] = random.Random(i).choice(others)
            copy = dump(tmp_path / path.name, lines)
            assert any(f.line == i + 1 for f in check_files([copy])), f"{path.name}:{i + 1}"

    def test_any_deleted_state_change(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """Deleting a transition that changes the state is noticed at or after its line."""
        for path, i in self.sites(
            corpus, lambda line: line["event"] in _HOOKED and line["src"] != line["dst"]
        ):
            lines = load(path)
            if not any(line["event"].startswith("lifecycle.") for line in lines[i + 1 :]):
                continue  # nothing after it to contradict
            del lines[i]
            copy = dump(tmp_path / path.name, lines)
            assert any(f.line >= i + 1 for f in check_files([copy])), f"{path.name}:{i + 1}"


_HOOKED = ("lifecycle.transition", "lifecycle.failed")


def find_body(lines: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(lines[find(lines, "lifecycle.body")])


class TestWeightSyncFindings:
    def test_second_coordinator(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A second rank claiming to coordinate a slot's version (vime #57) is reported at its line."""
        paths = copy_sync(corpus, tmp_path)
        path = paths["trainer1"]
        lines = load(path)
        i = find(lines, "weight_sync.update", version=2)
        lines[i]["coordinator"] = True
        dump(path, lines)
        findings = check_files(list(paths.values()))
        finding = assert_finding(
            findings,
            path,
            i + 1,
            "rank 1 coordinated, but the coordinator is the slot's first rank 0",
            "vime #57",
        )
        assert (finding.rank, finding.role) == (1, "trainer")

    def test_rank_dropped_from_a_version(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A rank whose update line is missing is reported at the coordinator's line."""
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["trainer3"])
        del lines[find(lines, "weight_sync.update", version=3)]
        dump(paths["trainer3"], lines)
        coordinator = load(paths["trainer2"])
        j = find(coordinator, "weight_sync.update", version=3)
        findings = check_files(list(paths.values()))
        assert_finding(findings, paths["trainer2"], j + 1, "slot 1 version 3: ranks [3] did not report")

    def test_rank_dropped_from_the_ranks_field(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["trainer1"])
        i = find(lines, "weight_sync.update", version=1)
        lines[i]["ranks"] = [0]
        dump(paths["trainer1"], lines)
        findings = check_files(list(paths.values()))
        assert_finding(findings, paths["trainer1"], i + 1, "ranks [0] differ from [0, 1]")

    def test_two_transports(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["trainer3"])
        i = find(lines, "weight_sync.update", version=2)
        lines[i]["transport"] = "gloo"
        dump(paths["trainer3"], lines)
        assert_finding(
            check_files(list(paths.values())),
            paths["trainer3"],
            i + 1,
            "transport 'gloo' differs from 'cuda_ipc'",
        )

    def test_update_outside_syncing(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """An update moved out of its sync body (after the sync's exit) is reported."""
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["trainer0"])
        i = find(lines, "weight_sync.update", version=1)
        update = lines.pop(i)
        j = find(lines, "lifecycle.transition", operation="sync", phase="exit")
        lines.insert(j + 1, update)
        dump(paths["trainer0"], lines)
        assert_finding(
            check_files(list(paths.values())), paths["trainer0"], j + 2, "logged in PAUSED", "SYNCING"
        )

    def test_loaded_outside_syncing(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["engine0"])
        i = find(lines, "weight_sync.loaded", version=2)
        loaded = lines.pop(i)
        lines.insert(find(lines, "lifecycle.body", operation="generate"), loaded)
        dump(paths["engine0"], lines)
        j = find(load(paths["engine0"]), "weight_sync.loaded", version=2)
        assert_finding(
            check_files(list(paths.values())),
            paths["engine0"],
            j + 1,
            "weight_sync.loaded (version 2) logged in AWAKE",
        )

    def test_a_load_whose_written_weights_differ_from_what_was_sent(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        """A load logged with digest_ok false (the engine read back other bytes than were sent) is
        a finding at its line; true or absent (an engine that cannot read back) is none."""
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["engine0"])
        i = find(lines, "weight_sync.loaded", version=2)
        lines[i]["digest_ok"] = True
        dump(paths["engine0"], lines)
        assert check_files(list(paths.values())) == []
        lines[i].update(digest_ok=False, buckets=[3])
        dump(paths["engine0"], lines)
        assert_finding(
            check_files(list(paths.values())),
            paths["engine0"],
            i + 1,
            "the engine's weights differ from what was sent",
            "buckets [3]",
        )

    def test_versions_must_increase(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["engine1"])
        i = find(lines, "weight_sync.loaded", version=3)
        lines[i]["version"] = 1
        dump(paths["engine1"], lines)
        assert_finding(
            check_files(list(paths.values())), paths["engine1"], i + 1, "version 1 does not increase"
        )

    def test_a_failed_version_may_be_retried(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A failed update (ok=false) followed by the same version again is a retry; two good ones are not."""
        paths = copy_sync(corpus, tmp_path)
        lines = load(paths["trainer0"])
        i = find(lines, "weight_sync.update", version=2)
        lines.insert(i, dict(lines[i], ok=False, error="WeightSyncTimeout('rank 1 did not arrive')"))
        dump(paths["trainer0"], lines)
        assert check_files(list(paths.values())) == []
        lines[i]["ok"] = True
        dump(paths["trainer0"], lines)
        findings = check_files(list(paths.values()))
        assert_finding(findings, paths["trainer0"], i + 2, "version 2 does not increase")
        assert_finding(findings, paths["trainer0"], i + 2, "rank 0 reported this update twice")

    def test_a_rank_outside_every_slot_is_not_cross_checked(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        """Updates with slot=None (a rank whose GPU hosts no engine) have no slot to agree with."""
        path = Path(shutil.copy(corpus["sync/trainer3"], tmp_path / "trainer3.jsonl"))
        # rank 2's log is read, but without its updates: rank 3's slot misses them
        other = dump(
            tmp_path / "trainer2.jsonl",
            [x for x in load(corpus["sync/trainer2"]) if x["event"] != "weight_sync.update"],
        )
        findings = check_files([path, other])
        assert_finding(findings, path, find(load(path), "weight_sync.update") + 1, "ranks [2] did not report")
        lines = load(path)
        for line in lines:
            if line["event"] == "weight_sync.update":
                line |= {"slot": None, "ranks": [], "coordinator": False}
        assert check_files([dump(path, lines), other]) == []

    def test_one_rank_s_log_alone_gives_no_cross_rank_finding(self, corpus: dict[str, Path]) -> None:
        """The ranks a slot shares with one rank are not expected to report when their logs are not given."""
        for name in ("sync/trainer0", "sync/trainer1", "sync/trainer2", "sync/trainer3", "sync/engine0"):
            assert check_files([corpus[name]]) == [], name  # trainer1 alone: its coordinator is not read

    def test_a_rank_whose_log_is_read_must_report(self, corpus: dict[str, Path], tmp_path: Path) -> None:
        """A rank given among the logs but silent for every version is still reported missing."""
        paths = copy_sync(corpus, tmp_path)
        lines = [x for x in load(paths["trainer1"]) if x["event"] != "weight_sync.update"]
        dump(paths["trainer1"], lines)
        findings = check_files([paths["trainer0"], paths["trainer1"]])
        coordinator = load(paths["trainer0"])
        for version in VERSIONS:
            j = find(coordinator, "weight_sync.update", version=version)
            assert_finding(findings, paths["trainer0"], j + 1, f"version {version}: ranks [1] did not report")

    def test_a_single_rank_job_gives_no_cross_rank_finding(self, tmp_path: Path) -> None:
        """A one-rank job (its slot is itself) coordinates its own slot: clean."""
        path = tmp_path / "solo.jsonl"
        with json_log(path):
            lc, rec = recording_lifecycle(
                LifecyclePolicy(offload_train=True), initial=State.PAUSED, rank=0, role="trainer"
            )
            for version in VERSIONS:

                def update(version: int = version) -> None:
                    rec.check_body(lc, "sync")
                    lc.event(
                        "weight_sync.update",
                        slot=0,
                        version=version,
                        transport="shm",
                        coordinator=True,
                        ranks=[0],
                    )

                lc.run("train", body(rec, lc, "train"))
                lc.run("sync", update)
        assert check_files([path]) == []

    def test_update_without_a_machine(self, tmp_path: Path) -> None:
        line = {"event": "weight_sync.update", "rank": 5, "role": "trainer", "slot": 0, "version": 1}
        line |= {"transport": "gloo", "coordinator": True, "ranks": [5]}
        findings = check_lines([json.dumps(line)], "x.jsonl")
        assert [(f.line, f.rank) for f in findings] == [(0, None), (1, 5)]
        assert "no lifecycle machine" in findings[1].message
        del line["rank"], line["role"]  # logged without a lifecycle: nothing to check it against
        (finding,) = check_lines([json.dumps(line)], "x.jsonl")
        assert finding.line == 0 and finding.message.startswith("no lifecycle events")


def copy_sync(corpus: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, path in corpus.items():
        if name.startswith("sync/"):
            out[path.stem] = Path(shutil.copy(path, tmp_path / path.name))
    assert check_files(list(out.values())) == []
    return out


class TestInput:
    def test_finding_reads_as_file_line_who_what(self) -> None:
        finding = Finding("rank3.jsonl", 42, 3, "trainer", "sleep on a FAILED actor")
        assert str(finding) == "rank3.jsonl:42 rank 3 trainer: sleep on a FAILED actor"
        assert str(Finding("a.jsonl", 1, None, None, "x")) == "a.jsonl:1: x"

    def test_missing_file_is_refused_before_reading(self, tmp_path: Path) -> None:
        good = tmp_path / "good.jsonl"
        good.write_text("")
        with pytest.raises(FileNotFoundError, match="does not exist"):
            check_files([good, tmp_path / "missing.jsonl"])
        (tmp_path / "empty_dir").mkdir()
        with pytest.raises(FileNotFoundError, match=r"no \*\.jsonl"):
            check_files([tmp_path / "empty_dir"])
        with pytest.raises(ValueError, match="no log files"):
            check_files([])

    def test_lines_that_are_not_events(self) -> None:
        findings = check_lines(["", "[1, 2]", '{"no": "event"}', "{oops"], "f.jsonl")
        assert [f.line for f in findings] == [0, 2, 3, 4]
        assert "none of its 3 line(s) is a log event" in findings[0].message
        assert "not JSON" in findings[3].message

    def test_a_finding_about_the_whole_file_has_no_line_number(self) -> None:
        assert (
            str(Finding("a.jsonl", 0, None, None, "no lifecycle events: x"))
            == "a.jsonl: no lifecycle events: x"
        )

    def test_a_lone_surrogate_in_a_log_still_prints(self) -> None:
        """JSON may carry "\\udc80"; the finding prints it escaped instead of failing to encode."""
        (finding,) = [
            f for f in check_lines(['{"event": "lifecycle.noop", "rank": "\\udc80"}'], "s.jsonl") if f.line
        ]
        assert "\\udc80" in str(finding) and str(finding).encode("utf-8")


class TestNothingToCheck:
    def test_an_empty_file_is_a_finding_not_clean(self, tmp_path: Path) -> None:
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        (finding,) = check_files([empty])
        assert (finding.path, finding.line) == (str(empty), 0)
        assert str(finding) == (
            f"{empty}: no lifecycle events: the file is empty; is it a lifecycle log? per-rank logs are "
            "written by lifecycle.configure_logging(json_path=...) at level info"
        )

    def test_another_app_s_structlog_file_is_a_finding_naming_it(self, tmp_path: Path) -> None:
        other = tmp_path / "web.jsonl"
        lines = [
            {"event": "user logged in", "level": "info", "user": "bob"},
            {"event": "request done", "status": 200},
        ]
        (finding,) = check_files([dump(other, lines)])
        assert finding.line == 0 and finding.path == str(other)
        assert "no lifecycle events: none of its 2 event(s) is a lifecycle.* event" in finding.message

    def test_a_file_of_garbled_lines_says_none_is_an_event(self, tmp_path: Path) -> None:
        garbled = tmp_path / "garbled.jsonl"
        garbled.write_text("\x00\x00\x00\nhello\n")
        findings = check_files([garbled])
        assert [f.line for f in findings] == [0, 1, 2]
        assert "none of its 2 line(s) is a log event" in findings[0].message

    def test_an_empty_file_beside_good_logs_is_the_only_finding(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        empty = tmp_path / "rank7.jsonl"
        empty.write_text("\n\n")
        (finding,) = check_files([corpus["trainer_offload"], empty])
        assert finding.path == str(empty) and "no lifecycle events" in finding.message


class TestGarbledLines:
    def test_a_garbled_line_is_a_finding_and_the_rest_is_still_checked(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        """A line that is not JSON is reported at its number; an edit after it is still found."""
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", nth=6)
        lines[i]["hooks"] = lines[i]["hooks"][1:]
        text = [json.dumps(line) for line in lines]
        text[3] = "}{ not json"
        path.write_text("\n".join(text) + "\n")
        findings = check_files([path])
        assert_finding(findings, path, 4, "line is not JSON")
        assert_finding(findings, path, i + 1, "expected hooks")

    def test_a_line_missing_a_field_is_a_finding_at_its_line(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        path, lines = edited(corpus, "trainer_offload", tmp_path)
        i = find(lines, "lifecycle.transition", nth=2)
        del lines[i]["dst"]
        j = find(lines, "lifecycle.transition", nth=4, hooks=lambda hooks: len(hooks) > 1)
        assert j > i + 1
        lines[j]["hooks"] = lines[j]["hooks"][1:]
        findings = check_files([dump(path, lines)])
        assert_finding(findings, path, i + 1, "malformed lifecycle.transition", "has no 'dst' field")
        assert_finding(findings, path, j + 1, "expected hooks")

    def test_a_time_that_is_not_a_finite_number_is_malformed(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        """Python's JSON reads NaN, Infinity and 1e400 (as inf): none of them is a time."""
        for bad, shown in (("NaN", "nan"), ("Infinity", "inf"), ("1e400", "inf"), ("1" + "0" * 400, "1000")):
            path, lines = edited(corpus, "trainer_offload", tmp_path)
            i = find(lines, "lifecycle.transition", nth=2)
            text = [json.dumps(line) for line in lines]
            text[i] = text[i].replace(f'"t": {lines[i]["t"]!r}', f'"t": {bad}')
            path.write_text("\n".join(text) + "\n")
            findings = check_files([path])
            assert_finding(findings, path, i + 1, f"t={shown}", "is not a time in epoch seconds")

    def test_a_garbled_configured_line_is_two_findings_not_a_cascade(
        self, corpus: dict[str, Path], tmp_path: Path
    ) -> None:
        """A cut lifecycle.configured is reported, and so is the machine it leaves unconfigured, once;
        the machine's sync updates still count for its slot."""
        paths = copy_sync(corpus, tmp_path)
        text = paths["trainer1"].read_text().splitlines()
        assert json.loads(text[0])["event"] == "lifecycle.configured"
        text[0] = text[0][:120]
        paths["trainer1"].write_text("\n".join(text) + "\n")
        first = next(
            n for n, line in enumerate(text[1:], 2) if json.loads(line)["event"].startswith("lifecycle.")
        )
        findings = check_files(list(paths.values()))
        assert [(Path(f.path).name, f.line) for f in findings] == [
            ("trainer1.jsonl", 1),
            ("trainer1.jsonl", first),
        ]
        assert "line is not JSON" in findings[0].message
        assert "line 1 before it cannot be read: it may have been this machine's lifecycle.configured" in (
            findings[1].message
        )


class TestEnginesDied:
    """An engine server that died (`rollout.server_died`) leaves its machine where it was (no finding),
    and the checker names it, unless a restart configured the machine again after it."""

    def test_a_death_is_named_with_what_exited_and_is_no_finding(self, tmp_path: Path) -> None:
        path = engine_died_log(tmp_path / "rollout.jsonl", restart=False)
        run = LogChecker()
        run.feed(str(path), path.read_text().splitlines())
        assert run.finish() == [] and run.ended_failed() == []
        (line,) = run.engines_died()
        assert (
            line.startswith(f"{path}:")
            and " rank 3 rollout: its engine SGLang http://10.0.0.7:30000 died: " in line
        )
        assert line.endswith(
            "sglang::scheduler_TP0 (pid 4242, exit code -9) during generate; not restarted in this log"
        )

    def test_a_restart_after_the_death_clears_it(self, tmp_path: Path) -> None:
        path = engine_died_log(tmp_path / "rollout.jsonl", restart=True)
        run = LogChecker()
        run.feed(str(path), path.read_text().splitlines())
        assert run.finish() == [] and run.engines_died() == []

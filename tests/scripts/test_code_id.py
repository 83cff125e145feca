"""scripts/code_id.py: the id of the code a GPU run ran, and forgetting steps that ran other code."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_script


@pytest.fixture(scope="module")
def code_id() -> ModuleType:
    return load_script("code_id")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name, text in {
        "lifecycle/machine.py": "STATES = 5\n",
        "actor_integration/engines/x.py": "x = 1\n",
        "scripts/gpu_check.sh": "echo hi\n",
        "tests/gpu/test_x.py": "def test(): pass\n",
        "pyproject.toml": "[project]\n",
        "docs/measurements.md": "# figures\n",
        "README.md": "# read me\n",
        "tests/lifecycle/test_machine.py": "def test(): pass\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_id_covers_the_code_and_the_gpu_tests_not_the_docs_the_cpu_tests_or_the_caches(code_id, repo):
    first = code_id.line(repo)
    assert first.startswith("code ") and first.endswith("(5 files)")
    (repo / "docs/measurements.md").write_text("# figures, a note written after the run\n")
    (repo / "README.md").write_text("changed\n")
    (repo / "tests/lifecycle/test_machine.py").write_text("def test_more(): pass\n")
    (repo / "lifecycle/__pycache__").mkdir()
    (repo / "lifecycle/__pycache__/machine.cpython-312.pyc").write_bytes(b"\0")
    (repo / "tests/gpu/x.pyc").write_bytes(b"\0")
    assert code_id.line(repo) == first
    (repo / "lifecycle/machine.py").write_text("STATES = 6\n")
    assert code_id.line(repo) != first


def test_a_file_moved_changes_the_id_even_with_the_same_bytes(code_id, repo):
    first = code_id.line(repo)
    (repo / "lifecycle/machine.py").rename(repo / "lifecycle/states.py")
    assert code_id.line(repo) != first


def test_pinning_the_same_code_keeps_the_steps_done(code_id, repo, tmp_path, capsys):
    work = tmp_path / "work"
    assert code_id.pin(work, repo) is True
    (work / "done").write_text("bench\ndemo\n")
    (work / "summary.txt").write_text("install rc=0 33s\nbench_sglang_sync rc=0 100s\n")
    assert code_id.pin(work, repo) is True
    assert (work / "done").read_text() == "bench\ndemo\n"
    assert capsys.readouterr().out.splitlines() == [code_id.line(repo)] * 2
    assert (work / "code-id").read_text().strip() == code_id.line(repo)


def test_pinning_other_code_forgets_the_steps_keeps_the_install_and_says_what_differs(
    code_id, repo, tmp_path, capsys
):
    work = tmp_path / "work"
    code_id.pin(work, repo)
    (work / "done").write_text("bench\n")
    (work / "summary.txt").write_text("install rc=0 33s\nbench_sglang_sync rc=0 100s\n")
    before = code_id.line(repo)
    (repo / "lifecycle/machine.py").write_text("STATES = 6\n")
    (repo / "tests/gpu/test_y.py").write_text("\n")
    (repo / "scripts/gpu_check.sh").unlink()
    capsys.readouterr()
    assert code_id.pin(work, repo) is False
    assert not (work / "done").exists()
    assert (work / "summary.txt").read_text() == "install rc=0 33s\n"
    said = capsys.readouterr().out
    assert f"({before} -> {code_id.line(repo)}): they run again" in said
    assert "  changed lifecycle/machine.py" in said
    assert "  removed scripts/gpu_check.sh" in said
    assert "  added tests/gpu/test_y.py" in said


def test_the_command_line(code_id, capsys):
    assert code_id.main([]) == 0
    assert capsys.readouterr().out.strip() == code_id.line()
    assert code_id.main(["--pin"]) == 2

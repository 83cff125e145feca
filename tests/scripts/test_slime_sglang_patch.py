"""scripts/slime_sglang_patch.py: slime's SGLang patches over a wheel's sglang/, the changed files out."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slime_sglang_patch.py"

ORIGINAL = "def path(route):\n    return route.path\n"
PATCHED = "def path(route):\n    return getattr(route, 'path', None)\n"


def _diff(old: str, new: str, path: str) -> str:
    """A git diff of one file, as slime's patches are written."""
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    body = "".join(f"-{line}" for line in old_lines) + "".join(f"+{line}" for line in new_lines)
    return (
        f"diff --git a/{path} b/{path}\nindex 1111111..2222222 100644\n--- a/{path}\n+++ b/{path}\n"
        f"@@ -1,{len(old_lines)} +1,{len(new_lines)} @@\n{body}"
    )


def _new_file(text: str, path: str) -> str:
    lines = text.splitlines(keepends=True)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..3333333\n--- /dev/null\n"
        f"+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}" for line in lines)
    )


def _slime(tmp_path: Path, patches: dict[str, str]) -> tuple[Path, str]:
    """A git repository holding docker/patch/latest/NAME for each patch; its commit."""
    repo = tmp_path / "slime"
    (repo / "docker" / "patch" / "latest").mkdir(parents=True)
    for name, text in patches.items():
        (repo / "docker" / "patch" / "latest" / name).write_text(text)
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
    )
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "patches"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=env)
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return repo, commit


def _wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "sglang-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/srt/utils/common.py", ORIGINAL)
        zf.writestr("sglang/srt/untouched.py", "x = 1\n")
        zf.writestr("sglang-0.0.1.dist-info/METADATA", "Name: sglang\n")
    return wheel


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_it_applies_the_package_files_writes_only_those_changed_and_names_what_it_left_out(
    tmp_path: Path,
) -> None:
    sglang = (
        _diff(ORIGINAL, PATCHED, "python/sglang/srt/utils/common.py")
        + _new_file("y = 2\n", "python/sglang/srt/weight_sync/added.py")
        + _diff("int f();\n", "int g();\n", "sgl-kernel/csrc/kernel.cu")
    )
    slime, commit = _slime(tmp_path, {"sglang.patch": sglang})
    out = tmp_path / "out"
    proc = _run(
        "--slime", str(slime), "--commit", commit, "--wheel", str(_wheel(tmp_path)), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "sglang/srt/utils/common.py").read_text() == PATCHED
    assert (out / "sglang/srt/weight_sync/added.py").read_text() == "y = 2\n"
    assert not (out / "sglang/srt/untouched.py").exists()  # only what the patches change travels
    report = (out / "PATCHED").read_text()
    assert "sglang.patch: 2 file(s) applied" in report
    assert "left out (not in the wheel): sgl-kernel/csrc/kernel.cu" in report
    assert "sglang-top_p.patch: not at this commit, skipped" in report
    assert "wrote sglang/srt/weight_sync/added.py (new)" in report
    assert "2 file(s) to copy over the installed sglang/, 0 to delete from it" in report
    assert (out / "REMOVED").read_text() == ""


def test_a_file_a_patch_deletes_is_listed_for_deletion(tmp_path: Path) -> None:
    deleted = (
        "diff --git a/python/sglang/srt/untouched.py b/python/sglang/srt/untouched.py\ndeleted file mode 100644\n"
        "index 4444444..0000000\n--- a/python/sglang/srt/untouched.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n"
    )
    slime, commit = _slime(tmp_path, {"sglang.patch": deleted})
    out = tmp_path / "out"
    proc = _run(
        "--slime", str(slime), "--commit", commit, "--wheel", str(_wheel(tmp_path)), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "REMOVED").read_text() == "sglang/srt/untouched.py\n"
    assert "removed sglang/srt/untouched.py" in (out / "PATCHED").read_text()


def test_later_patches_apply_over_earlier_ones_in_the_dockerfiles_order(tmp_path: Path) -> None:
    third = "def path(route):\n    return getattr(route, 'path', None) or '/'\n"
    slime, commit = _slime(
        tmp_path,
        {
            "sglang.patch": _diff(ORIGINAL, PATCHED, "python/sglang/srt/utils/common.py"),
            "sglang-pull_weights.patch": _diff(PATCHED, third, "python/sglang/srt/utils/common.py"),
        },
    )
    out = tmp_path / "out"
    proc = _run(
        "--slime", str(slime), "--commit", commit, "--wheel", str(_wheel(tmp_path)), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "sglang/srt/utils/common.py").read_text() == third


def test_a_hunk_that_does_not_apply_fails_and_names_the_patch(tmp_path: Path) -> None:
    wrong = _diff("def other():\n    pass\n", PATCHED, "python/sglang/srt/utils/common.py")
    slime, commit = _slime(tmp_path, {"sglang.patch": wrong})
    proc = _run(
        "--slime",
        str(slime),
        "--commit",
        commit,
        "--wheel",
        str(_wheel(tmp_path)),
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 1
    assert "sglang.patch does not apply to sglang-0.0.1-py3-none-any.whl's sglang/" in proc.stderr


SLIME_SOURCE = os.environ.get("RL_LIFECYCLE_SLIME_SOURCE")
PINNED_WHEEL = sorted(glob.glob(str(REPO / ".gpuw/slime/full/sglang-0.5.15.post1-*.whl")))


@pytest.mark.skipif(
    not SLIME_SOURCE or not PINNED_WHEEL, reason="needs slime's source and the SGLang 0.5.15.post1 wheel"
)
def test_slimes_own_patches_apply_to_its_pinned_sglang_wheel(tmp_path: Path) -> None:
    """slime 624b824a's five SGLang patches over SGLang 0.5.15.post1's wheel: every file of the package
    applies, and the fastapi route fix slime's `/v1/loads` needs is in."""
    out = tmp_path / "out"
    proc = _run(
        "--slime", str(SLIME_SOURCE), "--commit", "624b824a", "--wheel", PINNED_WHEEL[0], "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'getattr(route, "path", None)' in (out / "sglang/srt/utils/common.py").read_text()
    assert (out / "sglang/srt/weight_sync/local_checkpoint.py").is_file()

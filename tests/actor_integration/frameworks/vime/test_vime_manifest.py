"""The vime source folder's check (scripts/export_vime.py, tests/helpers/vime_manifest.py), without vime's files."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from actor_integration.frameworks.vime import VIME_FILES
from tests.helpers import vime_manifest

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "scripts" / "export_vime.py"


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_manifest_pins_what_the_adapter_says_it_was_read_from() -> None:
    assert {f.path: f.commit for f in vime_manifest.files()} == VIME_FILES
    assert all(len(f.sha256) == 64 and f.chars > 0 for f in vime_manifest.files())


def test_a_missing_or_different_file_is_named_with_where_to_read_it(tmp_path: Path) -> None:
    entries = vime_manifest.files()
    changed = tmp_path / entries[0].path
    changed.parent.mkdir(parents=True)
    changed.write_text("not vime's file\n")
    found = vime_manifest.problems(tmp_path)
    assert len(found) == len(entries)
    assert found[0].startswith(f"{entries[0].path}: sha256 ") and entries[0].commit in found[0]
    assert all("missing; read_file repo=vllm-project/vime" in line for line in found[1:])


def test_a_folder_of_the_manifests_bytes_passes(tmp_path: Path) -> None:
    """The check is of bytes: a folder holding exactly the recorded digests is accepted (here, a manifest of its own)."""
    manifest = tmp_path / "manifest.json"
    folder = tmp_path / "src"
    (folder / "vime").mkdir(parents=True)
    (folder / "vime" / "a.py").write_text("x = 1\n")
    digest = hashlib.sha256(b"x = 1\n").hexdigest()
    entry = (
        f'{{"path": "vime/a.py", "commit": "{"0" * 40}", "index_id": "1", "chars": 6, "sha256": "{digest}"}}'
    )
    manifest.write_text(f'{{"files": [{entry}]}}')
    assert vime_manifest.problems(folder, manifest) == []
    (folder / "vime" / "a.py").write_text("x = 2\n")
    assert len(vime_manifest.problems(folder, manifest)) == 1


def test_the_script_lists_and_refuses_an_incomplete_folder(tmp_path: Path) -> None:
    listed = _script("list")
    assert listed.returncode == 0 and listed.stdout.count("read_file repo=vllm-project/vime") == len(
        VIME_FILES
    )
    checked = _script("check", str(tmp_path))
    assert checked.returncode == 1 and checked.stderr.count("missing;") == len(VIME_FILES)


def test_the_source_folder_is_ignored_by_git() -> None:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", ".vime-source/vime/backends/megatron_utils/actor.py"],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0

"""vime's files the vime suites run: where each comes from, and a check of a folder holding them (tests only).

There is no git snapshot of vime to fetch, so its files are read from the public file index
(`read_file repo=vllm-project/vime path=PATH commit=COMMIT`), one version each, at the commits in
`vime_manifest.json` (the index stores vime's files at mixed commits), and written into a
git-ignored folder; `RL_LIFECYCLE_VIME_SOURCE` points the suites at it. `check(folder)` compares
every file with the manifest (characters as the index counts them, sha256 of the bytes) and names
what is missing or differs; nothing of vime is stored in this repository.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).with_name("vime_manifest.json")
REPOSITORY = "vllm-project/vime"


@dataclass(frozen=True)
class VimeFile:
    path: str
    commit: str
    index_id: str
    chars: int
    sha256: str

    def how_to_read(self) -> str:
        return f"read_file repo={REPOSITORY} path={self.path} commit={self.commit} (index id {self.index_id})"


def files(manifest: Path = MANIFEST) -> list[VimeFile]:
    data: dict[str, Any] = json.loads(manifest.read_text())
    return [VimeFile(**entry) for entry in data["files"]]


def problems(folder: Path, manifest: Path = MANIFEST) -> list[str]:
    """What keeps `folder` from being the manifest's vime files (empty: it is them)."""
    found: list[str] = []
    for entry in files(manifest):
        target = folder / entry.path
        if not target.is_file():
            found.append(f"{entry.path}: missing; {entry.how_to_read()}")
            continue
        data = target.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            chars = len(data.decode("utf-8", errors="replace"))
            found.append(
                f"{entry.path}: sha256 {digest[:12]}…, {chars} characters; the manifest's is "
                f"{entry.sha256[:12]}…, {entry.chars} characters at {entry.commit[:8]}; {entry.how_to_read()}"
            )
    return found


def tracked_by_git(folder: Path) -> list[str]:
    """Files under `folder` git would commit (the folder must be ignored where it lies in a checkout)."""
    proc = subprocess.run(
        ["git", "-C", str(folder), "ls-files", "--others", "--cached", "--exclude-standard", "."],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:  # not inside a git work tree: nothing to commit it into
        return []
    return [line for line in proc.stdout.splitlines() if line.strip()]


def record(folder: Path, manifest: Path = MANIFEST) -> list[VimeFile]:
    """Rewrite the manifest's sizes and digests from `folder` (after re-reading the files at their commits)."""
    data: dict[str, Any] = json.loads(manifest.read_text())
    updated = []
    for entry in data["files"]:
        raw = (folder / entry["path"]).read_bytes()
        entry["chars"] = len(raw.decode("utf-8"))
        entry["sha256"] = hashlib.sha256(raw).hexdigest()
        updated.append(VimeFile(**entry))
    manifest.write_text(json.dumps(data, indent=2) + "\n")
    return updated

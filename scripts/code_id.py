"""The id of the code a GPU run ran: one hash of every file the GPU paths load or run.

    python3 scripts/code_id.py              print "code ID (N files)" for this tree
    python3 scripts/code_id.py --pin WORK   the same, kept in WORK/code-id; where WORK held another id,
                                            the steps done there ran other code: they are forgotten
                                            (WORK/done, and summary.txt but its install line) and
                                            what differs is printed

The device machine gets a copy of the working tree without git, so the id is taken from the files
themselves: everything under ROOTS and the FILES beside them, caches left out. A table that carries
this line can be told apart from one that ran other code, and tables from several machines or
sessions can be joined (`scripts/gpu_check_table.py --merge`) only when they ran the same code.
Standard library only: it runs on the GPU machine before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# What a GPU run loads or runs: the product, the benchmarks, the scripts, the GPU tests and the test
# helpers and configuration they import. The CPU-only tests (tests/lifecycle, tests/actor_integration,
# tests/scripts, ...) and the docs are not in it: a CPU test or a note added after a run leaves the id.
ROOTS = ("lifecycle", "actor_integration", "benchmarks", "scripts", "tests/gpu", "tests/helpers", "configs")
FILES = ("pyproject.toml", "Makefile", "tests/__init__.py", "tests/conftest.py")
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
REPO = Path(__file__).resolve().parent.parent


def files(repo: Path = REPO) -> list[Path]:
    found = [repo / name for name in FILES if (repo / name).is_file()]
    for root in ROOTS:
        for path in (repo / root).rglob("*"):
            parts = set(path.relative_to(repo).parts)
            cached = parts & SKIP_DIRS or any(part.endswith(".egg-info") for part in parts)
            if path.is_file() and not cached and path.suffix != ".pyc":
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(repo).as_posix())


def manifest(repo: Path = REPO) -> dict[str, str]:
    """Each file's path -> the sha256 of its bytes."""
    return {p.relative_to(repo).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files(repo)}


def code_id(listed: dict[str, str]) -> str:
    """12 hex digits over each file's path and hash."""
    digest = hashlib.sha256()
    for path in sorted(listed):
        digest.update(path.encode() + b"\0" + bytes.fromhex(listed[path]))
    return digest.hexdigest()[:12]


def describe(listed: dict[str, str]) -> str:
    """The line a table ends with: "code ID (N files)"."""
    return f"code {code_id(listed)} ({len(listed)} files)"


def line(repo: Path = REPO) -> str:
    return describe(manifest(repo))


def changed(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two manifests, one word and a path each."""
    return [
        f"{'added' if path not in before else 'removed' if path not in now else 'changed'} {path}"
        for path in sorted(before.keys() | now.keys())
        if before.get(path) != now.get(path)
    ]


def pin(work: Path, repo: Path = REPO) -> bool:
    """Keep this tree's line in WORK/code-id (its manifest beside it). Where WORK held another id the
    steps done there (the gpu scripts' WORK/done and summary.txt) ran other code: they are forgotten,
    the install kept, and what differs is printed. False then."""
    work.mkdir(parents=True, exist_ok=True)
    kept, kept_manifest = work / "code-id", work / "code-manifest.json"
    now = manifest(repo)
    now_line = describe(now)
    before_line = kept.read_text().strip() if kept.is_file() else None
    before = json.loads(kept_manifest.read_text()) if kept_manifest.is_file() else {}
    kept.write_text(now_line + "\n")
    kept_manifest.write_text(json.dumps(now, sort_keys=True))
    if before_line is not None and before_line != now_line:
        differs = changed(before, now)
        print(
            f"the code changed since the steps done on this machine ({before_line} -> {now_line}): they run again"
        )
        print(
            "\n".join(f"  {d}" for d in differs[:10])
            + (f"\n  and {len(differs) - 10} more" if len(differs) > 10 else "")
        )
        (work / "done").unlink(missing_ok=True)
        summary = work / "summary.txt"
        if summary.is_file():
            kept_lines = [
                x for x in summary.read_text().splitlines(keepends=True) if x.startswith("install ")
            ]
            summary.write_text("".join(kept_lines))
        return False
    print(now_line)
    return True


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pin"] and len(argv) == 2:
        pin(Path(argv[1]))
        return 0
    if argv:
        print("usage: code_id.py [--pin WORK]", file=sys.stderr)
        return 2
    print(line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

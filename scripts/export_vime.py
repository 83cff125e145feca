"""The vime source folder the vime suites run: list what to read, check a folder, record a re-read.

    python scripts/export_vime.py list                 # each file, its commit and how to read it from the index
    python scripts/export_vime.py check .vime-source   # every file there as the manifest says; exit 1 if not
    python scripts/export_vime.py record .vime-source  # after re-reading the files: their sizes and sha256

There is no git snapshot of vllm-project/vime, and the public file index that stores its files is
reachable only through the search tools (`read_file`), not from a script. So the files are read
there, each at its commit in tests/helpers/vime_manifest.json, and written under a git-ignored
folder (`.vime-source/` is ignored); `check` verifies the folder against the manifest (and that git
would not commit it), and the suites then run with `RL_LIFECYCLE_VIME_SOURCE=.vime-source`. Without
that variable they skip.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import vime_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("list", "check", "record"))
    parser.add_argument("folder", nargs="?", type=Path, default=Path(".vime-source"))
    args = parser.parse_args(argv)
    if args.command == "list":
        for entry in vime_manifest.files():
            print(f"{entry.path}  {entry.commit}  {entry.chars} chars  ({entry.how_to_read()})")
        return 0
    if args.command == "record":
        for entry in vime_manifest.record(args.folder):
            print(f"recorded {entry.path}: {entry.chars} chars, sha256 {entry.sha256}")
        return 0
    problems = vime_manifest.problems(args.folder)
    committed = vime_manifest.tracked_by_git(args.folder) if args.folder.is_dir() else []
    for problem in problems:
        print(f"vime source: {problem}", file=sys.stderr)
    for path in committed:
        print(
            f"vime source: {path} is not ignored by git: vime's code must not be committed", file=sys.stderr
        )
    if problems or committed:
        return 1
    count = len(vime_manifest.files())
    print(f"{args.folder}: the {count} vime files of the manifest; RL_LIFECYCLE_VIME_SOURCE={args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

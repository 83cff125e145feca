"""slime's SGLang patches over the SGLang wheel's Python package, as slime's image applies them.

slime's docker/Dockerfile (PATCH_VERSION=latest) applies docker/patch/latest/sglang.patch,
sglang-top_p.patch, sglang-release_hicache.patch, sglang-pull_weights.patch and
sglang-deterministic.patch, in that order and each only if present, to the SGLang checkout its base
image installs from. The wheel holds that checkout's python/sglang/ as sglang/. This script applies the
same patches to the wheel's sglang/ and writes out only the files they change or add, to be copied
over the installed package (scripts/gpu_slime.sh's install does), so that slime's own job runs the
SGLang slime's users run: without sglang.patch, for one, SGLang 0.5.15.post1 answers slime's
`GET /v1/loads?include=core` with a 500 under fastapi >= 0.140 (seen on the H100, 2026-12-07).

A patch's files outside python/sglang/ (sgl-kernel's C++ sources, SGLang's test/ tree) are not in the
wheel; they are left out and named. The Dockerfile does not rebuild anything after patching, so the
kernels' patched sources do not reach slime's image's binaries either.

    python3 scripts/slime_sglang_patch.py --slime GIT --commit COMMIT --wheel sglang-*.whl --out DIR

Writes DIR/sglang/... (the changed and added files), DIR/REMOVED (the package's files a patch deletes,
one path a line) and DIR/PATCHED (what was applied, what was left out, each file written or
removed); exits 1 if a hunk of a file in the wheel does not apply.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# docker/Dockerfile's loop, in its order (a missing one is skipped, as there).
PATCHES = (
    "sglang.patch",
    "sglang-top_p.patch",
    "sglang-release_hicache.patch",
    "sglang-pull_weights.patch",
    "sglang-deterministic.patch",
)
PATCH_DIR = "docker/patch/latest"
PREFIX = "python/"  # the checkout's python/sglang/ is the wheel's sglang/


def split_blocks(text: str) -> list[tuple[str, str]]:
    """A git diff -> (path in the checkout, the block's text) for each file it touches."""
    blocks: list[tuple[str, str]] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git ") and current:
            blocks.append(_named(current))
            current = []
        current.append(line)
    if current:
        blocks.append(_named(current))
    return blocks


def _named(lines: list[str]) -> tuple[str, str]:
    head = lines[0].split()
    if len(head) < 4 or not head[2].startswith("a/"):
        raise ValueError(f"not a git diff block: {lines[0]!r}")
    return head[2][2:], "".join(lines)


def in_package(path: str, tree: Path, block: str) -> bool:
    """Whether a block's file is the wheel's: under python/sglang/, and there already or created here."""
    if not path.startswith(PREFIX + "sglang/"):
        return False
    return (tree / path[len(PREFIX) :]).is_file() or "\nnew file mode" in block or "--- /dev/null" in block


def apply(slime: Path, commit: str, wheel: Path, out: Path) -> list[str]:
    """Apply the patches to the wheel's sglang/; write the changed files under `out`; return the report."""
    report: list[str] = [f"slime {commit}, {PATCH_DIR}; wheel {wheel.name}"]
    with tempfile.TemporaryDirectory() as tmp:
        pristine, tree = Path(tmp) / "pristine", Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("sglang/")]
            zf.extractall(pristine, members)
        shutil.copytree(pristine, tree)
        for name in PATCHES:
            shown = subprocess.run(
                ["git", "-C", str(slime), "show", f"{commit}:{PATCH_DIR}/{name}"],
                capture_output=True,
                text=True,
            )
            if shown.returncode != 0:
                report.append(f"{name}: not at this commit, skipped (as the Dockerfile skips it)")
                continue
            kept, left = [], []
            for path, block in split_blocks(shown.stdout):
                (kept if in_package(path, tree, block) else left).append((path, block))
            if kept:
                proc = subprocess.run(
                    ["patch", "-p2", "-N", "--no-backup-if-mismatch", "-r", "-", "-d", str(tree)],
                    input="".join(block for _, block in kept),
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"{name} does not apply to {wheel.name}'s sglang/:\n{proc.stdout}{proc.stderr}"
                    )
            report.append(f"{name}: {len(kept)} file(s) applied")
            for path, _ in left:
                report.append(f"  left out (not in the wheel): {path}")
        written = 0
        for path in sorted(tree.rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(tree)
            before = pristine / rel
            if before.is_file() and filecmp.cmp(before, path, shallow=False):
                continue
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            report.append(f"wrote {rel}{'' if before.is_file() else ' (new)'}")
            written += 1
        removed = [
            path.relative_to(pristine).as_posix()
            for path in sorted(pristine.rglob("*"))
            if path.is_file() and not (tree / path.relative_to(pristine)).exists()
        ]
        for rel_path in removed:
            report.append(f"removed {rel_path}")
        (out / "REMOVED").write_text("".join(f"{rel_path}\n" for rel_path in removed))
        report.append(
            f"{written} file(s) to copy over the installed sglang/, {len(removed)} to delete from it (REMOVED)"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slime", type=Path, required=True, help="a clone or git directory of slime")
    parser.add_argument("--commit", required=True, help="slime's commit whose patches to apply")
    parser.add_argument("--wheel", type=Path, required=True, help="the sglang wheel")
    parser.add_argument("--out", type=Path, required=True, help="where the changed files go (DIR/sglang/...)")
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    try:
        report = apply(args.slime, args.commit, args.wheel, args.out)
    except (RuntimeError, ValueError) as exc:
        print(f"slime_sglang_patch: {exc}", file=sys.stderr)
        return 1
    (args.out / "PATCHED").write_text("\n".join(report) + "\n")
    print("\n".join(line for line in report if not line.startswith("wrote ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The vLLM 0.26.0 wheel set for the lent GPU machine: its list, its parts, and their checks.

Used by scripts/gpu_vllm_wheels.sh here (a CPU machine that reaches PyPI) and by scripts/gpu_vllm.sh on
the GPU machine (no network, Python 3.12). Only the standard library (plus `packaging` for `reqcheck`,
which the machine's image has).

    list LIST [--role ROLE]           name==version<TAB>role[<TAB>patterns] of each entry (checked)
    stubs LIST DIR CONSTRAINTS        empty wheels for the `image` and `drop` entries, and the
                                      constraints file that pins them (for the offline `pip --dry-run`)
    pack WHEELS... --list LIST --out DIR [--part-mib N] [--preset P]
                                      strip each wheel's members named in LIST, store it uncompressed,
                                      tar the lot, xz it (one solid stream: ~30% smaller than the wheels'
                                      own deflate), split it into DIR/p1..pN (one part each) with a
                                      MANIFEST in every part
    unpack STAGED DEST                join the parts in STAGED (checked against the MANIFEST), extract
                                      the wheels into DEST
    reqcheck LIST                     on the machine: each shipped distribution's requirements against
                                      what is installed (the image's and the set's)

LIST lines: `name==version<TAB>role[<TAB>pattern ...]`, `#` comments. Roles:
    ship   carried to the machine (patterns: members stripped from the wheel, fnmatch on its paths)
    image  the machine's image has it (not carried; a stub stands in for it in the offline check)
    drop   a requirement nothing on the checked paths imports (not carried; stub in the offline check)
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import lzma
import os
import re
import sys
import tarfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("ship", "image", "drop")
ARCHIVE = "vllm-set.tar.xz"
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SetError(Exception):
    """A list, a part or a manifest that is not what it must be."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Entry:
    name: str
    version: str
    role: str
    strip: tuple[str, ...] = field(default=())
    line: int = 0

    @property
    def key(self) -> str:
        return normalize(self.name)


def parse_list(text: str) -> list[Entry]:
    """The entries of a wheel list; SetError on a malformed line, an unknown role, a name twice, or
    strip patterns on an entry that is not shipped."""
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        fields = line.split("\t")
        spec, role, strip = fields[0].strip(), (fields[1].strip() if len(fields) > 1 else ""), fields[2:]
        name, sep, version = spec.partition("==")
        if not sep or not _NAME.match(name) or not version or " " in version:
            raise SetError(f"line {number}: '{spec}' is not name==version")
        if role not in ROLES:
            raise SetError(f"line {number}: role '{role}' is not one of {', '.join(ROLES)}")
        patterns = tuple(p for f in strip for p in f.split() if p)
        if patterns and role != "ship":
            raise SetError(f"line {number}: only a shipped wheel can be stripped ({name} is {role})")
        key = normalize(name)
        if key in seen:
            raise SetError(f"line {number}: {name} is listed twice (first on line {seen[key]})")
        seen[key] = number
        entries.append(Entry(name, version, role, patterns, number))
    return entries


def read_list(path: Path) -> list[Entry]:
    return parse_list(path.read_text())


# --- stubs: the machine's packages and the dropped ones, for `pip install --dry-run --no-index` -----


def stub_wheel(dest: Path, name: str, version: str) -> Path:
    """An empty wheel (metadata only, no requirements) of name at version."""
    dist = re.sub(r"[-.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_vllm_set\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    return path


def write_stubs(entries: Sequence[Entry], dest: Path, constraints: Path) -> int:
    """Stubs of every image and drop entry at `version+image` / `version+drop` (a local label PyPI never
    serves, so the constraint picks the stub), and the constraints file pinning them."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = []
    for entry in entries:
        if entry.role == "ship":
            continue
        version = f"{entry.version}+{entry.role}"
        stub_wheel(dest, entry.name, version)
        pins.append(f"{entry.name}=={version}\n")
    constraints.write_text("".join(pins))
    return len(pins)


# --- pack and unpack ------------------------------------------------------------------------------


def stored_copy(src: Path, patterns: Sequence[str]) -> tuple[bytes, list[str]]:
    """The wheel's bytes with the members matching patterns left out (and their RECORD lines), every
    member stored uncompressed (the solid xz stream compresses them together)."""
    out = io.BytesIO()
    dropped: list[str] = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        names = zin.namelist()
        dropped = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
        for pattern in patterns:
            if not any(fnmatch.fnmatch(n, pattern) for n in names):
                raise SetError(f"{src.name}: strip pattern '{pattern}' matches no member")
        gone = set(dropped)
        for info in zin.infolist():
            if info.filename in gone:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [x for x in data.decode().splitlines() if x.split(",", 1)[0] not in gone]
                data = ("\n".join(lines) + "\n").encode()
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            member.external_attr = info.external_attr
            member.compress_type = zipfile.ZIP_STORED
            zout.writestr(member, data)
    return out.getvalue(), dropped


def wheel_key(path: Path) -> str:
    return normalize(path.name.split("-", 1)[0])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(
    wheels: Sequence[Path],
    entries: Sequence[Entry],
    out: Path,
    part_mib: float = 56,
    preset: int = 9,
) -> dict[str, Any]:
    """Lay out out/p1..pN: the wheels (stripped, stored) in one tar.xz split into parts of at most
    part_mib MiB, each part's folder holding its piece and the MANIFEST. Every shipped entry must have
    exactly one wheel and every wheel an entry."""
    ship = {e.key: e for e in entries if e.role == "ship"}
    by_key: dict[str, Path] = {}
    for whl in wheels:
        key = wheel_key(whl)
        if key not in ship:
            raise SetError(f"{whl.name}: no `ship` entry in the list")
        if key in by_key:
            raise SetError(f"{whl.name}: a second wheel of {key} ({by_key[key].name})")
        if f"-{ship[key].version}-" not in whl.name:
            raise SetError(f"{whl.name}: the list pins {ship[key].name}=={ship[key].version}")
        by_key[key] = whl
    missing = sorted(set(ship) - set(by_key))
    if missing:
        raise SetError(f"no wheel for: {', '.join(missing)}")
    tar_bytes = io.BytesIO()
    stripped: dict[str, list[str]] = {}
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key in sorted(by_key):
            data, dropped = stored_copy(by_key[key], ship[key].strip)
            if dropped:
                stripped[by_key[key].name] = dropped
            info = tarfile.TarInfo(f"wheels/{by_key[key].name}")
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    blob = lzma.compress(tar_bytes.getvalue(), format=lzma.FORMAT_XZ, preset=preset)
    size = int(part_mib * 2**20)
    pieces = [blob[i : i + size] for i in range(0, len(blob), size)] or [b""]
    manifest = {
        "archive": ARCHIVE,
        "parts": len(pieces),
        "sha256": sha256(blob),
        "bytes": len(blob),
        "tar_bytes": tar_bytes.tell(),
        "wheels": sorted(p.name for p in by_key.values()),
        "stripped": stripped,
        "pieces": [
            {"name": f"{ARCHIVE}.{k}", "bytes": len(piece), "sha256": sha256(piece)}
            for k, piece in enumerate(pieces, 1)
        ],
    }
    for k, piece in enumerate(pieces, 1):
        folder = out / f"p{k}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{ARCHIVE}.{k}").write_bytes(piece)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def staged(staged_dir: Path) -> tuple[dict[str, Any], list[int]]:
    """The manifest in staged_dir and the numbers of the parts still missing (a piece whose size or
    hash differs from the manifest's is an error, not a missing part)."""
    path = staged_dir / MANIFEST
    if not path.is_file():
        raise SetError(f"no {MANIFEST} in {staged_dir}: no part staged yet")
    manifest = json.loads(path.read_text())
    missing = []
    for k, piece in enumerate(manifest["pieces"], 1):
        p = staged_dir / piece["name"]
        if not p.is_file():
            missing.append(k)
            continue
        if p.stat().st_size != piece["bytes"] or sha256(p.read_bytes()) != piece["sha256"]:
            raise SetError(f"{p.name}: not the part the manifest names (size or sha256 differ)")
    return manifest, missing


class _Joined(io.RawIOBase):
    """The parts read back to back as one stream."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)
        self._file: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = open(self._paths.pop(0), "rb")  # noqa: SIM115 - closed when read out
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None


def unpack(staged_dir: Path, dest: Path) -> list[Path]:
    """Join the staged parts (every one present and as the manifest says) and extract the wheels."""
    manifest, missing = staged(staged_dir)
    if missing:
        raise SetError(f"parts missing: {', '.join(f'p{k}' for k in missing)}")
    paths = [staged_dir / piece["name"] for piece in manifest["pieces"]]
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.read_bytes())
    if digest.hexdigest() != manifest["sha256"]:
        raise SetError("the joined parts differ from the archive that was split")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BufferedReader(_Joined(paths), 1 << 20), mode="r|xz") as tar:
        for member in tar:
            if not member.isfile() or not member.name.startswith("wheels/") or ".." in member.name:
                raise SetError(f"unexpected member {member.name} in the archive")
            source = tar.extractfile(member)
            assert source is not None
            (dest / Path(member.name).name).write_bytes(source.read())
    out = sorted(dest.glob("*.whl"))
    if sorted(p.name for p in out) != sorted(manifest["wheels"]):
        raise SetError("the extracted wheels are not the manifest's")
    return out


# --- on the machine: requirements against what is installed ---------------------------------------


def requirement_problems(entries: Sequence[Entry]) -> Iterator[str]:
    """Each shipped distribution's requirements (no extras) unmet by what is installed: 'missing' where
    nothing provides the name (dropped ones are said so), 'version' where the installed one is outside
    the pin (the image's own versions, e.g. numpy 2.5 under numba's `<2.5`)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    dropped = {e.key for e in entries if e.role == "drop"}
    for entry in entries:
        if entry.role != "ship":
            continue
        try:
            dist = md.distribution(entry.name)
        except md.PackageNotFoundError:
            yield f"NOT INSTALLED {entry.name}=={entry.version}"
            continue
        if dist.version != entry.version:
            yield f"VERSION {entry.name}: installed {dist.version}, list {entry.version}"
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                why = "dropped from the set" if normalize(req.name) in dropped else "MISSING"
                yield f"{why}: {entry.name} needs {req}"
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                yield f"version: {entry.name} needs {req}, installed {have}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list")
    p.add_argument("list", type=Path)
    p.add_argument("--role", choices=ROLES)
    p = sub.add_parser("stubs")
    p.add_argument("list", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("constraints", type=Path)
    p = sub.add_parser("pack")
    p.add_argument("wheels", type=Path, nargs="+")
    p.add_argument("--list", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=float, default=56)
    p.add_argument("--preset", type=int, default=9)
    p = sub.add_parser("unpack")
    p.add_argument("staged", type=Path)
    p.add_argument("dest", type=Path)
    p = sub.add_parser("missing")
    p.add_argument("staged", type=Path)
    p = sub.add_parser("reqcheck")
    p.add_argument("list", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for e in read_list(args.list):
                if args.role in (None, e.role):
                    print("\t".join([f"{e.name}=={e.version}", e.role, *e.strip]))
        elif args.command == "stubs":
            n = write_stubs(read_list(args.list), args.dest, args.constraints)
            print(f"{n} stubs in {args.dest}, pinned in {args.constraints}")
        elif args.command == "pack":
            manifest = pack(args.wheels, read_list(args.list), args.out, args.part_mib, args.preset)
            for whl, dropped in manifest["stripped"].items():  # the whole list is in the MANIFEST
                shown = " ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")
                print(f"stripped {whl}: {len(dropped)} members: {shown}")
            print(
                f"{len(manifest['wheels'])} wheels, tar {manifest['tar_bytes'] / 2**20:.1f} MiB -> xz "
                f"{manifest['bytes'] / 2**20:.1f} MiB in {manifest['parts']} parts"
            )
        elif args.command == "missing":  # prints the parts still to stage: "2 3", or nothing
            _manifest, missing = staged(args.staged)
            print(" ".join(str(k) for k in missing))
        elif args.command == "unpack":
            wheels = unpack(args.staged, args.dest)
            print(f"{len(wheels)} wheels in {args.dest}")
        elif args.command == "reqcheck":
            problems = list(requirement_problems(read_list(args.list)))
            for line in problems:
                print(line)
            hard = [x for x in problems if x.startswith(("MISSING", "NOT INSTALLED", "VERSION"))]
            print(f"reqcheck: {len(problems)} unmet, {len(hard)} of them missing wheels or wrong versions")
            return 1 if hard else 0
    except SetError as exc:
        print(f"gpu_vllm_set: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    raise SystemExit(main())

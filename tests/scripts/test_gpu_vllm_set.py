"""scripts/gpu_vllm_set.py and scripts/gpu_vllm.sh: the vLLM wheel list, its parts and their reassembly,
and the device script's staging and step gating (dry run, on small stand-in wheels)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vset() -> ModuleType:
    return load_script("gpu_vllm_set")


def wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> Path:
    """A small installable wheel with the given members (and a RECORD naming them)."""
    info = f"{name}-{version}.dist-info"
    files = {
        **members,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]).encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for member, data in files.items():
            whl.writestr(member, data)
    return path


def test_the_committed_list_parses_and_ships_vllm_with_fa2_stripped(vset: ModuleType) -> None:
    entries = vset.read_list(ROOT / "scripts" / "gpu_vllm_wheels.txt")
    by_name = {e.key: e for e in entries}
    assert by_name["vllm"].version == "0.26.0" and by_name["vllm"].role == "ship"
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in by_name["vllm"].strip
    assert not any(p.endswith("_vllm_fa3_C.abi3.so") for p in by_name["vllm"].strip)
    # never carried: what the machine's image has
    for name in ("torch", "triton", "numpy", "transformers"):
        assert by_name[name].role == "image", name
    assert by_name["flashinfer-python"].role == "drop"


def test_a_bad_list_is_refused_with_its_line(vset: ModuleType) -> None:
    good = "# c\nvllm==0.26.0\tship\tvllm/a.so vllm/b/*\ntorch==2.11.0\timage  # the image's\n"
    entries = vset.parse_list(good)
    assert [(e.name, e.role, e.strip, e.line) for e in entries] == [
        ("vllm", "ship", ("vllm/a.so", "vllm/b/*"), 2),
        ("torch", "image", (), 3),
    ]
    for text, words in [
        ("vllm>=0.26\tship\n", "line 1: 'vllm>=0.26' is not name==version"),
        ("vllm==0.26.0\tcarry\n", "role 'carry'"),
        ("vllm==0.26.0\n", "role ''"),
        ("torch==2.11.0\timage\tx/*\n", "only a shipped wheel can be stripped"),
        ("Foo_Bar==1\tship\nfoo-bar==2\tdrop\n", "line 2: foo-bar is listed twice (first on line 1)"),
    ]:
        with pytest.raises(vset.SetError, match=words.replace("(", r"\(").replace(")", r"\)")):
            vset.parse_list(text)


def test_stubs_pin_the_image_and_dropped_entries_with_a_local_label(vset: ModuleType, tmp_path: Path) -> None:
    entries = vset.parse_list("a==1\tship\nb-c==2.0\timage\nd==3\tdrop\n")
    n = vset.write_stubs(entries, tmp_path / "stubs", tmp_path / "c.txt")
    assert n == 2
    assert (tmp_path / "c.txt").read_text() == "b-c==2.0+image\nd==3+drop\n"
    stub = zipfile.ZipFile(tmp_path / "stubs" / "b_c-2.0+image-py3-none-any.whl")
    metadata = stub.read("b_c-2.0+image.dist-info/METADATA").decode()
    assert "Name: b-c\nVersion: 2.0+image\n" in metadata and "Requires-Dist" not in metadata


def layout(vset: ModuleType, tmp_path: Path, part_mib: float) -> tuple[Path, dict[str, object]]:
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(300_000)  # incompressible: the parts split it
    wheels = [
        wheel(
            src, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n", "alpha/huge.so": big, "alpha/keep.so": big}
        ),
        wheel(src, "beta", "2.0", {"beta.py": b"Y = 2\n"}),
    ]
    entries = vset.parse_list("alpha==1.0\tship\talpha/huge.so\nbeta==2.0\tship\ngamma==3\tdrop\n")
    out = tmp_path / "gpuw"
    return out, vset.pack(wheels, entries, out, part_mib=part_mib, preset=1)


def test_pack_splits_and_unpack_joins_the_stripped_wheels(vset: ModuleType, tmp_path: Path) -> None:
    out, manifest = layout(vset, tmp_path, part_mib=0.25)  # 256 KiB parts
    parts = sorted(out.glob("p*"))
    assert manifest["parts"] == len(parts) == 2
    assert manifest["stripped"] == {"alpha-1.0-py3-none-any.whl": ["alpha/huge.so"]}
    for k, part in enumerate(parts, 1):
        assert sorted(p.name for p in part.iterdir()) == ["MANIFEST.json", f"vllm-set.tar.xz.{k}"]
        assert (part / f"vllm-set.tar.xz.{k}").stat().st_size <= 256 * 1024
    staged = tmp_path / "staged"
    staged.mkdir()
    for f in (out / "p2").iterdir():
        (staged / f.name).write_bytes(f.read_bytes())
    assert vset.staged(staged)[1] == [1]
    with pytest.raises(vset.SetError, match="parts missing: p1"):
        vset.unpack(staged, tmp_path / "wheels")
    for f in (out / "p1").iterdir():
        (staged / f.name).write_bytes(f.read_bytes())
    assert vset.staged(staged)[1] == []
    got = vset.unpack(staged, tmp_path / "wheels")
    assert [p.name for p in got] == ["alpha-1.0-py3-none-any.whl", "beta-2.0-py3-none-any.whl"]
    alpha = zipfile.ZipFile(got[0])
    assert "alpha/huge.so" not in alpha.namelist() and len(alpha.read("alpha/keep.so")) == 300_000
    assert all(i.compress_type == zipfile.ZIP_STORED for i in alpha.infolist())
    record = alpha.read("alpha-1.0.dist-info/RECORD").decode()
    assert "alpha/huge.so" not in record and "alpha/keep.so" in record


def test_a_damaged_part_is_refused(vset: ModuleType, tmp_path: Path) -> None:
    out, _ = layout(vset, tmp_path, part_mib=0.25)
    piece = out / "p2" / "vllm-set.tar.xz.2"
    data = bytearray(piece.read_bytes())
    data[10] ^= 0xFF
    piece.write_bytes(bytes(data))
    staged = tmp_path / "staged"
    staged.mkdir()
    for part in ("p1", "p2"):
        for f in (out / part).iterdir():
            (staged / f.name).write_bytes(f.read_bytes())
    with pytest.raises(vset.SetError, match="not the part the manifest names"):
        vset.staged(staged)


def test_pack_refuses_a_set_that_differs_from_the_list(vset: ModuleType, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    alpha = wheel(src, "alpha", "1.0", {"alpha/__init__.py": b""})
    beta = wheel(src, "beta", "2.0", {"beta.py": b""})
    cases = [
        ("alpha==1.0\tship\n", [alpha, beta], "beta-2.0-py3-none-any.whl: no `ship` entry"),
        ("alpha==1.0\tship\nbeta==2.0\tship\n", [alpha], "no wheel for: beta"),
        ("alpha==1.1\tship\n", [alpha], r"the list pins alpha==1.1"),
        ("alpha==1.0\tship\talpha/nothing*\n", [alpha], "matches no member"),
    ]
    for text, wheels, words in cases:
        with pytest.raises(vset.SetError, match=words):
            vset.pack(wheels, vset.parse_list(text), tmp_path / "out", preset=1)


def device_script(tmp_path: Path, parts: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        "VLW": str(tmp_path / "vlw"),
        "GPU_VLLM_STAGE": str(tmp_path / "stage"),
        "WORK": str(tmp_path / "work"),
        "GPU_VLLM_PARTS": str(parts),
        "GPU_VLLM_DRY_RUN": "1",
        "PY": sys.executable,
        "OUT": "",
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_vllm.sh")], capture_output=True, text=True, env=full, timeout=120
    )


def test_the_device_script_stages_part_by_part_installs_then_gates_steps_by_budget(
    vset: ModuleType, tmp_path: Path
) -> None:
    out, _ = layout(vset, tmp_path, part_mib=0.25)
    carried = tmp_path / "carried"  # what one call carries: one part folder
    carried.mkdir()
    (carried / "p1").symlink_to(out / "p1")
    first = device_script(tmp_path, carried, GPU_VLLM_BUDGET_S="100")
    assert first.returncode == 0, first.stderr
    assert f"parts still missing: 2; call again at once, carrying {carried}/p2" in first.stdout
    assert not (tmp_path / "vlw" / ".installed").exists()
    (carried / "p1").unlink()
    (carried / "p2").symlink_to(out / "p2")
    # 100 s of budget: imports (60 s usually) fits, tests (360 s) does not
    second = device_script(tmp_path, carried, GPU_VLLM_BUDGET_S="100")
    assert second.returncode == 0, second.stderr
    assert "=== install: rc=0" in second.stdout
    assert (tmp_path / "vlw" / "site" / "alpha" / "keep.so").is_file()
    assert not (tmp_path / "vlw" / "site" / "alpha" / "huge.so").exists()
    assert not (tmp_path / "stage").exists()  # the parts' disk is freed once installed
    assert "=== imports: rc=0" in second.stdout
    assert (
        "=== next call: tests and after (" in second.stdout and "tests usually takes 150 s" in second.stdout
    )
    assert "| imports | 0 | 0 |" in second.stdout and "| tests | not run | |" in second.stdout
    # the next call carries nothing: no install again, imports not again, the rest within 1500 s
    (carried / "p2").unlink()
    third = device_script(tmp_path, carried, GPU_VLLM_BUDGET_S="1500")
    assert third.returncode == 0, third.stderr
    assert "install" not in third.stdout.split("| step |")[0]
    assert "=== imports" not in third.stdout
    assert (
        "=== tests: rc=0" in third.stdout
        and "=== http: rc=0" in third.stdout
        and "=== demo: rc=0" in third.stdout
        and "=== vime: rc=0" in third.stdout
        and "=== bench: rc=0" in third.stdout
    )
    assert "=== next call: report" not in third.stdout and "=== report: rc=0" in third.stdout
    assert (tmp_path / "work" / "done").read_text().split() == [
        "imports",
        "tests",
        "http",
        "demo",
        "vime",
        "bench",
        "report",
    ]


def test_the_device_script_refuses_an_unknown_step(tmp_path: Path) -> None:
    result = device_script(tmp_path, tmp_path, GPU_VLLM_STEPS="imports bogus", GPU_VLLM_INSTALLED="1")
    assert result.returncode == 2 and "unknown step 'bogus'" in result.stderr

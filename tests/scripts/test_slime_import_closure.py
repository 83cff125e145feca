"""scripts/slime_import_closure.py: what slime's job imports that nothing on the GPU machine provides."""

from __future__ import annotations

import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_script


@pytest.fixture(scope="module")
def closure_module() -> ModuleType:
    return load_script("slime_import_closure")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    write(
        src / "app" / "__init__.py",
        "import os\n"
        "import numpy\n"  # the image has it
        "import wheeled.inner\n"  # a carried wheel, followed
        "import unfollowed_wheel\n"  # a carried wheel, not followed
        "from . import sub\n"
        "import missing_required\n"
        "try:\n    import missing_guarded\nexcept ImportError:\n    missing_guarded = None\n"
        "if os.name == 'nt':\n    import missing_conditional\n    from app import windows_only\n"
        "if __name__ == '__main__':\n    import never_reported\n"
        "def later():\n    import missing_lazily\n",
    )
    write(src / "app" / "sub.py", "from .deeper import thing\n")
    write(src / "app" / "deeper.py", "import missing_via_relative\nthing = 1\n")
    write(src / "app" / "windows_only.py", "import missing_under_windows\n")
    write(src / "app" / "unreached.py", "import missing_unreached\n")
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "wheeled-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("wheeled/__init__.py", "")
        whl.writestr("wheeled/inner.py", "import missing_in_wheel\n")
        whl.writestr("wheeled-1.0.dist-info/METADATA", "Name: wheeled\n")
    with zipfile.ZipFile(wheels / "unfollowed_wheel-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("unfollowed_wheel/__init__.py", "import missing_not_followed\n")
    return src, wheels


def test_it_sorts_what_is_missing_by_how_it_is_imported(
    closure_module: ModuleType, tree: tuple[Path, Path]
) -> None:
    src, wheels = tree
    sources = closure_module.Sources(dirs=[src], follow_wheels=frozenset({"wheeled"}))
    sources.add_wheels(wheels)
    missing, read, _ = closure_module.closure(sources, ["app"])
    assert set(missing.required) == {"missing_required", "missing_via_relative", "missing_in_wheel"}
    assert missing.required["missing_via_relative"] == "app.deeper:1"
    # a module reached only under an `if` makes what it imports conditional too
    assert set(missing.conditional) == {"missing_conditional", "missing_under_windows"}
    assert set(missing.guarded) == {"missing_guarded"}
    assert read == 6  # app, app.sub, app.deeper, app.windows_only, wheeled, wheeled.inner


def test_a_module_imported_both_ways_counts_as_required(closure_module: ModuleType, tmp_path: Path) -> None:
    write(tmp_path / "a.py", "try:\n    import dep\nexcept ImportError:\n    pass\nimport b\n")
    write(tmp_path / "b.py", "import dep\n")
    missing, _, sites = closure_module.closure(closure_module.Sources(dirs=[tmp_path]), ["a"], trace=["dep"])
    assert missing.required == {"dep": "b:1"} and not missing.guarded
    assert sites == ["a:2 guarded -> dep", "b:1 required -> dep"]


def test_the_command_fails_on_a_required_module_only(
    closure_module: ModuleType, tree: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src, wheels = tree
    assert closure_module.main(["--source", str(src), "--wheels", str(wheels), "--root", "app"]) == 1
    out = capsys.readouterr().out
    assert "MISSING (required) missing_required" in out and "absent (guarded)   missing_guarded" in out
    write(src / "ok.py", "import json\nimport torch\n")
    assert closure_module.main(["--source", str(src), "--root", "ok"]) == 0


def test_an_import_under_suppress_import_error_is_guarded(closure_module: ModuleType, tmp_path: Path) -> None:
    write(
        tmp_path / "a.py",
        "import contextlib\nfrom contextlib import suppress\n"
        "with suppress(ImportError):\n    import quiet_one\n"
        "with contextlib.suppress(ModuleNotFoundError, OSError):\n    import quiet_two\n"
        "with suppress(KeyError):\n    import loud\n"
        "with open('x') as f:\n    import also_loud\n",
    )
    missing, _, _ = closure_module.closure(closure_module.Sources(dirs=[tmp_path]), ["a"])
    assert set(missing.guarded) == {"quiet_one", "quiet_two"}
    assert set(missing.required) == {"loud", "also_loud"}


def test_follow_walks_into_the_named_wheels_and_reached_lists_them(
    closure_module: ModuleType, tree: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src, wheels = tree
    args = ["--source", str(src), "--wheels", str(wheels), "--root", "app", "--reached"]
    closure_module.main([*args, "--follow", "unfollowed_wheel"])
    out = capsys.readouterr().out
    # only the named wheel is walked into: what `wheeled.inner` imports is no longer seen
    assert "missing_not_followed" in out and "missing_in_wheel" not in out
    assert "reached (required) wheeled" in out and "reached (required) unfollowed_wheel" in out
    assert "reached (required) app" in out and "numpy" not in out  # the image's are not listed
    closure_module.main([*args, "--follow", "all"])
    out = capsys.readouterr().out
    assert "missing_not_followed" in out and "missing_in_wheel" in out


def test_an_overlays_file_is_read_instead_of_the_wheels_own(
    closure_module: ModuleType, tree: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A patch laid over a carried package is what the job imports: its imports count, the wheel's
    replaced file's do not; a module the overlay adds is found; an overlay's package no wheel or
    source carries is not made up."""
    src, wheels = tree
    overlay = tmp_path / "overlay"
    write(overlay / "wheeled" / "inner.py", "import missing_from_the_patch\nimport wheeled.added\n")
    write(overlay / "wheeled" / "added.py", "import missing_from_an_added_file\n")
    write(overlay / "nowhere" / "__init__.py", "import missing_never_carried\n")
    args = [
        "--source",
        str(src),
        "--wheels",
        str(wheels),
        "--root",
        "app",
        "--root",
        "nowhere",
        "--follow",
        "wheeled",
    ]
    closure_module.main([*args, "--overlay", str(overlay)])
    out = capsys.readouterr().out
    assert "MISSING (required) missing_from_the_patch" in out
    assert "MISSING (required) missing_from_an_added_file" in out
    assert "missing_in_wheel" not in out  # the replaced file's import
    assert "MISSING (required) nowhere" in out and "missing_never_carried" not in out
    closure_module.main(args)
    out = capsys.readouterr().out
    assert "missing_in_wheel" in out and "missing_from_the_patch" not in out


_LAZY_HEAD = """from dataclasses import dataclass
from typing import TYPE_CHECKING
from vllm_like.import_utils import LazyLoader
if TYPE_CHECKING:
    import {mod}
else:
    {mod} = LazyLoader("{mod}", globals(), "{mod}")
"""


def test_a_lazy_module_read_at_load_is_required(closure_module: ModuleType, tmp_path: Path) -> None:
    """vLLM 0.26's backend_guidance.py: a dataclass field annotated with a LazyLoader's attribute
    imports the module with the file (found on the H100: `No module named 'llguidance'`)."""
    write(tmp_path / "vllm_like" / "__init__.py", "")
    write(tmp_path / "vllm_like" / "import_utils.py", "class LazyLoader: ...\n")
    field = "@dataclass\nclass Grammar:\n    matcher: {mod}.LLMatcher\n"
    write(tmp_path / "annotated.py", _LAZY_HEAD.format(mod="llguidance") + field.format(mod="llguidance"))
    default = "def allocate(n, kind={mod}.KIND):\n    return n\n"
    write(tmp_path / "defaulted.py", _LAZY_HEAD.format(mod="xgrammar") + default.format(mod="xgrammar"))
    # not read at load: postponed annotations, a function body, a use under `if TYPE_CHECKING`
    postponed = "from __future__ import annotations\n" + _LAZY_HEAD.format(mod="outlines_core")
    write(tmp_path / "postponed.py", postponed + field.format(mod="outlines_core"))
    body = "def compile(s):\n    return {mod}.compile(s)\n\nLATER = lambda: {mod}.compile('x')\n"
    write(
        tmp_path / "in_body.py",
        _LAZY_HEAD.format(mod="lmformatenforcer") + body.format(mod="lmformatenforcer"),
    )
    sources = closure_module.Sources(dirs=[tmp_path])
    missing, _, _ = closure_module.closure(sources, ["annotated", "defaulted", "postponed", "in_body"])
    assert missing.required == {"llguidance": "annotated:10", "xgrammar": "defaulted:8"}
    # the other two only through their `if TYPE_CHECKING` imports
    assert not missing.conditional and set(missing.guarded) == {"outlines_core", "lmformatenforcer"}


def test_a_lazy_module_read_under_an_if_or_a_try_is_as_sure_as_its_branch(
    closure_module: ModuleType, tmp_path: Path
) -> None:
    write(tmp_path / "import_utils.py", "class LazyLoader: ...\n")
    head = 'import os\nfrom import_utils import LazyLoader\nnp = LazyLoader("np", globals(), "cond_dep")\n'
    head += 'gd = LazyLoader("gd", globals(), "guarded_dep")\n'
    text = (
        head
        + "if os.name == 'nt':\n    X = np.zeros\ntry:\n    Y = gd.thing\nexcept ImportError:\n    Y = None\n"
    )
    write(tmp_path / "app.py", text)
    missing, _, _ = closure_module.closure(closure_module.Sources(dirs=[tmp_path]), ["app"])
    assert not missing.required
    assert set(missing.conditional) == {"cond_dep"} and set(missing.guarded) == {"guarded_dep"}

"""docs/architecture.md names every module of `actor_integration/`, every module it names exists,
and the imports keep the layering it states."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
LIMIT = 1000  # lines: the project's rule for a product module


def _modules() -> list[Path]:
    return sorted(p for p in (ROOT / "actor_integration").rglob("*.py") if p.name != "__init__.py")


def _named() -> set[str]:
    """The modules the doc's tables name: a path in a row's first cell; a bare file name beside it
    is in the first path's folder; a package's row (`.../process_groups/`) names its files."""
    named: set[str] = set(re.findall(r"`(actor_integration/[\w/]+\.py)`", DOC))  # in a heading or prose too
    for row in re.findall(r"^\| (`actor_integration/[^|]*)\|([^\n]*)$", DOC, flags=re.M):
        first, rest = row
        paths = re.findall(r"`([\w./]+)`", first)
        folder = paths[0] if paths[0].endswith("/") else paths[0].rsplit("/", 1)[0] + "/"
        files = paths if not paths[0].endswith("/") else re.findall(r"`(\w+\.py)`", rest)
        named |= {name if name.startswith("actor_integration/") else folder + name for name in files}
    return named


def test_every_module_of_actor_integration_is_in_the_architecture_doc():
    named = _named()
    missing = [
        p.relative_to(ROOT).as_posix() for p in _modules() if p.relative_to(ROOT).as_posix() not in named
    ]
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_every_module_the_architecture_doc_names_exists():
    named = set(re.findall(r"`(actor_integration/[\w/]+\.py)`", DOC))
    assert named, "the doc names no module"
    gone = sorted(rel for rel in named if not (ROOT / rel).is_file())
    assert gone == [], f"docs/architecture.md names modules that are not in the tree: {gone}"


def test_every_product_module_is_under_the_line_limit():
    over = {
        path.relative_to(ROOT).as_posix(): n
        for root in ("actor_integration", "lifecycle")
        for path in (ROOT / root).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > LIMIT
    }
    assert over == {}, f"modules over {LIMIT} lines: {over}"


def _imported(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return found


def _offenders(folder: str, forbidden: str) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT).as_posix()} imports {name}"
        for path in (ROOT / folder).rglob("*.py")
        for name in _imported(path)
        if name == forbidden or name.startswith(forbidden + ".")
    )


def test_the_core_imports_nothing_from_the_adapters():
    """`lifecycle/` imports nothing from `actor_integration/`, as the doc says."""
    assert "`lifecycle/` imports nothing from `actor_integration/`" in DOC
    assert _offenders("lifecycle", "actor_integration") == []


ENGINES = sorted(
    p.name for p in (ROOT / "actor_integration" / "engines").iterdir() if (p / "__init__.py").is_file()
)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_imports_nothing_from_another_engine(engine):
    """What two engines share lives in `rollout/` or `weight_sync/`, not in one of them."""
    assert "imports nothing from another engine's" in DOC
    assert len(ENGINES) > 1
    others = [other for other in ENGINES if other != engine]
    offenders = [
        o
        for other in others
        for o in _offenders(f"actor_integration/engines/{engine}", f"actor_integration.engines.{other}")
    ]
    assert offenders == []

"""The public API of a package, for the docstring tests: the names in its `__all__`, and the public
methods and properties of its public classes (defined in this project, their own or inherited)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lifecycle", "actor_integration")


class Member(NamedTuple):
    """One public member: its dotted name, whether it has a docstring, and where it is defined."""

    name: str
    documented: bool
    where: str


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in PACKAGES


def _where(obj: Any) -> str:
    try:
        target: Any = obj.fget if isinstance(obj, property) else obj
        target = inspect.unwrap(target) if callable(target) else target
        path = Path(inspect.getsourcefile(target) or "?")
        return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return "?"


def _class_documented(cls: type) -> bool:
    # Its own docstring: dataclasses and NamedTuples make one from the signature, which says nothing.
    doc = cls.__dict__.get("__doc__")
    return isinstance(doc, str) and bool(doc.strip()) and not doc.startswith(f"{cls.__name__}(")


def members(package: ModuleType) -> Iterator[Member]:
    """Every public member of `package`, in `__all__` order."""
    for name in package.__all__:
        obj = getattr(package, name)
        qualified = f"{package.__name__}.{name}"
        if inspect.isclass(obj):
            yield Member(qualified, _class_documented(obj), _where(obj))
            seen: set[str] = set()
            for base in obj.__mro__:
                if not _ours(base):
                    continue
                for attr, value in vars(base).items():
                    if attr.startswith("_") or attr in seen:
                        continue
                    seen.add(attr)
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if isinstance(value, property):
                        yield Member(f"{qualified}.{attr}", bool(value.__doc__), _where(value))
                    elif inspect.isfunction(value):
                        # A method that overrides a documented one of its bases shares its docstring.
                        documented = bool(inspect.getdoc(getattr(obj, attr)))
                        yield Member(f"{qualified}.{attr}", documented, _where(value))
        elif inspect.isfunction(obj):
            yield Member(qualified, bool(inspect.getdoc(obj)), _where(obj))
        # constants (ALL_TAGS) cannot carry a docstring


def undocumented(package: ModuleType) -> list[str]:
    """`name (file:line)` of each public member without a docstring."""
    return [f"{m.name} ({m.where})" for m in members(package) if not m.documented]

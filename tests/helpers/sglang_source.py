"""SGLang's source, read from the pinned wheel without importing it, for checking our adapters.

`fetch_wheel()` downloads the wheel once into a cache directory. `SourceTree` parses the modules
the adapters touch with `ast`: classes, methods with `inspect.Signature`s built from their
definitions, request structs' fields, module constants, HTTP routes. `source_shaped_sglang()`
makes `import sglang...` inside the adapters resolve to recording fakes shaped by that source:
an attribute SGLang does not have raises AttributeError, and every call is recorded with the
signature it must bind to.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import inspect
import os
import subprocess
import sys
import tempfile
import types
import urllib.parse
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The exact wheels: the same files on every machine (their source, not their binaries, is what we
# read), so a hash pins each. The oldest and the newest release of pyproject's `sglang` extra (a
# test checks): 0.5.17 is the last on torch 2.11 (what the GPU machine runs), 0.5.23 the newest.
WHEELS = {
    "0.5.17": "575e38f5683624ded3b4bb267f637a098e5ed37d13a1d1ff5ea09bd781a04d16",
    "0.5.23": "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
}
VERSIONS = tuple(WHEELS)
WHEEL_TAGS = (
    "--platform",
    "manylinux_2_34_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
)
OFFLINE_ENV = "RL_LIFECYCLE_OFFLINE"


class WheelUnavailable(RuntimeError):
    """The pinned wheel is neither cached nor downloadable."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rl-lifecycle" / "sglang"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_name(version: str) -> str:
    return f"sglang-{version}-cp311-cp311-manylinux_2_34_x86_64.whl"


def cached_wheel(version: str) -> Path | None:
    path = cache_dir() / wheel_name(version)
    return path if path.is_file() and _sha256(path) == WHEELS[version] else None


def fetch_wheel(version: str, timeout_s: float = 120.0) -> Path:
    """The pinned wheel from the cache, or downloaded there with pip (no dependencies, no install)."""
    cached = cached_wheel(version)
    if cached is not None:
        return cached
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    name = wheel_name(version)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            *WHEEL_TAGS,
            f"sglang=={version}",
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise WheelUnavailable(f"`{' '.join(command)}` did not finish within {timeout_s:.0f} s") from exc
        got = Path(tmp) / name
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise WheelUnavailable(f"`{' '.join(command)}` exited {proc.returncode}: {tail}")
        digest = _sha256(got)
        if digest != WHEELS[version]:
            raise WheelUnavailable(f"{name} has sha256 {digest}, expected {WHEELS[version]}")
        os.replace(got, target / name)
    return target / name


# ---------------------------------------------------------------------------------------------- the source


class _SourceText:
    """A default value as its source text, so signatures print as SGLang wrote them."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


@dataclass(frozen=True)
class ModuleRef:
    name: str


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True, eq=False)
class FunctionSym:
    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def is_async(self) -> bool:
        return isinstance(self.node, ast.AsyncFunctionDef)

    @property
    def is_async_generator(self) -> bool:
        """An `async def` that yields (its own body, not a nested function's)."""
        if not self.is_async:
            return False
        stack: list[ast.AST] = list(self.node.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.Yield, ast.YieldFrom)):
                return True
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.extend(ast.iter_child_nodes(node))
        return False

    @property
    def decorators(self) -> set[str]:
        return {ast.unparse(d).split("(")[0] for d in self.node.decorator_list}

    def signature(self, *, bound: bool) -> inspect.Signature:
        """The signature as written; `bound` drops the first parameter (self or cls)."""
        args = self.node.args
        positional = [*args.posonlyargs, *args.args]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
        defaults += args.defaults
        params = []
        for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
            kind = (
                inspect.Parameter.POSITIONAL_ONLY
                if i < len(args.posonlyargs)
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            params.append(_param(arg.arg, kind, default))
        if args.vararg:
            params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
            params.append(_param(arg.arg, inspect.Parameter.KEYWORD_ONLY, default))
        if args.kwarg:
            params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
        if bound:
            if not params or params[0].kind not in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                raise ValueError(f"{self.module}.{self.name} has no self/cls parameter to bind")
            params = params[1:]
        return inspect.Signature(params)

    def annotation(self, name: str) -> ast.expr | None:
        args = self.node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if arg.arg == name:
                return arg.annotation
        return None


def _param(name: str, kind: inspect._ParameterKind, default: ast.expr | None) -> inspect.Parameter:
    if default is None:
        return inspect.Parameter(name, kind)
    return inspect.Parameter(name, kind, default=_SourceText(ast.unparse(default)))


@dataclass(frozen=True)
class FieldSym:
    name: str
    annotation: ast.expr
    has_default: bool
    kw_only: bool


@dataclass(eq=False)
class ClassSym:
    module: str
    node: ast.ClassDef
    bases: list[ClassSym] = field(default_factory=list)
    external_bases: list[str] = field(default_factory=list)  # bases outside sglang (msgspec.Struct, ABC)

    @property
    def name(self) -> str:
        return self.node.name

    def mro(self) -> list[ClassSym]:
        order: list[ClassSym] = []
        for cls in [self, *(c for base in self.bases for c in base.mro())]:
            if cls not in order:
                order.append(cls)
        return order

    def method(self, name: str) -> FunctionSym | None:
        for cls in self.mro():
            for node in cls.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return FunctionSym(cls.module, node)
        return None

    def class_attribute(self, name: str) -> Const | None:
        for cls in self.mro():
            for node in cls.node.body:
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets
                ):
                    with contextlib.suppress(ValueError):
                        return Const(ast.literal_eval(node.value))
                    return Const(_SourceText(ast.unparse(node.value)))
        return None

    def instance_attributes(self) -> set[str]:
        """Names assigned as `self.NAME = ...` in any method of the class or its bases."""
        names: set[str] = set()
        for cls in self.mro():
            for node in ast.walk(cls.node):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets = [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        names.add(target.attr)
        return names

    @property
    def is_struct(self) -> bool:
        """A msgspec Struct or a dataclass: constructed from its fields."""
        for cls in self.mro():
            if any("Struct" in b for b in cls.external_bases):
                return True
            if any(
                ast.unparse(d).split("(")[0] in ("dataclass", "dataclasses.dataclass")
                for d in cls.node.decorator_list
            ):
                return True
        return False

    def fields(self) -> list[FieldSym]:
        """Struct fields, the bases' first, as msgspec and dataclasses order them."""
        found: dict[str, FieldSym] = {}
        for cls in reversed(self.mro()):
            class_kw_only = any(
                k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in cls.node.keywords
            ) or any("kw_only=True" in ast.unparse(d) for d in cls.node.decorator_list)
            for node in cls.node.body:
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                if "ClassVar" in ast.unparse(node.annotation):
                    continue
                value = node.value
                kw_only = class_kw_only or (
                    isinstance(value, ast.Call)
                    and any(k.arg == "kw_only" and ast.unparse(k.value) == "True" for k in value.keywords)
                )
                found[node.target.id] = FieldSym(node.target.id, node.annotation, value is not None, kw_only)
        return list(found.values())

    def field(self, name: str) -> FieldSym | None:
        return next((f for f in self.fields() if f.name == name), None)

    def constructor(self) -> inspect.Signature:
        if self.is_struct:
            positional, keyword = [], []
            for f in self.fields():
                default = _SourceText("...") if f.has_default else inspect.Parameter.empty
                if f.kw_only:
                    keyword.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default))
                else:
                    positional.append(
                        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
                    )
            return inspect.Signature([*positional, *keyword])
        init = self.method("__init__")
        return init.signature(bound=True) if init is not None else inspect.Signature([])


def literal_values(annotation: ast.expr) -> tuple[Any, ...]:
    """The values of a `Literal[...]` annotation (inside Optional/Annotated too); () if none."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).split(".")[-1] == "Literal":
            inner = node.slice
            items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return tuple(ast.literal_eval(item) for item in items)
    return ()


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    handler: FunctionSym


class SourceTree:
    """The modules of one SGLang wheel, parsed on demand."""

    def __init__(self, wheel: Path, version: str) -> None:
        self.wheel = wheel
        self.version = version
        self._zip = zipfile.ZipFile(wheel)
        self._files = set(self._zip.namelist())
        # Directories without __init__.py are namespace packages (sglang/srt is one).
        self._dirs = {name.rsplit("/", 1)[0] for name in self._files if "/" in name}
        self._dirs |= {d.rsplit("/", i)[0] for d in list(self._dirs) for i in range(1, d.count("/") + 1)}
        self._modules: dict[str, ast.Module] = {}
        self._classes: dict[tuple[str, str], ClassSym] = {}

    def close(self) -> None:
        self._zip.close()

    def _path(self, module: str) -> str | None:
        stem = module.replace(".", "/")
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in self._files:
                return candidate
        return None

    def has_module(self, module: str) -> bool:
        return self._path(module) is not None or module.replace(".", "/") in self._dirs

    def is_package(self, module: str) -> bool:
        return module.replace(".", "/") in self._dirs

    def module(self, module: str) -> ast.Module:
        if module not in self._modules:
            path = self._path(module)
            if path is None:
                if not self.has_module(module):
                    raise ModuleNotFoundError(f"sglang {self.version} has no module {module}")
                self._modules[module] = ast.Module(body=[], type_ignores=[])  # a namespace package
            else:
                self._modules[module] = ast.parse(self._zip.read(path), filename=path)
        return self._modules[module]

    def source(self, module: str) -> str:
        path = self._path(module)
        if path is None:
            raise ModuleNotFoundError(f"sglang {self.version} has no module {module}")
        return self._zip.read(path).decode()

    # ------------------------------------------------------------------ names

    def lookup(self, module: str, name: str, _seen: frozenset[tuple[str, str]] = frozenset()) -> Any:
        """What `module.name` is: a ClassSym, FunctionSym, Const, ModuleRef, or None if absent."""
        if (module, name) in _seen:
            return None
        seen = _seen | {(module, name)}
        found: Any = None
        stars: list[str] = []
        for node in _top_level(self.module(module)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                found = self._class(module, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = FunctionSym(module, node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                found = self._value(module, node.value, seen)
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                found = self._value(module, node.value, seen) if node.value is not None else None
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        if self.has_module(f"{source}.{alias.name}"):
                            found = ModuleRef(f"{source}.{alias.name}")
                        elif source.split(".")[0] == "sglang" and self.has_module(source):
                            found = self.lookup(source, alias.name, seen)
        if found is None:
            for source in stars:
                if self.has_module(source) and not name.startswith("_"):
                    found = self.lookup(source, name, seen)
                    if found is not None:
                        break
        if found is None and self.is_package(module) and self.has_module(f"{module}.{name}"):
            found = ModuleRef(f"{module}.{name}")
        return found

    def resolve(self, dotted: str) -> Any:
        """`sglang.srt.managers.io_struct.PauseGenerationReqInput` → its symbol (None if absent)."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if self.has_module(module):
                found: Any = ModuleRef(module)
                for part in parts[cut:]:
                    if isinstance(found, ModuleRef):
                        found = self.lookup(found.name, part)
                    elif isinstance(found, ClassSym):
                        found = found.method(part) or found.class_attribute(part)
                    else:
                        return None
                return found
        return None

    def cls(self, dotted: str) -> ClassSym:
        found = self.resolve(dotted)
        if not isinstance(found, ClassSym):
            raise LookupError(f"sglang {self.version}: {dotted} is not a class (found {found!r})")
        return found

    def server_args_fields(self) -> set[str]:
        """ServerArgs' field names: its class body's (0.5.17), or the field order 0.5.23 assembles
        it from (`msgspec.defstruct` over `arg_groups/fields`, so no class body to read)."""
        try:
            return {f.name for f in self.cls("sglang.srt.server_args.ServerArgs").fields()}
        except LookupError:
            return set(self.constants("sglang.srt.arg_groups.field_order")["POSITIONAL_FIELD_ORDER"])

    def constants(self, module: str) -> dict[str, Any]:
        """Module-level names bound to literal values (lists of such names resolved)."""
        values: dict[str, Any] = {}
        for node in _top_level(self.module(module)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found = self._value(module, node.value, frozenset())
                        if isinstance(found, Const):
                            values[target.id] = found.value
        return values

    def _class(self, module: str, node: ast.ClassDef) -> ClassSym:
        key = (module, node.name)
        if key not in self._classes:
            sym = ClassSym(module, node)
            self._classes[key] = sym
            for base in node.bases:
                resolved = self._expr(module, base)
                if isinstance(resolved, ClassSym):
                    sym.bases.append(resolved)
                else:
                    sym.external_bases.append(ast.unparse(base))
        return self._classes[key]

    def _expr(self, module: str, expr: ast.expr) -> Any:
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self._expr(module, expr.value)
            if isinstance(owner, ModuleRef):
                return self.lookup(owner.name, expr.attr)
        return None

    def _value(self, module: str, value: ast.expr, seen: frozenset[tuple[str, str]]) -> Any:
        with contextlib.suppress(ValueError, TypeError, SyntaxError):
            return Const(ast.literal_eval(value))
        if isinstance(value, ast.Name):
            return self.lookup(module, value.id, seen)
        if isinstance(value, (ast.List, ast.Tuple)):
            items = [self._value(module, item, seen) for item in value.elts]
            if all(isinstance(item, Const) for item in items):
                values = [item.value for item in items]
                return Const(values if isinstance(value, ast.List) else tuple(values))
        # sglang/__init__.py: `Engine = LazyImport("sglang.srt.entrypoints.engine", "Engine")`
        if (
            isinstance(value, ast.Call)
            and ast.unparse(value.func).endswith("LazyImport")
            and len(value.args) == 2
            and all(isinstance(a, ast.Constant) for a in value.args)
        ):
            target_module, target_name = (a.value for a in value.args)  # type: ignore[attr-defined]
            return self.lookup(target_module, target_name, seen)
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.is_package(module) else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{node.module}" if node.module else package

    # ------------------------------------------------------------------ HTTP

    def routes(self, *modules: str) -> dict[str, Route]:
        """FastAPI routes declared with `@app.get/post/api_route` or `@router.get/post/...`, by path."""
        found: dict[str, Route] = {}
        for module in modules:
            for node in _top_level(self.module(module)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for decorator in node.decorator_list:
                    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                        continue
                    verb = decorator.func.attr
                    if verb not in ("get", "post", "put", "delete", "api_route") or not decorator.args:
                        continue
                    path = decorator.args[0]
                    if not isinstance(path, ast.Constant):
                        continue  # a route named by an environment variable
                    if verb == "api_route":
                        methods = next(
                            (ast.literal_eval(k.value) for k in decorator.keywords if k.arg == "methods"),
                            ["GET"],
                        )
                    else:
                        methods = [verb.upper()]
                    route = found.get(path.value)
                    merged = frozenset(methods) | (route.methods if route else frozenset())
                    found[path.value] = Route(path.value, merged, FunctionSym(module, node))
        return found

    def body_struct(self, route: Route) -> ClassSym | None:
        """The request struct FastAPI parses the JSON body into (the handler's class-typed parameter)."""
        for arg in route.handler.node.args.args:
            if arg.annotation is None:
                continue
            annotation = arg.annotation
            if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).endswith("Annotated"):
                first = (
                    annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
                )
                annotation = first
            found = self._expr(route.handler.module, annotation)
            if isinstance(found, ClassSym):
                return found
        return None


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module statements, including those under module-level if/try (optional imports)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            stack.extend(reversed([*node.body, *node.orelse]))
        elif isinstance(node, ast.Try):
            stack.extend(reversed([*node.body, *(s for h in node.handlers for s in h.body), *node.orelse]))
        else:
            yield node


# ---------------------------------------------------------------------------------------------- recording fakes


@dataclass
class Call:
    """One call the adapter made on SGLang, and the signature SGLang's source gives it."""

    qualname: str
    signature: inspect.Signature
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    where: str  # module.Class of the definition
    version: str

    def problem(self) -> str | None:
        try:
            self.signature.bind(*self.args, **self.kwargs)
        except TypeError as exc:
            shown = ", ".join(
                [*map(_short, self.args), *(f"{k}={_short(v)}" for k, v in self.kwargs.items())]
            )
            return (
                f"{self.qualname}({shown}) does not bind to sglang {self.version}'s "
                f"{self.where}{self.signature}: {exc}"
            )
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class SourceShapedSGLang:
    """Recording fakes for SGLang's modules and classes, shaped by its parsed source.

    `answers` maps a qualname ("Engine.flush_cache") to the value a call returns, or to a
    callable computing it from the call's arguments. `instance_values` maps "Class.attr" to the
    value of an attribute the class assigns on `self` (SGLang's `Engine.loop`, for example).
    """

    def __init__(
        self,
        tree: SourceTree,
        *,
        answers: Mapping[str, Any] | None = None,
        instance_values: Mapping[str, Any] | None = None,
    ) -> None:
        self.tree = tree
        self.calls: list[Call] = []
        self.answers = dict(answers or {})
        self.instance_values = dict(instance_values or {})
        self._classes: dict[int, type] = {}

    def problems(self) -> list[str]:
        return [p for p in (c.problem() for c in self.calls) if p is not None]

    def called(self) -> set[str]:
        return {c.qualname for c in self.calls}

    def fake_class(self, dotted: str) -> type:
        return self._fake(self.tree.cls(dotted))

    def make(self, dotted: str, **fields: Any) -> Any:
        """An instance of a fake class for an answer, not recorded; a struct's fields must bind."""
        cls = self.tree.cls(dotted)
        instance = object.__new__(self._fake(cls))
        values = dict(cls.constructor().bind(**fields).arguments) if cls.is_struct else {}
        object.__setattr__(instance, "_fields", values)
        return instance

    # ------------------------------------------------------------------ modules

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """`import sglang...` resolves to these fakes inside the block (real sglang set aside)."""
        saved = {
            name: mod for name, mod in sys.modules.items() if name == "sglang" or name.startswith("sglang.")
        }
        for name in saved:
            del sys.modules[name]
        finder = _Finder(self)
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
                del sys.modules[name]
            sys.modules.update(saved)

    def module_attribute(self, module: str, name: str) -> Any:
        if f"{module}:{name}" in self.instance_values:  # a value the source computes at import time
            return self.instance_values[f"{module}:{name}"]
        found = self.tree.lookup(module, name)
        if isinstance(found, ClassSym):
            return self._fake(found)
        if isinstance(found, FunctionSym):
            return self._recorder(found.name, found, bound=False, where=module)
        if isinstance(found, Const):
            return found.value
        if isinstance(found, ModuleRef):
            return importlib.import_module(found.name)
        raise AttributeError(f"sglang {self.tree.version}: module {module} has no attribute {name!r}")

    # ------------------------------------------------------------------ classes and instances

    def _fake(self, cls: ClassSym) -> type:
        if id(cls) in self._classes:
            return self._classes[id(cls)]
        shaped = self

        class Meta(type):
            def __call__(self_cls, *args: Any, **kwargs: Any) -> Any:
                qualname = f"{cls.name}()"
                shaped.calls.append(
                    Call(
                        qualname,
                        cls.constructor(),
                        args,
                        kwargs,
                        f"{cls.module}.{cls.name}",
                        shaped.tree.version,
                    )
                )
                instance = object.__new__(self_cls)
                values: dict[str, Any] = {}
                if cls.is_struct:
                    with contextlib.suppress(TypeError):
                        values = dict(cls.constructor().bind(*args, **kwargs).arguments)
                object.__setattr__(instance, "_fields", values)
                return instance

            def __getattr__(self_cls, name: str) -> Any:
                return shaped._class_attribute(cls, name)

        def instance_getattr(instance: Any, name: str) -> Any:
            return shaped._instance_attribute(cls, instance, name)

        fake = Meta(cls.name, (), {"__getattr__": instance_getattr, "__module__": cls.module})
        self._classes[id(cls)] = fake
        return fake

    def _class_attribute(self, cls: ClassSym, name: str) -> Any:
        method = cls.method(name)
        if method is not None and ({"staticmethod", "classmethod"} & method.decorators):
            bound = "classmethod" in method.decorators
            return self._recorder(
                f"{cls.name}.{name}", method, bound=bound, where=f"{method.module}.{cls.name}"
            )
        constant = cls.class_attribute(name)
        if constant is not None:
            return constant.value
        raise AttributeError(
            f"sglang {self.tree.version}: class {cls.module}.{cls.name} has no class attribute {name!r}"
        )

    def _instance_attribute(self, cls: ClassSym, instance: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        fields = object.__getattribute__(instance, "_fields")
        if name in fields:
            return fields[name]
        method = cls.method(name)
        if method is not None:
            bound = "staticmethod" not in method.decorators
            if "property" in method.decorators:
                return self._answer(f"{cls.name}.{name}", (), {})
            return self._recorder(
                f"{cls.name}.{name}", method, bound=bound, where=f"{method.module}.{cls.name}"
            )
        field_ = cls.field(name) if cls.is_struct else None
        if field_ is not None:
            return _SourceText(f"<default of {cls.name}.{name}>")
        key = f"{cls.name}.{name}"
        if name in cls.instance_attributes():
            if key in self.instance_values:
                return self.instance_values[key]
            raise AttributeError(
                f"sglang {self.tree.version}: {cls.name} sets self.{name}, but the fake was given no value for it "
                f"(pass instance_values={{{key!r}: ...}})"
            )
        constant = cls.class_attribute(name)
        if constant is not None:
            return constant.value
        raise AttributeError(
            f"sglang {self.tree.version}: {cls.module}.{cls.name} has no method, field or attribute {name!r} "
            "(nor its bases)"
        )

    def _recorder(self, qualname: str, fn: FunctionSym, *, bound: bool, where: str) -> Callable[..., Any]:
        signature = fn.signature(bound=bound)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(
                Call(qualname, signature, args, kwargs, f"{where}.{fn.name}", self.tree.version)
            )
            result = self._answer(qualname, args, kwargs)
            if fn.is_async_generator:

                async def stream() -> Any:
                    yield (await result) if inspect.isawaitable(result) else result

                return stream()
            if fn.is_async:

                async def answer() -> Any:
                    # An answer may itself be awaitable: one that never finishes stands for a hang.
                    return (await result) if inspect.isawaitable(result) else result

                return answer()
            return result

        call.__signature__ = signature  # type: ignore[attr-defined]
        call.__name__ = fn.name
        return call

    def _answer(self, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        answer = self.answers.get(qualname)
        return answer(*args, **kwargs) if callable(answer) else answer


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, shaped: SourceShapedSGLang) -> None:
        self.shaped = shaped

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if not self.shaped.tree.has_module(fullname):
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self, is_package=self.shaped.tree.is_package(fullname)
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        shaped, name = self.shaped, spec.name

        def module_getattr(attribute: str) -> Any:
            return shaped.module_attribute(name, attribute)

        module.__getattr__ = module_getattr  # type: ignore[method-assign]
        if spec.submodule_search_locations is not None:
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def event_loop() -> asyncio.AbstractEventLoop:
    """A loop standing in for `Engine.loop` (the adapter runs SGLang's coroutines on it)."""
    return asyncio.new_event_loop()


HTTP_MODULES = ("sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.v1_loads")


def request_problem(tree: SourceTree, method: str, target: str, body: Any) -> str | None:
    """Why SGLang's HTTP server would not route or parse this request, or None if it would.

    The path must be a route with that method; query parameters must be the handler's; a JSON
    object body must bind, by keyword, to the request struct the handler parses it into.
    """
    routes = tree.routes(*HTTP_MODULES)
    split = urllib.parse.urlsplit(target)
    route = routes.get(split.path)
    if route is None:
        return f"{method} {split.path}: sglang {tree.version}'s HTTP server has no such route"
    if method not in route.methods:
        return f"{method} {split.path}: the route accepts {sorted(route.methods)} in sglang {tree.version}"
    handler_params = {a.arg for a in [*route.handler.node.args.args, *route.handler.node.args.kwonlyargs]}
    unknown = sorted(set(urllib.parse.parse_qs(split.query)) - handler_params)
    if unknown:
        return f"{method} {split.path}: query parameters {unknown} are not parameters of {route.handler.name}"
    if isinstance(body, dict):
        struct = tree.body_struct(route)
        if struct is None:
            return f"{method} {split.path}: a JSON body was sent but {route.handler.name} parses none"
        try:
            struct.constructor().bind(**body)
        except TypeError as exc:
            return f"{method} {split.path}: body {sorted(body)} does not bind to {struct.name}: {exc}"
    return None

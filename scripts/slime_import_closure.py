"""Which top-level modules slime's job imports that neither Python, the GPU image nor the carried set has.

Walks the module-level imports (ast, nothing is imported) reachable from the roots slime's driver and
workers start from (train.py, the trainer actor, the rollout manager, SGLang's engine actor and HTTP
server, the router, Megatron's training module, the launch switch), through the sources given with
--source (directories: the exported slime and Megatron, this repository) and the wheels given with
--wheels (read inside the .whl files, never installed; only the packages in FOLLOW_WHEELS are walked
into), a module's file in an --overlay directory read instead of its package's own. Imports inside functions are not followed (they run only on the paths that call them). Each
missing module is reported under the strongest way it is imported: required (unconditional, at load),
under if (a module-level `if`, mostly a platform test: ROCm, NPU, MUSA, an env switch; and whatever a
module reached only that way imports), guarded (a `try` whose handler catches ImportError or
Exception, a `with suppress(ImportError)`, or `if TYPE_CHECKING`). `if __name__ == "__main__"` blocks are skipped.

    python3 scripts/slime_import_closure.py --source .gpuw/slime/src/slime \\
        --source .gpuw/slime/src/Megatron-LM --source . --wheels .gpuw/slime/wheels

Prints each missing top-level module with one place that imports it, required first, and exits 1 if
a required one is missing (scripts/gpu_slime_wheels.sh runs it after laying out the set).
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The GPU image's Python packages (the device library's KINDS.md, read 2026-11-17), as import names.
_IMAGE = """absl accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attr attrs botorch
    build certifi charset_normalizer chex click cloudpickle cmake colorama contourpy coverage cuda
    cupy cupy_backends cupyx cycler Cython cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fontTools formulaic frozenlist fsspec gpytorch grpc h11 h5py hf_xet httpcore httpx
    huggingface_hub humanize hypothesis idna imageio iniconfig interface_meta jax jax_cuda13_pjrt
    jax_cuda13_plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy_loader lightning
    lightning_utilities linear_operator lineax llvmlite lxml markdown markdown_it markupsafe matplotlib
    mdurl mesonbuild ml_dtypes mpi4py mpmath msgpack multidict multipledispatch mypy_extensions nanobind
    narwhals networkx ninja numba numba_cuda numpy numpyro nvidia pynvml onnx onnx_ir onnxruntime
    onnxscript cv2 optax psutil safetensors opt_einsum opt_einsum_fx optimistix orbax packaging pandas pathspec patsy peft
    PIL pip pluggy portalocker prometheus_client propcache google pyarrow pybind11 cpuinfo pygments
    pyparsing pyproject_hooks pyre_extensions pytest _pytest pytest_benchmark pytest_cov pytest_mock
    pytest_timeout xdist dateutil pytorch_lightning yaml _yaml regex requests rich sacrebleu
    scikit_build_core skimage sklearn scipy seaborn sentencepiece sentence_transformers setuptools
    pkg_resources _distutils_hack shellingham simplejson six sortedcontainers statsmodels sympy tabulate
    tensorboard tensorboard_data_server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
    toolz torch torchgen functorch torchaudio torchdiffeq torch_geometric torchmetrics torchvision tqdm
    transformers treescope triton typer typing_extensions typing_inspect urllib3 uvloop
    wadler_lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
IMAGE_MODULES = frozenset(_IMAGE.split())
# Python 3.12's standard library beyond what the running interpreter lists (it may be 3.11).
STDLIB = frozenset(sys.stdlib_module_names) | {"tomllib", "_typeshed", "__future__"}

# Where slime's driver and workers start: the driver runs train.py; the trainer actor, the rollout
# manager and SGLang's engine actor are Ray workers; SGLang's server and scheduler are its subprocesses.
DEFAULT_ROOTS = (
    "train",
    "slime.ray.placement_group",
    "slime.ray.rollout",
    "slime.backends.megatron_utils.actor",
    "slime.backends.sglang_utils.sglang_engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.models.qwen2",
    "sglang_router.launch_router",
    "megatron.training",
    "torch_memory_saver",
    "actor_integration.frameworks.launch",
    "actor_integration.models.megatron_spec",
    "ray.scripts.scripts",  # `ray start --head`, `ray job submit`
    "ray.dashboard.optional_deps",  # what the dashboard's job server needs (ray[default])
    "ray.dashboard.modules.job.job_head",
    "wandb",
)
FOLLOW_WHEELS = ("sglang", "sglang_router", "sgl_kernel", "torch_memory_saver", "ray", "wandb", "flashinfer")


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    names: tuple[str, ...]  # `from module import names` (maybe submodules)
    kind: str  # "required"; "conditional" (under a module-level if); "guarded" (a try catching
    # ImportError or Exception, or `if TYPE_CHECKING`)
    line: int


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {k.id if isinstance(k, ast.Name) else getattr(k, "attr", "") for k in kinds}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError"})


def _suppresses_import_error(node: ast.With) -> bool:
    """`with suppress(ImportError)` / `with contextlib.suppress(...)` naming ImportError or a base of it."""
    for item in node.items:
        call = item.context_expr
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name != "suppress":
            continue
        caught = {a.id if isinstance(a, ast.Name) else getattr(a, "attr", "") for a in call.args}
        if caught & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}:
            return True
    return False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main(test: ast.expr) -> bool:
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"


_RANK = {"required": 0, "conditional": 1, "guarded": 2}


def _weaker(kind: str, other: str) -> str:
    return kind if _RANK[kind] >= _RANK[other] else other


def _at_load(body: Iterable[ast.stmt], kind: str, type_checking: bool) -> Iterator[tuple[ast.stmt, str]]:
    """Each statement a module's import runs (module and class bodies, not functions), with how surely
    it runs: the bodies of `if`, `try`, `with` and `class` flattened after the statement that holds
    them; `if __name__ == "__main__"` skipped, `if TYPE_CHECKING` bodies (as guarded) only with
    `type_checking`."""
    for node in body:
        if isinstance(node, ast.If):
            if _is_main(node.test):
                continue
            yield node, kind
            if not _is_type_checking(node.test):
                yield from _at_load(node.body, _weaker(kind, "conditional"), type_checking)
            elif type_checking:
                yield from _at_load(node.body, _weaker(kind, "guarded"), type_checking)
            yield from _at_load(node.orelse, _weaker(kind, "conditional"), type_checking)
        elif isinstance(node, ast.Try):
            caught = any(_catches_import_error(h) for h in node.handlers)
            yield from _at_load(node.body, _weaker(kind, "guarded") if caught else kind, type_checking)
            for h in node.handlers:
                yield from _at_load(h.body, _weaker(kind, "conditional"), type_checking)
            yield from _at_load([*node.orelse, *node.finalbody], kind, type_checking)
        elif isinstance(node, ast.With):
            yield node, kind
            inner = _weaker(kind, "guarded") if _suppresses_import_error(node) else kind
            yield from _at_load(node.body, inner, type_checking)
        elif isinstance(node, ast.ClassDef):
            yield node, kind
            yield from _at_load(node.body, kind, type_checking)
        else:
            yield node, kind


def module_imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[Import]:
    """The imports a module runs when it is imported (module and class bodies, not functions)."""
    package = module if is_package else module.rpartition(".")[0]
    for node, kind in _at_load(tree.body, "required", type_checking=True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, (), kind, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, base] if base else parts)
            yield Import(base, tuple(a.name for a in node.names), kind, node.lineno)
    yield from lazy_loads(tree)


def _walk_at_load(node: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk`, less what a function or a lambda holds (it runs when called, not at load)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)


def _lazy_loaders(tree: ast.Module) -> dict[str, str]:
    """NAME -> module of each module-level `NAME = LazyLoader("local", globals(), "module")` (vLLM's,
    and the like: a module object that imports its module on the first attribute read)."""
    found: dict[str, str] = {}
    for node in _walk_at_load(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        func, args = node.value.func, node.value.args
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name != "LazyLoader" or len(args) < 3 or not isinstance(args[2], ast.Constant):
            continue
        if isinstance(args[2].value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = args[2].value
    return found


def _evaluated(node: ast.stmt, annotations: bool) -> list[ast.AST]:
    """What Python 3.12 evaluates of a statement `_at_load` yields: an `if`'s test, a `with`'s
    context managers, a class's decorators, bases and keywords, a function's decorators, defaults and
    (with `annotations`: no `from __future__ import annotations`) annotations, an annotated
    assignment's annotation (likewise) and value, any other statement whole; nothing of an import."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return []
    if isinstance(node, ast.If):
        return [node.test]
    if isinstance(node, ast.With):
        return [item.context_expr for item in node.items]
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        loaded: list[ast.AST] = [*node.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d)]
        if annotations:
            every = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
            loaded += [x.annotation for x in every if x.annotation] + ([node.returns] if node.returns else [])
        return loaded
    if isinstance(node, ast.AnnAssign):
        return ([node.annotation] if annotations else []) + ([node.value] if node.value is not None else [])
    return [node]


def lazy_loads(tree: ast.Module) -> Iterator[Import]:
    """The lazily loaded modules a module's import loads after all: an attribute of a LazyLoader
    read in code that runs at load (a dataclass field annotated `llguidance.LLMatcher` imports
    llguidance with the module; vLLM 0.26's structured-output backends do this)."""
    lazy = _lazy_loaders(tree)
    if not lazy:
        return
    future = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    for statement, kind in _at_load(tree.body, "required", type_checking=False):
        for node in (n for expr in _evaluated(statement, not future) for n in _walk_at_load(expr)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in lazy:
                yield Import(lazy[node.value.id], (), kind, node.lineno)


@dataclass
class Sources:
    """Module sources in directories and inside wheels, by top-level name."""

    dirs: list[Path] = field(default_factory=list)
    wheels: dict[str, zipfile.ZipFile] = field(default_factory=dict)  # top-level name → wheel
    # Files laid over an installed package (slime's SGLang patches, say): a module found here is read
    # from here, wherever else its package comes from.
    overlays: list[Path] = field(default_factory=list)
    follow_wheels: frozenset[str] = frozenset(FOLLOW_WHEELS)

    def add_wheels(self, folder: Path) -> None:
        for whl in sorted(folder.rglob("*.whl")):
            archive = zipfile.ZipFile(whl)
            for name in archive.namelist():
                top = name.split("/", 1)[0]
                if ".dist-info" in top or ".data" in top:
                    continue
                self.wheels.setdefault(top.split(".", 1)[0], archive)

    def provided(self, top: str) -> bool:
        return top in self.wheels or self._in_dirs(top) is not None

    def _in_dirs(self, top: str) -> Path | None:
        for d in self.dirs:
            if (d / top).is_dir() or (d / f"{top}.py").is_file():
                return d
        return None

    def source(self, module: str) -> tuple[str, bool] | None:
        """(text, is_package) of a module we follow, or None."""
        rel = module.replace(".", "/")
        top = module.split(".", 1)[0]
        for overlay in self.overlays:
            for path, pkg in ((overlay / rel / "__init__.py", True), (overlay / f"{rel}.py", False)):
                if path.is_file() and (
                    (top in self.follow_wheels and top in self.wheels) or self._in_dirs(top)
                ):
                    return path.read_text(errors="replace"), pkg
        d = self._in_dirs(top)
        if d is not None:
            for path, pkg in ((d / rel / "__init__.py", True), (d / f"{rel}.py", False)):
                if path.is_file():
                    return path.read_text(errors="replace"), pkg
            return None
        archive = self.wheels.get(top)
        if archive is None or top not in self.follow_wheels:
            return None
        names = set(archive.namelist())
        for member, pkg in ((f"{rel}/__init__.py", True), (f"{rel}.py", False)):
            if member in names:
                return archive.read(member).decode(errors="replace"), pkg
        return None


@dataclass
class Missing:
    """Top-level modules found nowhere, by how they are imported: name → first "module:line"."""

    required: dict[str, str] = field(default_factory=dict)
    conditional: dict[str, str] = field(default_factory=dict)
    guarded: dict[str, str] = field(default_factory=dict)

    def add(self, top: str, kind: str, where: str) -> None:
        for name in _RANK:  # keep each module under the strongest way it is imported
            bucket: dict[str, str] = getattr(self, name)
            if top in bucket:
                if _RANK[name] <= _RANK[kind]:
                    return
                del bucket[top]
        getattr(self, kind)[top] = where


def closure(
    sources: Sources,
    roots: Iterable[str],
    trace: Iterable[str] = (),
    reached: dict[str, str] | None = None,
) -> tuple[Missing, int, list[str]]:
    """Walk from the roots: what is missing, how many modules were read, and where the top-level
    modules named in `trace` are imported (present or not), one "module:line kind -> name" each.
    `reached`, when given, is filled with each top-level module found in the sources or the wheels
    (not the image's) and the strongest way it was reached."""
    traced, sites = frozenset(trace), []
    missing = Missing()
    seen: dict[str, str] = {}  # module → the strongest way it was reached
    queue: list[tuple[str, str]] = []

    def want(module: str, kind: str, where: str) -> None:
        top = module.split(".", 1)[0]
        if top in traced:
            sites.append(f"{where} {kind} -> {module}")
        if not top or top in STDLIB:
            return
        if not sources.provided(top) and top not in IMAGE_MODULES:
            missing.add(top, kind, where)
            return
        stronger = reached is not None and (top not in reached or _RANK[kind] < _RANK[reached[top]])
        if reached is not None and stronger and sources.provided(top):
            reached[top] = kind  # the strongest way it is reached
        if kind != "guarded":  # a guarded import may fail there: what it would import is not followed
            parts = module.split(".")
            queue.extend((".".join(parts[: i + 1]), kind) for i in range(len(parts)))

    for root in roots:
        want(root, "required", "<root>")
    read = 0
    while queue:
        module, context = queue.pop()
        if module in seen and _RANK[seen[module]] <= _RANK[context]:
            continue
        seen[module] = context
        found = sources.source(module)
        if found is None:
            continue
        text, is_package = found
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        read += 1
        for imp in module_imports(tree, module, is_package):
            # what a module reached only under an `if` imports runs only there too
            kind, where = _weaker(imp.kind, context), f"{module}:{imp.line}"
            want(imp.module, kind, where)
            for name in imp.names:
                sub = f"{imp.module}.{name}"
                if name != "*" and sources.source(sub) is not None:
                    want(sub, kind, where)
    return missing, read, sites


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--source", action="append", type=Path, default=[], help="a directory of modules")
    parser.add_argument("--wheels", action="append", type=Path, default=[], help="a folder of .whl files")
    parser.add_argument(
        "--overlay",
        action="append",
        type=Path,
        default=[],
        help="a directory of files laid over a carried package (read instead of the package's own)",
    )
    parser.add_argument("--root", action="append", default=None, help="a module to start from (repeat)")
    parser.add_argument(
        "--trace", action="append", default=[], help="print where this top-level module is imported"
    )
    parser.add_argument(
        "--follow",
        action="append",
        default=None,
        help="a wheel's top-level module to walk into (repeat; 'all': every wheel's)",
    )
    parser.add_argument(
        "--reached", action="store_true", help="print each carried top-level module the walk reached"
    )
    args = parser.parse_args(argv)
    sources = Sources(dirs=list(args.source), overlays=list(args.overlay))
    for folder in args.wheels:
        sources.add_wheels(folder)
    if args.follow:
        sources.follow_wheels = frozenset(sources.wheels if "all" in args.follow else args.follow)
    reached: dict[str, str] = {}
    missing, read, sites = closure(sources, args.root or DEFAULT_ROOTS, args.trace, reached)
    for site in sites:
        print(f"trace: {site}")
    if args.reached:
        for top, kind in sorted(reached.items()):
            print(f"reached ({kind}) {top}")
    print(
        f"read {read} modules from {len(args.source)} source folders and {len(sources.wheels)} wheel top-levels"
    )
    for top, where in sorted(missing.required.items()):
        print(f"MISSING (required) {top:24} first imported at {where}")
    for top, where in sorted(missing.conditional.items()):
        print(f"absent (under if)  {top:24} first imported at {where}")
    for top, where in sorted(missing.guarded.items()):
        print(f"absent (guarded)   {top:24} first imported at {where}")
    return 1 if missing.required else 0


if __name__ == "__main__":
    raise SystemExit(main())

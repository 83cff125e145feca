"""Old module paths, kept importable for one release (0.2 removes them).

0.1's modules sat side by side in `actor_integration/`; they now live in packages named for what
they hold (`backends/`, `actors/`, `tools/`, `models/`, `frameworks/`); the SGLang modules of
`rollout/` and `frameworks/` moved to `engines/sglang/`, each framework's adapters to
`frameworks/<name>/`. Importing an old path gives
the new module itself (the same classes, so isinstance checks and Ray's pickles by name still work)
and one `DeprecationWarning` naming the new path.

A name that left a module which stays (`MOVED_NAMES`) answers there the same way: the module's
`__getattr__` hands it to `moved_name`, which gives the object from its new home and warns.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

MOVED = {
    "actor_integration.memory_saver": "actor_integration.backends.memory_saver",
    "actor_integration.tms_env": "actor_integration.backends.tms_env",
    "actor_integration.process_groups": "actor_integration.backends.process_groups",
    "actor_integration.megatron": "actor_integration.backends.megatron",
    "actor_integration.clear_memory": "actor_integration.backends.clear_memory",
    "actor_integration.routing_replay": "actor_integration.backends.routing_replay",
    "actor_integration.model_tag": "actor_integration.backends.model_tag",
    "actor_integration.release_audit": "actor_integration.backends.release_audit",
    "actor_integration.mixin": "actor_integration.actors.mixin",
    "actor_integration.ray_group": "actor_integration.actors.ray_group",
    "actor_integration.cli": "actor_integration.tools.cli",
    "actor_integration.doctor": "actor_integration.tools.doctor",
    "actor_integration.demo": "actor_integration.tools.demo",
    "actor_integration.tiny_model": "actor_integration.models.tiny",
    "actor_integration.qwen2_model": "actor_integration.models.qwen2",
    "actor_integration.slime": "actor_integration.frameworks.slime",
    # 0.1.x, issue 48: each engine a package of its own, each framework's adapters one package
    "actor_integration.rollout.sglang": "actor_integration.engines.sglang.engine",
    "actor_integration.rollout.sglang_http": "actor_integration.engines.sglang.http",
    "actor_integration.rollout.sglang_receiver": "actor_integration.engines.sglang.receiver",
    "actor_integration.rollout.sglang_scheduler": "actor_integration.engines.sglang.scheduler",
    "actor_integration.frameworks.sglang_actor": "actor_integration.engines.sglang.actor",
    "actor_integration.frameworks.router": "actor_integration.rollout.router",
    "actor_integration.frameworks.slime_rollout": "actor_integration.frameworks.slime.rollout",
    "actor_integration.frameworks.miles_rollout": "actor_integration.frameworks.miles.rollout",
}

# Names that left a module which stays, by their whole dotted paths (old -> new).
MOVED_NAMES = {
    # 0.1.x, issue 48: the payload codec is the weight sync's, whatever engine's processes receive
    "actor_integration.engines.sglang.receiver.encode_payload": "actor_integration.weight_sync.wire.encode_payload",
    "actor_integration.engines.sglang.receiver.decode_payload": "actor_integration.weight_sync.wire.decode_payload",
    "actor_integration.engines.sglang.receiver.TRANSPORTS": "actor_integration.weight_sync.wire.PAYLOAD_TRANSPORTS",
}


def moved_name(module: str, name: str) -> Any:
    """`module.name` asked for under its old path: the object at its new one, with a DeprecationWarning
    (what a module's `__getattr__` returns); an AttributeError for a name that never moved."""
    new = MOVED_NAMES.get(f"{module}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} moved to {new}; import it from there (the old name goes in 0.2)",
        DeprecationWarning,
        stacklevel=3,
    )
    where, attr = new.rsplit(".", 1)
    return getattr(importlib.import_module(where), attr)


def new_name(old: str) -> str | None:
    """The module an old dotted path now names (`actor_integration.demo.step` included), or None."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix) :]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; import it from there (the old path goes in 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported; the old name is only bound to it."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves an old path to its new module; `import actor_integration` installs it once."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not fullname.startswith("actor_integration."):
            return None  # every other import of the process passes here first: answer at once
        new = new_name(fullname)
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        alias = ModuleSpec(fullname, _Alias(new), is_package=spec.submodule_search_locations is not None)
        alias.submodule_search_locations = spec.submodule_search_locations
        return alias


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())

"""`MegatronParallelState`: the process-group backend of a Megatron trainer.

Megatron keeps its groups in `parallel_state` module globals. Sleep calls
`destroy_model_parallel()`, which forgets them (and destroys its few gloo groups), then the
groups' `destroy()`, which tears every communicator still registered in torch down at once,
Megatron's included, WORLD last (torch's own WORLD destroy takes them one by one: 8.8-9.2 s for
Megatron's 27 groups on an H200); wake rebuilds WORLD and calls `initialize_model_parallel(**kwargs)`
again, so Megatron creates fresh groups the honest way instead of slime's monkey-patched group
wrappers. Where the groups suspend or keep their communicators instead (`communicators=`),
Megatron's groups stay as they are; any of them that NCCL could not suspend (and so tore down)
makes the wake re-initialise Megatron's groups the same way.

Megatron modules also cache group objects at construction (`self.tp_group`, `pg_collection`).
Those are stale after a reload: with NCCL they are aborted communicators, with gloo they keep the
old connections alive. Objects given to `register()` get their cached groups swapped for the new
ones after every reload.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any, cast

import torch
from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import ReloadableProcessGroups, each_at_once
from actor_integration.errors import MemorySaverConfigError
from lifecycle.table import ASLEEP, ASLEEP_GROUPS, Communicators, Groups

__all__ = ["MegatronParallelState"]

_INSTALL_HINT = "pip install rl-lifecycle[megatron]"


def _parallel_state() -> ModuleType:
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise ImportError(
            f"MegatronParallelState needs megatron-core, which is not importable ({exc}); {_INSTALL_HINT}"
        ) from exc
    except AttributeError as exc:
        if "_impl_ctor_kwargs" not in str(exc):
            raise
        # Seen with megatron-core 0.19.2 and torch_memory_saver 0.0.10 on an H200.
        raise MemorySaverConfigError(
            "importing megatron.core failed: megatron-core sets torch_memory_saver.hook_mode = 'torch' when "
            "it is imported (megatron/core/inference/contexts/dynamic_context.py), and torch_memory_saver "
            f"refuses that once it is initialised ({exc}). Import megatron.core, or build "
            "MegatronParallelState, before TorchMemorySaverBackend (or anything else that uses torch_memory_saver)."
        ) from exc
    return cast(ModuleType, parallel_state)


class MegatronParallelState:
    """destroy()/reload()/is_alive() for `lifecycle.Lifecycle(process_groups=...)` on a Megatron trainer.

    Every reload re-runs `parallel_state.initialize_model_parallel` with the layout Megatron runs
    with now: when Megatron is initialised already, its layout (TP, PP, VPP, CP, EP, ETP, order,
    gloo groups) is read back from `parallel_state`, and `init_kwargs` may only add to it (a
    size that differs is an error: a reload would change the layout, e.g. PP=2 into DP=2);
    otherwise `init_kwargs` initialise it now.
    """

    def __init__(self, groups: ReloadableProcessGroups, **init_kwargs: Any) -> None:
        if not isinstance(groups, ReloadableProcessGroups):
            raise TypeError(
                f"MegatronParallelState needs ReloadableProcessGroups, got {type(groups).__name__}"
            )
        self._ps = _parallel_state()
        self.groups = groups
        self.init_kwargs = dict(init_kwargs)
        self._registered: list[Any] = []
        self._stale: dict[str, Any] = {}
        if not groups.is_alive():
            raise RuntimeError(
                f"MegatronParallelState: the process groups are {groups.state}; build it while they are alive"
            )
        if self._ps.model_parallel_is_initialized():
            live = _live_layout(self._ps, order=self.init_kwargs.get("order"))
            given = {k: v for k, v in self.init_kwargs.items() if k in live}
            if given.get("expert_tensor_parallel_size", 0) is None:  # Megatron: None means TP's size
                given["expert_tensor_parallel_size"] = given.get(
                    "tensor_model_parallel_size", live["tensor_model_parallel_size"]
                )
            wrong = {k: (v, live[k]) for k, v in given.items() if v != live[k]}
            if wrong:
                raise ValueError(
                    "MegatronParallelState: Megatron is initialised with a different layout than given "
                    + ", ".join(f"{k}={g!r} (Megatron has {m!r})" for k, (g, m) in wrong.items())
                    + "; every reload would rebuild the groups with the given one. Pass no sizes to use "
                    "Megatron's own layout, or the sizes it was initialised with."
                )
            self.init_kwargs = {**self.init_kwargs, **live}
        else:
            self._ps.initialize_model_parallel(**self.init_kwargs)

    def register(self, *objects: Any) -> None:
        """Models, optimizers or group collections whose cached Megatron groups follow each reload."""
        self._registered.extend(objects)

    @property
    def communicators(self) -> str:
        """What sleep does to the communicators: the groups' way (the lifecycle machine reads it)."""
        return self.groups.communicators

    def is_alive(self) -> bool:
        """Whether the groups are up and Megatron's parallel state is initialized; recover asks it."""
        return bool(self.groups.is_alive() and self._ps.model_parallel_is_initialized())

    def destroy(self) -> None:
        """Forget Megatron's groups, then destroy every communicator, all at once, WORLD last. Collective.

        Where the groups suspend or keep their communicators, Megatron's groups stay as they are.
        """
        # Megatron's groups stay registered in torch until the groups' teardown takes them all down
        # together; destroy_model_parallel() first, so that it releases what it holds on them
        # (megatron-core 0.19's NCCL EP context) while they still work.
        survive = ASLEEP[Communicators(self.groups.communicators)] is not Groups.DESTROYED
        if self._ps.model_parallel_is_initialized() and not survive:
            self._stale = _megatron_groups(self._ps)
            self._ps.destroy_model_parallel()
        if self.groups.state not in ASLEEP_GROUPS:
            self.groups.destroy()
        if survive and self.groups.state == Groups.DESTROYED and self._ps.model_parallel_is_initialized():
            # NCCL could not suspend WORLD, so this sleep tore everything down: forget the dead groups
            # (destroy_model_parallel destroys only the gloo groups still registered).
            self._stale = _megatron_groups(self._ps)
            self._ps.destroy_model_parallel()

    def reload(self) -> None:
        """Rebuild WORLD, re-run `initialize_model_parallel`, re-point registered objects. Collective."""
        # Each step is skipped when already done, so recover() can finish a half-done reload.
        if not self.groups.is_alive():
            self.groups.reload()
        if self.groups.lost_groups and self._ps.model_parallel_is_initialized():
            self._reinitialise()
        if not self._ps.model_parallel_is_initialized():
            self._ps.initialize_model_parallel(**self.init_kwargs)
            if self.groups.eager_connect:
                self.groups.connect()  # Megatron's groups were made after the groups' own reload
        if self._stale and self._registered:
            fresh = _megatron_groups(self._ps)
            swap: dict[int, Any] = {}
            for name, old in self._stale.items():
                new = fresh.get(name)
                if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
                    swap.update((id(o), n) for o, n in zip(old, new, strict=True))
                elif isinstance(old, ProcessGroup) and isinstance(new, ProcessGroup):
                    swap[id(old)] = new
            _rebind(self._registered, swap)
        self._stale = {}

    def _reinitialise(self) -> None:
        """Some of Megatron's groups were torn down (NCCL could not suspend them): rebuild them all.

        The rest were resumed; they go down too, concurrently, so that the re-initialisation below
        makes one set of groups, not a second one beside the first.
        """
        self._stale = _megatron_groups(self._ps)
        self._ps.destroy_model_parallel()
        registered = torch.distributed.distributed_c10d._world.pg_map
        keep = {id(torch.distributed.distributed_c10d._get_default_group())}
        keep |= {id(h.group) for h in self.groups.handles}
        left: dict[int, ProcessGroup] = {}
        for value in self._stale.values():
            for pg in value if isinstance(value, list) else [value]:
                if registered.get(pg) is not None and id(pg) not in keep:
                    left[id(pg)] = pg
        each_at_once(torch.distributed.destroy_process_group, list(left.values()))

    def __repr__(self) -> str:
        return f"<MegatronParallelState alive={self.is_alive()} {self.init_kwargs} groups={self.groups!r}>"


_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")  # the two slime and Megatron's arguments choose between


def _live_layout(ps: ModuleType, *, order: str | None = None) -> dict[str, Any]:
    """The `initialize_model_parallel` arguments that rebuild the layout Megatron runs with now.

    The rank order is not kept by Megatron: it is the one of `_ORDERS` whose pipeline groups are
    this rank's, unless `order` is given.
    """
    layout: dict[str, Any] = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "create_gloo_process_groups": getattr(ps, "_DATA_PARALLEL_GROUP_GLOO", None) is not None,
    }
    tp, pp, cp = (
        layout[k]
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    )
    if order is not None:
        layout["order"] = order
        return layout
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = sorted(torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    for order in _ORDERS:
        generator = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
        if any(rank in ranks and sorted(ranks) == mine for ranks in generator.get_ranks("pp")):
            layout["order"] = order
            return layout
    raise ValueError(
        f"MegatronParallelState: rank {rank}'s pipeline group {mine} matches no rank order of {list(_ORDERS)} for "
        f"TP={tp} PP={pp} CP={cp} in a world of {world}; pass order= explicitly"
    )


def _megatron_groups(ps: ModuleType) -> dict[str, Any]:
    """Megatron's group globals, keyed by global name (ids would change with the objects)."""
    found: dict[str, Any] = {}
    for name, value in vars(ps).items():
        if isinstance(value, ProcessGroup):
            found[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, ProcessGroup) for v in value):
            found[name] = list(value)
    return found


def _rebind(roots: Iterable[Any], swap: dict[int, Any]) -> None:
    """Replace every attribute (or list/dict/tuple item) that is a stale group, walking object graphs."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, ProcessGroup):
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                if id(value) in swap:
                    obj[key] = swap[id(value)]
                else:
                    stack.append(value)
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                if id(value) in swap:
                    obj[i] = swap[id(value)]
                else:
                    stack.append(value)
        elif isinstance(obj, tuple):
            stack.extend(obj)  # tuples cannot be patched in place; their mutable items can
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, ModuleType)):
            attrs = vars(obj)
            for key, value in list(attrs.items()):
                if id(value) in swap:
                    # Past nn.Module.__setattr__ and frozen dataclasses (ProcessGroupCollection).
                    object.__setattr__(obj, key, swap[id(value)])
                else:
                    stack.append(value)

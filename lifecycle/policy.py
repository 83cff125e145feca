"""`LifecyclePolicy`: what the table's guards read, validated once at construction."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lifecycle.budget import COMMUNICATORS, MemoryBudget
from lifecycle.table import ALL_TAGS, PolicyView

# Fields older logs may carry: `colocate` (read nowhere; a transport concern, see configure_sender).
_RETIRED = frozenset({"colocate"})


@dataclass(frozen=True, kw_only=True)
class LifecyclePolicy:
    """How one actor sleeps and wakes.

    offload_train: sleep after every train step (slime `--offload-train`).
    use_routing_replay: clear routing-replay caches before releasing memory (MoE).
    memory_tags: the torch_memory_saver tags this actor pauses, in order; resume uses the
        same order. None tracks all memory as one unit (`pause()` / `resume()` with no tag).
    destroy_process_groups: sleep destroys the process groups and wake reloads them.
    auto_wake: `train` and `save` called while PAUSED wake the actor first instead of refusing.
    model_tag: the model tag `switch_model` restores after a wake (slime: "actor").
    sync_requires: tags the weight-update body writes into; they must be resident to sync
        (a rollout engine receives into "weights"; a trainer reads its CPU backup: none).
    discard_on_release: tags whose contents a release discards, because nothing backs them up
        (SGLang's `weights` and `kv_cache`; a torch_memory_saver tag with CPU backup keeps its
        contents). After their release the machine refuses `generate` until a sync has written
        the weight tags again.
    overlap_hooks: run the hooks a plan declares independent together (process-group teardown
        with the memory pause, their rebuild with the memory resume), where the memory backend
        allows it (`may_overlap_process_groups`); off: one after another, in plan order.
    memory_budget: a sleep releases only the tags (and the communicators) the next phase's declared
        need requires (`Lifecycle.expect`, `lifecycle.budget`), and checks after it that the need is
        free; needs `Hooks(budget=...)`. None (default): every sleep releases everything, as set above.
    """

    offload_train: bool = False
    use_routing_replay: bool = False
    memory_tags: tuple[str, ...] | None = None
    destroy_process_groups: bool = True
    auto_wake: bool = True
    model_tag: str | None = "actor"
    sync_requires: tuple[str, ...] = ()
    discard_on_release: tuple[str, ...] = ()
    overlap_hooks: bool = True
    memory_budget: MemoryBudget | None = None

    def __post_init__(self) -> None:
        if self.memory_budget is not None and not isinstance(self.memory_budget, MemoryBudget):
            raise ValueError(
                f"LifecyclePolicy.memory_budget must be a lifecycle.MemoryBudget or None, got {self.memory_budget!r}"
            )
        if self.memory_budget is not None and COMMUNICATORS in (self.memory_tags or ()):
            raise ValueError(
                f"LifecyclePolicy.memory_tags: {COMMUNICATORS!r} names the communicators in a budget"
            )
        for name in (
            "offload_train",
            "use_routing_replay",
            "destroy_process_groups",
            "auto_wake",
            "overlap_hooks",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"LifecyclePolicy.{name} must be a bool, got {value!r}")
        if self.memory_tags is not None:
            if isinstance(self.memory_tags, str) or not isinstance(self.memory_tags, (tuple, list)):
                raise ValueError(
                    f"LifecyclePolicy.memory_tags must be a tuple of tag names or None, got "
                    f"{self.memory_tags!r}; for one tag write memory_tags=({self.memory_tags!r},)"
                )
            object.__setattr__(self, "memory_tags", tuple(self.memory_tags))
            if not self.memory_tags:
                raise ValueError(
                    "LifecyclePolicy.memory_tags is empty: nothing would ever be released. "
                    "Use memory_tags=None to pause all memory as one unit."
                )
            for tag in self.memory_tags:
                if not isinstance(tag, str) or not tag.strip():
                    raise ValueError(f"LifecyclePolicy.memory_tags has an empty or non-string tag: {tag!r}")
                if tag == ALL_TAGS:
                    raise ValueError(
                        f"LifecyclePolicy.memory_tags may not use {ALL_TAGS!r}: it stands for 'all memory'; "
                        "use memory_tags=None for that"
                    )
            duplicates = sorted({t for t in self.memory_tags if self.memory_tags.count(t) > 1})
            if duplicates:
                raise ValueError(f"LifecyclePolicy.memory_tags names {duplicates} more than once")
        if isinstance(self.sync_requires, str):
            raise ValueError(f"LifecyclePolicy.sync_requires must be a tuple, got {self.sync_requires!r}")
        object.__setattr__(self, "sync_requires", tuple(self.sync_requires))
        if self.sync_requires:
            if self.memory_tags is None:
                raise ValueError(
                    f"LifecyclePolicy.sync_requires={self.sync_requires} names tags, but memory_tags=None "
                    "tracks all memory as one unit; list the tags in memory_tags too"
                )
            unknown = [t for t in self.sync_requires if t not in self.memory_tags]
            if unknown:
                raise ValueError(
                    f"LifecyclePolicy.sync_requires names {unknown}, which are not in memory_tags={self.memory_tags}"
                )
        if isinstance(self.discard_on_release, str) or not isinstance(self.discard_on_release, (tuple, list)):
            raise ValueError(
                f"LifecyclePolicy.discard_on_release must be a tuple of tag names, got {self.discard_on_release!r}"
            )
        object.__setattr__(self, "discard_on_release", tuple(self.discard_on_release))
        unknown = [t for t in self.discard_on_release if t not in self.tags]
        if unknown:
            where = f"memory_tags={self.memory_tags}" if self.memory_tags is not None else f"({ALL_TAGS!r},)"
            raise ValueError(
                f"LifecyclePolicy.discard_on_release names {unknown}, which this policy does not track; "
                f"name tags of {where} (with memory_tags=None all memory is one unit, {ALL_TAGS!r})"
            )
        if self.model_tag is not None and (not isinstance(self.model_tag, str) or not self.model_tag):
            raise ValueError(
                f"LifecyclePolicy.model_tag must be a non-empty string or None, got {self.model_tag!r}"
            )
        if self.offload_train and not self.auto_wake:
            raise ValueError(
                "LifecyclePolicy(offload_train=True, auto_wake=False) contradicts itself: every train step "
                "ends asleep, and without auto_wake the next train step from PAUSED would be refused. "
                "Set auto_wake=True, or offload_train=False and call sleep() yourself."
            )

    @property
    def tags(self) -> tuple[str, ...]:
        """The residency keys: the memory tags, or ALL_TAGS when memory is one unit."""
        return self.memory_tags if self.memory_tags is not None else (ALL_TAGS,)

    def view(self) -> PolicyView:
        """The fields the table's guards read (`lifecycle.table.PolicyView`)."""
        return PolicyView(
            offload_train=self.offload_train,
            auto_wake=self.auto_wake,
            use_routing_replay=self.use_routing_replay,
            destroy_process_groups=self.destroy_process_groups,
            model_tag=self.model_tag,
            sync_requires=self.sync_requires,
            discard_on_release=self.discard_on_release,
            weight_tags=self.sync_requires or self.tags,
        )

    def to_dict(self) -> dict[str, Any]:
        """The policy as plain data (what `lifecycle.configured` logs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LifecyclePolicy:
        """The policy `to_dict` wrote (a logged one too); raises ValueError on an unknown field."""
        known = {f for f in cls.__dataclass_fields__}
        extra = sorted(set(data) - known - _RETIRED)
        if extra:
            raise ValueError(f"unknown LifecyclePolicy fields {extra}; known fields: {sorted(known)}")
        fields = {k: v for k, v in data.items() if k not in _RETIRED}
        for name in ("memory_tags", "sync_requires", "discard_on_release"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        if isinstance(fields.get("memory_budget"), Mapping):
            fields["memory_budget"] = MemoryBudget.from_dict(fields["memory_budget"])
        return cls(**fields)

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, role: str = "actor", **overrides: Any) -> LifecyclePolicy:
        """Read slime/miles-style parsed flags.

        Reads `offload_train`, `colocate`, `use_routing_replay`, `use_critic` and, where present,
        `offload` and `release_train`, resolving them the way slime's argument validation does:
        `--offload` and `--colocate` imply offload_train unless `--release-train` is set, and a
        PPO critic forces offload_train. Only the actor role restores a model tag after a wake.
        Keyword overrides win over the flags.
        """
        if role not in ("actor", "critic"):
            raise ValueError(f"LifecyclePolicy.from_args: role must be 'actor' or 'critic', got {role!r}")
        colocate = bool(getattr(args, "colocate", False))
        release_train = bool(getattr(args, "release_train", False))
        offload_train = getattr(args, "offload_train", None)
        if getattr(args, "offload", False):
            offload_train = True
        if colocate and release_train:
            offload_train = False
        elif colocate and offload_train is None:
            offload_train = True
        if getattr(args, "use_critic", False):
            offload_train = True
        fields: dict[str, Any] = {
            "offload_train": bool(offload_train),
            "use_routing_replay": bool(getattr(args, "use_routing_replay", False)),
            "model_tag": "actor" if role == "actor" else None,
        }
        fields.update(overrides)
        return cls(**fields)

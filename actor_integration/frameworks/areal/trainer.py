"""AReaL's `MegatronEngine` in AWEX colocate mode under the lifecycle (the trainer's half).

    from actor_integration.frameworks.areal import ArealTrainerMixin
    from areal.engine.megatron_engine import MegatronEngine

    class LifecycleMegatronEngine(ArealTrainerMixin, MegatronEngine):
        pass

Who owns each resource (read from AReaL cbff54d6, `areal/engine/megatron_engine.py` and
`areal/engine/awex/colocate_writer.py`; the same code as #1500, 76138cb3):

- Memory: AReaL's own `AwexMegatronAdapter.release_memory(tags)` / `resume_memory(tags)`, tags
  `optimizer` (fp32 main params and Adam states moved to CPU) and `weights` (DDP param buffers
  copied to pinned host memory, their storage resized to 0), with its `_released_tags` set. Not
  torch_memory_saver: `AwexMemory` is the memory backend over those two calls, so the machine's
  residency is AReaL's set, and `recover()` asks the set (`is_paused`) instead of guessing.
- The gradient buffers: released by the sleep plan's `clear_memory` hook (AReaL's own
  `_release_grad_memory`, what its save and its weight update call first), rebuilt by AReaL's own
  `ensure_grad_buffers` at the next `train_batch`. They are dead between steps.
- Process groups: kept. AReaL's offload leaves them ("TODO: NCCL offload") and reads its gloo
  mirror of the model-parallel group while the accelerator is the rollout's; no group hook.
- `offload()` / `onload()`: the sleep and wake plans, then AReaL's own barrier on its CPU group and
  its `is_offload` flag. A second `offload()` is a logged no-op.
- `update_weights(meta)` with `meta.type == "awex"`: the optimizer released first (AReaL's first
  step, now the plan's), the weights resident (the conversion reads them; AReaL resumes them itself
  when offloaded), then AReaL's own `update_weights` as the sync body. Inside it the writer releases
  `weights` before publishing (so the reader's resume of its own weights fits), which the machine
  learns after the body from AReaL's set: its sleep of `weights` is then AReaL's own no-op
  (`release_memory` skips a released tag). On rank 0 the rollout is told the transfer is done when
  it can be (`lifecycle_weights_updated`, `ArealRolloutMixin`). Other update types run AReaL's own.
- `save(meta)`: the save operation (from PAUSED: wake, save, sleep), so a save after a weight
  update reads resident weights: AReaL leaves `is_offload` False after the transfer, and its own
  save would then run on released storage. `load(meta)`: woken for the load, asleep again after if
  it was. `train_batch`: the train operation (from PAUSED: wake first).

Without an AWEX adapter (`init_awex_adapter` not called: AReaL's torch_memory_saver path) every
method is AReaL's own and nothing is under the lifecycle.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from actor_integration.actors.mixin import LifecycleMixin
from lifecycle import Hooks, LifecyclePolicy, Residency, State
from lifecycle.logs import Event

__all__ = [
    "TRAINER_TAGS",
    "ArealTrainerMixin",
    "AwexMemory",
    "GradBufferRelease",
    "areal_trainer_policy",
]

TRAINER_TAGS = ("optimizer", "weights")  # AReaL's release order (colocate_writer.release_memory)


class AwexMemory:
    """A `MemoryBackend` over AReaL's `AwexMegatronAdapter.release_memory` / `resume_memory`.

    One tag per call, as the machine pauses them; AReaL's own calls skip a tag already in its
    `_released_tags` (release) or not in it (resume), so a pause or resume the machine asks for is
    never done twice. `is_paused(tag)` reads that set: `recover()` learns what a failed call left.
    """

    def __init__(self, adapter: Any) -> None:
        for name in ("release_memory", "resume_memory", "_released_tags"):
            if not hasattr(adapter, name):
                raise TypeError(
                    f"AwexMemory: {type(adapter).__name__} has no {name}; pass AReaL's AwexMegatronAdapter "
                    "(MegatronEngine._awex_adapter, created by init_awex_adapter)"
                )
        self.adapter = adapter

    def _tag(self, tag: str | None) -> list[str]:
        if tag is None:
            return list(TRAINER_TAGS)
        if tag not in TRAINER_TAGS:
            raise ValueError(f"AwexMemory: AReaL's adapter has tags {list(TRAINER_TAGS)}, not {tag!r}")
        return [tag]

    def pause(self, tag: str | None = None) -> None:
        self.adapter.release_memory(tags=self._tag(tag))

    def resume(self, tag: str | None = None) -> None:
        self.adapter.resume_memory(tags=self._tag(tag))

    def is_paused(self, tag: str | None = None) -> bool:
        released = set(self.adapter._released_tags)
        return bool(released) if tag is None else tag in released

    def released(self) -> frozenset[str]:
        """The tags AReaL's adapter holds released now."""
        return frozenset(self.adapter._released_tags)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield  # AReaL's offload moves tensors itself: no allocator region to step out of


class GradBufferRelease:
    """The `clear_memory` hook: AReaL's own release of the DDP gradient buffers, then its cache clear.

    `_release_grad_memory` resizes every DDP grad buffer's storage to 0 (its size kept for
    `ensure_grad_buffers`), skipping the released ones, so running it on a wake is a no-op.
    `clear` is AReaL's `current_platform.clear_memory` where given.
    """

    def __init__(self, adapter: Any, clear: Any = None) -> None:
        self.adapter = adapter
        self.clear = clear

    def __call__(self) -> None:
        self.adapter._release_grad_memory()
        if self.clear is not None:
            self.clear()


def areal_trainer_policy() -> LifecyclePolicy:
    """AReaL's colocated actor: two tags with host copies (nothing discarded), groups kept, and no
    sleep after a train step (rl_trainer's weight update releases the memory after the save)."""
    return LifecyclePolicy(
        memory_tags=TRAINER_TAGS,
        offload_train=False,
        destroy_process_groups=False,
        model_tag=None,
        sync_requires=("weights",),  # the conversion reads them
    )


class ArealTrainerMixin(LifecycleMixin):
    """`LifecycleMixin` over AReaL's `MegatronEngine` with its AWEX adapter; put it first in the bases."""

    # AReaL's MegatronEngine's own attributes.
    _awex_adapter: Any
    cpu_group: Any
    is_offload: bool
    rollout_engine: Any

    lifecycle_role = "actor"

    # ------------------------------------------------------------------ configuration

    def _areal_owner(self) -> Any:
        mro = type(self).__mro__
        return next(k for k in mro[mro.index(ArealTrainerMixin) + 1 :] if "offload" in vars(k))

    def _areal_global(self, name: str) -> Any:
        """A global of AReaL's engine module (`current_platform`), or None where it has none."""
        return vars(sys.modules[self._areal_owner().__module__]).get(name)

    def _colocated(self) -> bool:
        return getattr(self, "_awex_adapter", None) is not None

    def lifecycle_config(self) -> dict[str, Any] | None:
        if not self._colocated():
            raise RuntimeError(
                f"{type(self).__name__}: AReaL's AWEX adapter does not exist yet; call init_awex_adapter(...) "
                "(rl_trainer does, before the first offload) or connect_engine with an awex meta first"
            )
        memory = AwexMemory(self._awex_adapter)
        released = memory.released()
        if released and released != set(TRAINER_TAGS):
            raise RuntimeError(
                f"{type(self).__name__}: AReaL's adapter holds {sorted(released)} released and the rest resident; "
                "configure the lifecycle before the first offload (a wrapped offload builds it)"
            )
        platform = self._areal_global("current_platform")
        clear = getattr(platform, "clear_memory", None)
        return {
            "policy": areal_trainer_policy(),
            "hooks": Hooks(memory=memory, clear_memory=GradBufferRelease(self._awex_adapter, clear)),
            "rank": self._areal_rank(),
            "role": self.lifecycle_role,
            "initial": State.PAUSED if released else State.AWAKE,
        }

    # ------------------------------------------------------------------ AReaL's method names

    def offload(self) -> None:
        """The sleep plan (grad buffers, optimizer, weights), then AReaL's barrier; a no-op when asleep."""
        if not self._colocated():
            return super().offload()  # type: ignore[misc,no-any-return]
        self.lifecycle.sleep()
        self._barrier()
        self.is_offload = True

    def onload(self) -> None:
        """The wake plan (weights, then optimizer), then AReaL's barrier; a no-op when awake."""
        if not self._colocated():
            return super().onload()  # type: ignore[misc,no-any-return]
        self.lifecycle.wake_up()
        self._barrier()
        self.is_offload = False

    def train(self, mode: bool = True) -> Any:
        """AReaL's own `train(mode)` (the modules' training flag), not a train step."""
        return super(LifecycleMixin, self).train(mode)  # type: ignore[misc]

    def sleep(self, tags: Any = None) -> None:
        self.offload() if tags is None else self.lifecycle.sleep(tags)

    def wake_up(self, tags: Any = None) -> None:
        self.onload() if tags is None else self.lifecycle.wake_up(tags)

    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        """AReaL's train_batch as the train operation (from PAUSED it wakes first)."""
        if not self._colocated():
            return super().train_batch(*args, **kwargs)  # type: ignore[misc]
        return self._run_body("train", "train_batch", args, kwargs)

    def save(self, *args: Any, **kwargs: Any) -> Any:
        """AReaL's save as the save operation (from PAUSED: wake, save, sleep)."""
        if not self._colocated():
            return super().save(*args, **kwargs)  # type: ignore[misc]
        return self._run_body("save", "save", args, kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        """AReaL's load with every tag resident; asleep again after when it was (AReaL's own
        `_offload_aware_context` does the same around it)."""
        if not self._colocated():
            return super().load(*args, **kwargs)  # type: ignore[misc]
        lifecycle = self.lifecycle
        was_asleep = lifecycle.state is State.PAUSED
        lifecycle.wake_up()
        try:
            return super().load(*args, **kwargs)  # type: ignore[misc]
        finally:
            if was_asleep and lifecycle.state is not State.FAILED:
                lifecycle.sleep()

    def update_weights(self, meta: Any) -> Any:
        """An AWEX colocate update as the sync operation (see the module doc); other types are AReaL's."""
        if not self._colocated() or getattr(meta, "type", None) != "awex":
            return super(LifecycleMixin, self).update_weights(meta)  # type: ignore[misc]
        lifecycle = self.lifecycle
        rollout: Any = getattr(self, "rollout_engine", None)
        first = self._areal_rank() in (0, None)  # AReaL's rank 0 calls the rollout
        if first and callable(getattr(rollout, "lifecycle_before_weights_update", None)):
            rollout.lifecycle_before_weights_update()  # generation held in place, its weights released
        lifecycle.sleep(["optimizer"])  # AReaL's first step: room for the weights it may resume
        lifecycle.wake_up(["weights"])  # the conversion reads them
        try:
            result = self._run_body("sync", "update_weights", (meta,), {})
        finally:
            self._lifecycle_reconcile("update_weights")
        version = getattr(meta, "version", None)
        if first and callable(getattr(rollout, "lifecycle_weights_updated", None)):
            rollout.lifecycle_weights_updated(version if isinstance(version, int) else None)
        return result

    # ------------------------------------------------------------------ helpers

    def _lifecycle_reconcile(self, call: str) -> None:
        """Tell the machine what the body released or resumed itself (AReaL's set is the truth):
        a sleep or wake of those tags, whose hooks AReaL's adapter answers as already done."""
        lifecycle = self.lifecycle
        if lifecycle.state is State.FAILED:
            return
        released = AwexMemory(self._awex_adapter).released()
        behind = [t for t, r in lifecycle.residency.items() if (t in released) != (r is Residency.RELEASED)]
        if not behind:
            return
        lifecycle.event(
            Event.ABSORBED,
            call=call,
            reason=(
                f"AReaL's body changed {behind} itself (its adapter now holds {sorted(released)} released); "
                "the machine records it with AReaL's own calls, which find it done"
            ),
        )
        gone = [t for t in behind if t in released]
        back = [t for t in behind if t not in released]
        if gone:
            lifecycle.sleep(gone)
        if back:
            lifecycle.wake_up(back)

    def _areal_rank(self) -> int | None:
        """The engine's global rank: torch.distributed's, else AReaL's own `rank` attribute."""
        if dist.is_initialized():
            return dist.get_rank()
        rank = getattr(self, "rank", None)
        return rank if isinstance(rank, int) else None

    def _barrier(self) -> None:
        """AReaL's end of offload and onload: the device synchronised, every rank past the same point."""
        platform = self._areal_global("current_platform")
        synchronize = getattr(platform, "synchronize", None)
        if synchronize is not None:
            synchronize()
        if dist.is_initialized():
            dist.barrier(group=getattr(self, "cpu_group", None))

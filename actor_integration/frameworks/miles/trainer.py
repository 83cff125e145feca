"""miles' `MegatronTrainRayActor` under the lifecycle (radixark/miles, slime's maintained fork).

    import miles.backends.megatron_utils.actor as miles_actor
    from actor_integration.frameworks.miles import MilesLifecycleMixin

    class LifecycleTrainer(MilesLifecycleMixin, miles_actor.MegatronTrainRayActor):
        pass

Who owns each resource (read from miles 31f1ca96, `miles/backends/megatron_utils/actor.py`):

- `sleep()` / `wake_up()` are the plans: clear memory (host too) → miles' registry of wrapped
  groups torn down at once on every rank (miles destroys them one by one; WORLD stays) → a pause
  per tag of the layout (below); a resume per released tag → miles' `reload_process_groups()` →
  miles' `_switch_model("actor")`. miles' `_asleep` flag becomes a view of the machine (some tag
  not resident), so the bodies that read it take the branch the machine's state calls for.
- miles' own `@with_logs @timer` on `sleep` / `wake_up` keep running: the adapter's `sleep()` and
  `wake_up()` run under the decorators of miles' actor module, so miles' structured start/end
  lines and its `Timer` entries "sleep" and "wake_up" (its perf metrics) are there as in plain
  miles, and a sleep that released memory logs miles' `perf/cpu_memory_after_offload_train_gb`
  (its `log_cpu_memory(..., "after_offload_train")`, on the rank and from the step miles logs it).
- `train()` wakes the actor first through `wake_up()` when asleep, as miles' train calls it (so
  the wake is timed as miles times it), and stays awake, as miles' train does: miles' driver
  sleeps it (`offload()`) after the save.
- `save_model()` from PAUSED in the rematerialize layout wakes, saves and releases again exactly
  the tags that were released before it: `param_buffer` stays resident when it was (no push since
  the sleep) and is released again when a push had released it.
- `update_weights(info)` runs as the sync operation with `info` passed through. Its in-body
  `reload_process_groups()`, `torch_memory_saver.disable()`, `pause(tag="param_buffer")` and
  `destroy_process_groups()` are the plans' while it runs (`stand_ins`): the groups are up,
  `disable()` is entered, and the param pause is done by the adapter after the body (below).
- Per-tag memory (`MilesTagLayout`), as miles' sleep chooses it: all memory as one unit
  (`pause()`), `default` alone with LoRA rollout, and with `--rematerialize-param-from-master-weight`
  `grad_buffer` and `default` at sleep while `param_buffer` stays resident for the next
  `update_weights`, which reads the params from it (miles keeps no CPU copy of them) and releases
  it after the push. The machine tracks the three tags, so its residency is what
  torch_memory_saver holds: a wake resumes only the released tags (plain miles' `resume()` meets a
  resident `param_buffer` when no `update_weights` ran since the sleep: torch_memory_saver exits).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch.distributed as dist

from actor_integration.actors.mixin import LifecycleMixin
from actor_integration.backends.clear_memory import ClearMemory
from actor_integration.backends.memory_saver import NoopMemory, TorchMemorySaverBackend
from actor_integration.backends.tms_env import is_true
from actor_integration.errors import MilesVersionError, OffloadTrainRequiredError
from actor_integration.frameworks.registry_groups import RegistryProcessGroups, registry, require
from actor_integration.frameworks.slime.trainer import RETAIN_VARIABLE
from actor_integration.frameworks.stand_ins import body_owner, plan_owned_globals, stand_in_calls
from actor_integration.frameworks.timer_feed import TimerFeed
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, State
from lifecycle.errors import IllegalTransitionError
from lifecycle.hooks import MemoryBackend, ProcessGroupsBackend
from lifecycle.logs import Event
from lifecycle.table import Communicators, Residency, allowed_operations

__all__ = [
    "ALL_MEMORY",
    "LORA_ROLLOUT",
    "MILES_COMMIT",
    "REMATERIALIZE",
    "MilesLifecycleMixin",
    "MilesProcessGroups",
    "MilesTagLayout",
    "MilesVersionError",
    "OffloadTrainRequiredError",
    "check_miles_backup_fits",
    "miles_memory_backend",
    "miles_tag_layout",
]

MILES_COMMIT = "31f1ca96"  # the miles this adapter is read from and tested against
GROUPS_MODULE = "miles.utils.reloadable_process_group"
# What miles' sleep logs after offloading (its `log_cpu_memory` label: perf/cpu_memory_<label>_gb).
CPU_MEMORY_LABEL = "after_offload_train"


@dataclass(frozen=True)
class MilesTagLayout:
    """The torch_memory_saver tags miles' sleep, wake and update_weights touch.

    memory_tags: the tags the machine tracks, in miles' pause order (None: all memory as one unit).
    sleep_tags: the tags a sleep pauses (None: every tracked tag).
    kept_for_sync: tags a sleep leaves resident because the next `update_weights` reads them; that
        sync releases them after its push. They are the sync's `sync_requires`.
    """

    name: str
    memory_tags: tuple[str, ...] | None
    sleep_tags: tuple[str, ...] | None
    kept_for_sync: tuple[str, ...] = ()


# Megatron's DDP param and grad buffers are tags "param_buffer" and "grad_buffer", without CPU
# backup under --offload-train (miles' arguments set --disable-{param,grad}-buffers-cpu-backup);
# every other allocation of the preloaded process is "default", CPU-backed.
ALL_MEMORY = MilesTagLayout("all memory", None, None)
REMATERIALIZE = MilesTagLayout(
    "rematerialize",
    ("grad_buffer", "default", "param_buffer"),
    ("grad_buffer", "default"),
    ("param_buffer",),
)
LORA_ROLLOUT = MilesTagLayout("lora rollout", ("default",), None)  # the adapters' buffers are never paused


def miles_tag_layout(args: Any, role: str, *, lora_rollout: bool) -> MilesTagLayout:
    """miles' own choice in `MegatronTrainRayActor.sleep`: rematerialized params for the actor, else
    `default` alone with LoRA rollout (`lora_rollout_enabled(args)`), else all memory."""
    if getattr(args, "rematerialize_param_from_master_weight", False) and role == "actor":
        return REMATERIALIZE
    return LORA_ROLLOUT if lora_rollout else ALL_MEMORY


def miles_memory_backend(
    layout: MilesTagLayout,
    *,
    environ: Mapping[str, str] | None = None,
    saver: Any = None,
    cuda_major: int | None = None,
) -> TorchMemorySaverBackend:
    """The layout's tags, in the hook mode the launcher's environment asks for, the CPU backup retained.

    miles' launcher (`allocate_gpus_for_actor`) preloads torch_memory_saver with `TMS_INIT_ENABLE=1`
    and `TMS_INIT_ENABLE_CPU_BACKUP=1`: every allocation is saver memory, `default` CPU-backed. The
    backup is retained as slime's adapter retains it (`slime_memory_backend`: 5.75 s against 0.39 s
    per sleep + wake of a 0.6B-shaped state on an H200) unless the user's `TMS_RETAIN_CPU_BACKUP`
    says otherwise. Only `default` is declared backed up, and not all memory as one unit: the param
    and grad buffers have none, so a preparing pause of all memory (`prepare_cpu_backup`) would
    discard them. `notes` says what was chosen and why.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    given = env.get(RETAIN_VARIABLE)
    retain = True if given is None else is_true(given)
    backed_up = is_true(env.get("TMS_INIT_ENABLE_CPU_BACKUP"))
    memory = TorchMemorySaverBackend(
        tags=layout.memory_tags,
        cpu_backup=("default",) if backed_up and layout.memory_tags is not None else False,
        hook_mode="auto",
        retain_cpu_backup=retain,
        environ=env,
        saver=saver,
        cuda_major=cuda_major,
    )
    if not backed_up:
        memory.notes.append("TMS_INIT_ENABLE_CPU_BACKUP is off: a pause discards the trainer's memory")
    elif retain and not memory.retain_cpu_backup:
        pass  # the backend noted (and logged) that this torch_memory_saver cannot retain it, and the cost
    else:
        memory.notes.append(
            f"retain_cpu_backup={retain} ("
            + (
                f"{RETAIN_VARIABLE} unset; the adapter's default"
                if given is None
                else f"{RETAIN_VARIABLE}={given!r}"
            )
            + "): the CPU backup of tag 'default' (the param and grad buffers have none)"
            + (
                " is allocated by the first pause and reused by every later one"
                if retain
                else " is allocated again by every pause"
            )
        )
    return memory


def check_miles_backup_fits(
    memory: TorchMemorySaverBackend,
    model: Any,
    *,
    ranks_per_node: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """Refuse (or warn about) a retained backup the node's host RAM cannot hold, before the first pause.

    `TorchMemorySaverBackend.check_retained_backup` less Megatron's DDP param and grad buffers of
    `model`, which have no backup under --offload-train.
    `environ`: the launcher's environment the backend was built from (default: this process's).
    Returns the figures, or None where there is nothing to check (not retained, no backup, no CUDA).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    return memory.check_retained_backup(
        ranks_per_node=ranks_per_node,
        unbacked_bytes=_ddp_buffer_bytes(model),
        backed_up=is_true(env.get("TMS_INIT_ENABLE_CPU_BACKUP")),
    )


def _ddp_buffer_bytes(model: Any) -> int:
    """The bytes of Megatron's DDP param and grad buffers (`_ParamAndGradBuffer.param_data/grad_data`)."""
    total = 0
    for chunk in model or ():
        # Megatron's DDP wrapper keeps them as lists; on a plain nn.Module `buffers` is a method.
        found = [getattr(chunk, name, ()) for name in ("buffers", "expert_parallel_buffers")]
        for buffer in (b for listed in found if isinstance(listed, (list, tuple)) for b in listed):
            for name in ("param_data", "grad_data"):
                data = getattr(buffer, name, None)
                if data is not None and hasattr(data, "element_size"):
                    total += int(data.numel()) * int(data.element_size())
    return total


class MilesProcessGroups(RegistryProcessGroups):
    """destroy()/reload()/is_alive() over miles' own reloadable process groups (one owner: the plans).

    The sleep frees the communicators miles' `destroy_process_groups()` frees (every wrapped
    subgroup; miles leaves WORLD and its gloo group alone), all at once on every rank between two
    meetings instead of one after another; the wake is miles' own `reload_process_groups()`, so the
    wrappers Megatron cached stay valid and the group count stays plain miles'. `module` is miles'
    `miles.utils.reloadable_process_group` (imported when not given). `communicators`: "suspend"
    or "keep" leave the wrapped groups in place instead (`RegistryProcessGroups`).
    """

    framework = "miles"

    def __init__(
        self,
        module: ModuleType | None = None,
        *,
        timeout: timedelta | None = None,
        communicators: Communicators | str = Communicators.DESTROY,
    ) -> None:
        self.module = module if module is not None else importlib.import_module(GROUPS_MODULE)
        require(self.module, _MILES_GROUP_NAMES, "MilesProcessGroups", f"miles {MILES_COMMIT}")
        super().__init__(timeout=timeout, communicators=communicators)

    def wrappers(self) -> list[Any]:
        """miles' registry of wrapped subgroups in this process (`ReloadableProcessGroup.GROUPS`)."""
        return registry(self.module)

    def _reload(self) -> None:
        self.module.reload_process_groups()


_MILES_GROUP_NAMES = ("ReloadableProcessGroup", "reload_process_groups")


class MilesLifecycleMixin(LifecycleMixin):
    """`LifecycleMixin` configured from a miles actor's own state; put it first in the bases.

    The lifecycle is built by the `self.sleep()` that ends miles' `init` (or the first wrapped
    call when `--offload-train` is off). `lifecycle_communicators` says what sleep does to the
    NCCL communicators ("destroy", "suspend" or "keep"; set it on your class). Override
    `lifecycle_memory()`, `lifecycle_process_groups()`, `lifecycle_hooks()` or `lifecycle_policy()`
    to change one piece.
    """

    lifecycle_communicators: Communicators | str = Communicators.DESTROY

    # Set by miles' TrainRayActor.init / defined by MegatronTrainRayActor.
    args: Any
    role: str
    _switch_model: Callable[[str], None]
    _last_rollout_id: int  # set by miles' train: its sleep logs the CPU memory from then on

    # ------------------------------------------------------------------ configuration

    def init(self, args: Any, role: str, *rest: Any, **kwargs: Any) -> Any:
        """miles' init, with the memory backend built first when `--offload-train` is on.

        miles' init sets `torch_memory_saver.memory_margin_bytes` (`--train-memory-margin-bytes`),
        which initialises torch_memory_saver in whatever hook mode is pending, and importing
        megatron.core leaves "torch" pending: in miles' preloaded process a torch-mode saver pauses
        none of the preload library's memory. The backend sets the mode the launcher's environment
        asks for before that first use (and refuses a bad environment before any model is built).
        """
        if getattr(args, "offload_train", False):
            self.args, self.role = args, role
            self.__dict__["_lifecycle_memory"] = self.lifecycle_memory()
        return super().init(args, role, *rest, **kwargs)  # type: ignore[misc]

    def configure_lifecycle(self, policy: LifecyclePolicy, hooks: Hooks, **kwargs: Any) -> Lifecycle:
        """The lifecycle's per-plan and per-hook figures into miles' `Timer` (`perf/lifecycle_*` in miles'
        `log_perf_data`); miles' own entries (`sleep`, `wake_up`, ...) stay its decorators' alone."""
        lifecycle = super().configure_lifecycle(policy, hooks, **kwargs)
        timer = vars(sys.modules[body_owner(self).__module__]).get("Timer")
        if timer is not None:
            lifecycle.observe(TimerFeed(timer, plan_timers={}, operation_timers={}))
        return lifecycle

    def lifecycle_config(self) -> dict[str, Any]:
        return {
            "policy": self.lifecycle_policy(),
            "hooks": self.lifecycle_hooks(),
            "rank": dist.get_rank() if dist.is_initialized() else None,
            "role": self.role,
        }

    def lifecycle_layout(self) -> MilesTagLayout:
        """The tag layout of this actor, by miles' own rule and its own `lora_rollout_enabled`."""
        cached = self.__dict__.get("_lifecycle_layout")
        if isinstance(cached, MilesTagLayout):
            return cached
        (lora_rollout_enabled,) = self._miles_names(
            "lora_rollout_enabled", why="which miles' sleep reads to pick its tags"
        )
        layout = miles_tag_layout(self.args, self.role, lora_rollout=bool(lora_rollout_enabled(self.args)))
        self.__dict__["_lifecycle_layout"] = layout
        return layout

    def lifecycle_policy(self) -> LifecyclePolicy:
        """miles' flags and tag layout. miles' train does not sleep after the step (its driver's
        `offload()` does, after the save), and miles keeps routing-replay data in pinned host
        buffers that its train step clears: nothing of it on the device for a sleep to clear."""
        layout = self.lifecycle_layout()
        return LifecyclePolicy.from_args(
            self.args,
            role=self.role,
            offload_train=False,
            use_routing_replay=False,
            memory_tags=layout.memory_tags,
            sync_requires=layout.kept_for_sync,
        )

    def lifecycle_memory(self) -> MemoryBackend:
        layout = self.lifecycle_layout()
        if not self.args.offload_train:
            return NoopMemory(
                tags=layout.memory_tags,
                reason="--offload-train is off: miles keeps the model resident and does not preload torch_memory_saver",
            )
        return miles_memory_backend(layout)

    def lifecycle_process_groups(self) -> ProcessGroupsBackend:
        """miles' own groups (`MilesProcessGroups`) with miles' timeout, their communicators treated as
        `lifecycle_communicators` says."""
        minutes = getattr(self.args, "distributed_timeout_minutes", None)
        return MilesProcessGroups(
            timeout=timedelta(minutes=minutes) if minutes else None,
            communicators=self.lifecycle_communicators,
        )

    def lifecycle_hooks(self) -> Hooks:
        early = self.__dict__.pop("_lifecycle_memory", None)
        memory = early if early is not None else self.lifecycle_memory()
        if isinstance(memory, TorchMemorySaverBackend):  # the model exists now: check the retained backup
            check_miles_backup_fits(
                memory, getattr(self, "model", None), ranks_per_node=_ranks_per_node(self.args)
            )
        return Hooks(
            memory=memory,
            process_groups=self.lifecycle_process_groups(),
            clear_memory=ClearMemory(host=True),  # miles' sleep: clear_memory(clear_host_memory=True)
            # The param buffer has no CPU backup under --offload-train: a wake maps fresh memory, and
            # miles' train step restores the params itself; the wake restores them too, so a save or
            # a sync right after a wake reads the trained params (miles' wake leaves them discarded).
            switch_model=self._switch_model if self.role == "actor" else None,
        )

    # ------------------------------------------------------------------ miles' method names

    @property
    def _asleep(self) -> bool:
        """miles' flag, read from the machine once it exists: some tag is not resident."""
        lifecycle = self._lifecycle
        if lifecycle is None:
            return bool(self.__dict__.get("_miles_asleep", False))
        return any(r is not Residency.RESIDENT for r in lifecycle.residency.values())

    @_asleep.setter
    def _asleep(self, value: bool) -> None:
        self.__dict__["_miles_asleep"] = bool(value)  # miles' init sets False before any lifecycle

    def sleep(self, tags: Iterable[str] | None = None) -> None:
        """miles' sleep: the layout's sleep tags (with rematerialized params, not `param_buffer`),
        under miles' own `@with_logs @timer`, and miles' CPU-memory metric after a sleep that released."""
        self._require_offload("sleep")
        self._as_miles("sleep", self._sleep, self.lifecycle_layout().sleep_tags if tags is None else tags)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """The wake plan for `tags` (default: every released tag), under miles' own `@with_logs @timer`."""
        self._require_offload("wake_up")
        self._as_miles("wake_up", self.lifecycle.wake_up, tags)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The operation train; asleep, through `wake_up()` first, where miles' train calls it (so miles'
        timer and log lines cover that wake)."""
        if self.args.offload_train and self.lifecycle.state is State.PAUSED:
            self.wake_up()
        return super().train(*args, **kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> Any:
        """The operation save; from PAUSED in the rematerialize layout, a wake, the save, and the release
        of exactly the tags that were released before it."""
        lifecycle, layout = self.lifecycle, self.lifecycle_layout()
        if layout.kept_for_sync and lifecycle.state is State.PAUSED:
            # The table's save from PAUSED pauses every tag on leaving, but miles' sleep keeps the
            # params resident for the next update_weights (which releases them after its push): the
            # save leaves each tag as it found it. These are the adapter's own wake and sleep, not
            # miles' (plain miles' save_model calls neither): not timed as miles'.
            released = tuple(tag for tag, r in lifecycle.residency.items() if r is not Residency.RESIDENT)
            lifecycle.wake_up()
            try:
                return super().save_model(*args, **kwargs)
            finally:
                if lifecycle.failure is None:  # a failed save leaves FAILED: recover() decides
                    lifecycle.sleep(released)
        return super().save_model(*args, **kwargs)

    def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        """miles' `update_weights(info)` as the sync operation; then, when the actor is asleep (or awake
        only because a held scope deferred its sleep), the release of the tags kept for it
        (`param_buffer`), which miles' body asks for after its push."""
        lifecycle, layout = self.lifecycle, self.lifecycle_layout()
        if lifecycle.state is State.PAUSED:
            self._refuse_released_params(layout)
        # Asleep, or awake only because a held scope deferred its sleep (then the release is deferred too).
        asleep = lifecycle.state is State.PAUSED or bool(lifecycle.deferred)
        claimed: list[str] = []
        self.__dict__["_lifecycle_claimed_pauses"] = claimed
        try:
            return super().update_weights(*args, **kwargs)
        finally:
            self.__dict__.pop("_lifecycle_claimed_pauses", None)
            # From AWAKE the params stay: an awake actor holds all its memory (plain miles pauses
            # them there, and its next train step writes released memory).
            if claimed and asleep and lifecycle.state is not State.FAILED:
                lifecycle.sleep(tuple(dict.fromkeys(claimed)))

    def lifecycle_body_globals(self, operation: str) -> Mapping[str, Any]:
        kept = self.lifecycle_layout().kept_for_sync

        def claim(tag: str | None) -> bool:
            # miles' update_weights pauses the kept params after its push: the adapter releases them
            # after the body, through the machine, so the pause is the plans' (one owner).
            if operation != "sync" or tag not in kept:
                return False
            claims = self.__dict__.get("_lifecycle_claimed_pauses")
            if claims is not None:
                claims.append(tag)
            return True

        return plan_owned_globals(self, operation, on_pause=claim)

    def lifecycle_stand_in_calls(self) -> list[tuple[str, str]]:
        """(operation, name) of every resource call a body made that the plans owned, oldest first."""
        return stand_in_calls(self)

    # ------------------------------------------------------------------ miles' own decorators and metric

    def _sleep(self, tags: Iterable[str] | None) -> None:
        log_cpu_memory, is_first_replica_megatron_main_rank = self._miles_names(
            "log_cpu_memory", "is_first_replica_megatron_main_rank", why="which miles' sleep calls"
        )
        # As miles' sleep: decided before the groups go down (the rank test reads Megatron's groups),
        # and only by a sleep that has something to release; logged once it released something.
        should_log = (
            not self._asleep and is_first_replica_megatron_main_rank() and hasattr(self, "_last_rollout_id")
        )
        self.lifecycle.sleep(tags)
        if should_log and self._asleep:  # not when a held scope deferred it
            log_cpu_memory(self._last_rollout_id, self.args, CPU_MEMORY_LABEL)

    def _as_miles(
        self, method: str, run: Callable[[Iterable[str] | None], None], tags: Iterable[str] | None
    ) -> None:
        """`run(tags)` under the decorators miles puts on its `method` (`@with_logs @timer`), from miles'
        actor module: its structured start/end lines on that module's logger and its Timer entry `method`."""
        with_logs, timer = self._miles_names("with_logs", "timer", why=f"which decorate miles' {method}")
        owner = body_owner(self)

        def body(actor: Any, tags: Iterable[str] | None) -> None:
            run(tags)

        body.__name__, body.__qualname__ = method, f"{owner.__name__}.{method}"
        body.__module__ = owner.__module__  # with_logs logs on the logger of the module it decorates in
        with_logs(timer(body))(self, tags)

    def _miles_names(self, *names: str, why: str) -> list[Any]:
        """Globals of miles' actor module the adapter calls as miles does; refused when this miles lacks them."""
        owner = body_owner(self)
        namespace = vars(sys.modules[owner.__module__])
        missing = [name for name in names if name not in namespace]
        if missing:
            raise MilesVersionError(
                f"{owner.__name__}'s module {owner.__module__} has no {', '.join(missing)}, {why}; "
                f"MilesLifecycleMixin is written against miles {MILES_COMMIT}: update the adapter for this miles",
                module=owner.__module__,
                missing=missing,
            )
        return [namespace[name] for name in names]

    # ------------------------------------------------------------------ refusals

    def _require_offload(self, method: str) -> None:
        if not self.args.offload_train:
            raise OffloadTrainRequiredError(
                f"{type(self).__name__}.{method}() needs --offload-train (miles asserts it): without it miles' "
                "launcher does not preload torch_memory_saver, so nothing would be released or restored. "
                f"Launch with --offload-train to release the trainer's memory, or do not call {method}()",
                method=method,
            )

    def _refuse_released_params(self, layout: MilesTagLayout) -> None:
        lifecycle = self.lifecycle
        residency = lifecycle.residency
        released = [t for t in layout.kept_for_sync if residency.get(t) is not Residency.RESIDENT]
        if not released:
            return
        message = (
            f"{type(self).__name__}.update_weights from PAUSED reads the params from {released}, which the previous "
            "update_weights released after its push (--rematerialize-param-from-master-weight keeps no CPU copy "
            "of them: plain miles would push released memory, then pause it again and exit). Push once per sleep; "
            "to push again, wake_up() first: the wake rebuilds the params from the master weights."
        )
        lifecycle.event(Event.REFUSED, "warning", operation="sync", state=State.PAUSED, reason=message)
        raise IllegalTransitionError(
            message, state=State.PAUSED, operation="sync", allowed=allowed_operations(State.PAUSED)
        )


def _ranks_per_node(args: Any) -> int | None:
    """The trainer ranks sharing this node's host RAM: miles' `--num-gpus-per-node`, at most the world."""
    per_node = getattr(args, "num_gpus_per_node", None)
    if not isinstance(per_node, int) or per_node < 1:
        return None
    return min(per_node, dist.get_world_size()) if dist.is_initialized() else per_node

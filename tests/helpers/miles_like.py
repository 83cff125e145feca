"""A miles-shaped trainer actor on the recording fakes of `lifecycle.testing`, plain and under the adapter.

`MilesLikeActor` has the method names, flags and bodies of miles' `MegatronTrainRayActor` (31f1ca96)
in colocate + offload_train mode, in one of its tag layouts (`CONFIGS`), and reaches its resources
the way miles does: through this module's globals `torch_memory_saver`, `reload_process_groups()`,
`destroy_process_groups()` and `lora_rollout_enabled()` (process-wide, one actor per process as in a
Ray worker; `build()` installs the actor's fakes). Its `sleep`/`wake_up` carry miles' decorators
`@with_logs @timer` and its sleep logs the CPU memory (`log_cpu_memory`), recorded in `MILES_LOGS`. Its memory is `MilesMemory`: torch_memory_saver's
tags `default` (CPU-backed) and Megatron's `grad_buffer` and `param_buffer`, which have no backup
under --offload-train, so a pause discards what they hold. No torch: the params are an int (None:
discarded), the optimizer's master weights an int in `default`, the CPU weight backup a dict.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

from actor_integration.frameworks.miles import MilesLifecycleMixin, miles_memory_backend
from lifecycle import Hooks
from lifecycle.errors import IllegalTransitionError
from lifecycle.hooks import MemoryBackend
from lifecycle.testing import CallLog, FakeMemorySaver, FakeProcessGroups, ProtocolViolation, RecordingHook
from tests.helpers.method_sequences import KINDS
from tests.helpers.tms import preload_env

# miles' flags for each configuration the model check explores (besides colocate + offload_train).
CONFIGS: dict[str, dict[str, Any]] = {
    "all memory": {},
    "rematerialize": {"rematerialize_param_from_master_weight": True},
    "rematerialize, skip push": {
        "rematerialize_param_from_master_weight": True,
        "debug_skip_weight_update": True,
    },
    "lora rollout": {"lora_rank": 8},
}
TAGS = ("default", "grad_buffer", "param_buffer")

# miles' actor module reaches these as globals; MilesLifecycleMixin replaces them while bodies run.
torch_memory_saver: FakeMemorySaver
_groups = FakeProcessGroups()


class MilesMemory(FakeMemorySaver):
    """torch_memory_saver in miles' launcher: three tags, only `default` with a CPU backup.

    A pause of a tag without backup discards its contents: each `on_discard(tag)` is told. As the
    real singleton, it is initialised by its first use that needs the library (setting
    `memory_margin_bytes` or `retain_cpu_backup`), in the hook mode pending then, and refuses a
    hook mode after that.
    """

    def __init__(self, *, log: CallLog) -> None:
        super().__init__(TAGS, log=log)
        self.backed_up = frozenset({"default"})
        self.on_discard: list[Callable[[str], None]] = []
        self._impl: Any = None
        self.margin: int | None = None

    @property
    def hook_mode(self) -> str:
        raise AttributeError("torch_memory_saver.hook_mode is write-only")

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        assert self._impl is None, "Cannot configure after initialization"  # torch_memory_saver's own
        self._impl_ctor_kwargs = {"hook_mode": mode}

    def _ensure_initialized(self) -> None:
        if self._impl is None:
            pending = getattr(self, "_impl_ctor_kwargs", {})
            self._impl = types.SimpleNamespace(_hook_mode=pending.get("hook_mode", "preload"))

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._ensure_initialized()
        self.margin = value

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        self._retain_cpu_backup = bool(value)

    @property
    def initialised_hook_mode(self) -> str | None:
        return None if self._impl is None else str(self._impl._hook_mode)

    def pause(self, tag: str | None = None) -> None:
        affected = self._affected(tag)
        super().pause(tag)
        for discarded in (t for t in affected if t not in self.backed_up):
            for tell in self.on_discard:
                tell(discarded)


torch_memory_saver = MilesMemory(log=CallLog())

# What miles' own decorators and metric recorded: Timer entries ended ("timed"), with_logs lines
# ((class, method, phase)), log_cpu_memory calls ((rollout_id, label)).
MILES_LOGS: dict[str, list[Any]] = {"timed": [], "logged": [], "cpu_memory": []}


def with_logs(func: Callable[..., Any]) -> Callable[..., Any]:
    """miles' structured start/end lines around a method (`structured_log.with_logs`), recorded."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cls = type(args[0]).__name__
        MILES_LOGS["logged"].append((cls, func.__name__, "start"))
        result = func(*args, **kwargs)
        MILES_LOGS["logged"].append((cls, func.__name__, "end"))
        return result

    return wrapper


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    try:
        yield
    finally:
        MILES_LOGS["timed"].append(name)


def timer(func: Callable[..., Any]) -> Callable[..., Any]:
    """miles' `@timer`: a Timer entry named after the method, recorded when it ends."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _timed(func.__name__):
            return func(*args, **kwargs)

    return wrapper


def log_cpu_memory(rollout_id: int, args: argparse.Namespace, label: str) -> None:
    MILES_LOGS["cpu_memory"].append((rollout_id, label))  # miles: perf/cpu_memory_<label>_gb


def is_first_replica_megatron_main_rank() -> bool:
    return True  # one rank


def reload_process_groups() -> None:
    """miles': rebuild the wrapped groups that are destroyed; live ones are left alone."""
    if not _groups.alive:
        _groups.reload()


def destroy_process_groups() -> None:
    """miles': destroy the live wrapped groups; destroyed ones are skipped."""
    if _groups.alive:
        _groups.destroy()


def lora_rollout_enabled(args: argparse.Namespace) -> bool:
    return bool(args.lora_rank > 0)


def miles_args(config: str = "all memory") -> argparse.Namespace:
    """miles' parsed flags for a colocated, offloaded actor in one of `CONFIGS` (what these bodies read)."""
    args = argparse.Namespace(
        offload_train=True,
        colocate=True,
        use_critic=False,
        use_routing_replay=False,
        rematerialize_param_from_master_weight=False,
        debug_skip_weight_update=False,
        lora_rank=0,
        distributed_timeout_minutes=None,
        train_memory_margin_bytes=0,
    )
    for name, value in CONFIGS[config].items():
        setattr(args, name, value)
    return args


class MilesLikeActor:
    """miles' actor shape: init ends asleep; train wakes and stays awake; save_model saves what is
    there; update_weights(info) syncs and, with rematerialized params, pauses `param_buffer`."""

    def __init__(self) -> None:
        global torch_memory_saver
        # torch_memory_saver is a process-wide singleton that exists before the actor's init.
        self.calls = CallLog()
        self.tms = torch_memory_saver = MilesMemory(log=self.calls)
        for records in MILES_LOGS.values():
            records.clear()
        self.tms.hook_mode = "torch"  # what importing megatron.core leaves pending (its dynamic_context)

    def init(self, args: argparse.Namespace, role: str) -> int:
        self.build(args, role)
        if args.offload_train and args.train_memory_margin_bytes > 0:
            torch_memory_saver.memory_margin_bytes = args.train_memory_margin_bytes
        self._asleep = False
        self._switch_model("actor")
        if self.args.offload_train:
            self.sleep()
        return 0

    def build(self, args: argparse.Namespace, role: str) -> None:
        global _groups
        self.args, self.role = args, role
        self.tms.on_discard.append(self._discard)
        self.groups = _groups = FakeProcessGroups(log=self.calls)
        self.clear_memory = RecordingHook("clear_memory", log=self.calls)
        self.rematerialize = bool(self.args.rematerialize_param_from_master_weight and role == "actor")
        self.master = 0  # the optimizer's master weights ("default": CPU-backed)
        self.params: int | None = 0  # the model's params; None: discarded by a pause
        # miles' weights_backuper: a CPU copy of the actor's params, except with rematerialized params
        # (they are rebuilt from the master weights instead).
        self.backups: dict[str, int | None] = {} if self.rematerialize else {"actor": 0}
        self.saved: list[int | None] = []
        self.pushed: list[int | None] = []
        self.weight_version = 0

    @property
    def params_tag(self) -> str:
        # With LoRA rollout the base weights are "default"; the adapters' buffers are never paused.
        return "default" if lora_rollout_enabled(self.args) else "param_buffer"

    def _discard(self, tag: str) -> None:
        if tag == self.params_tag:
            self.params = None

    # miles' own sleep / wake_up (replaced by the plans under the adapter)
    @with_logs
    @timer
    def sleep(self) -> None:
        if self._asleep:
            return
        self.clear_memory()
        should_log_cpu_memory = is_first_replica_megatron_main_rank() and hasattr(self, "_last_rollout_id")
        destroy_process_groups()
        if self.rematerialize:
            torch_memory_saver.pause(tag="grad_buffer")
            torch_memory_saver.pause(tag="default")
        else:
            torch_memory_saver.pause(tag="default" if lora_rollout_enabled(self.args) else None)
        self._asleep = True
        if should_log_cpu_memory:
            log_cpu_memory(self._last_rollout_id, self.args, "after_offload_train")

    @with_logs
    @timer
    def wake_up(self) -> None:
        if not self._asleep:
            reload_process_groups()
            return
        torch_memory_saver.resume(tag="default" if lora_rollout_enabled(self.args) else None)
        self.clear_memory()
        reload_process_groups()
        self._asleep = False

    def _switch_model(self, target_tag: str) -> None:
        self.calls.add("switch_model", "", target_tag)
        self.tms.touch(self.params_tag)  # writes the params
        if self.rematerialize:  # cast the master weights into the params, then a DP all-gather
            self.tms.touch("default")
            self.groups.use()
            self.params = self.master
        else:
            self.params = self.backups[target_tag]

    def train(self, rollout_id: int) -> dict[str, Any]:
        self._last_rollout_id = rollout_id
        if self.args.offload_train and self._asleep:
            self.wake_up()
        self._switch_model("actor")  # train_actor restores the actor's params before its forward passes
        self.tms.touch(None)  # forward, backward, optimizer: every tag
        self.groups.use()  # gradient all-reduce
        self.master += 1
        self.params = self.master
        self.calls.add("body", "train", str(rollout_id))
        if not self.rematerialize:
            self.backups["actor"] = self.params  # miles: update the cpu actor weight to the latest model
        return {"rollout_id": rollout_id}

    def save_model(self, rollout_id: int) -> None:
        self.tms.touch("default")  # the checkpoint reads the optimizer state...
        self.tms.touch(self.params_tag)  # ...and the params
        self.groups.use()
        self.calls.add("body", "save", str(rollout_id))
        self.saved.append(self.params)

    def update_weights(self, info: Any = None) -> None:
        """miles' shape: reload when asleep, push under disable(), release the params, destroy."""
        temporary = self.args.offload_train and self._asleep
        if temporary:
            reload_process_groups()
        self.groups.use()  # connect the engines, a gloo barrier
        if self.args.debug_skip_weight_update:
            if self.rematerialize:
                torch_memory_saver.pause(tag="param_buffer")
            if temporary:
                destroy_process_groups()
            return
        with torch_memory_saver.disable() if self.args.offload_train else contextlib.nullcontext():
            if not self.tms.disabled:
                raise ProtocolViolation("weight buckets allocated as saver memory cannot be IPC-exported")
            if self.rematerialize:
                self.tms.touch("param_buffer")  # the backuper hands out the params themselves
                weights = self.params
            else:
                weights = self.backups["actor"]  # the CPU copy
            self.weight_version += 1
            self.pushed.append(weights)
            self.calls.add("body", "sync", str(self.weight_version))
        if self.rematerialize:
            torch_memory_saver.pause(tag="param_buffer")
        if temporary:
            destroy_process_groups()


@functools.cache
def launcher_env() -> dict[str, str]:
    """What miles' launcher (`allocate_gpus_for_actor`) puts in an offloaded megatron actor's environment."""
    return preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")


class LifecycleMilesActor(MilesLifecycleMixin, MilesLikeActor):
    """The same actor under the miles adapter, its bodies and init unchanged: the `self.sleep()` that
    ends miles' init configures the lifecycle and sleeps through it. Only the backends are the
    fakes: the adapter's memory backend over `MilesMemory` in the launcher's environment, the
    recording process groups and clear-memory hook (a real one would freeze this test process's heap)."""

    def lifecycle_memory(self) -> MemoryBackend:
        return miles_memory_backend(
            self.lifecycle_layout(), environ=launcher_env(), saver=self.tms, cuda_major=13
        )

    def lifecycle_process_groups(self) -> FakeProcessGroups:
        return self.groups

    def lifecycle_hooks(self) -> Hooks:
        return dataclasses.replace(super().lifecycle_hooks(), clear_memory=self.clear_memory)


# ---------------------------------------------------------------------------------------------- model check

# miles' methods as its driver (train.py) and users call them, for `method_sequences.explore`.
METHODS: dict[str, Callable[[MilesLikeActor], object]] = {
    "sleep": lambda actor: actor.sleep(),
    "wake_up": lambda actor: actor.wake_up(),
    "train": lambda actor: actor.train(1),
    "save_model": lambda actor: actor.save_model(1),
    "update_weights": lambda actor: actor.update_weights("engines and lock"),
}
DISCARDED = "reads discarded params (saves or pushes what a pause without backup left)"
RESIDENCY = "the machine's residency differs from torch_memory_saver's"


def started(cls: type[MilesLikeActor], config: str) -> MilesLikeActor:
    actor = cls()
    actor.init(miles_args(config), "actor")
    return actor


def check(actor: MilesLikeActor) -> str | None:
    """The violations the fakes cannot raise for, after a call: discarded params read, residency drift."""
    if (actor.saved and actor.saved[-1] is None) or (actor.pushed and actor.pushed[-1] is None):
        return DISCARDED
    lifecycle = getattr(actor, "_lifecycle", None)
    if lifecycle is not None and machine_paused(lifecycle.residency) != actor.tms.paused:
        return RESIDENCY
    return None


def machine_paused(residency: dict[str, Any]) -> dict[str, bool]:
    """The machine's residency as the saver's per-tag paused flags (tags it does not track: resident)."""
    if set(residency) == {"*"}:
        return dict.fromkeys(TAGS, residency["*"] != "resident")
    return {tag: residency.get(tag, "resident") != "resident" for tag in TAGS}


# The model check's findings on plain miles: its shortest reproductions, each
# (configuration, sequence after init, what plain miles does at its last call).
# test_miles_sequences.py asserts the search finds exactly these; test_miles_source.py runs them on
# miles' real class.
PAUSED_TWICE = KINDS["Cannot pause allocation"]
RESUMED_RESIDENT = KINDS["Cannot resume allocation"]
PAUSED_BODY = KINDS["body used memory"]
REPRODUCTIONS = [
    ("all memory", ("save_model",), PAUSED_BODY),
    # the param buffer has no CPU backup and miles' wake does not restore it (miles' use-critic save
    # path: onload → save_model)
    ("all memory", ("wake_up", "save_model"), DISCARDED),
    ("rematerialize", ("save_model",), PAUSED_BODY),
    # resume() of all tags meets the params the sleep kept resident (no update_weights since)
    ("rematerialize", ("wake_up",), RESUMED_RESIDENT),
    ("rematerialize", ("train",), RESUMED_RESIDENT),
    # the second push reads the params the first one paused
    ("rematerialize", ("update_weights", "update_weights"), PAUSED_BODY),
    ("rematerialize", ("update_weights", "wake_up", "save_model"), DISCARDED),
    ("rematerialize", ("update_weights", "wake_up", "update_weights"), DISCARDED),
    # an awake update_weights pauses the params; the next train step writes them
    ("rematerialize", ("update_weights", "train", "update_weights", "train"), PAUSED_BODY),
    ("rematerialize, skip push", ("save_model",), PAUSED_BODY),
    ("rematerialize, skip push", ("wake_up",), RESUMED_RESIDENT),
    ("rematerialize, skip push", ("train",), RESUMED_RESIDENT),
    ("rematerialize, skip push", ("update_weights", "update_weights"), PAUSED_TWICE),
    ("rematerialize, skip push", ("update_weights", "wake_up", "save_model"), DISCARDED),
    ("rematerialize, skip push", ("update_weights", "wake_up", "update_weights", "train"), PAUSED_BODY),
    ("lora rollout", ("save_model",), PAUSED_BODY),
]
# Under the adapter these calls are refused with a typed error before any work; every other call runs.
REFUSED = {
    # the params were released after the first push and miles keeps no copy: wake first
    ("rematerialize", ("update_weights", "update_weights")): ("update_weights", IllegalTransitionError),
    ("rematerialize, skip push", ("update_weights", "update_weights")): (
        "update_weights",
        IllegalTransitionError,
    ),
}

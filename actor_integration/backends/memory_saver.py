"""torch_memory_saver (TMS) behind a tag-aware adapter, and a no-op backend for machines without CUDA.

TMS answers every illegal call (pausing a paused tag, resuming a resident one) and every invalid
`TMS_*` environment value with `exit(1)`: no Python exception, the actor just dies. The adapter
keeps its own per-tag state and refuses those calls in Python first, and refuses the environments
TMS would die on (`actor_integration.backends.tms_env`) before any CUDA or TMS initialisation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from actor_integration.backends.device_restore import DeviceRestore, live_extents
from actor_integration.backends.tms_capabilities import RETAIN_COST, SaverCapabilities, saver_capabilities
from actor_integration.backends.tms_env import (
    CPU_BACKUP_BACKENDS,
    HOOK_MODES,
    PRELOAD_LIBRARY_STEM,
    HookMode,
    hook_mode_from_environment,
    is_true,
    preloads_tms,
    validate_environment,
)
from actor_integration.errors import MemorySaverConfigError, MemoryStateError
from lifecycle import ALL_TAGS

__all__ = [
    "MemorySaverConfigError",
    "MemoryStateError",
    "NoopMemory",
    "TorchMemorySaverBackend",
    "select_memory_backend",
]

_TMS_DEFAULT_TAG = "default"
_log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- bookkeeping


class _TagBook:
    """Per-tag paused flags, and the refusals TMS would answer with exit(1)."""

    def __init__(self, tags: Sequence[str] | None, owner: str) -> None:
        self.owner = owner
        self.tags = _check_tags(tags)
        self.paused: dict[str, bool] = dict.fromkeys(self.tags or (ALL_TAGS,), False)

    def key(self, tag: str | None, operation: str) -> str:
        """The bookkeeping key `tag` names; unknown tags raise."""
        if self.tags is None:
            if tag is not None:
                raise ValueError(
                    f"{self.owner}.{operation}({tag!r}): this backend pauses all memory as one unit (tags=None); "
                    f"call {operation}() without a tag, or declare tags=[...]"
                )
            return ALL_TAGS
        if tag is None:
            raise ValueError(f"{self.owner}.{operation}() needs a tag: one of {list(self.tags)}")
        if tag not in self.tags:
            raise ValueError(
                f"{self.owner}.{operation}({tag!r}): unknown tag; this backend's tags are {list(self.tags)}"
            )
        return tag

    def plan(self, operation: Literal["pause", "resume"], tag: str | None) -> tuple[str, ...]:
        """The keys one pause/resume call changes, after refusing what TMS would exit(1) on."""
        pausing = operation == "pause"
        if tag is None and self.tags is not None:
            keys = self.tags
            wrong = [t for t in keys if self.paused[t] == pausing]
            if wrong:
                right = [t for t in keys if t not in wrong]
                raise MemoryStateError(
                    f"{self.owner}: cannot {operation}() with no tag: tags {wrong} are already "
                    f"{'paused' if pausing else 'resident'} ({self.describe_state()}); torch_memory_saver would "
                    f"exit(1) ('Cannot {operation} allocation that is not {'active' if pausing else 'paused'}'). "
                    f"{operation.capitalize()} the others by name: {right}."
                )
            return keys
        key = self.key(tag, operation)
        if self.paused[key] == pausing:
            shown = "all memory" if key == ALL_TAGS else f"tag {key!r}"
            state, fix = ("paused", "resume") if pausing else ("resident", "pause")
            raise MemoryStateError(
                f"{self.owner}: cannot {operation} {shown}: it is already {state} ({self.describe_state()}); "
                f"torch_memory_saver would exit(1) ('Cannot {operation} allocation that is not "
                f"{'active' if pausing else 'paused'}'). Call {fix}({'' if key == ALL_TAGS else repr(key)}) "
                "first, or let lifecycle.Lifecycle order the calls."
            )
        return (key,)

    def region_key(self, tag: str | None) -> str:
        key = self.key(tag, "region")
        if self.paused[key]:
            shown = "memory" if key == ALL_TAGS else f"tag {key!r}"
            raise MemoryStateError(
                f"{self.owner}: cannot allocate in region({'' if key == ALL_TAGS else repr(key)}) while {shown} is "
                f"paused: the new allocation would be resident while the tag is paused, and the next resume would "
                f"exit(1) ('Cannot resume allocation that is not paused'). Resume it first."
            )
        return key

    def is_paused(self, tag: str | None) -> bool:
        if tag is None:
            return any(self.paused.values())
        return self.paused[self.key(tag, "is_paused")]

    def describe_state(self) -> str:
        return ", ".join(
            f"{'all' if t == ALL_TAGS else t}={'paused' if p else 'resident'}" for t, p in self.paused.items()
        )


def _check_tags(tags: Sequence[str] | None) -> tuple[str, ...] | None:
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise ValueError(
            f"tags must be a sequence of tag names or None, got {tags!r}; for one tag write tags=[{tags!r}]"
        )
    if not tags:
        raise ValueError("tags is empty; pass tags=None to pause all memory as one unit")
    for tag in tags:
        if not isinstance(tag, str) or not tag.strip():
            raise ValueError(f"tags has an empty or non-string tag: {tag!r}")
        if tag == ALL_TAGS:
            raise ValueError(f"tag {ALL_TAGS!r} is reserved for 'all memory'; pass tags=None for that")
    duplicates = sorted({t for t in tags if list(tags).count(t) > 1})
    if duplicates:
        raise ValueError(f"tags names {duplicates} more than once")
    return tuple(tags)


# ---------------------------------------------------------------------------------------------- backends


class TorchMemorySaverBackend:
    """torch_memory_saver's interface, tag-aware, refusing in Python what TMS would exit(1) on.

    With `tags=None` all memory is one unit (TMS `pause()` with no tag). With named tags, a call
    without a tag means every declared tag, made as one TMS call per tag, so memory under tags this
    adapter does not declare is never touched. Regions must be entered through `region()` so that
    `disable()` knows whether TMS is active on the calling thread.

    `device_restore=[tags]` keeps those tags' contents too, but in this process's own pinned copy
    of the tag's live blocks, written before the pause and read back after the resume by the SMs
    (one kernel launch) instead of torch_memory_saver's copy-engine backup, which runs at half
    speed right after another process released much memory (`backends/device_restore.py`).
    """

    def __init__(
        self,
        *,
        tags: Sequence[str] | None = None,
        cpu_backup: bool | Collection[str] = False,
        device_restore: bool | Collection[str] = False,
        cpu_backup_backend: str | None = None,
        retain_cpu_backup: bool = False,
        hook_mode: HookMode | Literal["auto"] | None = "auto",
        environ: Mapping[str, str] | None = None,
        saver: Any = None,
        cuda_major: int | None = None,
    ) -> None:
        self._book = _TagBook(tags, "TorchMemorySaverBackend")
        self.tags = self._book.tags
        self._device_tags = _device_restore_tags(device_restore, self.tags)
        # Tags whose contents a pause keeps: torch_memory_saver's CPU backup or this process's copy.
        self._backup_tags = _backup_tags(cpu_backup, self.tags) | self._device_tags
        self._restore: DeviceRestore | None = None  # made at the first use (the device is known then)
        if cpu_backup_backend is not None:
            if cpu_backup_backend not in CPU_BACKUP_BACKENDS:
                raise MemorySaverConfigError(
                    f"cpu_backup_backend must be one of {list(CPU_BACKUP_BACKENDS)} or None, got {cpu_backup_backend!r}"
                )
            if not self._backup_tags - self._device_tags:
                raise MemorySaverConfigError(
                    f"cpu_backup_backend={cpu_backup_backend!r} needs cpu_backup on for at least one tag "
                    "(torch_memory_saver raises 'cpu_backup_backend requires enable_cpu_backup=True')"
                )
            if cpu_backup_backend == "mmap" and torch.version.hip:
                raise MemorySaverConfigError(
                    "cpu_backup_backend='mmap' is not supported on ROCm; use 'pinned'"
                )
        if not isinstance(retain_cpu_backup, bool):
            raise MemorySaverConfigError(f"retain_cpu_backup must be a bool, got {retain_cpu_backup!r}")
        if hook_mode is not None and hook_mode not in (*HOOK_MODES, "auto"):
            raise MemorySaverConfigError(
                f"hook_mode must be one of {[*HOOK_MODES, 'auto']} or None, got {hook_mode!r}"
            )
        self._cpu_backup_backend = cpu_backup_backend
        if self._device_tags and torch.cuda.is_available():
            why = DeviceRestore.supported(torch.device("cuda"))
            if why is not None:
                raise MemorySaverConfigError(f"device_restore={sorted(self._device_tags)}: {why}")
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        auto = hook_mode == "auto"
        if auto:  # what LD_PRELOAD / TMS_INIT_ENABLE ask for, unless TMS was configured already (below)
            hook_mode = hook_mode_from_environment(self._environ)

        if saver is None:
            if hook_mode == "torch" and torch.version.cuda is None and torch.version.hip is None:
                raise MemorySaverConfigError(
                    f"torch_memory_saver hook_mode='torch' needs a CUDA build of torch; this is torch "
                    f"{torch.__version__}. Use NoopMemory (select_memory_backend('auto')) on machines without CUDA."
                )
            from torch_memory_saver import torch_memory_saver

            saver = torch_memory_saver
        self._saver = saver
        configured, initialised = _configured_hook_mode(saver)
        overridden = None
        if auto and configured == "torch" and not initialised and preloads_tms(self._environ):
            # megatron-core sets hook_mode="torch" on the singleton when megatron.core is imported
            # (inference/contexts/dynamic_context.py). In a preloaded process every allocation is the
            # preload library's, which a torch-mode TMS never sees: pause() would release nothing.
            overridden, configured = configured, None
        elif auto and configured == "torch" and preloads_tms(self._environ):
            raise MemorySaverConfigError(
                "torch_memory_saver is already initialised with hook_mode='torch', but LD_PRELOAD loads its preload "
                "library, so every allocation is the preload library's and pause() would release none of it. "
                "Likely cause: megatron.core was imported (it sets hook_mode='torch') and TMS used before this "
                "backend was built; build the backend before the first use of torch_memory_saver."
            )
        elif auto and configured is not None:
            hook_mode = None
        if hook_mode is not None and configured not in (None, hook_mode):
            when = "is already initialised" if initialised else "was already configured by earlier code"
            raise MemorySaverConfigError(
                f"torch_memory_saver {when} with hook_mode={configured!r}, and one process has one mode; "
                f"pass hook_mode=None (or {configured!r}) to use it as it is"
            )
        self.hook_mode: str = hook_mode or configured or "preload"  # TMS's own default is preload
        self.notes = validate_environment(self._environ, hook_mode=self.hook_mode, cuda_major=cuda_major)
        if overridden is not None:
            self.notes.append(
                f"torch_memory_saver was configured with hook_mode={overridden!r} before its first use (megatron-core "
                "does this when megatron.core is imported), but LD_PRELOAD loads the preload library, so every "
                "allocation is the preload library's: the backend set hook_mode='preload'"
            )
        self._init_enable = is_true(self._environ.get("TMS_INIT_ENABLE"))
        if self._init_enable and self.tags is not None and _TMS_DEFAULT_TAG not in self.tags:
            self.notes.append(
                f"TMS_INIT_ENABLE puts allocations outside region() under TMS tag 'default', which this backend "
                f"(tags {list(self.tags)}) never pauses; use tags=None to pause them too"
            )
        # Nothing above touched CUDA or initialised TMS.
        if hook_mode is not None and configured is None:
            saver.hook_mode = hook_mode
        self._lock = threading.RLock()
        self._local = threading.local()
        library = _preloaded_library(self._environ) if self.hook_mode == "preload" else None
        self.capabilities: SaverCapabilities = saver_capabilities(saver, library=library)
        if cpu_backup_backend is not None and not self.capabilities.supports("cpu_backup_backend"):
            raise MemorySaverConfigError(
                f"cpu_backup_backend={cpu_backup_backend!r}: {self.capabilities.why_not['cpu_backup_backend']} "
                f"({self.capabilities.source}); leave cpu_backup_backend unset or install a torch_memory_saver "
                "that has it"
            )
        self.retain_requested = retain_cpu_backup
        if self.capabilities.supports("retain_cpu_backup"):
            saver.retain_cpu_backup = retain_cpu_backup
        elif retain_cpu_backup:
            # slime's pinned fork (zhuzilin/torch_memory_saver) has none: assigning it would only set a
            # Python attribute nothing reads, and the backup would be lost with no word.
            decision = (
                f"retain_cpu_backup was asked for, but {self.capabilities.source} cannot retain the CPU backup "
                f"({self.capabilities.why_not['retain_cpu_backup']}), so it is off: {RETAIN_COST}. Install a "
                "torch_memory_saver with retain_cpu_backup (upstream fzyzcjy/torch_memory_saver 0.0.10 has it) "
                "to get it back"
            )
            self.notes.append(decision)
            _log.warning("%s", decision)

    # ------------------------------------------------------------------ allocation

    @contextlib.contextmanager
    def region(self, tag: str | None = None) -> Iterator[None]:
        """Allocations inside belong to `tag` (no tag when the backend has tags=None)."""
        with self._lock:
            key = self._book.region_key(tag)
        backup = key in self._backup_tags and key not in self._device_tags
        kwargs: dict[str, Any] = {"enable_cpu_backup": backup}
        if backup and self._cpu_backup_backend is not None:
            kwargs["cpu_backup_backend"] = self._cpu_backup_backend
        with self._saver.region(_TMS_DEFAULT_TAG if key == ALL_TAGS else key, **kwargs):
            if self.hook_mode == "torch":
                _allow_frees_at_exit(self._saver)
            if key in self._device_tags:
                self._check_pool(key)  # refused here, before the model is allocated, if unreadable
            self._local.depth = getattr(self._local, "depth", 0) + 1
            # A region inside disable() turns TMS back on: a disable() in it is a real one again.
            outer_disabled, self._local.disabled = getattr(self._local, "disabled", False), False
            try:
                yield
            finally:
                self._local.depth -= 1
                self._local.disabled = outer_disabled

    def disable(self) -> contextlib.AbstractContextManager[Any]:
        """Allocations inside are plain CUDA memory, so CUDA IPC can export them. Nests."""
        # TMS's disable() asserts its thread-local "interesting region" flag. That flag is set inside a
        # region and, under preload, everywhere when TMS_INIT_ENABLE is on; elsewhere allocations are
        # already plain, so there is nothing to disable. Inside a disable() the flag is off, so a
        # second TMS disable() would assert: a nested one (a sender inside the sync plan's) is a no-op.
        if getattr(self._local, "disabled", False):
            return contextlib.nullcontext()
        if getattr(self._local, "depth", 0) > 0 or (self.hook_mode == "preload" and self._init_enable):
            return self._disabled()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _disabled(self) -> Iterator[None]:
        with self._saver.disable():
            self._local.disabled = True
            try:
                yield
            finally:
                self._local.disabled = False

    # ------------------------------------------------------------------ pause / resume

    def pause(self, tag: str | None = None) -> None:
        """Release the device memory of `tag` (None: every tag) through torch_memory_saver."""
        self._call("pause", tag)

    def resume(self, tag: str | None = None) -> None:
        """Map the device memory of the paused `tag` (None: every tag) back through torch_memory_saver."""
        self._call("resume", tag)

    _backup_held = False  # a pause allocated this rank's pinned backup (kept with retain_cpu_backup)

    def _call(self, operation: Literal["pause", "resume"], tag: str | None) -> None:
        method = getattr(self._saver, operation)
        with self._lock:
            for key in self._book.plan(operation, tag):
                ours = key in self._device_tags
                if ours and operation == "pause":
                    self._restorer().save(key, self._segments(key))
                try:
                    method(None if key == ALL_TAGS else key)
                except BaseException:
                    if ours and operation == "pause":
                        self._restorer().forget(key)
                    raise
                # Only after TMS returned: a raise before it leaves the old state, which is the truth.
                self._book.paused[key] = operation == "pause"
                if ours and operation == "resume":
                    self._restore_contents(key)
                self._backup_held = self._backup_held or (
                    operation == "pause" and key in self._backup_tags and not ours
                )

    def _restore_contents(self, key: str) -> None:
        """Copy a device-restore tag's saved blocks back after its resume mapped them again."""
        try:
            self._restorer().restore(key)
        except Exception as exc:
            raise MemoryStateError(
                f"TorchMemorySaverBackend: tag {key!r} was resumed, but copying its saved contents back "
                f"failed ({exc!r}): its memory is mapped and holds other bytes. Load the state again "
                "(a checkpoint) before using it."
            ) from exc

    def _restorer(self) -> DeviceRestore:
        if self._restore is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self._restore = DeviceRestore(device or torch.device("cpu"))
        return self._restore

    def _region_pools(self) -> Mapping[Any, Any] | None:
        """torch_memory_saver's region pools by (tag, CPU backup, disk backup, backend, device)
        (`_impl._mem_pools`, 0.0.10), or None where they cannot be read."""
        pools = getattr(getattr(self._saver, "_impl", None), "_mem_pools", None)
        return pools if isinstance(pools, Mapping) else None

    def _device_pools(self, tag: str) -> list[Any]:
        """The region pools of device-restore `tag` (no TMS backup) on this device."""
        pools = self._region_pools()
        if pools is None:
            raise MemorySaverConfigError(
                f"device_restore={sorted(self._device_tags)}: this torch_memory_saver keeps no region pools "
                "(`_impl._mem_pools`, 0.0.10), so the tags' live blocks cannot be listed; back them up with "
                "cpu_backup instead"
            )
        device = self._restorer().device
        return [
            pool
            for key, pool in list(pools.items())
            if key[0] == tag
            and not key[1]
            and not (len(key) > 2 and key[2])
            and (device.type != "cuda" or key[-1] == device.index)
        ]

    def _check_pool(self, tag: str) -> None:
        """Inside the tag's region: its pool is found, and can list its blocks. A pool not found
        there (torch_memory_saver keyed its pools another way) would leave the pause saving
        nothing and the resume bringing the tag back with other bytes."""
        pools = self._device_pools(tag)
        if not pools:
            raise MemorySaverConfigError(
                f"device_restore: inside tag {tag!r}'s region, no region pool of torch_memory_saver "
                f"matches it (keys {sorted(map(repr, self._region_pools() or {}))}; expected (tag, "
                f"cpu_backup False, disk_backup False, backend, device {self._restorer().device.index}), "
                "as 0.0.10 keys them). This torch_memory_saver is not the one this backend was written "
                "for; back the tag up with cpu_backup instead"
            )
        for pool in pools:
            if not callable(getattr(pool, "snapshot", None)):
                raise MemorySaverConfigError(
                    f"device_restore: torch {torch.__version__}'s MemPool has no snapshot(), so the live blocks "
                    f"of tag {tag!r} cannot be listed; back the tag up with cpu_backup instead"
                )

    def _segments(self, tag: str) -> list[Any]:
        """The snapshot segments of device-restore `tag`'s region pools on this device."""
        return [segment for pool in self._device_pools(tag) for segment in pool.snapshot()]

    def is_paused(self, tag: str | None = None) -> bool:
        """Whether `tag` is paused; with no tag, whether any memory is."""
        with self._lock:
            return self._book.is_paused(tag)

    def is_backed_up(self, tag: str | None = None) -> bool:
        """Whether a pause of `tag` (with no tag: of any tag) keeps its contents in a CPU backup."""
        if tag is None:
            return bool(self._backup_tags)
        return self._book.key(tag, "is_backed_up") in self._backup_tags

    @property
    def may_overlap_process_groups(self) -> bool:
        """Whether a pause/resume may run while process groups are torn down or rebuilt.

        In torch hook mode only region allocations are saver memory, so NCCL's buffers are not:
        yes. In preload mode with TMS_INIT_ENABLE every cudaMalloc of the process is, NCCL's
        included: no, the communicators must be gone before their memory is paused.
        """
        return not (self.hook_mode == "preload" and self._init_enable)

    # ------------------------------------------------------------------ CPU backup

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep the CPU copy after resume: steady pauses skip the host allocation (FACTS: ~2 GB/s → ~50 GB/s).
        False on a torch_memory_saver that cannot retain it (`capabilities`)."""
        if not self.capabilities.supports("retain_cpu_backup"):
            return False
        return bool(self._saver.retain_cpu_backup)

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        if not self.capabilities.supports("retain_cpu_backup"):
            if value:
                raise MemorySaverConfigError(
                    f"retain_cpu_backup=True: {self.capabilities.why_not['retain_cpu_backup']} "
                    f"({self.capabilities.source}); {RETAIN_COST}"
                )
            return
        self._saver.retain_cpu_backup = bool(value)

    def cpu_backup(self, tensor: torch.Tensor, tag: str | None = None) -> torch.Tensor | None:
        """A CPU copy of `tensor` from TMS's backup; None when resident and its backup was released.

        `tensor` must be memory allocated in `region(tag)`. Pass `tag` when a paused tag without CPU
        backup exists: TMS exits on a tensor of such a tag, and the adapter cannot tell tags apart.
        """
        with self._lock:
            if tag is not None and self._book.key(tag, "cpu_backup") in self._device_tags:
                _check_backup_tensor(tensor)
                return self._restorer().copy_of(tag, tensor)  # None while resident, as TMS's
            if not self._backup_tags - self._device_tags:
                raise MemoryStateError(
                    "cpu_backup: no tag of this backend has cpu_backup on, so torch_memory_saver holds no CPU copy "
                    "and would exit(1) on a paused tensor; construct the backend with cpu_backup=True or a tag list"
                )
            if tag is not None:
                key = self._book.key(tag, "cpu_backup")
                if key not in self._backup_tags:
                    raise MemoryStateError(
                        f"cpu_backup: tag {tag!r} has no CPU backup (backed-up tags: {sorted(self._backup_tags)}); "
                        "torch_memory_saver would exit(1) on its paused tensors"
                    )
            else:
                risky = [
                    t
                    for t, p in self._book.paused.items()
                    if p and (t not in self._backup_tags or t in self._device_tags)
                ]
                if risky:
                    raise MemoryStateError(
                        f"cpu_backup: tags {risky} are paused without CPU backup and torch_memory_saver exits on "
                        "their tensors; pass tag= to say which tag this tensor belongs to"
                    )
            _check_backup_tensor(tensor)
            if tensor.device.type != "cuda":
                raise ValueError(
                    f"cpu_backup needs a CUDA tensor allocated in region(); got one on {tensor.device}"
                )
            return self._saver.get_cpu_backup(tensor)  # type: ignore[no-any-return]

    def prepare_cpu_backup(
        self, *, ranks_per_node: int | None = None, nbytes: int | None = None
    ) -> dict[str, Any]:
        """Allocate the retained pinned CPU backup now, at configuration, not in the first sleep.

        torch_memory_saver (0.0.10, csrc/cpu_backup.h) allocates each allocation's pinned backup
        inside its first pause (one cudaMallocHost each: 3.4-4.1 s for 8.9 GiB measured on an H200)
        and takes no host memory from outside; with `retain_cpu_backup` the backup then outlives
        every resume. So one pause and resume of each backed-up tag here moves that cost out of
        the first step (measured, 8.9 GiB in 1270 tensors: 6.75 s here, then the first sleep's
        pause 0.22 s, 44 GB/s); it cannot run in the background, since a pause unmaps the tensors
        while it copies. Host RAM is checked first (`check_host_memory`). Call it with every backed-up
        tag resident and nothing running on it, e.g. right after the model and optimizer exist.
        Returns the figures: bytes, the host check, seconds.
        """
        with self._lock:
            if not self._backup_tags:
                raise MemorySaverConfigError(
                    "prepare_cpu_backup: no tag has cpu_backup on, so there is no backup to prepare"
                )
            tms_tags = self._backup_tags - self._device_tags
            if tms_tags and not self.retain_cpu_backup:
                raise MemorySaverConfigError(
                    "prepare_cpu_backup needs retain_cpu_backup=True: without it torch_memory_saver frees "
                    "the pinned backup on every resume and allocates it again in every pause, so nothing "
                    "prepared now would survive to the first sleep"
                )
            paused = [t for t in self._book.paused if t in self._backup_tags and self._book.paused[t]]
            if paused:
                raise MemoryStateError(
                    f"prepare_cpu_backup: tags {paused} are paused ({self._book.describe_state()}); call it "
                    "while the tags are resident (at configuration, before the first sleep)"
                )
        figures = self.check_host_memory(ranks_per_node=ranks_per_node, nbytes=nbytes)
        t0 = time.perf_counter()
        for tag in sorted(tms_tags):
            key = None if tag == ALL_TAGS else tag
            self.pause(key)
            self.resume(key)
        for tag in sorted(self._device_tags):  # their pinned copy: allocated, nothing paused
            self._restorer().prepare(tag, self._segments(tag))
        figures["seconds"] = round(time.perf_counter() - t0, 3)
        return figures

    def check_retained_backup(
        self,
        *,
        ranks_per_node: int | None = None,
        unbacked_bytes: int = 0,
        backed_up: bool | None = None,
    ) -> dict[str, Any] | None:
        """`check_host_memory` for a preloaded process (`TMS_INIT_ENABLE=1`), before its first pause.

        There torch_memory_saver backs up every allocation of the process, so what it will hold is
        the caching allocator's segments (`torch.cuda.memory_reserved()`, after `empty_cache()` as the
        sleep's clear-memory hook does) less `unbacked_bytes` (allocations whose tag has no backup,
        e.g. Megatron's param and grad buffers under miles' --offload-train). `backed_up`: whether
        the process's allocations are backed up at all (default: a tag of this backend has
        cpu_backup). Returns the figures (noted in `notes`), or None where nothing is held between
        steps (no backup, not retained) or CUDA is not initialised.
        """
        backed_up = self.is_backed_up() if backed_up is None else backed_up
        if not (self.retain_cpu_backup and backed_up and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return None
        torch.cuda.empty_cache()
        nbytes = max(0, int(torch.cuda.memory_reserved()) - unbacked_bytes)
        figures = self.check_host_memory(ranks_per_node=ranks_per_node, nbytes=nbytes)
        less = (
            f" (the allocator's segments less {unbacked_bytes / 2**30:.2f} GiB without backup)"
            if unbacked_bytes
            else ""
        )
        self.notes.append(
            f"host RAM checked for the retained backup: {nbytes / 2**30:.2f} GiB per rank{less} x "
            f"{figures['ranks_per_node']} ranks, {figures['available_bytes'] / 2**30:.1f} GiB available"
        )
        return figures

    def check_host_memory(
        self, *, ranks_per_node: int | None = None, nbytes: int | None = None
    ) -> dict[str, Any]:
        """Refuse (or warn about) a CPU backup the node's host RAM cannot hold.

        Every rank on a node backs up its own GPU state in host RAM (vime #190, miles #2781: host
        OOM kills). `nbytes` is this rank's backed-up bytes (default: read from torch_memory_saver's
        region pools, torch hook mode); `ranks_per_node` defaults to LOCAL_WORLD_SIZE, else 1.
        Raises MemorySaverConfigError when they need more than the available memory, warns above
        80% of it; returns the numbers.
        """
        if nbytes is None:
            nbytes = self.backup_bytes()
        if ranks_per_node is None:
            ranks_per_node = int(self._environ.get("LOCAL_WORLD_SIZE") or 1)
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise MemorySaverConfigError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        import psutil

        available = int(psutil.virtual_memory().available)
        device_held = self._restore.held_bytes() if self._restore is not None else 0
        # Held already: this backend's device_restore copies, and TMS's retained backup of the rest.
        retained = max(0, nbytes - device_held) if self.retain_cpu_backup and self._backup_held else 0
        held = device_held + retained
        needed = nbytes * ranks_per_node - held
        gib = 2**30
        figures: dict[str, Any] = {
            "backup_bytes": nbytes,
            "ranks_per_node": ranks_per_node,
            "needed_bytes": needed,
            "available_bytes": available,
        }
        what = (
            f"the pinned CPU backup needs {needed / gib:.1f} GiB of host RAM on this node ({nbytes / gib:.2f} GiB "
            f"per rank x {ranks_per_node} ranks"
            + (", this rank's already held" if held else "")
            + f") and {available / gib:.1f} GiB are available"
        )
        if needed > available:
            raise MemorySaverConfigError(
                f"{what}: the host would run out of memory and the kernel kill a rank (vime #190, miles "
                "#2781). Back up fewer tags (cpu_backup=[...]), use fewer ranks per node, free host memory "
                "(the rollout engine's weight mirror), or pass ranks_per_node= if fewer ranks share this host."
            )
        if needed > 0.8 * available:
            warning = f"{what}: little is left for anything else"
            warnings.warn(warning, ResourceWarning, stacklevel=2)
            self.notes.append(warning)
        return figures

    def backup_bytes(self) -> int:
        """The bytes allocated in the backed-up tags' regions (torch hook mode: TMS's region pools)."""
        pools = self._region_pools()
        if pools is None:
            raise MemorySaverConfigError(
                "backup_bytes: torch_memory_saver's region pools cannot be read (preload hook mode, or nothing "
                "allocated yet); pass nbytes= (this rank's backed-up bytes) to check_host_memory/prepare_cpu_backup"
            )
        total = 0
        for key, pool in list(pools.items()):
            tag, backed_up = key[0], key[1]
            if backed_up and (
                tag in self._backup_tags or (ALL_TAGS in self._backup_tags and tag == _TMS_DEFAULT_TAG)
            ):
                try:
                    segments = pool.snapshot()
                except Exception as exc:  # a torch without MemPool.snapshot()
                    raise MemorySaverConfigError(
                        f"backup_bytes: torch {torch.__version__} cannot list the region pool's segments "
                        f"({exc!r}); pass nbytes= (this rank's backed-up bytes) instead"
                    ) from exc
                total += sum(int(segment["total_size"]) for segment in segments)
        for tag in self._device_tags:  # their copy is of the live blocks alone
            total += sum(size for _, size in live_extents(self._segments(tag)))
        return total

    def describe(self) -> str:
        """One line for `lifecycle.configured`: hook mode, tags, CPU backups and the tags' state."""
        tags = "all memory as one unit" if self.tags is None else f"tags {list(self.tags)}"
        backup = (
            sorted("all" if t == ALL_TAGS else t for t in self._backup_tags - self._device_tags) or "none"
        )
        restored = f"device_restore={sorted(self._device_tags)}, " if self._device_tags else ""
        return (
            f"torch_memory_saver (hook_mode={self.hook_mode}, {tags}, cpu_backup={backup}, {restored}"
            f"backend={self._cpu_backup_backend or self._environ.get('TMS_INIT_CPU_BACKUP_BACKEND') or 'pinned'}, "
            f"retain_cpu_backup={self.retain_cpu_backup}"
            + (
                " (asked for; this torch_memory_saver cannot)"
                if self.retain_requested and not self.capabilities.supports("retain_cpu_backup")
                else ""
            )
            + f"; {self._book.describe_state()})"
        )

    def __repr__(self) -> str:
        return f"<TorchMemorySaverBackend {self.describe()}>"


_exit_guard_registered = False


def _allow_frees_at_exit(saver: Any) -> None:
    """Let interpreter teardown free region memory without TMS killing the process.

    In torch hook mode TMS exits with "only support interesting region" when region memory is
    freed outside a region, and teardown (the memory pools' destructors) does exactly that: a run
    that passed would end with exit code 1 (seen on an H200 with TMS 0.0.10). At exit the thread
    is marked as inside a region, so those frees go through.
    """
    global _exit_guard_registered
    cdll = getattr(getattr(getattr(saver, "_impl", None), "_binary_wrapper", None), "cdll", None)
    if _exit_guard_registered or cdll is None:
        return

    def guard() -> None:
        with contextlib.suppress(Exception):
            cdll.tms_set_interesting_region(True)

    atexit.register(guard)
    _exit_guard_registered = True


class NoopMemory:
    """The memory backend for machines without CUDA: the same interface and refusals, no GPU work."""

    def __init__(self, *, tags: Sequence[str] | None = None, reason: str | None = None) -> None:
        self._book = _TagBook(tags, "NoopMemory")
        self.tags = self._book.tags
        self.reason = reason
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def region(self, tag: str | None = None) -> Iterator[None]:
        """Allocations inside would belong to `tag`; refused while it is paused, as the real backend does."""
        with self._lock:
            self._book.region_key(tag)
        yield

    def disable(self) -> contextlib.AbstractContextManager[Any]:
        """A context that does nothing: every allocation is plain memory already."""
        return contextlib.nullcontext()

    def pause(self, tag: str | None = None) -> None:
        """Mark `tag` (None: all of it) paused, refusing a double pause as torch_memory_saver would."""
        with self._lock:
            for key in self._book.plan("pause", tag):
                self._book.paused[key] = True

    def resume(self, tag: str | None = None) -> None:
        """Mark `tag` (None: all of it) resident, refusing a resume of a resident tag."""
        with self._lock:
            for key in self._book.plan("resume", tag):
                self._book.paused[key] = False

    def is_paused(self, tag: str | None = None) -> bool:
        """Whether `tag` is paused; with no tag, whether any memory is."""
        with self._lock:
            return self._book.is_paused(tag)

    may_overlap_process_groups = True  # nothing is released

    def describe(self) -> str:
        """One line for `lifecycle.configured`: why nothing is released, the tags and their state."""
        tags = "all memory as one unit" if self.tags is None else f"tags {list(self.tags)}"
        why = f" because {self.reason}" if self.reason else ""
        return f"no-op memory (nothing is released{why}; {tags}; {self._book.describe_state()})"

    def __repr__(self) -> str:
        return f"<NoopMemory {self.describe()}>"


MEMORY_BACKEND_KINDS: tuple[str, ...] = ("auto", "tms", "noop")
_BACKEND_OPTIONS = frozenset(
    {
        "cpu_backup",
        "device_restore",
        "cpu_backup_backend",
        "retain_cpu_backup",
        "hook_mode",
        "environ",
        "saver",
        "cuda_major",
    }
)


def select_memory_backend(
    kind: str = "auto", *, tags: Sequence[str] | None, **kwargs: Any
) -> TorchMemorySaverBackend | NoopMemory:
    """ "tms", "noop", or "auto" (TMS when CUDA is available); the result's `describe()` says which and why.

    The keyword options are TorchMemorySaverBackend's; a no-op backend accepts and ignores them.
    """
    if kind not in MEMORY_BACKEND_KINDS:
        raise ValueError(f"unknown memory backend kind {kind!r}; kinds are {list(MEMORY_BACKEND_KINDS)}")
    unknown = sorted(set(kwargs) - _BACKEND_OPTIONS)
    if unknown:
        raise TypeError(
            f"select_memory_backend: unknown options {unknown}; options are {sorted(_BACKEND_OPTIONS)}"
        )
    if kind == "noop":
        return NoopMemory(tags=tags, reason="kind='noop' was asked for")
    cuda = torch.cuda.is_available()
    if kind == "auto" and not cuda:
        return NoopMemory(tags=tags, reason="torch.cuda.is_available() is False (kind='auto')")
    if not cuda and kwargs.get("saver") is None:
        raise MemorySaverConfigError(
            f"kind='tms' but torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); use kind='auto' or 'noop' on machines without a GPU"
        )
    return TorchMemorySaverBackend(tags=tags, **kwargs)


def _backup_tags(cpu_backup: bool | Collection[str], tags: tuple[str, ...] | None) -> frozenset[str]:
    if isinstance(cpu_backup, bool):
        return frozenset((tags or (ALL_TAGS,)) if cpu_backup else ())
    if isinstance(cpu_backup, str) or not isinstance(cpu_backup, Collection):
        raise MemorySaverConfigError(
            f"cpu_backup must be a bool or a collection of tags, got {cpu_backup!r}; for one tag write [{cpu_backup!r}]"
        )
    if tags is None:
        raise MemorySaverConfigError(
            f"cpu_backup={sorted(cpu_backup)} names tags, but tags=None pauses all memory as one unit; "
            "pass cpu_backup=True, or declare the tags"
        )
    unknown = sorted(set(cpu_backup) - set(tags))
    if unknown:
        raise MemorySaverConfigError(
            f"cpu_backup names unknown tags {unknown}; this backend's tags are {list(tags)}"
        )
    return frozenset(cpu_backup)


def _device_restore_tags(
    device_restore: bool | Collection[str], tags: tuple[str, ...] | None
) -> frozenset[str]:
    if device_restore is False or (not isinstance(device_restore, bool) and not device_restore):
        return frozenset()
    if tags is None:
        raise MemorySaverConfigError(
            "device_restore needs named tags: with tags=None a pause covers every allocation of the process, "
            "which no region pool lists; declare tags=[...] and name the ones to restore"
        )
    if device_restore is True:
        return frozenset(tags)
    if isinstance(device_restore, str) or not isinstance(device_restore, Collection):
        raise MemorySaverConfigError(
            f"device_restore must be a bool or a collection of tags, got {device_restore!r}; for one tag "
            f"write [{device_restore!r}]"
        )
    unknown = sorted(set(device_restore) - set(tags))
    if unknown:
        raise MemorySaverConfigError(
            f"device_restore names unknown tags {unknown}; this backend's tags are {list(tags)}"
        )
    return frozenset(device_restore)


def _check_backup_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"cpu_backup needs a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            "cpu_backup needs a contiguous tensor (the backup is looked up by address range); pass the "
            "parameter itself, not a transposed or strided view"
        )


def _configured_hook_mode(saver: Any) -> tuple[str | None, bool]:
    """(mode, initialised): the hook mode the saver runs or will run with. TMS has no public getter."""
    impl = getattr(saver, "_impl", None)
    if impl is not None:
        mode = getattr(impl, "_hook_mode", None)
        return (mode if isinstance(mode, str) else None), True
    pending = getattr(saver, "_impl_ctor_kwargs", None)
    mode = pending.get("hook_mode") if isinstance(pending, dict) else None
    return (mode if isinstance(mode, str) else None), False


def _preloaded_library(environ: Mapping[str, str]) -> str | None:
    """The torch_memory_saver library LD_PRELOAD loads (the one whose exports decide what it supports)."""
    for entry in environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if PRELOAD_LIBRARY_STEM in os.path.basename(entry):
            return entry
    return None

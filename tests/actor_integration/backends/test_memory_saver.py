"""The torch_memory_saver adapter and the no-op backend (the environment check: test_tms_env.py).

Three kinds of evidence: a fake with the exact interface of the `torch_memory_saver` singleton
(unit tests), a real `lifecycle.Lifecycle` driving both backends, and the real TMS C++ library
loaded in subprocesses over a stub CUDA driver, which shows the `exit(1)` the adapter exists for.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from actor_integration.backends.memory_saver import (
    MemorySaverConfigError,
    MemoryStateError,
    NoopMemory,
    TorchMemorySaverBackend,
    select_memory_backend,
)
from actor_integration.backends.tms_env import (
    hook_mode_from_environment,
    preload_library,
    validate_environment,
)
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, Residency, State
from lifecycle.testing import InjectedFault, ProtocolViolation
from tests.helpers.tms import preload_env

REPO = Path(__file__).resolve().parents[3]
TAGS = ("weights", "kv_cache")
_TRUE = ("1", "true", "TRUE", "yes", "YES")


# ---------------------------------------------------------------------------------------------- the fake


class FakeTorchMemorySaver:
    """The `torch_memory_saver.torch_memory_saver` singleton's interface and failure modes, on CPU.

    Where TMS calls exit(1) this raises `ProtocolViolation`; where TMS asserts, it asserts the same.
    "Allocations" are CPU tensors registered with `allocate()` inside a region. TMS's thread-local
    "interesting region" flag starts from TMS_INIT_ENABLE, is set inside `region()`, cleared inside
    `disable()`, which asserts it, exactly as in csrc/entrypoint.cpp and entrypoint.py.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = dict(environ or {})
        self._impl: Any = None
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._local = threading.local()
        self._retain = self._environ.get("TMS_RETAIN_CPU_BACKUP") in _TRUE
        self.allocations: list[SimpleNamespace] = []
        self.calls: list[tuple[Any, ...]] = []
        self.fail_before: set[str] = set()

    # TMS: hook_mode has a setter only, usable before the first use.
    @property
    def hook_mode(self) -> str:
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, hook_mode: str) -> None:
        if self._impl is not None:
            raise AttributeError("'TorchMemorySaver' object has no attribute '_impl_ctor_kwargs'")
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    def _ensure_initialized(self) -> None:
        if self._impl is None:
            self._impl = SimpleNamespace(_hook_mode=self._impl_ctor_kwargs.get("hook_mode", "preload"))

    def _state(self) -> SimpleNamespace:
        local = self._local
        if not hasattr(local, "state"):
            local.state = SimpleNamespace(
                interesting=self._environ.get("TMS_INIT_ENABLE") in _TRUE, tag="default", cpu_backup=False
            )
        return local.state  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        self._ensure_initialized()
        self.calls.append(("region", tag, enable_cpu_backup, cpu_backup_backend))
        state = self._state()
        saved = (state.interesting, state.tag, state.cpu_backup)
        state.interesting, state.tag, state.cpu_backup = True, tag, enable_cpu_backup
        try:
            yield
        finally:
            state.interesting, state.tag, state.cpu_backup = saved

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a CUDA allocation does: TMS memory under the current tag when the flag is set."""
        state = self._state()
        if state.interesting:
            self.allocations.append(
                SimpleNamespace(
                    tensor=tensor, tag=state.tag, cpu_backup=state.cpu_backup, paused=False, backup=None
                )
            )
        return tensor

    def is_saver_memory(self, tensor: torch.Tensor) -> bool:
        return any(a.tensor is tensor for a in self.allocations)

    def _matching(self, tag: str | None) -> list[SimpleNamespace]:
        return [a for a in self.allocations if not tag or a.tag == tag]

    def pause(self, tag: str | None = None) -> None:
        self._ensure_initialized()
        self.calls.append(("pause", tag))
        if "pause" in self.fail_before:
            self.fail_before.discard("pause")
            raise InjectedFault("pause failed before any effect")
        for alloc in self._matching(tag):
            if alloc.paused:
                raise ProtocolViolation(
                    f"Cannot pause allocation that is not active. tag={alloc.tag} (exit(1))"
                )
            if alloc.cpu_backup:
                alloc.backup = alloc.tensor.clone()
            alloc.tensor.fill_(-7)  # the physical memory is gone
            alloc.paused = True

    def resume(self, tag: str | None = None) -> None:
        self._ensure_initialized()
        self.calls.append(("resume", tag))
        for alloc in self._matching(tag):
            if not alloc.paused:
                raise ProtocolViolation(
                    f"Cannot resume allocation that is not paused. tag={alloc.tag} (exit(1))"
                )
            if alloc.backup is not None:
                alloc.tensor.copy_(alloc.backup)
                if not self._retain:
                    alloc.backup = None
            alloc.paused = False

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        self._ensure_initialized()
        state = self._state()
        assert state.interesting, "disable() should be called only when tms is active"
        self.calls.append(("disable",))
        state.interesting = False
        try:
            yield
        finally:
            state.interesting = True

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        self._retain = bool(value)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        self._ensure_initialized()
        for alloc in self.allocations:
            if alloc.tensor.data_ptr() == x.data_ptr():
                if alloc.paused and alloc.backup is None:
                    raise ProtocolViolation("found paused allocation but cpu_backup does not exist (exit(1))")
                return None if alloc.backup is None else alloc.backup.clone()
        raise ProtocolViolation("get_cpu_backup_pointer fail to find backup (exit(1))")


def tms_backend(
    tags: tuple[str, ...] | None = TAGS, environ: Mapping[str, str] | None = None, **kwargs: Any
) -> tuple[TorchMemorySaverBackend, FakeTorchMemorySaver]:
    env = dict(environ or {})
    saver = FakeTorchMemorySaver(env)
    return TorchMemorySaverBackend(tags=tags, environ=env, saver=saver, **kwargs), saver


class TestNoopMemory:
    """Per-tag bookkeeping and the refusals TMS would exit(1) on; reused for the TMS adapter below."""

    def make(self, tags: tuple[str, ...] | None = TAGS) -> Any:
        return NoopMemory(tags=tags)

    def test_pause_and_resume_flip_each_tag(self) -> None:
        memory = self.make()
        memory.pause("weights")
        assert memory.is_paused("weights") and not memory.is_paused("kv_cache")
        assert memory.is_paused()  # any tag
        memory.resume("weights")
        assert not memory.is_paused()

    def test_second_pause_of_a_tag_is_refused(self) -> None:
        memory = self.make()
        memory.pause("weights")
        with pytest.raises(
            MemoryStateError, match=r"cannot pause tag 'weights': it is already paused.*exit\(1\)"
        ):
            memory.pause("weights")
        assert memory.is_paused("weights")

    def test_resume_of_a_resident_tag_is_refused(self) -> None:
        memory = self.make()
        with pytest.raises(MemoryStateError, match=r"cannot resume tag 'kv_cache': it is already resident"):
            memory.resume("kv_cache")

    def test_untagged_pause_while_a_tag_is_paused_is_refused(self) -> None:
        memory = self.make()
        memory.pause("kv_cache")
        with pytest.raises(
            MemoryStateError, match=r"tags \['kv_cache'\] are already paused.*by name: \['weights'\]"
        ):
            memory.pause()
        assert not memory.is_paused("weights")

    def test_untagged_resume_while_a_tag_is_resident_is_refused(self) -> None:
        memory = self.make()
        memory.pause("kv_cache")
        with pytest.raises(
            MemoryStateError, match=r"cannot resume\(\) with no tag: tags \['weights'\] are already resident"
        ):
            memory.resume()

    def test_untagged_calls_cover_every_tag(self) -> None:
        memory = self.make()
        memory.pause()
        assert memory.is_paused("weights") and memory.is_paused("kv_cache")
        memory.resume()
        assert not memory.is_paused()

    def test_unit_mode(self) -> None:
        memory = self.make(tags=None)
        memory.pause()
        assert memory.is_paused()
        with pytest.raises(MemoryStateError, match=r"cannot pause all memory: it is already paused"):
            memory.pause()
        memory.resume()
        with pytest.raises(ValueError, match=r"pauses all memory as one unit \(tags=None\)"):
            memory.pause("weights")

    def test_unknown_tag(self) -> None:
        memory = self.make()
        with pytest.raises(
            ValueError, match=r"pause\('kv'\): unknown tag; this backend's tags are \['weights', 'kv_cache'\]"
        ):
            memory.pause("kv")
        with pytest.raises(ValueError, match=r"region\('kv'\): unknown tag"), memory.region("kv"):
            pass

    def test_region_of_a_paused_tag_is_refused(self) -> None:
        memory = self.make()
        memory.pause("weights")
        with (
            pytest.raises(
                MemoryStateError,
                match=r"cannot allocate in region\('weights'\) while tag 'weights' is paused",
            ),
            memory.region("weights"),
        ):
            pass
        with memory.region("kv_cache"):
            pass

    @pytest.mark.parametrize("tags", [(), ("a", "a"), ("",), ("*",), "weights"])
    def test_bad_tags(self, tags: Any) -> None:
        with pytest.raises(ValueError, match="tag"):
            self.make(tags=tags)

    def test_describe_names_the_state(self) -> None:
        memory = self.make()
        memory.pause("weights")
        assert "weights=paused, kv_cache=resident" in memory.describe()


class TestTorchMemorySaverBackendBookkeeping(TestNoopMemory):
    """The same bookkeeping over the TMS-shaped fake, which would raise where TMS exits."""

    def make(self, tags: tuple[str, ...] | None = TAGS) -> Any:
        return tms_backend(tags)[0]

    def test_refused_calls_never_reach_the_saver(self) -> None:
        backend, saver = tms_backend()
        backend.pause("weights")
        with pytest.raises(MemoryStateError):
            backend.pause("weights")
        with pytest.raises(MemoryStateError):
            backend.resume("kv_cache")
        with pytest.raises(MemoryStateError):
            backend.pause()
        assert [c for c in saver.calls if c[0] in ("pause", "resume")] == [("pause", "weights")]

    def test_untagged_call_is_one_tms_call_per_declared_tag(self) -> None:
        """So memory under tags this adapter does not declare is never paused."""
        backend, saver = tms_backend()
        with saver.region("other"):
            other = saver.allocate(torch.ones(2))
        backend.pause()
        backend.resume()
        assert [c for c in saver.calls if c[0] != "region"] == [
            ("pause", "weights"),
            ("pause", "kv_cache"),
            ("resume", "weights"),
            ("resume", "kv_cache"),
        ]
        assert torch.equal(other, torch.ones(2))

    def test_unit_mode_is_tms_pause_with_no_tag(self) -> None:
        backend, saver = tms_backend(tags=None)
        with backend.region():
            saver.allocate(torch.ones(2))
        backend.pause()
        backend.resume()
        assert saver.calls == [("region", "default", False, None), ("pause", None), ("resume", None)]

    def test_state_changes_only_after_tms_returned(self) -> None:
        backend, saver = tms_backend()
        saver.fail_before.add("pause")
        with pytest.raises(InjectedFault):
            backend.pause("weights")
        assert not backend.is_paused("weights")
        backend.pause("weights")  # the fake would raise ProtocolViolation if the first had paused it
        assert backend.is_paused("weights")


class TestTorchMemorySaverBackendRegions:
    """region(tag) routes allocations to the tag, with that tag's CPU backup setting."""

    def test_region_passes_tag_and_per_tag_backup(self) -> None:
        backend, saver = tms_backend(cpu_backup=["weights"], cpu_backup_backend="mmap")
        with backend.region("weights"):
            weights = saver.allocate(torch.arange(4.0))
        with backend.region("kv_cache"):
            cache = saver.allocate(torch.zeros(4))
        assert saver.calls == [("region", "weights", True, "mmap"), ("region", "kv_cache", False, None)]
        assert [(a.tag, a.cpu_backup) for a in saver.allocations] == [("weights", True), ("kv_cache", False)]
        backend.pause()
        assert torch.equal(weights, torch.full((4,), -7.0)) and torch.equal(cache, torch.full((4,), -7.0))
        backend.resume()
        assert torch.equal(weights, torch.arange(4.0))  # backed up: contents survive

    def test_cpu_backup_true_covers_every_tag(self) -> None:
        backend, saver = tms_backend(cpu_backup=True)
        for tag in TAGS:
            with backend.region(tag):
                pass
        assert [c[2] for c in saver.calls] == [True, True]

    def test_region_needs_a_tag_when_tags_are_declared(self) -> None:
        backend, _ = tms_backend()
        with (
            pytest.raises(ValueError, match=r"region\(\) needs a tag: one of \['weights', 'kv_cache'\]"),
            backend.region(),
        ):
            pass


class TestTorchMemorySaverBackendDisable:
    """disable() calls TMS's disable() exactly where TMS's flag is set; elsewhere allocations are plain already."""

    def test_torch_mode_outside_a_region_is_a_null_context(self) -> None:
        backend, saver = tms_backend()
        with backend.disable():
            saver.allocate(torch.ones(1))
        assert ("disable",) not in saver.calls
        assert saver.allocations == []  # plain memory

    def test_torch_mode_inside_a_region_disables(self) -> None:
        backend, saver = tms_backend()
        with backend.region("weights"), backend.disable():
            plain = saver.allocate(torch.ones(1))
        assert ("disable",) in saver.calls
        assert not saver.is_saver_memory(plain)

    def test_preload_with_init_enable_disables(self) -> None:
        backend, saver = tms_backend(
            environ=preload_env(TMS_INIT_ENABLE="1"), hook_mode="preload", cuda_major=13
        )
        outside = saver.allocate(torch.ones(1))
        with backend.disable():
            plain = saver.allocate(torch.ones(1))
        assert saver.is_saver_memory(outside) and not saver.is_saver_memory(plain)

    def test_preload_without_init_enable_is_a_null_context(self) -> None:
        backend, saver = tms_backend(environ=preload_env(), hook_mode="preload", cuda_major=13)
        with backend.disable():
            saver.allocate(torch.ones(1))
        assert ("disable",) not in saver.calls

    def test_other_threads_see_their_own_flag(self) -> None:
        backend, _ = tms_backend()
        errors: list[BaseException] = []

        def outside_region() -> None:
            try:
                with backend.disable():
                    pass
            except BaseException as exc:  # an AssertionError from TMS's disable()
                errors.append(exc)

        with backend.region("weights"):
            thread = threading.Thread(target=outside_region)
            thread.start()
            thread.join()
        assert errors == []

    def test_nested_disable_is_a_no_op(self):
        """TMS asserts on a second disable() (slime's update_weights inside the sync plan's, a sender inside it)."""
        backend, saver = tms_backend(
            environ=preload_env(TMS_INIT_ENABLE="1"), hook_mode="preload", cuda_major=13
        )
        with backend.disable(), backend.disable():
            plain = saver.allocate(torch.ones(1))
        assert saver.calls.count(("disable",)) == 1 and not saver.is_saver_memory(plain)
        with backend.disable():  # and the next one is a real one again
            pass
        assert saver.calls.count(("disable",)) == 2

    def test_a_region_inside_disable_can_be_disabled_again(self):
        backend, saver = tms_backend()
        with backend.region("weights"), backend.disable(), backend.region("kv_cache"), backend.disable():
            plain = saver.allocate(torch.ones(1))
        assert saver.calls.count(("disable",)) == 2 and not saver.is_saver_memory(plain)


class TestTorchMemorySaverBackendConfiguration:
    """Constructor checks run before TMS is configured or initialised."""

    def test_backend_variable_applies_to_regions_too(self) -> None:
        """TMS resolves region(enable_cpu_backup=True) without a backend from TMS_INIT_CPU_BACKUP_BACKEND."""
        assert validate_environment({"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}) == []
        backend, _ = tms_backend(environ={"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}, cpu_backup=True)
        assert "backend=mmap" in backend.describe()

    def test_hook_mode_is_set_before_first_use(self) -> None:
        backend, saver = tms_backend()
        assert saver._impl._hook_mode == "torch"
        assert backend.hook_mode == "torch"

    def test_bad_environment_leaves_tms_untouched(self) -> None:
        saver = FakeTorchMemorySaver()
        with pytest.raises(MemorySaverConfigError, match="TMS_INIT_ENABLE"):
            TorchMemorySaverBackend(tags=TAGS, environ={"TMS_INIT_ENABLE": ""}, saver=saver)
        assert saver._impl is None and saver._impl_ctor_kwargs == {}

    def test_tms_initialised_in_another_mode(self) -> None:
        saver = FakeTorchMemorySaver()
        saver._ensure_initialized()  # e.g. by SGLang, in its default preload mode
        with pytest.raises(
            MemorySaverConfigError, match=r"already initialised with hook_mode='preload'.*hook_mode=None"
        ):
            TorchMemorySaverBackend(tags=TAGS, environ={}, saver=saver, hook_mode="torch")

    def test_hook_mode_none_uses_the_configured_mode(self) -> None:
        saver = FakeTorchMemorySaver()
        saver.hook_mode = "torch"
        backend = TorchMemorySaverBackend(tags=TAGS, environ={}, saver=saver, hook_mode=None)
        assert backend.hook_mode == "torch"

    def test_auto_hook_mode_follows_the_launcher_environment(self) -> None:
        """slime's RayTrainGroup sets LD_PRELOAD and TMS_INIT_ENABLE=1 for offloaded trainers."""
        backend, saver = tms_backend(tags=None, environ=preload_env(TMS_INIT_ENABLE="1"), cuda_major=13)
        assert backend.hook_mode == "preload" and saver._impl_ctor_kwargs == {"hook_mode": "preload"}
        backend, _ = tms_backend(environ={})
        assert backend.hook_mode == "torch"

    def test_auto_hook_mode_keeps_a_configured_mode(self) -> None:
        saver = FakeTorchMemorySaver(preload_env())
        saver.hook_mode = "preload"
        backend = TorchMemorySaverBackend(tags=TAGS, environ=preload_env(), saver=saver, cuda_major=13)
        assert backend.hook_mode == "preload"

    def test_auto_hook_mode_overrides_an_import_time_torch_in_a_preloaded_process(self) -> None:
        """megatron.core's import sets hook_mode="torch"; with the preload library loaded that would pause nothing."""
        env = preload_env(TMS_INIT_ENABLE="1")
        saver = FakeTorchMemorySaver(env)
        saver.hook_mode = "torch"  # megatron/core/inference/contexts/dynamic_context.py, at import
        backend = TorchMemorySaverBackend(tags=None, environ=env, saver=saver, cuda_major=13)
        assert backend.hook_mode == "preload" and saver._impl_ctor_kwargs == {"hook_mode": "preload"}
        assert any("megatron-core does this" in note for note in backend.notes)

    def test_auto_hook_mode_cannot_change_an_initialised_torch_mode(self) -> None:
        env = preload_env(TMS_INIT_ENABLE="1")
        saver = FakeTorchMemorySaver(env)
        saver.hook_mode = "torch"
        saver._ensure_initialized()
        with pytest.raises(
            MemorySaverConfigError, match=r"already initialised with hook_mode='torch'.*release none"
        ):
            TorchMemorySaverBackend(tags=None, environ=env, saver=saver, cuda_major=13)

    @pytest.mark.parametrize(
        ("environ", "mode"),
        [({}, "torch"), ({"TMS_INIT_ENABLE": "1"}, "preload"), ({"TMS_INIT_ENABLE": "0"}, "torch")],
    )
    def test_hook_mode_from_environment(self, environ: dict[str, str], mode: str) -> None:
        assert hook_mode_from_environment(environ) == mode
        assert hook_mode_from_environment(preload_env()) == "preload"

    def test_hook_mode_none_defaults_to_tms_preload(self) -> None:
        with pytest.raises(MemorySaverConfigError, match="names no torch_memory_saver library"):
            tms_backend(hook_mode=None, cuda_major=13)

    def test_retain_cpu_backup_is_set_on_tms(self) -> None:
        backend, saver = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        assert saver._retain is True and backend.retain_cpu_backup
        backend.retain_cpu_backup = False
        assert saver._retain is False

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"cpu_backup": ["ref"]}, r"cpu_backup names unknown tags \['ref'\]"),
            ({"cpu_backup": "weights"}, r"write \['weights'\]"),
            ({"cpu_backup_backend": "pinned"}, r"needs cpu_backup on for at least one tag"),
            ({"cpu_backup": True, "cpu_backup_backend": "disk"}, r"one of \['pinned', 'mmap'\]"),
            ({"hook_mode": "cuda"}, r"hook_mode must be one of"),
            ({"retain_cpu_backup": 1}, r"retain_cpu_backup must be a bool"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, Any], message: str) -> None:
        with pytest.raises(MemorySaverConfigError, match=message):
            tms_backend(**kwargs)

    def test_tag_list_backup_needs_tags(self) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"tags=None pauses all memory as one unit"):
            tms_backend(tags=None, cpu_backup=["weights"])

    def test_init_enable_with_tags_leaves_default_tag_unpaused_note(self) -> None:
        backend, _ = tms_backend(environ=preload_env(TMS_INIT_ENABLE="1"), hook_mode="preload", cuda_major=13)
        assert any("TMS tag 'default', which this backend" in note for note in backend.notes)

    def test_no_unpaused_default_note_when_default_is_declared(self) -> None:
        """miles' tag layouts declare 'default' itself: the backend pauses it, so no note says otherwise."""
        backend, _ = tms_backend(
            tags=("grad_buffer", "default"),
            environ=preload_env(TMS_INIT_ENABLE="1"),
            hook_mode="preload",
            cuda_major=13,
        )
        assert not any("TMS tag 'default', which this backend" in note for note in backend.notes)

    def test_describe(self) -> None:
        backend, _ = tms_backend(cpu_backup=["weights"], retain_cpu_backup=True)
        text = backend.describe()
        assert (
            "hook_mode=torch" in text
            and "cpu_backup=['weights']" in text
            and "retain_cpu_backup=True" in text
        )

    @pytest.mark.skipif(torch.version.cuda is not None, reason="checks the refusal on a CPU build of torch")
    def test_real_tms_in_torch_mode_needs_a_cuda_torch(self) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"needs a CUDA build of torch.*NoopMemory"):
            TorchMemorySaverBackend(tags=TAGS, environ={})


class TestCpuBackupRefusals:
    """cpu_backup() refuses where TMS's get_cpu_backup would exit(1)."""

    def test_no_tag_has_backup(self) -> None:
        backend, _ = tms_backend()
        with pytest.raises(MemoryStateError, match=r"no tag of this backend has cpu_backup on"):
            backend.cpu_backup(torch.ones(1))

    def test_named_tag_without_backup(self) -> None:
        backend, _ = tms_backend(cpu_backup=["weights"])
        with pytest.raises(MemoryStateError, match=r"tag 'kv_cache' has no CPU backup"):
            backend.cpu_backup(torch.ones(1), tag="kv_cache")

    def test_ambiguous_while_a_tag_without_backup_is_paused(self) -> None:
        backend, _ = tms_backend(cpu_backup=["weights"])
        backend.pause("kv_cache")
        with pytest.raises(
            MemoryStateError, match=r"tags \['kv_cache'\] are paused without CPU backup.*pass tag="
        ):
            backend.cpu_backup(torch.ones(1))

    def test_needs_a_cuda_tensor(self) -> None:
        backend, _ = tms_backend(cpu_backup=True)
        with pytest.raises(ValueError, match=r"needs a CUDA tensor allocated in region\(\); got one on cpu"):
            backend.cpu_backup(torch.ones(1), tag="weights")


GIB = 2**30


@pytest.fixture
def host_ram(monkeypatch: pytest.MonkeyPatch) -> Any:
    """psutil's available host memory, set by the test (in GiB)."""
    import psutil

    figures = SimpleNamespace(available_gib=64.0)
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: SimpleNamespace(available=int(figures.available_gib * GIB))
    )
    return figures


class TestPrepareCpuBackup:
    """The retained pinned backup allocated at configuration (one pause + resume), host RAM checked first."""

    def test_one_pause_and_resume_of_each_backed_up_tag_contents_intact(self, host_ram: Any) -> None:
        backend, saver = tms_backend(cpu_backup=["weights"], retain_cpu_backup=True)
        with backend.region("weights"):
            weights = saver.allocate(torch.arange(8.0))
        figures = backend.prepare_cpu_backup(nbytes=GIB)
        assert [c for c in saver.calls if c[0] in ("pause", "resume")] == [
            ("pause", "weights"),
            ("resume", "weights"),
        ]
        assert not backend.is_paused() and torch.equal(weights, torch.arange(8.0))
        assert saver.allocations[0].backup is not None  # retained: the first sleep allocates nothing
        assert figures["backup_bytes"] == GIB and figures["needed_bytes"] == GIB and figures["seconds"] >= 0

    def test_refused_without_retain_because_nothing_would_survive(self, host_ram: Any) -> None:
        backend, saver = tms_backend(cpu_backup=True)
        with pytest.raises(MemorySaverConfigError, match=r"needs retain_cpu_backup=True.*every pause"):
            backend.prepare_cpu_backup(nbytes=GIB)
        assert saver.calls == []

    def test_refused_without_backup_or_while_paused(self, host_ram: Any) -> None:
        backend, _ = tms_backend(retain_cpu_backup=True)
        with pytest.raises(MemorySaverConfigError, match="no tag has cpu_backup on"):
            backend.prepare_cpu_backup(nbytes=GIB)
        backend, _ = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        backend.pause("weights")
        with pytest.raises(
            MemoryStateError, match=r"tags \['weights'\] are paused.*while the tags are resident"
        ):
            backend.prepare_cpu_backup(nbytes=GIB)

    def test_region_bytes_unknown_asks_for_nbytes(self, host_ram: Any) -> None:
        backend, _ = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        with pytest.raises(MemorySaverConfigError, match=r"pools cannot be read.*pass nbytes="):
            backend.prepare_cpu_backup()

    def test_region_bytes_are_read_from_the_backed_up_pools(self) -> None:
        backend, saver = tms_backend(cpu_backup=["weights"], retain_cpu_backup=True)
        pool = SimpleNamespace(snapshot=lambda: [{"total_size": 3 * GIB}, {"total_size": GIB}])
        other = SimpleNamespace(snapshot=lambda: [{"total_size": 100 * GIB}])
        saver._impl._mem_pools = {
            ("weights", True, False, "pinned", 0): pool,
            ("kv_cache", False, False, "", 0): other,
        }
        assert backend.backup_bytes() == 4 * GIB


class TestHostMemoryCheck:
    """Every rank on the node backs up its GPU state in host RAM: refused or warned with the numbers."""

    def test_more_than_available_is_refused_with_the_numbers_and_what_to_do(self, host_ram: Any) -> None:
        backend, saver = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        host_ram.available_gib = 60.0
        with pytest.raises(
            MemorySaverConfigError,
            match=r"needs 71\.2 GiB of host RAM on this node \(8\.90 GiB per rank x 8 ranks\) and 60\.0 GiB are "
            r"available.*vime #190.*ranks_per_node=",
        ):
            backend.prepare_cpu_backup(nbytes=int(8.9 * GIB), ranks_per_node=8)
        assert saver.calls == []  # refused before any pause allocated host memory

    def test_close_to_available_warns(self, host_ram: Any) -> None:
        backend, _ = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        host_ram.available_gib = 10.0
        with pytest.warns(ResourceWarning, match=r"needs 8\.9 GiB.*little is left"):
            figures = backend.check_host_memory(nbytes=int(8.9 * GIB))
        assert figures["available_bytes"] == 10 * GIB and "little is left" in backend.notes[-1]

    def test_ranks_per_node_defaults_to_local_world_size(self, host_ram: Any) -> None:
        backend, _ = tms_backend(environ={"LOCAL_WORLD_SIZE": "4"}, cpu_backup=True, retain_cpu_backup=True)
        assert backend.check_host_memory(nbytes=GIB)["needed_bytes"] == 4 * GIB
        with pytest.raises(MemorySaverConfigError, match="ranks_per_node must be a positive int"):
            backend.check_host_memory(nbytes=GIB, ranks_per_node=0)

    def test_a_backup_already_held_is_not_counted_twice(self, host_ram: Any) -> None:
        backend, _ = tms_backend(cpu_backup=True, retain_cpu_backup=True)
        backend.prepare_cpu_backup(nbytes=GIB, ranks_per_node=2)
        assert backend.check_host_memory(nbytes=GIB, ranks_per_node=2)["needed_bytes"] == GIB


class TestSelectMemoryBackend:
    def test_auto_without_cuda_is_noop_and_says_why(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        backend = select_memory_backend(tags=TAGS, cpu_backup=True)
        assert isinstance(backend, NoopMemory)
        assert "torch.cuda.is_available() is False" in backend.describe()

    def test_auto_with_cuda_is_tms(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        backend = select_memory_backend(tags=TAGS, saver=FakeTorchMemorySaver(), environ={})
        assert isinstance(backend, TorchMemorySaverBackend)

    def test_tms_without_cuda_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(
            MemorySaverConfigError, match=r"kind='tms' but torch.cuda.is_available\(\) is False"
        ):
            select_memory_backend("tms", tags=TAGS)

    def test_noop(self) -> None:
        assert isinstance(select_memory_backend("noop", tags=None), NoopMemory)

    def test_unknown_kind_lists_kinds(self) -> None:
        with pytest.raises(
            ValueError, match=r"unknown memory backend kind 'gpu'; kinds are \['auto', 'tms', 'noop'\]"
        ):
            select_memory_backend("gpu", tags=TAGS)

    def test_unknown_option(self) -> None:
        with pytest.raises(TypeError, match=r"unknown options \['cpu_backups'\]"):
            select_memory_backend("noop", tags=TAGS, cpu_backups=True)


# ---------------------------------------------------------------------------------------------- with a real Lifecycle


class TestLifecycleDrivesNoopMemory:
    """A real Lifecycle drives the backend through repeated sleeps and wakes without a refusal."""

    def make(self, tags: tuple[str, ...] | None) -> Any:
        return NoopMemory(tags=tags)

    @pytest.mark.parametrize("tags", [TAGS, None])
    def test_sleep_sleep_wake_wake(self, tags: tuple[str, ...] | None) -> None:
        memory = self.make(tags)
        lifecycle = Lifecycle(LifecyclePolicy(memory_tags=tags, model_tag=None), Hooks(memory=memory))
        lifecycle.sleep()
        lifecycle.sleep()
        assert lifecycle.state is State.PAUSED and memory.is_paused()
        lifecycle.wake_up()
        lifecycle.wake_up()
        assert lifecycle.state is State.AWAKE and not memory.is_paused()

    def test_partial_wake_then_sync_then_sleep(self) -> None:
        memory = self.make(TAGS)
        policy = LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",), model_tag=None)
        lifecycle = Lifecycle(policy, Hooks(memory=memory), initial=State.AWAKE)
        lifecycle.sleep()
        lifecycle.wake_up(tags=["weights"])
        assert memory.is_paused("kv_cache") and not memory.is_paused("weights")
        assert lifecycle.run("sync", lambda: "synced") == "synced"
        lifecycle.sleep()
        assert memory.is_paused("weights") and memory.is_paused("kv_cache")
        lifecycle.wake_up()
        assert not memory.is_paused()

    def test_recover_asks_the_backend(self) -> None:
        """A pause that raised leaves the tag unknown; recover resolves it with is_paused()."""
        memory = self.make(TAGS)
        original = memory.pause
        calls = {"n": 0}

        def flaky(tag: str | None = None) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise InjectedFault("pause of kv_cache failed before any effect")
            original(tag)

        memory.pause = flaky
        lifecycle = Lifecycle(LifecyclePolicy(memory_tags=TAGS, model_tag=None), Hooks(memory=memory))
        with pytest.raises(InjectedFault):
            lifecycle.sleep()
        assert lifecycle.state is State.FAILED
        assert lifecycle.residency == {"weights": Residency.RELEASED, "kv_cache": Residency.UNKNOWN}
        lifecycle.recover(State.PAUSED)
        assert lifecycle.residency == {"weights": Residency.RELEASED, "kv_cache": Residency.RELEASED}
        assert memory.is_paused("weights") and memory.is_paused("kv_cache")


class TestLifecycleDrivesTorchMemorySaverBackend(TestLifecycleDrivesNoopMemory):
    def make(self, tags: tuple[str, ...] | None) -> Any:
        backend, saver = tms_backend(tags, cpu_backup=True)
        self.saver = saver
        for tag in tags or (None,):
            with backend.region(tag):
                saver.allocate(torch.arange(3.0))
        return backend

    def test_contents_survive_and_the_sync_body_runs_outside_tms(self) -> None:
        backend = self.make(TAGS)
        policy = LifecyclePolicy(memory_tags=TAGS, sync_requires=("weights",), model_tag=None)
        lifecycle = Lifecycle(policy, Hooks(memory=backend))
        lifecycle.sleep()
        lifecycle.sleep()
        assert all(torch.equal(a.tensor, torch.full((3,), -7.0)) for a in self.saver.allocations)
        lifecycle.wake_up(tags=["weights"])
        received = lifecycle.run("sync", lambda: self.saver.allocate(torch.ones(3)))
        assert not self.saver.is_saver_memory(received)
        lifecycle.wake_up()
        lifecycle.wake_up()
        assert all(torch.equal(a.tensor, torch.arange(3.0)) for a in self.saver.allocations)


# ---------------------------------------------------------------------------------------------- the real TMS library

STUB_DRIVER = r"""
#include <stddef.h>
typedef unsigned long long u64;
static u64 next_va = 0x7f0000000000ULL, next_handle = 1;
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuCtxGetDevice(int *d) { *d = 0; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) { *v = 0; return 0; }
int cuGetErrorString(int e, const char **s) { *s = "stub driver"; return 0; }
int cuMemGetAllocationGranularity(size_t *g, const void *p, int o) { *g = 2u << 20; return 0; }
int cuMemCreate(u64 *h, size_t n, const void *p, u64 f) { *h = next_handle++; return 0; }
int cuMemAddressReserve(u64 *va, size_t n, size_t a, u64 addr, u64 f) { *va = next_va; next_va += n; return 0; }
int cuMemAddressFree(u64 va, size_t n) { return 0; }
int cuMemMap(u64 va, size_t n, size_t off, u64 h, u64 f) { return 0; }
int cuMemSetAccess(u64 va, size_t n, const void *d, size_t c) { return 0; }
int cuMemUnmap(u64 va, size_t n) { return 0; }
int cuMemRelease(u64 h) { return 0; }
"""


@pytest.fixture(scope="module")
def real_tms(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """TMS's own C++ libraries, loadable on a CPU machine over a stub CUDA driver (libcuda.so.1).

    The stub maps no memory: it lets TMS's bookkeeping run, which is where its exit(1) calls live.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub CUDA driver")
    site = Path(preload_library(13)).parent
    for major in (13, 12):
        with contextlib.suppress(OSError):
            ctypes.CDLL(f"libcudart.so.{major}")
            break
    else:
        pytest.skip("no libcudart.so.13 or .12 on this machine; TMS's libraries cannot load")
    directory = tmp_path_factory.mktemp("stub_cuda_driver")
    (directory / "stub.c").write_text(STUB_DRIVER)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(directory / "stub.c")],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k != "LD_PRELOAD"}
    env["LD_LIBRARY_PATH"] = f"{directory}:{env.get('LD_LIBRARY_PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    return SimpleNamespace(
        major=major,
        env=env,
        torch_library=str(site / f"torch_memory_saver_hook_mode_torch_cu{major}.abi3.so"),
        preload_library=preload_library(major),
    )


def run_python(code: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


class TestRealTorchMemorySaver:
    """The real TMS library exits the process where the adapter raises; the environment check matches it."""

    def test_second_pause_of_a_tag_kills_the_process(self, real_tms: SimpleNamespace) -> None:
        result = run_python(
            f"""
            import ctypes
            lib = ctypes.CDLL({real_tms.torch_library!r})
            lib.tms_torch_malloc.restype = ctypes.c_void_p
            lib.tms_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            lib.tms_set_current_tag(b"weights")
            lib.tms_set_interesting_region(True)
            lib.tms_torch_malloc(1 << 20, 0, None)
            lib.tms_pause(b"weights")
            print("first pause returned", flush=True)
            lib.tms_pause(b"weights")
            print("second pause returned", flush=True)
            """,
            real_tms.env,
        )
        assert result.returncode == 1
        assert "Cannot pause allocation that is not active" in result.stderr
        assert "first pause returned" in result.stdout
        assert "second pause returned" not in result.stdout
        assert "Traceback" not in result.stderr  # no Python exception: nothing a Ray actor could catch

    def test_adapter_over_the_real_singleton_refuses_and_survives(self, real_tms: SimpleNamespace) -> None:
        """Preload mode, TMS_INIT_ENABLE=1: the same double pause through the adapter raises and the process lives."""
        env = {**real_tms.env, "LD_PRELOAD": real_tms.preload_library, "TMS_INIT_ENABLE": "1"}
        result = run_python(
            f"""
            import ctypes
            from actor_integration.backends.memory_saver import MemoryStateError, TorchMemorySaverBackend
            from lifecycle import Hooks, Lifecycle, LifecyclePolicy
            from torch_memory_saver import torch_memory_saver

            pointer = ctypes.c_void_p()
            # cudaMalloc as torch would call it: interposed by the preloaded TMS library.
            assert ctypes.CDLL({real_tms.preload_library!r}).cudaMalloc(ctypes.byref(pointer), 1 << 20) == 0
            backend = TorchMemorySaverBackend(tags=None, hook_mode="preload", cuda_major={real_tms.major})
            lifecycle = Lifecycle(LifecyclePolicy(model_tag=None), Hooks(memory=backend))
            lifecycle.sleep(); lifecycle.sleep(); lifecycle.wake_up(); lifecycle.wake_up()
            backend.pause()
            try:
                backend.pause()
            except MemoryStateError as exc:
                print("refused:", exc, flush=True)
            backend.resume()
            print("alive after refusal", flush=True)
            torch_memory_saver.pause()
            torch_memory_saver.pause()
            print("raw second pause returned", flush=True)
            """,
            env,
        )
        assert (
            "refused: TorchMemorySaverBackend: cannot pause all memory: it is already paused" in result.stdout
        )
        assert "alive after refusal" in result.stdout, result.stderr
        assert result.returncode == 1
        assert "Cannot pause allocation that is not active" in result.stderr
        assert "raw second pause returned" not in result.stdout

    # (variable, value, does TMS exit?) — read by the getters below, as TMS reads them on first use.
    CASES: ClassVar[list[tuple[str, str, bool]]] = [
        ("TMS_INIT_ENABLE", "", True),
        ("TMS_INIT_ENABLE", "True", True),
        ("TMS_INIT_ENABLE", "on", True),
        ("TMS_INIT_ENABLE", "YES", False),
        ("TMS_INIT_ENABLE_CPU_BACKUP", "2", True),
        ("TMS_INIT_ENABLE_CPU_BACKUP", "no", False),
        ("TMS_INIT_ENABLE_DISK_BACKUP", "", True),
        ("TMS_RETAIN_CPU_BACKUP", "Yes", True),
        ("TMS_RETAIN_CPU_BACKUP", "TRUE", False),
        ("TMS_INIT_CPU_BACKUP_BACKEND", "Pinned", True),
        ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap", False),
    ]

    @pytest.mark.parametrize(("name", "value", "exits"), CASES)
    def test_environment_check_matches_the_library(
        self, real_tms: SimpleNamespace, name: str, value: str, exits: bool
    ) -> None:
        result = run_python(
            f"""
            import ctypes
            lib = ctypes.CDLL({real_tms.torch_library!r})
            lib.tms_get_cpu_backup_backend.restype = ctypes.c_char_p
            lib.tms_get_interesting_region(); lib.tms_get_enable_cpu_backup(); lib.tms_get_enable_disk_backup()
            lib.tms_get_cpu_backup_backend(); lib.tms_get_retain_cpu_backup()
            print("survived", flush=True)
            """,
            {**real_tms.env, name: value},
        )
        assert (result.returncode == 1) is exits, result.stderr
        assert ("survived" in result.stdout) is not exits
        if exits:
            assert "[torch_memory_saver.cpp]" in result.stderr
        raised = False
        try:
            environ = {"LD_PRELOAD": real_tms.preload_library, name: value}
            validate_environment(environ, hook_mode="preload", cuda_major=real_tms.major)
        except MemorySaverConfigError:
            raised = True
        assert raised is exits

    def test_empty_backend_variable_is_refused_though_tms_survives_it(
        self, real_tms: SimpleNamespace
    ) -> None:
        """Stricter than TMS on purpose: an empty value is a templating slip, and TMS silently uses 'pinned'."""
        result = run_python(
            f"""
            import ctypes
            lib = ctypes.CDLL({real_tms.torch_library!r})
            lib.tms_get_cpu_backup_backend.restype = ctypes.c_char_p
            print(lib.tms_get_cpu_backup_backend().decode())
            """,
            {**real_tms.env, "TMS_INIT_CPU_BACKUP_BACKEND": ""},
        )
        assert result.returncode == 0 and result.stdout.strip() == "pinned"
        with pytest.raises(MemorySaverConfigError, match="TMS_INIT_CPU_BACKUP_BACKEND is empty"):
            validate_environment({"TMS_INIT_CPU_BACKUP_BACKEND": ""})

"""What the installed torch_memory_saver supports, and a missing retained backup as a logged decision.

slime's image pins its own fork (zhuzilin/torch_memory_saver at the Dockerfile's TMS_COMMIT), which
has no `retain_cpu_backup`: `ForkMemorySaver` has that fork's Python API.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from actor_integration.backends.memory_saver import TorchMemorySaverBackend
from actor_integration.backends.tms_capabilities import CAPABILITIES, saver_capabilities
from actor_integration.errors import MemorySaverConfigError
from actor_integration.frameworks.slime import slime_memory_backend
from actor_integration.tools.doctor import check_cpu_backup_retention, check_saver_capabilities
from lifecycle import Hooks, Lifecycle, LifecyclePolicy, capture_events
from lifecycle.testing import FakeMemorySaver
from tests.helpers.tms import ForkMemorySaver, preload_env

LAUNCHER = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}


class TestReading:
    def test_the_installed_upstream_saver_supports_every_capability(self) -> None:
        """torch-memory-saver 0.0.10 (the dev environment's) has all of them, its library exports agreeing."""
        library = preload_env()["LD_PRELOAD"]
        capabilities = saver_capabilities(library=library)
        assert capabilities.missing == ()
        assert capabilities.source.startswith("torch_memory_saver 0.")
        assert capabilities.supports("retain_cpu_backup")

    def test_the_fork_lacks_retain_and_the_backup_backend(self) -> None:
        capabilities = saver_capabilities(ForkMemorySaver())
        assert capabilities.missing == ("retain_cpu_backup", "cpu_backup_backend")
        assert capabilities.supports("disk_backup")
        assert (
            "no retain_cpu_backup (ForkMemorySaver has no retain_cpu_backup property)"
            in capabilities.describe()
        )

    def test_a_library_that_does_not_export_the_symbol_does_not_support_it(self, tmp_path: Path) -> None:
        """The Python class may have the property while the loaded library is older: the library decides."""
        library = tmp_path / "torch_memory_saver_hook_mode_preload_cu13.abi3.so"
        library.write_bytes(b"\x7fELF tms_set_enable_disk_backup tms_get_cpu_backup_pointer")
        capabilities = saver_capabilities(FakeMemorySaver(), library=library)
        assert not capabilities.supports("retain_cpu_backup")
        assert (
            capabilities.why_not["retain_cpu_backup"]
            == f"{library.name} does not export tms_set_retain_cpu_backup"
        )

    def test_an_unknown_capability_is_refused(self) -> None:
        with pytest.raises(ValueError, match="unknown torch_memory_saver capability 'retain'"):
            saver_capabilities(FakeMemorySaver()).supports("retain")

    def test_the_capabilities_are_named_in_the_configured_event(self) -> None:
        memory = TorchMemorySaverBackend(tags=None, environ={}, saver=FakeMemorySaver(), hook_mode="torch")
        with capture_events() as events:
            Lifecycle(LifecyclePolicy(), Hooks(memory=memory))
        (configured,) = [e for e in events if e["event"] == "lifecycle.configured"]
        assert configured["memory_capabilities"]["supported"][:3] == list(CAPABILITIES)[:3]


class TestARetainTheSaverCannotDo:
    def test_is_off_noted_with_its_cost_and_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        saver = ForkMemorySaver()
        with caplog.at_level(logging.WARNING, logger="actor_integration.backends.memory_saver"):
            memory = TorchMemorySaverBackend(
                tags=None, cpu_backup=True, retain_cpu_backup=True, environ={}, saver=saver, hook_mode="torch"
            )
        assert memory.retain_cpu_backup is False
        assert "retain_cpu_backup" not in vars(saver)  # nothing assigned that the fork would silently ignore
        (decision,) = [n for n in memory.notes if "retain_cpu_backup was asked for" in n]
        assert "5.75 s" in decision and "0.39 s" in decision
        assert decision in caplog.text
        assert "retain_cpu_backup=False (asked for; this torch_memory_saver cannot)" in memory.describe()
        with capture_events() as events:
            Lifecycle(LifecyclePolicy(), Hooks(memory=memory))
        (configured,) = [e for e in events if e["event"] == "lifecycle.configured"]
        assert decision in configured["memory_notes"]
        assert "retain_cpu_backup" in configured["memory_capabilities"]["missing"]

    def test_setting_it_later_is_refused(self) -> None:
        memory = TorchMemorySaverBackend(tags=None, environ={}, saver=ForkMemorySaver(), hook_mode="torch")
        memory.retain_cpu_backup = False  # asking for nothing is fine
        with pytest.raises(MemorySaverConfigError, match="has no retain_cpu_backup property"):
            memory.retain_cpu_backup = True

    def test_a_backup_backend_it_cannot_take_is_refused(self) -> None:
        with pytest.raises(MemorySaverConfigError, match="no cpu_backup_backend argument to region"):
            TorchMemorySaverBackend(
                tags=["weights"],
                cpu_backup=True,
                cpu_backup_backend="mmap",
                environ={},
                saver=ForkMemorySaver(),
                hook_mode="torch",
            )

    def test_slimes_adapter_does_not_claim_a_retained_backup(self) -> None:
        """slime's own image, slime's launcher environment: the adapter's default asks, the fork cannot."""
        memory = slime_memory_backend(environ=preload_env(**LAUNCHER), saver=ForkMemorySaver(), cuda_major=13)
        assert memory.retain_cpu_backup is False
        assert not any("the adapter's default): the pinned backup is allocated" in n for n in memory.notes)
        assert any("cannot retain the CPU backup" in n for n in memory.notes)

    def test_on_upstream_the_same_call_retains(self) -> None:
        memory = slime_memory_backend(environ=preload_env(**LAUNCHER), saver=FakeMemorySaver(), cuda_major=13)
        assert memory.retain_cpu_backup is True


class TestDoctor:
    def test_names_the_capabilities_and_warns_without_retain(self) -> None:
        fork = check_saver_capabilities({}, ForkMemorySaver())
        assert fork.verdict == "warn" and "no retain_cpu_backup" in fork.detail and "5.75 s" in fork.detail
        upstream = check_saver_capabilities({}, FakeMemorySaver())
        assert upstream.verdict == "ok" and "retain_cpu_backup" in upstream.detail

    def test_the_backup_check_says_it_is_not_retained_when_the_saver_cannot(self) -> None:
        check = check_cpu_backup_retention(LAUNCHER, can_retain=False)
        assert check.verdict == "warn" and check.detail.startswith("not retained")
        assert check_cpu_backup_retention(LAUNCHER, can_retain=True).verdict == "ok"

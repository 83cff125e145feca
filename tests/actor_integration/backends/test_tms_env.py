"""`validate_environment`: every environment torch_memory_saver would exit(1) on is refused first."""

from __future__ import annotations

from pathlib import Path

import pytest

from actor_integration.backends.tms_env import TMS_ENV_VARS, preload_library, validate_environment
from actor_integration.errors import MemorySaverConfigError


class TestValidateEnvironmentRefuses:
    """Every environment TMS would exit(1) on (or silently misread) raises, naming the variable and the fix."""

    @pytest.mark.parametrize(
        ("name", "conf"),
        [
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True"),
            ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
        ],
    )
    def test_expandable_segments(self, name: str, conf: str) -> None:
        with pytest.raises(MemorySaverConfigError, match=rf"{name}=.*expandable_segments:False"):
            validate_environment({name: conf})

    @pytest.mark.parametrize(
        "name", [n for n in TMS_ENV_VARS if n.startswith(("TMS_INIT_ENABLE", "TMS_RETAIN"))]
    )
    @pytest.mark.parametrize("value", ["", "True", "on", "2", " 1"])
    def test_boolean_variables_accept_only_tms_spellings(self, name: str, value: str) -> None:
        with pytest.raises(MemorySaverConfigError) as info:
            validate_environment({name: value}, hook_mode="preload", cuda_major=13)
        assert name in str(info.value)
        assert "1/true/TRUE/yes/YES or 0/false/FALSE/no/NO" in str(info.value)

    @pytest.mark.parametrize("value", ["", "Pinned", "cpu", "mmap "])
    def test_cpu_backup_backend_value(self, value: str) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"TMS_INIT_CPU_BACKUP_BACKEND .*'pinned' or 'mmap'"):
            validate_environment({"TMS_INIT_CPU_BACKUP_BACKEND": value})

    @pytest.mark.parametrize("value", ["", "abc", "-5", "0", "12abc", str(2**60)])
    def test_disk_chunk_size(self, value: str) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"TMS_DISK_BACKUP_CHUNK_MB.*256"):
            validate_environment({"TMS_DISK_BACKUP_CHUNK_MB": value})

    def test_disk_dir_empty_or_a_file(self, tmp_path: Path) -> None:
        with pytest.raises(
            MemorySaverConfigError, match=r"TMS_DISK_BACKUP_DIR is empty.*Set it to a directory"
        ):
            validate_environment({"TMS_DISK_BACKUP_DIR": ""})
        a_file = tmp_path / "file"
        a_file.write_text("x")
        with pytest.raises(MemorySaverConfigError, match=r"TMS_DISK_BACKUP_DIR=.*not a directory"):
            validate_environment({"TMS_DISK_BACKUP_DIR": str(a_file)})

    def test_cpu_and_disk_backup_both_on(self) -> None:
        env = {"TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_INIT_ENABLE_DISK_BACKUP": "true"}
        with pytest.raises(MemorySaverConfigError, match=r"mutually exclusive.*Turn one off"):
            validate_environment(env)

    def test_init_enable_in_torch_mode(self) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"TMS_INIT_ENABLE is on but hook_mode is 'torch'"):
            validate_environment({"TMS_INIT_ENABLE": "1"}, hook_mode="torch")

    def test_every_problem_is_listed_at_once(self) -> None:
        env = {"TMS_INIT_ENABLE": "", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        with pytest.raises(MemorySaverConfigError) as info:
            validate_environment(env, hook_mode="preload", cuda_major=13)
        message = str(info.value)
        assert "TMS_INIT_ENABLE is empty" in message
        assert "PYTORCH_CUDA_ALLOC_CONF" in message
        assert "names no torch_memory_saver library" in message

    def test_unknown_hook_mode(self) -> None:
        with pytest.raises(MemorySaverConfigError, match=r"hook_mode must be one of \['torch', 'preload'\]"):
            validate_environment({}, hook_mode="cuda")


class TestValidateEnvironmentPreload:
    """Preload mode: LD_PRELOAD holds exactly the preload library TMS itself resolves for torch's CUDA major."""

    def test_no_library(self) -> None:
        with pytest.raises(
            MemorySaverConfigError, match=r"names no torch_memory_saver library; set LD_PRELOAD="
        ):
            validate_environment(
                {"LD_PRELOAD": "/usr/lib/libjemalloc.so"}, hook_mode="preload", cuda_major=13
            )
        with pytest.raises(MemorySaverConfigError, match="names no torch_memory_saver library"):
            validate_environment({}, hook_mode="preload", cuda_major=13)

    def test_library_for_the_other_cuda_major(self) -> None:
        """slime #2186: a _cu12 library under a cu13 torch hooks nothing."""
        wrong, right = preload_library(12), preload_library(13)
        with pytest.raises(MemorySaverConfigError) as info:
            validate_environment({"LD_PRELOAD": wrong}, hook_mode="preload", cuda_major=13)
        assert f"LD_PRELOAD names {wrong}, but this torch needs {right}" in str(info.value)

    def test_unsuffixed_or_torch_mode_library(self) -> None:
        right = Path(preload_library(13))
        for name in (
            "torch_memory_saver_hook_mode_preload.abi3.so",
            "torch_memory_saver_hook_mode_torch_cu13.abi3.so",
        ):
            wrong = right.parent / name
            assert wrong.is_file()
            with pytest.raises(MemorySaverConfigError, match=rf"this torch needs {right}"):
                validate_environment({"LD_PRELOAD": str(wrong)}, hook_mode="preload", cuda_major=13)

    def test_two_libraries(self) -> None:
        env = {"LD_PRELOAD": f"{preload_library(13)}:{preload_library(12)}"}
        with pytest.raises(MemorySaverConfigError, match=r"names 2 torch_memory_saver libraries.*Keep only"):
            validate_environment(env, hook_mode="preload", cuda_major=13)

    def test_space_separated_entries(self) -> None:
        env = {"LD_PRELOAD": f"/usr/lib/libjemalloc.so {preload_library(13)}"}
        with pytest.raises(MemorySaverConfigError, match=r"splits LD_PRELOAD on ':' only"):
            validate_environment(env, hook_mode="preload", cuda_major=13)

    def test_missing_file(self, tmp_path: Path) -> None:
        env = {"LD_PRELOAD": str(tmp_path / "torch_memory_saver_hook_mode_preload_cu13.abi3.so")}
        with pytest.raises(MemorySaverConfigError, match=r"does not exist"):
            validate_environment(env, hook_mode="preload", cuda_major=13)

    def test_cpu_only_torch_is_reported_not_a_traceback(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torch_memory_saver import utils

        def no_cuda() -> int:
            raise RuntimeError("torch_memory_saver: could not detect CUDA runtime.")

        monkeypatch.setattr(utils, "_detect_cuda_major", no_cuda)
        monkeypatch.setattr(utils, "_is_rocm_torch", lambda: False)
        monkeypatch.setattr(utils, "is_xpu", lambda: False)
        with pytest.raises(MemorySaverConfigError, match=r"Preload mode needs a CUDA build of torch"):
            validate_environment({"LD_PRELOAD": "x"}, hook_mode="preload")

    def test_good_preload_environment_passes(self) -> None:
        env = {
            "LD_PRELOAD": f"/usr/lib/libjemalloc.so:{preload_library(13)}",
            "TMS_INIT_ENABLE": "1",
            "TMS_INIT_ENABLE_CPU_BACKUP": "YES",
            "TMS_INIT_CPU_BACKUP_BACKEND": "pinned",
            "TMS_RETAIN_CPU_BACKUP": "false",
            "TMS_DISK_BACKUP_CHUNK_MB": "64",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
        }
        assert validate_environment(env, hook_mode="preload", cuda_major=13) == []


class TestValidateEnvironmentNotes:
    """What does not kill TMS but has no effect comes back as notes."""

    def test_clean_environment(self) -> None:
        assert validate_environment({"PATH": "/usr/bin"}) == []

    def test_misspelled_variable(self) -> None:
        notes = validate_environment({"TMS_RETAIN_CPU_BACKUPS": "1"})
        assert notes == [
            "TMS_RETAIN_CPU_BACKUPS is not read by torch_memory_saver and has no effect; did you mean TMS_RETAIN_CPU_BACKUP?"
        ]

    def test_init_options_without_init_enable(self) -> None:
        notes = validate_environment({"TMS_INIT_ENABLE_CPU_BACKUP": "1"})
        assert len(notes) == 1 and "TMS_INIT_ENABLE_CPU_BACKUP only applies" in notes[0]

    def test_preload_library_in_torch_mode(self) -> None:
        notes = validate_environment({"LD_PRELOAD": preload_library(13)}, hook_mode="torch")
        assert len(notes) == 1 and "hook_mode is 'torch'" in notes[0]


# ---------------------------------------------------------------------------------------------- bookkeeping

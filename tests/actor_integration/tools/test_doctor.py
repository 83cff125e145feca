"""`lifecycle doctor`'s hazard checks on CPU: CUDA graphs with NCCL buffer registration over
torch_memory_saver memory (FIELD.md #13), expandable_segments with CUDA IPC (FIELD.md #14), and
the loaded NCCL with the way sleep should treat its communicators."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from actor_integration.backends.process_groups import _nccl
from actor_integration.tools import cli, doctor
from actor_integration.tools.doctor import (
    check_communicators,
    check_cuda_graph_registration,
    check_ipc_allocator,
    check_nccl,
)
from tests.helpers.nccl_lib import nccl_library

REPO = Path(__file__).resolve().parents[3]


class TestCudaGraphRegistration:
    def test_declared_graphs_with_registration_explicitly_on_fail_with_the_fix(self):
        """NCCL_GRAPH_REGISTER=1 with CUDA graphs: fail, naming the hang and NCCL_GRAPH_REGISTER=0."""
        check = check_cuda_graph_registration({"NCCL_GRAPH_REGISTER": "1"}, cuda_graphs=True)
        assert check.verdict == "fail"
        assert "replay hangs" in check.detail and "export NCCL_GRAPH_REGISTER=0" in check.detail

    def test_declared_graphs_with_registration_left_at_nccls_default_warn(self):
        """Unset means NCCL's default (on): a warning with the fix, since SGLang covers only its own graphs."""
        check = check_cuda_graph_registration({}, cuda_graphs=True)
        assert check.verdict == "warn" and "export NCCL_GRAPH_REGISTER=0" in check.detail

    def test_registration_off_is_ok_whatever_is_captured(self):
        """NCCL_GRAPH_REGISTER=0 is the workaround: ok."""
        for graphs in (True, False, None):
            assert check_cuda_graph_registration({"NCCL_GRAPH_REGISTER": "0"}, graphs).verdict == "ok"

    def test_no_graphs_skips(self):
        """--no-cuda-graphs: nothing captured, nothing to go stale."""
        assert (
            check_cuda_graph_registration({"NCCL_GRAPH_REGISTER": "1"}, cuda_graphs=False).verdict == "skip"
        )

    def test_when_not_told_an_explicit_registration_warns_and_an_unset_one_asks(self):
        """Without --cuda-graphs: an explicit non-zero value warns (SGLang captures by default);
        an unset one is skipped with the flag to pass."""
        assert check_cuda_graph_registration({"NCCL_GRAPH_REGISTER": "1"}, None).verdict == "warn"
        unset = check_cuda_graph_registration({}, None)
        assert unset.verdict == "skip" and "--cuda-graphs" in unset.detail

    def test_without_torch_memory_saver_nothing_is_swapped(self, monkeypatch):
        """No torch_memory_saver: no physical pages change under the graphs."""
        monkeypatch.setattr(doctor, "_version", lambda dist: None)
        assert check_cuda_graph_registration({"NCCL_GRAPH_REGISTER": "1"}, True).verdict == "skip"


class TestIpcAllocator:
    @pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
    def test_expandable_segments_with_cuda_ipc_fails_with_the_fix(self, name):
        """expandable_segments:True in either variable with cuda_ipc: pidfd_getfd, and what to do."""
        check = check_ipc_allocator({name: "max_split_size_mb:64,expandable_segments:True"}, "cuda_ipc")
        assert check.verdict == "fail" and name in check.detail
        assert "pidfd_getfd: Operation not permitted" in check.detail
        assert "expandable_segments:False" in check.detail and "--transport shm" in check.detail

    def test_without_expandable_segments_cuda_ipc_is_ok(self):
        """expandable_segments off (or False): ok."""
        assert (
            check_ipc_allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "cuda_ipc").verdict
            == "ok"
        )
        assert check_ipc_allocator({}, "cuda_ipc").verdict == "ok"

    def test_other_transports_export_no_handles(self):
        """shm, disk and nccl export no CUDA IPC handles: skipped."""
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        assert {check_ipc_allocator(env, t).verdict for t in ("shm", "disk", "nccl")} == {"skip"}


class TestDoctorCommand:
    def run(self, capsys, *args):
        code = cli.main(["doctor", "--json", *args])
        return code, json.loads(capsys.readouterr().out)

    def verdicts(self, report):
        return {c["name"]: c["verdict"] for c in report["checks"]}

    def test_the_flags_reach_the_checks_and_a_failure_fails_the_command(self, capsys, monkeypatch):
        """--cuda-graphs and --transport cuda_ipc with both hazards present: exit 1, both flagged."""
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        code, report = self.run(capsys, "--cuda-graphs", "--transport", "cuda_ipc")
        verdicts = self.verdicts(report)
        assert code == 1
        assert verdicts["CUDA graphs + NCCL buffer registration"] == "fail"
        assert verdicts["CUDA IPC + expandable_segments"] == "fail"

    def test_with_the_workarounds_applied_the_command_passes(self, capsys, monkeypatch):
        """NCCL_GRAPH_REGISTER=0 and no expandable_segments: both ok."""
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        _code, report = self.run(capsys, "--cuda-graphs", "--transport", "cuda_ipc")
        verdicts = self.verdicts(report)
        assert verdicts["CUDA graphs + NCCL buffer registration"] == "ok"
        assert verdicts["CUDA IPC + expandable_segments"] == "ok"

    def test_without_a_transport_the_recommended_one_is_checked(self, capsys, monkeypatch):
        """No --transport on a CPU machine: the recommendation is shm, so no IPC export is checked."""
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        _code, report = self.run(capsys)
        assert report["transport"] == "shm"
        assert self.verdicts(report)["CUDA IPC + expandable_segments"] == "skip"


class TestCpuBackupRetention:
    """The retain choice is visible before the job starts."""

    def test_unset_says_the_adapter_retains(self):
        from actor_integration.tools.doctor import check_cpu_backup_retention

        check = check_cpu_backup_retention({"TMS_INIT_ENABLE_CPU_BACKUP": "1"})
        assert check.verdict == "ok" and "SlimeLifecycleMixin retains the backup" in check.detail

    def test_a_user_who_turned_retain_off_is_warned_with_the_cost(self):
        from actor_integration.tools.doctor import check_cpu_backup_retention

        check = check_cpu_backup_retention({"TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_RETAIN_CPU_BACKUP": "0"})
        assert check.verdict == "warn" and "every pause allocates the pinned backup again" in check.detail

    def test_without_a_backup_there_is_nothing_to_retain(self):
        from actor_integration.tools.doctor import check_cpu_backup_retention

        assert check_cpu_backup_retention({}).verdict == "skip"


class TestNcclAndCommunicators:
    def test_the_loaded_nccl_is_reported_with_where_it_was_loaded_from(self, tmp_path):
        """LD_PRELOAD of a newer libnccl.so.2: the doctor shows its version and path, not torch's build."""
        library = nccl_library(tmp_path)
        if library is None:
            pytest.skip("no nvidia-nccl wheel (2.30+) on this machine")
        env = {**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": str(library)}
        out = subprocess.run(
            [sys.executable, "-m", "actor_integration.tools.cli", "doctor", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        report = json.loads(out.stdout)
        (nccl,) = [c for c in report["checks"] if c["name"] == "NCCL"]
        assert nccl["verdict"] == "ok" and f"NCCL 2.30.7 loaded from {library}" in nccl["detail"]
        assert report["communicators"] == "destroy"

    def test_a_preloaded_library_is_what_torch_runs(self, monkeypatch):
        """torch reports the NCCL it was built against; the library its calls bind to is the loaded one."""
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(
            _nccl, "loaded_nccl", lambda: _nccl.LoadedNccl((2, 30, 7), "/x/libnccl.so.2", None)
        )
        monkeypatch.setattr(_nccl, "torch_nccl_version", lambda: (2, 28, 9))
        detail = check_nccl().detail
        assert (
            "NCCL 2.30.7 loaded from /x/libnccl.so.2 (torch was built against 2.28.9; its NCCL calls run"
            in detail
        )

    @pytest.mark.parametrize("reachable", [True, False])
    def test_destroy_is_recommended_with_the_measurement_and_suspend_stays_opt_in(
        self, monkeypatch, reachable
    ):
        """Suspend reachable or not, the recommendation is the measured fastest way; the detail says
        whether suspend could be chosen here and how to get it where it cannot."""
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        reason = (
            "NCCL 2.30.7 (/x): suspended through torch's Backend.suspend()"
            if reachable
            else (f"NCCL 2.28.9 is loaded; ncclCommSuspend needs 2.29.7+. {_nccl.UPGRADE}")
        )
        support = _nccl.NcclSuspendSupport(reachable, reason, (2, 30, 7) if reachable else (2, 28, 9))
        monkeypatch.setattr(_nccl, "nccl_suspend_support", lambda backend="nccl": support)
        check, way, why = check_communicators()
        assert way == "destroy" and check.verdict == "ok"
        assert "0.73-0.80 s" in why and "3.7-6.3 s" in why and "~390 MiB per communicator" in why
        if reachable:
            assert (
                "suspend is reachable" in check.detail and "opt-in: communicators='suspend'" in check.detail
            )
        else:
            assert "pip install 'nvidia-nccl-cu13>=2.29.7'" in check.detail and "LD_PRELOAD" in check.detail


class TestMemoryBudgetCheck:
    def test_it_says_what_the_budget_would_decide_or_why_not(self) -> None:
        """The report carries the budget's decision on this host (skipped with the reason without CUDA)."""
        from actor_integration.tools.doctor import check_memory_budget

        check, decision = check_memory_budget()
        assert check.name == "memory budget" and check.verdict in ("ok", "skip") and decision


class TestEngines:
    """The rollout engines installed against the releases the adapters are checked on, and vLLM's
    load-time imports (the first H100 run of vLLM 0.26.0 failed on `No module named 'llguidance'`)."""

    @staticmethod
    def engines(monkeypatch, versions, present=("llguidance", "xgrammar")):
        monkeypatch.setattr(doctor, "_version", lambda dist: versions.get(dist))
        checks = doctor.check_engines(find_spec=lambda name: object() if name in present else None)
        return {c.name: c for c in checks}

    def test_neither_engine_installed_is_skipped_not_failed(self, monkeypatch):
        checks = self.engines(monkeypatch, {})
        assert [c.verdict for c in checks.values()] == ["skip", "skip"]
        assert "the sglang extra" in checks["SGLang"].detail and "the vllm extra" in checks["vLLM"].detail

    @pytest.mark.parametrize(
        ("sglang", "verdict"),
        [("0.5.17", "ok"), ("0.5.20", "ok"), ("0.5.23", "ok"), ("0.5.15.post1", "warn"), ("0.5.24", "warn")],
    )
    def test_sglang_is_ok_within_the_checked_releases(self, monkeypatch, sglang, verdict):
        check = self.engines(monkeypatch, {"sglang": sglang})["SGLang"]
        assert check.verdict == verdict and f"sglang {sglang}" in check.detail
        if verdict == "warn":
            assert "checked against 0.5.17 and 0.5.23" in check.detail and "make gpu-check" in check.detail

    def test_vllm_without_its_load_time_modules_fails_naming_them_and_the_fix(self, monkeypatch):
        check = self.engines(monkeypatch, {"vllm": "0.26.0"}, present=("xgrammar",))["vLLM"]
        assert check.verdict == "fail"
        assert "without llguidance" in check.detail and "No module named 'llguidance'" in check.detail
        assert "pip install vllm==0.26.0" in check.detail

    def test_vllm_at_the_checked_release_with_its_modules_is_ok(self, monkeypatch):
        assert self.engines(monkeypatch, {"vllm": "0.26.0"})["vLLM"].verdict == "ok"

    def test_another_vllm_release_warns(self, monkeypatch):
        check = self.engines(monkeypatch, {"vllm": "0.31.0"})["vLLM"]
        assert check.verdict == "warn" and "checked against 0.26.0 only" in check.detail

    def test_the_doctor_report_carries_them(self):
        names = [c["name"] for c in doctor.run_checks({})["checks"]]
        assert "SGLang" in names and "vLLM" in names

"""The loaded NCCL: its version, whether suspend can be reached, and how a communicator is called.

The library tests load the real NCCL 2.30.7 (the `nvidia-nccl-cu13` wheel's `libnccl.so.2`, which
needs no GPU to answer `ncclGetVersion` or to refuse a NULL communicator) into a child process with
`LD_PRELOAD`, as the H200 runs do.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from actor_integration.backends.process_groups import _nccl
from actor_integration.errors import NcclError
from tests.helpers.nccl_lib import nccl_library

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def libnccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = nccl_library(tmp_path_factory.mktemp("nccl"))
    if path is None:
        pytest.skip("no nvidia-nccl wheel (2.30+) on this machine")
    return path


def _child(code: str, preload: Path | None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


PROBE = """
import json
import torch
from actor_integration.backends.process_groups import _nccl
from actor_integration.errors import NcclError
from tests.helpers.nccl_lib import nccl_library
loaded = _nccl.loaded_nccl()
out = {"loaded": None}
if loaded is not None:
    refused = {}
    for name, call in (("suspend", loaded.suspend), ("resume", loaded.resume), ("stats", loaded.mem_stats)):
        try:
            call(0)  # a NULL communicator: NCCL refuses it without touching a GPU
        except NcclError as exc:
            refused[name] = str(exc)
    out = {
        "loaded": list(loaded.version),
        "path": loaded.path,
        "symbols": [s for s in ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats") if loaded.has(s)],
        "refused": refused,
    }
out["support"] = _nccl.nccl_suspend_support("nccl").reason
print(json.dumps(out))
"""


class TestLoadedLibrary:
    def test_the_preloaded_library_is_the_one_read_with_its_own_version_and_symbols(
        self, libnccl: Path
    ) -> None:
        found = _child(PROBE, libnccl)
        assert found["loaded"] == [2, 30, 7]
        assert found["path"] == str(libnccl.resolve()) or found["path"].endswith("libnccl.so.2")
        assert found["symbols"] == ["ncclCommSuspend", "ncclCommResume", "ncclCommMemStats"]

    def test_an_nccl_error_carries_nccls_own_words(self, libnccl: Path) -> None:
        refused = _child(PROBE, libnccl)["refused"]
        assert (
            "ncclCommSuspend returned" in refused["suspend"] and "comm argument is NULL" in refused["suspend"]
        )
        assert (
            "ncclCommResume returned" in refused["resume"] and "ncclCommMemStats returned" in refused["stats"]
        )
        assert all("(NCCL 2.30.7)" in why for why in refused.values())

    def test_no_library_is_loaded_into_a_process_that_has_none(self) -> None:
        found = _child(PROBE, None)
        if not dist.is_nccl_available():  # a CPU build of torch maps no libnccl
            assert found["loaded"] is None and "built without NCCL" in found["support"]

    @pytest.mark.parametrize(
        ("code", "version"), [(23007, (2, 30, 7)), (22809, (2, 28, 9)), (2708, (2, 7, 8))]
    )
    def test_version_codes_of_both_schemes_are_read(self, code: int, version: tuple[int, int, int]) -> None:
        assert _nccl.decode_version(code) == version


class _FakeLibrary:
    """The three symbols of a libnccl.so.2, recording calls (return 0: ncclSuccess)."""

    def __init__(self, *, suspend: bool = True) -> None:
        self.calls: list[tuple[str, int]] = []
        if suspend:
            self.ncclCommSuspend = lambda comm, flags: self._call("suspend", comm, flags)
            self.ncclCommResume = lambda comm: self._call("resume", comm)

    def _call(self, name: str, comm: ctypes.c_void_p, flags: int = 0) -> int:
        self.calls.append((name, int(comm.value or 0)))
        assert name != "suspend" or flags == _nccl.NCCL_SUSPEND_MEM
        return 0


def _loaded(version: tuple[int, int, int], *, suspend: bool = True) -> _nccl.LoadedNccl:
    return _nccl.LoadedNccl(
        version, "/site-packages/nvidia/nccl/lib/libnccl.so.2", _FakeLibrary(suspend=suspend)
    )


class TestSuspendSupport:
    """What `nccl_suspend_support` decides from the loaded version, torch's API and `_comm_ptr()`."""

    @pytest.mark.parametrize(
        ("loaded", "torch_version", "api", "ptr", "available", "route", "says"),
        [
            ((2, 28, 9), (2, 28, 9), False, True, False, None, "NCCL 2.28.9 is loaded"),
            ((2, 30, 7), (2, 30, 7), True, False, True, "torch", "through torch's Backend.suspend()"),
            (
                (2, 30, 7),
                (2, 30, 7),
                False,
                True,
                True,
                "ctypes",
                "through the loaded library and torch's _comm_ptr()",
            ),
            # torch reports the NCCL it was built against; its calls run the loaded (preloaded) one.
            ((2, 30, 7), (2, 28, 9), False, True, True, "ctypes", "through the loaded library"),
            ((2, 30, 7), (2, 30, 7), False, False, False, None, "cannot be reached"),
        ],
    )
    def test_the_loaded_version_and_torch_decide(
        self,
        monkeypatch: pytest.MonkeyPatch,
        loaded: tuple[int, int, int],
        torch_version: tuple[int, int, int],
        api: bool,
        ptr: bool,
        available: bool,
        route: str | None,
        says: str,
    ) -> None:
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(_nccl, "loaded_nccl", lambda: _loaded(loaded))
        monkeypatch.setattr(_nccl, "torch_nccl_version", lambda: torch_version)
        monkeypatch.setattr(_nccl, "torch_suspend_api", lambda: api)
        monkeypatch.setattr(_nccl, "comm_ptr_available", lambda: ptr)
        support = _nccl.nccl_suspend_support("nccl")
        assert (support.available, support.route) == (available, route), support
        assert says in support.reason and support.nccl_version == loaded

    def test_an_old_nccl_says_how_to_upgrade(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(_nccl, "loaded_nccl", lambda: _loaded((2, 28, 9)))
        monkeypatch.setattr(_nccl, "torch_nccl_version", lambda: (2, 28, 9))
        reason = _nccl.nccl_suspend_support("nccl").reason
        assert "needs 2.29.7+" in reason and "pip install 'nvidia-nccl-cu13>=2.29.7'" in reason
        assert "LD_PRELOAD=<site-packages>/nvidia/nccl/lib/libnccl.so.2" in reason

    def test_a_backend_without_nccl_has_nothing_to_suspend(self) -> None:
        support = _nccl.nccl_suspend_support("gloo")
        assert not support.available and "has no NCCL communicators" in support.reason


class TestCommunicatorRoutes:
    """How one communicator is suspended: torch's API where it has one, else the library and its pointer."""

    def test_torchs_backend_suspend_is_used_where_torch_has_it(self) -> None:
        calls: list[str] = []
        backend = SimpleNamespace(
            suspend=lambda: calls.append("suspend"),
            resume=lambda: calls.append("resume"),
            _comm_ptr=lambda: 7,
        )
        library = _loaded((2, 30, 7))
        communicator = _nccl.NcclCommunicator("tp", backend, library)
        communicator.suspend()
        communicator.resume()
        assert calls == ["suspend", "resume"] and library.lib.calls == []

    def test_otherwise_the_loaded_library_is_called_on_the_communicator_pointer(self) -> None:
        library = _loaded((2, 30, 7))
        communicator = _nccl.NcclCommunicator("tp", SimpleNamespace(_comm_ptr=lambda: 0xBEEF), library)
        assert communicator.created()
        communicator.suspend()
        communicator.resume()
        assert library.lib.calls == [("suspend", 0xBEEF), ("resume", 0xBEEF)]

    def test_a_communicator_torch_has_not_created_is_not_called(self) -> None:
        communicator = _nccl.NcclCommunicator(
            "lazy", SimpleNamespace(_comm_ptr=lambda: 0), _loaded((2, 30, 7))
        )
        assert not communicator.created() and communicator.stats() is None
        with pytest.raises(NcclError, match="group lazy has no NCCL communicator"):
            communicator.suspend()

    def test_an_unreachable_communicator_says_how_to_upgrade(self) -> None:
        communicator = _nccl.NcclCommunicator(
            "tp", SimpleNamespace(_comm_ptr=lambda: 7), _loaded((2, 28, 9), suspend=False)
        )
        with pytest.raises(
            NcclError, match=r"no loaded libnccl.so.2 exports ncclCommSuspend.*nvidia-nccl-cu13"
        ):
            communicator.suspend()

    def test_torchs_memory_stats_are_read_by_their_names(self) -> None:
        counters = {"suspend": 100, "suspended": 1, "persist": 4, "total": 104}
        backend = SimpleNamespace(memory_stats=lambda: counters)
        stats = _nccl.NcclCommunicator("tp", backend, None).stats()
        assert stats == _nccl.MemStats(suspendable=100, persistent=4, total=104, suspended=True)

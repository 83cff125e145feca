"""Gloo groups standing in for NCCL ones, so the suspend way runs on CPU (tests only).

`install(...)` replaces `_nccl.communicator_of` and `_nccl.nccl_suspend_support` in this process
(call it inside a spawned rank too). Each gloo group gets one `FakeCommunicator` with the exact
`_nccl.Communicator` interface; it records every suspend and resume in `LOG`, and fails where
told, as NCCL refuses an NVLS or split-shared communicator.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import _nccl
from actor_integration.errors import NcclError

LOG: list[tuple[str, str]] = []  # (call, group name); WORLD is named "WORLD"
# What one H200 communicator held: docs/measurements.md#serial-process-group-teardown-2026-12-01
SUSPENDABLE = 390 << 20
PERSISTENT = 4 << 20


class FakeCommunicator:
    """A gloo group's stand-in communicator: suspend/resume recorded, refused where told."""

    def __init__(self, pg: ProcessGroup, name: str, *, created: bool, fails: bool) -> None:
        # Weak, as torch's communicator holds no group: a group torn down is freed here as there.
        self.pg = weakref.ref(pg)
        self._name = name
        self._created = created
        self._fails = fails
        self.suspended = False

    @property
    def name(self) -> str:
        return self._name

    def created(self) -> bool:
        return self._created

    def suspend(self) -> None:
        LOG.append(("suspend", self._name))
        if self._fails:
            message = f"ncclCommSuspend returned 5 (invalid usage): injected for {self._name}"
            raise NcclError(message, call="ncclCommSuspend", code=5)
        if self.suspended:
            message = "ncclCommSuspend returned 5 (invalid usage): MemManager: Already suspended"
            raise NcclError(message, call="ncclCommSuspend", code=5)
        self.suspended = True

    def resume(self) -> None:
        LOG.append(("resume", self._name))
        self.suspended = False

    def stats(self) -> _nccl.MemStats:
        total = SUSPENDABLE + PERSISTENT
        return _nccl.MemStats(SUSPENDABLE, PERSISTENT, total, self.suspended)


def install(
    *,
    fail: Iterable[str] = (),
    uncreated: Iterable[str] = (),
    descs: Callable[[ProcessGroup], str] | None = None,
) -> dict[int, FakeCommunicator]:
    """Make every gloo group look like an NCCL one. Groups are named by their `group_desc`
    ("WORLD" for the default group); those in `fail` refuse to suspend, those in `uncreated` have no
    communicator yet. Returns the fakes by `id(group)`."""
    fails, missing = set(fail), set(uncreated)
    fakes: dict[int, FakeCommunicator] = {}

    def name_of(pg: ProcessGroup) -> str:
        if pg is dist.distributed_c10d._get_default_group():
            return "WORLD"
        return descs(pg) if descs else str(pg.group_desc)

    def communicator_of(pg: ProcessGroup) -> FakeCommunicator | None:
        if "gloo" not in str(dist.get_backend(pg)):
            return None
        name = name_of(pg)
        if name == "side_channel":
            return None  # the side channel is gloo in real runs too
        fake = fakes.get(id(pg))
        if fake is None or fake.pg() is not pg:
            fake = fakes[id(pg)] = FakeCommunicator(
                pg, name, created=name not in missing, fails=name in fails
            )
        return fake

    def support(backend: str = "nccl") -> _nccl.NcclSuspendSupport:
        return _nccl.NcclSuspendSupport(True, "fake NCCL 2.30.7 over gloo", (2, 30, 7), (2, 30, 7), "fake")

    setattr(_nccl, "communicator_of", communicator_of)  # noqa: B010 - the module attribute the ways call
    setattr(_nccl, "nccl_suspend_support", support)  # noqa: B010
    LOG.clear()
    return fakes


def calls(kind: str | None = None) -> list[Any]:
    return [name for call, name in LOG if kind is None or call == kind]

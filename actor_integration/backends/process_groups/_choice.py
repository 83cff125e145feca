"""Choosing a way of treating the communicators (`communicators=`), and saying why it runs.

One place for every host (`ReloadableProcessGroups`, a framework's `RegistryProcessGroups`): the
unit a name stands for, checked once against the backend (the suspend probe runs here, once per
host), and the line the first sleep logs about it.
"""

from __future__ import annotations

from actor_integration.backends.process_groups import _nccl
from actor_integration.backends.process_groups._destroy import DestroyCommunicators
from actor_integration.backends.process_groups._keep import KeepCommunicators
from actor_integration.backends.process_groups._suspend import SuspendCommunicators
from actor_integration.backends.process_groups._way import CommunicatorWay
from lifecycle.table import Communicators


def choose_way(communicators: Communicators | str, backend: str) -> CommunicatorWay:
    """The unit for the chosen way, after it checked it can work with `backend` here."""
    try:
        chosen = Communicators(communicators)
    except ValueError:
        raise ValueError(
            f"communicators must be one of {[c.value for c in Communicators]} (what sleep does to the NCCL "
            f"communicators), got {communicators!r}"
        ) from None
    way: CommunicatorWay
    if chosen is Communicators.SUSPEND:
        way = SuspendCommunicators()
    elif chosen is Communicators.KEEP:
        way = KeepCommunicators()
    else:
        way = DestroyCommunicators()
    way.check(backend)
    return way


def why_this_way(way: CommunicatorWay, backend: str) -> str:
    """Why `way` runs here, for the first sleep's event."""
    if isinstance(way, SuspendCommunicators) and way.support is not None:
        return f"communicators='suspend' (opt-in): {way.support.reason}"
    if isinstance(way, KeepCommunicators):
        return "communicators='keep' (opt-in): nothing is freed; the communicators' memory stays held"
    if "nccl" not in backend:
        return "no NCCL groups"
    return (
        "communicators='destroy' (default): the fastest measured way that frees the memory "
        f"(suspend is opt-in; here: {_nccl.nccl_suspend_support(backend).reason})"
    )

"""The transport interface, the registry, `select_transport` and the `auto` probe.

A sender transport packs buckets into buffers another process can read and describes them with
small picklable descriptors; the matching receiver transport turns a descriptor back into a
uint8 region (on the device, or in host memory the receiver may upload). The protocol (`sender.py`, `receiver.py`) moves only manifests and descriptors between
processes; the bytes go through the transport.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from actor_integration.weight_sync.buckets import ALIGN, Bucket, BucketManifest
from actor_integration.weight_sync.nodes import decide_transport
from lifecycle import events
from lifecycle.hooks import EventSink, MemoryDisable
from lifecycle.logs import Event

TRANSPORTS: tuple[str, ...] = ("cuda_ipc", "shm", "disk", "nccl")
REQUESTABLE: tuple[str, ...] = ("auto", *TRANSPORTS)

_SENDERS = {
    "cuda_ipc": "actor_integration.weight_sync.cuda_ipc:CudaIpcSender",
    "shm": "actor_integration.weight_sync.shm:ShmSender",
    "disk": "actor_integration.weight_sync.disk:DiskSender",
    "nccl": "actor_integration.weight_sync.nccl:NcclSender",
}
_RECEIVERS = {
    "cuda_ipc": "actor_integration.weight_sync.cuda_ipc:CudaIpcReceiver",
    "shm": "actor_integration.weight_sync.shm:ShmReceiver",
    "disk": "actor_integration.weight_sync.disk:DiskReceiver",
    "nccl": "actor_integration.weight_sync.nccl:NcclReceiver",
}


def emit(sink: EventSink | None, name: str, level: str = "info", **fields: Any) -> None:
    """Log a weight-sync event with the actor's context when a lifecycle is given."""
    if sink is not None:
        sink.event(name, level, **fields)
    elif events.enabled(events.LEVELS[level]):
        events.emit(level, name, fields)


class SenderTransport(abc.ABC):
    """Packs buckets where a receiver can read them.

    Per round: `begin_round`, `export` for each bucket (position counts from 0 inside the
    round; the packing may still run on the device when it returns), `ready` (the round's
    manifests, checksums included, after one wait for the packing), then the protocol hands the
    descriptors over, `push` runs while the engine receives (nccl only), and `end_round` runs
    after the engine acknowledged. A transport with `double_buffered` packs round r + 1 into
    other buffers than round r, so the sender may pack the next round while the engine loads
    this one; `abandon` gives back what a round exported but never handed over.
    """

    name: ClassVar[str]
    default_round_buckets: ClassVar[int | None]  # buckets per round; None: the whole update
    align: ClassVar[int] = ALIGN  # bucket layout alignment (1: the safetensors layout)
    double_buffered: ClassVar[bool] = False

    def __init__(self) -> None:
        self.sender_id = uuid.uuid4().hex[:12]
        self.version: int | None = None
        self.round_index = 0
        self.checksums = True  # False: manifests carry no checksum (WeightSender(checksums=False))
        self.pipelined = False  # True: round r + 1 is exported before round r is acknowledged

    @property
    def gpu(self) -> int | None:
        """Machine-wide GPU id of the exported buffers (cuda_ipc), else None."""
        return None

    def begin_round(self, version: int, round_index: int) -> None:
        self.version, self.round_index = version, round_index

    @abc.abstractmethod
    def export(self, position: int, bucket: Bucket) -> Any:
        """Pack `bucket` into the buffer for `position`; return its descriptor."""

    @abc.abstractmethod
    def ready(self) -> list[BucketManifest]:
        """The manifests of the buckets exported this round, in order, once the receiver can read them."""

    def push(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """Move the round's bytes while the engine receives (transports that push)."""

    def end_round(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """The engine acknowledged the round; buffers may be reused."""

    def abandon(self, descriptors: Sequence[Any]) -> None:  # noqa: B027 - optional step
        """A round was exported but will not be handed over (an earlier round failed)."""

    def release(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """Free the staging buffers; the next export uses new buffers (receivers reopen)."""

    def close(self) -> None:
        self.release()


class ReceiverTransport(abc.ABC):
    """Opens the regions a sender exported, caching what may be reused."""

    name: ClassVar[str]

    @abc.abstractmethod
    def open(self, manifest: BucketManifest, descriptor: Any, *, gpu: int | None) -> torch.Tensor:
        """A uint8 tensor holding the bucket's bytes at offset 0 (valid until `close_round`)."""

    def close_round(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """The round's tensors were consumed (device copies must be finished here)."""

    def discard(self, descriptor: Any) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """The engine refused a bucket without opening it: release what the sender holds for it."""

    def settle(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """Host bookkeeping of the opened round (cuda_ipc: grants no longer needed), run while the
        device copies; `close_round` settles whatever is left."""

    def release(self) -> None:  # noqa: B027 - optional step, a no-op unless a transport needs it
        """Drop every cached handle or mapping (called when the rollout sleeps)."""


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def sender_class(name: str) -> type[SenderTransport]:
    _check_name(name, TRANSPORTS)
    cls: type[SenderTransport] = _load(_SENDERS[name])
    return cls


def receiver_class(name: str) -> type[ReceiverTransport]:
    _check_name(name, TRANSPORTS)
    cls: type[ReceiverTransport] = _load(_RECEIVERS[name])
    return cls


def _check_name(name: object, allowed: tuple[str, ...]) -> None:
    if name not in allowed:
        raise ValueError(f"unknown weight transport {name!r}; choose one of {list(allowed)}")


# ----------------------------------------------------------------------------------------------
# Selection


_probe_cache: dict[bool, tuple[bool, str]] = {}


def probe_cuda_ipc(memory: MemoryDisable | None = None) -> tuple[bool, str]:
    """Whether this process can export a CUDA IPC handle for a buffer the senders would allocate.

    Probed once per process (per with/without memory backend): under torch_memory_saver's preload
    hook every allocation is cuMem virtual memory and `_share_cuda_()` fails (slime #2188), so the
    probe allocates the way `CudaIpcSender` does, inside `memory.disable()`.
    """
    key = memory is not None
    if key in _probe_cache:
        return _probe_cache[key]
    if not torch.cuda.is_available():
        result = (False, "CUDA is not available in this process")
    else:
        try:
            context = memory.disable() if memory is not None else contextlib.nullcontext()
            with context:
                probe = torch.empty(4096, dtype=torch.uint8, device="cuda")
                share = probe.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            # Nobody will open this export: release its grant, or the probe would never be freed.
            torch.UntypedStorage._release_ipc_counter_cuda(share[4], share[5])
            del probe
            result = (
                True,
                "a CUDA buffer allocated outside torch_memory_saver regions exports an IPC handle",
            )
        except Exception as exc:  # the CUDA error is the reason
            result = (False, f"exporting a CUDA IPC handle failed: {exc}")
    _probe_cache[key] = result
    return result


def select_transport(
    requested: str,
    *,
    colocated: bool,
    memory: MemoryDisable | None = None,
    lifecycle: EventSink | None = None,
    same_node: bool = True,
    between: tuple[str, str] | None = None,
) -> str:
    """Resolve a requested transport (default `auto`) for an engine, or refuse it with the reason.

    The rules are `nodes.decide_transport`'s: `nccl` toward a colocated engine is refused (NCCL
    cannot connect two ranks on one GPU, "Duplicate GPU detected"); `cuda_ipc` toward a remote
    engine is refused (its handles only open on the same GPUs); `cuda_ipc` and `shm` toward an
    engine rank on another node (`same_node=False`; `between` names the two nodes) are refused
    with `CrossNodeTransportError`. `auto` picks `cuda_ipc` when the probe passes, else `shm`,
    for a colocated engine, and `nccl` for a remote one or one on another node.
    """
    _check_name(requested, REQUESTABLE)
    for name, value in (("colocated", colocated), ("same_node", same_node)):
        if not isinstance(value, bool):
            raise TypeError(f"select_transport: {name} must be a bool, got {value!r}")
    chosen, reason = decide_transport(
        requested,
        colocated=colocated,
        same_node=same_node,
        probe=lambda: probe_cuda_ipc(memory),
        between=between,
    )
    emit(lifecycle, Event.SYNC_TRANSPORT, requested=requested, chosen=chosen, reason=reason)
    return chosen


def check_directory(directory: str | os.PathLike[str], *, what: str, create: bool) -> Path:
    """Refuse, at configuration time, a directory a transport cannot write its buffers into."""
    path = Path(directory)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{what} directory {str(path)!r} cannot be created: {exc}") from exc
    if not path.is_dir():
        raise ValueError(f"{what} directory {str(path)!r} does not exist or is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"{what} directory {str(path)!r} is not writable ({exc.strerror or exc}); "
            "point the transport at a directory this process can write, or choose another transport"
        ) from exc
    return path


def configure_sender(
    requested: str = "auto",
    *,
    colocated: bool,
    memory: MemoryDisable | None = None,
    directory: str | os.PathLike[str] | None = None,
    group: Any = None,
    src: int | None = None,
    device: torch.device | str | int | None = None,
    lifecycle: EventSink | None = None,
    same_node: bool = True,
    between: tuple[str, str] | None = None,
) -> SenderTransport:
    """Select and build the sending transport; every refusal happens here, before any GPU work
    (`same_node=False`: the engine rank is on another node, see `select_transport`)."""
    name = select_transport(
        requested,
        colocated=colocated,
        memory=memory,
        lifecycle=lifecycle,
        same_node=same_node,
        between=between,
    )
    if name == "cuda_ipc":
        return sender_class(name)(device=device, memory=memory)  # type: ignore[call-arg]
    if name == "shm":
        kwargs = {} if directory is None else {"directory": directory}
        return sender_class(name)(**kwargs)
    if name == "disk":
        if directory is None:
            raise ValueError(
                "weight transport 'disk' needs a directory (shared with the engine) to write into"
            )
        return sender_class(name)(directory)  # type: ignore[call-arg]
    if group is None or src is None:
        raise ValueError(
            "weight transport 'nccl' needs the process group joining the trainer's source rank and the "
            "engine ranks, and the source rank's global rank (group=..., src=...)"
        )
    return sender_class(name)(group, src=src, device=device)  # type: ignore[call-arg]

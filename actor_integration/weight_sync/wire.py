"""The wire format of a weight sync: what one slot rank hands the engine per round, and its errors.

Both sides read this module: `sender.py` builds `RankPayload`s, `receiver.py` opens them. A round
carries one payload per slot rank, in rank order; every payload of a round must agree on version,
round, transport and whether it is the last round (`payload_mismatch`). The bucket layout inside a
payload (`BucketManifest`) is in `buckets.py`; the descriptors are the transport's.

A receiver inside an engine's own processes (SGLang's schedulers, vLLM's workers) gets its payloads
through the engine's calls, which carry strings: `encode_payload` writes a `cuda_ipc` or `shm`
payload (`PAYLOAD_TRANSPORTS`, what such a process opens itself) as plain JSON builtins, bytes as
base64, and `decode_payload` reads it back, equal to what was sent.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actor_integration.errors import (
    CorruptBucketError,
    StaleVersionError,
    WeightSyncError,
    WeightSyncTimeout,
    WrittenWeightsError,
)
from actor_integration.weight_sync.buckets import BucketManifest, PackedEntries

__all__ = [
    "PAYLOAD_TRANSPORTS",
    "CorruptBucketError",
    "RankPayload",
    "StaleVersionError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WrittenWeightsError",
    "decode_payload",
    "encode_payload",
    "payload_mismatch",
]

# What a receiver inside an engine's processes opens: the trainer's GPU buffers, or /dev/shm files.
PAYLOAD_TRANSPORTS = ("cuda_ipc", "shm")


@dataclass(frozen=True)
class RankPayload:
    """What one slot rank contributes to one round: manifests and transport descriptors."""

    version: int
    round: int
    final: bool  # the last round of this version
    slot: int | None
    rank: int
    transport: str
    sender: str
    gpu: int | None  # machine-wide GPU id of the exported buffers (cuda_ipc)
    buckets: tuple[BucketManifest, ...]
    descriptors: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def payload_mismatch(payloads: Sequence[RankPayload]) -> str | None:
    """Why the payloads of one round cannot be loaded together, or None."""
    first = payloads[0]
    for p in payloads[1:]:
        for attr in ("version", "round", "transport"):
            if getattr(p, attr) != getattr(first, attr):
                return (
                    f"rank {p.rank} sent {attr} {getattr(p, attr)!r} but rank {first.rank} sent "
                    f"{getattr(first, attr)!r}; every rank of a slot must call send() with the same version "
                    "and transport"
                )
        if p.final != first.final:
            short = p.rank if p.final else first.rank
            return (
                f"the slot ranks disagree on the number of buckets: rank {short} sent its last bucket in this "
                "round while others have more; every rank of a slot must send the same tensors (sizes included)"
            )
    return None


# ---------------------------------------------------------------------------------------------- as JSON


def encode_payload(payload: RankPayload) -> dict[str, Any]:
    """A `cuda_ipc` or `shm` payload as JSON-able builtins (`decode_payload` reverses it)."""
    if payload.transport not in PAYLOAD_TRANSPORTS:
        raise ValueError(
            f"a receiver inside the engine takes {list(PAYLOAD_TRANSPORTS)} payloads, got "
            f"{payload.transport!r}: the engine's processes open the trainer's buffers by their CUDA IPC "
            "handles or shared-memory files"
        )
    buckets = []
    for manifest in payload.buckets:
        names, meta = manifest.packed.key
        buckets.append(
            {
                "index": manifest.index,
                "nbytes": manifest.nbytes,
                "names": names,
                "meta": _plain(meta),
                "checksum": manifest.checksum,
                "checksum_kind": manifest.checksum_kind,
            }
        )
    return {
        "version": payload.version,
        "round": payload.round,
        "final": payload.final,
        "slot": payload.slot,
        "rank": payload.rank,
        "transport": payload.transport,
        "sender": payload.sender,
        "gpu": payload.gpu,
        "buckets": buckets,
        "descriptors": [_descriptor(payload.transport, d) for d in payload.descriptors],
    }


def decode_payload(data: dict[str, Any]) -> RankPayload:
    """The payload `encode_payload` wrote."""
    buckets = tuple(
        BucketManifest(
            index=b["index"],
            nbytes=b["nbytes"],
            entries=PackedEntries(b["names"], _unplain(b["meta"])),
            checksum=b["checksum"],
            checksum_kind=b["checksum_kind"],
        )
        for b in data["buckets"]
    )
    return RankPayload(
        version=data["version"],
        round=data["round"],
        final=data["final"],
        slot=data["slot"],
        rank=data["rank"],
        transport=data["transport"],
        sender=data["sender"],
        gpu=data["gpu"],
        buckets=buckets,
        descriptors=tuple(_undescriptor(data["transport"], d) for d in data["descriptors"]),
    )


def _plain(value: Any) -> Any:
    """JSON-able form of a descriptor field: bytes become {"b64": ...}, tuples lists."""
    if isinstance(value, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} to the engine's receiver: {value!r}")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    if isinstance(value, list):
        return tuple(_unplain(v) for v in value)
    return value


def _descriptor(transport: str, d: Any) -> dict[str, Any]:
    if transport == "shm":
        from actor_integration.weight_sync.shm import ShmRegion

        if not isinstance(d, ShmRegion):
            raise TypeError(f"shm payload with a {type(d).__name__} descriptor")
        return {"path": d.path, "nbytes": d.nbytes}
    from actor_integration.weight_sync.cuda_ipc import IpcBuffer

    if not isinstance(d, IpcBuffer):
        raise TypeError(f"cuda_ipc payload with a {type(d).__name__} descriptor")
    return {
        "buffer_id": d.buffer_id,
        "share": _plain(d.share),
        "capacity": d.capacity,
        "ready": _plain(d.ready),
    }


def _undescriptor(transport: str, d: dict[str, Any]) -> Any:
    if transport == "shm":
        from actor_integration.weight_sync.shm import ShmRegion

        return ShmRegion(path=d["path"], nbytes=d["nbytes"])
    from actor_integration.weight_sync.cuda_ipc import IpcBuffer

    return IpcBuffer(
        buffer_id=d["buffer_id"],
        share=_unplain(d["share"]),
        capacity=d["capacity"],
        ready=_unplain(d["ready"]),
    )

"""The wire format of a weight sync: what one slot rank hands the engine per round, and its errors.

Both sides read this module: `sender.py` builds `RankPayload`s, `receiver.py` opens them. A round
carries one payload per slot rank, in rank order; every payload of a round must agree on version,
round, transport and whether it is the last round (`payload_mismatch`). The bucket layout inside a
payload (`BucketManifest`) is in `buckets.py`; the descriptors are the transport's.
"""

from __future__ import annotations

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
from actor_integration.weight_sync.buckets import BucketManifest

__all__ = [
    "CorruptBucketError",
    "RankPayload",
    "StaleVersionError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WrittenWeightsError",
    "payload_mismatch",
]


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

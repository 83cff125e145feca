"""The receiving side of a weight sync: `WeightReceiver` opens and verifies a round, `VersionGate` orders versions.

`WeightReceiver` opens every bucket of a round through its transport and checks its checksum
before the engine sees any of it; `VersionGate` refuses stale, repeated and out-of-order updates.
The rollout (`actor_integration.rollout`) imports this side only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from actor_integration.weight_sync.buckets import BucketManifest, checksum, unpack
from actor_integration.weight_sync.transport import ReceiverTransport, receiver_class
from actor_integration.weight_sync.wire import RankPayload, payload_mismatch
from lifecycle.errors import CorruptBucketError, StaleVersionError, WeightSyncError

__all__ = ["ReceivedRound", "VersionGate", "WeightReceiver"]


@dataclass
class ReceivedRound:
    """One verified round: per engine rank (slot rank order), the named tensors to load."""

    version: int
    round: int
    final: bool
    transport: str
    nbytes: int
    shards: list[list[tuple[str, torch.Tensor]]]


class WeightReceiver:
    """Opens the payloads of a round through their transport and verifies every bucket.

    Transport receivers are created on first use; give `transports={"nccl": NcclReceiver(...)}`
    for the broadcast transport, which needs its process group. `release()` drops every cached
    handle and mapping: the rollout calls it when it sleeps.
    """

    def __init__(
        self, *, verify: bool = True, transports: Mapping[str, ReceiverTransport] | None = None
    ) -> None:
        self.verify = verify
        self._transports: dict[str, ReceiverTransport] = dict(transports or {})

    def transport(self, name: str) -> ReceiverTransport:
        found = self._transports.get(name)
        if found is None:
            if name == "nccl":
                raise ValueError(
                    "WeightReceiver: payloads came by 'nccl', which needs the process group joining the "
                    "engine to the trainer's source rank: WeightReceiver(transports={'nccl': "
                    "NcclReceiver(group, src=...)})"
                )
            found = self._transports[name] = receiver_class(name)()
        return found

    @contextlib.contextmanager
    def open(self, payloads: Sequence[RankPayload]) -> Iterator[ReceivedRound]:
        """Open, check and unpack one round; the views are valid inside the block only.

        Every bucket's transport resources are accounted for whether this succeeds or raises:
        opened, or discarded (a cuda_ipc grant released, a broadcast drained).
        """
        if not isinstance(payloads, (list, tuple)) or not payloads:
            raise ValueError("WeightReceiver.open: payloads must be a non-empty list, one per slot rank")
        for p in payloads:
            if not isinstance(p, RankPayload):
                self.discard(payloads)
                raise TypeError(f"WeightReceiver.open: expected RankPayload items, got {type(p).__name__}")
        mismatch = payload_mismatch(payloads)
        if mismatch is not None:
            self.discard(payloads)
            raise WeightSyncError(f"inconsistent payloads: {mismatch}", version=payloads[0].version)
        first = payloads[0]
        transport = self.transport(first.transport)
        pending = [(p, m, d) for p in payloads for m, d in zip(p.buckets, p.descriptors, strict=True)]
        try:
            opened: list[torch.Tensor] = []
            try:
                for p, m, d in pending:
                    opened.append(self._open(transport, p, m, d))
            except BaseException:
                for _p, _m, d in pending[len(opened) + 1 :]:
                    transport.discard(d)
                raise
            if self.verify:
                for (p, manifest, _d), region in zip(pending, opened, strict=True):
                    actual = checksum(region, manifest.nbytes, manifest.checksum_kind)
                    if actual != manifest.checksum:
                        raise CorruptBucketError(
                            f"bucket {manifest.index} of version {p.version} from rank {p.rank} (slot {p.slot}, "
                            f"transport {p.transport}) fails its {manifest.checksum_kind} checksum: expected "
                            f"{manifest.checksum:#x}, got {actual:#x}; it was corrupted or truncated in transit",
                            version=p.version,
                            rank=p.rank,
                            bucket=manifest.index,
                        )
            shards: list[list[tuple[str, torch.Tensor]]] = [[] for _ in payloads]
            index = {id(p): i for i, p in enumerate(payloads)}
            for (p, manifest, _d), region in zip(pending, opened, strict=True):
                shards[index[id(p)]].extend(unpack(region, manifest))
            del opened
            yield ReceivedRound(
                version=first.version,
                round=first.round,
                final=first.final,
                transport=first.transport,
                nbytes=sum(p.nbytes for p in payloads),
                shards=shards,
            )
            del shards
        finally:
            transport.close_round()

    def discard(self, payloads: Sequence[Any]) -> None:
        """Release what the senders hold for payloads the engine refused before opening them."""
        for p in payloads if isinstance(payloads, (list, tuple)) else ():
            if isinstance(p, RankPayload):
                transport = self._transports.get(p.transport)
                if transport is None and p.transport != "nccl":
                    transport = self.transport(p.transport)
                for d in p.descriptors if transport is not None else ():
                    transport.discard(d)  # type: ignore[union-attr]

    @staticmethod
    def _open(
        transport: ReceiverTransport, payload: RankPayload, manifest: BucketManifest, descriptor: Any
    ) -> torch.Tensor:
        try:
            return transport.open(manifest, descriptor, gpu=payload.gpu)
        except CorruptBucketError as exc:
            raise CorruptBucketError(
                f"bucket {manifest.index} of version {payload.version} from rank {payload.rank} (slot "
                f"{payload.slot}): {exc}",
                version=payload.version,
                rank=payload.rank,
                bucket=manifest.index,
            ) from exc

    def release(self) -> None:
        for transport in self._transports.values():
            transport.release()

    def open_handles(self) -> int:
        """Cached IPC handles and shared-memory mappings held now (0 after `release()`)."""
        return sum(int(getattr(t, "open_handles", 0)) for t in self._transports.values())


@dataclass
class VersionGate:
    """Versions strictly increase; rounds of one version arrive in order, starting at 0."""

    committed: int | None = None
    staging: int | None = None  # version being received
    next_round: int = 0
    started: float = field(default=0.0)

    def admit(self, version: int, round_index: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightSyncError(f"weight version must be an int, got {version!r}")
        if self.committed is not None and version <= self.committed:
            what = "repeats" if version == self.committed else "is older than"
            raise StaleVersionError(
                f"weight version {version} refused: it {what} version {self.committed}, which is loaded. "
                "Versions must strictly increase: a retried call, or a trainer restarted without restoring its "
                "version counter; send a newer version.",
                version=version,
                committed=self.committed,
            )
        if round_index == 0:
            self.staging, self.next_round, self.started = version, 1, time.perf_counter()
            return
        if self.staging != version or self.next_round != round_index:
            expected = (
                f"round {self.next_round} of version {self.staging}"
                if self.staging is not None
                else "a round 0"
            )
            raise WeightSyncError(
                f"round {round_index} of version {version} arrived, but {expected} was expected: the update "
                "was interrupted or reordered; send the whole version again (from round 0)",
                version=version,
            )
        self.next_round += 1

    def commit(self, version: int) -> float:
        """Record `version` as loaded; returns seconds since its round 0."""
        self.committed, self.staging, self.next_round = version, None, 0
        return time.perf_counter() - self.started

    def abort(self) -> None:
        self.staging, self.next_round = None, 0

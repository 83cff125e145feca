"""The receiving side of a weight sync: `WeightReceiver` opens and verifies a round, `VersionGate` orders versions.

`WeightReceiver` opens every bucket of a round through its transport and checks every checksum
before anything is written: one verification launch for the buckets on a GPU, compared on the
device with the senders' values. Then either `load_into` copies the round straight into the
engine's tensors (one batched kernel per GPU, no intermediate tensor; an engine opts in with
`weight_targets`, see `actor_integration.rollout.engine.LoadsInPlace`): on one GPU the copy is
queued right behind the verification and gated by its verdict on the device (a failed checksum
makes it write nothing), while the host reads the checksums and raises. Or `open` hands out views
of the buckets for an engine that copies them itself (`load_weights`). `VersionGate` refuses stale, repeated and
out-of-order updates. The rollout (`actor_integration.rollout`) imports this side only.

`WeightReceiver(keep_previous=False)` trades that guarantee for a pass over the data: `load_into`
then writes the round while checksumming what it reads (one read of the buckets, one write of
the engine's tensors) and compares afterwards. A corrupt bucket is still refused with
`CorruptBucketError` (its `written` field true), but the targets hold part of the round by then:
the rollout marks its weights invalid until a round loads whole (the sender re-sends it once).

After the copies, `load_into` checks what it wrote where it wrote it (`digest`, on by default): the
WSUM64 of every target, each word weighted by its place in the bucket it came from, summed per
bucket on the device (one launch, a read of the written bytes) and compared with the senders'
checksums. A mismatch raises `WrittenWeightsError`: the engine does not hold what was sent.
`sent_sums` and `check_written` are the same check for receivers that write elsewhere (SGLang's
schedulers, through their copy plans).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from actor_integration.errors import (
    CorruptBucketError,
    StaleVersionError,
    WeightSyncError,
    WrittenWeightsError,
)
from actor_integration.weight_sync import kernels
from actor_integration.weight_sync.buckets import (
    ALIGN,
    CRC32,
    NONE,
    SUM32,
    WSUM64,
    WSUM64_DEVICE,
    BucketManifest,
    checksum,
    checksum_trailer,
    dtype_from_name,
    padded,
    tiles_bucket,
    unpack,
    wsum64_sums,
    wsum64_value,
)
from actor_integration.weight_sync.transport import ReceiverTransport, receiver_class
from actor_integration.weight_sync.wire import RankPayload, payload_mismatch

__all__ = [
    "LoadedRound",
    "ReceivedRound",
    "VersionGate",
    "WeightReceiver",
    "WeightTargets",
    "check_written",
    "sent_sums",
]


@dataclass(frozen=True)
class WeightTargets:
    """Where a round goes: per engine rank (slot rank order), the tensors to write, by name.

    The receiver writes the tensors in place, so they must stay allocated where they are while
    this object is in use: an engine that reallocates its weights (a release and resume) returns a
    new `WeightTargets`. The receiver caches its copy plan per targets object. `complete`: the
    round must carry every tensor of every rank (a version in one round written into the served
    weights); a round that does not is refused before anything is written."""

    tensors: Sequence[Mapping[str, torch.Tensor]]
    complete: bool = False


@dataclass
class _Bucket:
    payload: RankPayload
    rank_index: int  # position of the payload in the round (the engine rank)
    position: int  # position of the bucket in its payload
    manifest: BucketManifest
    descriptor: Any
    region: torch.Tensor | None = None  # as opened by the transport
    work: torch.Tensor | None = None  # what is verified and copied (a device copy of a host region)


class ReceivedRound:
    """One verified round: per engine rank (slot rank order), the named tensors to load (views of
    the buckets, made on first access) or the buckets themselves (`buckets`)."""

    def __init__(
        self, version: int, round_index: int, final: bool, transport: str, buckets: list[_Bucket], ranks: int
    ) -> None:
        self.version = version
        self.round = round_index
        self.final = final
        self.transport = transport
        self.nbytes = sum(b.manifest.nbytes for b in buckets)
        self._buckets = buckets
        self._ranks = ranks
        self._shards: list[list[tuple[str, torch.Tensor]]] | None = None

    @property
    def buckets(self) -> list[list[tuple[torch.Tensor, BucketManifest]]]:
        """Per engine rank, its verified buckets: (uint8 region, manifest)."""
        out: list[list[tuple[torch.Tensor, BucketManifest]]] = [[] for _ in range(self._ranks)]
        for b in self._buckets:
            assert b.work is not None
            out[b.rank_index].append((b.work, b.manifest))
        return out

    @property
    def shards(self) -> list[list[tuple[str, torch.Tensor]]]:
        if self._shards is None:
            shards: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(self._ranks)]
            for b in self._buckets:
                assert b.work is not None
                shards[b.rank_index].extend(unpack(b.work, b.manifest))
            self._shards = shards
        return self._shards


class LoadedRound:
    """One round written into the engine's tensors."""

    def __init__(
        self,
        version: int,
        round_index: int,
        final: bool,
        transport: str,
        manifests: list[list[BucketManifest]],
    ) -> None:
        self.version = version
        self.round = round_index
        self.final = final
        self.transport = transport
        self.nbytes = sum(m.nbytes for per_rank in manifests for m in per_rank)
        self._manifests = manifests

    @property
    def names(self) -> Sequence[tuple[str, ...]]:
        """Per engine rank, the tensors written (each rank's tuple made on first access: an engine
        that only needs to know the round arrived never pays for thousands of names)."""
        return _Names(self._manifests)


class _Names(Sequence[tuple[str, ...]]):
    def __init__(self, manifests: list[list[BucketManifest]]) -> None:
        self._manifests = manifests
        self._made: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._manifests)

    @overload
    def __getitem__(self, index: int) -> tuple[str, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, ...]]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, ...] | Sequence[tuple[str, ...]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        rank = range(len(self))[index]
        made = self._made.get(rank)
        if made is None:
            made = self._made[rank] = tuple(
                itertools.chain.from_iterable(m.names for m in self._manifests[rank])
            )
        return made

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"_Names({[len(m.names) for per_rank in self._manifests for m in per_rank]} per bucket)"


@dataclass
class _Plan:
    targets: WeightTargets  # held so its id stays unique while the plan is cached
    by_device: dict[torch.device, tuple[kernels.ScatterPlan, list[int]]]  # plan, bucket indices
    tiled: bool = False  # every bucket carries a device checksum its entries tile: copies can check it


class WeightReceiver:
    """Opens the payloads of a round through their transport and verifies every bucket.

    Transport receivers are created on first use; give `transports={"nccl": NcclReceiver(...)}`
    for the broadcast transport, which needs its process group. `release()` drops every cached
    handle, mapping, upload buffer and copy plan: the rollout calls it when it sleeps.
    Where CUDA is already initialised (the engine is on its GPU) the copy kernels are compiled
    on construction. `last_timings` holds the phases of the last round in milliseconds (open, verify, copy, close).

    `keep_previous` (with `verify`) chooses what a corrupt round costs in `load_into`. True (the
    default): every bucket is verified before anything is written, so the engine keeps its
    previous weights; three passes over the data (the sender's pack, this verification, the
    copy). False: the copy checksums what it reads and the round is compared afterwards, two
    passes; a corrupt round has then been written (`CorruptBucketError.written`), the engine's
    weights are invalid until the round is sent again. Rounds the copy cannot check whole (host
    checksums, a layout that does not tile its buckets) are verified first either way.

    `digest` (default True): after `load_into` wrote a round, the targets are read back on the
    device and their digest compared with the senders' checksums (`WrittenWeightsError` on a
    mismatch); `last_digest` says whether the last round was checked (True), or could not be
    (None: no device checksum sent, or verification off). About a read of the written bytes.
    """

    def __init__(
        self,
        *,
        verify: bool = True,
        keep_previous: bool = True,
        digest: bool = True,
        transports: Mapping[str, ReceiverTransport] | None = None,
    ) -> None:
        self.verify = verify
        self.keep_previous = keep_previous
        self.digest = digest
        self.last_digest: bool | None = None
        self._transports: dict[str, ReceiverTransport] = dict(transports or {})
        self._uploads: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # device copies of host buckets
        self._plans: OrderedDict[Any, _Plan] = OrderedDict()
        self.plans_built = 0  # copy plans built so far (tests check reuse)
        self.last_timings: dict[str, float] = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            kernels.warm_up()  # the engine is on its GPU: compile the copy kernels now, not in the first sync

    def transport(self, name: str) -> ReceiverTransport:
        """The receiving side of transport `name`, made on first use (nccl must be given at construction)."""
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

    # ------------------------------------------------------------------ the two ways to receive

    @contextlib.contextmanager
    def open(self, payloads: Sequence[RankPayload]) -> Iterator[ReceivedRound]:
        """Open, check and unpack one round; the views are valid inside the block only.

        Every bucket's transport resources are accounted for whether this succeeds or raises:
        opened, or discarded (a cuda_ipc grant released, a broadcast drained).
        """
        first, transport, buckets = self._begin(payloads)
        try:
            self._open_all(transport, buckets)
            for b in buckets:
                b.work = b.region
            self._verify(buckets)
            transport.settle()
            yield ReceivedRound(
                first.version, first.round, first.final, first.transport, buckets, len(payloads)
            )
        finally:
            for b in buckets:
                b.region = b.work = None
            transport.close_round()

    def load_into(
        self,
        payloads: Sequence[RankPayload],
        targets: WeightTargets,
        *,
        before_write: Callable[[], Any] | None = None,
    ) -> LoadedRound:
        """Verify one round, then copy it into `targets` (no intermediate tensor).

        Nothing in `targets` is written unless every tensor matched a target (name, shape, dtype;
        all of them if `targets.complete`) and, with `keep_previous` (the default), every bucket
        of the round passed its checksum; without it the checksums are compared after the copy
        that computed them (`CorruptBucketError` with `written=True`). `before_write` runs
        between the checks and the first write."""
        if not isinstance(targets, WeightTargets):
            if isinstance(payloads, (list, tuple)):
                self.discard(payloads)
            raise TypeError(
                f"WeightReceiver.load_into: targets must be WeightTargets, got {type(targets).__name__}"
            )
        first, transport, buckets = self._begin(payloads)
        if len(targets.tensors) != len(payloads):
            self.discard(payloads)
            raise ValueError(
                f"WeightReceiver.load_into: the engine has {len(targets.tensors)} ranks but the round carries "
                f"{len(payloads)} payloads: the trainer's slot and the engine disagree on the number of GPUs"
            )
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            self._open_all(transport, buckets)
            devices = [_device_of(t) for t in targets.tensors]
            for b in buckets:
                b.work = self._upload(b, devices[b.rank_index])
            timings["open_ms"] = _ms(t0)
            t1 = time.perf_counter()
            if self.verify and not self.keep_previous:
                plan = self._plan(buckets, targets)
                if plan.tiled:
                    self._write_checked(buckets, plan, transport, timings, before_write)
                    self._check_written(buckets, plan, timings)
                    return _loaded(first, buckets, len(payloads))
            pending = self._launch_verify(buckets)
            plan = self._plan(buckets, targets)  # host work, while the device verifies
            gates = _gates(pending, plan)
            for device, (scatter_plan, _indices) in plan.by_device.items():
                if device in gates:  # queued behind the verification, writes only if it passed
                    kernels.scatter_fast(scatter_plan, device, gates[device])
            if pending:
                transport.settle()  # host bookkeeping while the device verifies
            self._check(buckets, pending)  # raises on a bad checksum: the gated copies wrote nothing
            timings["verify_ms"] = _ms(t1)
            if before_write is not None:
                before_write()
            t2 = time.perf_counter()
            for device, (scatter_plan, indices) in plan.by_device.items():
                if device not in gates:
                    kernels.scatter_fast(scatter_plan, device)
                kernels.scatter_slow(scatter_plan, [buckets[i].work for i in indices])  # type: ignore[misc]
            transport.settle()  # (unless done above) while the device copies
            for device in plan.by_device:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
            timings["copy_ms"] = _ms(t2)
            self._check_written(buckets, plan, timings)
            return _loaded(first, buckets, len(payloads))
        finally:
            for b in buckets:
                b.region = b.work = None
            t3 = time.perf_counter()
            transport.close_round()
            timings["close_ms"] = _ms(t3)
            self.last_timings = timings

    def _write_checked(
        self,
        buckets: list[_Bucket],
        plan: _Plan,
        transport: ReceiverTransport,
        timings: dict[str, float],
        before_write: Callable[[], Any] | None,
    ) -> None:
        """The two-pass path: copy every bucket into its targets while checksumming what is read,
        then compare with the senders' values (raises after the write)."""
        if before_write is not None:
            before_write()
        t2 = time.perf_counter()
        pending: dict[torch.device, _Pending] = {}
        for device, (scatter_plan, indices) in plan.by_device.items():
            chosen = [buckets[i] for i in indices]
            sums = kernels.scatter_checked(
                scatter_plan, [_work(b) for b in chosen], [b.manifest.nbytes for b in chosen], device
            )
            pending[device] = _pending(indices, sums, _expected(chosen, device), device)
        transport.settle()  # host bookkeeping while the device copies
        self._check(buckets, pending, written=True)
        for device in plan.by_device:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        timings["copy_ms"] = _ms(t2)

    # ------------------------------------------------------------------ steps

    def _begin(self, payloads: Sequence[RankPayload]) -> tuple[RankPayload, ReceiverTransport, list[_Bucket]]:
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
        buckets = [
            _Bucket(p, i, k, m, d)
            for i, p in enumerate(payloads)
            for k, (m, d) in enumerate(zip(p.buckets, p.descriptors, strict=True))
        ]
        if self.verify:
            unchecked = next((b for b in buckets if b.manifest.checksum_kind == NONE), None)
            if unchecked is not None:
                self.discard(payloads)
                raise WeightSyncError(
                    f"bucket {unchecked.manifest.index} of version {first.version} from rank "
                    f"{unchecked.payload.rank} carries no checksum, and this receiver verifies: build the "
                    "WeightSender with checksums=True, or the WeightReceiver with verify=False",
                    version=first.version,
                )
        return first, transport, buckets

    def _open_all(self, transport: ReceiverTransport, buckets: list[_Bucket]) -> None:
        opened = 0
        try:
            for b in buckets:
                b.region = self._open(transport, b.payload, b.manifest, b.descriptor)
                opened += 1
        except BaseException:
            for b in buckets[opened + 1 :]:
                transport.discard(b.descriptor)
            raise

    def _upload(self, b: _Bucket, device: torch.device | None) -> torch.Tensor:
        """The region to verify and copy from: a host bucket bound for a GPU is copied there
        first (one DMA into a reused buffer), so the check covers the bytes that are written."""
        region = b.region
        assert region is not None
        if device is None or device.type != "cuda" or region.device.type != "cpu":
            return region
        if b.manifest.checksum_kind not in (WSUM64, WSUM64_DEVICE, NONE) and self.verify:
            return region  # a host checksum (CRC32): checked on the host, copied tensor by tensor
        end = padded(b.manifest.nbytes, ALIGN)
        slot = (device, b.rank_index, b.position)
        buffer = self._uploads.get(slot)
        if buffer is None or buffer.numel() < end:
            self._uploads.pop(slot, None)
            buffer = self._uploads[slot] = torch.empty(max(end, 1 << 20), dtype=torch.uint8, device=device)
        take = min(end, region.numel())
        buffer[:take].copy_(region[:take], non_blocking=region.is_pinned())
        if take < end:
            buffer[take:end].zero_()
        return buffer

    def _launch_verify(self, buckets: list[_Bucket]) -> dict[torch.device, _Pending]:
        """Start the device checksums and their comparison (no wait); host checksums (CRC32) are
        checked at once."""
        pending: dict[torch.device, _Pending] = {}
        if not self.verify:
            return pending
        groups: dict[torch.device, list[int]] = {}
        for i, b in enumerate(buckets):
            assert b.work is not None
            kind = b.manifest.checksum_kind
            if kind in (WSUM64, WSUM64_DEVICE):
                groups.setdefault(b.work.device, []).append(i)
            else:
                self._compare(b, checksum(b.work, b.manifest.nbytes, kind), b.manifest.checksum)
        for device, indices in groups.items():
            chosen = [buckets[i] for i in indices]
            sums = kernels.region_sums(
                [_work(b) for b in chosen], [b.manifest.nbytes for b in chosen], device
            )
            pending[device] = _pending(indices, sums, _expected(chosen, device), device)
        return pending

    def _check(
        self, buckets: list[_Bucket], pending: dict[torch.device, _Pending], *, written: bool = False
    ) -> None:
        for p in pending.values():
            if p.event is not None:
                p.event.synchronize()  # the checksums only; copies queued after them run on
            got, want = p.host[0].tolist(), p.host[1].tolist()
            for i, actual, expected in zip(p.indices, got, want, strict=True):
                self._compare(buckets[i], wsum64_value(actual), wsum64_value(expected), written=written)

    def _check_written(self, buckets: list[_Bucket], plan: _Plan, timings: dict[str, float]) -> None:
        """Read back what the round wrote, on its devices, and compare with the senders' sums."""
        self.last_digest = None
        if not (self.digest and self.verify):
            return
        t0 = time.perf_counter()
        checked = False
        for device, (scatter_plan, indices) in plan.by_device.items():
            chosen = [buckets[i] for i in indices]
            sent = sent_sums([(_work(b), b.manifest) for b in chosen], device)
            if sent is None:
                return  # host checksums: nothing on the device to compare with
            check_written(
                kernels.scatter_digest(scatter_plan, device),
                sent,
                [(b.payload, b.manifest) for b in chosen],
                after="the copy",
            )
            checked = True
        self.last_digest = checked or None
        timings["digest_ms"] = _ms(t0)

    def _verify(self, buckets: list[_Bucket]) -> None:
        self._check(buckets, self._launch_verify(buckets))

    @staticmethod
    def _compare(b: _Bucket, actual: int, expected: int, *, written: bool = False) -> None:
        manifest, p = b.manifest, b.payload
        if actual != expected:
            after = (
                "; the round was written while checked (WeightReceiver(keep_previous=False)): the "
                "targets hold part of it and are not valid until a round loads whole (send it again)"
                if written
                else ""
            )
            raise CorruptBucketError(
                f"bucket {manifest.index} of version {p.version} from rank {p.rank} (slot {p.slot}, "
                f"transport {p.transport}) fails its {manifest.checksum_kind} checksum: expected "
                f"{expected:#x}, got {actual:#x}; it was corrupted or truncated in transit{after}",
                version=p.version,
                rank=p.rank,
                bucket=manifest.index,
                round=p.round,
                written=written,
            )

    def _plan(self, buckets: list[_Bucket], targets: WeightTargets) -> _Plan:
        works = [_work(b) for b in buckets]
        key = (
            id(targets),
            tuple(
                (b.rank_index, w.data_ptr(), w.device, b.manifest.checksum_kind, b.manifest.entries_key)
                for b, w in zip(buckets, works, strict=True)
            ),
        )
        found = self._plans.get(key)
        if found is not None and found.targets is targets:
            self._plans.move_to_end(key)
            return found
        per_device: dict[torch.device, list[int]] = {}
        resolved: list[list[torch.Tensor]] = []
        for i, b in enumerate(buckets):
            resolved.append(_resolve(b, targets.tensors[b.rank_index]))
            assert b.work is not None
            per_device.setdefault(_device_of_list(resolved[-1]) or b.work.device, []).append(i)
        if targets.complete:
            for rank, mapping in enumerate(targets.tensors):
                got = {n for b in buckets if b.rank_index == rank for n in b.manifest.names}
                missing = sorted(set(mapping) - got)
                if missing:
                    raise ValueError(
                        f"weight version {buckets[0].payload.version} is incomplete for engine rank {rank}: "
                        f"missing {missing[:6]}{'...' if len(missing) > 6 else ''} ({len(missing)} tensors); "
                        "the previous weights stay loaded"
                    )
        by_device = {}
        for device, indices in per_device.items():
            pieces = [(buckets[i].work, buckets[i].manifest.packed, resolved[i]) for i in indices]
            by_device[device] = (kernels.plan_scatter(pieces, device), indices)  # type: ignore[arg-type]
        tiled = all(
            b.manifest.checksum_kind in (WSUM64, WSUM64_DEVICE)
            and _work(b).device == device
            and tiles_bucket(b.manifest.entries, b.manifest.nbytes)
            for device, (_scatter, indices) in by_device.items()
            for b in (buckets[i] for i in indices)
        )
        plan = _Plan(targets, by_device, tiled)
        self._plans[key] = plan
        while len(self._plans) > 64:  # a streamed update has a plan per round
            self._plans.popitem(last=False)
        self.plans_built += 1
        return plan

    # ------------------------------------------------------------------ accounting

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
        """Drop the cached handles and mappings, the device copies of host buckets and the copy plans (on sleep)."""
        for transport in self._transports.values():
            transport.release()
        self._uploads.clear()
        self._plans.clear()

    def open_handles(self) -> int:
        """Cached IPC handles and shared-memory mappings held now (0 after `release()`)."""
        return sum(int(getattr(t, "open_handles", 0)) for t in self._transports.values())


@dataclass
class _Pending:
    """A device group's verification in flight: the buckets, pinned host copies of (sums,
    expected), the event after those copies, and the on-device verdict that gates the copies."""

    indices: list[int]
    host: torch.Tensor
    event: torch.cuda.Event | None
    gate: torch.Tensor


def _pending(
    indices: list[int], sums: torch.Tensor, expected: torch.Tensor, device: torch.device
) -> _Pending:
    """Start reading a device group's (sums, expected) back (pinned, no wait) and compare them on
    the device (the verdict that may gate a copy)."""
    gate = kernels.verdict(sums, expected)
    cuda = device.type == "cuda"
    host = torch.empty((2, len(indices), 2), dtype=torch.int64, pin_memory=cuda)
    host[0].copy_(sums, non_blocking=cuda)
    host[1].copy_(expected, non_blocking=cuda)
    event = None
    if cuda:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
    return _Pending(indices, host, event, gate)


def _loaded(first: RankPayload, buckets: list[_Bucket], ranks: int) -> LoadedRound:
    manifests: list[list[BucketManifest]] = [[] for _ in range(ranks)]
    for b in buckets:
        manifests[b.rank_index].append(b.manifest)
    return LoadedRound(first.version, first.round, first.final, first.transport, manifests)


def _gates(pending: dict[torch.device, _Pending], plan: _Plan) -> dict[torch.device, torch.Tensor]:
    """Verdicts that may gate the copies on the device: only when the round verifies and copies
    on one device (a verdict cannot stop another device's copies, so those wait for the host)."""
    if len(pending) != 1 or set(plan.by_device) != set(pending):
        return {}
    return {device: p.gate for device, p in pending.items()}


def _expected(chosen: list[_Bucket], device: torch.device) -> torch.Tensor:
    sent = sent_sums([(_work(b), b.manifest) for b in chosen], device)
    assert sent is not None, "verified on the device: every bucket carries a WSUM64"
    return sent


def sent_sums(
    buckets: Sequence[tuple[torch.Tensor, BucketManifest]], device: torch.device
) -> torch.Tensor | None:
    """The senders' (s1, s2) of each verified (region, manifest) as an (n, 2) int64 tensor on
    `device`: read from the bucket's trailer (WSUM64_DEVICE, no host round trip), made from the
    manifest's value (WSUM64), or, for a bucket the sender checksummed on the host (CRC32, SUM32)
    and the receiver verified against it, computed here over the verified bytes. None if a bucket
    carries no checksum: what was written cannot be compared with anything sent."""
    rows = []
    for region, manifest in buckets:
        if manifest.checksum_kind == WSUM64_DEVICE:
            rows.append(checksum_trailer(region, manifest.nbytes).to(device))
        elif manifest.checksum_kind == WSUM64:
            value = manifest.checksum
            rows.append(
                torch.tensor(
                    [value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF], dtype=torch.int64, device=device
                )
            )
        elif manifest.checksum_kind in (CRC32, SUM32):
            rows.append(wsum64_sums(region, manifest.nbytes).to(device))
        else:
            return None
    return torch.stack(rows) if rows else None


def check_written(
    written: torch.Tensor,
    sent: torch.Tensor,
    buckets: Sequence[tuple[RankPayload, BucketManifest]],
    *,
    after: str,
) -> None:
    """Raise `WrittenWeightsError` naming the buckets whose written digest (`written`, per bucket)
    differs from the senders' sums (`sent`) mod 2**32; `after`: what wrote them (one host sync)."""
    differs = ((written - sent) & 0xFFFFFFFF).ne(0).any(dim=1)
    bad = [int(i) for i in differs.nonzero().flatten().tolist()]
    if not bad:
        return
    payload, manifest = buckets[bad[0]]
    indices = [buckets[i][1].index for i in bad]
    raise WrittenWeightsError(
        f"version {payload.version} round {payload.round}: after {after}, what the engine's tensors hold "
        f"differs from what was sent in bucket(s) {indices} of rank {payload.rank} (the digest of the written "
        f"tensors against the senders' {manifest.checksum_kind}); the weights are not what the trainer sent "
        "and stay unknown until a round loads whole",
        version=payload.version,
        round=payload.round,
        rank=payload.rank,
        buckets=indices,
        written=True,
    )


def _work(b: _Bucket) -> torch.Tensor:
    assert b.work is not None
    return b.work


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 3)


def _device_of(mapping: Mapping[str, torch.Tensor]) -> torch.device | None:
    for tensor in mapping.values():
        return tensor.device
    return None


def _device_of_list(tensors: list[torch.Tensor]) -> torch.device | None:
    return tensors[0].device if tensors else None


def _resolve(b: _Bucket, mapping: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The target of every entry of a bucket, checked against the entry (before any write)."""
    out = []
    for entry in b.manifest.entries:
        target = mapping.get(entry.name)
        if target is None:
            known = sorted(mapping)
            raise ValueError(
                f"weight version {b.payload.version}: the engine has no tensor {entry.name!r} (from rank "
                f"{b.payload.rank}); it has {known[:6]}{'...' if len(known) > 6 else ''}"
            )
        dtype = dtype_from_name(entry.dtype)
        if tuple(target.shape) != tuple(entry.shape) or target.dtype != dtype:
            raise ValueError(
                f"weight version {b.payload.version}: {entry.name!r} arrived as {tuple(entry.shape)} {dtype}, "
                f"the engine has {tuple(target.shape)} {target.dtype}"
            )
        out.append(target)
    return out


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

    def retry(self, version: int, round_index: int) -> None:
        """Round `round_index` of `version` failed where it may be sent again (a corrupt bucket):
        the next round admitted may be that one (or a round 0)."""
        if round_index == 0 or self.staging != version:
            self.abort()
        else:
            self.next_round = round_index

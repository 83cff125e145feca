"""The sending side of a weight sync: `WeightSender`, the slot coordinator, deadlines.

One update carries its version with its data. Each round, every rank of a slot packs its buckets;
the ranks check in with the slot's coordinator through the job's c10d store, which has clean
deadlines, and once all are there the coordinator gathers their payloads (manifests and transport
descriptors) over the slot's gloo group. The coordinator alone calls the engine, with one payload
per slot rank in rank order, and reports the outcome to the others. Every wait has a deadline; a
timeout names the slot, the version, what was awaited, from whom, for how long, and the likely
cause. A rank outside every slot does nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import itertools
import math
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from actor_integration.errors import CorruptBucketError, WeightSyncError, WeightSyncTimeout
from actor_integration.weight_sync.buckets import ArenaBucket, Bucket, LayoutCache, iter_buckets
from actor_integration.weight_sync.topology import RankSlot
from actor_integration.weight_sync.transport import SenderTransport, emit
from actor_integration.weight_sync.wire import RankPayload, payload_mismatch
from lifecycle.hooks import EventSink
from lifecycle.logs import Event

__all__ = ["StagingArena", "SyncReport", "WeightSender"]


@dataclass(frozen=True)
class SyncReport:
    """What `WeightSender.send` did on this rank."""

    version: int
    slot: int | None
    rank: int
    coordinator: bool
    transport: str
    nbytes: int
    buckets: int
    rounds: int
    duration_s: float
    engine_results: tuple[Any, ...] = ()  # the coordinator's engine_call results, one per round
    phases_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # pack_ms: exporting (layout, launching the packing copies); pack_cpu_ms: the CPU time the
    # sending thread spent in it (far below pack_ms: it waited, for the GIL another thread held,
    # a driver lock or a blocking call); ready_ms: waiting for the packing and checksums;
    # engine_ms: waiting for acknowledgements (overlaps packing when pipelined)
    resends: int = 0  # rounds the engine found corrupt and that were packed and sent again

    @property
    def gbps(self) -> float:
        return self.nbytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


class StagingArena:
    """Views into a sender's staging buffers, one per tensor (`tensors`): write the weights there,
    then `sender.send(version, arena)`; end to end is then the engine's copy alone."""

    def __init__(
        self, sender: WeightSender, tensors: dict[str, torch.Tensor], buckets: tuple[ArenaBucket, ...]
    ) -> None:
        self.sender = sender
        self.tensors = tensors
        self.buckets = buckets

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def items(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.tensors.items()


@dataclasses.dataclass
class _Round:
    """A round handed over and not yet acknowledged."""

    payload: RankPayload
    started: float  # time.monotonic() when handed over (followers: when they arrived)
    board: _Board | None
    others: list[int]
    future: concurrent.futures.Future[Any] | None  # the engine call (coordinator only)


def _add(phases: dict[str, float], key: str, seconds: float) -> None:
    phases[key] = phases.get(key, 0.0) + seconds


def _started() -> tuple[float, float]:
    """(wall, this thread's CPU) clocks at the start of a phase."""
    return time.perf_counter(), time.thread_time()


_UNSET: Any = object()


class _Peekable:
    """The planned buckets, looked ahead only when asked (`exhausted`): the next bucket's tensors
    are checked after this one's copy is launched, so the device starts at the first bucket."""

    def __init__(self, it: Iterator[Bucket]) -> None:
        self._it = it
        self._next: Bucket | None = _UNSET

    def _peek(self) -> Bucket | None:
        if self._next is _UNSET:
            self._next = next(self._it, None)
        return self._next

    def take(self) -> Bucket | None:
        current = self._peek()
        self._next = _UNSET
        return current

    @property
    def exhausted(self) -> bool:
        return self._peek() is None


class WeightSender:
    """The trainer side of one rank; use inside the trainer's `run("sync", ...)` body.

    `engine_call(version, payloads)` is called on the coordinator only, once per round, with one
    payload per slot rank in rank order; in Ray it is
    `ray.get(rollout.update_weights.remote(version, payloads), timeout=...)`. `named_tensors`
    given to `send` are the full (TP-gathered) tensors this rank provides for its GPU, from GPU
    memory or a CPU backup; they are consumed one bucket at a time.

    `slot_group` is the slot's gloo group, or a handle whose `.group` is the live one (the
    `GroupHandle` of `ReloadableProcessGroups.new_group`, which survives a process-group reload).
    `deadline_s` bounds every wait on other ranks, `engine_deadline_s` (default: `deadline_s`)
    the engine's acknowledgement. `round_buckets` is how many buckets one round carries (default:
    the transport's: all for cuda_ipc and disk, one for shm and nccl). `store` is the c10d store
    for check-ins (default: the job's default store; only multi-rank slots use it).

    `checksums=False`: manifests carry no checksum (receivers must not verify). `pipelined=True`
    (cuda_ipc, with rounds of fewer buckets than the update): round r + 1 is packed into a second
    set of staging buffers while the engine loads round r. Off by default: a colocated trainer and
    engine time-slice one GPU (no MPS), so their kernels do not overlap, and on the H200 the
    switching cost more than the overlap hid.

    `corrupt_resends` (default 1): how many times a round the engine refuses as corrupt
    (`CorruptBucketError`: a bucket failed its checksum) is packed again from the same tensors and
    sent again before `send` raises that error. Every rank of the slot re-sends together. Not for
    an arena's round (the arena is the only copy of its bytes) nor a pipelined one.
    """

    def __init__(
        self,
        topology_slot: RankSlot,
        slot_group: Any,
        transport: SenderTransport,
        *,
        rank: int,
        engine_call: Callable[[int, list[RankPayload]], Any] | None,
        bucket_bytes: int,
        deadline_s: float,
        engine_deadline_s: float | None = None,
        round_buckets: int | None = -1,
        lifecycle: EventSink | None = None,
        store: Any = None,
        checksums: bool = True,
        pipelined: bool = False,
        corrupt_resends: int = 1,
    ) -> None:
        if not isinstance(topology_slot, RankSlot):
            raise TypeError(
                f"WeightSender: topology_slot must be a RankSlot, got {type(topology_slot).__name__}"
            )
        if topology_slot.rank != rank:
            raise ValueError(
                f"WeightSender: rank={rank} but the topology slot is for rank {topology_slot.rank}; "
                "pass topology.for_rank(rank)"
            )
        if not isinstance(transport, SenderTransport):
            raise TypeError(
                f"WeightSender: transport must be a SenderTransport, got {type(transport).__name__}"
            )
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ValueError(f"WeightSender: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        for name, value in (("deadline_s", deadline_s), ("engine_deadline_s", engine_deadline_s)):
            if value is not None and (
                not isinstance(value, (int, float)) or not value > 0 or math.isinf(value)
            ):
                raise ValueError(f"WeightSender: {name} must be a positive number of seconds, got {value!r}")
        if topology_slot.is_coordinator and not callable(engine_call):
            raise ValueError(
                f"WeightSender: rank {rank} coordinates slot {topology_slot.slot} and must be given "
                "engine_call(version, payloads), the call that reaches the rollout engine"
            )
        if len(topology_slot.ranks) > 1 and slot_group is None:
            raise ValueError(
                f"WeightSender: slot {topology_slot.slot} has ranks {list(topology_slot.ranks)}; pass its gloo "
                "group (SlotTopology.create_groups on every rank, then groups[slot])"
            )
        if transport.name == "nccl" and len(topology_slot.ranks) > 1:
            raise ValueError(
                "WeightSender: the nccl transport broadcasts from one source rank; give it a one-rank slot "
                "(RankSlot.single(rank)) on the source rank"
            )
        if not isinstance(corrupt_resends, int) or isinstance(corrupt_resends, bool) or corrupt_resends < 0:
            raise ValueError(
                f"WeightSender: corrupt_resends must be a non-negative int, got {corrupt_resends!r}"
            )
        if round_buckets == -1:
            round_buckets = transport.default_round_buckets
        if round_buckets is not None and (not isinstance(round_buckets, int) or round_buckets < 1):
            raise ValueError(
                f"WeightSender: round_buckets must be a positive int or None, got {round_buckets!r}"
            )
        self.slot = topology_slot
        self.group = slot_group
        self.transport = transport
        self.rank = rank
        self.engine_call = engine_call
        self.bucket_bytes = bucket_bytes
        self.deadline_s = float(deadline_s)
        self.engine_deadline_s = float(engine_deadline_s if engine_deadline_s is not None else deadline_s)
        self.round_buckets = round_buckets
        self.lifecycle = lifecycle
        self.store = store  # c10d store for arrivals and reports; default: the job's default store
        self.last_version: int | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._broken: str | None = None
        if pipelined and not transport.double_buffered:
            raise ValueError(
                f"WeightSender: pipelined=True needs a double-buffered transport; {transport.name!r} reuses "
                "one buffer per position (use 'cuda_ipc')"
            )
        transport.checksums = bool(checksums)
        transport.pipelined = bool(pipelined)
        self.pipelined = bool(pipelined)
        self.corrupt_resends = corrupt_resends
        self.layouts = LayoutCache()  # the previous update's layouts, reused while shapes repeat

    # ------------------------------------------------------------------ public

    def send(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StagingArena,
    ) -> SyncReport:
        """Send one version of the weights; returns when the engine acknowledged every round.

        `named_tensors` may be an arena (`arena()`) the trainer wrote in place: nothing is packed."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"WeightSender.send: version must be a non-negative int, got {version!r}")
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"WeightSender.send: version {version} is not newer than {self.last_version}, the last one this "
                "rank sent; versions must strictly increase"
            )
        if self._broken is not None:
            raise WeightSyncError(
                f"WeightSender of rank {self.rank} is unusable: {self._broken}. The slot group and the engine "
                "state are unknown after that; restart the job (or recreate the slot groups and the sender).",
                slot=self.slot.slot,
                version=version,
            )
        start = time.perf_counter()
        nbytes = buckets = rounds = resends = 0
        results: list[Any] = []
        phases: dict[str, float] = {}
        error: BaseException | None = None
        try:
            if self.slot.slot is not None:
                nbytes, buckets, rounds, resends = self._send_rounds(version, named_tensors, results, phases)
            self.last_version = version
            return SyncReport(
                version=version,
                slot=self.slot.slot,
                rank=self.rank,
                coordinator=self.slot.is_coordinator,
                transport=self.transport.name,
                nbytes=nbytes,
                buckets=buckets,
                rounds=rounds,
                duration_s=time.perf_counter() - start,
                engine_results=tuple(results),
                phases_ms={k: round(v * 1e3, 3) for k, v in phases.items()},
                resends=resends,
            )
        except BaseException as exc:
            error = exc
            if isinstance(exc, WeightSyncTimeout):
                self._broken = f"version {version} timed out ({exc.fields.get('awaited')})"
            raise
        finally:
            elapsed = time.perf_counter() - start
            fields: dict[str, Any] = {
                "slot": self.slot.slot,
                "version": version,
                "transport": self.transport.name,
                "coordinator": self.slot.is_coordinator,
                "ranks": list(self.slot.ranks),
                "bytes": nbytes,
                "buckets": buckets,
                "rounds": rounds,
                "resends": resends,
                "duration_ms": round(elapsed * 1e3, 3),
                "gbps": round(nbytes / elapsed / 1e9, 3) if elapsed > 0 and nbytes else 0.0,
                "ok": error is None,
            }
            if error is not None:
                fields["error"] = repr(error)
            emit(self.lifecycle, Event.SYNC_UPDATE, "info" if error is None else "error", **fields)

    def arena(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> StagingArena:
        """Staging buffers laid out for these names, shapes and dtypes (the tensors' data is not
        read; meta tensors do), for the trainer to write its converted weights into directly;
        `send(version, arena)` then packs nothing. Valid until `release()` or the next `arena()`."""
        regions_for = getattr(self.transport, "arena_regions", None)
        if regions_for is None:
            raise ValueError(
                f"WeightSender.arena: transport {self.transport.name!r} has no staging arena; use 'cuda_ipc'"
            )
        planned = list(
            iter_buckets(named_tensors, self.bucket_bytes, align=self.transport.align, layout_only=True)
        )
        regions: list[torch.Tensor] = regions_for([b.nbytes for b in planned])
        buckets: list[ArenaBucket] = []
        views: dict[str, torch.Tensor] = {}
        for bucket, region in zip(planned, regions, strict=True):
            region.zero_()
            tensors = tuple(
                region[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
                for e, t in zip(bucket.entries, bucket.tensors, strict=True)
            )
            buckets.append(
                ArenaBucket(bucket.index, tensors, bucket.entries, bucket.nbytes, region, f"a{bucket.index}")
            )
            views.update(zip(bucket.entries.names, tensors, strict=True))
        return StagingArena(self, views, tuple(buckets))

    def release(self) -> None:
        """Free the transport's staging buffers (call when the trainer sleeps, if configured)."""
        self.transport.release()

    def close(self) -> None:
        """Close the transport and shut down the thread that calls the engine."""
        self.transport.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # ------------------------------------------------------------------ rounds

    def _send_rounds(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StagingArena,
        results: list[Any],
        phases: dict[str, float],
    ) -> tuple[int, int, int, int]:
        """Send the update round by round: (bytes, buckets, rounds, rounds re-sent)."""
        planned = _Peekable(self._plan(named_tensors))
        if planned.exhausted:
            raise ValueError(f"WeightSender.send(version={version}): no tensors given")
        # Pipelined: round r + 1 is packed (into the other buffers) while the engine loads round r.
        pipelined = self.pipelined
        limit = self.round_buckets if self.round_buckets is not None else math.inf
        nbytes = buckets = 0
        inflight: _Round | None = None
        exported: list[Any] = []
        resends = 0
        try:
            for round_index in itertools.count():
                t0 = _started()
                self.transport.begin_round(version, round_index)
                taken: list[Bucket] = []  # kept until acknowledged: a corrupt round is packed again
                exported = []
                while len(exported) < limit:
                    bucket = planned.take()
                    if bucket is None:
                        break
                    taken.append(bucket)
                    exported.append(self.transport.export(len(exported), bucket))
                payload = self._payload(version, round_index, planned.exhausted, exported, t0, phases)
                if inflight is not None:
                    done, inflight = inflight, None
                    self._finish(done, results, phases)
                inflight = self._start(payload)
                exported = []  # handed over: the engine accounts for them now
                attempt = 0
                while not pipelined or payload.final:
                    done, inflight = inflight, None
                    try:
                        self._finish(done, results, phases)
                        break
                    except CorruptBucketError as error:
                        if not self._may_resend(attempt, taken):
                            raise self._gave_up(error, attempt) from error
                    # The bytes went bad between the packing and the engine's check (or in the
                    # engine): pack the round again from the trainer's tensors and hand it over.
                    attempt += 1
                    resends += 1
                    t0 = _started()
                    self.transport.begin_round(version, round_index)
                    for bucket in taken:
                        exported.append(self.transport.export(len(exported), bucket))
                    payload = self._payload(version, round_index, payload.final, exported, t0, phases)
                    inflight = self._start(payload, attempt)
                    exported = []
                nbytes += payload.nbytes
                buckets += len(payload.buckets)
                if payload.final:
                    return nbytes, buckets, round_index + 1, resends
        except BaseException:
            if inflight is not None:  # let the round the engine is loading finish first
                with contextlib.suppress(BaseException):
                    self._finish(inflight, results, phases)
            if exported:
                self.transport.abandon(exported)
            raise
        raise AssertionError("unreachable")

    def _payload(
        self,
        version: int,
        round_index: int,
        final: bool,
        exported: list[Any],
        t0: tuple[float, float],
        phases: dict[str, float],
    ) -> RankPayload:
        """The round's payload once the transport has its manifests (after the exports)."""
        t1, c1 = time.perf_counter(), time.thread_time()
        manifests = self.transport.ready()
        _add(phases, "pack_ms", t1 - t0[0])
        _add(phases, "pack_cpu_ms", c1 - t0[1])
        _add(phases, "ready_ms", time.perf_counter() - t1)
        return RankPayload(
            version=version,
            round=round_index,
            final=final,
            slot=self.slot.slot,
            rank=self.rank,
            transport=self.transport.name,
            sender=self.transport.sender_id,
            gpu=self.transport.gpu,
            buckets=tuple(manifests),
            descriptors=tuple(exported),
        )

    def _may_resend(self, attempt: int, taken: list[Bucket]) -> bool:
        """Whether a round the engine found corrupt is sent again; every rank of the slot decides
        the same from the same settings. Never an arena's round: the arena is the only copy of
        its bytes, and checksumming it again would vouch for the corruption. Never a pipelined
        round: the next one is already packed behind it."""
        return (
            attempt < self.corrupt_resends
            and not self.pipelined
            and not any(isinstance(b, ArenaBucket) for b in taken)
        )

    def _gave_up(self, error: CorruptBucketError, attempt: int) -> CorruptBucketError:
        if attempt == 0:
            return error
        return CorruptBucketError(
            f"{error}. The round was packed and sent again {attempt} time(s) and failed again: not a "
            "transient fault; suspect the GPU or host memory, or a process writing into the staging "
            "buffers. The engine's weights are as its log says (kept with WeightReceiver(keep_previous="
            "True), invalid until the next sync otherwise).",
            **{**error.fields, "resends": attempt},
        )

    def _plan(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StagingArena
    ) -> Iterator[Bucket]:
        if isinstance(named_tensors, StagingArena):
            if named_tensors.sender is not self:
                raise ValueError("WeightSender.send: this arena belongs to another sender")
            return iter(named_tensors.buckets)
        return iter_buckets(named_tensors, self.bucket_bytes, align=self.transport.align, cache=self.layouts)

    def _start(self, payload: RankPayload, attempt: int = 0) -> _Round:
        """Hand the round over: the coordinator has the engine call running when this returns;
        a follower has delivered its payload to the coordinator."""
        t0 = time.monotonic()
        if not self.slot.is_coordinator:
            return self._follow_start(payload, t0, attempt)
        others = [r for r in self.slot.ranks if r != self.rank]
        board = self._board(payload, attempt) if others else None
        if board is not None:
            missing = board.await_arrivals(others, t0 + self.deadline_s)
            if missing:
                error = self._timeout(
                    payload,
                    awaited="the slot ranks to call send()",
                    missing=missing,
                    waited_s=time.monotonic() - t0,
                    cause=(
                        "those ranks did not call send() for this version: they skipped the sync, crashed, are "
                        "blocked in another collective, or built a different slot topology"
                    ),
                    extra=f"arrived: {sorted(set(self.slot.ranks) - set(missing))}",
                )
                board.post("go", [r for r in others if r not in missing], error)
                raise error
            board.post("go", others, None)
        try:
            payloads = self._gather(payload, t0 + 2 * self.deadline_s) if others else [payload]
            mismatch = payload_mismatch(payloads)
            if mismatch is not None:
                raise WeightSyncError(
                    f"weight sync of slot {self.slot.slot}, version {payload.version}, round {payload.round}: "
                    f"{mismatch}",
                    slot=self.slot.slot,
                    version=payload.version,
                )
        except WeightSyncError as error:
            if board is not None:
                board.post("status", others, error)
            raise
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync-engine")
        assert self.engine_call is not None
        future = self._executor.submit(self.engine_call, payload.version, payloads)
        return _Round(payload, time.monotonic(), board, others, future)

    def _finish(self, inflight: _Round, results: list[Any], phases: dict[str, float]) -> None:
        """Wait for the engine's acknowledgement of a round (followers: the coordinator's report)."""
        t0 = time.perf_counter()
        try:
            if inflight.future is None:
                self._follow_finish(inflight)
            else:
                results.append(self._await_engine(inflight))
        finally:
            _add(phases, "engine_ms", time.perf_counter() - t0)
        self.transport.end_round()

    def _await_engine(self, inflight: _Round) -> Any:
        payload, future, board = inflight.payload, inflight.future, inflight.board
        assert future is not None
        try:
            self.transport.push()
            try:
                remaining = max(self.engine_deadline_s - (time.monotonic() - inflight.started), 0.0)
                result = future.result(timeout=remaining)
            except concurrent.futures.TimeoutError:
                raise self._timeout(
                    payload,
                    awaited="the engine's acknowledgement",
                    missing=["engine"],
                    waited_s=time.monotonic() - inflight.started,
                    cause=(
                        "the rollout engine did not finish loading in time: it may still be generating (pause "
                        "generation before syncing), have its weights released (wake_up(tags=['weights']) "
                        "first), be blocked on another call, or be dead; or engine_deadline_s is too short for "
                        "this model"
                    ),
                ) from None
            except Exception as exc:
                # A corrupt bucket keeps its type (it survives the pickling to the followers), so
                # every rank of the slot can decide to send the round again.
                refused = CorruptBucketError if _is_corrupt(exc) else WeightSyncError
                raise refused(
                    f"weight sync of slot {self.slot.slot}: the engine refused version {payload.version} "
                    f"(round {payload.round}): {exc}",
                    slot=self.slot.slot,
                    version=payload.version,
                    round=payload.round,
                ) from exc
        except WeightSyncError as error:
            if board is not None:
                board.post("status", inflight.others, error)
            raise
        if board is not None:
            board.post("status", inflight.others, None)
        return result

    def _follow_start(self, payload: RankPayload, t0: float, attempt: int) -> _Round:
        coordinator = self.slot.coordinator
        assert coordinator is not None
        board = self._board(payload, attempt)
        board.arrive(self.rank)
        # The coordinator may enter up to deadline_s after us and then wait deadline_s for others.
        go = board.await_message("go", self.rank, t0 + 2 * self.deadline_s)
        if go is _MISSING:
            raise self._timeout(
                payload,
                awaited="the coordinator to start the round",
                missing=[coordinator],
                waited_s=time.monotonic() - t0,
                cause="the coordinator did not call send() for this version, or died",
            )
        if go is not None:
            raise go
        self._gather(payload, t0 + 3 * self.deadline_s)
        return _Round(payload, t0, board, [], None)

    def _follow_finish(self, inflight: _Round) -> None:
        payload, board, t0 = inflight.payload, inflight.board, inflight.started
        assert board is not None and self.slot.coordinator is not None
        status = board.await_message("status", self.rank, t0 + 3 * self.deadline_s + self.engine_deadline_s)
        if status is _MISSING:
            raise self._timeout(
                payload,
                awaited="the coordinator's report",
                missing=[self.slot.coordinator],
                waited_s=time.monotonic() - t0,
                cause="the coordinator died while calling the engine (its own engine deadline should have fired)",
            )
        if status is not None:
            raise status

    def _gather(self, payload: RankPayload, deadline: float) -> list[RankPayload]:
        """One payload per slot rank onto the coordinator, over the slot's gloo group."""
        coordinator = self.slot.coordinator
        gathered: list[Any] | None = [None] * len(self.slot.ranks) if self.slot.is_coordinator else None
        t0 = time.monotonic()
        # A handle whose `.group` is the live group (ReloadableProcessGroups) survives a reload.
        group = (
            self.group
            if isinstance(self.group, dist.ProcessGroup)
            else getattr(self.group, "group", self.group)
        )
        try:
            _with_deadline(
                lambda: dist.gather_object(payload, gathered, dst=coordinator, group=group), deadline
            )
        except (TimeoutError, RuntimeError) as exc:
            raise self._timeout(
                payload,
                awaited="the gather of payloads over the slot group",
                missing=[r for r in self.slot.ranks if r != self.rank],
                waited_s=time.monotonic() - t0,
                cause=f"a slot rank died or stalled after it arrived ({exc})",
            ) from exc
        return list(gathered) if gathered is not None else []

    def _board(self, payload: RankPayload, attempt: int = 0) -> _Board:
        # Looked up per round: reloading the process groups (after a sleep) replaces the store.
        store = self.store if self.store is not None else dist.distributed_c10d._get_default_store()
        prefix = f"weight_sync/{'-'.join(map(str, self.slot.ranks))}/v{payload.version}/r{payload.round}"
        return _Board(store, prefix + (f"/resend{attempt}" if attempt else ""))

    def _timeout(
        self,
        payload: RankPayload,
        *,
        awaited: str,
        missing: Sequence[int | str],
        waited_s: float,
        cause: str,
        extra: str = "",
    ) -> WeightSyncTimeout:
        who = ", ".join(str(m) for m in missing)
        message = (
            f"weight sync timed out: rank {self.rank} of slot {self.slot.slot} (ranks {list(self.slot.ranks)}), "
            f"version {payload.version}, round {payload.round}, waited {waited_s:.1f} s for {awaited}; "
            f"no answer from: {who}{f' ({extra})' if extra else ''}. Likely cause: {cause}. After a timeout "
            "the slot group is broken: restart the job, or recreate the groups and the senders."
        )
        return WeightSyncTimeout(
            message,
            slot=self.slot.slot,
            version=payload.version,
            awaited=awaited,
            waiting_rank=self.rank,
            missing=list(missing),
            waited_s=round(waited_s, 3),
            cause=cause,
        )


# ----------------------------------------------------------------------------------------------
# Rendezvous with deadlines.
#
# Arrivals and reports go through the job's c10d store: `Store.wait(keys, timeout)` fails cleanly
# and `check` names who is missing. Gloo alone cannot do this: a `Work.wait(timeout)` that expires
# closes every pair of the group, and an abandoned send or receive aborts the process when the
# group is destroyed. So the slot group carries the payloads only once every rank is known to be
# there.

_MISSING = object()


class _Board:
    """Keys under one (slot, version, round): arrived/<rank>, go/<rank>, status/<rank>."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def arrive(self, rank: int) -> None:
        self.store.set(self._key("arrived", rank), b"1")

    def await_arrivals(self, ranks: list[int], deadline: float) -> list[int]:
        """The ranks whose arrival key is not there by the deadline (arrival keys are consumed)."""
        missing = []
        for rank in ranks:
            key = self._key("arrived", rank)
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                self.store.wait([key], datetime.timedelta(seconds=remaining))
            except (TimeoutError, RuntimeError):
                if not self.store.check([key]):
                    missing.append(rank)
                    continue
            self.store.delete_key(key)
        return missing

    def post(self, kind: str, ranks: list[int], message: WeightSyncError | None) -> None:
        blob = pickle.dumps(message)
        for rank in ranks:
            self.store.set(self._key(kind, rank), blob)

    def await_message(self, kind: str, rank: int, deadline: float) -> Any:
        key = self._key(kind, rank)
        try:
            self.store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except (TimeoutError, RuntimeError):
            if not self.store.check([key]):
                return _MISSING
        message = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return message


def _is_corrupt(exc: BaseException | None) -> bool:
    """Whether an engine call failed on a corrupt bucket: the error itself, what it wraps, or a
    Ray task error's `cause`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CorruptBucketError):
            return True
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return False


def _with_deadline(fn: Callable[[], Any], deadline: float) -> Any:
    """Run a blocking collective in a daemon thread; TimeoutError at the deadline."""
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the waiting thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="weight-sync-gather", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError("deadline passed")
    ok, value = outcome[0]
    if not ok:
        raise RuntimeError(str(value).splitlines()[0] if str(value) else repr(value)) from value
    return value

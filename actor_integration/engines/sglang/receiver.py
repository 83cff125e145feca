"""The weight receiver that runs inside SGLang's scheduler processes (SGLang's `custom_weight_loader`).

SGLang's parameters live in its scheduler processes, one per TP rank, and no other process can
write them. So the part of a weight sync that touches them runs there: `SGLangEngine` starts the
engine with `custom_weight_loader=[LOADER]`, and each round goes over as one
`update_weights_from_tensor(load_format=LOADER)` call whose only content is the round's
`RankPayload`s, encoded in plain JSON (SGLang unpickles requests with an allowlist of its own
modules; names are strings, so the payloads travel in the names, each next to an empty tensor).

In each scheduler, `receive(model, named_tensors)` opens its TP rank's buffers straight from the
trainer rank on its GPU (CUDA IPC handles cached across updates, as the rollout's own receiver
caches them), verifies every bucket with the library's checksum kernels, agrees with the other TP
ranks (all of them verified, or none loads), and only then hands views of the trainer's buffers
to the model's own weight loaders (SGLang's name mapping, QKV fusion and TP sharding). One copy
into the parameters, no intermediate tensor, one engine call per round.

`receive` never raises: an exception there would end the scheduler (SGLang does not catch it).
It writes a reply file instead, from TP rank 0, carrying every rank's verdict; the adapter reads
it after the call and raises the typed error (`CorruptBucketError` with the same fields, and
`written` saying whether the parameters were touched).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actor_integration import _moved
from actor_integration.rollout.load_plan import LoadPlans
from actor_integration.weight_sync import wire
from actor_integration.weight_sync.wire import RankPayload

LOADER = "actor_integration.engines.sglang.receiver.receive"
PREFIX = "rl-lifecycle:"
OPS = ("hello", "round", "release")

_receiver: Any = None  # the WeightReceiver of this scheduler process, made on first use
_plans = LoadPlans()  # SGLang's loaders' copies, per layout


def encode_request(
    op: str,
    *,
    call: str,
    reply: str,
    ranks: int,
    payloads: Sequence[RankPayload] | None = None,
    digest: bool = True,
) -> list[str]:
    """The tensor names of one call: one request per TP rank, in TP rank order (SGLang gives every
    rank the same list; each reads its own entry). `digest`: a round's schedulers read back what
    they wrote and compare it with the senders' checksums."""
    if op not in OPS:
        raise ValueError(f"unknown scheduler op {op!r}; one of {list(OPS)}")
    if payloads is not None and len(payloads) != ranks:
        raise ValueError(
            f"the round carries {len(payloads)} payloads for an engine of {ranks} TP ranks: the trainer's "
            "slot and the engine disagree on the number of GPUs"
        )
    names = []
    for rank in range(ranks):
        request: dict[str, Any] = {"op": op, "call": call, "reply": reply, "rank": rank}
        if payloads is not None:
            request["payload"] = wire.encode_payload(payloads[rank])
            request["digest"] = digest
        names.append(PREFIX + json.dumps(request, separators=(",", ":")))
    return names


def read_reply(path: str | Path) -> dict[str, Any] | None:
    """The reply a call left (None if none was written), removing the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    reply: dict[str, Any] = json.loads(text)
    return reply


# ---------------------------------------------------------------------------------------------- inside SGLang


def receive(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: `func(model, named_tensors)`. Never raises (see the module doc)."""
    started = time.perf_counter()
    request: dict[str, Any] = {}
    try:
        rank, group = _tp()
        request = _request(named_tensors, rank)
        verdict = _handle(model, request, group)
    except BaseException as exc:  # an exception here would end SGLang's scheduler
        rank, group = _tp_or_zero()
        verdict = _gathered(_failure(exc, written=False), group)
    verdict["ms"] = round((time.perf_counter() - started) * 1e3, 3)
    if rank == 0 and request.get("reply"):
        _write_reply(request, verdict)


def _handle(model: Any, request: dict[str, Any], group: Any) -> dict[str, Any]:
    op = request.get("op")
    if op == "hello":
        import sglang

        _get_receiver()  # builds the receiver and compiles its kernels now, not in the first sync
        mine = {"ok": True, "pid": os.getpid(), "sglang": getattr(sglang, "__version__", "?")}
        return _gathered(mine, group)
    if op == "release":
        receiver = _get_receiver()
        opened = receiver.open_handles()
        receiver.release()
        return _gathered({"ok": True, "pid": os.getpid(), "released": opened}, group)
    if op == "round":
        return _load_round(model, request, group)
    return _gathered(_failure(ValueError(f"unknown op {op!r}"), written=False), group)


def _load_round(model: Any, request: dict[str, Any], group: Any) -> dict[str, Any]:
    """Verify this rank's buckets, agree with the other ranks, load, agree again: every rank makes
    the same collectives in the same order whatever fails (the verdicts decide the path)."""
    receiver = _get_receiver()
    stack = contextlib.ExitStack()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    received = None
    try:
        payload = wire.decode_payload(request["payload"])
        received = stack.enter_context(receiver.open([payload]))  # opens and verifies every bucket
        mine: dict[str, Any] = {"ok": True, "pid": os.getpid(), "nbytes": received.nbytes}
    except Exception as exc:
        mine = _failure(exc, written=False)
    timings["verify_ms"] = _ms(t0)
    verdicts = _gathered(mine, group)
    loaded: dict[str, Any] | None = None
    if verdicts["ok"] and received is not None:
        t1 = time.perf_counter()
        try:
            # SGLang's loaders copy from the trainer's buffers (their copies replayed once recorded).
            regions = [region for region, _manifest in received.buckets[0]]
            way = _plans.load(model, _layout(payload), received.shards[0], regions)
            loaded = {"ok": True, "pid": os.getpid(), "nbytes": received.nbytes, "load": way}
        except Exception as exc:
            loaded = _failure(exc, written=True)
        timings["load_ms"] = _ms(t1)
        if loaded["ok"] and request.get("digest", True):
            t3 = time.perf_counter()
            try:  # read back what was written, before the buckets close (their trailers hold the sums)
                loaded["digest"] = _written_digest(model, payload, received.buckets[0])
            except Exception as exc:
                loaded = _failure(exc, written=True)
            timings["digest_ms"] = _ms(t3)
    t2 = time.perf_counter()
    try:
        stack.close()  # waits for the copies: the trainer may overwrite its buffers once we answer
    except Exception as exc:
        if loaded is not None and loaded["ok"]:
            loaded = _failure(exc, written=True)
    timings["close_ms"] = _ms(t2)
    if loaded is None:
        verdicts["timings"] = timings
        return verdicts
    outcome = _gathered(loaded, group)
    outcome["timings"] = timings
    outcome["load"] = loaded.get("load")
    digests = [r.get("digest") for r in outcome["ranks"] if r is not None]
    outcome["digest"] = True if digests and all(d is True for d in digests) else None
    return outcome


def _written_digest(model: Any, payload: RankPayload, buckets: Sequence[tuple[Any, Any]]) -> bool | None:
    """Whether this rank's parameters hold what was sent (the digest of what the copies wrote,
    read where they wrote it, against the senders' sums); None where it cannot be told (SGLang's
    loaders transform or shard the tensors, or the buckets carry no device checksum). Raises
    `WrittenWeightsError` on a mismatch."""
    from actor_integration.weight_sync import kernels
    from actor_integration.weight_sync.receiver import check_written, sent_sums

    segments = _plans.written(model, _layout(payload))
    if not segments:
        return None
    device = segments[0][0].device
    sent = sent_sums(buckets, device)
    if sent is None:
        return None
    written = kernels.written_sums(segments, len(buckets), device)
    check_written(
        written, sent, [(payload, manifest) for _region, manifest in buckets], after="SGLang's loaders"
    )
    return True


def _layout(payload: RankPayload) -> Any:
    """What a recorded copy plan depends on: the transport, and each bucket's place and entries."""
    return (payload.transport, tuple((m.index, m.nbytes, m.entries_key) for m in payload.buckets))


def _get_receiver() -> Any:
    global _receiver
    if _receiver is None:
        from actor_integration.weight_sync.receiver import WeightReceiver

        _receiver = WeightReceiver()  # compiles the verification kernels here, on its GPU
    return _receiver


def _request(named_tensors: Sequence[tuple[str, Any]], rank: int) -> dict[str, Any]:
    names = [name for name, _tensor in named_tensors]
    if len(names) <= rank or not all(isinstance(n, str) and n.startswith(PREFIX) for n in names):
        raise ValueError(
            f"load_format {LOADER} got {len(names)} entries not made by the lifecycle's SGLangEngine "
            f"(TP rank {rank}): send weights through SGLangEngine, or use load_format='flattened_bucket'"
        )
    request: dict[str, Any] = json.loads(names[rank][len(PREFIX) :])
    return request


def _failure(exc: BaseException, *, written: bool) -> dict[str, Any]:
    fields = dict(getattr(exc, "fields", {}) or {})
    return {
        "ok": False,
        "pid": os.getpid(),
        "error": type(exc).__name__,
        "message": str(exc) or repr(exc),
        "fields": json.loads(json.dumps(fields, default=str)),
        "written": written,
    }


def _tp() -> tuple[int, Any]:
    """This scheduler's TP rank and the CPU group its ranks agree over (None for one rank)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return int(tp.rank_in_group), (tp.cpu_group if int(tp.world_size) > 1 else None)


def _tp_or_zero() -> tuple[int, Any]:
    try:
        return _tp()
    except Exception:
        return 0, None


def _gathered(mine: dict[str, Any], group: Any) -> dict[str, Any]:
    """Every TP rank's verdict (one collective); ok only if every rank's is."""
    ranks: list[Any] = [mine]
    if group is not None:
        import torch.distributed as dist

        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, mine, group=group)
    return {"ok": all(r is not None and r.get("ok") for r in ranks), "ranks": ranks}


def _write_reply(request: dict[str, Any], verdict: dict[str, Any]) -> None:
    path = Path(request["reply"])
    verdict["call"] = request.get("call")
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(verdict, default=str))
        os.replace(tmp, path)


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 3)


def __getattr__(name: str) -> Any:
    """0.1's names of the payload codec here (`encode_payload`, `TRANSPORTS`), now in
    `weight_sync.wire`, for one release."""
    return _moved.moved_name(__name__, name)


__all__ = [
    "LOADER",
    "OPS",
    "PREFIX",
    "encode_request",
    "read_reply",
    "receive",
]

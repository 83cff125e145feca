"""Calls of the lifecycle's receiver inside SGLang's schedulers, shared by both adapters.

`SGLangEngine` (an offline `sglang.Engine`) and `SGLangHTTPEngine` (a server started with
`python -m sglang.launch_server`) reach SGLang's schedulers the same way: one
`update_weights_from_tensor` call whose `load_format` is the lifecycle's receiver
(`sglang_receiver.LOADER`, which the server must list in `custom_weight_loader`), whose tensor
names carry the request (`sglang_receiver.encode_request`), and whose reply the receiver leaves in a
file in `_reply_dir` (the scheduler sits on this host: it opens the trainer's buffers by CUDA IPC
handle or /dev/shm file). What differs is how the call is sent (`_send_update`) and how the names
are serialized (`_serialize_names`: bytes in process, base64 over HTTP).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from actor_integration.engines.sglang import receiver as sglang_receiver
from actor_integration.weight_sync.wire import (
    PAYLOAD_TRANSPORTS,
    CorruptBucketError,
    RankPayload,
    WeightSyncError,
    WrittenWeightsError,
)

SCHEDULER_LOADER = sglang_receiver.LOADER

__all__ = ["SCHEDULER_LOADER", "SchedulerReceiverCalls", "reply_directory"]


def reply_directory(prefix: str) -> Path:
    """A fresh directory for the receiver's reply files: in /dev/shm where writable (no disk I/O)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm))


class SchedulerReceiverCalls:
    """`LoadsPayloads` through the scheduler-side receiver. The host class sets `scheduler_receiver`,
    `tp_size`, `call_timeout_s`, `weights_timeout_s`, `_reply_dir`, `_calls` (an itertools.count),
    `weight_version` and `_mixed`, and implements `_send_update`, `_serialize_names`,
    `_weight_session`, `_require_resident` and `_receiver_gone`."""

    scheduler_receiver: bool
    tp_size: int
    call_timeout_s: float
    weights_timeout_s: float
    weight_version: int
    _mixed: int | None
    _reply_dir: Path
    _calls: Iterator[int]
    # Each round's schedulers read back what they wrote and compare it with the senders' checksums
    # (about a read of the weights on the GPU); False skips it.
    weight_digest: bool = True

    # ------------------------------------------------------------------ what the host provides

    def _send_update(
        self, payloads: list[Any], *, load_format: str, ends_version: int | None, timeout_s: float, what: str
    ) -> None:
        raise NotImplementedError

    def _serialize_names(self, names: Sequence[str]) -> Any:
        raise NotImplementedError

    def _weight_session(self, *, round_index: int, final: bool) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _require_resident(self, what: str, tags: Sequence[str]) -> None:
        raise NotImplementedError

    def _receiver_gone(self) -> bool:
        """The schedulers are known dead: nothing to ask them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ LoadsPayloads

    def accepts_payloads(self, transport: str) -> bool:
        """Whether a round by `transport` goes to the schedulers unopened (`load_payloads`)."""
        return self.scheduler_receiver and transport in PAYLOAD_TRANSPORTS

    def check_payloads(self, payloads: Sequence[RankPayload]) -> None:
        """Refuse a round before anything is sent (the caller still holds its buffers' grants)."""
        self._require_resident("update_weights", ["weights"])
        if len(payloads) != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: the round carries {len(payloads)} payloads but the engine has "
                f"{self.tp_size} TP ranks: the trainer's slot and the engine disagree on the number of GPUs"
            )

    def load_payloads(
        self, version: int, payloads: Sequence[RankPayload], *, round_index: int, final: bool
    ) -> dict[str, Any]:
        """One round, received by SGLang's schedulers themselves: each opens and verifies its TP
        rank's buffers and loads only if every rank verified. Raises `CorruptBucketError` (nothing
        written, the previous weights stay) or `WeightSyncError` (see `written`)."""
        import time

        self.check_payloads(payloads)
        started = time.perf_counter()
        try:
            reply = self._scheduler(
                "round",
                payloads=payloads,
                timeout_s=self.weights_timeout_s,
                version=version,
                round_index=round_index,
                final=final,
            )
        except (CorruptBucketError, WeightSyncError) as error:
            if error.fields.get("written", True) or round_index > 0:
                self._mixed = version  # written in part now, or in an earlier round of the version
            raise
        except BaseException:
            self._mixed = version  # the call may have loaded some ranks before it failed
            raise
        if final:
            self.weight_version = version
            self._mixed = None
        # The engine's phases: verify/load/close inside the scheduler, the scheduler's whole share,
        # and the call as this process saw it (the difference is SGLang's request round trip).
        timings = {
            **reply.get("timings", {}),
            "scheduler_ms": reply.get("ms"),
            "call_ms": round((time.perf_counter() - started) * 1e3, 3),
            "load_path": reply.get("load"),  # SGLang's loaders, or their recorded copies (load_plan.py)
            "digest": reply.get("digest"),  # the schedulers read back what they wrote (None: could not)
        }
        return {"nbytes": sum(p.nbytes for p in payloads), "timings": timings}

    def release_payload_handles(self) -> int:
        """Close the trainer buffers the schedulers hold open (the rollout calls it when it sleeps,
        so no cached handle pins trainer memory: slime #1731). The number closed."""
        if not self.scheduler_receiver or self._receiver_gone():
            return 0
        reply = self._scheduler("release", timeout_s=self.call_timeout_s)
        return sum(int(r.get("released", 0)) for r in reply["ranks"])

    def scheduler_hello(self) -> list[int]:
        """Ask every scheduler's receiver to start (it compiles its kernels now, not in the first
        sync); their pids."""
        hello = self._scheduler("hello", timeout_s=self.call_timeout_s)
        return [int(r["pid"]) for r in hello["ranks"]]

    # ------------------------------------------------------------------ one call

    def _scheduler(
        self,
        op: str,
        *,
        timeout_s: float,
        payloads: Sequence[RankPayload] | None = None,
        version: int | None = None,
        round_index: int = 0,
        final: bool = True,
    ) -> dict[str, Any]:
        """One call of the scheduler-side receiver (`sglang_receiver.receive`); its reply. A round
        carries `version`'s payloads; any other op is a call of its own (its own session)."""
        call = f"{os.getpid()}-{next(self._calls)}-{uuid.uuid4().hex[:6]}"
        reply_path = self._reply_dir / f"{call}.json"
        names = sglang_receiver.encode_request(
            op,
            call=call,
            reply=str(reply_path),
            ranks=self.tp_size,
            payloads=payloads,
            digest=self.weight_digest,
        )
        serialized = self._serialize_names(names)
        with self._weight_session(round_index=round_index, final=final):
            self._send_update(
                [serialized] * self.tp_size,
                load_format=SCHEDULER_LOADER,
                ends_version=version if final else None,
                timeout_s=timeout_s,
                what=f"the lifecycle's {op} call",
            )
            reply = sglang_receiver.read_reply(reply_path)
            if reply is not None and not reply["ok"] and version is not None:
                self._raise_refusal(version, reply)
        if reply is None:
            raise WeightSyncError(
                f"SGLang answered the lifecycle's {op} call but its receiver left no reply in {reply_path}: "
                f"the engine was not started with custom_weight_loader=[{SCHEDULER_LOADER!r}] (the lifecycle's "
                "adapters add it when they start the engine), its scheduler cannot import actor_integration, "
                "or it runs on another host than this process",
                op=op,
            )
        return reply

    def _raise_refusal(self, version: int, reply: dict[str, Any]) -> None:
        failed = [r for r in reply["ranks"] if not r.get("ok")]
        first: dict[str, Any] = failed[0] if failed else {"error": "unknown", "message": "no rank said why"}
        written = any(r.get("written") for r in failed)
        if written:
            self._mixed = version
        ranks = [i for i, r in enumerate(reply["ranks"]) if not r.get("ok")]
        message = f"SGLang's scheduler (TP rank(s) {ranks}) refused version {version}: {first['message']}" + (
            "; its weights were partly written and are not valid until a version loads whole"
            if written
            else "; nothing was written: the previous weights stay loaded"
        )
        fields = {**(first.get("fields") or {}), "version": version, "written": written, "tp_ranks": ranks}
        if first.get("error") == "CorruptBucketError":
            raise CorruptBucketError(message, **fields)
        if first.get("error") == "WrittenWeightsError":
            raise WrittenWeightsError(message, **fields)
        raise WeightSyncError(message, **{**fields, "error": first.get("error")})

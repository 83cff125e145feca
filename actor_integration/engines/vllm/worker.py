"""The lifecycle's weight receiver inside vLLM's workers: a `worker_extension_cls`.

vLLM's parameters live in its worker processes, one per TP rank. Started with
`worker_extension_cls=WORKER_EXTENSION`, every worker gains the methods below, which the adapters
call through `collective_rpc` (the offline `LLM.collective_rpc`, or the dev server's
`POST /collective_rpc`, which passes string arguments only: every request is one JSON string).

A round takes two calls, so that all ranks verify before any writes: `lifecycle_verify` opens this
worker's payload from the trainer (CUDA IPC handles or shared-memory files; the handles stay cached
across updates as the rollout's own receiver caches them), checks every bucket with the library's
checksum kernels and keeps the verified views; the adapter reads every rank's verdict and then
sends `lifecycle_load` with `commit` true (each worker hands its views to the model's own
`load_weights`: vLLM's name mapping, QKV fusion and TP sharding) or false (each drops them).

No method raises: vLLM would turn the exception into an RPC failure without the fields the adapter
needs. Each returns a dict verdict; the adapter raises the typed error. vLLM is not imported here:
this module loads in any process (torch only once a round is received).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any

WORKER_EXTENSION = "actor_integration.engines.vllm.worker.LifecycleWorkerExtension"
METHODS = (
    "lifecycle_hello",
    "lifecycle_verify",
    "lifecycle_load",
    "lifecycle_release",
    "lifecycle_checksum",
    "lifecycle_memory",
)


def _failure(exc: BaseException, *, written: bool) -> dict[str, Any]:
    from actor_integration.errors import CorruptBucketError

    fields = getattr(exc, "fields", {}) if isinstance(exc, CorruptBucketError) else {}
    return {
        "ok": False,
        "corrupt": isinstance(exc, CorruptBucketError),
        "error": f"{type(exc).__name__}: {exc}",
        "fields": {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "written": written,
    }


class LifecycleWorkerExtension:
    """Mixed into vLLM's GPU worker (`self.model_runner.model` is the served model, `self.rank` the
    worker's rank in the engine). Its state lives in `_lifecycle`, one dict per worker."""

    model_runner: Any
    rank: int

    def _lifecycle_state(self) -> dict[str, Any]:
        state: dict[str, Any] | None = getattr(self, "_lifecycle", None)
        if state is None:
            state = {"receiver": None, "stack": None, "received": None, "round": None, "version": None}
            self._lifecycle = state
        return state

    def _lifecycle_receiver(self) -> Any:
        state = self._lifecycle_state()
        if state["receiver"] is None:
            from actor_integration.weight_sync.receiver import WeightReceiver

            state["receiver"] = WeightReceiver()  # compiles the verification kernels here, on its GPU
        return state["receiver"]

    def _lifecycle_drop(self) -> None:
        state = self._lifecycle_state()
        stack = state["stack"]
        state["stack"] = state["received"] = state["round"] = None
        if stack is not None:
            stack.close()

    def lifecycle_hello(self, request: str = "{}") -> dict[str, Any]:
        """Who answers: the worker's pid and rank (the adapter checks every rank has the extension)."""
        version = self._lifecycle_state().get("version")
        return {
            "ok": True,
            "pid": os.getpid(),
            "rank": int(getattr(self, "rank", 0)),
            "weight_version": version,
        }

    def lifecycle_verify(self, request: str) -> dict[str, Any]:
        """Open and verify this worker's payload of a round; keep the views until `lifecycle_load`."""
        start = time.perf_counter()
        self._lifecycle_drop()  # a round left open by a failed exchange is closed first
        try:
            from actor_integration.weight_sync.wire import decode_payload

            data = json.loads(request)
            rank = int(getattr(self, "rank", 0))
            encoded = data["payloads"]
            if rank >= len(encoded):
                raise ValueError(f"worker rank {rank} has no payload: the round carries {len(encoded)}")
            payload = decode_payload(encoded[rank])
            stack = contextlib.ExitStack()
            try:
                received = stack.enter_context(self._lifecycle_receiver().open([payload]))
            except BaseException:
                stack.close()
                raise
            state = self._lifecycle_state()
            state["stack"], state["received"], state["round"] = (
                stack,
                received,
                (data["version"], data["round"]),
            )
        except BaseException as exc:  # never into vLLM's RPC loop: the verdict carries it
            return _failure(exc, written=False)
        return {"ok": True, "rank": rank, "nbytes": received.nbytes, "verify_ms": _ms(start)}

    def lifecycle_load(self, request: str) -> dict[str, Any]:
        """Load the verified round (`commit` true) through the model's `load_weights`, or drop it."""
        start = time.perf_counter()
        state = self._lifecycle_state()
        try:
            data = json.loads(request)
            if not data.get("commit"):
                self._lifecycle_drop()
                return {"ok": True, "loaded": False}
            if state["received"] is None or state["round"] != (data["version"], data["round"]):
                raise RuntimeError(
                    f"no verified round {(data['version'], data['round'])} here (holding {state['round']})"
                )
        except BaseException as exc:
            self._lifecycle_drop()
            return _failure(exc, written=False)
        try:
            self.model_runner.model.load_weights(weights=iter(state["received"].shards[0]))
        except BaseException as exc:
            return _failure(exc, written=True)
        finally:
            self._lifecycle_drop()
        if data.get("final"):
            state["version"] = data["version"]  # what `served_weight_version` reports
        return {"ok": True, "loaded": True, "load_ms": _ms(start)}

    def lifecycle_release(self, request: str = "{}") -> dict[str, Any]:
        """Close every trainer buffer this worker holds open (the rollout's sleep asks)."""
        self._lifecycle_drop()
        receiver = self._lifecycle_state()["receiver"]
        held = 0 if receiver is None else int(receiver.open_handles())
        if receiver is not None:
            receiver.release()
        return {"ok": True, "released": held}

    def lifecycle_checksum(self, request: str = "{}") -> dict[str, Any]:
        """sha256 over this worker's parameters (names sorted, raw bytes): equal iff bit-identical."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model_runner.model.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().contiguous().view(-1).view(_uint8()).cpu().numpy().tobytes())
        return {"ok": True, "rank": int(getattr(self, "rank", 0)), "sha256": digest.hexdigest()}

    def lifecycle_memory(self, request: str = "{}") -> dict[str, Any]:
        """What vLLM says this worker holds: the weights (`model_memory_usage`, measured by vLLM at
        load) and the KV cache (its tensors' bytes)."""
        runner = self.model_runner
        kv = sum(int(t.numel() * t.element_size()) for t in _tensors(getattr(runner, "kv_caches", [])))
        return {"ok": True, "weights": int(getattr(runner, "model_memory_usage", 0)), "kv_cache": kv}


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if hasattr(value, "element_size") else []


def _uint8() -> Any:
    import torch

    return torch.uint8


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 3)


__all__ = ["METHODS", "WORKER_EXTENSION", "LifecycleWorkerExtension"]

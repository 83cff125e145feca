"""A `RolloutActor` (reference engine) in a process of its own, reached through a pipe the way
`ray.get(actor.update_weights.remote(...))` reaches a Ray actor; its exceptions come back raised."""

from __future__ import annotations

import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout import ReferenceEngine, RolloutActor
from actor_integration.weight_sync import WeightReceiver


class EngineClient:
    """`engine_call(version, payloads)` for a `WeightSender`, and `call(method, *args)` for the rest."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __call__(self, version: int, payloads: list[Any]) -> Any:
        return self.call("update_weights", version, payloads)

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        status, value = self.conn.recv()
        if status == "error":
            raise value
        return value

    def stop(self) -> None:
        self.conn.send(None)


def serve_rollout(
    conn: Connection, config: TinyLMConfig, devices: Sequence[str], receiver: WeightReceiver | None = None
) -> None:
    """Serve `RolloutActor` methods over `conn` until it sends None. Besides the actor's methods:
    `seen_ranks` (the payload ranks of every update), `handles_opened` (cuda_ipc opens so far) and
    `visible_devices` (this process's CUDA_VISIBLE_DEVICES)."""
    serve(conn, RolloutActor(ReferenceEngine(config, devices=list(devices)), receiver=receiver))


def serve_tensors_rollout(
    conn: Connection, specs: Sequence[tuple[str, tuple[int, ...], Any]], device: str
) -> None:
    """`serve` a `RolloutActor` over a `TensorsEngine` of `specs` (any checkpoint layout)."""
    from tests.helpers.weight_sync_doubles import TensorsEngine

    serve(conn, RolloutActor(TensorsEngine(specs, device)))


def serve(conn: Connection, actor: RolloutActor) -> None:
    """Serve the actor's methods over `conn` until it sends None, and these queries: `seen_ranks`,
    `handles_opened`, `visible_devices`, `contents` (the weights' contents), `lifecycle_version`,
    `fingerprints` (engines that have them), `keep_previous` (sets the receiver's)."""
    seen_ranks: list[list[int]] = []

    def keep_previous(value: bool) -> None:
        actor.receiver.keep_previous = value

    queries: dict[str, Any] = {
        "seen_ranks": lambda: seen_ranks,
        "handles_opened": lambda: actor.receiver.transport("cuda_ipc").handles_opened,  # type: ignore[attr-defined]
        "visible_devices": lambda: os.environ.get("CUDA_VISIBLE_DEVICES"),
        "contents": lambda: actor.lifecycle.contents["weights"].value,
        "lifecycle_version": lambda: actor.lifecycle.weight_version,
        "fingerprints": lambda: actor.engine.fingerprints(),  # type: ignore[attr-defined]
        "keep_previous": keep_previous,
    }
    while True:
        message = conn.recv()
        if message is None:
            return
        method, args = message
        try:
            if method in queries:
                result = queries[method](*args)
            else:
                if method == "update_weights":
                    seen_ranks.append([p.rank for p in args[1]])
                result = getattr(actor, method)(*args)
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", exc))

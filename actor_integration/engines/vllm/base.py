"""What the offline and the HTTP vLLM adapters share: the `RolloutEngine` calls behind the guards,
and the two weight paths.

Each subclass supplies the vLLM calls (`_sleep`, `_wake`, `_pause`, `_resume`, `_reset_prefix_cache`,
`_generate`, `_rpc`, `_start_update`, `_update`, `_finish_update`); every public call here checks
`SleepGuard` first, so a refused call never reaches vLLM.

Weights reach vLLM two ways:
- the lifecycle's own sender (`LoadsPayloads`): a round's payloads go unopened to the workers'
  `LifecycleWorkerExtension` (`worker.py`), which verify them, agree through this adapter, and load
  through the model's `load_weights`;
- vLLM's weight-transfer engine (`weight_transfer_config={"backend": "ipc"}`): `begin_weight_update`
  hands one coordinator a `WeightUpdate` (start / update / finish); `load_weights` uses it with
  vLLM's own IPC sender, packed. A second coordinator is refused (`WeightUpdateBusyError`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from actor_integration.engines.vllm.guards import VLLM_TAGS, SleepGuard, vllm_pause_mode
from actor_integration.errors import CorruptBucketError, WeightSyncError

if TYPE_CHECKING:
    from actor_integration.weight_sync.wire import RankPayload

PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (0.26.0)
IpcSender = Callable[[Iterator[tuple[str, Any]], dict[str, Any]], None]


def vllm_ipc_sender() -> IpcSender:
    """vLLM's own trainer-side IPC sender (`IPCWeightTransferEngine.trainer_send_weights`)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    send: IpcSender = IPCWeightTransferEngine.trainer_send_weights
    return send


class WeightUpdate:
    """One weight update held by one coordinator: `update(update_info)` per chunk, then `finish(version)`
    (or `abort()`); as a context manager it aborts unless finished."""

    def __init__(self, engine: VLLMAdapter, owner: str) -> None:
        self.engine = engine
        self.owner = owner
        self.chunks = 0
        self._open = True
        self.failed = False  # a chunk failed: vLLM may have loaded part of it
        self.finish_error: BaseException | None = None  # what vLLM answered an abort's finish

    def update(self, update_info: dict[str, Any]) -> None:
        """Send one chunk (`update_info` as vLLM's weight-transfer backend defines it)."""
        self._require_open("update")
        self.engine.guard.check_load(f"update_weights by {self.owner!r}")
        try:
            self.engine._update(update_info)
        except BaseException:
            self.failed = True
            self.engine.guard.weights_mixed = self.engine.weight_version
            raise
        self.chunks += 1

    def finish(self, version: int) -> None:
        """End the update: vLLM serves `version` from here on."""
        self._require_open("finish")
        self._open = False
        try:
            self.engine._finish_update()
        except BaseException:
            self.engine.guard.end_update(self.owner, version=None)
            raise
        self.engine.guard.end_update(self.owner, version=version)
        self.engine.weight_version = version

    def abort(self) -> None:
        """Give the update up. vLLM's finish is asked whatever failed: its start put the model's layers
        on the meta device for a layerwise reload, and only the finish puts back the layers no chunk
        loaded (without it the next level-2 sleep fails on meta buffers, seen on an H100 after a chunk
        failed in this process, before it reached vLLM). A chunk sent, or one that failed, leaves the
        version mixed (generation refused until a whole version loads). A finish vLLM refuses (its
        worker ends the session itself when a chunk fails inside it, the layers left unloaded) sets
        `guard.layers_unloaded`: generation and a level-2 sleep are refused until a whole version
        loads. vLLM's answer is kept in `finish_error`; the chunk's error is the one raised."""
        if not self._open:
            return
        self._open = False
        try:
            self.engine._finish_update()
        except Exception as exc:
            self.finish_error = exc
            self.engine.guard.layers_unloaded = (
                f"the weight update of {self.owner!r} failed and vLLM refused its finish ({type(exc).__name__}: "
                f"{str(exc)[:120]}): its worker ends the session of a chunk that failed inside it with the "
                "model's layers unloaded"
            )
        finally:
            if self.chunks or self.failed:
                self.engine.guard.weights_mixed = self.engine.weight_version
            self.engine.guard.end_update(self.owner, version=None)

    def _require_open(self, what: str) -> None:
        if not self._open:
            raise WeightSyncError(f"{what}: the weight update of {self.owner!r} has ended", owner=self.owner)

    def __enter__(self) -> WeightUpdate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class VLLMAdapter:
    """The shared half of `VLLMEngine` and `VLLMHTTPEngine` (see the module docstring)."""

    memory_tags = VLLM_TAGS
    stages_weights = False  # vLLM loads in place
    name = "vllm"

    def __init__(
        self,
        *,
        sleep_level: int,
        worker_receiver: bool,
        ipc_sender: IpcSender | None = None,
        packed: bool = True,
    ) -> None:
        self.guard = SleepGuard(type(self).__name__, sleep_level)
        self.sleep_level = sleep_level
        self.weight_version = 0
        self.worker_receiver = worker_receiver
        self._ipc_sender = ipc_sender
        self.packed = packed
        self._pause_mode = "abort"
        self._paused = False
        self._resumed_by_wake = False
        self._update_of_rounds: WeightUpdate | None = None
        self.workers: list[dict[str, Any]] = []
        self._memory: dict[str, int] | None = None

    # ------------------------------------------------------------------ what the engine is

    @property
    def residency(self) -> dict[str, bool]:
        """Which tags are awake, as this adapter's calls left them (`recover()` reads it)."""
        return self.guard.residency()

    def weights_state(self) -> str:
        """ "resident", "host" (level-1 sleep) or "discarded" (level 2, until a whole version loads)."""
        return self.guard.weights()

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "adapter": type(self).__name__,
            "sleep_level": self.sleep_level,
            "memory_tags": list(self.memory_tags),
            "weights_via": "worker_extension" if self.worker_receiver else "weight_transfer_ipc",
        }

    # ------------------------------------------------------------------ memory

    def set_sleep_level(self, level: int) -> None:
        """The level of the next sleep: 1 keeps the weights in host RAM, 2 discards them (see guards.py)."""
        self.guard.set_level(level)
        self.sleep_level = level

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Sleep: both tags at the configured level; any other set is refused before vLLM is called."""
        level = self.guard.check_release(tags)
        self._check_idle()
        self._sleep(level, self._pause_mode)
        self._resumed_by_wake = False  # vLLM's sleep paused its scheduler: a continue must ask again
        self.guard.released()

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Wake `tags` (None: both); a tag already awake is refused first."""
        chosen = self.guard.check_resume(tags)
        self._wake(chosen)
        self.guard.resumed(chosen)
        # vLLM resumes its scheduler itself once every allocation is resident again (EngineCore.wake_up,
        # 0.26.0): the continue that ends the rollout's wake has nothing left to ask (one round trip less).
        self._resumed_by_wake = all(self.guard.residency().values())

    def _check_idle(self) -> None:
        """Subclasses ask vLLM for requests this adapter did not start."""

    # ------------------------------------------------------------------ generation

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause vLLM's scheduling (`mode`: abort, in_place = vLLM's keep, or vLLM's wait)."""
        vllm_mode = vllm_pause_mode(mode)
        self._pause(vllm_mode)
        self._pause_mode = "abort" if vllm_mode == "wait" else vllm_mode  # what the sleep's own pause does
        self._paused = True
        self._resumed_by_wake = False

    def pause_with_release(self) -> None:
        """Let the next release be the pause: vLLM's sleep pauses its scheduler in the mode given,
        here abort, and clears its caches before it releases (one request, none now). A pause left in
        vLLM's keep mode must not carry into a release: requests kept over a released KV cache."""
        self._pause_mode = "abort"
        self._paused = True
        self._resumed_by_wake = False

    def continue_generation(self) -> None:
        """Resume vLLM's scheduling; the first continue after a whole wake asks nothing: that wake
        already resumed it."""
        if not self._resumed_by_wake:
            self._resume()
        self._resumed_by_wake = False
        self._paused = False

    def flush_cache(self) -> bool:
        """vLLM's prefix-cache reset; False while blocks are still held (running requests)."""
        return bool(self._reset_prefix_cache())

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for each prompt (token ids); refused while asleep or on discarded weights."""
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens!r}")
        bad = [i for i, p in enumerate(prompts) if not p or not all(isinstance(t, int) for t in p)]
        if bad:
            raise ValueError(f"generate: prompts {bad} are not non-empty lists of token ids")
        with self.guard.generating():
            return self._generate([list(p) for p in prompts], max_new_tokens)

    # ------------------------------------------------------------------ vLLM's weight transfer (IPC)

    def begin_weight_update(self, owner: str) -> WeightUpdate:
        """Start a weight update through vLLM's weight-transfer engine, held by `owner`; a second
        start before it ends is refused (`WeightUpdateBusyError`), as is one while the weights sleep,
        and one whose handles vLLM cannot carry (`IpcSerializationError`)."""
        self._check_ipc_transfer()
        self.guard.begin_update(owner)
        try:
            self._start_update()
        except BaseException:
            self.guard.end_update(owner, version=None)
            raise
        return WeightUpdate(self, owner)

    def load_weights(
        self, version: int, shards: Sequence[Sequence[tuple[str, Any]]], *, round_index: int, final: bool
    ) -> None:
        """One round through vLLM's IPC weight transfer: every vLLM worker finds its GPU's handles."""
        if len(shards) != 1:
            raise ValueError(
                f"{type(self).__name__}.load_weights takes one shard of full tensors (vLLM shards them "
                f"itself), got {len(shards)}; for TP > 1 send through the workers' receiver (LoadsPayloads)"
            )
        if round_index == 0:
            if self._update_of_rounds is not None:
                self._update_of_rounds.abort()
            self._update_of_rounds = self.begin_weight_update(f"load_weights(version={version})")
        update = self._update_of_rounds
        if update is None:
            raise WeightSyncError(f"load_weights: round {round_index} of version {version} without round 0")
        sender = self._ipc_sender or vllm_ipc_sender()
        try:
            tensors = list(shards[0])
            args: dict[str, Any] = {"send_mode": self._send_ipc(update), "packed": self.packed}
            if self.packed:  # vLLM refuses a tensor larger than its buffer (1 GiB; a 7B's embedding is more)
                largest = max(
                    (t.numel() * t.element_size() for _, t in tensors if hasattr(t, "numel")), default=0
                )
                args["packed_buffer_size_bytes"] = max(PACKED_BUFFER_BYTES, largest)
            sender(iter(tensors), args)
            if final:
                self._update_of_rounds = None
                update.finish(version)
        except BaseException:
            self._update_of_rounds = None
            update.abort()
            raise

    def _send_ipc(self, update: WeightUpdate) -> Callable[[Any], None]:
        def send(update_info: Any) -> None:
            # As vLLM's own "ray" sender sends it: the dataclass as a dict.
            is_instance = dataclasses.is_dataclass(update_info) and not isinstance(update_info, type)
            info = dataclasses.asdict(update_info) if is_instance else dict(update_info)
            update.update(self._ipc_update_info(info))

        return send

    def _ipc_update_info(self, info: dict[str, Any]) -> dict[str, Any]:
        return info

    def _check_ipc_transfer(self) -> None:
        """Before vLLM's own weight transfer starts: can the handles reach its workers? (Each adapter
        knows; the HTTP server answers a refusal itself.)"""

    # ------------------------------------------------------------------ the workers' receiver

    def accepts_payloads(self, transport: str) -> bool:
        if not self.worker_receiver:
            return False
        from actor_integration.weight_sync.wire import PAYLOAD_TRANSPORTS  # what the workers open themselves

        return transport in PAYLOAD_TRANSPORTS

    def check_payloads(self, payloads: Sequence[RankPayload]) -> None:
        self.guard.check_load("a weight sync")
        if self.guard.update_owner is not None:
            self.guard.begin_update("the lifecycle's sender")  # raises: one coordinator per engine
        from actor_integration.weight_sync.wire import PAYLOAD_TRANSPORTS

        transports = sorted({p.transport for p in payloads})
        if transports != [t for t in transports if t in PAYLOAD_TRANSPORTS]:
            raise ValueError(
                f"{type(self).__name__}: the workers open {list(PAYLOAD_TRANSPORTS)} payloads, got {transports}"
            )

    def load_payloads(
        self, version: int, payloads: Sequence[RankPayload], *, round_index: int, final: bool
    ) -> dict[str, Any]:
        """Verify the round in every worker, then load it in all of them or in none."""
        from actor_integration.weight_sync.wire import encode_payload

        owner = "the lifecycle's sender"
        self.guard.begin_update(owner)
        loaded = False
        try:
            head = {"version": version, "round": round_index}
            request = json.dumps({**head, "payloads": [encode_payload(p) for p in payloads]})
            verdicts = self._rpc("lifecycle_verify", request)
            bad = [v for v in verdicts if not v.get("ok")]
            commit = not bad
            replies = self._rpc("lifecycle_load", json.dumps({**head, "commit": commit, "final": final}))
            if bad:
                first = bad[0]
                error = CorruptBucketError if first.get("corrupt") else WeightSyncError
                raise error(
                    f"{type(self).__name__}: {len(bad)} worker(s) refused round {round_index} of version "
                    f"{version}, nothing loaded: {first.get('error')}",
                    version=version,
                    round=round_index,
                    written=False,
                    **{
                        k: v
                        for k, v in first.get("fields", {}).items()
                        if k not in ("version", "round", "written")
                    },
                )
            failed = [r for r in replies if not r.get("ok")]
            if failed:
                self.guard.weights_mixed = version
                raise WeightSyncError(
                    f"{type(self).__name__}: loading round {round_index} of version {version} failed in "
                    f"{len(failed)} worker(s) after verification: {failed[0].get('error')}; the weights are "
                    "mixed until a whole version loads",
                    version=version,
                    round=round_index,
                    written=any(r.get("written") for r in failed),
                )
            if not final:
                self.guard.weights_mixed = version  # part of the new version is in until the final round
            loaded = final
        finally:
            self.guard.end_update(owner, version=version if loaded else None)
        if final:
            self.weight_version = version
        timings = {"verify_ms": max((v.get("verify_ms", 0.0) for v in verdicts), default=0.0)}
        timings["load_ms"] = max((r.get("load_ms", 0.0) for r in replies), default=0.0)
        return {"timings": timings}

    def release_payload_handles(self) -> int:
        if not self.worker_receiver:
            return 0
        return sum(int(r.get("released", 0)) for r in self._rpc("lifecycle_release", "{}"))

    def weights_checksum(self) -> str:
        """sha256 of the workers' parameters (each worker's digest, rank order): needs the worker extension."""
        if not self.worker_receiver:
            raise NotImplementedError(
                f"{type(self).__name__}: a checksum of vLLM's weights needs the worker extension "
                "(worker_receiver=True); compare greedy generations instead"
            )
        digests = sorted(
            (r.get("rank", 0), r.get("sha256", "")) for r in self._rpc("lifecycle_checksum", "{}")
        )
        return "/".join(d for _rank, d in digests)

    def memory_bytes(self, tag: str | None = None) -> int | None:
        """What `tag` (None: both) holds on the first worker's GPU as vLLM reports it (asked once); None
        without the worker extension. What a sleep should free; the trainer's budget plans from it."""
        if self._memory is None:
            self._memory = self.memory_report()
        if self._memory is None:
            return None
        return sum(self._memory[t] for t in (self.memory_tags if tag is None else (tag,)))

    def memory_report(self) -> dict[str, int] | None:
        """What vLLM says its first worker holds: {"weights": bytes, "kv_cache": bytes} (worker extension)."""
        if not self.worker_receiver:
            return None
        replies = self._rpc("lifecycle_memory", "{}")
        return (
            {"weights": int(replies[0]["weights"]), "kv_cache": int(replies[0]["kv_cache"])}
            if replies
            else None
        )

    # ------------------------------------------------------------------ what subclasses call vLLM with

    def _sleep(self, level: int, mode: str) -> None:
        raise NotImplementedError

    def _wake(self, tags: list[str] | None) -> None:
        raise NotImplementedError

    def _pause(self, mode: str) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        raise NotImplementedError

    def _rpc(self, method: str, request: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _start_update(self) -> None:
        raise NotImplementedError

    def _update(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError

    def _finish_update(self) -> None:
        raise NotImplementedError

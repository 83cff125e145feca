"""A framework's `vllm serve` actor under the rollout lifecycle: what vLLM's verbs add to the server-actor rules.

A framework that drives a `vllm serve` process from a Ray actor (vime's `VLLMEngine`) gets the
engine-agnostic rules of `rollout.server_actor` (router membership, weight-version validity,
followers, health) over the lifecycle's own client of the server, `VLLMHTTPEngine`, whose guards
(`guards.SleepGuard`) refuse what vLLM crashes on before it is sent. `VLLMServerActorLifecycle`
adds what vLLM 0.26.0's routes make different from SGLang's:

- the sleep: out of the router, then one `POST /sleep?level=&mode=abort`, which pauses vLLM's
  scheduler (aborting what runs) and clears its caches before it releases (`lifecycle_release_pauses`);
- memory: vLLM's tags are `weights` and `kv_cache`, and one `POST /sleep?level=` releases both
  (level 1 keeps the weights in host RAM and the wake maps them back; level 2 discards them). The
  level is chosen per sleep (`_lc_release`), as vime's rollout manager does; the machine counts
  the weights discarded by every sleep, and the wake of the weights after a level-1 sleep of a
  whole version declares them valid again at that version. A sleep while one tag still sleeps
  (vLLM ignores it, "already sleeping") is refused before anything is sent (`MemoryStateError`);
  a second sleep of both is a logged no-op, as is a wake of an awake tag;
- the weight update of vLLM's weight-transfer routes (`/start_weight_update`, `/update_weights`
  per chunk, `/finish_weight_update`) is one sync operation of the table, open from the start to
  the finish: a second start while it is open is a `DuplicateWeightUpdateStartError` (one
  coordinator per engine slot, vime #57), a chunk or a finish with none open a
  `WeightUpdateNotStartedError`, a start into released weights the table's `IllegalTransitionError`
  (vLLM's EngineCore segfaults on a chunk written into sleeping weights and the server stays up:
  vllm #57853), and a sleep while one is open a `MemoryStateError`; all refused before vLLM is
  called, the engine alive. The weights are unknown from the start, valid at the finish's version
  only if every chunk since the start arrived and at least one did, and the server rejoins the
  router only then (and awake); a continue while the update is open keeps generation paused;
- vLLM 0.26.0 keeps no weight version (no route reports one): the version served is the one this
  actor saw loaded whole.

A framework's mixin (`frameworks.vime.rollout.VimeRolloutMixin`) maps its own method names onto
these calls and builds the lifecycle at the end of its `init` (`_lc_vllm_start`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from actor_integration.engines.vllm.guards import VLLM_TAGS
from actor_integration.engines.vllm.http_engine import VLLMHTTPEngine
from actor_integration.errors import (
    DuplicateWeightUpdateStartError,
    MemoryStateError,
    WeightUpdateBusyError,
    WeightUpdateNotStartedError,
)
from actor_integration.rollout.server_actor import ServerActorLifecycle, as_int
from lifecycle import Contents, Residency, State
from lifecycle.logs import Event

__all__ = ["UPDATE_LABEL", "VLLMActorState", "VLLMServerActorLifecycle"]

UPDATE_LABEL = "(update)"  # what a version being loaded is called until its finish names it
ADMISSIONS = ("after_sync", "at_init")


@dataclass
class VLLMActorState:
    """What the vLLM layer keeps on the actor beside `ServerState` (`self._lc_vllm`)."""

    update: str | None = None  # the call that opened the weight update in progress (None: none open)
    chunks: int = 0  # the chunks the open update has sent
    restore: bool = False  # the sleep in force is level 1 over a whole version: the wake brings it back


class VLLMServerActorLifecycle(ServerActorLifecycle):
    """The vLLM part of a framework's `vllm serve` actor under the rollout lifecycle (module doc).

    Class attributes a subclass may change (and `ServerActorLifecycle`'s):
    `lifecycle_admission`: "after_sync" (join the router only once a whole version is loaded and
    awake), "at_init" (join at launch), or None: "after_sync" when the server sleeps
    (`enable_sleep_mode` in its arguments: colocated and offloaded), else "at_init".
    `lifecycle_weights_timeout_s`: the deadline of the lifecycle's own weight-transfer requests.
    """

    lifecycle_framework: ClassVar[str] = "vllm"
    lifecycle_engine_label: ClassVar[str] = "vLLM"
    lifecycle_server_tags: ClassVar[tuple[str, ...]] = VLLM_TAGS
    lifecycle_admission: ClassVar[str | None] = None
    # vLLM's /sleep pauses the scheduler (abort) and clears the prefix and KV caches before it
    # releases, and every sleep here releases both tags or is refused: no /pause (which waits 20 ms
    # after pausing, by design) or /reset_prefix_cache before it (measured on an H100: the wrapped
    # vime release took 127.7 ms with them against vime's own 50.6 ms /sleep).
    lifecycle_release_pauses: ClassVar[bool] = True
    lifecycle_weights_timeout_s: ClassVar[float] = 600.0

    @property
    def _lc_vllm(self) -> VLLMActorState:
        state: VLLMActorState | None = self.__dict__.get("_lc_vllm")
        if state is None:
            state = self.__dict__["_lc_vllm"] = VLLMActorState()
        return state

    def _lc_new_client(self, url: str, *, timeout_s: float, api_key: Any = None) -> VLLMHTTPEngine:
        return VLLMHTTPEngine(
            url, timeout_s=timeout_s, weights_timeout_s=self.lifecycle_weights_timeout_s, api_key=api_key
        )

    def _lc_vllm_client(self) -> VLLMHTTPEngine:
        client = self._lc_server()
        assert isinstance(client, VLLMHTTPEngine), "the lifecycle's client of a vLLM server"
        return client

    def _lc_reported_version(self) -> str | None:
        """vLLM 0.26.0 reports no weight version: the one this actor saw loaded whole."""
        return self._lc_state.served

    def _lc_admission(self) -> str:
        sleeps = self.lifecycle_server_args().get("enable_sleep_mode")
        chosen = self.lifecycle_admission or ("after_sync" if sleeps else "at_init")
        if chosen in ADMISSIONS:
            return chosen
        raise ValueError(
            f"{type(self).__name__}.lifecycle_admission: one of {ADMISSIONS} or None, not {chosen!r}"
        )

    def _lc_vllm_start(self, dist_init_addr: str, *, bootstrap_port: Any = None) -> None:
        """The lifecycle, once the server is up: every sleep counts the weights discarded (a level-1
        sleep's wake restores them, `_lc_resume`)."""
        self.__dict__["_lc_vllm"] = VLLMActorState()
        self._lc_start(dist_init_addr, discard_on_release=VLLM_TAGS, bootstrap_port=bootstrap_port)

    def lifecycle_state(self) -> dict[str, Any]:
        """`ServerActorLifecycle.lifecycle_state`, plus `weight_update`: the call that opened the update in progress."""
        snapshot = super().lifecycle_state()
        if snapshot.get("node_rank") == 0:
            snapshot["weight_update"] = self._lc_vllm.update
        return snapshot

    # ------------------------------------------------------------------ memory

    def _lc_release(self, level: int, call: str) -> None:
        """Sleep both tags at `level` (1 or 2), as one request; see the module doc for what is refused."""
        if self.node_rank != 0:
            self._lc_sleep(None, call)
            return
        lifecycle = self.lifecycle
        client = self._lc_vllm_client()
        level = client.guard.checked_level(level)
        if self._lc_vllm.update is not None:
            self._lc_refuse(
                call,
                MemoryStateError,
                f"{call}: the weight update {self._lc_vllm.update} opened on {self._lc_url()} has not finished; "
                "a sleep now would release the weights it is writing. finish_weight_update first.",
                tags=list(VLLM_TAGS),
            )
        if lifecycle.state is State.FAILED:
            self._lc_sleep(None, call)  # refused by the machine, typed (recover first)
            return
        released = [t for t, r in lifecycle.residency.items() if r is Residency.RELEASED]
        if released and len(released) < len(VLLM_TAGS):
            self._lc_refuse(
                call,
                MemoryStateError,
                f"{call}: {released} still asleep on {self._lc_url()}; vLLM releases the weights and the KV "
                "cache together and ignores a sleep while one of them sleeps (its executor warns 'already "
                "sleeping'), so nothing would be freed. Wake every tag first (resume_memory_occupation()).",
                tags=released,
            )
        if not released:
            client.set_sleep_level(level)
            self._lc_vllm.restore = (
                level == 1
                and lifecycle.contents.get("weights") is Contents.VALID
                and self._lc_state.loading is None
            )
        self._lc_sleep(None, call)

    def _lc_resume(self, tags: Sequence[str] | None, call: str) -> None:
        """Wake `tags` (None: both); after a level-1 sleep of a whole version the weights' wake brings it
        back, and the server serves again once it is awake."""
        self._lc_wake(tags, call)
        if self.node_rank != 0 or not self._lc_vllm.restore:
            return
        lifecycle = self.lifecycle
        if lifecycle.residency.get("weights") is not Residency.RESIDENT:
            return
        self._lc_vllm.restore = False
        version = as_int(self._lc_state.served, lifecycle.weight_version)

        def restored() -> None:
            lifecycle.note_weights(
                Contents.VALID,
                version,
                reason="the level-1 sleep kept the weights in host RAM; the wake mapped them back",
            )

        lifecycle.run("sync", restored)
        self._lc_publish()
        if self._lc_servable():
            self._lc_rejoin()

    # ------------------------------------------------------------------ generation

    def _lc_vllm_pause(self, call: str, pause: Callable[[], Any]) -> Any:
        """The trainer's pause; inside an open update it pauses only (the update's version stays open)."""
        if self.node_rank == 0 and self._lc_vllm.update is not None:
            result = pause()
            self._lc_generation().paused = True
            return result
        return self._lc_pause(call, pause)

    def _lc_vllm_continue(self, call: str, resume: Callable[[], Any]) -> Any:
        """The trainer's continue: while an update is open generation stays paused (absorbed: None)."""
        if self.node_rank == 0 and self._lc_vllm.update is not None:
            self._lc_wait_logged(call)
            return None
        return self._lc_continue(call, resume)

    # ------------------------------------------------------------------ the weight update, one sync operation

    def _lc_update_start(self, call: str, start: Callable[[], Any]) -> Any:
        """Open the weight update (`start`: the framework's `POST /start_weight_update`)."""
        self._lc_node0(call)
        update = self._lc_vllm.update
        if update is not None:
            self._lc_refuse(
                call,
                DuplicateWeightUpdateStartError,
                f"{call} on {self._lc_url()} while the update {update} opened has not finished: one start "
                "per finish, from one coordinator per engine slot (vime #57); vLLM would refuse it ('a weight "
                "update is already active'), or a second coordinator would write into the first one's update",
                engine=self._lc_url(),
                call=call,
                open=update,
            )
        self._lc_state.loading = None  # a new version starts here, whatever the last one left
        result = self._lc_push(call, UPDATE_LABEL, start)
        self._lc_vllm.update, self._lc_vllm.chunks = call, 0
        return result

    def _lc_update_chunk(self, call: str, send: Callable[[], Any]) -> Any:
        """One chunk of the open update (`send`: the framework's `POST /update_weights`)."""
        self._lc_node0(call)
        self._lc_require_update(call)
        result = self._lc_push(call, UPDATE_LABEL, send)
        self._lc_vllm.chunks += 1
        return result

    def _lc_update_finish(self, call: str, version: Any, finish: Callable[[], Any]) -> Any:
        """Close the open update (`finish`: the framework's `POST /finish_weight_update`): its version is
        whole if every chunk since the start arrived, and at least one did."""
        self._lc_node0(call)
        self._lc_require_update(call)
        state, lifecycle = self._lc_vllm, self.lifecycle
        try:
            result = lifecycle.run("sync", finish)
        except BaseException:
            self._lc_state.interrupted = True
            raise
        finally:
            state.update = None
            self._lc_publish()
        if state.chunks == 0:
            self._lc_state.loading, self._lc_state.update_open = None, False
            self._lc_event(
                Event.ABSORBED,
                "warning",
                call=call,
                reason=(
                    f"no chunk came between the start and the finish of version {version}: it did not load, and the "
                    "weights stay unknown until a version loads whole"
                ),
            )
            return result
        if version is not None:
            self._lc_state.loading = str(version)
        self._lc_version_end(call)
        return result

    def _lc_whole_version(self, call: str, label: str, load: Callable[[], Any]) -> Any:
        """A version loaded whole by one call (from disk); refused while an update is open."""
        self._lc_node0(call)
        if self._lc_vllm.update is not None:
            self._lc_refuse(
                call,
                WeightUpdateBusyError,
                f"{call} on {self._lc_url()} while the update {self._lc_vllm.update} opened has not finished",
                engine=self._lc_url(),
                owner=self._lc_vllm.update,
                refused=call,
            )
        self._lc_state.loading = None
        result = self._lc_push(call, label, load)
        self._lc_version_end(call)
        return result

    def _lc_node0(self, call: str) -> None:
        if self.node_rank != 0:
            raise self._lc_follower_error(
                call, "the weight update goes to the engine's node-0 actor: one coordinator per slot"
            )

    def _lc_require_update(self, call: str) -> None:
        if self._lc_vllm.update is None:
            self._lc_refuse(
                call,
                WeightUpdateNotStartedError,
                f"{call} on {self._lc_url()} with no weight update open: start_weight_update first (vLLM refuses "
                "a chunk or a finish before a start)",
                engine=self._lc_url(),
                call=call,
            )

    def _lc_refuse(self, operation: str, error: type[Exception], message: str, /, **fields: Any) -> NoReturn:
        """Log the refusal of `operation` and raise it (with `fields`), before anything is sent."""
        self._lc_event(
            Event.REFUSED, "warning", operation=operation, state=self.lifecycle.state, reason=message
        )
        raise error(message, **fields)

"""AReaL's remote SGLang engine under the rollout table (the rollout's half).

    from actor_integration.frameworks.areal import ArealRolloutMixin
    from areal.engine.sglang_remote import RemoteSGLangEngine

    class LifecycleRemoteSGLangEngine(ArealRolloutMixin, RemoteSGLangEngine):
        pass

A rollout worker holds one `RemoteSGLangEngine` over its SGLang server(s); AReaL's trainer and
its `RolloutController` reach it with the calls below (read from AReaL cbff54d6:
`areal/engine/sglang_remote.py`, `areal/infra/remote_inf_engine.py`, `areal/trainer/rl_trainer.py`,
`areal/utils/recover.py`, `areal/engine/awex/sglang_plugin.py`). The wrap sends AReaL's requests
(the same endpoints and bodies; its first pause names SGLang's default mode, "abort") through the
lifecycle's own HTTP client, plus a `/flush_cache` after the pause, which AReaL does not send:

| AReaL's call | plain AReaL | under `ArealRolloutMixin` |
|---|---|---|
| `pause_generation()` | `/pause_generation` abort, then in_place, on every server | the same two (`ABORT_THEN_IN_PLACE`), then `/flush_cache` until the scheduler is idle or a deadline (`EngineNotIdleError`); once per pause |
| `offload(tags)` | `/release_memory_occupation` | the sleep of those tags: generation paused and flushed first; a released tag is not released again |
| `onload(tags)` | `/resume_memory_occupation` | the wake of the released ones; generation continues at its end only with every tag resident and valid weights |
| `continue_generation()` | `/continue_generation` | the same when awake with valid weights; otherwise held for the end of the wake (logged) |
| `resume()` | the workflow submits again | a sleeping engine is woken first, then the admission runs as a `generate`: refused (`InvalidWeightsError`) on weights no update reloaded |
| `update_weights_from_disk(meta)` | the load, in a helper process | the sync: weights unknown until the load returns, then valid at `meta.version`, and generation continues if the update's pause held it |
| the AWEX transfer (trainer side) | the plugin resumes `weights` in the scheduler and loads them | `lifecycle_before_weights_update()` first (asleep, paused in place), `lifecycle_weights_updated(version)` after: the machine learns the scheduler's resume and the version |
| `launch_server(args)` with AWEX | the plugin's entry point | the same, with the plugin's idle-loop queue polling off (AReaL #1737) |

Not covered: `agenerate` itself (requests go from the workflow to the server directly; the
admission gate is `resume()`), LoRA adapter loads, vLLM.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.rollout.engine import ABORT_THEN_IN_PLACE, PAUSE_MODES, EngineGeneration
from actor_integration.rollout.machine import rollout_lifecycle
from lifecycle import Contents, Hooks, Lifecycle, LifecyclePolicy, Residency, State
from lifecycle.errors import IllegalTransitionError
from lifecycle.events import log_path
from lifecycle.logs import Event

__all__ = [
    "IDLE_POLL_ENV",
    "ROLLOUT_TAGS",
    "ArealRolloutMixin",
    "SGLangServers",
    "ServersGeneration",
    "ServersMemory",
    "areal_rollout_policy",
]

ROLLOUT_TAGS = ("kv_cache", "weights")  # what AReaL releases, in its order (rl_trainer, recover)
# The AWEX plugin's switch for polling its weight queue in SGLang's idle loop (7cad29b6, the
# polling AReaL #1737 removed): each TP rank votes on its own loop count, and a rank whose loop
# drifted enters the vote's all_reduce while the others broadcast the next requests.
IDLE_POLL_ENV = "AREAL_AWEX_PROCESS_QUEUE_WHEN_IDLE"


def areal_rollout_policy() -> LifecyclePolicy:
    """SGLang's release keeps no copy of either tag; the weight update writes `weights`."""
    return LifecyclePolicy(
        memory_tags=ROLLOUT_TAGS,
        sync_requires=("weights",),
        discard_on_release=ROLLOUT_TAGS,
        model_tag=None,
        destroy_process_groups=False,
    )


def _no_codec(named: Any) -> Any:
    raise RuntimeError("the AReaL rollout wrap sends no weights: AReaL's own paths load them")


class SGLangServers:
    """The engine's servers as one: each call goes to every server, as AReaL's
    `_run_request_on_all_servers` sends it (what `EngineGeneration` drives)."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 60.0) -> None:
        if not urls:
            raise ValueError("SGLangServers: no server address; launch or connect the engine's servers first")
        self.servers = [
            # No codec: the AWEX plugin or SGLang's disk loader moves the weights, never this client.
            SGLangHTTPEngine(
                u if "://" in u else f"http://{u}",
                timeout_s=timeout_s,
                codec=_no_codec,
                multi_dtype_buckets=False,
            )
            for u in urls
        ]

    def pause_generation(self, mode: str = "abort") -> None:
        for server in self.servers:
            server.pause_generation(mode)

    def continue_generation(self) -> None:
        for server in self.servers:
            server.continue_generation()

    def flush_cache(self) -> bool:
        return all([server.flush_cache() for server in self.servers])

    def queued_requests(self) -> dict[str, int]:
        queued = [server.queued_requests() for server in self.servers]
        return {k: sum(q.get(k, 0) for q in queued) for k in ("running", "waiting")}

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        for server in self.servers:
            server.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        for server in self.servers:
            server.resume_memory_occupation(tags)

    def close(self) -> None:
        for server in self.servers:
            server.close()


class ServersMemory:
    """A `MemoryBackend` over the servers' release and resume, one tag per request as AReaL sends
    them. A tag in `scheduler_resumed` was resumed inside SGLang's scheduler by AReaL's AWEX plugin
    (`process_awex_queue`): its resume is recorded without a request (a second resume is SGLang's
    `KeyError`, which kills the server)."""

    def __init__(self, servers: SGLangServers) -> None:
        self.servers = servers
        self.scheduler_resumed: set[str] = set()

    def pause(self, tag: str | None = None) -> None:
        self.scheduler_resumed.discard(tag or "")
        self.servers.release_memory_occupation([tag] if tag else list(ROLLOUT_TAGS))

    def resume(self, tag: str | None = None) -> None:
        if tag is not None and tag in self.scheduler_resumed:
            self.scheduler_resumed.discard(tag)
            return
        self.servers.resume_memory_occupation([tag] if tag else list(ROLLOUT_TAGS))

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield  # the servers allocate their own memory


class ServersGeneration(EngineGeneration):
    """The rollout's generation backend: AReaL's pause (default `ABORT_THEN_IN_PLACE`) and a flush
    with a deadline, once per pause; the continue only when `servable()` (every tag resident, the
    weights valid), else generation stays paused (`on_hold` is told why)."""

    def __init__(
        self,
        servers: SGLangServers,
        *,
        servable: Callable[[], bool],
        on_hold: Callable[[str], None],
        mode: str = ABORT_THEN_IN_PLACE,
        flush_deadline_s: float | None = None,
    ) -> None:
        super().__init__(servers, mode=mode, flush_deadline_s=flush_deadline_s)  # type: ignore[arg-type]
        self.servable, self.on_hold = servable, on_hold
        self.paused = False

    def pause(self) -> None:
        if self.paused:
            self._flush()  # paused already (AReaL's own pause_generation before the offload): idle?
            return
        self.paused = True  # before the requests: a pause whose flush failed is continued by the wake
        EngineGeneration.pause(self)

    def resume(self) -> None:
        if not self.paused:
            return
        if not self.servable():
            self.on_hold("generation stays paused: a tag is released or the weights are not valid")
            return
        EngineGeneration.resume(self)
        self.paused = False


class ArealRolloutMixin:
    """The rollout table in front of AReaL's `RemoteSGLangEngine` calls; put it first in the bases."""

    lifecycle_pause_mode: str = ABORT_THEN_IN_PLACE
    lifecycle_flush_deadline_s: float = 30.0
    lifecycle_timeout_s: float = 60.0
    lifecycle_rank: int | None = None
    lifecycle_log_dir: str | None = None

    # ------------------------------------------------------------------ configuration

    def _own(self, name: str) -> Any:
        return getattr(super(), name)

    def lifecycle_addresses(self) -> list[str]:
        """The engine's servers (`RemoteInfEngine.addresses`)."""
        inner = getattr(self, "_engine", self)
        return list(getattr(inner, "addresses", None) or [])

    def lifecycle_servers(self, addresses: Sequence[str]) -> SGLangServers:
        """The client the machine's hooks send through (override to send elsewhere)."""
        return SGLangServers(addresses, timeout_s=self.lifecycle_timeout_s)

    @property
    def lifecycle(self) -> Lifecycle:
        """The engine's machine, built on first use over its servers (started AWAKE, as launched)."""
        lifecycle: Lifecycle | None = self.__dict__.get("_lc")
        if lifecycle is not None:
            return lifecycle
        if self.lifecycle_pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"{type(self).__name__}.lifecycle_pause_mode must be one of {list(PAUSE_MODES)}, "
                f"got {self.lifecycle_pause_mode!r}"
            )
        addresses = self.lifecycle_addresses()
        if not addresses:
            raise IllegalTransitionError(
                f"{type(self).__name__} has no SGLang server yet: initialize() or launch_server() first",
                state=State.AWAKE,
                operation="lifecycle",
                allowed=("initialize", "launch_server"),
            )
        servers = self.lifecycle_servers(addresses)
        memory = ServersMemory(servers)
        generation = ServersGeneration(
            servers,
            servable=self._lc_servable,
            on_hold=lambda why: self._lc_event("continue_generation", why),
            mode=self.lifecycle_pause_mode,
            flush_deadline_s=self.lifecycle_flush_deadline_s,
        )
        lifecycle = rollout_lifecycle(
            areal_rollout_policy(),
            Hooks(memory=memory, generation=generation),
            rank=self.lifecycle_rank,
            log_dir=self.lifecycle_log_dir,
        )
        lifecycle.bind(framework="areal", servers=addresses)
        self.__dict__.update(_lc=lifecycle, _lc_memory=memory, _lc_generation=generation, _lc_servers=servers)
        return lifecycle

    def _lc_servable(self) -> bool:
        lifecycle = self.lifecycle
        return (
            all(r is Residency.RESIDENT for r in lifecycle.residency.values())
            and lifecycle.contents.get("weights") is Contents.VALID
        )

    def _lc_event(self, call: str, reason: str) -> None:
        self.lifecycle.event(Event.ABSORBED, call=call, reason=reason)

    def _lc_tags(self, tags: Iterable[str] | None, call: str) -> tuple[str, ...]:
        if tags is None:
            return ROLLOUT_TAGS
        asked = list(tags)
        unknown = sorted(set(asked) - set(ROLLOUT_TAGS))
        if unknown:
            raise ValueError(
                f"{call}(tags={asked}): the lifecycle tracks {list(ROLLOUT_TAGS)} (what AReaL releases), not {unknown}"
            )
        return tuple(t for t in ROLLOUT_TAGS if t in asked)

    # ------------------------------------------------------------------ AReaL's calls

    def pause_generation(self) -> None:
        """AReaL's pause (abort, then in_place) and a flush, once until the next continue."""
        generation: ServersGeneration = self._lc_parts()["_lc_generation"]
        generation.pause()

    def continue_generation(self) -> None:
        """Continue when awake with valid weights; otherwise the wake that makes them so continues."""
        lifecycle = self.lifecycle
        generation: ServersGeneration = self.__dict__["_lc_generation"]
        if lifecycle.state is State.AWAKE and self._lc_servable():
            generation.resume()
            return
        self._lc_event(
            "continue_generation",
            f"held: the engine is {lifecycle.state.value} with {lifecycle.snapshot()['residency']} and weights "
            f"{lifecycle.contents.get('weights')}; generation continues at the end of the wake that makes every "
            "tag resident with valid weights",
        )

    def offload(self, tags: list[str] | None = None) -> None:
        """The sleep of `tags` (default: both): paused and flushed first; released tags stay released."""
        self.lifecycle.sleep(self._lc_tags(tags, "offload"))

    def onload(self, tags: list[str] | None = None) -> None:
        """The wake of `tags` (default: both); generation continues at its end if it can be served."""
        self.lifecycle.wake_up(self._lc_tags(tags, "onload"))

    def resume(self) -> Any:
        """Admission again (the workflow submits): a sleeping engine is woken first; refused on weights
        that no update reloaded, instead of admitting requests that would hang or read garbage."""
        lifecycle = self.lifecycle
        if lifecycle.state is State.PAUSED:
            lifecycle.wake_up()
        admit = self._own("resume")

        def body() -> Any:
            self.continue_generation()  # the continue a paused engine was left without (the recover's finally)
            return admit()

        return lifecycle.run("generate", body)

    def update_weights_from_disk(self, meta: Any) -> Any:
        """AReaL's disk load as the sync: its future is returned at once (AReaL's trainer saves the
        checkpoint while the load waits for it); when it resolves the version is whole."""
        lifecycle = self.lifecycle
        version = getattr(meta, "version", None)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(
                f"update_weights_from_disk: meta.version must be the int version loaded, got {version!r}; "
                "pass meta.with_version(step) as AReaL's trainer does"
            )
        path = getattr(meta, "path", None)
        lifecycle.run(
            "sync",
            lambda: lifecycle.note_weights(Contents.UNKNOWN, reason=f"loading {path} from disk"),
        )
        inner = self._own("update_weights_from_disk")(meta)
        # AReaL's trainer waits on the future, then continues generation and resumes the workflow:
        # the future it gets resolves once the machine knows the version is whole.
        outer: Future[Any] = Future()

        def done(finished: Future[Any]) -> None:
            try:
                self._lc_disk_done(finished, version)
            finally:
                error = None if finished.cancelled() else finished.exception()
                if finished.cancelled():
                    outer.cancel()
                elif error is not None:
                    outer.set_exception(error)
                else:
                    outer.set_result(finished.result())

        inner.add_done_callback(done)
        return outer

    def _lc_disk_done(self, future: Future[Any], version: int) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the weights stay unknown: generate is refused until a load succeeds
        lifecycle = self.lifecycle
        lifecycle.run(
            "sync", lambda: lifecycle.note_weights(Contents.VALID, version, reason="disk load returned")
        )
        self.continue_generation()  # a missing continue no longer holds generation (AReaL #1160)

    def launch_server(self, server_args: dict[str, Any]) -> Any:
        """AReaL's launch; with AWEX, the plugin's idle-loop polling is switched off first."""
        awex = bool(
            server_args.get("awex_colocate_mode")
            or server_args.get("awex_meta_server_addr")
            or os.environ.get("AWEX_META_SERVER_ADDR")
        )
        if awex:
            given = os.environ.get(IDLE_POLL_ENV)
            if given not in (None, "", "0", "false", "False"):
                raise ValueError(
                    f"{IDLE_POLL_ENV}={given!r}: polling AWEX's queue in SGLang's idle loop desynchronises the TP "
                    f"ranks' collectives (AReaL #1737); unset it, the lifecycle updates weights only while paused"
                )
            os.environ[IDLE_POLL_ENV] = "0"  # read by the plugin in the server process AReaL spawns
        return self._own("launch_server")(server_args)

    # ------------------------------------------------------------------ the AWEX transfer

    def lifecycle_before_weights_update(self) -> None:
        """Asleep before the trainer publishes: paused in place (the plugin only reads its queue then)
        and `weights` released (the plugin resumes them itself). A no-op when already so."""
        self.lifecycle.sleep(ROLLOUT_TAGS)

    def lifecycle_weights_updated(self, version: int | None) -> None:
        """The trainer's AWEX transfer finished (every engine signalled): the plugin resumed `weights`
        in the scheduler and loaded `version` (None: the next one). Generation continues if the engine
        is then awake."""
        lifecycle = self.lifecycle
        if (
            version is not None
            and lifecycle.weight_version == version
            and lifecycle.contents.get("weights") is Contents.VALID
            and lifecycle.residency.get("weights") is Residency.RESIDENT
        ):
            return  # told already (trainer rank 0, then the driver): the same transfer
        if lifecycle.residency.get("weights") is not Residency.RELEASED:
            raise IllegalTransitionError(
                f"lifecycle_weights_updated(version={version}): the engine's weights were "
                f"{lifecycle.residency.get('weights')}, but the AWEX reader resumes them itself (SGLang's "
                "KeyError on an unreleased tag): call lifecycle_before_weights_update() before the trainer's update",
                state=lifecycle.state,
                operation="sync",
                allowed=("sleep",),
            )
        if version is None:
            version = (lifecycle.weight_version or 0) + 1
        memory: ServersMemory = self.__dict__["_lc_memory"]
        memory.scheduler_resumed.add("weights")
        lifecycle.wake_up(["weights"])
        lifecycle.run(
            "sync",
            lambda: lifecycle.note_weights(
                Contents.VALID, version, reason="AWEX transfer: the plugin resumed and loaded the weights"
            ),
        )
        if lifecycle.state is State.AWAKE:
            self.continue_generation()

    def lifecycle_state(self) -> dict[str, Any]:
        """The machine's snapshot (what a driver reads)."""
        return self.lifecycle.snapshot()

    def lifecycle_log_path(self) -> str | None:
        """The JSON-lines file this engine's lifecycle events go to (None: not to a file)."""
        self.lifecycle  # noqa: B018 - configures the rank log on first use
        path = log_path()
        return None if path is None else str(path)

    def _lc_parts(self) -> dict[str, Any]:
        self.lifecycle  # noqa: B018 - builds the machine and its backends on first use
        return self.__dict__

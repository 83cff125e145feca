"""A framework's SGLang engine actor under the rollout lifecycle: what slime's and miles' share.

slime and miles drive each SGLang server from a Ray actor (`SGLangEngine` in
`backends/sglang_utils/sglang_engine.py`) that launches `sglang.launch_server` in a child process
and sends it HTTP requests, with no state of its own. Their rollout manager calls the actor
(offload = `release_memory_occupation`, onload = `resume_memory_occupation(tags)`), their trainer
calls it around a weight push (`pause_generation`, `flush_cache`, `update_weights_from_tensor` per
bucket, `continue_generation`), their health monitor calls `health_generate`; rollout requests
never pass through it: the rollout function sends them to the router, which forwards them.

`SGLangActorLifecycle` puts the rollout's transition table in front of every one of those calls:

- memory: the server's tags `weights`, `kv_cache`, `cuda_graph`, each resident or released; a
  release or resume of several tags is one request, as the framework sends it. A second release
  and a resume of a resident tag are logged no-ops (the real server exits on either);
- a sleep takes the server out of the router, pauses generation (abort) and flushes the cache
  (retried until a deadline) before anything is released, so no request reaches released memory
  (a router with no route that removes a worker, miles' own, keeps the server: then SGLang's pause
  alone holds the requests routed to it, until the wake);
- weights, per version: valid at launch (the checkpoint), discarded by a release, unknown from the
  first bucket of a version until the trainer's `continue_generation` (miles: `end_weight_update`)
  says the version is whole, then valid at that version; a push into released weights is refused;
- the server goes back into the router, and generation continues, only when it is awake with a
  whole version loaded and `/model_info` reports that version: a server that lost its weights
  (a wake without a push), holds a partly loaded version, or reports another version stays out;
- an engine with the memory saver (colocated, offloaded) joins the router only once that holds,
  not at launch: a restarted engine never serves its launch checkpoint (miles #1724);
- a health check while the weights cannot be served asks `/model_info` (no generation: a
  `/health_generate` on released memory kills the server) and reports FAILED as unhealthy.

Followers (`node_rank != 0`: the other nodes of a multi-node engine) send nothing, in plain slime
and miles too, but answer every call with success; here they follow the node-0 actor's lifecycle
(`EngineDirectory`): a release or resume returns once node 0's did it, a health check asks node
0's server, and a call only node 0 can make (a weight push: one coordinator per engine slot) is a
`FollowerCallError`.

Weights from the lifecycle's own `WeightSender` go through `lifecycle_update_weights(version,
payloads)`, the sender's `engine_call`: the same guard as the framework's pushes, with the round
sent to the server's schedulers unopened (the wrap starts the server with the lifecycle's receiver
in `custom_weight_loader`; `lifecycle_scheduler_receiver = False` leaves it out): each scheduler
opens the trainer's staging buffers by CUDA IPC handle, verifies every bucket's checksum and
loads through SGLang's loaders. A version's final round ends it, as `continue_generation` does;
the sleep closes the trainer buffers the schedulers hold open.

What is not covered: a client that sends requests to the server directly, bypassing the router,
while it is awake (its requests wait while generation is paused, and are served after the wake,
on the new version); LoRA adapter loads; frameworks' calls not listed in the subclasses.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.engines.sglang.scheduler import SCHEDULER_LOADER
from actor_integration.errors import SGLangServerError, SGLangServerTimeout
from actor_integration.rollout.directory import EngineDirectory, LocalDirectory, engine_directory
from actor_integration.rollout.machine import log_loaded
from actor_integration.rollout.router import RouterWorkers
from actor_integration.rollout.server_actor import ServerActorLifecycle, ServerMemory
from actor_integration.weight_sync.wire import (
    CorruptBucketError,
    RankPayload,
    WeightSyncError,
    WrittenWeightsError,
)
from lifecycle.logs import Event

__all__ = [
    "SERVER_TAGS",
    "EngineDirectory",
    "LocalDirectory",
    "SGLangActorLifecycle",
    "ServerMemory",
    "engine_base",
    "engine_directory",
]

SERVER_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES, in its order


def _no_codec(named: Any) -> Any:
    raise RuntimeError(
        "the framework's engine actor pushes weights itself; the lifecycle's client sends none"
    )


class SGLangActorLifecycle(ServerActorLifecycle):
    """The shared part of `SlimeRolloutMixin` and `MilesRolloutMixin`; put theirs first in the bases.
    The engine-agnostic rules are `ServerActorLifecycle`'s; this class adds SGLang's calls.

    Class attributes a subclass (or a user's class) may change (and `ServerActorLifecycle`'s):
    `lifecycle_admission`: "after_sync" (join the router only once a whole version is loaded and
    awake), "at_init" (join at launch, as plain slime and miles do: for frozen models that are
    never pushed to), or None: "after_sync" when the server has the memory saver
    (`enable_memory_saver`, i.e. it is offloaded), else "at_init".
    `lifecycle_flush_deadline_s`: how long a sleep retries a flush the server refuses as busy
    (slime's own `flush_cache` tries 60 times, a second apart).
    `lifecycle_scheduler_receiver`: start the server with the lifecycle's receiver in
    `custom_weight_loader`, so `lifecycle_update_weights` can load the trainer's buffers there.
    """

    lifecycle_framework: ClassVar[str] = "sglang"
    lifecycle_engine_label: ClassVar[str] = "SGLang"
    lifecycle_server_tags: ClassVar[tuple[str, ...]] = SERVER_TAGS
    lifecycle_process_prefix: ClassVar[str] = "sglang::"  # SGLang titles its scheduler and detokenizer so
    lifecycle_admission: ClassVar[str | None] = None
    lifecycle_scheduler_receiver: ClassVar[bool] = True

    def _lc_new_client(self, url: str, *, timeout_s: float, api_key: Any = None) -> SGLangHTTPEngine:
        return SGLangHTTPEngine(
            url, timeout_s=timeout_s, api_key=api_key, codec=_no_codec, multi_dtype_buckets=False
        )

    # ------------------------------------------------------------------ the calls both frameworks make alike

    def _own(self, name: str) -> Any:
        """The framework's own method `name`: the engine class after the lifecycle's in the bases."""
        return getattr(super(), name)

    def init(self, dist_init_addr: str, port: int, nccl_port: int, *args: Any, **kwargs: Any) -> Any:
        result = self._own("init")(dist_init_addr, port, nccl_port, *args, **kwargs)
        self._lc_after_init(dist_init_addr)
        return result

    def _init_normal(self, server_args_dict: dict[str, Any]) -> Any:
        return self._lc_init_normal(self._own("_init_normal"), server_args_dict)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._lc_wake(tags, "resume_memory_occupation")

    def continue_generation(self) -> Any:
        return self._lc_continue("continue_generation", self._own("continue_generation"))

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> Any:
        result = self._lc_push(
            "update_weights_from_disk",
            weight_version if weight_version is not None else f"disk:{model_path}",
            lambda: self._own("update_weights_from_disk")(
                model_path, load_format=load_format, weight_version=weight_version
            ),
        )
        self._lc_version_end("update_weights_from_disk")  # a checkpoint loads whole in one call
        return result

    def health_generate(self, timeout: float = 5.0) -> Any:
        return self._lc_health(timeout, lambda: self._own("health_generate")(timeout=timeout))

    def shutdown(self) -> Any:
        """The framework's shutdown (its server out of the router, then killed), then the wrap's
        helper thread and kept-alive connections closed. Under a router that cannot remove a worker
        (miles' own), the framework's removal request fails before its kill: the wrap kills the
        server itself, logs the call as absorbed and returns, so the `ray.kill` that the rollout
        manager sends after a shutdown that returned runs."""
        try:
            return self._own("shutdown")()
        except Exception as exc:
            router: RouterWorkers | None = self._lc_state.router
            if self._lc_state.lifecycle is None or router is None or router.removable:
                raise
            kill_process_tree = vars(sys.modules[engine_base(type(self)).__module__])["kill_process_tree"]
            kill_process_tree(self.process.pid)
            self._lc_state.admitted = False
            self._lc_event(
                Event.ABSORBED,
                "warning",
                call="shutdown",
                reason=(
                    f"the framework's shutdown failed ({type(exc).__name__}: {exc}) at the router at "
                    f"{router.router_url}, which has no route that removes a worker ({router.api!r} API); "
                    f"the wrap killed the server at {self._lc_url()} (pid {self.process.pid}) instead"
                ),
            )
            return None
        finally:
            self._lc_close()

    def _lc_admission(self) -> str:
        if self.lifecycle_admission is not None:
            if self.lifecycle_admission not in ("after_sync", "at_init"):
                raise ValueError(
                    f"{type(self).__name__}.lifecycle_admission must be 'after_sync', 'at_init' or None, "
                    f"got {self.lifecycle_admission!r}"
                )
            return self.lifecycle_admission
        return "after_sync" if self.lifecycle_server_args().get("enable_memory_saver") else "at_init"

    def _lc_init_normal(self, launch: Callable[[dict[str, Any]], Any], server_args: dict[str, Any]) -> Any:
        """The framework's `_init_normal`, with its router registration held back under "after_sync"."""
        if self.lifecycle_scheduler_receiver:
            loaders = list(server_args.get("custom_weight_loader") or [])
            if SCHEDULER_LOADER not in loaders:
                server_args["custom_weight_loader"] = [*loaders, SCHEDULER_LOADER]
        self._lc_state.server_args = dict(server_args)
        hold_back = self._lc_admission() == "after_sync"
        router = (self.router_ip, self.router_port)
        if hold_back:
            self.router_ip = None  # both frameworks register only when router_ip is set
        try:
            return launch(server_args)
        finally:
            self.router_ip, self.router_port = router
            self._lc_state.held_back = hold_back

    def _lc_after_init(self, dist_init_addr: str) -> None:
        """Build the lifecycle once the server is up (node 0) or the follower's view of node 0's."""
        backed_up = bool(self.lifecycle_server_args().get("enable_weights_cpu_backup"))
        self._lc_start(
            dist_init_addr,
            discard_on_release=tuple(t for t in SERVER_TAGS if not (backed_up and t == "weights")),
            bootstrap_port=self.lifecycle_server_args().get("disaggregation_bootstrap_port"),
        )

    def lifecycle_update_weights(self, version: int, payloads: list[RankPayload]) -> dict[str, Any]:
        """One round of the lifecycle's `WeightSender` (its `engine_call`): one payload per TP rank,
        loaded by the server's schedulers from the trainer's buffers. Guarded as the framework's
        pushes are (generation paused, the weights unknown until the version's final round); the
        final round ends the version and, where the server is awake, continues generation and puts
        it back in the router. The engine's answer (bytes, its phases' timings)."""
        if not payloads:
            raise ValueError(f"lifecycle_update_weights(version={version}): no payloads")
        self._lc_check_receiver()
        first = payloads[0]
        if first.round == 0:  # the sender's first round opens the version, as the trainer's pause does
            state = self._lc_state
            state.update_open, state.loading, state.interrupted = True, None, False
            state.sent = [time.perf_counter(), 0]
        # [when the version's first round came, the bytes of its rounds loaded so far]
        if self._lc_state.sent is None:
            self._lc_state.sent = [time.perf_counter(), 0]
        sent: list[Any] = self._lc_state.sent

        def load() -> dict[str, Any]:
            client = self._lc_receiver()  # started here, past the guard: with the weights resident
            try:
                answer = client.load_payloads(version, payloads, round_index=first.round, final=first.final)
            except (CorruptBucketError, WeightSyncError) as error:
                log_loaded(
                    self._lc_event,
                    version=version,
                    nbytes=sent[1],  # the version's rounds loaded before this one, as RolloutActor logs them
                    transport=first.transport,
                    ok=False,
                    checksum_ok=not isinstance(error, CorruptBucketError),
                    digest_ok=False if isinstance(error, WrittenWeightsError) else None,
                    written=bool(error.fields.get("written")),
                    duration_ms=round((time.perf_counter() - sent[0]) * 1e3, 3),
                )
                raise
            sent[1] += answer["nbytes"]
            if first.final:  # inside the sync body, as every engine's `weight_sync.loaded`: the whole version
                log_loaded(
                    self._lc_event,
                    version=version,
                    nbytes=sent[1],
                    transport=first.transport,
                    ok=True,
                    checksum_ok=True,
                    digest_ok=answer["timings"].get("digest"),  # the schedulers read back what they wrote
                    duration_ms=round((time.perf_counter() - sent[0]) * 1e3, 3),
                    engine_ms=answer["timings"],
                )
            return answer

        answer: dict[str, Any] = self._lc_push("lifecycle_update_weights", version, load)
        if first.final:
            self._lc_continue("lifecycle_update_weights", self._lc_server().continue_generation)
        return answer

    def _lc_check_receiver(self) -> None:
        """Refuse, before anything is sent, a sync this engine cannot take (a follower; a server
        started without the lifecycle's receiver)."""
        if self.node_rank != 0:
            raise self._lc_follower_error(
                "lifecycle_update_weights",
                "weights go to the engine's node-0 actor: one coordinator per slot",
            )
        if SCHEDULER_LOADER not in (self.lifecycle_server_args().get("custom_weight_loader") or []):
            raise ValueError(
                f"{type(self).__name__}.lifecycle_update_weights: the server was started without the "
                f"lifecycle's receiver ({type(self).__name__}.lifecycle_scheduler_receiver is False): push "
                "with the framework's update_weights_from_tensor, or set it True and restart the engine"
            )

    def _lc_receiver(self) -> SGLangHTTPEngine:
        """The client of the server's scheduler-side receiver, started on first use."""
        client: SGLangHTTPEngine | None = self._lc_state.receiver_client
        if client is None:
            client = SGLangHTTPEngine(
                self._lc_url(),
                timeout_s=self.lifecycle_timeout_s,
                api_key=self.lifecycle_server_args().get("api_key"),
                codec=_no_codec,
                multi_dtype_buckets=False,
                scheduler_receiver=True,
                serialize_names=self.lifecycle_serialize_names(),
            )
            self._lc_state.receiver_client = client
        return client

    def lifecycle_serialize_names(self) -> Callable[[Sequence[str]], Any] | None:
        """How the receiver's calls are serialized (None: SGLang's own serializer)."""
        return None

    def _lc_close_trainer_buffers(self) -> None:
        """The sleep's first request to the schedulers (its generation hook, once out of the
        router): they close the trainer buffers they hold open. A server that does not answer in
        time, or cannot be reached, fails the sleep here, typed, with nothing released and within
        one request's deadline (the flush would wait out another); any other error is logged and
        the sleep goes on (best effort)."""
        client: SGLangHTTPEngine | None = self._lc_state.receiver_client
        if client is None:
            return
        try:
            closed = client.release_payload_handles()
        except (SGLangServerError, SGLangServerTimeout):
            raise
        except Exception as exc:
            self._lc_event(Event.ABSORBED, "warning", call="release_payload_handles", reason=repr(exc))
            return
        if closed:
            self._lc_event(
                Event.ABSORBED, call="release_payload_handles", reason=f"{closed} trainer buffers closed"
            )


_BUILT: dict[tuple[type, type], type] = {}


def wrapped_engine(mixin: type, engine_class: type, module: str) -> type:
    """`class LifecycleSGLangEngine(mixin, engine_class)`, built once per pair (Ray pickles it by
    value; `module` is the framework adapter's, where the class says it comes from)."""
    built = _BUILT.get((mixin, engine_class))
    if built is None:
        built = type("LifecycleSGLangEngine", (mixin, engine_class), {"__module__": module})
        _BUILT[(mixin, engine_class)] = built
    return built


def engine_base(cls: type) -> type:
    """The framework's own SGLangEngine among a wrapped class's bases (the first after the mixins)."""
    for klass in cls.__mro__:
        if "init" in vars(klass) and not issubclass(klass, ServerActorLifecycle):
            return klass
    raise TypeError(f"{cls.__name__} has no framework SGLangEngine among its bases")


def install_into(module: Any, wrap: Callable[[type], type]) -> type:
    """`module.SGLangEngine = wrap(module.SGLangEngine)`, once (a wrapped class is left as it is)."""
    current = module.SGLangEngine
    if isinstance(current, type) and issubclass(current, SGLangActorLifecycle):
        return current
    module.SGLangEngine = wrap(current)
    wrapped: type = module.SGLangEngine
    return wrapped

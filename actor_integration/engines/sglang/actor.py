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

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.engines.sglang.scheduler import SCHEDULER_LOADER
from actor_integration.errors import (
    FollowerCallError,
    RouterError,
    SGLangServerError,
    SGLangServerTimeout,
    StaleWeightsError,
)
from actor_integration.rollout.engine import EngineGeneration
from actor_integration.rollout.router import RouterWorkers
from actor_integration.weight_sync.wire import (
    CorruptBucketError,
    RankPayload,
    WeightSyncError,
    WrittenWeightsError,
)
from lifecycle import Contents, Hooks, Lifecycle, LifecyclePolicy, Residency, State
from lifecycle.errors import IllegalTransitionError, LifecycleFailedError
from lifecycle.events import configure_rank_log, log_path
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

T = TypeVar("T")
SERVER_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
ROLE = "rollout"


def _no_codec(named: Any) -> Any:
    raise RuntimeError(
        "the framework's engine actor pushes weights itself; the lifecycle's client sends none"
    )


class ServerMemory:
    """A `MemoryBackend` over the server's `/release_memory_occupation` and `/resume_memory_occupation`.

    The machine pauses and resumes one tag per hook call; inside `together(...)` the tags of one
    plan go in one request, the first call's, as slime and miles send them (SGLang releases
    several tags in one scheduler call): the later calls of the plan find their tag sent.
    """

    def __init__(self, server: SGLangHTTPEngine) -> None:
        self.server = server
        self._batch: dict[str, tuple[str, ...]] = {"pause": (), "resume": ()}
        self._sent: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def together(self, *, pause: Sequence[str] = (), resume: Sequence[str] = ()) -> Iterator[None]:
        self._batch = {"pause": tuple(pause), "resume": tuple(resume)}
        self._sent = set()
        try:
            yield
        finally:
            self._batch = {"pause": (), "resume": ()}
            self._sent = set()

    def _send(self, kind: str, tag: str | None, call: Callable[[list[str] | None], None]) -> None:
        if tag is not None and (kind, tag) in self._sent:
            return
        batch = self._batch[kind]
        tags = list(batch) if tag in batch else (None if tag is None else [tag])
        call(tags)
        self._sent.update((kind, t) for t in (tags or ()))

    def pause(self, tag: str | None = None) -> None:
        self._send("pause", tag, self.server.release_memory_occupation)

    def resume(self, tag: str | None = None) -> None:
        self._send("resume", tag, self.server.resume_memory_occupation)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield  # the server allocates its own memory


class _ServerGeneration(EngineGeneration):
    """The sleep's first step: out of the router while SGLang pauses (abort) and flushes with a
    deadline. The wake's last step puts the server back only when its weights can be served."""

    def __init__(
        self,
        server: SGLangHTTPEngine,
        *,
        while_leaving: Callable[[Callable[[], None]], None],
        close_buffers: Callable[[], None],
        rejoin: Callable[[], None],
        flush_deadline_s: float,
    ) -> None:
        super().__init__(server, mode="abort", flush_deadline_s=flush_deadline_s)
        self._while_leaving, self._close_buffers, self._rejoin = while_leaving, close_buffers, rejoin
        self.paused = False
        self.by_sleep = False  # paused by the sleep, not continued since: nothing runs on the server

    def pause(self) -> None:
        # The server's requests go while the router takes it out (one round trip, not two): a
        # request the router still sends after SGLang's pause waits in SGLang's tokenizer manager,
        # before the scheduler and its memory, and is served after the wake's continue, on the
        # version the wake checked.
        self._while_leaving(self._pause_server)

    def _pause_server(self) -> None:
        # Marked before the requests: a pause SGLang took whose flush then failed (a hung
        # scheduler) leaves the server paused, and the wake that recovers must continue it (a
        # continue on a server that never paused is harmless).
        self.paused = self.by_sleep = True
        self._close_buffers()
        EngineGeneration.pause(self)

    def resume(self) -> None:
        self._rejoin()


# ---------------------------------------------------------------------------------- followers


class EngineDirectory:
    """Where an engine's node-0 actor publishes its lifecycle for the engine's followers."""

    def put(self, key: str, value: dict[str, Any]) -> None:
        raise NotImplementedError

    def get(self, key: str) -> dict[str, Any] | None:
        raise NotImplementedError


class LocalDirectory(EngineDirectory):
    """One process's directory (tests, and actors run in one process)."""

    entries: ClassVar[dict[str, dict[str, Any]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self.entries[key] = json.loads(json.dumps(value, default=str))

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self.entries.get(key)
            return None if entry is None else dict(entry)


class _RayDirectory(EngineDirectory):
    """Ray's internal key-value store: every actor of the job reads what node 0's actor wrote."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.kv._internal_kv_put(key, json.dumps(value, default=str).encode(), overwrite=True)

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self.kv._internal_kv_get(key)
        return None if raw is None else dict(json.loads(raw))


def engine_directory() -> EngineDirectory:
    """Ray's key-value store inside a Ray worker, else this process's `LocalDirectory`."""
    try:
        from ray.experimental import internal_kv
    except ImportError:
        return LocalDirectory()
    initialized = getattr(internal_kv, "_internal_kv_initialized", lambda: False)
    return _RayDirectory(internal_kv) if initialized() else LocalDirectory()


# ---------------------------------------------------------------------------------- the mixin


class SGLangActorLifecycle:
    """The shared part of `SlimeRolloutMixin` and `MilesRolloutMixin`; put theirs first in the bases.

    Class attributes a subclass (or a user's class) may change:
    `lifecycle_admission`: "after_sync" (join the router only once a whole version is loaded and
    awake), "at_init" (join at launch, as plain slime and miles do: for frozen models that are
    never pushed to), or None: "after_sync" when the server has the memory saver
    (`enable_memory_saver`, i.e. it is offloaded), else "at_init".
    `lifecycle_flush_deadline_s`: how long a sleep retries a flush the server refuses as busy
    (slime's own `flush_cache` tries 60 times, a second apart).
    `lifecycle_timeout_s`: the deadline of every request the lifecycle itself sends.
    `lifecycle_follow_deadline_s`: how long a follower waits for node 0's actor.
    `lifecycle_log_dir`: where `rollout-rank<rank>.jsonl` goes (see `configure_rank_log`).
    `lifecycle_scheduler_receiver`: start the server with the lifecycle's receiver in
    `custom_weight_loader`, so `lifecycle_update_weights` can load the trainer's buffers there.
    """

    lifecycle_framework: ClassVar[str] = "sglang"
    lifecycle_admission: ClassVar[str | None] = None
    lifecycle_flush_deadline_s: ClassVar[float] = 60.0
    lifecycle_timeout_s: ClassVar[float] = 60.0
    lifecycle_follow_deadline_s: ClassVar[float] = 600.0
    lifecycle_log_dir: ClassVar[str | None] = None
    lifecycle_scheduler_receiver: ClassVar[bool] = True

    # The framework's own attributes (set by its __init__ / init).
    args: Any
    rank: int
    process: Any
    worker_type: str
    node_rank: int
    server_host: str
    server_port: int
    router_ip: Any
    router_port: Any

    _lc: Lifecycle | None = None
    _lc_key: str | None = None

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
            router: RouterWorkers | None = self.__dict__.get("_lc_router")
            if self._lc is None or router is None or router.removable:
                raise
            kill_process_tree = vars(sys.modules[engine_base(type(self)).__module__])["kill_process_tree"]
            kill_process_tree(self.process.pid)
            self.__dict__["_lc_admitted"] = False
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

    # ------------------------------------------------------------------ configuration

    def lifecycle_router_api(self) -> str:
        """Which worker API the router speaks (`router.ROUTER_APIS`); the framework's own choice."""
        return "workers"

    def lifecycle_server_args(self) -> dict[str, Any]:
        """The server's arguments, as the framework computed them at init (empty before)."""
        return dict(self.__dict__.get("_lc_server_args") or {})

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
        self.__dict__["_lc_server_args"] = dict(server_args)
        hold_back = self._lc_admission() == "after_sync"
        router = (self.router_ip, self.router_port)
        if hold_back:
            self.router_ip = None  # both frameworks register only when router_ip is set
        try:
            return launch(server_args)
        finally:
            self.router_ip, self.router_port = router
            self.__dict__["_lc_held_back"] = hold_back

    def _lc_after_init(self, dist_init_addr: str) -> None:
        """Build the lifecycle once the server is up (node 0) or the follower's view of node 0's."""
        self._lc_key = f"rl-lifecycle/engine/{dist_init_addr}"
        self.__dict__["_lc_directory"] = engine_directory()
        if self.node_rank != 0:
            return
        url = f"http://{self.server_host}:{self.server_port}"
        api_key = self.lifecycle_server_args().get("api_key")
        server = SGLangHTTPEngine(
            url,
            timeout_s=self.lifecycle_timeout_s,
            api_key=api_key,
            codec=_no_codec,
            multi_dtype_buckets=False,
        )
        self.__dict__["_lc_client"] = server
        memory = ServerMemory(server)
        generation = _ServerGeneration(
            server,
            while_leaving=lambda pause: self._lc_alongside_router("left", pause),
            close_buffers=self._lc_close_trainer_buffers,
            rejoin=self._lc_rejoin,
            flush_deadline_s=self.lifecycle_flush_deadline_s,
        )
        self.__dict__["_lc_memory"] = memory
        self.__dict__["_lc_generation"] = generation
        backed_up = bool(self.lifecycle_server_args().get("enable_weights_cpu_backup"))
        discarded = tuple(t for t in SERVER_TAGS if not (backed_up and t == "weights"))
        policy = LifecyclePolicy(
            memory_tags=SERVER_TAGS,
            sync_requires=("weights",),
            discard_on_release=discarded,
            model_tag=None,
            destroy_process_groups=False,
        )
        configure_rank_log(ROLE, self.rank, log_dir=self.lifecycle_log_dir)
        lifecycle = Lifecycle(policy, Hooks(memory=memory, generation=generation), role=ROLE, rank=self.rank)
        lifecycle.bind(engine=url, framework=self.lifecycle_framework)
        self._lc = lifecycle
        self.__dict__["_lc_served"] = self._lc_reported_version()  # the launch checkpoint ("default")
        router = None
        if self.router_ip and self.router_port and getattr(self, "worker_type", "regular") != "encoder":
            router = RouterWorkers(
                f"http://{self.router_ip}:{self.router_port}",
                url,
                api=self.lifecycle_router_api(),
                worker_type=getattr(self, "worker_type", "regular"),
                bootstrap_port=self.lifecycle_server_args().get("disaggregation_bootstrap_port"),
                timeout_s=min(self.lifecycle_timeout_s, 30.0),
            )
        self.__dict__["_lc_router"] = router
        self.__dict__["_lc_admitted"] = router is not None and not self.__dict__.get("_lc_held_back", False)
        if router is not None and not router.removable:
            self._lc_event(
                Event.ROUTER,
                "warning",
                action="cannot leave",
                worker=router.worker_url,
                router=router.router_url,
                reason=(
                    f"the router ({router.api!r} API) has no route that removes a worker: once joined, this "
                    "server stays in it while it sleeps, and requests routed to it then wait on SGLang's "
                    "pause until a whole version is awake"
                ),
            )
        self.__dict__.update(_lc_loading=None, _lc_interrupted=False, _lc_update_open=False)
        self._lc_publish()

    # ------------------------------------------------------------------ views

    @property
    def lifecycle(self) -> Lifecycle:
        """This actor's machine (node 0 only; built at the end of `init`)."""
        if self._lc is None:
            follower = getattr(self, "node_rank", 0) != 0
            raise IllegalTransitionError(
                f"{type(self).__name__} (rank {getattr(self, 'rank', '?')}) has no lifecycle "
                + (
                    "of its own: it is a follower (node_rank != 0); node 0's actor drives the engine"
                    if follower
                    else "yet: call init(...) first (the lifecycle starts with the server)"
                ),
                state=State.AWAKE,
                operation="lifecycle",
                allowed=("init",),
            )
        return self._lc

    def lifecycle_state(self) -> dict[str, Any]:
        """The snapshot `LifecycleGroup` reads, plus `admitted` (in the router), `served_version`
        and `loading`; a follower answers node 0's, with its own `node_rank`."""
        if getattr(self, "node_rank", 0) != 0:
            leader = self._lc_leader_entry()
            return {**(leader or {}), "node_rank": self.node_rank, "follower": True}
        return {
            **self.lifecycle.snapshot(),
            "admitted": bool(self.__dict__.get("_lc_admitted")),
            "served_version": self.__dict__.get("_lc_served"),
            "loading": self.__dict__.get("_lc_loading"),
            "url": self._lc_url(),
            "node_rank": 0,
        }

    def lifecycle_log_path(self) -> str | None:
        """The JSON-lines file this actor's lifecycle events go to (None: not to a file)."""
        path = log_path()
        return None if path is None else str(path)

    def lifecycle_recover(self, target: str = "AWAKE") -> dict[str, Any]:
        """Bring a FAILED engine to `target` ("AWAKE" or "PAUSED"); the snapshot after."""
        lifecycle = self.lifecycle
        lifecycle.recover(State(target))
        self._lc_publish()
        return self.lifecycle_state()

    def _lc_url(self) -> str:
        return f"http://{self.server_host}:{self.server_port}"

    def _lc_server(self) -> SGLangHTTPEngine:
        server: SGLangHTTPEngine = self.__dict__["_lc_client"]
        return server

    def _lc_reported_version(self) -> str | None:
        return self._lc_server().served_weight_version()

    def _lc_servable(self) -> bool:
        return self._lc_servable_after(())

    def _lc_servable_after(self, resumed: Sequence[str]) -> bool:
        """Whether the weights can be served once the tags `resumed` are resident."""
        lifecycle = self.lifecycle
        return (
            all(r is Residency.RESIDENT or t in resumed for t, r in lifecycle.residency.items())
            and lifecycle.contents.get("weights") is Contents.VALID
            and self.__dict__.get("_lc_loading") is None
        )

    def _lc_event(self, name: Event, level: str = "info", **fields: Any) -> None:
        self.lifecycle.event(name, level, **fields)

    def _lc_has_followers(self) -> bool:
        """Whether the engine spans nodes (SGLang's `nnodes`): only then do other actors follow this one."""
        return int(self.lifecycle_server_args().get("nnodes") or 1) > 1

    def _lc_publish(self) -> None:
        """Node 0's lifecycle, for the engine's followers (none on an engine of one node: no write,
        which in a Ray actor is a round trip to the cluster's key-value store)."""
        directory: EngineDirectory | None = self.__dict__.get("_lc_directory")
        if directory is None or self._lc_key is None or self._lc is None or not self._lc_has_followers():
            return
        directory.put(self._lc_key, {**self.lifecycle_state(), "published_at": time.time()})

    # ------------------------------------------------------------------ the router

    def _lc_leave_if_failed(self) -> None:
        """A FAILED engine (its server dead, or in an unknown state) is taken out of the router, best effort."""
        if self._lc is None or self._lc.state is not State.FAILED or not self.__dict__.get("_lc_admitted"):
            return
        self._lc_leave_if_admitted()

    def _lc_rejoin(self) -> None:
        """The end of a wake: continue generation and rejoin the router when the weights can be
        served; otherwise the server stays paused and out (logged)."""
        if not self._lc_servable():
            self._lc_wait_logged("the end of the wake")
            return
        generation: _ServerGeneration = self.__dict__["_lc_generation"]
        self._lc_serve(self._lc_server().continue_generation if generation.paused else lambda: None)

    def _lc_serve(self, resume: Callable[[], Any]) -> Any:
        """Check the version the server reports, then continue generation (`resume`) while the
        router puts the server back: a request routed before the continue lands waits in SGLang's
        tokenizer manager for it. A continue that fails takes the server back out."""
        self._lc_check_version()
        generation: _ServerGeneration = self.__dict__["_lc_generation"]

        def continued() -> Any:
            result = resume()
            generation.paused = generation.by_sleep = False
            return result

        return self._lc_alongside_router("joined", continued)

    def _lc_pool(self) -> ThreadPoolExecutor:
        """The actor's one helper thread: the router's requests and the version query run there
        while the server's own requests run on the calling thread."""
        pool: ThreadPoolExecutor | None = self.__dict__.get("_lc_helper")
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-lifecycle-engine")
            self.__dict__["_lc_helper"] = pool
        return pool

    def _lc_close(self) -> None:
        """The helper thread stopped and the kept-alive connections closed (at shutdown); a later
        call opens what it needs again."""
        pool: ThreadPoolExecutor | None = self.__dict__.pop("_lc_helper", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for key in ("_lc_client", "_lc_receiver_client", "_lc_router"):
            client = self.__dict__.get(key)
            if client is not None:
                client.close()

    def _lc_alongside_router(self, action: str, main: Callable[[], T]) -> T:
        """`main()` here while the router takes the server out (`action` "left") or puts it back
        ("joined") on the helper thread; both have ended when this returns. `main`'s error wins
        (the router's, if it failed too, is logged); a server put back whose `main` failed is
        taken out again. State and logs change on this thread only."""
        router: RouterWorkers | None = self.__dict__.get("_lc_router")
        admitted = bool(self.__dict__.get("_lc_admitted"))
        if router is None or admitted == (action == "joined") or (action == "left" and not router.removable):
            return main()  # nothing to change at the router, or nothing it can change (the pause guards)
        future = self._lc_pool().submit(router.remove if action == "left" else router.add)
        try:
            result = main()
        except BaseException:
            self._lc_router_done(action, router, future, raising=False)
            if action == "joined":
                self._lc_leave_if_admitted()
            raise
        self._lc_router_done(action, router, future, raising=True)
        return result

    def _lc_router_done(
        self, action: str, router: RouterWorkers, future: Future[Any], *, raising: bool
    ) -> None:
        error = future.exception()  # waits for the router's answer
        if error is not None:
            if raising:
                raise error
            failed = "join failed" if action == "joined" else "leave failed"
            self._lc_event(Event.ROUTER, "warning", action=failed, reason=str(error))
            return
        self.__dict__["_lc_admitted"] = action == "joined"
        extra: dict[str, Any] = (
            {"weight_version": self.__dict__.get("_lc_served")} if action == "joined" else {}
        )
        self._lc_event(
            Event.ROUTER, action=action, worker=router.worker_url, router=router.router_url, **extra
        )

    def _lc_leave_if_admitted(self) -> None:
        """Out of the router, best effort (a failure is logged)."""
        try:
            self._lc_alongside_router("left", lambda: None)
        except RouterError as exc:
            self._lc_event(Event.ROUTER, "warning", action="leave failed", reason=str(exc))

    def _lc_wait_logged(self, when: str) -> None:
        lifecycle = self.lifecycle
        self._lc_event(
            Event.ABSORBED,
            call="continue_generation",
            reason=(
                f"at {when} the weights cannot be served (contents {lifecycle.contents.get('weights')}, "
                f"loading {self.__dict__.get('_lc_loading')}, residency {lifecycle.snapshot()['residency']}): "
                "generation stays paused and the server out of the router until a whole version is loaded "
                "and every tag is resident"
            ),
        )

    def _lc_check_version(self) -> None:
        expected = self.__dict__.get("_lc_served")
        asked: Future[str | None] | None = self.__dict__.pop("_lc_version_asked", None)
        reported = asked.result() if asked is not None else self._lc_reported_version()
        if expected is not None and reported != expected:
            raise StaleWeightsError(
                f"the SGLang server at {self._lc_url()} reports weight version {reported!r}, but its actor saw "
                f"version {expected!r} loaded whole: it stays paused and out of the router. Push the version "
                "again (the trainer's update_weights), or restart the engine.",
                url=self._lc_url(),
                reported=reported,
                expected=expected,
            )

    # ------------------------------------------------------------------ memory

    def _lc_sleep(self, tags: Sequence[str] | None, call: str) -> None:
        if self.node_rank != 0:
            self._lc_follow(call, released=tuple(tags) if tags else SERVER_TAGS)
            return
        lifecycle = self.lifecycle
        targets = self._lc_targets(tags, call)
        if self.__dict__.get("_lc_loading") is not None:
            self.__dict__["_lc_interrupted"] = (
                True  # a release in the middle of a version: it cannot complete
            )
        batch = [t for t in targets if lifecycle.residency[t] is Residency.RESIDENT]
        memory: ServerMemory = self.__dict__["_lc_memory"]
        try:
            with memory.together(pause=batch):
                lifecycle.sleep(targets)
        finally:
            self._lc_leave_if_failed()
            self._lc_publish()

    def _lc_wake(self, tags: Sequence[str] | None, call: str) -> None:
        if self.node_rank != 0:
            self._lc_follow(call, resident=tuple(tags) if tags else SERVER_TAGS)
            return
        lifecycle = self.lifecycle
        targets = self._lc_targets(tags, call)
        batch = [t for t in targets if lifecycle.residency[t] is Residency.RELEASED]
        memory: ServerMemory = self.__dict__["_lc_memory"]
        if batch and self._lc_servable_after(targets):
            # The version check of the wake's end, asked while the memory comes back (nothing the
            # wake does changes the version the server reports).
            self.__dict__["_lc_version_asked"] = self._lc_pool().submit(self._lc_reported_version)
        try:
            with memory.together(resume=batch):
                lifecycle.wake_up(targets)
        finally:
            asked: Future[str | None] | None = self.__dict__.pop("_lc_version_asked", None)
            if asked is not None:
                asked.exception()  # the wake failed before its end: no request left in flight
            self._lc_leave_if_failed()
            self._lc_publish()

    def _lc_targets(self, tags: Sequence[str] | None, call: str) -> tuple[str, ...]:
        if not tags:
            return SERVER_TAGS
        unknown = sorted(set(tags) - set(SERVER_TAGS))
        if unknown:
            raise ValueError(
                f"{call}(tags={list(tags)}): SGLang has no memory tags {unknown}; it has {list(SERVER_TAGS)}"
            )
        return tuple(t for t in SERVER_TAGS if t in tags)

    # ------------------------------------------------------------------ weights

    def _lc_push(self, call: str, version: Any, push: Callable[[], Any]) -> Any:
        """One bucket of a version (`update_weights_from_tensor` / `_from_distributed`) as the sync operation."""
        if self.node_rank != 0:
            raise self._lc_follower_error(
                call, "weights go to the engine's node-0 actor: one coordinator per slot"
            )
        lifecycle = self.lifecycle
        label = "unversioned" if version is None else str(version)
        generation: _ServerGeneration = self.__dict__["_lc_generation"]

        def body() -> Any:
            if not generation.paused:
                # A push without the trainer's pause: requests would be served on a half-written model.
                self._lc_server().pause_generation(self._lc_pause_mode())
                generation.paused = True
                self._lc_event(Event.ABSORBED, call=call, reason="generation paused before the first bucket")
            if self.__dict__.get("_lc_loading") != label:
                self.__dict__.update(_lc_loading=label, _lc_interrupted=False)
                lifecycle.note_weights(
                    Contents.UNKNOWN,
                    _as_int(version),
                    reason=f"loading version {label}: weights being overwritten",
                )
            try:
                return push()
            except BaseException:
                self.__dict__["_lc_interrupted"] = True  # a bucket failed: this version cannot be whole
                raise

        try:
            return lifecycle.run("sync", body)
        except IllegalTransitionError as exc:
            if (
                lifecycle.residency.get("weights") is not Residency.RESIDENT
                and exc.fields.get("operation") == "sync"
            ):
                raise IllegalTransitionError(
                    f"{call}: {exc} (the framework's call for it is resume_memory_occupation(tags=['weights']), "
                    "the rollout manager's onload_weights)",
                    state=exc.fields["state"],
                    operation="sync",
                    allowed=exc.fields.get("allowed", ()),
                ) from None
            raise
        finally:
            self._lc_publish()

    def _lc_pause_mode(self) -> str:
        return "abort"

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
            self.__dict__.update(
                _lc_update_open=True,
                _lc_loading=None,
                _lc_interrupted=False,
                _lc_sent=[time.perf_counter(), 0],
            )
        # [when the version's first round came, the bytes of its rounds loaded so far]
        sent: list[Any] = self.__dict__.setdefault("_lc_sent", [time.perf_counter(), 0])

        def load() -> dict[str, Any]:
            client = self._lc_receiver()  # started here, past the guard: with the weights resident
            try:
                answer = client.load_payloads(version, payloads, round_index=first.round, final=first.final)
            except (CorruptBucketError, WeightSyncError) as error:
                self._lc_event(
                    Event.SYNC_LOADED,
                    "error",
                    version=version,
                    bytes=sent[1],  # the version's rounds loaded before this one, as RolloutActor logs them
                    checksum_ok=not isinstance(error, CorruptBucketError),
                    digest_ok=False if isinstance(error, WrittenWeightsError) else None,
                    written=bool(error.fields.get("written")),
                    duration_ms=round((time.perf_counter() - sent[0]) * 1e3, 3),
                    transport=first.transport,
                    ok=False,
                )
                raise
            sent[1] += answer["nbytes"]
            if first.final:  # inside the sync body, as every engine's `weight_sync.loaded`: the whole version
                self._lc_event(
                    Event.SYNC_LOADED,
                    version=version,
                    bytes=sent[1],
                    checksum_ok=True,
                    digest_ok=answer["timings"].get("digest"),  # the schedulers read back what they wrote
                    duration_ms=round((time.perf_counter() - sent[0]) * 1e3, 3),
                    transport=first.transport,
                    ok=True,
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
        client: SGLangHTTPEngine | None = self.__dict__.get("_lc_receiver_client")
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
            self.__dict__["_lc_receiver_client"] = client
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
        client: SGLangHTTPEngine | None = self.__dict__.get("_lc_receiver_client")
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

    def _lc_version_end(self, call: str) -> None:
        """The trainer says the version is whole: valid at it, unless a release interrupted its load."""
        lifecycle = self.lifecycle
        label = self.__dict__.get("_lc_loading")
        self.__dict__["_lc_update_open"] = False
        if label is None:
            return
        if self.__dict__.get("_lc_interrupted"):
            self.__dict__["_lc_loading"] = None
            self._lc_event(
                Event.ABSORBED,
                "warning",
                call=call,
                reason=(
                    f"version {label} cannot be whole: a bucket of it failed, or a release discarded the weights "
                    "while it loaded; the weights stay unknown until a version loads whole (push it again)"
                ),
            )
            return

        def whole() -> None:
            lifecycle.note_weights(
                Contents.VALID, _as_int(label, lifecycle.weight_version), reason=f"version {label} loaded"
            )

        lifecycle.run("sync", whole)
        self.__dict__.update(_lc_loading=None, _lc_served=label)
        self._lc_publish()

    def _lc_continue(self, call: str, resume: Callable[[], Any]) -> Any:
        """The trainer's `continue_generation`: the version ends here; generation continues now if the
        server is awake with it, else at the end of the wake (the call is then absorbed: None)."""
        if self.node_rank != 0:
            raise self._lc_follower_error(call, "generation is node 0's to pause and continue")
        self._lc_version_end(call)
        try:
            if not self._lc_servable():
                self._lc_wait_logged(call)
                return None
            return self._lc_serve(resume)
        finally:
            self._lc_publish()

    def _lc_pause(self, call: str, pause: Callable[[], Any]) -> Any:
        """The trainer's `pause_generation`: the next bucket opens a version. Sent as it is, unless
        the sleep paused the server and it has not continued since (absorbed, None): nothing runs
        there, and SGLang's pause in "abort" mode (slime's) would abort the requests waiting on the
        sleep's pause, which are otherwise served after the wake on the new version."""
        if self.node_rank != 0:
            raise self._lc_follower_error(call, "generation is node 0's to pause and continue")
        self.__dict__.update(_lc_update_open=True, _lc_loading=None, _lc_interrupted=False)
        generation: _ServerGeneration = self.__dict__["_lc_generation"]
        if generation.by_sleep:
            self._lc_event(
                Event.ABSORBED,
                call=call,
                reason="generation is paused since the sleep and nothing runs; a second pause would abort "
                "the requests waiting for the wake",
            )
            return None
        result = pause()
        generation.paused = True
        return result

    def _lc_reads_weights(self, call: str, read: Callable[[], Any]) -> Any:
        """A call that reads the weights on the server (`check_weights`): only while they are resident."""
        if self.node_rank != 0:
            raise self._lc_follower_error(call, "the weights are checked through node 0's server")
        lifecycle = self.lifecycle
        if lifecycle.state is State.FAILED or lifecycle.residency.get("weights") is not Residency.RESIDENT:
            message = (
                f"{call}: the weights are {lifecycle.residency.get('weights')} (state {lifecycle.state}); SGLang "
                "would read released memory. Resume them first (resume_memory_occupation(tags=['weights']))."
            )
            self._lc_event(Event.REFUSED, "warning", operation=call, state=lifecycle.state, reason=message)
            raise IllegalTransitionError(message, state=lifecycle.state, operation=call, allowed=("wake_up",))
        return read()

    # ------------------------------------------------------------------ health

    def _lc_health(self, timeout: float, check: Callable[[], Any]) -> Any:
        """The framework's health check where a generation is safe; else a liveness probe."""
        if self.node_rank != 0:
            leader = self._lc_leader_entry()
            if leader is None or leader.get("url") is None:
                raise self._lc_follower_error(
                    "health_generate", "node 0's actor has not published its server yet"
                )
            SGLangHTTPEngine(
                leader["url"], timeout_s=timeout, codec=_no_codec, multi_dtype_buckets=False
            ).alive()
            if leader.get("state") == State.FAILED.value:
                raise self._lc_follower_error("health_generate", "node 0's lifecycle is FAILED")
            return True
        lifecycle = self.lifecycle
        if lifecycle.state is State.FAILED:
            self._lc_leave_if_failed()
            raise LifecycleFailedError(
                f"{self._lc_url()} is FAILED ({lifecycle.failure}): reported unhealthy so the rollout's fault "
                "tolerance can restart it; or lifecycle_recover() it",
                hook=str(lifecycle.failure.hook if lifecycle.failure is not None else "unknown"),
                operation="health_generate",
                residency=lifecycle.residency,
                groups=None,
                error=str(lifecycle.failure),
            )
        generation: _ServerGeneration = self.__dict__["_lc_generation"]
        if self._lc_servable() and not generation.paused:
            return check()
        server = SGLangHTTPEngine(
            self._lc_url(), timeout_s=timeout, codec=_no_codec, multi_dtype_buckets=False
        )
        server.alive()  # no generation: the KV cache may be released or the weights half-written
        return True

    # ------------------------------------------------------------------ followers

    def _lc_follower_error(self, call: str, why: str) -> FollowerCallError:
        leader = self._lc_leader_entry()
        url = None if leader is None else leader.get("url")
        return FollowerCallError(
            f"{call} on a follower actor (rank {getattr(self, 'rank', '?')}, node_rank {self.node_rank}): {why}. "
            f"Call node 0's actor{f' (its server {url})' if url else ''}: the rollout manager's "
            "ServerGroup.engines are those.",
            node_rank=self.node_rank,
            call=call,
            leader=url,
        )

    def _lc_leader_entry(self) -> dict[str, Any] | None:
        """What node 0's actor last published for this engine (None: nothing yet)."""
        directory: EngineDirectory | None = self.__dict__.get("_lc_directory")
        if directory is None or self._lc_key is None:
            return None
        return directory.get(self._lc_key)

    def _lc_follow(self, call: str, *, released: Sequence[str] = (), resident: Sequence[str] = ()) -> None:
        """Return once node 0's actor shows the tags released (or resident); raise if it failed."""
        deadline = time.monotonic() + self.lifecycle_follow_deadline_s
        backoff = 0.01
        while True:
            leader = self._lc_leader_entry()
            if leader is not None:
                if leader.get("state") == State.FAILED.value:
                    raise self._lc_follower_error(
                        call, f"node 0's lifecycle is FAILED ({leader.get('failure')})"
                    )
                residency = leader.get("residency", {})
                if all(residency.get(t) == Residency.RELEASED.value for t in released) and all(
                    residency.get(t) == Residency.RESIDENT.value for t in resident
                ):
                    return
            if time.monotonic() >= deadline:
                raise self._lc_follower_error(
                    call,
                    f"node 0's actor did not show {list(released) or list(resident)} "
                    f"{'released' if released else 'resident'} within {self.lifecycle_follow_deadline_s:.0f} s "
                    f"(it shows {None if leader is None else leader.get('residency')})",
                )
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)


def _as_int(version: Any, default: int | None = 0) -> int:
    """SGLang's weight versions are strings; the machine counts versions as ints (slime's and miles' are)."""
    try:
        return int(str(version))
    except (TypeError, ValueError):
        return 0 if default is None else default


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
        if "init" in vars(klass) and not issubclass(klass, SGLangActorLifecycle):
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

"""An engine server's Ray actor under the rollout lifecycle, whatever the engine: the rules the wrap keeps.

A framework drives each engine server from a Ray actor that launches the server in a child process
and sends it HTTP requests (slime's and miles' `SGLangEngine`). `ServerActorLifecycle` is the
engine-agnostic part of putting the rollout's transition table in front of that actor's calls,
over the server's client (`rollout.client.ServerClient`); an engine's wrap
(`engines.sglang.actor.SGLangActorLifecycle`) adds the engine's own calls and builds its client:

- memory: the server's tags (`lifecycle_server_tags`), each resident or released; a release or
  resume of several tags is one request (the memory hook takes a stage's tags together). A second
  release and a resume of a resident tag are logged no-ops;
- a sleep takes the server out of the router, pauses generation (abort) and flushes the cache
  (retried until a deadline) before anything is released, so no request reaches released memory;
- weights, per version: valid at launch (the checkpoint), discarded by a release, unknown from the
  first bucket of a version until the trainer says the version is whole, then valid at that
  version; a push into released weights is refused;
- the server goes back into the router, and generation continues, only when it is awake with a
  whole version loaded and the server reports that version;
- a health check while the weights cannot be served is a liveness probe (no generation), and a
  FAILED lifecycle is unhealthy;
- followers (`node_rank != 0`) follow node 0's actor through the `EngineDirectory`; a call only
  node 0 can make is a `FollowerCallError`;
- a server whose process (or one of its children: SGLang's scheduler) exited is found before the
  next call the actor drives, and on the rollout manager's watch (`lifecycle_check_server`,
  `rollout.server_watch`): `EngineDiedError` naming the process, what is left of it killed, the
  server out of the router, logged once (`rollout.server_died`).

The wrap's state is one typed object (`ServerState`, `self._lc_state`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

from actor_integration.errors import FollowerCallError, RouterError, StaleWeightsError
from actor_integration.rollout.client import ServerClient
from actor_integration.rollout.directory import EngineDirectory, engine_directory
from actor_integration.rollout.engine import EngineGeneration, RolloutEngine
from actor_integration.rollout.machine import rollout_lifecycle
from actor_integration.rollout.router import RouterWorkers
from actor_integration.rollout.server_watch import ServerProcesses, died_error
from lifecycle import Contents, Hooks, Lifecycle, LifecyclePolicy, Residency, State
from lifecycle.errors import IllegalTransitionError, LifecycleFailedError
from lifecycle.events import flush_logs, log_path
from lifecycle.logs import Event

__all__ = ["ServerActorLifecycle", "ServerGeneration", "ServerMemory", "ServerState", "as_int"]

T = TypeVar("T")


class ServerMemory:
    """A `MemoryBackend` over the server's release and resume of memory by tag: one tag per call,
    or a plan stage's tags in one request (`pause_tags` / `resume_tags`, as the frameworks send
    them: the engine releases several tags in one scheduler call)."""

    def __init__(self, server: ServerClient) -> None:
        self.server = server

    def pause(self, tag: str | None = None) -> None:
        self.server.release_memory_occupation(None if tag is None else [tag])

    def resume(self, tag: str | None = None) -> None:
        self.server.resume_memory_occupation(None if tag is None else [tag])

    def pause_tags(self, tags: tuple[str, ...]) -> None:
        self.server.release_memory_occupation(list(tags))

    def resume_tags(self, tags: tuple[str, ...]) -> None:
        self.server.resume_memory_occupation(list(tags))

    @contextmanager
    def disable(self) -> Iterator[None]:
        yield  # the server allocates its own memory


class ServerGeneration(EngineGeneration):
    """The sleep's first step: out of the router while the server pauses (abort) and flushes with a
    deadline. The wake's last step puts the server back only when its weights can be served."""

    def __init__(
        self,
        server: ServerClient,
        *,
        while_leaving: Callable[[Callable[[], None]], None],
        close_buffers: Callable[[], None],
        rejoin: Callable[[], None],
        flush_deadline_s: float,
        pause_in_release: bool = False,
    ) -> None:
        # EngineGeneration calls only the pause, continue and flush a ServerClient has (and, with
        # pause_in_release, its pause_with_release: the release's own request pauses, vLLM's sleep).
        super().__init__(
            cast("RolloutEngine", server),
            mode="abort",
            flush_deadline_s=flush_deadline_s,
            pause_in_release=pause_in_release,
        )
        self._while_leaving, self._close_buffers, self._rejoin = while_leaving, close_buffers, rejoin
        self.paused = False
        self.by_sleep = False  # paused by the sleep, not continued since: nothing runs on the server

    def pause(self) -> None:
        # The server's requests go while the router takes it out (one round trip, not two): a
        # request the router still sends after the pause waits in the server's tokenizer manager,
        # before the scheduler and its memory, and is served after the wake's continue, on the
        # version the wake checked.
        self._while_leaving(self._pause_server)

    def _pause_server(self) -> None:
        # Marked before the requests: a pause the server took whose flush then failed (a hung
        # scheduler) leaves the server paused, and the wake that recovers must continue it (a
        # continue on a server that never paused is harmless).
        self.paused = self.by_sleep = True
        self._close_buffers()
        EngineGeneration.pause(self)

    def resume(self) -> None:
        self._rejoin()


@dataclass
class ServerState:
    """Everything the wrap keeps on the actor, typed (one object: `self._lc_state`)."""

    lifecycle: Lifecycle | None = None  # node 0's machine, built once the server is up
    key: str | None = None  # the engine's key in the directory
    directory: EngineDirectory | None = None
    client: ServerClient | None = None  # the lifecycle's own client of the server
    receiver_client: Any = None  # the client of the engine's in-server receiver, started on first use
    memory: ServerMemory | None = None
    generation: ServerGeneration | None = None
    router: RouterWorkers | None = None
    admitted: bool = False  # in the router
    held_back: bool = False  # the launch kept the server out of the router ("after_sync")
    server_args: dict[str, Any] = field(default_factory=dict)  # as the framework computed them
    served: str | None = None  # the version last seen loaded whole
    loading: str | None = None  # the version whose buckets are arriving (weights unknown)
    interrupted: bool = False  # a release or a failed bucket: the loading version cannot be whole
    update_open: bool = False  # the trainer paused for an update that has not ended
    sent: list[Any] | None = None  # the lifecycle's sync: [when its first round came, bytes loaded]
    version_asked: Future[str | None] | None = None  # the wake's version check, asked early
    helper: ThreadPoolExecutor | None = None  # the router's requests and the version query run there
    processes: ServerProcesses | None = None  # the server's processes, once it was up (node 0)
    died: dict[str, Any] | None = None  # what of them exited, once found


def as_int(version: Any, default: int | None = 0) -> int:
    """Servers' weight versions are strings; the machine counts versions as ints (slime's and miles' are)."""
    try:
        return int(str(version))
    except (TypeError, ValueError):
        return 0 if default is None else default


class ServerActorLifecycle:
    """The engine-agnostic part of a framework's engine-server actor under the rollout lifecycle.

    Class attributes a subclass (or a user's class) may change:
    `lifecycle_flush_deadline_s`: how long a sleep retries a flush the server refuses as busy.
    `lifecycle_timeout_s`: the deadline of every request the lifecycle itself sends.
    `lifecycle_follow_deadline_s`: how long a follower waits for node 0's actor.
    `lifecycle_log_dir`: where `rollout-rank<rank>.jsonl` goes (see `configure_rank_log`).
    An engine's wrap sets `lifecycle_release_pauses` where every sleep of its server releases memory
    in one request that pauses generation (abort) and clears the caches first (vLLM's `/sleep`; its
    client has `pause_with_release`): the sleep's pause then sends nothing of its own. It also sets
    `lifecycle_server_tags` (its memory tags, in its order),
    `lifecycle_engine_label` and `lifecycle_process_prefix` (how the engine titles its own
    processes: those are watched beside the server's, none without it), and implements `_lc_new_client`.
    """

    lifecycle_framework: ClassVar[str] = "server"
    lifecycle_engine_label: ClassVar[str] = "engine"
    lifecycle_server_tags: ClassVar[tuple[str, ...]] = ()
    lifecycle_process_prefix: ClassVar[str] = ""
    lifecycle_flush_deadline_s: ClassVar[float] = 60.0
    lifecycle_release_pauses: ClassVar[bool] = False
    lifecycle_timeout_s: ClassVar[float] = 60.0
    lifecycle_follow_deadline_s: ClassVar[float] = 600.0
    lifecycle_log_dir: ClassVar[str | None] = None

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

    @property
    def _lc_state(self) -> ServerState:
        """The wrap's state, created on first use (the framework's __init__ is not ours)."""
        state: ServerState | None = self.__dict__.get("_lc_state")
        if state is None:
            state = self.__dict__["_lc_state"] = ServerState()
        return state

    # ------------------------------------------------------------------ what an engine's wrap provides

    def _lc_new_client(self, url: str, *, timeout_s: float, api_key: Any = None) -> ServerClient:
        """A client of the server at `url` (the engine's)."""
        raise NotImplementedError(f"{type(self).__name__}: an engine's wrap builds its server's client")

    def _lc_close_trainer_buffers(self) -> None:
        """The sleep's first request to the server, once out of the router (an engine whose
        in-server receiver holds the trainer's buffers open closes them here)."""

    # ------------------------------------------------------------------ the lifecycle

    def _lc_start(
        self,
        dist_init_addr: str,
        *,
        discard_on_release: Sequence[str],
        bootstrap_port: Any = None,
    ) -> None:
        """Build the lifecycle once the server is up (node 0), or the follower's view of node 0's:
        the server's client, the memory and generation hooks, the machine, the router membership."""
        state = self._lc_state
        state.key = f"rl-lifecycle/engine/{dist_init_addr}"
        state.directory = engine_directory()
        if self.node_rank != 0:
            return
        url = self._lc_url()
        server = self._lc_new_client(
            url, timeout_s=self.lifecycle_timeout_s, api_key=self.lifecycle_server_args().get("api_key")
        )
        state.client = server
        memory = ServerMemory(server)
        generation = ServerGeneration(
            server,
            while_leaving=lambda pause: self._lc_alongside_router("left", pause),
            close_buffers=self._lc_close_trainer_buffers,
            rejoin=self._lc_rejoin,
            flush_deadline_s=self.lifecycle_flush_deadline_s,
            pause_in_release=self.lifecycle_release_pauses,
        )
        state.memory, state.generation = memory, generation
        tags = self.lifecycle_server_tags
        policy = LifecyclePolicy(
            memory_tags=tags,
            sync_requires=("weights",),
            discard_on_release=tuple(discard_on_release),
            model_tag=None,
            destroy_process_groups=False,
        )
        lifecycle = self.configure_lifecycle(policy, Hooks(memory=memory, generation=generation))
        lifecycle.bind(engine=url, framework=self.lifecycle_framework)
        state.lifecycle = lifecycle
        state.processes = ServerProcesses.of(
            getattr(self, "process", None), own=self.lifecycle_process_prefix
        )
        state.served = self._lc_reported_version()  # the launch checkpoint ("default")
        router = None
        if self.router_ip and self.router_port and getattr(self, "worker_type", "regular") != "encoder":
            router = RouterWorkers(
                f"http://{self.router_ip}:{self.router_port}",
                url,
                api=self.lifecycle_router_api(),
                worker_type=getattr(self, "worker_type", "regular"),
                bootstrap_port=bootstrap_port,
                timeout_s=min(self.lifecycle_timeout_s, 30.0),
            )
        state.router = router
        state.admitted = router is not None and not state.held_back
        if router is not None and not router.removable:
            self._lc_event(
                Event.ROUTER,
                "warning",
                action="cannot leave",
                worker=router.worker_url,
                router=router.router_url,
                reason=(
                    f"the router ({router.api!r} API) has no route that removes a worker: once joined, this "
                    f"server stays in it while it sleeps, and requests routed to it then wait on "
                    f"{self.lifecycle_engine_label}'s pause until a whole version is awake"
                ),
            )
        state.loading, state.interrupted, state.update_open = None, False, False
        self._lc_publish()

    def configure_lifecycle(self, policy: LifecyclePolicy, hooks: Hooks) -> Lifecycle:
        """The server's machine over its hooks, built once it is up (node 0); a subclass may wrap
        the hooks or set the machine's options here (the launch switch's job classes do)."""
        return rollout_lifecycle(policy, hooks, rank=self.rank, log_dir=self.lifecycle_log_dir)

    def lifecycle_check_server(self) -> dict[str, Any] | None:
        """None while the server's processes run (a follower, or a server not launched by this
        actor: None). Else what exited (process, pid, exitcode, rank, url, label); what is left of
        the server is killed and it leaves the router, once. The rollout manager's watch asks."""
        if getattr(self, "node_rank", 0) != 0 or self._lc_state.lifecycle is None:
            return None
        return self._lc_server_died("the rollout manager's watch")

    def _lc_server_died(self, call: str) -> dict[str, Any] | None:
        """What of the server exited (None: nothing); found once: logged, the rest killed, out of the router."""
        state = self._lc_state
        if state.died is not None or state.processes is None:
            return state.died
        dead = state.processes.dead()
        if dead is None:
            return None
        process, pid, exitcode = dead
        killed = state.processes.kill()
        state.died = {
            "process": process,
            "pid": pid,
            "exitcode": exitcode,
            "rank": getattr(self, "rank", None),
            "url": self._lc_url(),
            "label": self.lifecycle_engine_label,
        }
        self._lc_event(Event.SERVER_DIED, "error", call=call, killed=killed, **state.died)
        self._lc_leave_if_admitted()
        flush_logs(timeout=2.0)  # the job may stop on this: the event is on disk first
        return state.died

    def _lc_require_server(self, call: str) -> None:
        """Before a call the actor drives: `EngineDiedError` if the server's processes exited."""
        died = self._lc_server_died(call)
        if died is not None:
            raise died_error(
                died,
                call=call,
                waited_s=None,
                advice="Restart the engine (the framework's engine fault tolerance, or the job).",
            )

    def lifecycle_router_api(self) -> str:
        """Which worker API the router speaks (`router.ROUTER_APIS`); the framework's own choice."""
        return "workers"

    def lifecycle_server_args(self) -> dict[str, Any]:
        """The server's arguments, as the framework computed them at init (empty before)."""
        return dict(self._lc_state.server_args or {})

    @property
    def lifecycle(self) -> Lifecycle:
        """This actor's machine (node 0 only; built at the end of `init`)."""
        if self._lc_state.lifecycle is None:
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
        return self._lc_state.lifecycle

    def lifecycle_state(self) -> dict[str, Any]:
        """The snapshot `LifecycleGroup` reads, plus `admitted` (in the router), `served_version`,
        `loading` and `server_died` (None while the server runs; what exited once the watch found it
        dead: the machine itself stays where its last transition left it, every call refused with
        `EngineDiedError`); a follower answers node 0's, with its own `node_rank`."""
        if getattr(self, "node_rank", 0) != 0:
            leader = self._lc_leader_entry()
            return {**(leader or {}), "node_rank": self.node_rank, "follower": True}
        return {
            **self.lifecycle.snapshot(),
            "admitted": bool(self._lc_state.admitted),
            "served_version": self._lc_state.served,
            "loading": self._lc_state.loading,
            "url": self._lc_url(),
            "node_rank": 0,
            "server_died": None if self._lc_state.died is None else dict(self._lc_state.died),
        }

    def lifecycle_log_path(self) -> str | None:
        """The JSON-lines file this actor's lifecycle events go to (None: not to a file)."""
        path = log_path()
        return None if path is None else str(path)

    def lifecycle_recover(self, target: str = "AWAKE") -> dict[str, Any]:
        """Bring a FAILED engine to `target` ("AWAKE" or "PAUSED"); the snapshot after. Refused with
        `EngineDiedError` where its server died: no hook can restore memory on a dead server."""
        self._lc_require_server("lifecycle_recover")
        lifecycle = self.lifecycle
        lifecycle.recover(State(target))
        self._lc_publish()
        return self.lifecycle_state()

    def _lc_url(self) -> str:
        return f"http://{self.server_host}:{self.server_port}"

    def _lc_server(self) -> ServerClient:
        server = self._lc_state.client
        assert server is not None, "the server's client is built at init (node 0)"
        return server

    def _lc_generation(self) -> ServerGeneration:
        generation = self._lc_state.generation
        assert generation is not None, "the generation hook is built at init (node 0)"
        return generation

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
            and self._lc_state.loading is None
        )

    def _lc_event(self, name: Event, level: str = "info", **fields: Any) -> None:
        self.lifecycle.event(name, level, **fields)

    def _lc_has_followers(self) -> bool:
        """Whether the engine spans nodes (its `nnodes` server argument): only then do other actors follow this one."""
        return int(self.lifecycle_server_args().get("nnodes") or 1) > 1

    def _lc_publish(self) -> None:
        """Node 0's lifecycle, for the engine's followers (none on an engine of one node: no write,
        which in a Ray actor is a round trip to the cluster's key-value store)."""
        directory: EngineDirectory | None = self._lc_state.directory
        if (
            directory is None
            or self._lc_state.key is None
            or self._lc_state.lifecycle is None
            or not self._lc_has_followers()
        ):
            return
        directory.put(self._lc_state.key, {**self.lifecycle_state(), "published_at": time.time()})

    def _lc_leave_if_failed(self) -> None:
        """A FAILED engine (its server dead, or in an unknown state) is taken out of the router, best effort."""
        if (
            self._lc_state.lifecycle is None
            or self._lc_state.lifecycle.state is not State.FAILED
            or not self._lc_state.admitted
        ):
            return
        self._lc_leave_if_admitted()

    def _lc_rejoin(self) -> None:
        """The end of a wake: continue generation and rejoin the router when the weights can be
        served; otherwise the server stays paused and out (logged)."""
        if not self._lc_servable():
            self._lc_wait_logged("the end of the wake")
            return
        generation = self._lc_generation()
        self._lc_serve(self._lc_server().continue_generation if generation.paused else lambda: None)

    def _lc_serve(self, resume: Callable[[], Any]) -> Any:
        """Check the version the server reports, then continue generation (`resume`) while the
        router puts the server back: a request routed before the continue lands waits in the server's
        tokenizer manager for it. A continue that fails takes the server back out."""
        self._lc_check_version()
        generation = self._lc_generation()

        def continued() -> Any:
            result = resume()
            generation.paused = generation.by_sleep = False
            return result

        return self._lc_alongside_router("joined", continued)

    def _lc_pool(self) -> ThreadPoolExecutor:
        """The actor's one helper thread: the router's requests and the version query run there
        while the server's own requests run on the calling thread."""
        pool: ThreadPoolExecutor | None = self._lc_state.helper
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-lifecycle-engine")
            self._lc_state.helper = pool
        return pool

    def _lc_close(self) -> None:
        """The helper thread stopped and the kept-alive connections closed (at shutdown); a later
        call opens what it needs again."""
        state = self._lc_state
        pool, state.helper = state.helper, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for client in (state.client, state.receiver_client, state.router):
            if client is not None:
                client.close()

    def _lc_alongside_router(self, action: str, main: Callable[[], T]) -> T:
        """`main()` here while the router takes the server out (`action` "left") or puts it back
        ("joined") on the helper thread; both have ended when this returns. `main`'s error wins
        (the router's, if it failed too, is logged); a server put back whose `main` failed is
        taken out again. State and logs change on this thread only."""
        router: RouterWorkers | None = self._lc_state.router
        admitted = bool(self._lc_state.admitted)
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
        self._lc_state.admitted = action == "joined"
        extra: dict[str, Any] = {"weight_version": self._lc_state.served} if action == "joined" else {}
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
                f"loading {self._lc_state.loading}, residency {lifecycle.snapshot()['residency']}): "
                "generation stays paused and the server out of the router until a whole version is loaded "
                "and every tag is resident"
            ),
        )

    def _lc_check_version(self) -> None:
        expected = self._lc_state.served
        asked, self._lc_state.version_asked = self._lc_state.version_asked, None
        reported = asked.result() if asked is not None else self._lc_reported_version()
        if expected is not None and reported != expected:
            raise StaleWeightsError(
                f"the {self.lifecycle_engine_label} server at {self._lc_url()} reports weight version {reported!r}, but its actor saw "
                f"version {expected!r} loaded whole: it stays paused and out of the router. Push the version "
                "again (the trainer's update_weights), or restart the engine.",
                url=self._lc_url(),
                reported=reported,
                expected=expected,
            )

    def _lc_sleep(self, tags: Sequence[str] | None, call: str) -> None:
        if self.node_rank != 0:
            self._lc_follow(call, released=tuple(tags) if tags else self.lifecycle_server_tags)
            return
        self._lc_require_server(call)
        lifecycle = self.lifecycle
        targets = self._lc_targets(tags, call)
        if self._lc_state.loading is not None:
            self._lc_state.interrupted = True  # a release in the middle of a version: it cannot complete
        try:
            lifecycle.sleep(targets)  # the resident tags released in one request (`ServerMemory.pause_tags`)
        finally:
            self._lc_leave_if_failed()
            self._lc_publish()

    def _lc_wake(self, tags: Sequence[str] | None, call: str) -> None:
        if self.node_rank != 0:
            self._lc_follow(call, resident=tuple(tags) if tags else self.lifecycle_server_tags)
            return
        self._lc_require_server(call)
        lifecycle = self.lifecycle
        targets = self._lc_targets(tags, call)
        batch = [t for t in targets if lifecycle.residency[t] is Residency.RELEASED]
        if batch and self._lc_servable_after(targets):
            # The version check of the wake's end, asked while the memory comes back (nothing the
            # wake does changes the version the server reports).
            self._lc_state.version_asked = self._lc_pool().submit(self._lc_reported_version)
        try:
            lifecycle.wake_up(
                targets
            )  # the released tags resumed in one request (`ServerMemory.resume_tags`)
        finally:
            asked, self._lc_state.version_asked = self._lc_state.version_asked, None
            if asked is not None:
                asked.exception()  # the wake failed before its end: no request left in flight
            self._lc_leave_if_failed()
            self._lc_publish()

    def _lc_targets(self, tags: Sequence[str] | None, call: str) -> tuple[str, ...]:
        if not tags:
            return self.lifecycle_server_tags
        unknown = sorted(set(tags) - set(self.lifecycle_server_tags))
        if unknown:
            raise ValueError(
                f"{call}(tags={list(tags)}): {self.lifecycle_engine_label} has no memory tags {unknown}; "
                f"it has {list(self.lifecycle_server_tags)}"
            )
        return tuple(t for t in self.lifecycle_server_tags if t in tags)

    def _lc_push(self, call: str, version: Any, push: Callable[[], Any]) -> Any:
        """One bucket of a version (`update_weights_from_tensor` / `_from_distributed`) as the sync operation."""
        if self.node_rank != 0:
            raise self._lc_follower_error(
                call, "weights go to the engine's node-0 actor: one coordinator per slot"
            )
        self._lc_require_server(call)
        lifecycle = self.lifecycle
        label = "unversioned" if version is None else str(version)
        generation = self._lc_generation()

        def body() -> Any:
            if not generation.paused:
                # A push without the trainer's pause: requests would be served on a half-written model.
                self._lc_server().pause_generation(self._lc_pause_mode())
                generation.paused = True
                self._lc_event(Event.ABSORBED, call=call, reason="generation paused before the first bucket")
            if self._lc_state.loading != label:
                self._lc_state.loading, self._lc_state.interrupted = label, False
                lifecycle.note_weights(
                    Contents.UNKNOWN,
                    as_int(version),
                    reason=f"loading version {label}: weights being overwritten",
                )
            try:
                return push()
            except BaseException:
                self._lc_state.interrupted = True  # a bucket failed: this version cannot be whole
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

    def _lc_version_end(self, call: str) -> None:
        """The trainer says the version is whole: valid at it, unless a release interrupted its load."""
        lifecycle = self.lifecycle
        label = self._lc_state.loading
        self._lc_state.update_open = False
        if label is None:
            return
        if self._lc_state.interrupted:
            self._lc_state.loading = None
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
                Contents.VALID, as_int(label, lifecycle.weight_version), reason=f"version {label} loaded"
            )

        lifecycle.run("sync", whole)
        self._lc_state.loading, self._lc_state.served = None, label
        self._lc_publish()

    def _lc_continue(self, call: str, resume: Callable[[], Any]) -> Any:
        """The trainer's `continue_generation`: the version ends here; generation continues now if the
        server is awake with it, else at the end of the wake (the call is then absorbed: None)."""
        if self.node_rank != 0:
            raise self._lc_follower_error(call, "generation is node 0's to pause and continue")
        self._lc_require_server(call)
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
        there, and the server's pause in "abort" mode (slime's) would abort the requests waiting on the
        sleep's pause, which are otherwise served after the wake on the new version."""
        if self.node_rank != 0:
            raise self._lc_follower_error(call, "generation is node 0's to pause and continue")
        self._lc_require_server(call)
        state = self._lc_state
        state.update_open, state.loading, state.interrupted = True, None, False
        generation = self._lc_generation()
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
        self._lc_require_server(call)
        lifecycle = self.lifecycle
        if lifecycle.state is State.FAILED or lifecycle.residency.get("weights") is not Residency.RESIDENT:
            message = (
                f"{call}: the weights are {lifecycle.residency.get('weights')} (state {lifecycle.state}); "
                f"{self.lifecycle_engine_label} would read released memory. Resume them first (resume_memory_occupation(tags=['weights']))."
            )
            self._lc_event(Event.REFUSED, "warning", operation=call, state=lifecycle.state, reason=message)
            raise IllegalTransitionError(message, state=lifecycle.state, operation=call, allowed=("wake_up",))
        return read()

    def _lc_health(self, timeout: float, check: Callable[[], Any]) -> Any:
        """The framework's health check where a generation is safe; else a liveness probe."""
        if self.node_rank != 0:
            leader = self._lc_leader_entry()
            if leader is None or leader.get("url") is None:
                raise self._lc_follower_error(
                    "health_generate", "node 0's actor has not published its server yet"
                )
            self._lc_new_client(leader["url"], timeout_s=timeout).alive()
            if leader.get("state") == State.FAILED.value:
                raise self._lc_follower_error("health_generate", "node 0's lifecycle is FAILED")
            return True
        self._lc_require_server("health_generate")
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
        generation = self._lc_generation()
        if self._lc_servable() and not generation.paused:
            return check()
        self._lc_new_client(
            self._lc_url(), timeout_s=timeout
        ).alive()  # no generation: the KV cache may be released or the weights half-written
        return True

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
        directory: EngineDirectory | None = self._lc_state.directory
        if directory is None or self._lc_state.key is None:
            return None
        return directory.get(self._lc_state.key)

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

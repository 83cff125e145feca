"""A local HTTP server that answers as SGLang's `launch_server` does, and a router in front of it
(tests only).

`FakeSGLangServer` answers the routes slime's and miles' engine actors and the lifecycle use, with
the status codes and bodies of SGLang's `http_server.py` (0.5.17 or 0.5.23; with the wheel's
`SourceTree` a route the version lacks is a 404 and a wrong method a 405, and every request is
recorded for `request_problem`). Its scheduler does what the real one does with calls out of
order, from the 0.5.17 source (`scheduler_components/weight_updater.py`) and the H200 runs
(docs/measurements.md#what-kills-an-sglang-http-server-2026-12-03), and each of the three sequences that kill the real server
kills this one: the request gets no answer and every later connection is refused:

- a release of a tag already paused (torch_memory_saver "Cannot pause allocation that is not
  active"; `cuda_graph` without CUDA graphs holds nothing, and pausing nothing is a no-op);
- a resume of a tag not released (`offload_tags.remove`: `KeyError`);
- a generation (`/generate`, `/health_generate`) with the weights or the KV cache released (a
  Triton pointer error); a weight load into released weights, and a release with requests in the
  scheduler (0.5.17 asserts an idle scheduler) die as well.

A server started with the lifecycle's receiver in `custom_weight_loader` runs it as SGLang's
scheduler does: an `/update_weights_from_tensor` whose `load_format` names it goes to
`sglang_receiver.receive(model, named_tensors)` on the fake's `model` (one TP rank; the names
serialized with `encode_names`, as `SGLangHTTPEngine(serialize_names=encode_names)` sends them),
which opens the trainer's buffers (shm on CPU), verifies and loads them, and writes its reply file.

Generation waits while paused (SGLang's tokenizer manager holds requests on `is_pause`), and
`/health_generate` answers 503 after its timeout then, without reaching the scheduler. A request
is registered before it waits, so an abort of every request meanwhile (a pause in "abort" mode,
slime's trainer's; `/abort_request` with `abort_all`) reaches it: at the continue it is answered
400, "Request ... was aborted" (`aborted` counts them), never served. Each
generation that runs is recorded with the weights it read (`served`): per parameter, the version
last written into it (`checkpoint` at launch, `garbage` after a release without backup).

`launch_server(server_args)` runs it as SGLang's server process (spawned by slime's and miles'
own `launch_server_process`); the test reads and steers it through `/_fake/*` routes.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERVER_TAGS = ("weights", "kv_cache", "cuda_graph")
NAMES = ("embed", "layer0", "lm_head")
VERSION_ENV = "RL_LIFECYCLE_FAKE_SGLANG_VERSION"


def encode_names(names: Any) -> str:
    """A bucket's stand-in payload: the names it writes (the real one carries CUDA IPC handles)."""
    return base64.b64encode(json.dumps(list(names)).encode()).decode()


def _decode_names(payload: Any) -> list[str] | None:
    try:
        names = json.loads(base64.b64decode(payload))
    except (ValueError, TypeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


class _Dropped(Exception):
    """The server died while answering: the connection closes without a response."""


@functools.cache
def _routes(version: str) -> dict[str, frozenset[str]] | None:
    try:
        from tests.helpers.sglang_source import HTTP_MODULES, SourceTree, cached_wheel
    except ImportError:  # pragma: no cover - the helpers always import
        return None
    wheel = cached_wheel(version)
    if wheel is None:
        return None
    tree = SourceTree(wheel, version)
    try:
        return {path: route.methods for path, route in tree.routes(*HTTP_MODULES).items()}
    finally:
        tree.close()


class FakeSGLangServer:
    """One SGLang server on 127.0.0.1 (its scheduler, tokenizer manager and HTTP front in one)."""

    def __init__(
        self,
        *,
        version: str = "0.5.17",
        host: str = "127.0.0.1",
        port: int = 0,
        names: tuple[str, ...] = NAMES,
        cuda_graph: bool = False,
        weights_cpu_backup: bool = False,
        health_generation: bool = False,
        health_timeout_s: float = 20.0,
        exit_on_death: bool = False,
        routes: dict[str, frozenset[str]] | None = None,
        custom_weight_loader: list[str] | None = None,
        model: Any = None,
    ) -> None:
        self.version = version
        self.custom_weight_loader = list(custom_weight_loader or [])
        self.model = model  # SGLang's model for the receiver (a `receiving_model()` on first use)
        self.names = names
        self.cuda_graph = cuda_graph
        self.weights_cpu_backup = weights_cpu_backup
        self.health_generation = health_generation  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
        self.health_timeout_s = health_timeout_s
        self.exit_on_death = exit_on_death
        self.routes = routes if routes is not None else _routes(version)
        self.cond = threading.Condition()
        self.alive = True
        self.released: set[str] = set()
        self.offload_tags: set[str] = set()
        self.paused = False
        self.queued = {"running": 0, "waiting": 0}
        self.labels = dict.fromkeys(names, "checkpoint")
        self.weight_version = "default"
        self.session_open = False
        self.trainer_version: str | None = None  # what "current" means for `served` (the test sets it)
        self.refuse_weights: str | None = None
        self.fail_next: dict[str, tuple[int, Any]] = {}  # path -> (status, body) answered once, nothing done
        # path -> gate: a request on it waits until the gate is set, then is handled (a scheduler
        # stopped, then continued: the client may have given up meanwhile)
        self.stalled: dict[str, threading.Event] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.served: list[dict[str, Any]] = []
        self.aborts = 0  # aborts of every request so far (a pause in "abort" mode, abort_all)
        self.aborted: list[str] = []  # requests that waited on the pause and were aborted meanwhile
        self.deaths: list[str] = []
        self.active = 0  # requests inside a handler, not waiting on the pause
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode(errors="replace")
                try:
                    status, answer = server.handle(method, self.path, body)
                except _Dropped:
                    self.close_connection = True
                    return
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(answer, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ life and death

    def close(self, wait: bool = False) -> None:
        with self.cond:
            self.alive = False
            self.cond.notify_all()
        stopper = threading.Thread(target=self._stop, daemon=True)
        stopper.start()
        if wait:
            stopper.join()

    def _stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def die(self, why: str) -> None:
        """What SGLang does when its scheduler exits: the whole process tree is killed."""
        with self.cond:
            if not self.alive:
                return
            self.alive = False
            self.deaths.append(why)
            self.cond.notify_all()
        if self.exit_on_death:
            os._exit(1)
        self.close()
        raise _Dropped(why)

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until no request is running (those held by the pause do not count)."""
        end = time.monotonic() + timeout_s
        with self.cond:
            while self.active and time.monotonic() < end:
                self.cond.wait(0.01)

    def state(self) -> dict[str, Any]:
        with self.cond:
            return {
                "alive": self.alive,
                "pid": os.getpid(),  # the server's process (a spawned fake's: the one a test may kill)
                "released": sorted(self.released),
                "paused": self.paused,
                "labels": dict(self.labels),
                "weight_version": self.weight_version,
                "served": list(self.served),
                "deaths": list(self.deaths),
                "requests": list(self.requests),
            }

    # ------------------------------------------------------------------ requests

    def handle(self, method: str, target: str, body: Any) -> tuple[int, Any]:
        split = urllib.parse.urlsplit(target)
        path, query = split.path, urllib.parse.parse_qs(split.query)
        if path.startswith("/_fake/"):
            return self._control(path, body)
        gate = self.stalled.get(path)
        if gate is not None:
            gate.wait()
        with self.cond:
            if not self.alive:
                raise _Dropped("dead")
            self.requests.append((method, target, body))
            self.active += 1
        try:
            if path in self.fail_next:
                return self.fail_next.pop(path)
            if self.routes is not None:
                methods = self.routes.get(path)
                if methods is None:
                    return 404, {"detail": "Not Found"}
                if method not in methods:
                    return 405, {"detail": "Method Not Allowed"}
            return self._route(method, path, query, body if isinstance(body, dict) else {})
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def _route(self, method: str, path: str, query: dict[str, Any], body: dict[str, Any]) -> tuple[int, Any]:
        if path in ("/health", "/health_generate"):
            if path == "/health" and not self.health_generation:
                return 200, ""
            return self._generate(
                path, {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}, health=True
            )
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": "model", "weight_version": self.weight_version, "is_generation": True}
        if path in ("/get_weight_version", "/weight_version"):
            detail = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
            return 404, {"detail": detail}
        if path in ("/server_info", "/get_server_info"):
            return 200, {
                "version": self.version,
                "weight_version": self.weight_version,
                "internal_states": [{}],
                "tp_size": 1,
                "custom_weight_loader": list(self.custom_weight_loader),
            }
        if path == "/v1/loads":
            loads = [
                {
                    "dp_rank": 0,
                    "num_running_reqs": self.queued["running"],
                    "num_waiting_reqs": self.queued["waiting"],
                }
            ]
            return 200, {"version": self.version, "loads": loads}
        if path == "/flush_cache":
            if self.queued["running"] or self.queued["waiting"]:
                return 400, "Flush cache failed.\n"
            return (
                200,
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
            )
        if path == "/abort_request":
            with self.cond:
                self.queued = {"running": 0, "waiting": 0}
                self.aborts += bool(body.get("abort_all"))
            return 200, ""
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            with self.cond:
                self.paused = True
                if mode == "abort":
                    self.queued = {"running": 0, "waiting": 0}
                    self.aborts += 1
                elif mode == "retract":
                    self.queued = {"running": 0, "waiting": self.queued["running"] + self.queued["waiting"]}
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            with self.cond:
                self.paused = False
                self.cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/release_memory_occupation":
            return self._release(body.get("tags"))
        if path == "/resume_memory_occupation":
            return self._resume(body.get("tags"))
        if path in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
            return self._update(path, body)
        if path == "/update_weights_from_disk":
            return self._update(path, {**body, "names": list(self.names)})
        if path == "/update_weight_version":
            self.weight_version = str(body.get("new_version"))
            return 200, {
                "success": True,
                "message": f"Weight version updated to {self.weight_version}",
                "new_version": self.weight_version,
            }
        if path == "/begin_weight_update":
            if self.session_open:
                return 400, {"success": False, "message": "a weight-update session is already open"}
            self.session_open = True
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update":
            if not self.session_open:
                return 400, {"success": False, "message": "no weight-update session is open"}
            self.session_open = False
            return 200, {"success": True, "message": "Success"}
        if path == "/weights_checker":
            if "weights" in self.released:
                self.die("weights_checker read released weights: illegal memory access")
            return 200, {"success": True, "message": "Success."}
        if path == "/generate":
            return self._generate(path, body)
        return 404, {"detail": "Not Found"}

    # ------------------------------------------------------------------ the scheduler

    def _release(self, tags: Any) -> tuple[int, Any]:
        tags = list(tags) if tags else list(SERVER_TAGS)
        with self.cond:
            # 0.5.23 ignores waiting requests while paused (is_fully_idle(ignore_waiting=...)); 0.5.17 does not.
            busy = self.queued["running"] or (
                self.queued["waiting"] and not (self.version >= "0.5.23" and self.paused)
            )
            if busy:
                self.die(
                    "AssertionError: release_memory_occupation should be called only when server is idle."
                )
            self.offload_tags |= set(tags)
            for tag in SERVER_TAGS:
                if tag not in tags:
                    continue
                holds_memory = tag != "cuda_graph" or self.cuda_graph
                if tag in self.released and holds_memory:
                    self.die(
                        f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. tag={tag}"
                    )
                self.released.add(tag)
                if tag == "weights" and not self.weights_cpu_backup:
                    self.labels = dict.fromkeys(self.names, "garbage")
        return 200, None

    def _resume(self, tags: Any) -> tuple[int, Any]:
        tags = list(tags) if tags else list(SERVER_TAGS)
        with self.cond:
            for tag in tags:
                if tag not in self.offload_tags:
                    self.die(f"KeyError: {tag!r} (offload_tags.remove in the scheduler's weight updater)")
                self.offload_tags.remove(tag)
                self.released.discard(tag)
        return 200, None

    def _update(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            if "weights" in self.released:
                self.die(
                    f"{path} into released weights: CUDA error: an illegal memory access was encountered"
                )
            if self.version >= "0.5.23" and path == "/update_weights_from_tensor" and not self.session_open:
                return 400, {
                    "success": False,
                    "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
                }
            if self.refuse_weights is not None:
                return 400, {"success": False, "message": self.refuse_weights}
            if body.get("load_format") in self.custom_weight_loader:
                return self._custom_load(body)
            if "names" in body:
                names: list[str] = list(body["names"])
            else:
                names = []
                for payload in body.get("serialized_named_tensors") or [None]:
                    names += _decode_names(payload) or list(self.names)
            version = body.get("weight_version")
            label = "unversioned" if version is None else str(version)
            for name in names:
                self.labels[name] = label
            if version is not None:
                self.weight_version = str(version)
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def _custom_load(self, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's `custom_loader(model, named_tensors)` (the lifecycle's receiver), one TP rank.
        Every parameter is labelled as the flattened-bucket path labels it: by the call's version."""
        from unittest import mock

        from actor_integration.engines.sglang import receiver as sglang_receiver

        if self.model is None:
            self.model = receiving_model()
        payloads = body.get("serialized_named_tensors") or [None]
        names = _decode_names(payloads[0]) or []
        with mock.patch.object(sglang_receiver, "_tp", lambda: (0, None)):  # no sglang: one rank
            sglang_receiver.receive(self.model, [(name, None) for name in names])
        version = body.get("weight_version")
        if not _receiver_round(names):  # "hello", "release": the receiver's own calls write no weight
            return 200, {"success": True, "message": "Success"}
        self.labels = dict.fromkeys(self.names, "unversioned" if version is None else str(version))
        if version is not None:
            self.weight_version = str(version)
        return 200, {"success": True, "message": "Success"}

    def _generate(self, path: str, body: dict[str, Any], *, health: bool = False) -> tuple[int, Any]:
        started = time.monotonic()
        with self.cond:
            aborts = self.aborts  # the request's state, registered before it waits
            self.active -= 1  # waiting on the pause is not running
            self.cond.notify_all()
            try:
                while self.paused and self.alive:
                    if health and time.monotonic() - started > self.health_timeout_s:
                        return 503, ""
                    self.cond.wait(0.02)
            finally:
                self.active += 1
            if not self.alive:
                raise _Dropped("dead")
            if not health and self.aborts != aborts:
                rid = f"fake-{len(self.requests)}"
                self.aborted.append(rid)
                return 400, {"error": {"message": f"Request {rid} was aborted"}}
            gpu_tags = {"weights", "kv_cache"} | ({"cuda_graph"} if self.cuda_graph else set())
            if self.released & gpu_tags:
                self.die(
                    f"{path} with {sorted(self.released)} released: Triton Error [CUDA]: Pointer argument cannot be accessed"
                )
            labels = dict(self.labels)
            current = self.trainer_version
            ok = len(set(labels.values())) == 1 and next(iter(labels.values())) == (
                current if current is not None else "checkpoint"
            )
            self.served.append({"path": path, "labels": labels, "current": current, "ok": ok})
        if health:
            return 200, ""
        prompts = body.get("input_ids") or [[0]]
        single = bool(prompts) and not isinstance(prompts[0], list)
        count = int((body.get("sampling_params") or {}).get("max_new_tokens", 8))
        seed = json.dumps(sorted(labels.items()))
        outputs = []
        for prompt in [prompts] if single else prompts:
            tokens = [abs(hash((seed, tuple(prompt), i))) % 1000 for i in range(count)]
            outputs.append(
                {"text": "", "output_ids": tokens, "meta_info": {"weight_version": self.weight_version}}
            )
        return 200, outputs[0] if single else outputs

    # ------------------------------------------------------------------ the test's controls

    def _control(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/_fake/state":
            return 200, self.state()
        if path == "/_fake/set" and isinstance(body, dict):
            with self.cond:
                for name, value in body.items():
                    setattr(self, name, value)
            return 200, {"ok": True}
        return 404, {"detail": "Not Found"}


def _receiver_round(names: list[str]) -> bool:
    """Whether a call of the lifecycle's receiver loads weights (its op "round"), from its names."""
    from actor_integration.engines.sglang import receiver as sglang_receiver

    if not names or not names[0].startswith(sglang_receiver.PREFIX):
        return True  # not the receiver's encoding: its refusal is a load attempt like any other
    return bool(json.loads(names[0][len(sglang_receiver.PREFIX) :]).get("op") == "round")


def receiving_model() -> Any:
    """SGLang's model (an nn.Module) as its weight loaders see it: `load_weights(named_tensors)`,
    which keeps a copy of each tensor (`loaded`) and counts the calls (`loads`)."""
    import torch

    class ReceivingModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.loaded: dict[str, Any] = {}
            self.loads = 0

        def load_weights(self, weights: Any) -> None:
            self.loads += 1
            for name, tensor in weights:
                self.loaded[name] = tensor.clone()

    return ReceivingModel()


def launch_server(server_args: Any) -> None:
    """SGLang's `launch_server(server_args)` for a spawned process: serve until killed or dead."""
    version = os.environ.get(VERSION_ENV, "0.5.17")
    server = FakeSGLangServer(
        version=version,
        host=server_args.host,
        port=int(server_args.port),
        weights_cpu_backup=bool(getattr(server_args, "enable_weights_cpu_backup", False)),
        exit_on_death=True,
        custom_weight_loader=getattr(server_args, "custom_weight_loader", None),
    )
    server.thread.join()


def fake_state(url: str) -> dict[str, Any]:
    """A spawned fake's state, read over HTTP."""
    with urllib.request.urlopen(f"{url}/_fake/state", timeout=10) as reply:
        state: dict[str, Any] = json.loads(reply.read())
        return state


def fake_set(url: str, **values: Any) -> None:
    """Steer a spawned fake (e.g. `queued={"running": 1, "waiting": 0}`, `refuse_weights="..."`)."""
    data = json.dumps(values).encode()
    request = urllib.request.Request(
        f"{url}/_fake/set", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


# ---------------------------------------------------------------------------------------------- the router


class FakeRouter:
    """sglang_router's worker API (`/workers`, and the legacy `/add_worker` / `/remove_worker`) and
    its `/generate`, forwarded round robin to the registered servers (503 with none); vllm-router's
    API is the same, with `/v1/completions` forwarded to vLLM servers.

    `kind="miles"` answers as miles' own router (`--use-miles-router`, `miles/router/router.py` at
    31f1ca96) does instead: `POST /add_worker` (the URL in the query or the body; a second add is
    no error) and `GET /list_workers`, and every other request, whatever its path, proxied to the
    registered server with the fewest requests in flight (500 with none). It has no route that
    removes a worker: a `POST /remove_worker` is proxied to a server like any other request. Its
    background health check is left out (it asks `/health`, which SGLang answers without generating)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, kind: str = "sglang") -> None:
        if kind not in ("sglang", "miles"):
            raise ValueError(f"FakeRouter: kind must be 'sglang' or 'miles', got {kind!r}")
        self.kind = kind
        self.in_flight: dict[str, int] = {}  # miles: requests being proxied, per server
        self.workers: dict[str, dict[str, Any]] = {}
        self.alive = True
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, Any]] = []
        self.routed: list[tuple[str | None, int]] = []
        # "add" / "remove" -> gate: a worker being added or removed waits (at most 10 s) until it is set
        self.stalled: dict[str, threading.Event] = {}
        self.fail_next: dict[str, tuple[int, Any]] = {}  # "add" / "remove" -> (status, body) answered once
        # called with the server's URL before each request is forwarded to it (a test's hook: e.g.
        # kill the server mid-rollout, while the rollout's requests are in flight)
        self.before_forward: Callable[[str], None] | None = None
        self._next_id = 0
        self._turn = 0
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if not router.alive:  # closed: a kept-alive connection goes with it, unanswered
                    self.close_connection = True
                    return
                body = json.loads(raw) if raw else None
                status, answer = router.handle(method, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.alive = False
        self.httpd.shutdown()
        self.httpd.server_close()

    def urls(self) -> list[str]:
        with self.lock:
            return [w["url"] for w in self.workers.values()]

    def handle(self, method: str, target: str, body: Any) -> tuple[int, Any]:
        split = urllib.parse.urlsplit(target)
        path, query = split.path, urllib.parse.parse_qs(split.query)
        operation = _worker_operation(method, path)
        gate = self.stalled.get(operation)
        if gate is not None:
            gate.wait(10)
        with self.lock:
            self.calls.append((method, target, body))
            refused = self.fail_next.pop(operation, None) if operation is not None else None
        if refused is not None:
            return refused
        if self.kind == "miles":
            return self._handle_as_miles(method, path, query, body)
        if path == "/workers" and method == "POST":
            return self._add(body["url"], body.get("worker_type", "regular"))
        if path == "/workers" and method == "GET":
            with self.lock:
                workers = [{"id": i, **w} for i, w in self.workers.items()]
            return 200, {"workers": workers, "total": len(workers)}
        if path.startswith("/workers/") and method == "DELETE":
            key = urllib.parse.unquote(path.removeprefix("/workers/"))
            with self.lock:
                found = (
                    key
                    if key in self.workers
                    else next((i for i, w in self.workers.items() if w["url"] == key), None)
                )
                if found is None:
                    return 404, {"error": f"worker {key} not found"}
                del self.workers[found]
            return 202, {"status": "accepted", "worker_id": found}
        if path == "/add_worker" and method == "POST":
            return self._add(query["url"][0], "regular")
        if path == "/remove_worker" and method == "POST":
            url = query["url"][0]
            with self.lock:
                found = next((i for i, w in self.workers.items() if w["url"] == url), None)
                if found is None:
                    return 400, {"error": f"worker {url} not found"}
                del self.workers[found]
            return 200, {"status": "removed"}
        if path == "/generate" and method == "POST":
            return self._forward(body)
        if path == "/v1/completions" and method == "POST":  # vllm-router's, to vLLM servers
            return self._forward(body, path=path)
        return 404, {"error": "Not Found"}

    def _handle_as_miles(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        if path == "/add_worker" and method == "POST":
            given = query.get("url") or query.get("worker_url")
            url = given[0] if given else (body or {}).get("url") or (body or {}).get("worker_url")
            if not url:
                return 400, {"error": "worker_url is required (use query ?url=... or JSON body)"}
            with self.lock:
                if all(w["url"] != url for w in self.workers.values()):
                    self.workers[f"w{self._next_id}"] = {"url": url, "worker_type": "regular"}
                    self._next_id += 1
                urls = {w["url"]: self.in_flight.get(w["url"], 0) for w in self.workers.values()}
            return 200, {"status": "success", "worker_urls": urls}
        if path == "/list_workers" and method == "GET":
            return 200, {"urls": self.urls()}
        return self._forward(body, path=path, method=method)

    def _add(self, url: str, worker_type: str) -> tuple[int, Any]:
        with self.lock:
            if any(w["url"] == url for w in self.workers.values()):
                return 409, {"error": f"worker {url} already exists"}
            worker_id = f"w{self._next_id}"
            self._next_id += 1
            self.workers[worker_id] = {"url": url, "worker_type": worker_type}
        return 202, {"status": "accepted", "worker_id": worker_id, "url": url}

    def _forward(self, body: Any, *, path: str = "/generate", method: str = "POST") -> tuple[int, Any]:
        with self.lock:
            urls = [w["url"] for w in self.workers.values()]
            if not urls:
                none = (
                    (500, "Internal Server Error") if self.kind == "miles" else (503, "No available workers")
                )
                self.routed.append((None, none[0]))
                return none[0], {"error": none[1]}
            if self.kind == "miles":  # the fewest requests in flight
                url = min(urls, key=lambda u: self.in_flight.get(u, 0))
            else:
                url = urls[self._turn % len(urls)]
                self._turn += 1
            self.in_flight[url] = self.in_flight.get(url, 0) + 1
        try:
            if self.before_forward is not None:
                self.before_forward(url)
            return self._send(url, body, path, method)
        finally:
            with self.lock:
                self.in_flight[url] -= 1

    def _send(self, url: str, body: Any, path: str, method: str) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = json.loads(reply.read())
                status = reply.status
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, {"error": exc.read().decode(errors="replace")}
        except Exception as exc:  # the worker died or refused the connection
            status, answer = 502, {"error": f"worker {url} failed: {exc!r}"}
        with self.lock:
            self.routed.append((url, status))
        return status, answer


def _worker_operation(method: str, path: str) -> str | None:
    """Which worker change a router request is, in any of the router's APIs ("add", "remove", None)."""
    if method == "POST" and path in ("/workers", "/add_worker"):
        return "add"
    if (method == "DELETE" and path.startswith("/workers/")) or (
        method == "POST" and path == "/remove_worker"
    ):
        return "remove"
    return None

"""A fake `vllm serve` (dev mode, sleep mode on) over `FakeVLLM`, on a real local HTTP socket.

Every request is checked against vLLM 0.26.0's routes first (`route_problem`: the path, the method,
the query parameters its handler reads) and its JSON body against the request model vLLM parses
(`CompletionRequest`'s fields, `update_info`'s); a request vLLM would not serve as meant is
recorded in `problems` and answered 404/400 as FastAPI would. A dead engine leaves the server up
and answers 500, as vLLM's server does after its EngineCore dies (vllm #57853); with
`hangs_on_death`, the request whose call killed the engine gets no answer until `close()` (the
real server's, whose EngineCore segfaulted, leaves its caller waiting out its timeout).
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import pickle
import threading
import urllib.parse
from typing import Any

from tests.helpers.vllm_fake import FakeVLLM
from tests.helpers.vllm_source import COMPLETION_REQUEST, field_names, route_problem


class FakeVLLMServer:
    def __init__(
        self,
        fake: FakeVLLM,
        model: str = "tiny",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        hangs_on_death: bool = False,
    ) -> None:
        self.fake = fake
        self.model = model
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.hangs_on_death = hangs_on_death
        self.hung: list[str] = []  # requests held unanswered since they killed the engine
        self.released = threading.Event()  # set by close(): the held requests answer
        self.completion_fields = field_names(fake.tree, COMPLETION_REQUEST)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._serve(self, "GET")

            def do_POST(self) -> None:
                server._serve(self, "POST")

        self.httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self.alive = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.alive = False
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, handler: http.server.BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        self.requests.append(f"{method} {handler.path}")
        problem = route_problem(self.fake.tree, method, handler.path)
        if problem is not None:
            self.problems.append(problem)
            return _answer(handler, 404, {"detail": problem})
        split = urllib.parse.urlsplit(handler.path)
        query = urllib.parse.parse_qs(split.query)
        body = json.loads(raw) if raw else None
        alive = self.fake.dead is None
        try:
            status, answer = self._route(split.path, query, body)
        except ValueError as exc:
            status, answer = 400, {"error": str(exc)}
        except Exception as exc:  # the engine's failure, as vLLM's handler reports it
            status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
        if alive and self.fake.dead is not None and self.hangs_on_death:
            self.hung.append(f"{method} {handler.path}")
            self.released.wait()
        with contextlib.suppress(
            BrokenPipeError, ConnectionResetError
        ):  # the client gave up (a timeout test)
            _answer(handler, status, answer)

    def _route(self, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        fake = self.fake
        if path == "/health":
            return (503, {"error": "EngineDeadError"}) if fake.dead else (200, None)
        if path not in ("/v1/models",):
            fake.call(path)
        if path == "/is_sleeping":
            return 200, {"is_sleeping": bool(fake.sleeping_tags) or fake.paused}
        if path == "/is_paused":
            return 200, {"is_paused": fake.paused}
        if path == "/sleep":
            fake.sleep(int(query.get("level", ["1"])[0]), query.get("mode", ["abort"])[0])
            return 200, None
        if path == "/wake_up":
            fake.wake_up(query.get("tags") or None)
            return 200, None
        if path == "/pause":
            fake.sleep(0, query.get("mode", ["abort"])[0])
            return 200, {"status": "paused"}
        if path == "/resume":
            fake.wake_up(["scheduling"])
            return 200, {"status": "resumed"}
        if path == "/reset_prefix_cache":
            return 200, {"success": fake.unfinished == 0}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if path == "/v1/completions":
            unknown = set(body) - self.completion_fields
            if unknown:
                self.problems.append(f"CompletionRequest has no fields {sorted(unknown)}")
                return 400, {"error": f"unknown fields {sorted(unknown)}"}
            if body.get("model") != self.model:
                return 404, {"error": f"The model `{body.get('model')}` does not exist."}
            tokens = fake.generate(body["prompt"], body["max_tokens"])
            choices = [
                {"index": i, "text": "", "token_ids": t if body.get("return_token_ids") else None}
                for i, t in enumerate(tokens)
            ]
            return 200, {"choices": choices}
        if path == "/init_weight_transfer_engine":
            if not isinstance(body, dict) or body.get("init_info") is None:
                return 400, {"detail": "Missing 'init_info' in request body"}
            fake.transfer_init = dict(body["init_info"])
            return 200, {"message": "Weight transfer initialized"}
        if path == "/collective_rpc":
            if not all(isinstance(a, str) for a in body.get("args", [])):
                self.problems.append("collective_rpc passes string arguments only")
            return 200, {"results": fake.rpc(body["method"], tuple(body.get("args", [])))}
        if path == "/start_weight_update":
            fake.start_update()
            return 200, {"message": "Weight update started"}
        if path == "/update_weights":
            info = dict(body["update_info"])
            pickled = info.pop("ipc_handles_pickled", None)
            if pickled is not None:  # as IPCWeightTransferUpdateInfo.__post_init__ does
                info["ipc_handles"] = pickle.loads(base64.b64decode(pickled))
            fake.update(info)
            return 200, {"message": "Weights updated"}
        if path == "/finish_weight_update":
            fake.finish_update()
            return 200, {"message": "Weight update finished"}
        raise AssertionError(f"the fake serves no {path}")


def _answer(handler: http.server.BaseHTTPRequestHandler, status: int, body: Any) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)

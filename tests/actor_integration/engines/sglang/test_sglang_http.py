"""SGLangHTTPEngine against a local HTTP server that answers as SGLang 0.5.23's does, and every
request it sent checked against that version's server source (routes, methods, JSON fields)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from actor_integration.engines.sglang.http import SGLangHTTPEngine, SGLangServerError, SGLangServerTimeout
from actor_integration.errors import EngineNotIdleError
from actor_integration.rollout import GENERATION_MODES, RolloutActor
from lifecycle import Residency, State
from tests.helpers.sglang_source import request_problem


class FakeSGLangServer:
    """The routes SGLangHTTPEngine uses, answering with SGLang's status codes and bodies
    (python/sglang/srt/entrypoints/http_server.py); records every request."""

    def __init__(self):
        self.requests = []  # (method, path with query, JSON body or None)
        self.released = set()
        self.busy = False  # requests still queued: /flush_cache answers 400
        self.refuse_weights = False
        self.hold = threading.Event()  # set to let a held /generate answer
        self.hold_generate = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer(server.handle("GET", self.path, None))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                self.answer(server.handle("POST", self.path, json.loads(raw) if raw else None))

            def answer(self, reply):
                status, body = reply
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def close(self):
        self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, method, path, body):
        self.requests.append((method, path, body))
        route = path.split("?")[0]
        if route == "/release_memory_occupation":
            self.released |= set(body["tags"] or ["weights", "kv_cache"])
            return 200, None
        if route == "/resume_memory_occupation":
            tags = body["tags"] or ["weights", "kv_cache"]
            if not set(tags) <= self.released:
                return 400, {"error": {"message": f"KeyError: {sorted(set(tags) - self.released)}"}}
            self.released -= set(tags)
            return 200, None
        if route in ("/pause_generation", "/continue_generation"):
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if route == "/flush_cache":
            if self.busy:
                return 400, "Flush cache failed.\n"
            return 200, "Cache flushed.\nPlease check backend logs for more details.\n"
        if route == "/v1/loads":
            loads = [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1 if self.busy else 0}]
            return 200, {"version": "0.5.23", "loads": loads}
        if route == "/generate":
            if self.hold_generate:
                self.hold.wait(timeout=30)
            n = body["sampling_params"]["max_new_tokens"]
            return 200, [{"output_ids": [5] * n, "meta_info": {}} for _ in body["input_ids"]]
        if route == "/update_weights_from_tensor":
            if self.refuse_weights:
                return 400, {"success": False, "message": "Failed to update weights: shape mismatch"}
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        return 404, {"detail": "Not Found"}


@pytest.fixture
def server():
    server = FakeSGLangServer()
    yield server
    server.close()


def codec(named):
    """Stands in for SGLang's flattened-bucket serializer: a JSON-able description per TP rank."""
    return [[name, list(t.shape), str(t.dtype)] for name, t in named]


def engine_for(server, **kwargs):
    return SGLangHTTPEngine(server.url, codec=codec, multi_dtype_buckets=True, **kwargs)


def shards():
    return [[("w", torch.zeros(2, 3))], [("w", torch.ones(2, 3))]]


class TestContract:
    def test_memory_generation_and_weights_reach_sglangs_routes(self, server):
        """Each RolloutEngine call is one request to the route SGLang names the same way."""
        engine = engine_for(server)
        engine.release_memory_occupation(["kv_cache"])
        engine.resume_memory_occupation(["kv_cache"])
        engine.pause_generation("retract")
        assert engine.flush_cache() is True
        engine.continue_generation()
        engine.load_weights(3, shards(), round_index=0, final=True)
        assert engine.generate([[1, 2]], max_new_tokens=2) == [[5, 5]]
        assert [(m, p) for m, p, _ in server.requests] == [
            ("POST", "/release_memory_occupation"),
            ("POST", "/resume_memory_occupation"),
            ("POST", "/pause_generation"),
            ("POST", "/flush_cache"),
            ("POST", "/continue_generation"),
            ("POST", "/update_weights_from_tensor"),
            ("POST", "/generate"),
        ]
        update = server.requests[5][2]
        assert update["load_format"] == "flattened_bucket" and update["weight_version"] == "3"
        assert len(update["serialized_named_tensors"]) == 2 and update["flush_cache"] is True
        assert engine.weight_version == 3

    def test_a_refused_flush_answers_false_and_the_queue_is_reported(self, server):
        """/flush_cache answers 400 while requests remain: False, as the other engines answer."""
        server.busy = True
        engine = engine_for(server)
        assert engine.flush_cache() is False
        assert engine.queued_requests() == {"running": 2, "waiting": 1}

    def test_sglangs_error_status_and_message_reach_a_typed_error(self, server):
        """A resume of a resident tag: SGLangServerError with the status and SGLang's message."""
        with pytest.raises(
            SGLangServerError, match=r"answered POST /resume_memory_occupation with 400: KeyError"
        ) as raised:
            engine_for(server).resume_memory_occupation(["weights"])
        assert raised.value.status == 400 and raised.value.path == "/resume_memory_occupation"

    def test_a_refused_weight_update_raises_and_blocks_generation_until_a_whole_version_loads(self, server):
        """An update answered success=False raises; a version applied in part blocks generation."""
        engine = engine_for(server)
        engine.load_weights(1, shards(), round_index=0, final=False)
        server.refuse_weights = True
        with pytest.raises(SGLangServerError, match="refused weight version 1: Failed to update weights"):
            engine.load_weights(1, shards(), round_index=1, final=True)
        with pytest.raises(RuntimeError, match="applied in part"):
            engine.generate([[1]])

    def test_the_errors_cross_processes_with_their_fields(self, server):
        """Ray ships exceptions by pickling: status, path and SGLang's answer survive."""
        import pickle

        with pytest.raises(SGLangServerError) as raised:
            engine_for(server).resume_memory_occupation(["weights"])
        copy = pickle.loads(pickle.dumps(raised.value))
        assert (copy.status, copy.path, copy.answer) == (
            400,
            "/resume_memory_occupation",
            "KeyError: ['weights']",
        )

    def test_an_unreachable_server_is_a_typed_error(self, server):
        """Nothing listening: SGLangServerError with status None and what to check."""
        url = server.url
        server.close()
        with pytest.raises(SGLangServerError, match="could not be reached") as raised:
            SGLangHTTPEngine(url, codec=codec, multi_dtype_buckets=True).continue_generation()
        assert raised.value.status is None

    def test_a_server_that_does_not_answer_in_time_is_a_typed_timeout(self, server):
        """A held request past the timeout: SGLangServerTimeout (a TimeoutError)."""
        server.hold_generate = True
        with pytest.raises(SGLangServerTimeout, match="did not answer POST /generate") as raised:
            engine_for(server, timeout_s=0.2).generate([[1]])
        assert isinstance(raised.value, TimeoutError)

    def test_bad_arguments_are_refused_before_any_request(self, server):
        """A URL without a scheme, a non-positive timeout or an unknown pause mode: ValueError."""
        with pytest.raises(ValueError, match="http"):
            SGLangHTTPEngine("localhost:30000", codec=codec)
        with pytest.raises(ValueError, match="positive"):
            engine_for(server, timeout_s=0)
        with pytest.raises(ValueError, match="mode must be one of"):
            engine_for(server).pause_generation("drain")
        assert server.requests == []


class TestRolloutActor:
    def test_the_lifecycle_drives_the_server_in_sglangs_order(self, server):
        """Sleep = pause, flush, release weights, release kv_cache; the wake resumes them."""
        actor = RolloutActor(engine_for(server), generation_mode="retract")
        actor.sleep()
        actor.wake_up(["weights"])
        actor.wake_up(["kv_cache"])
        assert [(p, b) for _, p, b in server.requests] == [
            ("/pause_generation", {"mode": "retract"}),
            ("/flush_cache", None),
            ("/release_memory_occupation", {"tags": ["weights"]}),
            ("/release_memory_occupation", {"tags": ["kv_cache"]}),
            ("/resume_memory_occupation", {"tags": ["weights"]}),
            ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
            ("/continue_generation", {}),
        ]

    def test_a_server_that_stays_busy_fails_the_sleep_before_any_release(self, server, monkeypatch):
        """Flush refused until the deadline: EngineNotIdleError with the server's queue, nothing released."""
        from actor_integration.rollout import engine as engine_module

        monkeypatch.setattr(engine_module, "FLUSH_DEADLINE_S", 0.0)
        server.busy = True
        actor = RolloutActor(engine_for(server), generation_mode="retract")
        with pytest.raises(EngineNotIdleError) as raised:
            actor.sleep()
        assert raised.value.queued == {"running": 2, "waiting": 1}
        assert actor.lifecycle.state is State.FAILED
        assert actor.lifecycle.residency == {"weights": Residency.RESIDENT, "kv_cache": Residency.RESIDENT}
        assert not any(p.startswith("/release") for _, p, _ in server.requests)


class TestAgainstSGLangSource:
    """Every request the adapter sent is one SGLang 0.5.23's server routes and parses."""

    def test_every_request_matches_a_route_and_its_request_struct(self, server, sglang_tree):
        """Paths, methods, query parameters and JSON fields, for every call and pause mode."""
        engine = engine_for(server)
        engine.release_memory_occupation(["weights", "kv_cache"])
        engine.resume_memory_occupation(None)
        for mode in GENERATION_MODES:
            engine.pause_generation(mode)
        engine.continue_generation()
        engine.flush_cache()
        engine.queued_requests()
        engine.load_weights(1, shards(), round_index=0, final=False)
        engine.load_weights(1, shards(), round_index=1, final=True)
        engine.generate([[1, 2], [3]], max_new_tokens=2)
        paths = {p.split("?")[0] for _, p, _ in server.requests}
        assert len(paths) == 8
        problems = [request_problem(sglang_tree, m, p, b) for m, p, b in server.requests]
        assert [p for p in problems if p] == []

    def test_the_sampling_parameters_are_sglangs(self, sglang_tree):
        """temperature and max_new_tokens are SamplingParams fields."""
        sglang_tree.cls("sglang.srt.sampling.sampling_params.SamplingParams").constructor().bind(
            temperature=0.0, max_new_tokens=2
        )

    def test_flush_answers_400_when_not_flushed(self, sglang_tree):
        """The /flush_cache handler answers 400 when the flush did not succeed (what flush_cache reads)."""
        handler = sglang_tree.routes("sglang.srt.entrypoints.http_server")["/flush_cache"].handler
        source = __import__("ast").unparse(handler.node)
        assert "status_code=200 if ret.success else HTTPStatus.BAD_REQUEST" in source

    def test_a_wrong_route_method_or_field_is_reported(self, sglang_tree):
        """The check fails on a path, a method or a JSON field SGLang does not have."""
        assert "no such route" in request_problem(sglang_tree, "POST", "/flush", None)
        assert "accepts ['POST']" in request_problem(sglang_tree, "GET", "/pause_generation", None)
        problem = request_problem(sglang_tree, "POST", "/pause_generation", {"pause_mode": "retract"})
        assert "PauseGenerationReqInput" in problem and "pause_mode" in problem
        assert "not parameters" in request_problem(sglang_tree, "GET", "/v1/loads?sections=core", None)

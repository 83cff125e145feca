"""`FakeSGLangServer` answers as the pinned SGLang server does where the engine actors depend on it:
its routes are the wheel's, and each of the three sequences that kill the real server (H200,
docs/measurements.md#what-kills-an-sglang-http-server-2026-12-03) kills it: no answer, then every connection refused."""

from __future__ import annotations

import threading
import time

import pytest

from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.errors import SGLangServerError
from tests.helpers.sglang_server import FakeRouter, FakeSGLangServer, encode_names
from tests.helpers.sglang_source import HTTP_MODULES, request_problem


def client(server, **kwargs):
    return SGLangHTTPEngine(
        server.url, codec=lambda named: None, multi_dtype_buckets=False, timeout_s=5, **kwargs
    )


@pytest.fixture
def server(sglang_tree):
    routes = {path: route.methods for path, route in sglang_tree.routes(*HTTP_MODULES).items()}
    server = FakeSGLangServer(version=sglang_tree.version, routes=routes, health_timeout_s=0.3)
    yield server
    server.close()


def assert_dead(server, sglang):
    assert not server.alive and server.deaths
    with pytest.raises(SGLangServerError):
        sglang.flush_cache()


class TestTheKillingSequences:
    def test_a_second_release(self, server):
        sglang = client(server)
        sglang.release_memory_occupation(None)
        with pytest.raises(SGLangServerError, match="without answering"):
            sglang.release_memory_occupation(None)
        assert "Cannot pause allocation that is not active" in server.deaths[0]
        assert_dead(server, sglang)

    def test_a_resume_of_a_resident_tag(self, server):
        sglang = client(server)
        with pytest.raises(SGLangServerError):
            sglang.resume_memory_occupation(["kv_cache", "cuda_graph"])
        assert server.deaths == [
            "KeyError: 'kv_cache' (offload_tags.remove in the scheduler's weight updater)"
        ]

    @pytest.mark.parametrize("path", ["/generate", "/health_generate"])
    def test_a_generation_while_released(self, server, path):
        sglang = client(server)
        sglang.release_memory_occupation(["kv_cache"])
        with pytest.raises(SGLangServerError):
            if path == "/generate":
                sglang.generate([[1, 2]], max_new_tokens=2)
            else:
                sglang._request("GET", "/health_generate", None)
        assert "Pointer argument cannot be accessed" in server.deaths[0]

    def test_a_cuda_graph_tag_without_graphs_holds_nothing_to_pause_twice(self, server):
        sglang = client(server)
        sglang.release_memory_occupation(["cuda_graph"])
        sglang.release_memory_occupation(["cuda_graph"])
        assert server.alive


class TestWhatLiveServersDo:
    def test_generation_waits_while_paused_and_runs_after_continue(self, server):
        sglang = client(server)
        sglang.pause_generation("abort")
        answers = []
        thread = threading.Thread(target=lambda: answers.append(sglang.generate([[1]], max_new_tokens=2)))
        thread.start()
        time.sleep(0.2)
        assert not answers and not server.served
        sglang.continue_generation()
        thread.join(5)
        assert len(answers[0][0]) == 2 and server.served[-1]["path"] == "/generate"

    @pytest.mark.parametrize("mode", ["abort", "retract"])
    def test_a_request_waiting_on_the_pause_is_aborted_by_a_second_pause_in_abort_mode(self, server, mode):
        """SGLang registers a request before it waits on the pause, so an abort of every request
        (a pause in "abort" mode) reaches it: at the continue it is answered 400, never served.
        A pause in "retract" mode leaves it waiting; it is served after the continue."""
        sglang = client(server)
        sglang.pause_generation("abort")
        answers = []

        def send() -> None:
            try:
                answers.append(sglang.generate([[1]], max_new_tokens=2))
            except SGLangServerError as exc:
                answers.append(exc.fields["status"])

        thread = threading.Thread(target=send)
        thread.start()
        time.sleep(0.2)
        sglang.pause_generation(mode)
        sglang.continue_generation()
        thread.join(5)
        if mode == "abort":
            assert answers == [400] and len(server.aborted) == 1 and not server.served
        else:
            assert len(answers[0][0]) == 2 and not server.aborted and server.served

    def test_health_generate_while_paused_answers_503_without_reaching_the_scheduler(self, server):
        sglang = client(server)
        sglang.release_memory_occupation(None)
        sglang.pause_generation("abort")
        with pytest.raises(SGLangServerError) as unhealthy:
            sglang._request("GET", "/health_generate", None)
        assert unhealthy.value.fields["status"] == 503 and server.alive

    def test_weights_are_labelled_by_the_version_written_into_them(self, server):
        sglang = client(server)
        sglang.release_memory_occupation(None)
        assert set(server.labels.values()) == {"garbage"}
        sglang.resume_memory_occupation(["weights"])
        if server.version >= "0.5.23":
            sglang._request("POST", "/begin_weight_update", {})
        body = {"serialized_named_tensors": [encode_names(["embed"])], "weight_version": "3"}
        sglang._request("POST", "/update_weights_from_tensor", body)
        assert server.labels["embed"] == "3" and server.labels["lm_head"] == "garbage"
        assert sglang.served_weight_version() == "3"

    def test_every_request_the_tests_send_is_one_the_pinned_server_routes(self, server, sglang_tree):
        sglang = client(server)
        sglang.pause_generation("retract")
        sglang.flush_cache()
        sglang.release_memory_occupation(["kv_cache", "cuda_graph"])
        sglang.resume_memory_occupation(["kv_cache", "cuda_graph"])
        sglang.continue_generation()
        sglang.queued_requests()
        sglang.served_weight_version()
        problems = [request_problem(sglang_tree, m, p, b) for m, p, b in server.requests]
        assert server.requests and not [p for p in problems if p], problems

    def test_a_route_the_version_lacks_is_a_404(self, server):
        sglang = client(server)
        if server.version >= "0.5.23":
            with pytest.raises(SGLangServerError) as missing:
                sglang._request("GET", "/get_weight_version", None)
            assert missing.value.fields["status"] == 404
        else:
            with pytest.raises(SGLangServerError, match="deprecated"):
                sglang._request("GET", "/get_weight_version", None)


def test_the_router_forwards_to_a_registered_server_and_answers_503_without_one(server):
    router = FakeRouter()
    try:
        import json
        import urllib.error
        import urllib.request

        def post():
            data = json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).encode()
            request = urllib.request.Request(f"{router.url}/generate", data=data, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return reply.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert post() == 503
        router._add(server.url, "regular")
        assert post() == 200 and router.routed[-1] == (server.url, 200)
    finally:
        router.close()

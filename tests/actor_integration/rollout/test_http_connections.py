"""`Connections`: kept-alive HTTP/1.1 connections, against a real local HTTP server."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from actor_integration.rollout import http_connections
from actor_integration.rollout.http_connections import Connections


class Server:
    """Answers every request with its path; records each request with the client's port.

    `idle_close_s`: close a kept-alive connection idle that long (uvicorn's keep-alive timeout);
    `drop`: read requests on these paths and close the connection unanswered; `hold`: paths whose
    answer waits until the event is set; `http10`: answer HTTP/1.0 (the connection closes)."""

    def __init__(self, *, idle_close_s: float | None = None, http10: bool = False) -> None:
        self.requests: list[tuple[int, str, str, bytes]] = []  # (client port, method, path, body)
        self.drop: set[str] = set()
        self.hold: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0" if http10 else "HTTP/1.1"
            timeout = idle_close_s

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with server.lock:
                    server.requests.append((self.client_address[1], self.command, self.path, body))
                if self.path in server.drop:
                    self.close_connection = True
                    return
                gate = server.hold.get(self.path)
                if gate is not None:
                    gate.wait(10)
                data = self.path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # type: ignore[method-assign]  # a client gone
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def ports(self) -> set[int]:
        with self.lock:
            return {port for port, *_ in self.requests}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server()
    yield server
    server.close()


def get(connections: Connections, path: str = "/x", timeout: float = 5.0) -> tuple[int, bytes]:
    return connections.request("GET", path, None, {}, timeout)


def test_back_to_back_requests_share_one_connection(server: Server) -> None:
    connections = Connections(server.url)
    answers = [get(connections, f"/{i}") for i in range(5)]
    assert answers == [(200, f"/{i}".encode()) for i in range(5)]
    assert connections.opened == 1 and len(server.ports()) == 1


def test_every_request_asks_for_quick_acks_after_it_is_sent_and_before_the_answer_is_read(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it a kept-alive connection waits up to 40 ms for a server that writes headers and
    body apart (Python's http.server, this test's server, does): see `_ack_at_once`."""
    asked: list[int] = []  # the socket's fd at each call

    def record(connection: http.client.HTTPConnection) -> None:
        assert connection.sock is not None
        deadline = time.monotonic() + 5
        while len(server.requests) <= len(asked):  # this request must be on the wire already
            assert time.monotonic() < deadline, "asked for quick acks before the request was sent"
            time.sleep(0.001)
        asked.append(connection.sock.fileno())

    monkeypatch.setattr(http_connections, "_ack_at_once", record)
    connections = Connections(server.url)
    assert [get(connections, f"/{i}")[0] for i in range(3)] == [200, 200, 200]
    assert len(asked) == 3 and len(server.requests) == 3  # once per request
    assert len(set(asked)) == 1  # on the one kept-alive connection


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
def test_the_quick_ack_option_is_set_on_the_connections_tcp_socket(server: Server) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=5)
    connection.connect()
    assert connection.sock is not None
    http_connections._ack_at_once(connection)
    assert connection.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
    connection.close()


def test_a_post_body_arrives_whole_and_the_prefix_leads_every_path(server: Server) -> None:
    connections = Connections(server.url + "/api/")
    assert connections.request(
        "POST", "/release", b'{"tags": null}', {"Content-Type": "application/json"}, 5
    ) == (
        200,
        b"/api/release",
    )
    assert server.requests[-1][1:] == ("POST", "/api/release", b'{"tags": null}')


def test_a_connection_idle_longer_than_idle_s_is_not_reused(server: Server) -> None:
    connections = Connections(server.url, idle_s=0.05)
    get(connections)
    time.sleep(0.15)
    get(connections)
    assert connections.opened == 2 and len(server.ports()) == 2


def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_request_sent_once() -> None:
    server = Server(idle_close_s=0.1)  # the server drops kept-alive connections idle 0.1 s
    try:
        connections = Connections(server.url, idle_s=10.0)
        get(connections, "/first")
        time.sleep(0.4)
        assert get(connections, "/second") == (200, b"/second")
        assert [path for _, _, path, _ in server.requests] == ["/first", "/second"]
        assert connections.opened == 2
    finally:
        server.close()


def test_an_http10_server_gets_a_new_connection_per_request() -> None:
    server = Server(http10=True)
    try:
        connections = Connections(server.url)
        assert [get(connections, f"/{i}")[0] for i in range(3)] == [200, 200, 200]
        assert connections.opened == 3
    finally:
        server.close()


def test_a_request_the_server_drops_unanswered_is_an_error_and_is_never_sent_again(server: Server) -> None:
    connections = Connections(server.url)
    get(connections, "/warm")  # the next request goes on a kept-alive connection
    server.drop.add("/release_memory_occupation")
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        connections.request("POST", "/release_memory_occupation", b"{}", {}, 5)
    assert [path for _, _, path, _ in server.requests].count("/release_memory_occupation") == 1
    assert get(connections, "/after") == (200, b"/after")
    assert connections.opened == 2


def test_concurrent_requests_each_get_a_connection(server: Server) -> None:
    connections = Connections(server.url)
    gate = threading.Event()
    server.hold["/slow"] = gate
    answers: list[tuple[int, bytes]] = []
    slow = threading.Thread(target=lambda: answers.append(get(connections, "/slow")), daemon=True)
    slow.start()
    deadline = time.monotonic() + 5
    while not any(path == "/slow" for _, _, path, _ in list(server.requests)) and time.monotonic() < deadline:
        time.sleep(0.005)
    answers.append(get(connections, "/fast"))  # answered while /slow is held on the other connection
    gate.set()
    slow.join(5)
    assert answers == [(200, b"/fast"), (200, b"/slow")]
    assert connections.opened == 2 and len(server.ports()) == 2
    assert get(connections, "/again") == (200, b"/again") and connections.opened == 2


def test_a_timeout_is_raised_and_its_connection_not_reused(server: Server) -> None:
    connections = Connections(server.url)
    gate = threading.Event()
    server.hold["/hung"] = gate
    try:
        with pytest.raises(TimeoutError):
            get(connections, "/hung", timeout=0.2)
    finally:
        gate.set()
    assert get(connections, "/after") == (200, b"/after") and connections.opened == 2


def test_a_closed_port_is_connection_refused() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        get(Connections(f"http://127.0.0.1:{port}"))


def test_close_drops_the_idle_connections(server: Server) -> None:
    connections = Connections(server.url)
    get(connections)
    connections.close()
    get(connections)
    assert connections.opened == 2


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "ftp://host:1", "http://"])
def test_a_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        Connections(url)

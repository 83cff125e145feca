"""The lifecycle's HTTP requests: a fresh connection per request against `Connections` (kept alive).

    python benchmarks/bench_http_connections.py [--rounds 200] [--out results.json]

A wrapped slime or miles engine actor sleeps with the router's leave (GET /workers, then DELETE
/workers/{id}) and wakes with its join (POST /workers), beside the server's own requests. Each
column is the median ms of one such request in this run, against local servers of both kinds:

- `nagle`: Python's `http.server` (the suite's FakeRouter) writes an answer's headers and its body
  apart, without TCP_NODELAY, so a client that delays its acknowledgements waits for the body;
- `nodelay`: the same server with TCP_NODELAY on its connections (uvicorn, SGLang's HTTP server,
  sets it).

Ways: `fresh` opens a connection per request (urllib, what the wrap did before and what slime's
`requests` calls do); `kept` is `Connections`; `kept-no-quickack` is `Connections` with its
TCP_QUICKACK turned off, the case `_ack_at_once` guards against. Target: `kept` no slower than
`fresh` on either server (printed as the ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actor_integration.rollout import http_connections
from actor_integration.rollout.http_connections import Connections
from tests.helpers.sglang_server import FakeRouter

Request = Callable[[str, str, bytes | None], int]  # (method, path, body) -> status


def fresh(url: str) -> Request:
    def send(method: str, path: str, body: bytes | None) -> int:
        request = urllib.request.Request(url + path, data=body, method=method)
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
            return int(reply.status)

    return send


def kept(url: str) -> Request:
    connections = Connections(url)

    def send(method: str, path: str, body: bytes | None) -> int:
        return connections.request(method, path, body, {"Content-Type": "application/json"}, 10)[0]

    return send


@contextmanager
def no_quickack() -> Iterator[None]:
    saved = http_connections._QUICKACK
    http_connections._QUICKACK = None
    try:
        yield
    finally:
        http_connections._QUICKACK = saved


@contextmanager
def router(nodelay: bool) -> Iterator[FakeRouter]:
    fake = FakeRouter()
    # StreamRequestHandler's switch: TCP_NODELAY on each accepted connection (uvicorn sets it too)
    fake.httpd.RequestHandlerClass.disable_nagle_algorithm = nodelay  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        fake.close()


def cycle_ms(send: Request, rounds: int) -> dict[str, float]:
    """Median ms of the leave's GET and DELETE and the join's POST, over `rounds` leave + join."""
    times: dict[str, list[float]] = {"GET /workers": [], "DELETE /workers/{id}": [], "POST /workers": []}
    body = json.dumps({"url": "http://127.0.0.1:1"}).encode()
    for i in range(rounds + 5):
        t0 = time.perf_counter()
        assert send("POST", "/workers", body) < 300
        t1 = time.perf_counter()
        assert send("GET", "/workers", None) == 200
        t2 = time.perf_counter()
        assert send("DELETE", f"/workers/w{i}", None) < 300
        t3 = time.perf_counter()
        if i >= 5:  # warm-up left out
            times["POST /workers"].append((t1 - t0) * 1e3)
            times["GET /workers"].append((t2 - t1) * 1e3)
            times["DELETE /workers/{id}"].append((t3 - t2) * 1e3)
    return {name: round(statistics.median(ms), 3) for name, ms in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    worst = 0.0
    for server in ("nagle", "nodelay"):
        results[server] = {}
        for way in ("fresh", "kept", "kept-no-quickack"):
            with router(nodelay=server == "nodelay") as fake:
                if way == "kept-no-quickack":
                    with no_quickack():
                        results[server][way] = cycle_ms(kept(fake.url), args.rounds)
                else:
                    make = fresh if way == "fresh" else kept
                    results[server][way] = cycle_ms(make(fake.url), args.rounds)
        print(f"{server} server (median ms per request, {args.rounds} leave + join rounds):")
        for name in results[server]["fresh"]:
            row = {way: results[server][way][name] for way in results[server]}
            ratio = row["kept"] / row["fresh"]
            worst = max(worst, ratio)
            cells = "  ".join(f"{way} {ms:7.3f}" for way, ms in row.items())
            print(f"  {name:22s} {cells}   kept/fresh {ratio:.2f} (target <= 1)")
    print(f"worst kept/fresh ratio: {worst:.2f} ({'met' if worst <= 1 else 'MISSED'})")
    if args.out:
        args.out.write_text(json.dumps({"ms": results, "worst_kept_over_fresh": round(worst, 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`RolloutEngine` over an SGLang server's HTTP endpoints (the deployment slime and miles use).

The requests themselves use the standard library's `http.client` (kept-alive connections from
`rollout.http_connections`); the module is not standard-library only: the class shares the
offline adapter's weight handling (`engine.SGLangWeights`, which imports torch) and the scheduler
calls (`scheduler`), and is the server-actor lifecycle's `ServerClient`. Every request has a
timeout, and every failure is typed: the server
answered with an error status (`SGLangServerError`, with the status and SGLang's message), could
not be reached (`SGLangServerError`, status None), or did not answer in time
(`SGLangServerTimeout`). A refused flush is not an error: `/flush_cache` answers 400 while
requests remain, and `flush_cache()` returns False then, as the offline adapter does.

Weights go through `/update_weights_from_tensor` in the flattened-bucket format, one base64
payload per TP rank (CUDA IPC handles inside: the server must be on the trainer's node). With
`scheduler_receiver=True` (a server started with
`--custom-weight-loader actor_integration.engines.sglang.receiver.receive`) a round goes to the
server's schedulers unopened instead (`LoadsPayloads`, as `SGLangEngine` does): each scheduler opens
the trainer's staging buffers itself, verifies them and loads through SGLang's weight loaders, in
one call per round; this process then never maps the trainer's memory.
Written against the SGLang pinned in pyproject's `sglang` extra; CI checks every route, method
and JSON field against that version's server source (test_sglang_http.py).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from actor_integration.engines.sglang.engine import Codec, SGLangWeights, version_tuple
from actor_integration.engines.sglang.scheduler import (
    SCHEDULER_LOADER,
    SchedulerReceiverCalls,
    reply_directory,
)
from actor_integration.errors import SGLangServerError, SGLangServerTimeout
from actor_integration.rollout.engine import GENERATION_MODES
from actor_integration.rollout.http_connections import Connections, answer_text, decode_answer


class SGLangHTTPEngine(SchedulerReceiverCalls, SGLangWeights):
    """Adapts a running SGLang server (`python -m sglang.launch_server`) to `RolloutEngine`.

    `scheduler_receiver=True` asks the server (`/server_info`) whether it lists the lifecycle's
    receiver in `custom_weight_loader` and starts it in every scheduler (`ValueError` naming the
    flag to add if not); `serialize_names` replaces SGLang's serializer for the receiver's calls
    (tests without sglang)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        weights_timeout_s: float = 600.0,
        api_key: str | None = None,
        codec: Codec | None = None,
        multi_dtype_buckets: bool | None = None,
        scheduler_receiver: bool = False,
        serialize_names: Callable[[Sequence[str]], Any] | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"SGLangHTTPEngine: url must be http(s)://host:port, got {url!r}")
        if timeout_s <= 0 or weights_timeout_s <= 0:
            raise ValueError(
                f"SGLangHTTPEngine: timeouts must be positive, got {timeout_s!r} and {weights_timeout_s!r}"
            )
        super().__init__(codec, multi_dtype_buckets)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.weights_timeout_s = weights_timeout_s
        # Kept-alive connections, no proxies: the server sits next to the actor, not behind a proxy.
        self._http = Connections(self.url)
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.call_timeout_s = timeout_s
        self.scheduler_receiver = False
        self.tp_size = 1
        self.scheduler_pids: list[int] = []
        self._names_serializer = serialize_names
        self._calls = itertools.count()
        self._reply_dir = Path(".")
        self._kv_resident = True  # as this client's own releases and resumes left it
        self._sessions = False  # SGLang 0.5.23's weight-update sessions (asked with the receiver)
        if scheduler_receiver:
            self._start_scheduler_receiver()

    def close(self) -> None:
        """Close the kept-alive connections to the server (a later request opens a new one)."""
        self._http.close()

    def _start_scheduler_receiver(self) -> None:
        _status, info = self._request("GET", "/server_info", None)
        info = info if isinstance(info, dict) else {}
        loaders = list(info.get("custom_weight_loader") or [])
        if SCHEDULER_LOADER not in loaders:
            raise ValueError(
                f"SGLangHTTPEngine(scheduler_receiver=True): the server at {self.url} was not started with the "
                f"lifecycle's receiver (its custom_weight_loader is {loaders}); start it with "
                f"--custom-weight-loader {SCHEDULER_LOADER} (the slime and miles wraps add it themselves), "
                "or pass scheduler_receiver=False to send flattened buckets"
            )
        self.tp_size = int(info.get("tp_size") or 1)
        version = str(info.get("version") or "0")
        self._sessions = version_tuple(version) >= (0, 5, 23)
        self._reply_dir = reply_directory("rl-lifecycle-sglang-http-")
        self.scheduler_receiver = True
        self.scheduler_pids = self.scheduler_hello()

    # ------------------------------------------------------------------ memory and generation

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._request("POST", "/release_memory_occupation", {"tags": None if tags is None else list(tags)})
        if tags is None or "kv_cache" in tags:
            self._kv_resident = False

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._request("POST", "/resume_memory_occupation", {"tags": None if tags is None else list(tags)})
        if tags is None or "kv_cache" in tags:
            self._kv_resident = True

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in GENERATION_MODES:
            raise ValueError(f"pause_generation: mode must be one of {list(GENERATION_MODES)}, got {mode!r}")
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    def flush_cache(self) -> bool:
        """True when flushed; False when the server refused because requests remain (400)."""
        status, _body = self._request("POST", "/flush_cache", None, refused_ok=True)
        return status == 200

    def queued_requests(self) -> dict[str, int]:
        """Running and waiting requests over the data-parallel ranks, as the schedulers last published them."""
        _status, body = self._request("GET", "/v1/loads?include=core", None)
        loads = body.get("loads", []) if isinstance(body, dict) else []
        return {
            "running": sum(int(load.get("num_running_reqs", 0)) for load in loads),
            "waiting": sum(int(load.get("num_waiting_reqs", 0)) for load in loads),
        }

    def served_weight_version(self) -> str | None:
        """The weight version the server reports (`/model_info`; `/get_weight_version` where that
        route still answers: SGLang 0.5.17 answers it with 404 and points to /model_info)."""
        try:
            _status, body = self._request("GET", "/model_info", None)
        except SGLangServerError as exc:
            if exc.fields.get("status") != 404:
                raise
            _status, body = self._request("GET", "/get_weight_version", None)
        version = body.get("weight_version") if isinstance(body, dict) else None
        return None if version is None else str(version)

    def alive(self) -> None:
        """Raise `SGLangServerError` / `SGLangServerTimeout` unless the server answers `/model_info`,
        which touches no scheduler memory (a generation, `/health_generate` too, reads the KV cache)."""
        self._request("GET", "/model_info", None)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 8) -> list[list[int]]:
        self._refuse_mixed("SGLangHTTPEngine")
        _status, outputs = self._request(
            "POST",
            "/generate",
            {
                "input_ids": [list(p) for p in prompts],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            },
        )
        if isinstance(outputs, dict):  # a batch of one may come back unwrapped
            outputs = [outputs]
        return [list(out["output_ids"]) for out in outputs]

    # ------------------------------------------------------------------ weights

    def _update(self, payloads: list[Any], *, version: int, last: bool) -> None:
        body: dict[str, Any] = {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": last,
        }
        if last:
            body["weight_version"] = str(version)
        status, answer = self._request(
            "POST", "/update_weights_from_tensor", body, refused_ok=True, timeout_s=self.weights_timeout_s
        )
        if status != 200 or not (isinstance(answer, dict) and answer.get("success")):
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise SGLangServerError(
                f"SGLang at {self.url} refused weight version {version}: {message}; the previous weights "
                "stay loaded if this was the version's first call, otherwise load the whole version again",
                method="POST",
                path="/update_weights_from_tensor",
                status=status,
                answer=str(message),
            )

    # ------------------------------------------------------------------ the scheduler-side receiver

    def _send_update(
        self, payloads: list[Any], *, load_format: str, ends_version: int | None, timeout_s: float, what: str
    ) -> None:
        """One `/update_weights_from_tensor` call of the receiver; the call that ends a version tags
        the server with it and flushes the radix cache where the KV cache is resident."""
        body: dict[str, Any] = {
            "serialized_named_tensors": payloads,
            "load_format": load_format,
            "flush_cache": ends_version is not None and self._kv_resident,
        }
        if ends_version is not None:
            body["weight_version"] = str(ends_version)
        status, answer = self._request(
            "POST", "/update_weights_from_tensor", body, refused_ok=True, timeout_s=timeout_s
        )
        if status != 200 or not (isinstance(answer, dict) and answer.get("success")):
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise SGLangServerError(
                f"SGLang at {self.url} refused {what}: {message}",
                method="POST",
                path="/update_weights_from_tensor",
                status=status,
                answer=str(message),
            )

    def _serialize_names(self, names: Sequence[str]) -> Any:
        if self._names_serializer is not None:
            return self._names_serializer(names)
        import torch
        from sglang.srt.utils import MultiprocessingSerializer

        # An empty tensor pickles without shared memory; over HTTP the payload is base64 text.
        return MultiprocessingSerializer.serialize([(n, torch.empty(0)) for n in names], output_str=True)

    @contextlib.contextmanager
    def _weight_session(self, *, round_index: int, final: bool) -> Iterator[None]:
        """The receiver's calls of a version inside one weight-update session (SGLang 0.5.23's
        `/begin_weight_update` ... `/end_weight_update`; 0.5.17 has none), closed at once on failure."""
        if not self._sessions:
            yield
            return
        if round_index == 0:
            self._session_call("/begin_weight_update")
        try:
            yield
        except BaseException:
            with contextlib.suppress(SGLangServerError):
                self._session_call("/end_weight_update")
            raise
        if final:
            self._session_call("/end_weight_update")

    def _session_call(self, path: str) -> None:
        status, answer = self._request("POST", path, {}, refused_ok=True)
        if status != 200 or not (isinstance(answer, dict) and answer.get("success")):
            raise SGLangServerError(
                f"SGLang at {self.url} refused {path}: {answer_text(answer)}",
                method="POST",
                path=path,
                status=status,
                answer=answer_text(answer),
            )

    def _require_resident(self, what: str, tags: Sequence[str]) -> None:
        pass  # the server does not say; the lifecycle in front of this client guards residency

    def _receiver_gone(self) -> bool:
        return False

    # ------------------------------------------------------------------ HTTP

    def _request(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        refused_ok: bool = False,
        timeout_s: float | None = None,
    ) -> tuple[int, Any]:
        """(status, decoded JSON or text). A 400 is returned when `refused_ok`; other errors raise."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw = self._http.request(method, path, data, self._headers, timeout)
        except TimeoutError as exc:
            raise self._timeout(method, path, timeout) from exc
        except ConnectionRefusedError as exc:
            raise self._unreachable(method, path, exc) from exc
        except (http.client.HTTPException, ConnectionError) as exc:
            # The server closed the connection without an answer: SGLang's process tree is killed
            # when its scheduler dies (the request that killed it gets no response).
            raise SGLangServerError(
                f"SGLang at {self.url} closed the connection on {method} {path} without answering ({exc!r}): "
                "the server died or is shutting down; check its log",
                method=method,
                path=path,
                status=None,
                answer=repr(exc),
            ) from exc
        except OSError as exc:
            raise self._unreachable(method, path, exc) from exc
        answer = decode_answer(raw)
        if 200 <= status < 300 or (refused_ok and status == 400):
            return status, answer
        raise SGLangServerError(
            f"SGLang at {self.url} answered {method} {path} with {status}: {answer_text(answer)}",
            method=method,
            path=path,
            status=status,
            answer=answer_text(answer),
        )

    def _unreachable(self, method: str, path: str, exc: OSError) -> SGLangServerError:
        reason = exc.strerror or repr(exc)
        return SGLangServerError(
            f"SGLang at {self.url} could not be reached for {method} {path}: {reason}; is the server "
            "up (python -m sglang.launch_server) and the URL right?",
            method=method,
            path=path,
            status=None,
            answer=str(reason),
        )

    def _timeout(self, method: str, path: str, timeout: float) -> SGLangServerTimeout:
        return SGLangServerTimeout(
            f"SGLang at {self.url} did not answer {method} {path} within {timeout:.0f} s; the server may be "
            "busy or hung: check its log, or raise the timeout",
            method=method,
            path=path,
            timeout_s=timeout,
            missing=[self.url],
        )


__all__ = ["SGLangHTTPEngine", "SGLangServerError", "SGLangServerTimeout"]

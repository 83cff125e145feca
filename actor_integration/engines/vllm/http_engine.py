"""`RolloutEngine` over a vLLM server (`vllm serve --enable-sleep-mode`, `VLLM_SERVER_DEV_MODE=1`).

No vLLM and, in this module, nothing but the standard library (the kept-alive connections come from
`rollout.http_connections`, whose package still loads torch today): every request has a timeout, and every failure is typed:
the server answered with an error status (`VLLMServerError`, with the status and vLLM's text),
could not be reached (`VLLMServerError`, status None), or did not answer in time
(`VLLMServerTimeout`). The routes are vLLM 0.26.0's dev routes (`/sleep?level=&mode=`,
`/wake_up?tags=`, `/is_sleeping`, `/pause?mode=`, `/resume`, `/is_paused`, `/reset_prefix_cache`,
`/collective_rpc`, the weight-transfer routes) and `/v1/completions` with `return_token_ids`;
CI checks each route, method and field against that wheel's source.

Weights: through vLLM's IPC weight transfer (`--weight-transfer-config '{"backend": "ipc"}'`; the
handles travel pickled, so the server needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, as vLLM's own
HTTP sender does), or, with `worker_receiver=True` and a server started with
`--worker-extension-cls actor_integration.engines.vllm.worker.LifecycleWorkerExtension`, unopened
to the workers (`LoadsPayloads`). Either way the server must be on the trainer's node.
"""

from __future__ import annotations

import base64
import http.client
import json
import pickle
import urllib.parse
from typing import Any

from actor_integration.engines.vllm.base import IpcSender, VLLMAdapter
from actor_integration.errors import EngineNotIdleError, VLLMServerError, VLLMServerTimeout
from actor_integration.rollout.http_connections import Connections, answer_text, decode_answer

VLLM_ANSWER_KEYS = ("error", "detail", "message")  # vLLM also answers {"error": "text"}


class VLLMHTTPEngine(VLLMAdapter):
    """Adapts a running vLLM server to `RolloutEngine`. `model`: the served model's name (None: the
    first of `/v1/models`)."""

    def __init__(
        self,
        url: str,
        *,
        sleep_level: int = 2,
        worker_receiver: bool = False,
        model: str | None = None,
        timeout_s: float = 60.0,
        weights_timeout_s: float = 600.0,
        api_key: str | None = None,
        ipc_sender: IpcSender | None = None,
        packed: bool = True,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"VLLMHTTPEngine: url must be http(s)://host:port, got {url!r}")
        if timeout_s <= 0 or weights_timeout_s <= 0:
            raise ValueError(
                f"VLLMHTTPEngine: timeouts must be positive, got {timeout_s!r} and {weights_timeout_s!r}"
            )
        super().__init__(
            sleep_level=sleep_level, worker_receiver=worker_receiver, ipc_sender=ipc_sender, packed=packed
        )
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.weights_timeout_s = weights_timeout_s
        self._http = Connections(self.url)
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._model = model
        try:
            sleeping = self.is_sleeping()
        except VLLMServerError as exc:
            if exc.fields.get("status") != 404:
                raise
            raise ValueError(
                f"VLLMHTTPEngine: {self.url} has no /is_sleeping: start the server with "
                "`VLLM_SERVER_DEV_MODE=1 vllm serve ... --enable-sleep-mode`"
            ) from exc
        if sleeping:
            # Asleep before we came (or only paused: vLLM's /is_sleeping counts a paused scheduler as
            # asleep, and no route tells the two apart). Every tag counts as asleep, so the first
            # wake is wake_up(None); vLLM's executor ignores it, with a warning, where nothing slept.
            self.guard.released()
        if worker_receiver:
            self.workers = self._rpc("lifecycle_hello", "{}")

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ what the server says

    def is_sleeping(self) -> bool:
        _status, body = self._request("GET", "/is_sleeping", None)
        return bool(isinstance(body, dict) and body.get("is_sleeping"))

    def is_paused(self) -> bool:
        _status, body = self._request("GET", "/is_paused", None)
        return bool(isinstance(body, dict) and body.get("is_paused"))

    def alive(self) -> None:
        """Raise `VLLMServerError` / `VLLMServerTimeout` unless `/health` answers (it touches no KV cache)."""
        self._request("GET", "/health", None)

    def served_weight_version(self) -> str | None:
        """The last whole version the workers loaded through the lifecycle's receiver, as they say it
        (one answer for every worker); None without the worker extension: vLLM keeps no version."""
        if not self.worker_receiver:
            return None
        versions = {r.get("weight_version") for r in self._rpc("lifecycle_hello", "{}")}
        version = versions.pop() if len(versions) == 1 else None
        return None if version is None else str(version)

    def _check_idle(self) -> None:
        if not self._paused and not self.is_paused():
            raise EngineNotIdleError(
                f"VLLMHTTPEngine: {self.url} is serving (not paused); sleeping under live requests is an "
                "illegal memory access (vllm #28714, #27901). Pause generation first (the rollout's sleep does).",
                queued=None,
            )

    # ------------------------------------------------------------------ vLLM's routes

    def _sleep(self, level: int, mode: str) -> None:
        self._request("POST", "/sleep?" + urllib.parse.urlencode({"level": level, "mode": mode}), None)

    def _wake(self, tags: list[str] | None) -> None:
        query = "" if tags is None else "?" + urllib.parse.urlencode([("tags", t) for t in tags])
        self._request("POST", "/wake_up" + query, None)

    def _pause(self, mode: str) -> None:
        self._request("POST", "/pause?" + urllib.parse.urlencode({"mode": mode}), None)

    def _resume(self) -> None:
        self._request("POST", "/resume", None)

    def _reset_prefix_cache(self) -> bool:
        _status, body = self._request("POST", "/reset_prefix_cache", None)
        return bool(isinstance(body, dict) and body.get("success"))

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        body = {
            "model": self._served_model(),
            "prompt": prompts,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        _status, answer = self._request("POST", "/v1/completions", body)
        choices = sorted(answer.get("choices", []), key=lambda c: int(c.get("index", 0)))
        if len(choices) != len(prompts) or any(c.get("token_ids") is None for c in choices):
            raise VLLMServerError(
                f"vLLM at {self.url} answered {len(prompts)} prompt(s) with {len(choices)} choice(s) without "
                "token ids all there; is it vLLM >= 0.26 (return_token_ids)?",
                method="POST",
                path="/v1/completions",
                status=200,
                answer=str(answer)[:200],
            )
        return [list(c["token_ids"]) for c in choices]

    def _served_model(self) -> str:
        if self._model is None:
            _status, body = self._request("GET", "/v1/models", None)
            self._model = str(body["data"][0]["id"])
        return self._model

    def _rpc(self, method: str, request: str) -> list[dict[str, Any]]:
        body = {"method": method, "args": [request], "timeout": self.weights_timeout_s}
        _status, answer = self._request("POST", "/collective_rpc", body, timeout_s=self.weights_timeout_s)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise VLLMServerError(
                f"vLLM at {self.url} answered collective_rpc({method}) without a dict per worker ({answer!r:.200}); "
                f"was the server started with --worker-extension-cls {self._extension()}?",
                method="POST",
                path="/collective_rpc",
                status=200,
                answer=str(answer)[:200],
            )
        return results

    @staticmethod
    def _extension() -> str:
        from actor_integration.engines.vllm.worker import WORKER_EXTENSION

        return WORKER_EXTENSION

    def _start_update(self) -> None:
        self._request("POST", "/start_weight_update", None)

    def _update(self, update_info: dict[str, Any]) -> None:
        self._request(
            "POST", "/update_weights", {"update_info": update_info}, timeout_s=self.weights_timeout_s
        )

    def _finish_update(self) -> None:
        self._request("POST", "/finish_weight_update", None, timeout_s=self.weights_timeout_s)

    def _ipc_update_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """vLLM's HTTP form: the handles pickled and base64-encoded (`ipc_handles_pickled`)."""
        handles = info.pop("ipc_handles", None)
        if handles is not None:
            info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
        return info

    # ------------------------------------------------------------------ HTTP

    def _request(
        self, method: str, path: str, body: Any, *, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw = self._http.request(method, path, data, self._headers, timeout)
        except TimeoutError as exc:
            raise VLLMServerTimeout(
                f"vLLM at {self.url} did not answer {method} {path} within {timeout:.0f} s; the server may be "
                "busy or hung (a dead EngineCore leaves the server up: vllm #57853): check its log",
                method=method,
                path=path,
                timeout_s=timeout,
                missing=[self.url],
            ) from exc
        except (http.client.HTTPException, OSError) as exc:
            raise VLLMServerError(
                f"vLLM at {self.url} could not be reached or closed the connection on {method} {path} "
                f"({exc!r}); is the server up and the URL right?",
                method=method,
                path=path,
                status=None,
                answer=repr(exc),
            ) from exc
        answer = decode_answer(raw)
        if 200 <= status < 300:
            return status, answer
        raise VLLMServerError(
            f"vLLM at {self.url} answered {method} {path} with {status}: {answer_text(answer, VLLM_ANSWER_KEYS)}",
            method=method,
            path=path,
            status=status,
            answer=answer_text(answer, VLLM_ANSWER_KEYS),
        )


__all__ = ["VLLMHTTPEngine"]

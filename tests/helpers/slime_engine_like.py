"""A slime-shaped `SGLangEngine` (the rollout actor), for CI where slime's source is not reachable.

`SlimeLikeEngine` has the method names, arguments, HTTP calls and return values of slime
624b824a's `slime/backends/sglang_utils/sglang_engine.py` (written from that interface, not
copied): `init` launches a server (an in-process `FakeSGLangServer`, as `engine_source`'s
in-process launch does) and registers it with the router; a follower (`node_rank != 0`) sends
nothing and answers None; `release_memory_occupation` flushes (60 tries, a second apart) and
releases every tag; the others are one request each. The source suite runs the same tests on
slime's own class.
"""

from __future__ import annotations

import time
import types
from typing import Any

import requests

from tests.helpers.sglang_server import FakeSGLangServer

SERVERS: dict[int, FakeSGLangServer] = {}  # what `init` launched, by a stand-in pid


class SlimeLikeEngine:
    def __init__(
        self,
        args: Any,
        rank: int,
        worker_type: str = "regular",
        base_gpu_id: int | None = None,
        sglang_overrides: dict[str, Any] | None = None,
        num_gpus_per_engine: int | None = None,
    ) -> None:
        self.args, self.rank, self.worker_type = args, rank, worker_type
        self.num_gpus_per_engine = num_gpus_per_engine

    def init(
        self,
        dist_init_addr: str,
        port: int,
        nccl_port: int,
        host: str | None = None,
        disaggregation_bootstrap_port: int | None = None,
        router_ip: str | None = None,
        router_port: int | None = None,
    ) -> None:
        self.router_ip = router_ip if router_ip is not None else self.args.sglang_router_ip
        self.router_port = router_port if router_port is not None else self.args.sglang_router_port
        gpus = self.num_gpus_per_engine or self.args.rollout_num_gpus_per_engine
        nnodes = max(1, gpus // self.args.num_gpus_per_node)
        server_args = {
            "host": host or "127.0.0.1",
            "port": port,
            "node_rank": self.rank % nnodes,
            "nnodes": nnodes,
            "dist_init_addr": dist_init_addr,
            "enable_memory_saver": self.args.offload_rollout,
            "api_key": None,
        }
        self.node_rank = server_args["node_rank"]
        self.server_host, self.server_port = server_args["host"], server_args["port"]
        self._init_normal(server_args)

    def _init_normal(self, server_args_dict: dict[str, Any]) -> None:
        server = FakeSGLangServer(
            host=server_args_dict["host"],
            port=int(server_args_dict["port"]),
            custom_weight_loader=server_args_dict.get("custom_weight_loader"),
        )
        pid = -len(SERVERS) - 1
        SERVERS[pid] = server
        self.process = types.SimpleNamespace(pid=pid, is_alive=lambda: server.alive)
        if self.node_rank == 0:
            while (
                requests.get(f"http://{self.server_host}:{self.server_port}/health_generate").status_code
                != 200
            ):
                time.sleep(2)
        self._register_to_router(server_args_dict)

    def _register_to_router(self, server_args_dict: dict[str, Any]) -> None:
        if self.node_rank == 0 and self.router_ip and self.router_port:
            payload = {
                "url": f"http://{self.server_host}:{self.server_port}",
                "worker_type": self.worker_type,
            }
            requests.post(
                f"http://{self.router_ip}:{self.router_port}/workers", json=payload
            ).raise_for_status()

    def _make_request(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        if self.node_rank != 0:
            return None
        response = requests.post(
            f"http://{self.server_host}:{self.server_port}/{endpoint}", json=payload or {}
        )
        response.raise_for_status()
        return response.json()

    def health_generate(self, timeout: float = 5.0) -> bool:
        if self.node_rank != 0:
            return True
        requests.get(
            f"http://{self.server_host}:{self.server_port}/health_generate", timeout=timeout
        ).raise_for_status()
        return True

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> Any:
        payload: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_tensor", payload)

    def flush_cache(self) -> None:
        if self.node_rank != 0:
            return
        for _ in range(60):
            try:
                if (
                    requests.get(f"http://{self.server_host}:{self.server_port}/flush_cache").status_code
                    == 200
                ):
                    break
                time.sleep(1)
            except Exception:  # slime catches requests' ConnectionError here and retries
                time.sleep(1)
        else:
            raise TimeoutError("Timeout while flushing cache.")

    def shutdown(self) -> None:
        if self.node_rank == 0 and self.router_ip:
            url = f"http://{self.server_host}:{self.server_port}"
            try:
                workers = requests.get(f"http://{self.router_ip}:{self.router_port}/workers").json()[
                    "workers"
                ]
                for worker in workers:
                    if worker["url"] == url:
                        requests.delete(f"http://{self.router_ip}:{self.router_port}/workers/{worker['id']}")
            except Exception:
                pass
        server = SERVERS.pop(self.process.pid, None)
        if server is not None:
            server.close()

    def get_weight_version(self) -> Any:
        if self.node_rank != 0:
            return None
        response = requests.get(f"http://{self.server_host}:{self.server_port}/get_weight_version")
        response.raise_for_status()
        return response.json()["weight_version"]

    def release_memory_occupation(self) -> Any:
        self.flush_cache()
        return self._make_request("release_memory_occupation")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._make_request("resume_memory_occupation", {"tags": tags})

    def check_weights(self, action: str) -> Any:
        return self._make_request("weights_checker", {"action": action})

    def pause_generation(self) -> Any:
        if self.node_rank != 0:
            return None
        response = requests.post(f"http://{self.server_host}:{self.server_port}/pause_generation", json={})
        response.raise_for_status()
        return response

    def continue_generation(self) -> Any:
        if self.node_rank != 0:
            return None
        response = requests.post(f"http://{self.server_host}:{self.server_port}/continue_generation", json={})
        response.raise_for_status()
        return response

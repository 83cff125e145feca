"""The demo's trainer: a plain torch trainer with slime's method names, wrapped by `LifecycleMixin`.

`TinyTrainer` is the "existing actor class" a framework already has (its bodies know nothing of
the lifecycle); `DemoTrainer` adds the mixin and wires the real backends: torch_memory_saver on a
GPU (NoopMemory on a CPU), reloadable process groups (NCCL or gloo), clear-memory, the CPU weight
backup with its model-tag switch, and the weight sender.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from actor_integration.actors.cluster import here
from actor_integration.actors.mixin import LifecycleMixin
from actor_integration.backends.clear_memory import ClearMemory
from actor_integration.backends.memory_budget import DeviceMemoryProbe
from actor_integration.backends.memory_saver import select_memory_backend
from actor_integration.backends.model_tag import CpuWeightBackup, ModelTagSwitch
from actor_integration.backends.process_groups import ReloadableProcessGroups
from actor_integration.models.qwen2 import QwenConfig, QwenLM
from actor_integration.models.tiny import TinyLM, TinyLMConfig, weights_checksum
from actor_integration.tools.demo.options import TRAINER_POLICY
from actor_integration.weight_sync import SlotTopology, WeightSender, configure_sender, probe_cuda_ipc
from actor_integration.weight_sync.buckets import WSUM64, WSUM64_DEVICE
from lifecycle import Hooks, MemoryBudget, configure_logging, flush_logs
from lifecycle.faults import FaultInjector, with_faults


class TinyTrainer:
    """A data-parallel trainer of `TinyLM` with slime's names: train, save_model, update_weights."""

    rank: int
    world_size: int
    out: Path
    device: torch.device
    model: TinyLM | QwenLM
    optimizer: torch.optim.Optimizer
    memory: Any
    groups: ReloadableProcessGroups
    backup: CpuWeightBackup
    sender: WeightSender

    def _train_step(self, samples: list[list[int]]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for tokens in samples:
            seq = torch.tensor(tokens, dtype=torch.long, device=self.device)
            logits = self.model(seq[:-1])
            total = total + F.cross_entropy(logits.float(), seq[1:])
        loss = total / len(samples)
        loss.backward()  # type: ignore[no-untyped-call]
        world = self.groups.world
        for p in self.model.parameters():  # data parallel: average the gradients
            if p.grad is not None:
                dist.all_reduce(p.grad, group=world)
                p.grad /= self.world_size
        self.optimizer.step()
        return float(loss.detach())

    def train(self, step: int, samples: list[list[int]]) -> dict[str, Any]:
        with self.memory.region("model"):
            loss = self._train_step(samples)
        self.backup.backup("actor", self.model.named_weights().items())
        return {"rank": self.rank, "loss": loss}

    def save_model(self, step: int) -> dict[str, Any]:
        path = self.out / "checkpoints" / f"step{step:04d}" / f"rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        torch.save(state, path)
        # The checkpoint reloads to the live weights (it was written from resident memory).
        reloaded = torch.load(path, map_location=self.device, weights_only=True)
        ok = all(torch.equal(reloaded[k], state[k]) for k in state)
        return {"rank": self.rank, "path": str(path), "bytes": path.stat().st_size, "reload_ok": ok}

    def update_weights(self, version: int) -> dict[str, Any]:
        # Model memory may be paused here: read the CPU copy, as slime's weight updater does.
        before = _reset_peak_rss()
        report = self.sender.send(version, self.backup.tensors("actor").items())
        peak = _peak_rss()
        return {
            "rank": self.rank,
            "version": version,
            "resends": report.resends,
            "bytes": report.nbytes,
            "seconds": report.duration_s,
            "transport": report.transport,
            # Host memory the sync added on this rank (vime #57: ~99 GB per rank on the second sync).
            "peak_rss_growth_mib": None
            if before is None or peak is None
            else round((peak - before) / 2**20, 1),
        }


class DemoTrainer(LifecycleMixin, TinyTrainer):
    """The trainer actor of `lifecycle demo` (use with `ray.remote`)."""

    def rendezvous(self) -> str:
        """A TCP address on this actor's node for torch.distributed (called on rank 0 only)."""
        import ray

        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def init(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        device: str,
        model: dict[str, Any],
        engine_gpu_counts: list[int],
        rollouts: list[Any],
        transport: str,
        bucket_mb: int,
        out: str,
        timeout_s: float,
        memory_budget: bool = False,
        between: tuple[str, str] | None = None,
    ) -> dict[str, Any]:
        """`between`: the (this rank's, its engine rank's) nodes; the transport is chosen for that pair."""
        self.rank, self.world_size, self.out = rank, world_size, Path(out)
        configure_logging(json_path=self.out / "logs" / f"trainer-rank{rank}.jsonl")
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves this actor one GPU
        self.device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        self.groups = ReloadableProcessGroups.init(
            backend="nccl" if device == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            timeout=timedelta(seconds=timeout_s),
            device_id=self.device if device == "cuda" else None,
        )
        topology = SlotTopology.plan(world_size, engine_gpu_counts)
        # Every rank creates every slot's gloo group, in slot order (dist.new_group is collective).
        handles = topology.create_groups(
            lambda ranks, backend: self.groups.new_group(ranks, backend=backend, name=f"slot{ranks[0]}")
        )
        me = topology.for_rank(rank)
        self.memory = select_memory_backend(
            "auto", tags=("model",), cpu_backup=True, retain_cpu_backup=device == "cuda"
        )
        with self.memory.region("model"):
            self.model = _build_model(model, self.device)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.backup = CpuWeightBackup()
        self.backup.backup("actor", self.model.named_weights().items())
        self.faults = FaultInjector()
        sender_transport = configure_sender(
            transport,
            colocated=True,
            memory=self.memory,
            directory=str(self.out / "transfer") if transport == "disk" else None,
            device=self.device if device == "cuda" else None,
            same_node=between is None or between[0] == between[1],
            between=between,
        )
        engine = rollouts[me.slot] if me.slot is not None else None
        self._corrupt_next = False
        self._cpu_model: QwenLM | None = None
        self.sender = WeightSender(
            me,
            handles[me.slot] if me.slot is not None and len(me.ranks) > 1 else None,
            sender_transport,
            rank=rank,
            engine_call=(lambda v, p: self._engine_call(engine, v, p, timeout_s))
            if me.is_coordinator
            else None,
            bucket_bytes=bucket_mb << 20,
            deadline_s=timeout_s,
        )
        # The budget agrees its inputs on the groups' rendezvous store (kept across WORLD rebuilds).
        probe = (
            DeviceMemoryProbe(
                expected_bytes=getattr(self.memory, "expected_bytes", None),
                store=torch.distributed.distributed_c10d._get_default_store() if world_size > 1 else None,
                rank=rank,
                world_size=world_size,
            )
            if memory_budget
            else None
        )
        lifecycle = self.configure_lifecycle(
            dataclasses.replace(TRAINER_POLICY, memory_budget=MemoryBudget())
            if memory_budget
            else TRAINER_POLICY,
            with_faults(
                self.faults,
                Hooks(
                    memory=self.memory,
                    process_groups=self.groups,
                    clear_memory=ClearMemory(host=True),
                    switch_model=ModelTagSwitch(self.backup, lambda: self.model),
                    budget=probe,
                ),
            ),
            rank=rank,
            role="trainer",
        )
        self.sender.lifecycle = lifecycle
        place = here()
        # world_size: `lifecycle check` names the ranks of the run that left no log.
        lifecycle.bind(
            slot=me.slot,
            device=str(self.device),
            host=socket.gethostname(),
            node=place["node_id"],
            world_size=world_size,
        )
        self.sleep()  # init ends asleep, as slime's does
        return {
            "rank": rank,
            "slot": me.slot,
            "coordinator": me.is_coordinator,
            "memory": self.memory.describe(),
            "transport": sender_transport.name,
            "cuda_ipc_probe": list(probe_cuda_ipc(self.memory)),
            "pid": os.getpid(),
            "node_id": place["node_id"],
        }

    # ------------------------------------------------------------------ for the driver

    def lifecycle_step(self, step: int) -> None:
        self.lifecycle.step = step

    def arm_fault(self, hook: str) -> None:
        self.faults.arm(hook)

    def weights_checksum(self) -> str:
        return weights_checksum(self.backup.tensors("actor"))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The trainer's own greedy continuation of `prompts` from its current weights (the CPU copy,
        in float32 on the CPU): what a Qwen model with these weights generates, to set beside the
        tokens the rollout engine generates from the same version."""
        if not isinstance(self.model, QwenLM):
            raise TypeError("greedy: the demo's trainer runs a Qwen model only with --engine sglang")
        if self._cpu_model is None:
            self._cpu_model = QwenLM(self.model.config, dtype=torch.float32, device="cpu")
        weights = self.backup.tensors("actor")
        with torch.no_grad():
            for name, param in self._cpu_model.named_parameters():
                param.copy_(weights[name])
        return self._cpu_model.generate(prompts, max_new_tokens=max_new_tokens)

    def corrupt_next_sync(self) -> None:
        """Make the next sync's first bucket fail its checksum on arrival, as a bucket corrupted in
        transit does (the demo's --corrupt-sync): the engine must refuse that round and write
        nothing, and the sender packs and sends it again."""
        self._corrupt_next = True

    def _engine_call(self, engine: Any, version: int, payloads: list[Any], timeout_s: float) -> Any:
        if self._corrupt_next:
            self._corrupt_next = False
            payloads = [_with_wrong_checksum(payloads[0]), *payloads[1:]]
        return _engine_call(engine, version, payloads, timeout_s)

    def flush_logs(self) -> bool:
        return flush_logs()

    def close(self) -> None:
        self.sender.close()
        self.groups.close()


def _engine_call(engine: Any, version: int, payloads: list[Any], timeout_s: float) -> Any:
    import ray

    started = time.monotonic()
    try:
        return ray.get(engine.update_weights.remote(version, payloads), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"rollout engine did not acknowledge version {version} within {timeout_s:.0f} s "
            f"(waited {time.monotonic() - started:.1f} s); it may be blocked or dead: see its lifecycle log"
        ) from exc


def _with_wrong_checksum(payload: Any) -> Any:
    """`payload` with its first bucket's expected checksum changed (a bucket checked against a device
    trailer is told to check against the manifest instead), so that its bytes no longer match it:
    what the receiver sees after a bit flip in transit."""
    bucket = payload.buckets[0]
    wrong = dataclasses.replace(
        bucket,
        checksum_kind=WSUM64 if bucket.checksum_kind == WSUM64_DEVICE else bucket.checksum_kind,
        checksum=bucket.checksum ^ 0x5A5A5A5A5A5A,
    )
    return dataclasses.replace(payload, buckets=(wrong, *payload.buckets[1:]))


def _build_model(model: dict[str, Any], device: torch.device) -> TinyLM | QwenLM:
    """The demo's TinyLM, or the Qwen2/Qwen3 model of `model["qwen_config"]` (what SGLang serves)."""
    if "qwen_config" in model:
        return QwenLM(
            QwenConfig.from_json(model["qwen_config"]), seed=int(model.get("seed", 0)), device=device
        )
    return TinyLM(TinyLMConfig(**model)).to(device)


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return that RSS (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _peak_rss() -> int | None:
    return _status_bytes("VmHWM")

"""Phase switch: one colocated step's lifecycle, slime's way against this library's, on one GPU.

    python benchmarks/bench_phase_switch.py --out out/bench_phase_switch.json
    python benchmarks/bench_phase_switch.py --nccl-lib /path/to/nvidia/nccl/lib/libnccl.so.2
    python benchmarks/bench_phase_switch.py --cpu-smoke     # tiny sizes, gloo, no-op memory (CI)

Every column runs the same state in the same process layout, one column after the other:

- a trainer process: the 0.6B-shaped training state (Qwen3-0.6B's 254 parameters as bf16 weights,
  fp32 main copies, Adam m and v, bf16 grads: 1270 tensors, 8.9 GiB) in a torch_memory_saver
  region with CPU backup, and the process groups of a Megatron model (megatron-core's
  `initialize_model_parallel`, or `--groups subgroups`: WORLD + 16 NCCL subgroups);
- a rollout process on the same GPU: the 1.2 GB of bf16 weights and a KV cache under
  torch_memory_saver tags `weights` and `kv_cache`, no backup (discarded on release, as SGLang);
- one step: rollout sleep -> trainer wake -> training body -> trainer sleep -> rollout wake
  weights -> sync -> rollout wake KV cache. The training body runs one collective on every
  process group, as the first step after a rebuild does (it creates the communicators a wake
  rebuilt lazily); it is timed apart and left out of the lifecycle figure. The sync sends the
  weights from a pinned CPU copy, since the trainer sleeps by then (slime's weights backup).

slime-style: slime's order and settings. `clear_memory` as slime has it (synchronize, a full
`gc.collect()`, `empty_cache`, `_host_emptyCache` on sleep), groups destroyed by torch's serial
`destroy_process_group()` and rebuilt by replaying `init_process_group` + `new_group`, the sync
with groups reloaded around it, torch_memory_saver's default pinned backup without retain, a
fresh flattened bucket and CUDA IPC handle per 512 MiB, `ipc_collect()` after each.
ours: `LifecycleMixin` + `TorchMemorySaverBackend` (retained backup, prepared at configuration),
`MegatronParallelState` over `ReloadableProcessGroups` (concurrent teardown), `ClearMemory`, the
hooks a plan declares independent run together, `RolloutActor`, `actor_integration.weight_sync`.
ours-suspend and ours-keep: the same with `communicators="suspend"` (ncclCommSuspend, skipped with
the reason where NCCL 2.29.7+ is not loaded and reachable) and `communicators="keep"`.

budget-fits, budget-part, budget-all (issue 31): ours under `LifecyclePolicy(memory_budget=...)`, the
state in two tags (`params`: bf16 weights and grads; `optimizer`: fp32 main, Adam m and v), a
`DeviceMemoryProbe`; two full-sleep calibration steps, then the rollout's KV cache is sized so its
declared wake need (`RolloutActor.wake_need_bytes`) leaves the trainer's sleep nothing to release,
part of it, or all of it. Their section prints each one's trainer lifecycle per step, the bytes
it moved, and its target next to the PCIe figure of the same run: fits <= 0.05 s; part <= bytes
moved / PCIe + 0.1 s; all no slower than ours (the full sleep). `--sm-restore` adds budget-part-sm:
budget-part with `params` kept by the backend's own pinned copy and restored by the SMs
(`device_restore`), against the same target.

Printed: each hook's time in every column (steady = median of the steps after the first), the
per-step totals, the PCIe and D2D ceilings measured in the same run, a section per way of
treating the communicators on WORLD + 16 warmed subgroups (time to free, memory freed, time to
bring back, first collectives after), and a teardown/rebuild section (serial vs concurrent
destroy; lazy vs concurrent connect). `--nccl-lib` re-runs the script with that libnccl.so.2 in
LD_PRELOAD (every child inherits it), e.g. the `nvidia-nccl-cu13` 2.30.7 wheel's, for suspend.
Targets (issue 11): ours <= 1.2 s of lifecycle per step and >= 10x faster than slime-style.
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

GIB = 2**30
TARGET_S = 1.2
TARGET_RATIO = 10.0
COLUMNS = ("slime", "ours")  # as printed; run ours first, so a run cut short still has it
WAY_COLUMNS = {"suspend": "ours-suspend", "keep": "ours-keep"}  # ours with another communicators= way
WAYS = ("destroy", "suspend", "keep")
# The memory budget (issue 31): the rollout's KV cache set so the trainer's budgeted sleep releases
# nothing, part (the smaller tag), or all (both tags and the communicators).
BUDGETS = ("fits", "part", "all")
BUDGET_COLUMNS = {b: f"budget-{b}" for b in BUDGETS}
# The full sleep (no budget) on the budget columns' two tags, the rollout sized as for budget-all:
# the baseline that variant must not be slower than, under the same nearly full device.
BUDGET_COLUMNS["full"] = "full-kv-all"
# budget-part with the `params` tag kept by the backend's own pinned copy and restored by the SMs
# (`TorchMemorySaverBackend(device_restore=["params"])`) instead of torch_memory_saver's copy
# engines, which run at half speed right after the rollout's release (--sm-restore adds it).
SM_COLUMNS = {"budget-part-sm": "part"}
BUDGET_TAGS = ("params", "optimizer")  # bf16 weights + grads | fp32 main + Adam m, v
CALIBRATION_STEPS = 2  # full sleeps before the need is set: the sleep's figures, learned and measured
TARGET_FITS_S = 0.05
TARGET_PART_SLACK_S = 0.1
SMOKE_DEVICE = 24 << 20  # --cpu-smoke: the simulated device the budget plans on (bytes)
SMOKE_GROUPS = 2 << 20  # --cpu-smoke: what the simulated communicators hold while alive


def budget_margin(cfg: Config) -> int:
    """The budget's safety margin: MemoryBudget's default 1 GiB on a GPU, 256 KiB in the CPU smoke."""
    return GIB if cfg.gpu else 256 << 10


@dataclass(frozen=True)
class Sizes:
    """The model shape (Qwen3-0.6B by default) and the rollout's KV cache."""

    layers: int = 28
    hidden: int = 1024
    q_dim: int = 2048  # 16 heads x 128
    kv_dim: int = 1024  # 8 KV heads x 128
    ffn: int = 3072
    vocab: int = 151936
    kv_cache_bytes: int = 4 * GIB
    bucket_bytes: int = 512 << 20

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """254 parameters: embedding, 9 per layer, final norm."""
        h = self.hidden
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes += [
                (p + "attn.q.weight", (self.q_dim, h)),
                (p + "attn.k.weight", (self.kv_dim, h)),
                (p + "attn.v.weight", (self.kv_dim, h)),
                (p + "attn.o.weight", (h, self.q_dim)),
                (p + "mlp.gate.weight", (self.ffn, h)),
                (p + "mlp.up.weight", (self.ffn, h)),
                (p + "mlp.down.weight", (h, self.ffn)),
                (p + "input_norm.weight", (h,)),
                (p + "post_norm.weight", (h,)),
            ]
        return [*shapes, ("final_norm.weight", (h,))]


SMOKE = Sizes(
    layers=2,
    hidden=64,
    q_dim=128,
    kv_dim=64,
    ffn=192,
    vocab=512,
    kv_cache_bytes=1 << 20,
    bucket_bytes=256 << 10,
)


@dataclass(frozen=True)
class Config:
    sizes: Sizes
    device: str  # "cuda" or "cpu"
    groups: str  # "megatron" or "subgroups"
    steps: int
    slime_steps: int
    timeout_s: float

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.gpu else "gloo"


# ---------------------------------------------------------------------------------------------- shared


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def used_gib() -> float | None:
    if not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / GIB, 2)


def allocate_state(sizes: Sizes, device: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The training state: bf16 weights (returned by name) and the fp32 main, Adam m/v and bf16 grads."""
    weights: dict[str, torch.Tensor] = {}
    others: list[torch.Tensor] = []
    for i, (name, shape) in enumerate(sizes.parameters()):
        value = float(i % 7 + 1)  # exact in bf16: checked after every wake
        weights[name] = torch.empty(shape, dtype=torch.bfloat16, device=device).fill_(value)
        others.append(torch.empty(shape, dtype=torch.float32, device=device).fill_(value))  # main
        others += [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(2)]  # Adam m, v
        others.append(torch.zeros(shape, dtype=torch.bfloat16, device=device))  # grad
    return weights, others


def allocate_split(
    sizes: Sizes, device: str, memory: Any
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """The same training state in the budget's two tags: `params` (bf16 weights and grads) and
    `optimizer` (fp32 main, Adam m and v); with each tag's bytes."""
    weights: dict[str, torch.Tensor] = {}
    others: list[torch.Tensor] = []
    with memory.region("params"):
        for i, (name, shape) in enumerate(sizes.parameters()):
            weights[name] = torch.empty(shape, dtype=torch.bfloat16, device=device).fill_(float(i % 7 + 1))
            others.append(torch.zeros(shape, dtype=torch.bfloat16, device=device))  # grad
    with memory.region("optimizer"):
        for i, (_name, shape) in enumerate(sizes.parameters()):
            others.append(torch.empty(shape, dtype=torch.float32, device=device).fill_(float(i % 7 + 1)))
            others += [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(2)]
    numel = sum(_numel(s) for _, s in sizes.parameters())
    return weights, others, {"params": numel * 4, "optimizer": numel * 12}


def state_intact(weights: dict[str, torch.Tensor]) -> bool:
    firsts = torch.stack([w.reshape(-1)[0].float() for w in weights.values()]).cpu()
    expected = torch.tensor([float(i % 7 + 1) for i in range(len(weights))])
    return bool(torch.equal(firsts, expected))


def pinned_copy(weights: dict[str, torch.Tensor], gpu: bool) -> dict[str, torch.Tensor]:
    """The trainer's CPU weight backup the sync reads while the trainer sleeps."""
    return {n: torch.empty(w.shape, dtype=w.dtype, pin_memory=gpu).copy_(w) for n, w in weights.items()}


def warm_groups() -> int:
    """One collective on every registered process group, as a first training step after a rebuild."""
    import torch.distributed as dist

    groups = list(dist.distributed_c10d._world.pg_map)
    for pg in groups:
        on_gpu = "nccl" in str(dist.get_backend(pg))
        dist.all_reduce(torch.ones(1, device="cuda" if on_gpu else "cpu"), group=pg)
    sync()
    return len(groups)


def buckets_of(sizes: Sizes, names: list[str]) -> list[list[str]]:
    shapes = dict(sizes.parameters())
    out: list[list[str]] = [[]]
    filled = 0
    for name in names:
        nbytes = 2 * _numel(shapes[name])
        if out[-1] and filled + nbytes > sizes.bucket_bytes:
            out.append([])
            filled = 0
        out[-1].append(name)
        filled += nbytes
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class NoSaver:
    """torch_memory_saver's singleton interface where there is none (CPU smoke): nothing is released."""

    hook_mode = "torch"
    retain_cpu_backup = False

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False) -> Iterator[None]:
        yield

    def pause(self, tag: str | None = None) -> None:
        pass

    def resume(self, tag: str | None = None) -> None:
        pass

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield


def raw_saver(gpu: bool) -> Any:
    if not gpu:
        return NoSaver()
    from torch_memory_saver import torch_memory_saver

    torch_memory_saver.hook_mode = "torch"
    return torch_memory_saver


def new_store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def init_megatron() -> Any:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return ps


# ---------------------------------------------------------------------------------------------- rollout


class BenchEngine:
    """A rollout engine with SGLang's memory behaviour: weights and KV cache in saver tags, no backup."""

    stages_weights = False

    def __init__(self, cfg: Config, kv: bool = True) -> None:
        self.saver = raw_saver(cfg.gpu)
        self.device = cfg.device
        self.weight_version = 0
        self._resident = {"weights": True, "kv_cache": True}
        with self.saver.region("weights"):
            self.weights = {
                n: torch.zeros(s, dtype=torch.bfloat16, device=cfg.device) for n, s in cfg.sizes.parameters()
            }
        self.kv: torch.Tensor | None = None
        if kv:
            self.allocate_kv(cfg.sizes.kv_cache_bytes)
        sync()

    def allocate_kv(self, nbytes: int) -> int:
        """The KV cache pool (once), sized by the budget columns after their calibration steps."""
        assert self.kv is None and self._resident["kv_cache"], "allocate_kv: once, while awake"
        with self.saver.region("kv_cache"):
            self.kv = torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16, device=self.device)
        sync()
        return self.kv.numel() * 2

    def memory_bytes(self, tag: str | None) -> int:
        """What a tag (None: every tag) holds while resident: the wake's need (RolloutActor.wake_need_bytes)."""
        held = {
            "weights": sum(w.numel() * 2 for w in self.weights.values()),
            "kv_cache": 0 if self.kv is None else self.kv.numel() * 2,
        }
        return sum(held.values()) if tag is None else held[tag]

    @property
    def residency(self) -> dict[str, bool]:
        return dict(self._resident)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            if tag != "kv_cache" or self.kv is not None:  # no pool yet: nothing to release
                self.saver.pause(tag)
            self._resident[tag] = False

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            if tag != "kv_cache" or self.kv is not None:
                self.saver.resume(tag)
            self._resident[tag] = True

    def pause_generation(self, mode: str = "abort") -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def flush_cache(self) -> bool:
        return True

    def generate(self, prompts: Any, *, max_new_tokens: int) -> list[list[int]]:
        return [[] for _ in prompts]

    def load_weights(self, version: int, shards: Any, *, round_index: int, final: bool) -> None:
        for name, tensor in shards[0]:
            self.weights[name].copy_(tensor.view(self.weights[name].shape))
        sync()
        if final:
            self.weight_version = version

    def load_bucket(self, names: list[str], bucket: torch.Tensor) -> int:
        """slime's engine side of one flattened bucket: the handle was opened by unpickling it."""
        offset = 0
        for name in names:
            target = self.weights[name]
            target.copy_(bucket[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
        sync()
        del bucket
        return offset

    def weights_checksum(self) -> str:
        firsts = torch.stack([w.reshape(-1)[0].float() for w in self.weights.values()]).cpu()
        return str(float(firsts.sum()))


def rollout_main(column: str, cfg: Config, conn: Any) -> None:
    import lifecycle

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    if cfg.gpu:
        torch.cuda.set_device(0)
    engine = BenchEngine(cfg, kv=budget_of(column) is None)
    actor = None
    if column != "slime":
        from actor_integration.rollout import RolloutActor

        actor = RolloutActor(engine)
    with lifecycle.capture_events("info") as events:
        conn.send(("ok", "ready"))
        while True:
            message = conn.recv()
            if message is None:
                break
            method, args = message
            del message
            try:
                if method == "events":
                    result: Any = list(events)
                    events.clear()
                elif method in ("load_bucket", "allocate_kv"):
                    result = getattr(engine, method)(*args)
                elif actor is not None and hasattr(actor, method):
                    result = getattr(actor, method)(*args)
                else:
                    result = getattr(engine, method)(*args)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
            del args  # a slime bucket's IPC mapping closes now, not at the next message
    conn.close()
    os._exit(0)  # torch_memory_saver's torch hook mode may exit(1) at teardown: nothing left to do


class Rollout:
    """The trainer's handle on the rollout process (what `ray.get(actor.method.remote(...))` is)."""

    def __init__(self, column: str, cfg: Config) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=rollout_main, args=(column, cfg, theirs), daemon=True)
        self.process.start()
        assert self.call("__ready__") == "ready"

    def call(self, method: str, *args: Any) -> Any:
        if method != "__ready__":
            self.conn.send((method, args))
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"rollout.{method} failed: {value}")
        return value

    def __call__(self, version: int, payloads: list[Any]) -> Any:  # WeightSender's engine_call
        return self.call("update_weights", version, payloads)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


# ---------------------------------------------------------------------------------------------- slime-style


class SlimeTrainer:
    """slime's actor as it sleeps, wakes and syncs in colocated mode, on the same state."""

    def __init__(self, cfg: Config, rollout: Rollout) -> None:
        import torch.distributed as dist

        self.cfg, self.rollout, self.dist = cfg, rollout, dist
        self.saver = raw_saver(cfg.gpu)  # TMS default: pinned backup, no retain
        self.store = new_store()
        self.worlds = 0
        self.ps: Any = None
        self.reload_groups()
        with self.saver.region("model", enable_cpu_backup=True):
            self.weights, self.others = allocate_state(cfg.sizes, cfg.device)
        self.cpu_weights = pinned_copy(self.weights, cfg.gpu)
        self.buckets = buckets_of(cfg.sizes, list(self.weights))
        self.registered = warm_groups()
        self.sleep_parts()  # slime's init ends asleep

    def clear_memory(self, host: bool) -> None:
        # slime/utils/memory_utils.py clear_memory
        sync()
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            if host:
                torch._C._host_emptyCache()

    def reload_groups(self) -> None:
        """slime's reload_process_groups: init_process_group again, then replay every new_group."""
        from torch.distributed.distributed_c10d import PrefixStore

        self.dist.init_process_group(
            self.cfg.backend,
            store=PrefixStore(f"slime/world{self.worlds}", self.store),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=300),
        )
        self.worlds += 1
        if self.cfg.groups == "megatron":
            if self.ps is not None:
                self.ps.destroy_model_parallel()  # its globals name the destroyed groups
            self.ps = init_megatron()
        else:
            for _ in range(16):
                self.dist.new_group([0])

    def destroy_groups(self) -> None:
        self.dist.destroy_process_group()  # torch's order, one communicator after another

    def sleep_parts(self) -> dict[str, float]:
        return {
            "sleep.clear_memory": timed(lambda: self.clear_memory(host=True)),
            "sleep.process_groups.destroy": timed(self.destroy_groups),
            "sleep.memory.pause": timed(self.saver.pause),
        }

    def step(self, version: int) -> dict[str, float]:
        rows: dict[str, float] = {}
        start = time.perf_counter()
        rows["rollout.sleep"] = timed(lambda: self.rollout.call("release_memory_occupation"))
        wake = {
            "wake.memory.resume": timed(self.saver.resume),
            "wake.clear_memory": timed(lambda: self.clear_memory(host=False)),
            "wake.process_groups.reload": timed(self.reload_groups),
        }
        rows.update(wake, **{"wake": sum(wake.values())})
        rows["body"] = timed(lambda: (state_intact(self.weights), warm_groups()))
        rows["intact"] = float(state_intact(self.weights))
        sleep = self.sleep_parts()
        rows.update(sleep, sleep=sum(sleep.values()))
        rows["rollout.wake_weights"] = timed(
            lambda: self.rollout.call("resume_memory_occupation", ["weights"])
        )
        up = timed(self.reload_groups)
        transfer = timed(self.send_buckets)
        down = timed(self.destroy_groups)
        rows.update({"sync.groups_up": up, "sync.transfer": transfer, "sync.groups_down": down})
        rows["sync"] = up + transfer + down
        rows["rollout.wake_kv"] = timed(lambda: self.rollout.call("resume_memory_occupation", ["kv_cache"]))
        rows["step"] = time.perf_counter() - start
        rows["asleep_used_gib"] = used_gib() or 0.0
        return rows

    def send_buckets(self) -> None:
        """slime's colocated update: a fresh flattened bucket per 512 MiB, shared with a fresh IPC handle.

        slime wraps it in `torch_memory_saver.disable()`, which its preload mode (TMS_INIT_ENABLE)
        needs; in torch hook mode memory outside regions is plain already (and disable() asserts).
        """
        for names in self.buckets:
            parts = [self.cpu_weights[n].to(self.cfg.device, non_blocking=True).view(-1) for n in names]
            bucket = torch.cat(parts)
            del parts
            sync()
            self.rollout.call("load_bucket", names, bucket)  # pickled by torch: a new CUDA IPC handle
            del bucket
            if self.cfg.gpu:
                torch.cuda.ipc_collect()


# ---------------------------------------------------------------------------------------------- ours


class _TrainerBody:
    """The existing actor's bodies, wrapped by LifecycleMixin below (no training: one collective per group)."""

    sender: Any
    cpu_weights: dict[str, torch.Tensor]

    weights: dict[str, torch.Tensor]
    intact: bool = False

    free_bytes: Callable[[], int | None] | None = None
    free_at_end: int | None = None

    def train(self, step: int) -> int:
        self.intact = state_intact(self.weights)  # the state came back (read while awake)
        registered = warm_groups()
        if self.free_bytes is not None:  # the free memory the trainer's sleep starts from
            self.free_at_end = self.free_bytes()
        return registered

    def update_weights(self, version: int) -> Any:
        return self.sender.send(version, self.cpu_weights)


def ours_trainer_class() -> type:
    from actor_integration import LifecycleMixin

    class OursTrainer(LifecycleMixin, _TrainerBody):
        pass

    return OursTrainer


class Ours:
    """This library's recommended configuration, driven the way a slime-shaped driver calls it."""

    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        communicators: str = "destroy",
        budget: str | None = None,
        sm_restore: bool = False,
    ) -> None:
        from actor_integration import (
            ClearMemory,
            DeviceMemoryProbe,
            MegatronParallelState,
            ReloadableProcessGroups,
            select_memory_backend,
        )
        from actor_integration.backends.release_audit import cuda_free_bytes
        from actor_integration.weight_sync import RankSlot, WeightSender, configure_sender
        from lifecycle import Hooks, LifecyclePolicy, MemoryBudget

        self.cfg, self.rollout, self.budget = cfg, rollout, budget
        self.plans: list[dict[str, Any]] = []  # per step, the train exit sleep's budget plan
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend,
            rank=0,
            world_size=1,
            store=new_store(),
            timeout=timedelta(seconds=300),
            communicators=communicators,
        )
        process_groups: Any = groups
        if cfg.groups == "megatron":
            process_groups = MegatronParallelState(
                groups, tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )
        else:
            for i in range(16):
                groups.new_group([0], name=f"g{i}")
        self.groups = groups
        # After megatron.core is imported: it sets torch_memory_saver.hook_mode on import, which TMS
        # refuses once the backend below has initialised it.
        tags = BUDGET_TAGS if budget else ("model",)
        memory = select_memory_backend(
            "tms" if cfg.gpu else "noop",
            tags=tags,
            cpu_backup=True,
            device_restore=["params"] if sm_restore else False,
            retain_cpu_backup=True,
            hook_mode="torch",
        )
        if budget:
            self.weights, self.others, self.tag_bytes = allocate_split(cfg.sizes, cfg.device, memory)
        else:
            with memory.region("model"):
                self.weights, self.others = allocate_state(cfg.sizes, cfg.device)
            self.tag_bytes = {
                "model": sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.others])
            }
        # The budget's free memory: the device's (CUDA), or on CPU a device of SMOKE_DEVICE bytes
        # holding the trainer's resident tags and, while alive, SMOKE_GROUPS bytes of communicators.
        self.free_bytes: Callable[[], int | None] = cuda_free_bytes if cfg.gpu else self._smoke_free
        self.memory = memory
        trainer = ours_trainer_class()()
        trainer.free_bytes = self.free_bytes if budget else None
        trainer.weights = self.weights
        trainer.cpu_weights = pinned_copy(self.weights, cfg.gpu)
        transport = configure_sender("auto", colocated=True, memory=memory)
        trainer.sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=rollout,
            bucket_bytes=cfg.sizes.bucket_bytes,
            deadline_s=cfg.timeout_s,
        )
        self.transport = type(transport).__name__
        self.registered = warm_groups()
        self.prepared: dict[str, Any] = {}
        if hasattr(memory, "prepare_cpu_backup"):
            try:  # read from torch_memory_saver's region pools, checked against the state allocated
                read: Any = memory.backup_bytes()
            except Exception as exc:
                read = repr(exc)
            known = sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.others])
            self.prepared = memory.prepare_cpu_backup(ranks_per_node=1, nbytes=known)
            self.prepared["backup_bytes_read"] = read
        self.clear = ClearMemory(host=True)
        probe = (
            DeviceMemoryProbe(
                free_bytes=self.free_bytes,
                expected_bytes=lambda tag: self.tag_bytes.get(tag) if tag else sum(self.tag_bytes.values()),
            )
            if budget and budget != "full"
            else None
        )
        trainer.configure_lifecycle(
            LifecyclePolicy(
                offload_train=True,
                memory_tags=tags,
                model_tag=None,
                memory_budget=MemoryBudget(margin_bytes=budget_margin(cfg)) if probe else None,
            ),
            Hooks(memory=memory, process_groups=process_groups, clear_memory=self.clear, budget=probe),
            rank=0,
            role="actor",
        )
        self.trainer = trainer
        trainer.sleep()  # as slime's init ends asleep
        self.version = 0

    def _smoke_free(self) -> int:
        held = sum(b for t, b in self.tag_bytes.items() if not self.memory.is_paused(t))
        return SMOKE_DEVICE - held - (SMOKE_GROUPS if self.groups.is_alive() else 0)

    def step(self, version: int, events: list[dict[str, Any]]) -> dict[str, float]:
        from lifecycle.logs import Event

        rows: dict[str, float] = {}
        mark = len(events)
        start = time.perf_counter()
        rows["rollout.sleep"] = timed(lambda: self.rollout.call("sleep"))
        rows["train"] = timed(lambda: self.trainer.train(version))
        rows["intact"] = float(self.trainer.intact)
        if self.budget:  # what the trainer's sleep left free (the rollout asleep): calibration
            free_at_sleep, freed = self.trainer.free_at_end, self.free_bytes()
            if free_at_sleep is not None and freed is not None:
                rows["budget.free_at_sleep"] = float(free_at_sleep)
                rows["budget.freed"] = float(freed - free_at_sleep)
        rows["rollout.wake_weights"] = timed(lambda: self.rollout.call("wake_up", ["weights"]))
        rows["sync"] = timed(lambda: self.trainer.update_weights(version))
        rows["rollout.wake_kv"] = timed(lambda: self.rollout.call("wake_up", ["kv_cache"]))
        rows["step"] = time.perf_counter() - start
        rows["asleep_used_gib"] = used_gib() or 0.0
        edges = {
            ("train", "enter"): "wake",
            ("train", "exit"): "sleep",
            ("sync", "enter"): "sync.groups_up",
            ("sync", "exit"): "sync.groups_down",
        }
        for event in events[mark:]:
            name, op = event.get("event"), event.get("operation")
            where = edges.get((op, event.get("phase")))
            if name == Event.TRANSITION and where is not None:
                rows[where] = event["duration_ms"] / 1e3
                for hook in event["hooks"] if where in ("wake", "sleep") else ():
                    key = f"{where}.{hook['name']}"
                    rows[key] = rows.get(key, 0.0) + hook["ms"] / 1e3
            elif name == Event.BODY:
                rows["body" if op == "train" else "sync.transfer"] = event["duration_ms"] / 1e3
        plans = [e for e in events[mark:] if e.get("event") == Event.BUDGET]
        checks = [e for e in events[mark:] if e.get("event") == Event.BUDGET_CHECKED]
        if self.budget or plans:
            released = plans[0].get("released", list(self.tag_bytes)) if plans else list(self.tag_bytes)
            self.plans.append(
                {
                    "need_bytes": plans[0].get("need_bytes") if plans else None,
                    "released": released,
                    "kept": plans[0].get("kept") if plans else [],
                    "feasible": plans[0].get("feasible") if plans else None,
                    "met": checks[0].get("met") if checks else None,
                    "free_bytes": plans[0].get("free_bytes") if plans else None,
                }
            )
        else:
            released = list(self.tag_bytes)
        # What the step moved over PCIe: each released tag down at the sleep, up at the next wake.
        rows["moved_bytes"] = float(sum(self.tag_bytes.get(t, 0) for t in released))
        # The trainer's lifecycle: its train call but the body (wake, the budget's plan, sleep, its
        # check), and the sync's groups up and down.
        rows["trainer"] = (
            rows["train"]
            - rows.get("body", 0.0)
            + rows.get("sync.groups_up", 0.0)
            + rows.get("sync.groups_down", 0.0)
        )
        destroyed = [e for e in events[mark:] if e.get("event") == Event.GROUPS_DESTROYED]
        if destroyed and destroyed[0].get("bytes") is not None:  # the first is the train exit's sleep
            rows["sleep.groups_freed_gib"] = destroyed[0]["bytes"] / GIB
        return rows


# ---------------------------------------------------------------------------------------------- columns


def column_main(column: str, cfg: Config, out: str) -> None:
    """One column in this process (the trainer), with its rollout process beside it."""
    import lifecycle

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {"column": column}
    rollout = None
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        t0 = time.perf_counter()
        rollout = Rollout(column, cfg)
        steps = cfg.slime_steps if column == "slime" else cfg.steps
        # debug: every process_groups.destroyed/reloaded event, not only the first (at info)
        with lifecycle.capture_events("debug") as events:
            budget = budget_of(column)
            trainer: Any = (
                SlimeTrainer(cfg, rollout)
                if column == "slime"
                else Ours(cfg, rollout, way_of(column), budget=budget, sm_restore=column in SM_COLUMNS)
            )
            first = 1
            if budget is not None:
                # Full sleeps first (no need declared): they teach the budget what each item frees
                # and costs, and measure the free memory the trainer's sleep starts from; then the
                # rollout's KV cache is sized so that its wake needs nothing, part, or all of it.
                result["calibration_steps"] = [
                    trainer.step(v, events) for v in range(1, CALIBRATION_STEPS + 1)
                ]
                result["need"] = set_need(trainer, rollout, cfg, budget, result["calibration_steps"][-1])
                trainer.plans.clear()
                first = CALIBRATION_STEPS + 1
                print(f"  {column}: {result['need']['summary']}", flush=True)
            result["setup_s"] = round(time.perf_counter() - t0, 2)
            import torch.distributed as dist

            result["registered_groups_awake"] = trainer.registered
            result["prepared"] = getattr(trainer, "prepared", None)
            result["transport"] = getattr(trainer, "transport", "fresh CUDA IPC handle per bucket")
            result["steps"] = []
            for version in range(first, first + steps):
                rows = trainer.step(version) if column == "slime" else trainer.step(version, events)
                result["steps"].append(rows)
                print(f"  {column} step {version}: {rows['step']:.3f} s", flush=True)
            if column != "slime":
                from actor_integration.backends.process_groups import loaded_nccl, nccl_suspend_support

                result["plans"] = trainer.plans
                result["tag_bytes"] = trainer.tag_bytes
                result["clear_memory_ms"] = trainer.clear.timings_ms
                result["communicators"] = trainer.groups.communicators
                result["suspend_probe"] = nccl_suspend_support(cfg.backend).reason
                loaded = loaded_nccl()
                result["nccl_loaded"] = None if loaded is None else ".".join(map(str, loaded.version))
                result["groups_events"] = [
                    {k: e.get(k) for k in ("event", "way", "bytes", "measured_by", "fell_back", "held_bytes")}
                    for e in events
                    if e.get("event") in ("process_groups.destroyed", "process_groups.reloaded")
                ][:4]
            result["registered_groups_asleep"] = len(dist.distributed_c10d._world.pg_map)
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
        print(result["error"], flush=True)
    finally:
        if rollout is not None:
            rollout.stop()
    Path(out).write_text(json.dumps(result, default=str))
    lifecycle.flush_logs()
    os._exit(0)  # torch_memory_saver's torch hook mode may exit(1) at teardown: the result is written


def budget_of(column: str) -> str | None:
    """The memory-budget variant a column runs ("fits", "part", "all"), or None: no budget."""
    if column in SM_COLUMNS:
        return SM_COLUMNS[column]
    return next((b for b, name in BUDGET_COLUMNS.items() if name == column), None)


def planned_columns(ways: list[str], budgets: list[str], sm_restore: bool) -> list[str]:
    """The columns a run makes, in order: ours first (a run cut short still has it)."""
    return [
        *reversed(COLUMNS),
        *(WAY_COLUMNS[w] for w in ways if w in WAY_COLUMNS),
        *(BUDGET_COLUMNS[b] for b in budgets),
        *([BUDGET_COLUMNS["full"]] if "all" in budgets else []),
        *(c for c, b in SM_COLUMNS.items() if sm_restore and b in budgets),
    ]


def set_need(
    ours: Ours, rollout: Rollout, cfg: Config, budget: str, last: dict[str, float]
) -> dict[str, Any]:
    """Size the rollout's KV cache so the trainer's next sleeps must release nothing, part or all,
    from the last calibration step's figures; declare the rollout's wake need to the trainer.

    fits: the KV cache the bench runs with (--kv-gib); part: half the smaller tag beyond what is
    free (need + margin - free); all: what the full sleep freed, less a quarter of the smaller tag
    (more than any release but all of them frees)."""
    free_at_sleep, freed = int(last["budget.free_at_sleep"]), int(last["budget.freed"])
    margin = budget_margin(cfg)
    weights = int(rollout.call("wake_need_bytes"))  # weights only: no KV pool yet
    small = min(ours.tag_bytes.values())
    full = free_at_sleep - margin + freed - small // 4
    need = {
        "fits": weights + cfg.sizes.kv_cache_bytes,
        "part": free_at_sleep - margin + small // 2,
        "all": full,
        "full": full,
    }[budget]
    if need - weights <= 0:
        raise RuntimeError(f"budget {budget}: a need of {need} bytes leaves no room for a KV cache")
    kv = int(rollout.call("allocate_kv", need - weights))
    declared = int(rollout.call("wake_need_bytes"))  # RolloutActor.wake_need_bytes: weights + KV
    if budget != "full":  # the full sleep's column has no budget to declare it to
        ours.trainer.lifecycle_expect(declared)
    required = declared + margin - free_at_sleep
    return {
        "need_bytes": declared,
        "kv_bytes": kv,
        "weights_bytes": weights,
        "free_at_sleep_bytes": free_at_sleep,
        "full_sleep_freed_bytes": freed,
        "margin_bytes": margin,
        "required_bytes": required,
        "summary": (
            f"rollout need {declared / GIB:.2f} GiB (KV {kv / GIB:.2f} GiB); free at the trainer's sleep "
            f"{free_at_sleep / GIB:.2f} GiB, margin {margin / GIB:.2f} GiB: the sleep must free "
            f"{max(0, required) / GIB:.2f} GiB (the full sleep freed {freed / GIB:.2f} GiB)"
        ),
    }


def way_of(column: str) -> str:
    """The communicators= way a column of ours runs with ("ours" is the default, destroy)."""
    return next((way for way, name in WAY_COLUMNS.items() if name == column), "destroy")


def run_column(column: str, cfg: Config) -> dict[str, Any]:
    return run_spawned(column_main, (column, cfg), cfg.timeout_s, {"column": column})


def run_spawned(
    target: Callable[..., None], args: tuple[Any, ...], timeout_s: float, label: dict[str, Any]
) -> dict[str, Any]:
    """`target(*args, out)` in a spawned process, which writes its JSON result to `out`; the result,
    or `label` with the error when the process outlived `timeout_s` or wrote nothing."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        process = ctx.Process(target=target, args=(*args, out))
        process.start()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            return {**label, "error": f"timed out after {timeout_s} s"}
        if not Path(out).exists():
            return {**label, "error": f"exited with code {process.exitcode} and no result"}
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


# ---------------------------------------------------------------------------------------------- teardown


def teardown_main(cfg: Config, out: str) -> None:
    """WORLD + 16 subgroups, each warmed: torch's serial destroy vs ours; rebuilt lazily vs connect()."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    import lifecycle
    from actor_integration.backends.process_groups import ReloadableProcessGroups

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {}
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        base = used_gib()
        # torch's own teardown: WORLD + 16 subgroups, one communicator after another.
        store = new_store()
        dist.init_process_group(cfg.backend, store=PrefixStore("serial", store), rank=0, world_size=1)
        for _ in range(16):
            dist.new_group([0])
        warm_groups()
        awake = used_gib()
        result["serial_destroy_s"] = timed(dist.destroy_process_group)
        result["serial_freed_gib"] = None if awake is None else round(awake - (used_gib() or 0.0), 2)
        # ours: the same groups (and the gloo side channel) through ReloadableProcessGroups.
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend, rank=0, world_size=1, store=new_store(), timeout=timedelta(seconds=300)
        )
        for i in range(16):
            groups.new_group([0], name=f"g{i}")
        warm_groups()
        awake = used_gib()
        for i in range(2):
            result[f"concurrent_destroy_{i}_s"] = timed(groups.destroy)
            result[f"concurrent_freed_{i}_gib"] = (
                None if awake is None else round(awake - (used_gib() or 0.0), 2)
            )
            result[f"reload_{i}_s"] = timed(groups.reload)
            if i == 0:  # each communicator created by its group's first collective, one by one
                result["lazy_first_collectives_s"] = timed(warm_groups)
            else:  # every communicator created at once, then the same collectives
                result["connect_s"] = timed(groups.connect)
                result["after_connect_collectives_s"] = timed(warm_groups)
        result["base_used_gib"] = base
        groups.close()
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
    Path(out).write_text(json.dumps(result, default=str))
    os._exit(0)


def run_teardown(cfg: Config) -> dict[str, Any]:
    return run_spawned(teardown_main, (cfg,), cfg.timeout_s, {})


# ---------------------------------------------------------------------------------------------- ways

WAY_CYCLES = 2


def way_main(cfg: Config, way: str, out: str) -> None:
    """One way of treating the communicators on WORLD + 16 warmed subgroups, in a process of its own."""
    import lifecycle
    from actor_integration.backends.process_groups import ReloadableProcessGroups
    from lifecycle.logs import Event

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {"way": way, "cycles": []}
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend,
            rank=0,
            world_size=1,
            store=new_store(),
            timeout=timedelta(seconds=300),
            communicators=way,
        )
        for i in range(16):
            groups.new_group([0], name=f"g{i}")
        result["first_collectives_s"] = timed(warm_groups)
        with lifecycle.capture_events("debug") as events:
            for _ in range(WAY_CYCLES):
                awake = used_gib()
                mark = len(events)
                free_s = timed(groups.destroy)
                asleep = used_gib()
                back_s = timed(groups.reload)
                after_s = timed(warm_groups)
                destroyed = next(e for e in events[mark:] if e.get("event") == Event.GROUPS_DESTROYED)
                result["cycles"].append(
                    {
                        "free_s": free_s,
                        "freed_gib": None if awake is None or asleep is None else round(awake - asleep, 2),
                        "nccl_freed_gib": None
                        if destroyed.get("bytes") is None
                        else destroyed["bytes"] / GIB,
                        "measured_by": destroyed.get("measured_by"),
                        "held_gib": None
                        if destroyed.get("held_bytes") is None
                        else destroyed["held_bytes"] / GIB,
                        "fell_back": destroyed.get("fell_back"),
                        "back_s": back_s,
                        "first_collectives_s": after_s,
                        "used_awake_gib": awake,
                    }
                )
        groups.close()
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
    Path(out).write_text(json.dumps(result, default=str))
    os._exit(0)


def run_way(cfg: Config, way: str) -> dict[str, Any]:
    return run_spawned(way_main, (cfg, way), cfg.timeout_s, {"way": way})


def suspend_unreachable(cfg: Config) -> str | None:
    """Why communicators="suspend" cannot run here (the children inherit this process's NCCL), or None."""
    from actor_integration.backends.process_groups import nccl_suspend_support

    support = nccl_suspend_support(cfg.backend)
    return None if support.available else support.reason


def with_nccl_library(path: Path, argv: list[str]) -> None:
    """Run this script again with `path` first in LD_PRELOAD, so torch (and every child) uses it."""
    preload = os.environ.get("LD_PRELOAD", "")
    if str(path) in preload.split(":"):
        return
    if not path.exists():
        raise SystemExit(f"--nccl-lib {path}: no such file")
    env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (str(path), preload) if p)}
    print(f"re-running with LD_PRELOAD={env['LD_PRELOAD']}", flush=True)
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


# ---------------------------------------------------------------------------------------------- ceilings


def ceilings(cfg: Config) -> dict[str, float | None]:
    if not cfg.gpu:
        return {"pcie_d2h_gbps": None, "pcie_h2d_gbps": None, "d2d_gbps": None}
    nbytes = 4 * GIB
    buf = {
        "host": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "device": torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        "other": torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    }
    out: dict[str, float | None] = {}
    for key, fn in (
        ("pcie_d2h_gbps", lambda: buf["host"].copy_(buf["device"], non_blocking=True)),
        ("pcie_h2d_gbps", lambda: buf["device"].copy_(buf["host"], non_blocking=True)),
        ("d2d_gbps", lambda: buf["other"].copy_(buf["device"])),
    ):
        fn()
        out[key] = round(nbytes / 1e9 / statistics.median(timed(fn) for _ in range(3)), 1)
    buf.clear()
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- report

# (label, key, counted in the lifecycle total)
ROWS: tuple[tuple[str, str], ...] = (
    ("rollout sleep", "rollout.sleep"),
    ("trainer wake", "wake"),
    ("  memory.resume", "wake.memory.resume"),
    ("  clear_memory", "wake.clear_memory"),
    ("  process_groups.reload", "wake.process_groups.reload"),
    ("train body: 1 collective per group *", "body"),
    ("trainer sleep", "sleep"),
    ("  clear_memory", "sleep.clear_memory"),
    ("  process_groups.destroy", "sleep.process_groups.destroy"),
    ("  memory.pause", "sleep.memory.pause"),
    ("rollout wake weights", "rollout.wake_weights"),
    ("sync", "sync"),
    ("  groups up (process_groups.reload)", "sync.groups_up"),
    ("  transfer", "sync.transfer"),
    ("  groups down (process_groups.destroy)", "sync.groups_down"),
    ("rollout wake kv_cache", "rollout.wake_kv"),
)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    steps: list[dict[str, float]] = result.get("steps") or []
    if not steps:
        return {}
    # Each step's lifecycle first, then the medians: a median of steps minus a median of bodies
    # can pair one step's wall with another's body.
    steps = [{**s, "lifecycle": s["step"] - s.get("body", 0.0)} for s in steps]
    rest = steps[1:] or steps
    keys = {k for s in steps for k in s}
    steady = {k: statistics.median(s.get(k, 0.0) for s in rest) for k in keys}
    return {"first": steps[0], "steady": steady}


def print_report(report: dict[str, Any]) -> None:
    order = [*COLUMNS, *WAY_COLUMNS.values(), *BUDGET_COLUMNS.values(), *SM_COLUMNS]
    shown = [c for c in order if c in report["columns"] and "skipped" not in report["columns"][c]]
    summary = {c: report["summary"].get(c, {}) for c in shown}
    steady = {c: summary[c].get("steady", {}) for c in shown}
    parallel = {
        "wake.memory.resume",
        "wake.process_groups.reload",
        "sleep.process_groups.destroy",
        "sleep.memory.pause",
    }

    def cell(rows: dict[str, float], key: str, mark: bool = False) -> str:
        if key not in rows:
            return "-"
        return f"{rows[key]:.3f}" + (" ||" if mark and key in parallel else "")

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<40} " + " ".join(f"{c:>14}" for c in cells))

    cfg = report["config"]
    print()
    nccl = report.get("nccl_loaded")
    print(
        f"phase switch, one colocated step ({report['device']}, {report['state_gib']:.2f} GiB training state in "
        f"{report['state_tensors']} tensors, {report['weights_gb']:.2f} GB bf16 weights synced, "
        f"groups: {cfg['groups']}, NCCL loaded: {nccl['version'] if nccl else 'none'}); seconds, "
        "steady = median of steps 2..n"
    )
    names = {"slime": "slime-style"}
    line("phase / hook", [names.get(c, c) for c in shown])
    print("-" * (41 + 15 * len(shown)))
    for label, key in ROWS:
        line(label, [cell(steady[c], key, mark=c != "slime") for c in shown])
    print("-" * (41 + 15 * len(shown)))
    for label, key in (
        ("lifecycle per step (step - body)", "lifecycle"),
        ("  trainer's (train-body + sync groups)", "trainer"),
        ("step wall", "step"),
    ):
        line(label, [cell(steady[c], key) for c in shown])
    line("first step: lifecycle", [cell(summary[c].get("first", {}), "lifecycle") for c in shown])
    line("GPU used after the step, GiB (device)", [cell(steady[c], "asleep_used_gib") for c in shown])
    line("groups freed by the sleep, GiB", [cell(steady[c], "sleep.groups_freed_gib") for c in shown])
    ran = [report["columns"].get(c, {}).get("steps") for c in shown]
    line(
        "state intact after every wake", [str(all(r.get("intact") for r in st)) if st else "-" for st in ran]
    )
    for column, result in report["columns"].items():
        if "skipped" in result:
            print(f"{column}: skipped ({result['skipped']})")
    print("|| = hooks of one stage, run together (each its own time; the edge takes the longest)")
    print("*  not lifecycle: the first collective on each group creates the communicators a wake rebuilt")
    c = report["ceilings"]
    if c.get("pcie_d2h_gbps"):
        floor = report["state_gib"] * GIB / 1e9 * (1 / c["pcie_d2h_gbps"] + 1 / c["pcie_h2d_gbps"])
        print(
            f"ceilings (same run): PCIe pinned D2H {c['pcie_d2h_gbps']} GB/s, H2D {c['pcie_h2d_gbps']} GB/s, "
            f"D2D {c['d2d_gbps']} GB/s; the state down and up at PCIe speed = {floor:.3f} s"
        )
    v = report["verdict"]
    if v:
        print(
            f"targets: ours <= {TARGET_S} s of lifecycle per step: {v['ours_lifecycle_s']:.3f} s "
            f"({'met' if v['meets_time'] else 'missed'}); >= {TARGET_RATIO:.0f}x slime-style: "
            f"{v['speedup']:.1f}x ({'met' if v['meets_ratio'] else 'missed'})"
        )
        print("ours, where the lifecycle time goes: " + ", ".join(f"{k} {t:.3f} s" for k, t in v["largest"]))
    t = report.get("teardown") or {}
    if t and "error" not in t:
        print(
            f"teardown, WORLD + 16 subgroups warmed (1 rank): torch's serial destroy {t['serial_destroy_s']:.3f} s "
            f"(freed {t['serial_freed_gib']} GiB); ours (+ gloo side channel) {t['concurrent_destroy_0_s']:.3f} / "
            f"{t['concurrent_destroy_1_s']:.3f} s (freed {t['concurrent_freed_0_gib']} / {t['concurrent_freed_1_gib']} GiB)"
        )
        print(
            f"rebuild: reload {t['reload_0_s']:.3f} s + first collectives one by one {t['lazy_first_collectives_s']:.3f} s; "
            f"reload {t['reload_1_s']:.3f} s + connect() at once {t['connect_s']:.3f} s + the collectives "
            f"{t['after_connect_collectives_s']:.3f} s"
        )
    elif t:
        print(f"teardown section failed: {t['error'][:500]}")
    print_ways(report.get("ways") or {})
    print_budget(report.get("budget") or {})
    for column, result in report["columns"].items():
        if result.get("error"):
            print(f"{column} FAILED: {result['error'][:1500]}")


def print_ways(ways: dict[str, Any]) -> None:
    """The ways section: one row per way, medians over its cycles."""
    if not ways:
        return
    print()
    print(
        "communicators on sleep, WORLD + 16 warmed subgroups (1 rank), seconds and GiB, "
        f"median of {WAY_CYCLES} cycles (freed: device-wide mem_get_info; NCCL: ncclCommMemStats)"
    )
    header = (
        f"{'way':<10} {'free':>8} {'freed':>8} {'NCCL says':>10} {'held':>8} {'bring back':>11} "
        f"{'1st coll.':>10}  notes"
    )
    print(header)
    print("-" * len(header))
    for way in WAYS:
        result = ways.get(way)
        if result is None:
            continue
        if "skipped" in result or "error" in result:
            why = result.get("skipped") or f"FAILED: {result['error'][:300]}"
            print(f"{way:<10} {why}")
            continue
        cycles = result["cycles"]

        def med(key: str, cycles: list[dict[str, Any]] = cycles) -> str:
            values = [c[key] for c in cycles if c.get(key) is not None]
            return f"{statistics.median(values):.3f}" if values else "-"

        fell = [c["fell_back"] for c in cycles if c.get("fell_back")]
        notes = f"fell back: {fell[0]}" if fell else ""
        print(
            f"{way:<10} {med('free_s'):>8} {med('freed_gib'):>8} {med('nccl_freed_gib'):>10} "
            f"{med('held_gib'):>8} {med('back_s'):>11} {med('first_collectives_s'):>10}  {notes}"
        )


def budget_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Per budget column (and ours, the full sleep): need, releases, bytes moved, the trainer's
    lifecycle per step, and its target (issue 31) with the PCIe figures of this run."""
    c = report["ceilings"]
    d2h, h2d = c.get("pcie_d2h_gbps"), c.get("pcie_h2d_gbps")
    rows: dict[str, Any] = {}
    full_column = "full-kv-all" if report["summary"].get("full-kv-all") else "ours"
    full = report["summary"].get(full_column, {}).get("steady")
    for column in ("ours", "full-kv-all", *(BUDGET_COLUMNS[b] for b in BUDGETS), *SM_COLUMNS):
        result = report["columns"].get(column)
        steady = report["summary"].get(column, {}).get("steady")
        if not result or not steady or (column != "ours" and "need" not in result):
            continue
        plans = (result.get("plans") or [])[1:] or (result.get("plans") or [])  # the steady steps'
        released = sorted({tuple(p["released"]) for p in plans}) if plans else []
        row: dict[str, Any] = {
            "trainer_s": steady["trainer"],
            "lifecycle_s": steady["lifecycle"],
            "moved_bytes": steady.get("moved_bytes", 0.0),
            "released": [list(r) for r in released] if budget_of(column) in BUDGETS else None,
            "need_bytes": result.get("need", {}).get("need_bytes"),
            "required_bytes": result.get("need", {}).get("required_bytes"),
            "met_every_check": all(p.get("met") for p in result.get("plans") or [])
            if budget_of(column) in BUDGETS
            else None,
        }
        budget = budget_of(column)
        if budget == "fits":
            row["target_s"], row["target"] = TARGET_FITS_S, f"<= {TARGET_FITS_S:.3f} s"
        elif budget == "part":
            if d2h and h2d:
                floor = row["moved_bytes"] / 1e9 * (1 / d2h + 1 / h2d)
                row["target_s"] = floor + TARGET_PART_SLACK_S
                row["target"] = (
                    f"<= moved / PCIe {floor:.3f} + {TARGET_PART_SLACK_S} = {row['target_s']:.3f} s"
                )
            else:
                row["target_s"], row["target"] = None, "moved / PCIe + 0.1 s: no PCIe figure (CPU)"
        elif budget == "all":
            row["target_s"] = full["trainer"] if full else None
            row["target"] = (
                f"<= the full sleep ({full_column}) {full['trainer']:.3f} s"
                if full
                else "the full sleep: not run"
            )
        if budget in BUDGETS:
            row["met"] = None if row["target_s"] is None else row["trainer_s"] <= row["target_s"]
        rows[column] = row
    return {"pcie_d2h_gbps": d2h, "pcie_h2d_gbps": h2d, "columns": rows} if rows else {}


def print_budget(budget: dict[str, Any]) -> None:
    """The memory-budget section: one row per budget column, ours (the full sleep) first."""
    if not budget:
        return
    print()
    pcie = (
        f"PCIe in this run: D2H {budget['pcie_d2h_gbps']} GB/s, H2D {budget['pcie_h2d_gbps']} GB/s"
        if budget["pcie_d2h_gbps"]
        else "no PCIe figure (CPU)"
    )
    print(
        "memory budget (issue 31): the rollout's KV cache sized so the trainer's sleep must release nothing, "
        f"part, or all; steady = median of steps 2..n; trainer = its lifecycle per step; {pcie}"
    )
    header = (
        f"{'column':<14} {'need GiB':>9} {'to free':>9} {'released':<34} {'moved GiB':>10} "
        f"{'trainer s':>10} {'lifecycle s':>12}  target"
    )
    print(header)
    print("-" * (len(header) + 40))
    for column, row in budget["columns"].items():
        need = "-" if row["need_bytes"] is None else f"{row['need_bytes'] / GIB:.2f}"
        required = "-" if row["required_bytes"] is None else f"{max(0, row['required_bytes']) / GIB:.2f}"
        if row["released"] is None:
            released = "everything (no budget)"
        else:
            released = " / ".join(", ".join(r) or "nothing" for r in row["released"]) or "-"
        target = row.get(
            "target",
            "(today's full sleep)" if column == "ours" else "(the full sleep, rollout as budget-all)",
        )
        if "met" in row:
            target += "" if row["met"] is None else (": met" if row["met"] else ": MISSED")
        if row["met_every_check"] is False:
            target += "; a check found the need not free"
        print(
            f"{column:<14} {need:>9} {required:>9} {released:<34} {row['moved_bytes'] / GIB:>10.2f} "
            f"{row['trainer_s']:>10.3f} {row['lifecycle_s']:>12.3f}  {target}"
        )
    print(
        "to free: GiB the sleep had to free (need + margin - free at the sleep); moved: each released tag down at the "
        "sleep and up at the next wake (so twice over PCIe)"
    )


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    slime, ours = summary.get("slime", {}).get("steady"), summary.get("ours", {}).get("steady")
    if not slime or not ours:
        return {}
    parts = {
        k: ours[k]
        for k in ("rollout.sleep", "wake", "sleep", "rollout.wake_weights", "sync", "rollout.wake_kv")
        if k in ours
    }
    return {
        "ours_lifecycle_s": ours["lifecycle"],
        "slime_lifecycle_s": slime["lifecycle"],
        "speedup": slime["lifecycle"] / ours["lifecycle"],
        "meets_time": ours["lifecycle"] <= TARGET_S,
        "meets_ratio": slime["lifecycle"] / ours["lifecycle"] >= TARGET_RATIO,
        "largest": sorted(parts.items(), key=lambda kv: -kv[1])[:3],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, gloo, no-op memory (CI)")
    parser.add_argument("--groups", choices=("megatron", "subgroups"), default=None)
    parser.add_argument("--steps", type=int, default=4, help="steps of ours (the first is reported apart)")
    parser.add_argument("--slime-steps", type=int, default=2, help="steps of slime-style (1: first only)")
    parser.add_argument("--kv-gib", type=float, default=4.0, help="the rollout's KV cache (GiB)")
    parser.add_argument("--no-teardown", action="store_true", help="skip the teardown/rebuild section")
    parser.add_argument(
        "--ways",
        default=",".join(WAYS),
        help="ways of treating the communicators on sleep, as columns and in their own section "
        "(comma-separated: destroy,suspend,keep; '' for none beyond ours)",
    )
    parser.add_argument(
        "--way-steps", type=int, default=3, help="steps of the ours-suspend and ours-keep columns"
    )
    parser.add_argument(
        "--budget",
        default=",".join(BUDGETS),
        help="memory-budget columns: the rollout's need set so the trainer's sleep releases nothing (fits), "
        "part, or all (comma-separated; '' for none)",
    )
    parser.add_argument(
        "--sm-restore",
        action="store_true",
        help="also budget-part-sm: budget-part with `params` restored by the SMs (device_restore)",
    )
    parser.add_argument(
        "--columns",
        default=None,
        help="run only these columns (comma-separated, e.g. ours,budget-fits; default: every column)",
    )
    parser.add_argument(
        "--nccl-lib",
        type=Path,
        help="a libnccl.so.2 to run with (LD_PRELOAD, every child too), e.g. nvidia-nccl-cu13 2.30.7's",
    )
    parser.add_argument("--timeout", type=float, default=400.0, help="per process, seconds")
    args = parser.parse_args(argv)
    if args.nccl_lib is not None:
        with_nccl_library(args.nccl_lib.resolve(), sys.argv[1:] if argv is None else argv)
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {unknown}; the ways are {list(WAYS)}")
    budgets = [b for b in args.budget.split(",") if b]
    if [b for b in budgets if b not in BUDGETS]:
        parser.error(
            f"--budget: unknown {[b for b in budgets if b not in BUDGETS]}; they are {list(BUDGETS)}"
        )
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_phase_switch needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    sizes = SMOKE if args.cpu_smoke else Sizes(kv_cache_bytes=int(args.kv_gib * GIB))
    cfg = Config(
        sizes=sizes,
        device="cpu" if args.cpu_smoke else "cuda",
        groups=args.groups or ("subgroups" if args.cpu_smoke else "megatron"),
        steps=max(args.steps, 2),
        slime_steps=max(args.slime_steps, 1),
        timeout_s=args.timeout,
    )
    started = time.perf_counter()
    params = sizes.parameters()
    state_bytes = sum(_numel(s) for _, s in params) * (2 + 4 + 4 + 4 + 2)
    from actor_integration.backends.process_groups import loaded_nccl

    loaded = loaded_nccl()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cfg.gpu else "cpu (smoke)",
        "torch": torch.__version__,
        "nccl_loaded": None
        if loaded is None
        else {"version": ".".join(map(str, loaded.version)), "path": loaded.path},
        "config": {**asdict(cfg), "sizes": asdict(sizes)},
        "state_gib": state_bytes / GIB,
        "state_tensors": 5 * len(params),
        "weights_gb": sum(_numel(s) for _, s in params) * 2 / 1e9,
        "ceilings": ceilings(cfg),
        "columns": {},
    }
    unreachable = suspend_unreachable(cfg)
    columns = planned_columns(ways, budgets, args.sm_restore)
    if args.columns is not None:
        chosen = [c for c in args.columns.split(",") if c]
        if [c for c in chosen if c not in columns]:
            missing = [c for c in chosen if c not in columns]
            hint = "; budget-part-sm needs --sm-restore" if any(c in SM_COLUMNS for c in missing) else ""
            parser.error(f"--columns: {missing} not among {columns}{hint}")
        columns = [c for c in columns if c in chosen]

    def save() -> None:  # what a run cut short leaves behind
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2, default=str))

    for column in columns:
        if way_of(column) == "suspend" and unreachable:
            print(f"{column} skipped: {unreachable}", flush=True)
            report["columns"][column] = {"column": column, "skipped": unreachable}
            continue
        print(f"running {column} ...", flush=True)
        column_cfg = cfg if column in COLUMNS else replace(cfg, steps=max(args.way_steps, 2))
        report["columns"][column] = run_column(column, column_cfg)
        save()
    report["ways"] = {}
    for way in ways:
        if way == "suspend" and unreachable:
            print(f"ways section, suspend skipped: {unreachable}", flush=True)
            report["ways"][way] = {"way": way, "skipped": unreachable}
            continue
        print(f"ways section: {way} on WORLD + 16 subgroups ...", flush=True)
        report["ways"][way] = run_way(cfg, way)
        save()
    report["teardown"] = {} if args.no_teardown else run_teardown(cfg)
    report["summary"] = {c: summarize(r) for c, r in report["columns"].items() if "skipped" not in r}
    report["verdict"] = verdict(report["summary"])
    report["budget"] = budget_verdict(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(report)
    print(f"total {report['wall_s']} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    failed = [c for c, r in report["columns"].items() if "error" in r]
    failed += [w for w, r in report["ways"].items() if "error" in r]
    return 1 if failed or "error" in report["teardown"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""bench_phase_switch.py's shared parts: its constants, the model shape (`Sizes`), the run's
`Config`, and the helpers every process of it uses (timing, the training state, the no-op saver,
the store, a spawned process's result, the PCIe and D2D ceilings)."""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
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
SMOKE_DEVICE = 24 << 20  # --cpu-smoke: the simulated device the budget plans on (bytes)
SMOKE_GROUPS = 2 << 20  # --cpu-smoke: what the simulated communicators hold while alive
WAY_CYCLES = 2  # the ways section: destroy and bring back, this many times per way


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

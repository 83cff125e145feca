"""What a slime job on a CPU machine stands in for: only what needs a GPU, Megatron-LM or SGLang (tests only).

Each name here is re-exported by a one-line module written over slime's own file (or as a package
of its own on the job's path) by `tests.helpers.slime_job`; every other module of slime runs as
it is. The choices:

- Megatron-LM's argument parser (megatron-core has none): the flags of Megatron's slime reads on
  this path, then slime's own (its `extra_args_provider`), so slime's own `parse_args`, HF check
  and validation run on the job's command line; SGLang's `ServerArgs` adds its flags as SGLang's does.
- the accelerator and memory helpers: a CPU plays the device and gloo the accelerator backend (so
  slime takes its production path of destroying and rebuilding WORLD).
- Megatron's model, training step, checkpoint: a tiny torch model, one SGD step, a recorded save;
  Megatron's parallel state itself is megatron-core's, initialised as slime's `init` does.
- the weight push (CUDA IPC buckets): slime's own sequence of engine calls around it (pause, flush,
  `update_weights_from_tensor` per engine with the parameter names, continue), no tensors.
- SGLang's server: `FakeSGLangServer` (tests/helpers/sglang_server.py) in the process slime spawns;
  it dies with the engine actor that started it.
- torch_memory_saver: the Python API of slime's pinned fork (`ForkMemorySaver`), whose preload
  library the launcher finds next to the package (an empty file: the loader ignores it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import signal
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.slime_source import NoPinnedTorch
from tests.helpers.tms import ForkMemorySaver

# ---------------------------------------------------------------------------------------------- Megatron-LM's parser


# Megatron-LM's flags a slime job reads on this path (megatron/training/arguments.py), with Megatron's
# defaults; slime's own parser (its extra_args_provider) adds and re-defaults the rest.
MEGATRON_FLAGS: dict[str, tuple[Any, Any]] = {
    "--tensor-model-parallel-size": (int, 1),
    "--pipeline-model-parallel-size": (int, 1),
    "--virtual-pipeline-model-parallel-size": (int, None),
    "--context-parallel-size": (int, 1),
    "--expert-model-parallel-size": (int, 1),
    "--expert-tensor-parallel-size": (int, None),
    "--num-layers": (int, None),
    "--hidden-size": (int, None),
    "--ffn-hidden-size": (int, None),
    "--num-attention-heads": (int, None),
    "--num-query-groups": (int, None),
    "--kv-channels": (int, None),
    "--moe-ffn-hidden-size": (int, None),
    "--moe-shared-expert-intermediate-size": (int, None),
    "--num-experts": (int, None),
    "--norm-epsilon": (float, 1e-5),
    "--rotary-base": (int, 10000),
    "--seq-length": (int, None),
    "--max-position-embeddings": (int, None),
    "--vocab-size": (int, None),
    "--make-vocab-size-divisible-by": (int, 128),
    "--tokenizer-model": (str, None),
    "--tokenizer-type": (str, None),
    "--normalization": (str, "LayerNorm"),
    "--position-embedding-type": (str, "learned_absolute"),
    "--rope-type": (str, None),
    "--ckpt-step": (int, None),
    "--optimizer": (str, "adam"),
    "--min-lr": (float, 0.0),
    "--lr-decay-style": (str, "linear"),
    "--weight-decay": (float, 0.01),
    "--adam-beta1": (float, 0.9),
    "--adam-beta2": (float, 0.999),
    "--attention-dropout": (float, 0.1),
    "--hidden-dropout": (float, 0.1),
    "--transformer-impl": (str, "transformer_engine"),
    "--spec": (str, None),
    "--decoder-first-pipeline-num-layers": (int, None),
    "--decoder-last-pipeline-num-layers": (int, None),
    "--moe-token-dispatcher-type": (str, "allgather"),
}
MEGATRON_SWITCHES = (
    "--fp16",
    "--bf16",
    "--untie-embeddings-and-output-weights",
    "--swiglu",
    "--group-query-attention",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--use-distributed-optimizer",
    "--no-load-optim",
    "--no-load-rng",
    "--finetune",
    "--use-rotary-position-embeddings",
    "--multi-latent-attention",
    "--sequence-parallel",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion",
    "--use-pytorch-profiler",
)


def megatron_parse_args(
    extra_args_provider: Any = None, ignore_unknown_args: bool = False
) -> argparse.Namespace:
    """megatron.training.arguments.parse_args: Megatron-LM's flags on this path, then slime's (its provider)."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)", allow_abbrev=False)
    for flag, (kind, default) in MEGATRON_FLAGS.items():
        parser.add_argument(flag, type=kind, default=default)
    for flag in MEGATRON_SWITCHES:
        parser.add_argument(flag, action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args, unknown = parser.parse_known_args()
    if unknown and not ignore_unknown_args:
        raise SystemExit(f"unrecognized arguments: {unknown}")
    args.layernorm_epsilon = args.norm_epsilon  # Megatron keeps the old name as an alias
    return args


def megatron_validate_args(args: Any, defaults: Any = None) -> Any:
    """megatron.training.arguments.validate_args: not its checks of a GPU run, only the values it derives
    that slime reads (the attention's head size and groups, the MLP's width)."""
    if args.kv_channels is None and args.hidden_size and args.num_attention_heads:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention or args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None and args.hidden_size:
        args.ffn_hidden_size = 4 * args.hidden_size
    return args


def vocab_size_with_padding(orig_vocab_size: int, args: Any, logging_enabled: bool = True) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return (orig_vocab_size + multiple - 1) // multiple * multiple


# slime.utils.accelerator for a CPU process: gloo plays the accelerator backend.
def initialize_accelerator() -> None:
    return None


def process_group_backend(backend: str | None = None) -> str:
    return "gloo"


def is_accelerator_backend(backend: Any) -> bool:
    return str(backend) == "gloo"


def set_device(index: Any) -> None:
    return None


def set_allocator_expandable_segments() -> bool:
    return False


def current_device() -> torch.device:
    return torch.device("cpu")


def synchronize(*_: Any, **__: Any) -> None:
    return None


def empty_cache() -> None:
    return None


def ipc_collect() -> None:
    return None


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return (64 << 30, 80 << 30)


def memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def resolve_visible_device_id(index: Any) -> int:
    return int(index)


def device_type() -> str:
    return "cpu"


def get_device_properties(device: Any = None) -> Any:
    return types.SimpleNamespace(uuid="cpu")


ACCELERATOR = [
    "initialize_accelerator",
    "process_group_backend",
    "is_accelerator_backend",
    "set_device",
    "set_allocator_expandable_segments",
    "current_device",
    "synchronize",
    "empty_cache",
    "ipc_collect",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "resolve_visible_device_id",
    "device_type",
    "get_device_properties",
]


# slime.utils.memory_utils
def clear_memory(clear_host_memory: bool = False) -> None:
    return None


def available_memory() -> dict[str, Any]:
    return {"gpu": "cpu", "total_GB": 80.0, "free_GB": 64.0}


def print_memory(msg: str, clear_before_print: bool = False) -> dict[str, Any]:
    info = available_memory()
    print(
        f"[Rank {dist.get_rank() if dist.is_initialized() else '-'}] Memory-Usage {msg}: {info}", flush=True
    )
    return info


MEMORY_UTILS = ["clear_memory", "available_memory", "print_memory"]


NO_PINNED_TORCH = NoPinnedTorch()


# ---------------------------------------------------------------------------------------------- Megatron


def init(args: Any) -> None:
    """slime's initialize.init, for its process groups: Megatron's from the parsed flags."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        order="tp-cp-ep-dp-pp",
    )
    torch.manual_seed(args.seed)


def is_megatron_main_rank() -> bool:
    from megatron.core import parallel_state as mpu

    return bool(mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1)


def initialize_model_and_optimizer(args: Any, role: str) -> tuple[Any, ...]:
    model = [torch.nn.Linear(4, 4)]
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    return model, optimizer, types.SimpleNamespace(), -1


def train(
    rollout_id: int, model: Any, optimizer: Any, scheduler: Any, data_iterator: Any, *rest: Any
) -> None:
    loss = model[0](torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save(rollout_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
    return None


def forward_only(*_: Any, **__: Any) -> dict[str, Any]:
    return {}


def load_checkpoint(*_: Any, **__: Any) -> tuple[int, int]:
    return 0, 0


class DataIterator:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def reset(self) -> None:
        return None


def get_data_iterator(data: Any) -> list[DataIterator]:
    return [DataIterator(data)]


def named_params_and_buffers(args: Any, model: Any, convert_to_global_name: bool = True) -> Iterator[Any]:
    for index, chunk in enumerate(model):
        for name, tensor in chunk.named_parameters():
            yield f"{index}.{name}", tensor


MEGATRON = {
    "initialize": ["init", "is_megatron_main_rank"],
    "model": ["initialize_model_and_optimizer", "train", "save", "forward_only"],
    "checkpoint": ["load_checkpoint"],
    "data": ["DataIterator", "get_data_iterator"],
}
NO_OPS = {
    "hf_checkpoint_saver": ["save_hf_model_to_path"],
    "loss": [
        "compute_advantages_and_returns",
        "drain_captured_log_probs",
        "enable_log_prob_capture",
        "get_log_probs_and_entropy",
        "get_values",
    ],
}


def no_op(*_: Any, **__: Any) -> None:
    return None


class UpdateWeightFromTensor:
    """slime's colocated weight push: its own sequence of engine calls, the parameter names for the tensors."""

    def __init__(self, args: Any, model: Any, weights_getter: Any, **kwargs: Any) -> None:
        self.args, self.weights_getter = args, weights_getter
        self.weight_version = 0
        self.rollout_engines: list[Any] = []

    def connect_rollout_engines(self, rollout_engines: Any, rollout_engine_lock: Any, **kwargs: Any) -> None:
        self.rollout_engines = list(rollout_engines)

    def update_weights(self) -> None:
        import ray
        from slime.utils.distributed_utils import get_gloo_group

        from tests.helpers.sglang_server import encode_names

        self.weight_version += 1
        engines = self.rollout_engines
        if dist.get_rank() == 0:
            ray.get([e.pause_generation.remote() for e in engines])
            ray.get([e.flush_cache.remote() for e in engines])
        dist.barrier(group=get_gloo_group())
        names = sorted(self.weights_getter())
        if dist.get_rank() == 0:
            payload = [encode_names(names)]
            ray.get(
                [
                    e.update_weights_from_tensor.remote(
                        serialized_named_tensors=payload,
                        load_format="flattened_bucket",
                        weight_version=str(self.weight_version),
                    )
                    for e in engines
                ]
            )
            ray.get([e.continue_generation.remote() for e in engines])
        dist.barrier(group=get_gloo_group())

    def pop_metrics(self) -> dict[str, Any]:
        return {}


UpdateWeightFromDisk = type("UpdateWeightFromDisk", (), {})
UpdateWeightFromDistributed = type("UpdateWeightFromDistributed", (), {})


# ---------------------------------------------------------------------------------------------- SGLang


GPU_MEMORY_TYPE_WEIGHTS = "weights"
GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"

# The ServerArgs fields slime sets or reads (sglang_engine.py), and those the wrap adds.
SERVER_FIELDS = (
    "model_path",
    "trust_remote_code",
    "random_seed",
    "enable_memory_saver",
    "host",
    "port",
    "nccl_port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "skip_server_warmup",
    "enable_draft_weights_cpu_backup",
    "enable_metrics",
    "mem_fraction_static",
    "api_key",
    "custom_weight_loader",
    "enable_weights_cpu_backup",
    "dtype",
    "moe_dp_size",
    "enable_dp_attention",
)
# SGLang's own defaults for the fields slime compares or computes with.
_SERVER_DEFAULTS: dict[str, Any] = {
    "dp_size": 1,
    "pp_size": 1,
    "ep_size": 1,
    "moe_dp_size": 1,
    "tp_size": 1,
    "enable_dp_attention": False,
}


def _url(self: Any) -> str:
    return f"http://{self.host}:{self.port}"


def _reduce(self: Any) -> tuple[Any, ...]:
    return (types.SimpleNamespace, (), dict(vars(self)))  # what the spawned launch_server reads


_SERVER_FLAG_TYPES = {
    "mem_fraction_static": float,
    "dp_size": int,
    "pp_size": int,
    "ep_size": int,
    "moe_dp_size": int,
}


def _add_cli_args(parser: argparse.ArgumentParser) -> None:
    """ServerArgs.add_cli_args: one flag per field (slime's wrapper prefixes `--sglang-` and skips its own)."""
    for name in SERVER_FIELDS:
        flag = f"--{name.replace('_', '-')}"
        if isinstance(_SERVER_DEFAULTS.get(name), bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(
                flag, type=_SERVER_FLAG_TYPES.get(name, str), default=_SERVER_DEFAULTS.get(name)
            )


ServerArgs = dataclasses.make_dataclass(
    "ServerArgs",
    [(name, Any, dataclasses.field(default=_SERVER_DEFAULTS.get(name))) for name in SERVER_FIELDS],
    namespace={"url": _url, "__reduce__": _reduce, "add_cli_args": staticmethod(_add_cli_args)},
)


def kill_process_tree(pid: int, include_parent: bool = True, **_: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def launch_server(server_args: Any) -> None:
    """SGLang's launch_server in the process slime spawns: the fake server, dying with its parent."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no server outlives its engine actor
    from tests.helpers.sglang_server import launch_server as fake_launch_server

    fake_launch_server(server_args)


class RouterArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, **_: Any) -> None:
        return None  # the router's own flags: the job's router is the test's FakeRouter

    @classmethod
    def from_cli_args(cls, *_: Any, **__: Any) -> RouterArgs:
        raise AssertionError("the job's router is the test's FakeRouter: --sglang-router-ip is given")


class HTTPStatusError(Exception):
    def __init__(self, message: str, response: Any) -> None:
        super().__init__(message)
        self.response = response


class _Response:
    def __init__(self, reply: Any) -> None:
        self.status_code, self.content, self.text = reply.status_code, reply.content, reply.text

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise HTTPStatusError(f"{self.status_code}: {self.text[:200]}", self)

    async def aread(self) -> bytes:
        return bytes(self.content)

    async def aclose(self) -> None:
        return None


class AsyncClient:
    """httpx.AsyncClient (not installed here) over `requests` in a thread: what slime's rollout posts through."""

    def __init__(self, *_: Any, **__: Any) -> None:
        return None

    async def post(self, url: str, json: Any = None, headers: Any = None) -> _Response:
        import asyncio

        import requests

        reply = await asyncio.to_thread(requests.post, url, json=json, headers=headers, timeout=300)
        return _Response(reply)

    async def get(self, url: str) -> _Response:
        import asyncio

        import requests

        return _Response(await asyncio.to_thread(requests.get, url, timeout=300))


class _Settings:
    def __init__(self, *_: Any, **__: Any) -> None:
        return None


Limits = Timeout = _Settings


# ---------------------------------------------------------------------------------------------- torch_memory_saver


torch_memory_saver = ForkMemorySaver(init_enable=True)
PRELOAD_LIBRARY = "torch_memory_saver_hook_mode_preload_cu13.abi3.so"
FORK_LIBRARY_EXPORTS = (
    "tms_set_interesting_region",
    "tms_get_interesting_region",
    "tms_set_current_tag",
    "tms_get_current_tag",
    "tms_get_enable_cpu_backup",
    "tms_set_enable_cpu_backup",
    "tms_get_enable_disk_backup",
    "tms_set_enable_disk_backup",
    "tms_set_disk_backup_dir",
    "set_memory_margin_bytes",
    "tms_pause",
    "tms_resume",
    "tms_get_cpu_backup_pointer",
)


def get_binary_path_from_package(stem: str) -> Path:
    """torch_memory_saver.utils' lookup: the library the launcher found next to the package."""
    return Path(os.environ["SLIME_JOB_SITE"]) / PRELOAD_LIBRARY

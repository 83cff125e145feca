"""What a miles job on a CPU machine stands in for: only what needs a GPU, Megatron-LM or SGLang (tests only).

miles kept most of slime's seams, so the stand-ins are slime_job's (tests.helpers.slime_job.stand_ins)
where miles' module has slime's names, and miles' own below where it does not:

- SGLang's `ServerArgs`: slime's fields and the ones miles' parser and validation read.
- Megatron's model, training step, checkpoint and parallel state: as slime_job's (a linear layer,
  one SGD step, a recorded save; megatron-core's parallel state initialised as miles' `init` does).
- miles' data path into the trainer: miles' own `process_rollout_data` (the rollout's batch through
  Ray's object store), then the tokens as CPU tensors.
- miles' perf log: miles' own `train_metric_utils.log_perf_data_raw` (its Timer, its tracking), on
  the one rank, without Megatron's FLOPs count.
- `torch` in miles' modules that select a CUDA device (`CPU_TORCH`).
- the weight push: slime_job's sequence of engine calls (pause, flush, `update_weights_from_tensor`
  with the parameter names, continue), no tensors; train_async's non-colocated senders use it too.
- httpx: slime_job's client over `requests`, with `json()` and the fields of SGLang's /generate
  reply miles reads that the fake server leaves out; optional decoding and training times
  (`GENERATE_SECONDS_ENV`, `TRAIN_SECONDS_ENV`) and one printed line per /generate (`GENERATED`),
  so a test can see train_async's rollout run while a step trains.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import types
from typing import Any

import torch

from tests.helpers.slime_job import stand_ins as slime

# The ServerArgs fields miles reads beyond slime's (miles/utils/arguments.py, sglang_engine.py at 31f1ca96).
MILES_SERVER_FIELDS: dict[str, Any] = {
    "config": None,
    "chat_template": None,
    "cuda_graph_backend_prefill": None,
    "enable_deterministic_inference": False,
    "enable_prefill_only_deterministic_inference": False,
    "experts_shared_outer_loras": False,
    "moe_a2a_backend": None,
    "moe_runner_backend": None,
    "reasoning_parser": None,
    "speculative_algorithm": None,
    "tool_call_parser": None,
    "enable_return_routed_experts": False,
    "enable_return_indexer_topk": False,
}
_DEFAULTS = {
    **{name: slime._SERVER_DEFAULTS.get(name) for name in slime.SERVER_FIELDS},
    **MILES_SERVER_FIELDS,
}


def _add_cli_args(parser: argparse.ArgumentParser) -> None:
    """ServerArgs.add_cli_args: one flag per field (miles' wrapper prefixes `--sglang-` and skips its own)."""
    for name, default in _DEFAULTS.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=slime._SERVER_FLAG_TYPES.get(name, str), default=default)


ServerArgs = dataclasses.make_dataclass(
    "ServerArgs",
    [(name, Any, dataclasses.field(default=default)) for name, default in _DEFAULTS.items()],
    namespace={"url": slime._url, "__reduce__": slime._reduce, "add_cli_args": staticmethod(_add_cli_args)},
)


class DumperConfig:
    """SGLang's dumper config (sglang.srt.debug_utils.dumper): miles reads its per-phase overrides; off here."""

    @staticmethod
    def _kv_pairs_to_dict(raw: Any) -> dict[str, Any]:
        if not raw:
            return {}
        return dict(pair.split("=", 1) for pair in (raw if isinstance(raw, list) else str(raw).split()))


def _get_rank() -> int:
    return 0


# ---------------------------------------------------------------------------------------------- Megatron-LM's parser

# Megatron-LM's flags a miles job reads on this path beyond slime's (with Megatron's defaults).
MILES_MEGATRON_FLAGS: dict[str, tuple[Any, Any]] = {
    "--distributed-timeout-minutes": (int, 10),
    "--micro-batch-size": (int, 1),
    "--lr": (float, None),
    "--lr-warmup-iters": (int, 0),
    "--seed": (int, 1234),
    "--non-persistent-ckpt-type": (str, None),
    "--profile-step-start": (int, 10),
    "--profile-step-end": (int, 12),
    "--tensorboard-dir": (str, None),
    "--memory-snapshot-path": (str, "snapshot.pickle"),
}
MILES_MEGATRON_SWITCHES = ("--record-memory-history", "--async-save")


def megatron_parse_args(
    extra_args_provider: Any = None, ignore_unknown_args: bool = False
) -> argparse.Namespace:
    """megatron.training.arguments.parse_args: slime_job's flags and those miles reads, then miles' own."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        known = {a for action in parser._actions for a in action.option_strings}
        for flag, (kind, default) in MILES_MEGATRON_FLAGS.items():
            if flag not in known:
                parser.add_argument(flag, type=kind, default=default)
        for flag in MILES_MEGATRON_SWITCHES:
            if flag not in known:
                parser.add_argument(flag, action="store_true")
        return extra_args_provider(parser) if extra_args_provider is not None else parser

    return slime.megatron_parse_args(provider, ignore_unknown_args)


megatron_validate_args = slime.megatron_validate_args


# ---------------------------------------------------------------------------------------------- torch on a CPU


class _CpuTorch:
    """torch for miles' modules on a CPU: no device to select or synchronise, no pinned host memory."""

    cuda = types.SimpleNamespace(
        set_device=lambda device: None,
        synchronize=lambda *a, **k: None,
        current_device=lambda: torch.device("cpu"),
        is_available=lambda: False,
        empty_cache=lambda: None,
        mem_get_info=lambda device=None: (64 << 30, 80 << 30),
        memory_allocated=lambda device=None: 0,
        memory_reserved=lambda device=None: 0,
    )

    _C = types.SimpleNamespace(_host_emptyCache=lambda: None)  # miles' clear_memory(clear_host_memory=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return torch.empty_like(tensor, **kwargs)


CPU_TORCH = _CpuTorch()


# ---------------------------------------------------------------------------------------------- Megatron


class TrainStepOutcome(enum.Enum):
    NORMAL = "normal"
    SKIPPED = "skipped"


def init(args: Any, **kwargs: Any) -> None:
    """miles' initialize.init, for its process groups: Megatron's from the parsed flags."""
    slime.init(args)


def is_first_replica_megatron_main_rank() -> bool:
    return slime.is_megatron_main_rank()


def get_parallel_state() -> Any:
    from megatron.core import parallel_state as mpu

    one = types.SimpleNamespace(size=1, rank=0, group=None)
    dp = types.SimpleNamespace(
        size=mpu.get_data_parallel_world_size(), rank=mpu.get_data_parallel_rank(), group=None
    )
    return types.SimpleNamespace(
        intra_dp=dp,
        effective_dp=dp,
        effective_dp_cp=dp,
        dp=dp,
        tp=one,
        cp=one,
        vpp_size=None,
        microbatch_group_size_per_vp_stage=None,
        is_pp_last_stage=is_first_replica_megatron_main_rank(),
        indep_dp=None,
    )


def initialize_model_and_optimizer(args: Any, role: str, **kwargs: Any) -> tuple[Any, ...]:
    return slime.initialize_model_and_optimizer(args, role)


TRAIN_SECONDS_ENV = "MILES_JOB_TRAIN_SECONDS"  # how long each training step takes (unset: at once)


def train(
    rollout_id: int, model: Any, optimizer: Any, scheduler: Any, data_iterator: Any, *rest: Any, **kw: Any
) -> Any:
    import os
    import time

    time.sleep(float(os.environ.get(TRAIN_SECONDS_ENV, "0")))  # Megatron's forward and backward
    slime.train(rollout_id, model, optimizer, scheduler, data_iterator)
    return TrainStepOutcome.NORMAL


save = slime.save
forward_only = slime.forward_only
named_params_and_buffers = slime.named_params_and_buffers


def load_checkpoint(*_: Any, **__: Any) -> tuple[int, int]:
    return 0, 0


class DataIterator(slime.DataIterator):
    pass


def get_data_iterator(args: Any, model: Any, data: Any) -> tuple[list[DataIterator], list[int]]:
    return [DataIterator(data)], [1]


def get_num_rollouts(args: Any, data: Any, num_steps: int) -> int:
    return 1


def get_rollout_data(
    args: Any, rollout_data_ref: Any, witness_info: Any = None
) -> tuple[dict[str, Any], Any]:
    """miles' get_rollout_data: its own process_rollout_data over the Ray object store, tokens on the CPU."""
    from miles.utils.data import process_rollout_data

    state = get_parallel_state()
    data, got = process_rollout_data(
        args, rollout_data_ref, state.effective_dp.rank, state.effective_dp.size, witness_info=witness_info
    )
    data["tokens"] = [torch.tensor(t, dtype=torch.long) for t in data["tokens"]]
    return data, got if got is not None else contextlib.nullcontext()


def log_perf_data(rollout_id: int, args: Any, extra_metrics: dict[str, Any] | None = None) -> None:
    """miles' log_perf_data on the one rank: its own log_perf_data_raw (Timer's entries to its tracking)."""
    from miles.utils import train_metric_utils

    train_metric_utils.log_perf_data_raw(
        rollout_id=rollout_id,
        args=args,
        is_primary_rank=True,
        compute_total_fwd_flops=lambda seq_lens: 0.0,
        extra_metrics=extra_metrics,
    )


def log_cpu_memory(rollout_id: int, args: Any, label: str) -> None:
    from miles.utils.metric_utils import compute_rollout_step
    from miles.utils.tracking_utils import tracking

    print(f"[CPU memory] {label} (rollout_id={rollout_id})", flush=True)
    tracking.log(
        args,
        {f"perf/cpu_memory_{label}_gb": 1.0, "rollout/step": compute_rollout_step(args, rollout_id)},
        step_key="rollout/step",
    )


def no_op(*_: Any, **__: Any) -> None:
    return None


class UpdateWeightFromTensor:
    """miles' weight push, its sequence of engine calls (pause, flush, `update_weights_from_tensor` per
    engine with the parameter names, continue) on rank 0, no tensors; the non-colocated senders too."""

    def __init__(self, args: Any, model: Any, weights_getter: Any, **kwargs: Any) -> None:
        self.args, self.weights_getter = args, weights_getter
        self.weight_version = 0
        self.rollout_engines: list[Any] = []

    def is_rollout_engines_fresh(self) -> bool:
        return bool(self.rollout_engines)

    def connect_rollout_engines(self, rollout_engines: Any, rollout_engine_lock: Any, **kwargs: Any) -> None:
        self.rollout_engines = list(rollout_engines)

    def update_weights(self) -> None:
        import ray
        import torch.distributed as dist
        from miles.utils.distributed_utils import get_gloo_group

        from tests.helpers.sglang_server import encode_names

        self.weight_version += 1
        engines = self.rollout_engines
        names = sorted(self.weights_getter())
        if dist.get_rank() == 0:
            ray.get([e.pause_generation.remote() for e in engines])
            ray.get([e.flush_cache.remote() for e in engines])
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


UpdateWeightFromDistributed = UpdateWeightP2P = UpdateWeightFromTensor
InMemoryCheckpointManager = type("InMemoryCheckpointManager", (), {})


# miles' path -> (names re-exported from here, why)
_MEGATRON = "miles/backends/megatron_utils"
_TRAINING = "miles/backends/training_utils"
OVERLAYS: dict[str, tuple[tuple[str, ...], str]] = {
    f"{_MEGATRON}/initialize.py": (("init", "is_first_replica_megatron_main_rank"), "Megatron's init"),
    f"{_MEGATRON}/model.py": (
        ("TrainStepOutcome", "forward_only", "initialize_model_and_optimizer", "save", "train"),
        "Megatron's model and training step need a GPU",
    ),
    f"{_MEGATRON}/checkpoint.py": (("load_checkpoint",), "Megatron's checkpoint"),
    f"{_MEGATRON}/update_weight/common.py": (("named_params_and_buffers",), "Megatron's names"),
    f"{_MEGATRON}/update_weight/update_weight_from_tensor.py": (
        ("UpdateWeightFromTensor",),
        "CUDA IPC buckets need a GPU",
    ),
    f"{_MEGATRON}/update_weight/update_weight_from_distributed/broadcast.py": (
        ("UpdateWeightFromDistributed",),
        "NCCL broadcast needs a GPU",
    ),
    f"{_MEGATRON}/update_weight/update_weight_from_distributed/p2p.py": (("UpdateWeightP2P",), "unused"),
    f"{_MEGATRON}/ft/in_memory_checkpoint.py": (("InMemoryCheckpointManager",), "unused"),
    f"{_TRAINING}/parallel.py": (("get_parallel_state",), "Megatron's parallel state, as miles reads it"),
    f"{_TRAINING}/data.py": (
        ("DataIterator", "get_data_iterator", "get_num_rollouts", "get_rollout_data"),
        "Megatron's micro-batches",
    ),
    f"{_TRAINING}/log_utils.py": (
        ("log_perf_data", "log_cpu_memory"),
        "miles' own perf log without Megatron's FLOPs",
    ),
}
# miles' modules whose functions are no-ops here: path -> names
NO_OPS: dict[str, tuple[str, ...]] = {
    f"{_TRAINING}/log_utils.py": ("log_rollout_data",),
    f"{_TRAINING}/loss.py": (
        "compute_advantages_and_returns",
        "get_log_probs_and_entropy",
        "get_values",
        "log_train_advantage_computation_event",
    ),
    f"{_TRAINING}/replay_data.py": ("fill_replay_data", "register_replay_list_sequential"),
    f"{_MEGATRON}/ft/checkpoint_transfer.py": ("recv_ckpt", "send_ckpt"),
    f"{_MEGATRON}/ft/indep_dp.py": ("reconfigure_indep_dp_group",),
    f"{_MEGATRON}/parallel.py": ("verify_megatron_parallel_state",),
    f"{_MEGATRON}/replay_utils.py": ("register_replay_list_moe",),
}
# miles' modules kept as they are but for `import torch` (they select a CUDA device)
CPU_TORCH_MODULES = (
    "miles/backends/megatron_utils/actor.py",
    "miles/ray/train_actor.py",
    "miles/utils/memory_utils.py",
    "miles/utils/tensor_backper.py",
)


# ---------------------------------------------------------------------------------------------- httpx


GENERATE_SECONDS_ENV = "MILES_JOB_GENERATE_SECONDS"  # how long each /generate takes (unset: at once)
GENERATED = "[miles_job] /generate"  # the line each /generate request prints: its start and end (epoch s)


class _Response(slime._Response):
    def __init__(self, reply: Any, url: str = "") -> None:
        super().__init__(reply)
        self.url = url

    def json(self) -> Any:
        import json

        body = json.loads(self.content)
        if self.url.endswith("/generate"):
            for output in body if isinstance(body, list) else [body]:
                _as_sglang_generate(output)
        return body


def _as_sglang_generate(output: dict[str, Any]) -> None:
    """The fields of SGLang's /generate reply miles reads that the fake server leaves out: the
    generated tokens with their log-probs (`return_logprob`), why generation stopped, the counts."""
    meta = output.setdefault("meta_info", {})
    tokens = list(output.get("output_ids") or [])
    meta.setdefault("output_token_logprobs", [[-1.0, token, None] for token in tokens])
    meta.setdefault("finish_reason", {"type": "length", "length": len(tokens)})
    meta.setdefault("completion_tokens", len(tokens))
    meta.setdefault("cached_tokens", 0)


class HTTPError(Exception):
    pass


class HTTPStatusError(slime.HTTPStatusError, HTTPError):
    pass


class AsyncClient(slime.AsyncClient):
    """slime_job's httpx.AsyncClient with what miles' http_utils reads besides (`json()`, `async with`)."""

    async def post(self, url: str, json: Any = None, headers: Any = None) -> _Response:
        if not url.endswith("/generate"):
            return _Response(await super().post(url, json=json, headers=headers), url)
        import asyncio
        import os
        import time

        started = time.time()
        await asyncio.sleep(float(os.environ.get(GENERATE_SECONDS_ENV, "0")))  # the engine's decoding time
        reply = _Response(await super().post(url, json=json, headers=headers), url)
        print(f"{GENERATED} {started:.3f} {time.time():.3f}", flush=True)
        return reply

    async def get(self, url: str) -> _Response:
        return _Response(await super().get(url), url)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


Limits = Timeout = slime.Limits

"""The `lifecycle demo` options: importing them (and `lifecycle demo --help`) imports neither torch nor Ray."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from lifecycle import faults
from lifecycle.faults import Fault
from lifecycle.policy import LifecyclePolicy
from lifecycle.table import Hook, hooks_used

# The demo's trainer (`trainer.py` builds it with these) and what its rollout's machine is made of
# (`RolloutActor`'s policy and hook slots; a test keeps the two equal).
TRAINER_POLICY = LifecyclePolicy(offload_train=True, memory_tags=("model",))
TRAINER_SLOTS = frozenset(
    {Hook.PROCESS_GROUPS_DESTROY, Hook.PROCESS_GROUPS_RELOAD, Hook.CLEAR_MEMORY, Hook.SWITCH_MODEL}
)
ROLLOUT_MACHINE = LifecyclePolicy(
    memory_tags=("weights", "kv_cache"), destroy_process_groups=False, model_tag=None
)
ROLLOUT_SLOTS = frozenset({Hook.GENERATION_PAUSE, Hook.GENERATION_RESUME})
ROLE_HOOKS = {
    "trainer": tuple(h.value for h in hooks_used(TRAINER_POLICY.view(), TRAINER_POLICY.tags, TRAINER_SLOTS)),
    "rollout": tuple(
        h.value for h in hooks_used(ROLLOUT_MACHINE.view(), ROLLOUT_MACHINE.tags, ROLLOUT_SLOTS)
    ),
}
TINY_HEADS = 4  # the reference model's attention heads (`placement.py` builds it with these)
DEMO_ENGINES = ("reference", "sglang", "vllm")  # the registered engines the demo drives
# The real engines: each serves the trainer's Qwen model (--model-config) on its own GPU.
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
REFERENCE_ONLY = {"hidden": 256, "layers": 4}  # the reference model's shape options and their defaults
MEM_FRACTION = 0.15  # a real engine's share of its GPU unless --mem-fraction says otherwise
# What each real engine's --mem-fraction is, and what --kill-engine kills there.
ENGINE_FRACTION = {"sglang": "SGLang's mem_fraction_static", "vllm": "vLLM's gpu_memory_utilization"}
ENGINE_PROCESS = {"sglang": "SGLang's scheduler", "vllm": "vLLM's EngineCore process"}
# What each step generates from: PROMPTS prompts of PROMPT_LEN random tokens. A real SGLang engine
# captures its CUDA graphs for those sizes only (decode batches up to PROMPTS, prefills up to
# PROMPTS * PROMPT_LEN tokens), not for the 256-512 sequences and 8192-token prefills SGLang sizes
# them for on an 80 GB GPU (with those, the engine's first start on an H100 took 183 s).
PROMPTS, PROMPT_LEN = 8, 8


def refuse(message: str) -> NoReturn:
    """Stop the demo with a one-line usage error (exit code 2), before or instead of any work."""
    print(f"lifecycle demo: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_fault(text: str) -> Fault:
    """`[trainer:|rollout:]HOOK@STEP` → (role, hook, step): `lifecycle.faults.parse_fault`, as an option."""
    try:
        return faults.parse_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--inject-fault {exc}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from actor_integration.rollout.registry import engine_names  # the engines registered by name

    parser.add_argument("--steps", type=_positive, default=6, help="RL steps to run (default 6)")
    parser.add_argument(
        "--trainers",
        type=_positive,
        default=None,
        help="trainer ranks (default: one per GPU on a GPU host, 2 on CPU)",
    )
    parser.add_argument(
        "--engines",
        type=_positive,
        default=None,
        help="rollout engines on CPU (reference engine), splitting the trainer ranks into that many slots "
        "(default 1), each kept on one node and spread over the cluster's nodes; on a GPU host each GPU has "
        "its own engine",
    )
    parser.add_argument(
        "--save-every", type=_positive, default=2, help="checkpoint every K steps (default 2)"
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "cuda_ipc", "shm", "disk"],
        default="auto",
        help="weight transport (default auto: cuda_ipc where CUDA IPC export works, shm otherwise; "
        "--engine vllm takes cuda_ipc or shm)",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if available"
    )
    parser.add_argument(
        "--out", default="lifecycle-demo-out", help="output directory for logs, checkpoints, timeline"
    )
    parser.add_argument(
        "--inject-fault",
        type=parse_fault,
        action="append",
        default=[],
        metavar="[ROLE:]HOOK@STEP",
        help="make HOOK raise at STEP on every rank of ROLE (default trainer), then recover; repeatable",
    )
    parser.add_argument(
        "--skip-sync",
        type=_positive,
        action="append",
        default=[],
        metavar="STEP",
        help="skip the weight sync of STEP (before the last): the next generation is refused on the "
        "discarded weights (InvalidWeightsError), then the demo syncs and generates; repeatable",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster (HOST:PORT) instead of starting a local one; the demo says what it found "
        "(nodes, CPUs, GPUs), where each slot went and the transport per pair of nodes",
    )
    parser.add_argument(
        "--engine",
        choices=list(engine_names()),
        default="reference",
        help="rollout engine: the reference torch engine (default, CPU or GPU), or on each GPU a real "
        "sglang.Engine or vllm.LLM (vllm 0.26.0, level-2 sleep, weights into its workers; passed on an "
        "H100); sglang and vllm need --model-config and a GPU, the trainer then trains that Qwen2/Qwen3 model. "
        "Every other option applies to all three unless its help names an engine",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        metavar="DIR",
        help="with --engine sglang or vllm: a Hugging Face Qwen2/Qwen3 config directory (e.g. "
        "configs/qwen2-tiny); the engine serves it with dummy weights until the first sync, the trainer trains it",
    )
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help=f"with --engine sglang or vllm: the engine's share of its GPU for weights + KV cache (SGLang's "
        f"mem_fraction_static, vLLM's gpu_memory_utilization; default {MEM_FRACTION})",
    )
    parser.add_argument(
        "--corrupt-sync",
        type=_positive,
        action="append",
        default=[],
        metavar="STEP",
        help="corrupt one bucket of STEP's weight sync after it was packed: the engine refuses the round "
        "(CorruptBucketError, nothing written) and the trainer sends it again; repeatable",
    )
    parser.add_argument(
        "--kill-engine",
        type=_positive,
        default=None,
        metavar="STEP",
        help="with --engine sglang or vllm: kill SGLang's scheduler or vLLM's EngineCore process at the start "
        "of STEP; the demo shows the typed error (EngineDiedError) and ends",
    )
    parser.add_argument(
        "--no-memory-budget",
        action="store_true",
        help="the trainer's every sleep releases everything (default: a memory budget releases only what "
        "the rollout's declared wake need requires, docs/memory-budget.md)",
    )
    parser.add_argument("--bucket-mb", type=_positive, default=64, help="weight-sync bucket size in MiB")
    parser.add_argument(
        "--hidden", type=_positive, default=None, help="with --engine reference: model width (default 256)"
    )
    parser.add_argument(
        "--layers", type=_positive, default=None, help="with --engine reference: model depth (default 4)"
    )
    parser.add_argument(
        "--timeout-s", type=_seconds, default=120.0, help="deadline for every cross-actor wait (seconds, > 0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of the live display"
    )


def check_demo_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with options that argparse checks one by one, or None; checked before anything starts.
    With None, the engine-specific options left out hold their defaults (`--hidden`, `--mem-fraction`, ...)."""
    late = sorted(step for step in set(args.skip_sync) if step >= args.steps)
    if late:
        return (
            f"--skip-sync {late[0]}: the refusal shows at the generation after the skipped sync, so the step "
            f"must come before the last one (--steps {args.steps}); use a step below {args.steps} or raise --steps"
        )
    faults = sorted(step for _, _, step in args.inject_fault if step > args.steps)
    if faults:
        return f"--inject-fault at step {faults[0]} never runs: the demo has --steps {args.steps}"
    for role, hook, step in args.inject_fault:
        if hook not in ROLE_HOOKS[role]:
            return (
                f"--inject-fault {role}:{hook}@{step}: the demo's {role} never calls {hook}; its hooks are "
                f"{list(ROLE_HOOKS[role])}"
            )
    if args.engine == "reference" and args.hidden is not None and args.hidden % TINY_HEADS:
        return (
            f"--hidden {args.hidden}: the reference model has {TINY_HEADS} attention heads, so its width must be "
            f"a multiple of {TINY_HEADS} (e.g. 256)"
        )

    corrupt = sorted(step for step in set(args.corrupt_sync) if step > args.steps or step in args.skip_sync)
    if corrupt:
        return (
            f"--corrupt-sync {corrupt[0]}: that step's sync never runs (--steps {args.steps}, --skip-sync "
            f"{sorted(args.skip_sync)}); pick a step that syncs"
        )
    if args.engine not in DEMO_ENGINES:
        return (
            f"--engine {args.engine}: the demo drives {list(DEMO_ENGINES)}; {args.engine}'s adapter is tested on "
            f"CPU against its own source, and its demo comes with its first GPU run (docs/frameworks/{args.engine}.md)"
        )
    if args.engine in ENGINE_NAMES:
        problem = _check_engine_arguments(args)
        if problem is not None:
            return problem
    else:
        given = (
            ("--model-config", args.model_config),
            ("--kill-engine", args.kill_engine),
            ("--mem-fraction", args.mem_fraction),
        )
        for flag, value in given:
            if value is not None:
                return (
                    f"{flag} is for --engine sglang or vllm (the reference engine has no model config, engine "
                    "process or memory fraction)"
                )
    problem = _check_out(args.out)  # last: the only check that makes something (the output directory)
    if problem is None:
        for name, default in REFERENCE_ONLY.items():
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
        args.mem_fraction = MEM_FRACTION if args.mem_fraction is None else args.mem_fraction
    return problem


def _check_out(out: str) -> str | None:
    """Whether the output directory can be made and written (the logs, checkpoints and timeline go there)."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".lifecycle-demo-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"--out {out}: cannot write there ({exc.strerror or exc}); pick a writable directory"
    return None


def check_address(address: str, timeout_s: float) -> None:
    """Refuse (exit 2) an --address where nothing answers, within `timeout_s`, before Ray is asked
    (Ray itself retries an unreachable GCS for minutes)."""
    from actor_integration.tools.doctor import unreachable

    problem = unreachable(address, min(timeout_s, 10.0))
    if problem is not None:
        refuse(f"--address {address}: {problem}; start one with `ray start --head` or leave --address out")


def _check_engine_arguments(args: argparse.Namespace) -> str | None:
    """--engine sglang or vllm: the model config, the options that apply, the engine installed."""
    engine, name = args.engine, ENGINE_NAMES[args.engine]
    if args.model_config is None:
        return (
            f"--engine {engine} needs --model-config DIR: a Qwen2/Qwen3 config.json (e.g. configs/qwen2-tiny)"
        )
    config = Path(args.model_config) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"--model-config {args.model_config}: cannot read {config} as JSON ({exc})"
    if data.get("model_type") not in ("qwen2", "qwen3"):
        return (
            f"--model-config {args.model_config}: model_type is {data.get('model_type')!r}; the demo's trainer "
            f"builds Qwen2 or Qwen3 (actor_integration.models.qwen2), so {name} serves what it trains"
        )
    if args.device == "cpu":
        return f"--engine {engine} needs a GPU: {name}'s engine runs on CUDA (--device cpu was asked for)"
    for option in REFERENCE_ONLY:
        if getattr(args, option) is not None:
            return (
                f"--{option} is for --engine reference: {name} serves the --model-config model, whose shape "
                f"is its config's ({config})"
            )
    if args.engines is not None:
        return f"--engines is for the reference engine on CPU: with --engine {engine} each GPU has its own engine"
    if args.mem_fraction is not None and not 0.0 < args.mem_fraction < 0.9:
        return f"--mem-fraction {args.mem_fraction}: {ENGINE_FRACTION[engine]} is a fraction in (0, 0.9)"
    if args.kill_engine is not None and args.kill_engine > args.steps:
        return f"--kill-engine {args.kill_engine} never runs: the demo has --steps {args.steps}"
    if engine == "vllm":
        if args.transport == "disk":
            return (
                "--transport disk: vLLM's workers open the trainer's buffers themselves, from cuda_ipc or shm "
                "(auto picks cuda_ipc on a GPU)"
            )
        if importlib.util.find_spec("vllm") is None:
            return (
                "--engine vllm needs vllm 0.26.0, which is not installed here: pip install 'rl-lifecycle[vllm]' "
                "(docs/frameworks/vllm.md)"
            )
    return None

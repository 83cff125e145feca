"""Where the demo's actors run: Ray, the device, one trainer rank per GPU sharing it with an engine."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from actor_integration.actors.ray_group import LifecycleGroup
from actor_integration.tools.demo.options import refuse

VOCAB = 97


@dataclass(frozen=True)
class Placement:
    """The started actors, their lifecycle groups, and what the trainers reported from `init`."""

    device: str
    engine: str  # "reference" or "sglang"
    vocab: int  # the model's vocabulary (prompts are drawn from it)
    wake_rest: tuple[str, ...]  # the rollout tags its wake resumes after the weights and the sync
    trainers: int
    engine_gpu_counts: list[int]
    trainer_actors: list[Any]
    rollout_actors: list[Any]
    trainer_group: LifecycleGroup
    rollout_group: LifecycleGroup
    infos: list[dict[str, Any]]

    @property
    def transport(self) -> str:
        name: str = self.infos[0]["transport"]
        return name


def start_ray(args: argparse.Namespace, console: Console) -> Any:
    import ray

    if args.address:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
        console.print(f"joined Ray cluster at {args.address}: {ray.cluster_resources()}")  # type: ignore[no-untyped-call]
    else:
        ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    return ray


def resolve_device(requested: str, transport: str = "auto") -> str:
    """The device the demo runs on; refuses what this machine cannot do before Ray starts."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda asked for, but torch sees no GPU (see `lifecycle doctor`)")
    device = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and transport == "cuda_ipc":
        refuse("--transport cuda_ipc needs CUDA, and the demo runs on the CPU here: use shm (or auto)")
    return device


def place(ray: Any, args: argparse.Namespace, device: str, out: Path, console: Console) -> Placement:
    """Start the rollout engines and the trainer ranks, initialise the trainers (asleep, as slime's)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actor_integration.tools.demo.rollout import DemoRollout, DemoSGLangRollout
    from actor_integration.tools.demo.trainer import DemoTrainer

    gpus = int(ray.cluster_resources().get("GPU", 0))
    trainers = args.trainers or (max(gpus, 1) if device == "cuda" else 2)
    if device == "cuda" and args.engines not in (None, trainers):
        refuse(
            f"on a GPU host every GPU has its own 1-GPU engine ({trainers}); --engines "
            f"{args.engines} is for CPU runs"
        )
    if device == "cuda" and trainers > gpus:
        refuse(
            f"{trainers} trainer ranks need {trainers} GPUs (one rank per GPU: NCCL refuses two "
            f"ranks on one GPU, 'Duplicate GPU detected'); this cluster has {gpus}"
        )
    engine = getattr(args, "engine", "reference")
    if engine == "sglang" and device != "cuda":
        refuse("--engine sglang needs a GPU (SGLang runs on CUDA); torch sees none")
    if engine == "sglang":
        from actor_integration.models.qwen2 import QwenConfig

        config_dir = str(Path(args.model_config).resolve())
        try:
            vocab = QwenConfig.from_json(config_dir).vocab_size
        except ValueError as exc:
            refuse(f"--model-config {args.model_config}: {exc}")
        model: dict[str, Any] = {"qwen_config": config_dir, "seed": args.seed}
    else:
        vocab = VOCAB
        model = {
            "vocab_size": VOCAB,
            "dim": args.hidden,
            "n_layers": args.layers,
            "n_heads": 4,
            "max_seq_len": 64,
            "seed": args.seed,
        }
    # GPU: one 1-GPU engine per trainer GPU, each sharing it (0.5 + 0.5). CPU: one engine over
    # `trainers` virtual devices, so the slot has several ranks and one coordinator.
    if device == "cuda":
        engine_gpu_counts = [1] * trainers
        pg = placement_group([{"GPU": 1, "CPU": 1}] * trainers, strategy="PACK")
        ray.get(pg.ready(), timeout=args.timeout_s)

        def options(i: int) -> dict[str, Any]:
            return {
                "num_gpus": 0.5,
                "num_cpus": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            }

        rollout_options = [options(i) for i in range(trainers)]
        rollout_devices = [["cuda:0"] for _ in range(trainers)]
    else:
        engines = args.engines or 1
        if trainers % engines:
            refuse(f"--engines {engines} must divide the {trainers} trainer ranks into equal slots")
        engine_gpu_counts = [trainers // engines] * engines

        def options(i: int) -> dict[str, Any]:
            return {"num_cpus": 0}

        rollout_options = [options(i) for i in range(engines)]
        rollout_devices = [["cpu"] * count for count in engine_gpu_counts]
    console.print(
        f"[bold]lifecycle demo[/]: {trainers} trainer rank(s) on {device}, {len(engine_gpu_counts)} rollout "
        f"engine(s) ({engine}) of {engine_gpu_counts} device(s), {args.steps} steps, checkpoint every {args.save_every}, "
        f"transport {args.transport}, output {out}"
    )
    trainer_cls = ray.remote(DemoTrainer)
    if engine == "sglang":
        sglang_cls = ray.remote(DemoSGLangRollout)
        rollouts = [
            sglang_cls.options(**opts).remote(
                config_dir=model["qwen_config"],
                rank=i,
                out=str(out),
                mem_fraction=args.mem_fraction,
                seed=args.seed,
                timeout_s=args.timeout_s,
            )
            for i, opts in enumerate(rollout_options)
        ]
        # SGLang starts in the actors' constructors: wait for it here, not inside the trainers' deadline.
        started = time.monotonic()
        described = ray.get(
            [r.describe_engine.remote() for r in rollouts], timeout=max(args.timeout_s, 300.0)
        )
        wake_rest = tuple(t for t in described[0]["memory_tags"] if t != "weights")
        console.print(
            f"SGLang {described[0]['sglang']} up on {len(rollouts)} GPU(s) in {time.monotonic() - started:.1f} s: "
            f"tags {described[0]['memory_tags']}, weights via {described[0]['weights_via']}, CUDA graphs "
            f"{'on' if described[0]['cuda_graphs'] else 'off'}"
        )
    else:
        wake_rest = ("kv_cache",)
        rollout_cls = ray.remote(DemoRollout)
        rollouts = [
            rollout_cls.options(**opts).remote(model=model, devices=devs, rank=i, out=str(out))
            for i, (opts, devs) in enumerate(zip(rollout_options, rollout_devices, strict=True))
        ]
    actors = [trainer_cls.options(**options(i)).remote() for i in range(trainers)]
    init_method = ray.get(actors[0].rendezvous.remote(), timeout=args.timeout_s)
    infos = ray.get(
        [
            a.init.remote(
                rank=i,
                world_size=trainers,
                init_method=init_method,
                device=device,
                model=model,
                engine_gpu_counts=engine_gpu_counts,
                rollouts=rollouts,
                transport=args.transport,
                bucket_mb=args.bucket_mb,
                memory_budget=not getattr(args, "no_memory_budget", False),
                out=str(out),
                timeout_s=args.timeout_s,
            )
            for i, a in enumerate(actors)
        ],
        timeout=args.timeout_s * 2,
    )
    console.print(
        f"trainer memory: {infos[0]['memory']}; weight transport: [bold]{infos[0]['transport']}[/]; "
        f"slot coordinators: {[i['rank'] for i in infos if i['coordinator']]}"
    )
    placed = Placement(
        device=device,
        engine=engine,
        vocab=vocab,
        wake_rest=wake_rest,
        trainers=trainers,
        engine_gpu_counts=engine_gpu_counts,
        trainer_actors=actors,
        rollout_actors=rollouts,
        trainer_group=LifecycleGroup(actors, timeout_s=args.timeout_s),
        rollout_group=LifecycleGroup(rollouts, timeout_s=args.timeout_s),
        infos=infos,
    )
    placed.trainer_group.assert_consistent()
    return placed

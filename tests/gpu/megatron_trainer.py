"""A slime-shaped Megatron trainer on one GPU, run as a script by test_megatron_trainer_gpu.py.

    python tests/gpu/megatron_trainer.py mixin WORKDIR      # through LifecycleMixin: must succeed
    python tests/gpu/megatron_trainer.py raw_pre1888 WORKDIR  # raw TMS calls, slime before #1888: must fail

Each scenario runs in its own process (TMS's hook mode and Megatron's parallel state are process
globals, and a CUDA error on paused memory poisons the context) and writes WORKDIR/result.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from actor_integration import (
    ClearMemory,
    CpuWeightBackup,
    LifecycleMixin,
    MegatronParallelState,
    ModelTagSwitch,
    ReloadableProcessGroups,
    TorchMemorySaverBackend,
)
from actor_integration.backends.model_tag import named_model_tensors
from lifecycle import Hooks, LifecyclePolicy, State
from tests.helpers.models import tiny_gpt_model

BATCH, SEQ, VOCAB = 4, 32, 128


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


class MegatronTrainer:
    """The existing actor class: builds the model in a saver region; train/save_model as in slime."""

    def init(self, workdir: Path) -> None:
        torch.cuda.set_device(0)
        self.workdir = workdir
        groups = ReloadableProcessGroups.init(
            backend="nccl",
            rank=0,
            world_size=1,
            init_method=f"file://{workdir}/store",
            device_id=torch.device("cuda:0"),
        )
        self.parallel = MegatronParallelState(
            groups, tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
        self.memory = TorchMemorySaverBackend(tags=("model",), cpu_backup=True, hook_mode="torch")
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).cuda()
        self.positions = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
        self.mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1).expand(
            BATCH, 1, SEQ, SEQ
        )
        with self.memory.region("model"):
            self.model = tiny_gpt_model(
                num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=VOCAB
            )
            self.parallel.register(self.model)
            # ~1 GiB of optimizer-sized ballast so the release shows in mem_get_info.
            self.ballast = torch.ones(256 << 20, device="cuda")
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=5e-3)
            self.losses = [self._step()]  # materialises Adam's state inside the region
        self.backup = CpuWeightBackup()
        self.backup.backup("actor", named_model_tensors(self.model))

    def _step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.ids, self.positions, self.mask, labels=self.ids).float().mean()
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def train(self, rollout_id: int) -> float:
        with self.memory.region("model"):
            loss = self._step()
        self.backup.backup("actor", named_model_tensors(self.model))
        self.losses.append(loss)
        return loss

    def save_model(self, rollout_id: int) -> dict[str, torch.Tensor]:
        path = self.workdir / f"ckpt-{rollout_id}"
        dcp.save({"model": self.model.state_dict()}, checkpoint_id=str(path))
        torch.cuda.synchronize()
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if torch.is_tensor(v)}


class LifecycleMegatronTrainer(LifecycleMixin, MegatronTrainer):
    def init(self, workdir: Path) -> None:
        super().init(workdir)
        self.configure_lifecycle(
            LifecyclePolicy(offload_train=True, memory_tags=("model",)),
            Hooks(
                memory=self.memory,
                process_groups=self.parallel,
                clear_memory=ClearMemory(host=True),
                switch_model=ModelTagSwitch(self.backup, lambda: self.model),
            ),
            rank=0,
            role="actor",
        )
        self.sleep()


def reload_and_compare(workdir: Path, rollout_id: int, saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    fresh = tiny_gpt_model(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=VOCAB, seed=99)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(workdir / f"ckpt-{rollout_id}"))
    fresh.load_state_dict(state["model"])
    loaded = {k: v.detach().cpu() for k, v in fresh.state_dict().items() if torch.is_tensor(v)}
    mismatched = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    return {"tensors": len(saved), "mismatched": mismatched}


def run_mixin(workdir: Path) -> dict[str, Any]:
    trainer = LifecycleMegatronTrainer()
    free_before = free_gib()
    trainer.init(workdir)
    result: dict[str, Any] = {"free_gib_start": free_before, "free_gib_asleep_after_init": free_gib()}
    t0 = time.perf_counter()
    loss = trainer.train(1)  # PAUSED → wake → step → sleep
    result["train_s"] = time.perf_counter() - t0
    result["state_after_train"] = trainer.lifecycle.state.value
    result["free_gib_after_train"] = free_gib()
    saved = trainer.save_model(1)  # from PAUSED: resume + reload, save, re-pause (#1886/#1888)
    result["state_after_save"] = trainer.lifecycle.state.value
    trainer.wake_up()
    result["free_gib_awake"] = free_gib()
    result["reload"] = reload_and_compare(workdir, 1, saved)
    live = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    result["live_equals_saved"] = all(torch.equal(live[k], saved[k]) for k in saved)
    result["losses"] = [*trainer.losses[:1], loss, trainer.train(2)]
    result["state_end"] = trainer.lifecycle.state.value
    assert trainer.lifecycle.state is State.PAUSED
    return result


def run_raw_pre1888(workdir: Path) -> dict[str, Any]:
    """slime before #1888: train() ends with a raw pause; save_model then reads paused memory."""
    from torch_memory_saver import torch_memory_saver

    trainer = MegatronTrainer()
    trainer.init(workdir)
    trainer.train(1)
    torch_memory_saver.pause("model")  # what train() did at its end (offload_train)
    print("saving on paused memory", flush=True)
    trainer.save_model(1)  # expected to raise a CUDA error
    return {"saved": True}


if __name__ == "__main__":
    mode, workdir = sys.argv[1], Path(sys.argv[2])
    workdir.mkdir(parents=True, exist_ok=True)
    outcome = run_mixin(workdir) if mode == "mixin" else run_raw_pre1888(workdir)
    (workdir / "result.json").write_text(json.dumps(outcome, indent=2))
    print(json.dumps(outcome), flush=True)

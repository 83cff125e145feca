"""`lifecycle demo --engine vllm` on CPU, as far as CPU allows: the demo's vLLM rollout actor
(`DemoVLLMRollout`, its fault injector, its kill) over the fake vLLM 0.26.0 (every call bound to the
wheel's signatures, its workers the real `LifecycleWorkerExtension`), driven by the demo's own step
driver (`StepDriver`) through an in-process `LifecycleGroup`, with the GPU run's flags (a skipped
sync, a rollout fault, a corrupt round) and `--kill-engine` on a real child process standing for
EngineCore. What only a GPU shows (vLLM's real memory, CUDA IPC, Ray actors) is not here: the GPU
session runs `lifecycle demo --engine vllm` itself.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from actor_integration.actors.ray_group import LifecycleGroup
from actor_integration.engines.vllm import VLLMEngine
from actor_integration.errors import GroupCallError
from actor_integration.tools.demo.progress import Progress
from actor_integration.tools.demo.rollout import DemoVLLMRollout, vllm_arguments
from actor_integration.tools.demo.step import StepDriver
from actor_integration.tools.demo.trainer import DemoTrainer, TinyTrainer, _with_wrong_checksum
from lifecycle import checker
from lifecycle.errors import InjectedFault
from lifecycle.logs import read_logs
from tests.helpers.vllm_fake import VOCAB, FakeLLM, sampling_params, weights
from tests.helpers.vllm_source import construct
from tests.helpers.weight_sync_doubles import shm_sender

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs" / "qwen2-tiny")
ENGINE_ARGS = "vllm.engine.arg_utils.EngineArgs"


class InProcessGroup(LifecycleGroup):
    """`LifecycleGroup` over actors in this process: its own `call`/`call_each` without Ray, a rank's
    error kept as the `GroupCallError` of Ray's fan-out keeps it (the exception the actor raised).
    Everything else (sleep, wake_up, states, recover, stale, assert_consistent) is the real group's."""

    def call(self, method, *args, timeout_s=None, ranks=None, **kwargs):
        targets = self.actors if ranks is None else {r: self.actors[r] for r in ranks}
        return self._each(method, {r: (args, kwargs) for r in targets})

    def call_each(self, method, args_by_rank, *, timeout_s=None):
        return self._each(method, {r: (tuple(a), {}) for r, a in args_by_rank.items()})

    def _each(self, method, calls):
        results, errors = {}, {}
        for rank, (args, kwargs) in calls.items():
            try:
                results[rank] = getattr(self.actors[rank], method)(*args, **kwargs)
            except Exception as exc:
                errors[rank] = exc
        if errors:  # what the step driver reads of it: the errors by rank
            raise GroupCallError(
                f"{method} raised on ranks {sorted(errors)}", operation=method, errors=errors
            )
        return results


class TrainerStandIn:
    """`DemoTrainer`'s methods the step driver calls, with its signatures (a test checks them), over
    the fake's weight set: `train` moves to the next set, `update_weights` sends the current one
    through a real shm `WeightSender` into the rollout actor (the demo's corruption of the first
    bucket on --corrupt-sync). It has no lifecycle of its own: it reports itself PAUSED."""

    def __init__(self, rollout: DemoVLLMRollout) -> None:
        self.seed, self.expected, self._corrupt_next = 1, None, False
        self.sender = shm_sender(self._engine_call, bucket_bytes=1 << 10)
        self.rollout = rollout

    def _engine_call(self, version: int, payloads: list[Any]) -> Any:
        if self._corrupt_next:
            self._corrupt_next = False
            payloads = [_with_wrong_checksum(payloads[0]), *payloads[1:]]
        return self.rollout.update_weights(version, payloads)

    def lifecycle_step(self, step: int) -> None:
        pass

    def arm_fault(self, hook: str) -> None:
        raise AssertionError(f"the GPU run arms no trainer fault ({hook})")

    def lifecycle_expect(self, need_bytes: int | None) -> dict[str, Any]:
        self.expected = need_bytes
        return self.lifecycle_state()

    def train(self, step: int, samples: list[list[int]]) -> dict[str, Any]:
        self.seed += 1
        return {"rank": 0, "loss": 1.0 / self.seed}

    def save_model(self, step: int) -> dict[str, Any]:
        return {"rank": 0, "path": "", "bytes": 0, "reload_ok": True}

    def sleep(self, tags: Any = None) -> None:
        pass

    def update_weights(self, version: int) -> dict[str, Any]:
        report = self.sender.send(version, weights(self.seed).items())
        return {  # DemoTrainer.update_weights' fields
            "rank": 0,
            "version": version,
            "resends": report.resends,
            "bytes": report.nbytes,
            "seconds": report.duration_s,
            "transport": report.transport,
            "peak_rss_growth_mib": None,
        }

    def weights_checksum(self) -> str:
        return f"seed {self.seed}"

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [[0] * max_new_tokens for _ in prompts]

    def corrupt_next_sync(self) -> None:
        self._corrupt_next = True

    def lifecycle_state(self) -> dict[str, Any]:
        return {"state": "PAUSED", "residency": {"model": "released"}}


def demo_rollout(fake, vllm_tree, tmp_path, made: list[dict[str, Any]] | None = None) -> DemoVLLMRollout:
    """The demo's vLLM actor as `placement` starts it, its `VLLMEngine` over the fake's `LLM`."""

    def engine(**arguments: Any) -> VLLMEngine:
        if made is not None:
            made.append(dict(arguments))
        return VLLMEngine(
            FakeLLM(fake),
            sleep_level=arguments["sleep_level"],
            sampling_params=sampling_params(vllm_tree),
        )

    return DemoVLLMRollout(
        config_dir=TINY, rank=0, out=str(tmp_path), mem_fraction=0.15, seed=0, engine=engine
    )


def gpu_run_args(**changes: Any) -> argparse.Namespace:
    """The GPU run's options (scripts/gpu_vllm.sh): --steps 5 --save-every 2 --skip-sync 2
    --inject-fault rollout:memory.pause@3 --corrupt-sync 4."""
    args = argparse.Namespace(
        steps=5,
        save_every=2,
        skip_sync=[2],
        inject_fault=[("rollout", "memory.pause", 3)],
        corrupt_sync=[4],
        kill_engine=None,
        seed=0,
        timeout_s=60.0,
        no_memory_budget=False,
    )
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def driver_over(rollout: DemoVLLMRollout, args: argparse.Namespace) -> tuple[StepDriver, io.StringIO]:
    trainer = TrainerStandIn(rollout)
    rollouts = InProcessGroup([rollout], role="rollout")
    placed = argparse.Namespace(
        engine="vllm",
        vocab=VOCAB,
        trainers=1,
        trainer_group=InProcessGroup([trainer], role="trainer"),
        rollout_group=rollouts,
        rollout_actors=[rollout],
        wake_rest=tuple(t for t in rollout.describe_engine()["memory_tags"] if t != "weights"),
        transport="shm",
    )
    text = io.StringIO()
    log = Progress(Console(file=text, width=200), args.steps, plain=True)
    return StepDriver(placed, args, log), text  # type: ignore[arg-type]


class TestTheActor:
    def test_the_engine_arguments_are_vllms_and_the_fraction_is_its_gpu_memory_utilization(
        self, fake, vllm_tree, tmp_path
    ):
        made: list[dict[str, Any]] = []
        demo_rollout(fake, vllm_tree, tmp_path, made)
        (arguments,) = made
        assert arguments == vllm_arguments(TINY, mem_fraction=0.15, seed=0)
        assert arguments["gpu_memory_utilization"] == 0.15 and arguments["load_format"] == "dummy"
        from actor_integration.engines.vllm.offline import llm_arguments

        llm = llm_arguments({k: v for k, v in arguments.items() if k != "sleep_level"}, worker_receiver=True)
        construct(vllm_tree, ENGINE_ARGS, llm)  # every argument LLM hands EngineArgs binds to 0.26.0's
        assert arguments["sleep_level"] == 2

    def test_it_describes_its_engine_and_logs_to_its_ranks_file(self, fake, vllm_tree, tmp_path):
        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        described = rollout.describe_engine()
        assert (described["engine"], described["memory_tags"], described["weights_via"]) == (
            "vllm",
            ["weights", "kv_cache"],
            "worker_extension",
        )
        assert described["sleep_level"] == 2 and described["cuda_graphs"] is False and "version" in described
        assert rollout.lifecycle_log_path() == str(tmp_path / "logs" / "rollout-rank0.jsonl")
        assert rollout.lifecycle.policy.discard_on_release == ("weights", "kv_cache")  # level 2

    def test_a_rollout_fault_in_the_release_fails_and_recovers_with_one_vllm_sleep(
        self, fake, vllm_tree, tmp_path
    ):
        """The GPU run's `rollout:memory.pause`: raised before vLLM's sleep, the actor FAILED with both
        tags resident; recover(PAUSED) then sleeps both tags in one vLLM sleep (vLLM cannot release one)."""
        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        rollout.arm_fault("memory.pause")
        with pytest.raises(InjectedFault, match=r"memory\.pause"):
            rollout.sleep()
        state = rollout.lifecycle_state()
        # nothing reached vLLM: its sleep is the pause too, and the fault came before it
        assert state["state"] == "FAILED" and not fake.sleeping_tags and fake.sleeps == []
        assert rollout.lifecycle_recover("PAUSED")["state"] == "PAUSED"
        # recover's sleep: one vLLM sleep of both tags, which pauses first
        assert fake.sleeps == [2] and fake.sleeping_tags == {"weights", "kv_cache"} and not fake.warnings

    def test_kill_engine_kills_the_engine_core_process_and_the_next_call_is_typed(
        self, fake, vllm_tree, tmp_path
    ):
        from actor_integration.errors import EngineDiedError

        core = fake.engine_core_process()
        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        assert rollout.kill_engine() == {"process": "EngineCore", "pid": core.pid}
        assert not core.is_alive()
        with pytest.raises(EngineDiedError, match="EngineCore"):
            rollout.generate([[1, 2, 3]])
        with pytest.raises(EngineDiedError, match="EngineCore"):
            rollout.sleep()
        # logged once, as a server actor's death is, and named by `lifecycle check`
        from lifecycle import flush_logs
        from lifecycle.checker import LogChecker

        flush_logs()
        path = Path(rollout.lifecycle_log_path())
        lines = path.read_text().splitlines()
        died = [json.loads(line) for line in lines if '"rollout.server_died"' in line]
        assert [(d["process"], d["pid"], d["call"], d["label"]) for d in died] == [
            ("EngineCore", core.pid, "generate", "vllm")
        ]
        run = LogChecker()
        run.feed(str(path), lines)
        assert run.finish() == []
        (line,) = run.engines_died()
        assert f"rank 0 rollout: its engine vllm died: EngineCore (pid {core.pid}" in line

    def test_kill_engine_without_an_engine_process_says_so(self, fake, vllm_tree, tmp_path):
        rollout = demo_rollout(fake, vllm_tree, tmp_path)  # EngineCore in the actor's process
        with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
            rollout.kill_engine()

    def test_close_shuts_the_engine_core_down(self, fake, vllm_tree, tmp_path):
        core = fake.engine_core_process()
        demo_rollout(fake, vllm_tree, tmp_path).close()
        assert not core.is_alive()


def test_the_trainer_stand_in_has_the_demo_trainers_signatures():
    """Its methods take what `DemoTrainer`'s take (the bodies' own where the mixin wraps them)."""
    for name, member in vars(TrainerStandIn).items():
        if name.startswith("_") or not callable(member):
            continue
        real = getattr(TinyTrainer, name, None) or getattr(DemoTrainer, name)
        assert _parameters(member) == _parameters(real), name


def _parameters(method: Any) -> list[str]:
    """Its parameters, less the `_ray_trace_ctx` that `ray.remote` of any subclass adds to the
    signature of each inherited function object, shared with every other class (LifecycleMixin's
    `lifecycle_expect` carries it once an earlier test of the session made a mixin class an actor)."""
    return [p for p in inspect.signature(method).parameters if p != "_ray_trace_ctx"]


class TestTheSteps:
    def test_the_gpu_runs_steps_pass_their_checks_on_the_fake(self, fake, vllm_tree, tmp_path):
        """Five steps with the GPU run's flags: every step refuses generation between the release and
        the sync and serves the same tokens after a re-sync of the same weights; the skipped sync of
        step 2 is refused at step 3 and recovered by a sync; the rollout fault of step 3 is recovered;
        the corrupt round of step 4 is refused and sent again; the rollout's log passes `lifecycle check`."""
        from actor_integration.tools.demo.report import engine_verdicts
        from lifecycle.timeline import read_lanes

        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        args = gpu_run_args()
        driver, text = driver_over(rollout, args)
        driver.prepare()
        assert driver.placed.trainer_group.actors[0].expected == 4096 + 256  # vLLM's report of both tags
        for step in range(1, args.steps + 1):
            driver.run(step)
        records = driver.records
        assert driver.ok, text.getvalue()
        assert [r["refused_before_sync"] for r in records] == [True] * 5
        assert [r["resync_identical"] for r in records] == [True] * 5
        assert [r.get("tokens_changed") for r in records] == [None, True, True, True, True]
        assert records[1]["sync_skipped"] and records[1]["stale_rollouts"] == {0: None}
        assert [(r["step"], r["error"]) for r in driver.refusals] == [(3, "InvalidWeightsError")]
        assert [(f["step"], f["hook"], f["recovered_to"]) for f in driver.faults] == [
            (3, "memory.pause", "PAUSED")
        ]
        assert records[3]["corrupt_resends"] == 1
        assert len({r["engine_checksum"][0] for r in records if "engine_checksum" in r}) == 4  # 4 weight sets
        assert not fake.warnings and fake.dead is None
        assert rollout.flush_logs()
        files = read_logs([tmp_path / "logs" / "rollout-rank0.jsonl"])
        assert checker.check_logs(files) == []
        verdicts = engine_verdicts(args, driver, read_lanes(files), "vllm")
        assert all(ok for _line, ok in verdicts["lines"]), verdicts["lines"]
        assert "initial sync: vLLM started with dummy weights" in text.getvalue()

    def test_a_resync_that_loads_other_weights_fails_the_run(self, fake, vllm_tree, tmp_path):
        """The check can fail: a sync that puts other weights in than the step generated from (here the
        trainer's weights move on every send) serves other tokens after the re-sync, and the run fails."""
        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        driver, text = driver_over(
            rollout, gpu_run_args(steps=1, skip_sync=[], inject_fault=[], corrupt_sync=[])
        )
        trainer = driver.placed.trainer_group.actors[0]
        send = trainer.update_weights

        def drifting(version: int) -> dict[str, Any]:
            trainer.seed += 1
            return send(version)

        trainer.update_weights = drifting
        driver.prepare()
        record = driver.run(1)
        assert record["resync_identical"] is False and driver.ok is False
        assert "after re-syncing the same weights the engine generated other tokens" in text.getvalue()

    def test_kill_engine_ends_the_run_with_a_typed_error(self, fake, vllm_tree, tmp_path):
        fake.engine_core_process()
        rollout = demo_rollout(fake, vllm_tree, tmp_path)
        args = gpu_run_args(steps=3, skip_sync=[], inject_fault=[], corrupt_sync=[], kill_engine=2)
        driver, text = driver_over(rollout, args)
        driver.prepare()
        driver.run(1)
        driver.run(2)
        killed = driver.killed
        assert killed is not None and killed["typed"] is True and killed["step"] == 2, killed
        assert killed["error"].startswith("EngineDiedError: vLLM's EngineCore process")
        assert driver.ok and "killed vLLM's EngineCore" in text.getvalue()


@pytest.mark.parametrize(("engine", "name"), [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_a_real_engine_without_a_gpu_is_refused_before_ray(engine, name, capsys):
    import torch

    from actor_integration.tools.demo.placement import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exited:
        resolve_device("auto", "auto", engine)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"lifecycle demo: error: --engine {engine} needs a GPU ({name} runs on CUDA); torch sees none"
    )
    assert resolve_device("auto", "auto", "reference") == "cpu"

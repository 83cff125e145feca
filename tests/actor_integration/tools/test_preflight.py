"""The preflight: a described job against a described machine, each shortfall one line saying what to change."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from actor_integration.errors import PreflightError
from actor_integration.tools.preflight import (
    GIB,
    GPU,
    JobNeeds,
    Machine,
    Node,
    check_job,
    describe_ray_cluster,
    describe_this_machine,
    model_weight_bytes,
    preflight,
    slime_job_needs,
)


def machine(
    *, nodes: int = 1, gpus: int = 8, gib: float | None = 80, cpus: float = 64, ram_gib: float = 1024
) -> Machine:
    return Machine(
        nodes=tuple(
            Node(
                name=f"node{i}",
                gpus=tuple(
                    GPU(name="H100", total_bytes=None if gib is None else int(gib * GIB)) for _ in range(gpus)
                ),
                cpus=cpus,
                host_ram_bytes=int(ram_gib * GIB),
            )
            for i in range(nodes)
        )
    )


def job(**overrides: object) -> JobNeeds:
    fields: dict[str, object] = {
        "gpus": 8,
        "gpus_per_node": 8,
        "trainer_ranks": 8,
        "trainer_bytes_per_gpu": 20 * GIB,
        "engine_mem_fraction": 0.7,
        "engine_weight_bytes_per_gpu": 2 * GIB,
        "backup_bytes_per_rank": 24 * GIB,
        "cpus": 10.0,
    }
    fields.update(overrides)
    return JobNeeds(**fields)  # type: ignore[arg-type]


def needs(shortfalls: list) -> list[str]:
    return [s.need for s in shortfalls]


class TestPreflight:
    def test_a_job_that_fits_has_no_shortfall(self) -> None:
        assert preflight(machine(), job()) == []
        assert check_job(machine(), job()).startswith("fits: 8 GPU(s) of 8, 10 CPU(s) of 64")

    def test_too_few_gpus(self) -> None:
        (short,) = preflight(machine(gpus=4), job(gpus=8, gpus_per_node=4))
        assert short.need == "gpus"
        assert "asks for 8 GPU(s)" in short.message and "the cluster has 4" in short.message

    def test_more_gpus_per_node_than_a_node_has(self) -> None:
        (short,) = preflight(machine(nodes=2, gpus=4), job(gpus=8, gpus_per_node=8))
        assert "places 8 per node" in short.message and "set it to 4 or less" in short.message

    def test_an_engine_fraction_that_cannot_hold_the_weights(self) -> None:
        (short,) = preflight(machine(), job(engine_mem_fraction=0.05, engine_weight_bytes_per_gpu=14 * GIB))
        assert short.need == "engine_memory"
        assert "is 4.0 GiB" in short.message and "to at least 0.19" in short.message

    def test_an_engine_fraction_outside_0_and_1(self) -> None:
        (short,) = preflight(machine(), job(engine_mem_fraction=1.2))
        assert "must lie between 0 and 1" in short.message

    def test_a_trainer_state_larger_than_a_gpu(self) -> None:
        """7B parameters at 16 bytes each on one 80 GiB GPU; two-way tensor parallelism halves it."""
        seven_b = int(7e9 * 16)
        (short,) = preflight(machine(), job(trainer_bytes_per_gpu=seven_b))
        assert short.need == "trainer_memory" and "at least 104.3 GiB per GPU" in short.message
        assert preflight(machine(), job(trainer_bytes_per_gpu=seven_b // 2)) == []

    def test_colocated_halves_resident_at_once_must_fit_together(self) -> None:
        """Without --offload-rollout the engine keeps its fraction while the trainer trains."""
        resident = job(trainer_bytes_per_gpu=30 * GIB, engine_mem_fraction=0.7, offload_rollout=False)
        (short,) = preflight(machine(), resident)
        assert "beside the engine's 56.0 GiB" in short.message
        assert preflight(machine(), job(trainer_bytes_per_gpu=30 * GIB)) == []

    def test_host_ram_for_the_cpu_backups(self) -> None:
        (short,) = preflight(machine(ram_gib=256), job(backup_bytes_per_rank=40 * GIB))
        assert short.need == "host_ram"
        assert "need 320.0 GiB on node node0" in short.message and "8 rank(s) x 40.0 GiB" in short.message

    def test_the_critic_doubles_the_backups(self) -> None:
        assert preflight(machine(ram_gib=512), job(backup_bytes_per_rank=30 * GIB)) == []
        (short,) = preflight(machine(ram_gib=512), job(backup_bytes_per_rank=30 * GIB, critic=True))
        assert "for the actor and the critic" in short.message

    def test_too_few_cpus(self) -> None:
        (short,) = preflight(machine(gpus=1, cpus=2), job(gpus=1, gpus_per_node=1, trainer_ranks=1, cpus=3.0))
        assert short.message.endswith("start Ray with --num-cpus 3 or more")

    def test_every_shortfall_is_one_line_and_the_refusal_lists_them_all(self) -> None:
        small = machine(gpus=2, gib=16, cpus=2, ram_gib=16)
        shortfalls = preflight(small, job())
        assert needs(shortfalls) == ["gpus", "gpus", "trainer_memory", "host_ram", "cpus"]
        assert all("\n" not in s.message for s in shortfalls)
        with pytest.raises(PreflightError) as caught:
            check_job(small, job())
        assert caught.value.shortfalls == [s.message for s in shortfalls]
        assert str(caught.value).splitlines()[0] == "slime preflight refused the job (5 shortfall(s)):"

    def test_unknown_figures_are_left_out_and_named(self) -> None:
        report = check_job(machine(gib=None), job(trainer_bytes_per_gpu=10**15))
        assert (
            report.startswith("fits") and "not checked, figures unknown: the trainer's GPU memory" in report
        )

    def test_warn_reports_instead_of_refusing(self) -> None:
        report = check_job(machine(gpus=4), job(gpus_per_node=4), refuse=False)
        assert report.startswith("1 shortfall(s): GPUs: the job asks for 8")

    def test_a_machine_description_round_trips(self) -> None:
        described = machine(nodes=2, gpus=2)
        assert Machine.from_dict(json.loads(json.dumps(described.to_dict()))) == described


def slime_args(**overrides: object) -> argparse.Namespace:
    args = argparse.Namespace(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=2,
        num_gpus_per_node=8,
        colocate=True,
        offload_train=True,
        offload_rollout=True,
        use_critic=False,
        debug_train_only=False,
        debug_rollout_only=False,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        use_distributed_optimizer=False,
        kl_coef=0.0,
        use_kl_loss=False,
        hf_checkpoint=None,
        sglang_mem_fraction_static=0.6,
    )
    vars(args).update(overrides)
    return args


class TestSlimeJobNeeds:
    def test_gpus_and_cpus_as_slimes_placement_group_takes_them(self) -> None:
        colocated = slime_job_needs(slime_args())
        assert (colocated.gpus, colocated.cpus) == (8, 10.0)  # 8 bundles + rollout manager + engine lock
        apart = slime_job_needs(slime_args(colocate=False, rollout_num_gpus=4))
        assert apart.gpus == 12
        assert slime_job_needs(slime_args(debug_rollout_only=True, rollout_num_gpus=2)).gpus == 2

    def test_the_models_size_from_its_checkpoint(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
        (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
        assert model_weight_bytes(tmp_path) == 4096
        needs_ = slime_job_needs(slime_args(hf_checkpoint=str(tmp_path)), environ={})
        params = 4096 / 2
        assert needs_.trainer_bytes_per_gpu == int(params * 16 / 2)  # TP 2
        assert needs_.engine_weight_bytes_per_gpu == 4096 // 2  # two GPUs per engine
        assert needs_.backup_bytes_per_rank == int(params * 16 / 2 + params * 2 / 2)  # backup + slime's copy

    def test_a_distributed_optimizer_splits_the_optimizer_over_data_parallel_ranks(self) -> None:
        plain = slime_job_needs(slime_args(), weight_bytes=2 * 10**9)
        split = slime_job_needs(slime_args(use_distributed_optimizer=True), weight_bytes=2 * 10**9)
        assert plain.trainer_bytes_per_gpu is not None and split.trainer_bytes_per_gpu is not None
        assert split.trainer_bytes_per_gpu < plain.trainer_bytes_per_gpu

    def test_an_unreadable_checkpoint_leaves_memory_unchecked(self) -> None:
        needs_ = slime_job_needs(slime_args(hf_checkpoint="/nonexistent"))
        assert needs_.trainer_bytes_per_gpu is None
        assert "the trainer's GPU memory" in check_job(machine(), needs_)


class TestDescribe:
    def test_this_machine(self) -> None:
        here = describe_this_machine()
        (node,) = here.nodes
        assert node.cpus >= 1 and node.host_ram_bytes is not None and node.host_ram_bytes > 0

    @pytest.mark.ray
    def test_a_ray_cluster_is_read_on_each_node(self, ray_cluster: object) -> None:
        described = describe_ray_cluster()
        assert described.cpus >= 8  # the session's cluster (tests/conftest.py)
        assert all(n.host_ram_bytes is not None and n.host_ram_bytes > 0 for n in described.nodes)


# ---------------------------------------------------------------------------------------------- the demo


def demo_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"timeout_s": 30.0, "mem_fraction": 0.5}
    return argparse.Namespace(**(values | overrides))


def test_the_demos_7b_on_a_24_gib_gpu_is_refused_with_what_to_change() -> None:
    from actor_integration.tools.preflight import demo_job_needs

    params = 7_615_616_512  # qwen2-7b's parameters (configs/qwen2-7b, counted on the meta device below)
    job_needs = demo_job_needs(trainers=1, gpu=True, params=params, param_bytes=2, engine_mem_fraction=0.5)
    lines = [s.message for s in preflight(machine(gpus=1, gib=24, ram_gib=64), job_needs)]
    assert [line.split(":")[0] for line in lines] == ["engine memory", "trainer memory", "host RAM"]
    assert "raise --mem-fraction" in lines[0]
    assert "the model of --model-config" in lines[1]
    # the same job on an 80 GiB GPU with the host RAM for its backups: the engine's half and the
    # trainer's state fit, since the demo sleeps one half while the other runs
    assert preflight(machine(gpus=1, gib=141, ram_gib=1024), job_needs) == []


def test_the_demos_ranks_share_their_nodes_host_ram() -> None:
    from actor_integration.tools.preflight import demo_job_needs

    one = demo_job_needs(trainers=4, gpu=True, params=1_000_000_000, param_bytes=4, ranks_per_node=4)
    # 4 ranks x 20 GB of backup (state 16 GB, weights 4 GB) on one node of 64 GiB: short; one per node fits
    assert needs(preflight(machine(gpus=4, ram_gib=64), one)) == ["host_ram"]
    spread = demo_job_needs(trainers=4, gpu=True, params=1_000_000_000, param_bytes=4, ranks_per_node=1)
    assert preflight(machine(nodes=4, gpus=1, ram_gib=64), spread) == []


def test_the_demo_on_cpu_needs_no_gpu() -> None:
    from actor_integration.tools.preflight import demo_job_needs

    job_needs = demo_job_needs(trainers=2, gpu=False, params=10_000, param_bytes=4, engine_mem_fraction=0.5)
    assert job_needs.gpus == 0 and job_needs.engine_mem_fraction is None
    assert preflight(machine(gpus=0, gib=None, cpus=2), job_needs) == []


def test_the_demo_counts_its_models_parameters_on_the_meta_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`placement.preflight` sizes the demo's model without allocating it, and refuses (exit 2) with
    the preflight's lines before any actor starts."""
    from rich.console import Console

    from actor_integration.tools.demo import placement

    seen: dict[str, object] = {}

    def check(machine_: Machine, job_needs: JobNeeds, *, refuse: bool = True) -> str:
        seen["job"] = job_needs
        return check_job(machine_, job_needs, refuse=refuse)

    monkeypatch.setattr("actor_integration.tools.preflight.check_job", check)
    monkeypatch.setattr(
        "actor_integration.tools.preflight.describe_ray_cluster",
        lambda timeout_s: machine(gpus=1, gib=24, ram_gib=64),
    )
    config = Path(__file__).resolve().parents[3] / "configs" / "qwen2-7b"
    console = Console(file=open(tmp_path / "out.txt", "w"))  # noqa: SIM115
    with pytest.raises(SystemExit) as stopped:
        placement.preflight(demo_args(), "cuda", 1, "sglang", {"qwen_config": str(config)}, console)
    assert stopped.value.code == 2
    job_needs = seen["job"]
    assert isinstance(job_needs, JobNeeds)
    assert job_needs.trainer_bytes_per_gpu == 7_615_616_512 * 2 * 4

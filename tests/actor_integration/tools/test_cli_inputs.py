"""Bad input to the `lifecycle` command, as a new user types it: one line `lifecycle <cmd>: error: ...`
naming the argument and what is accepted, exit code 2, no traceback, nothing started or written;
and a fuzz pass over the fault-spec parser."""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actor_integration.tools.demo.options import ROLE_HOOKS, ROLLOUT_MACHINE, ROLLOUT_SLOTS, parse_fault
from lifecycle.table import Hook
from tests.helpers.cli import lifecycle

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "qwen2-tiny")


def one_line_error(proc: subprocess.CompletedProcess[str], command: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"lifecycle {command}: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--hidden", "7"], "--hidden 7: the reference model has 4 attention heads"),
        (["--out", "/proc/nope"], "--out /proc/nope: cannot write there"),
        (["--timeout-s", "0"], "argument --timeout-s: expected a positive number of seconds, got 0"),
        (["--timeout-s", "-1"], "argument --timeout-s: expected a positive number of seconds, got -1"),
        (["--timeout-s", "soon"], "argument --timeout-s: expected a number of seconds, got 'soon'"),
        (["--steps", "two"], "argument --steps: expected a positive integer, got 'two'"),
        (["--inject-fault", "trainer:generation.pause@1"], "the demo's trainer never calls generation.pause"),
        (["--inject-fault", "memory.paws@2"], "expected [trainer:|rollout:]HOOK@STEP"),
        (["--engine", "sglang"], "--engine sglang needs --model-config DIR"),
        (["--engine", "vllm"], "--engine vllm needs --model-config DIR"),
        (["--engine", "vllm", "--model-config", TINY, "--device", "cpu"], "--engine vllm needs a GPU"),
        (
            ["--engine", "vllm", "--model-config", TINY, "--hidden", "64"],
            "--hidden is for --engine reference",
        ),
        (
            ["--engine", "sglang", "--model-config", TINY, "--layers", "2"],
            "--layers is for --engine reference",
        ),
        (
            ["--engine", "vllm", "--model-config", TINY, "--engines", "2"],
            "--engines is for the reference engine",
        ),
        (
            ["--engine", "vllm", "--model-config", TINY, "--transport", "disk"],
            "--transport disk: vLLM's workers",
        ),
        (
            ["--engine", "vllm", "--model-config", TINY, "--mem-fraction", "0.95"],
            "--mem-fraction 0.95: vLLM's gpu_memory_utilization is a fraction in (0, 0.9)",
        ),
        (["--mem-fraction", "0.2"], "--mem-fraction is for --engine sglang or vllm"),
        (["--step", "3"], "unrecognized arguments: --step 3"),  # no abbreviation of --steps
        (["--engines", "0"], "argument --engines: expected a positive integer, got 0"),
        (["--transport", "carrier-pigeon"], "argument --transport: invalid choice"),
        (["--mem-fraction", "2", "--engine", "sglang", "--model-config", TINY], "--mem-fraction 2.0"),
    ],
)
def test_a_bad_demo_argument_is_one_line_and_nothing_starts(tmp_path, args, names):
    out = tmp_path / "out"
    line = one_line_error(lifecycle("demo", "--out", str(out), *args), "demo")
    assert names in line
    assert not (out / "logs").exists()


# The GPU session's command (scripts/gpu_vllm.sh), as it will run it.
GPU_VLLM = ["--engine", "vllm", "--model-config", "configs/qwen2-tiny", "--steps", "5", "--save-every", "2"]
GPU_VLLM += [
    "--skip-sync",
    "2",
    "--inject-fault",
    "rollout:memory.pause@3",
    "--corrupt-sync",
    "4",
    "--no-progress",
]


def test_the_gpu_vllm_command_parses_and_passes_the_checks_where_vllm_is_installed(tmp_path, monkeypatch):
    """Every option of the GPU run is accepted (vllm found, as on the GPU machine); the engine's
    defaults are filled in, the reference model's options left out."""
    from actor_integration.tools import cli
    from actor_integration.tools.demo import options

    args = cli.build_parser().parse_args(["demo", *GPU_VLLM, "--out", str(tmp_path / "out")])
    found = options.importlib.util.find_spec
    monkeypatch.setattr(
        options.importlib.util, "find_spec", lambda name: object() if name == "vllm" else found(name)
    )
    assert options.check_demo_arguments(args) is None
    assert (args.engine, args.mem_fraction, args.inject_fault) == (
        "vllm",
        0.15,
        [("rollout", "memory.pause", 3)],
    )
    assert (args.skip_sync, args.corrupt_sync, args.kill_engine) == ([2], [4], None)


def test_the_gpu_vllm_command_is_refused_in_one_line_where_vllm_or_cuda_is_missing(tmp_path):
    """On this CPU machine: vllm not installed, or no GPU, each a one-line error before Ray starts."""
    import importlib.util

    torch = pytest.importorskip("torch")
    has_vllm, has_cuda = importlib.util.find_spec("vllm") is not None, torch.cuda.is_available()
    if has_vllm and has_cuda:
        pytest.skip("vllm and CUDA are here: the command runs (the GPU session's)")
    line = one_line_error(lifecycle("demo", *GPU_VLLM, "--out", str(tmp_path / "out"), timeout=120), "demo")
    if not has_vllm:
        assert "--engine vllm needs vllm 0.26.0, which is not installed here" in line
    else:
        assert "--engine vllm needs a GPU (vLLM runs on CUDA); torch sees none" in line
    assert not (tmp_path / "out" / "logs").exists()


def test_cuda_ipc_on_a_machine_without_cuda_is_refused_before_ray(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: cuda_ipc is allowed")
    line = one_line_error(lifecycle("demo", "--out", str(tmp_path), "--transport", "cuda_ipc"), "demo")
    assert "--transport cuda_ipc needs CUDA" in line and not (tmp_path / "logs").exists()


def test_an_unreachable_address_is_refused_within_the_deadline(tmp_path):
    started = time.monotonic()
    proc = lifecycle("demo", "--out", str(tmp_path), "--address", "127.0.0.1:1", "--timeout-s", "5")
    line = one_line_error(proc, "demo")
    assert time.monotonic() - started < 5 + 30  # the deadline, plus the interpreter's start on a slow CI box
    assert "--address 127.0.0.1:1: no Ray cluster answers there" in line
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("args", "command", "names"),
    [
        (["check"], "check", "the following arguments are required: logs"),
        (["check", "/nonexistent.jsonl"], "check", "/nonexistent.jsonl does not exist"),
        (["timeline", "/nonexistent.jsonl", "-o", "/tmp/t"], "timeline", "/nonexistent.jsonl does not exist"),
        (["diagram", "--format", "svg"], "diagram", "--format svg writes a binary file: give -o FILE"),
        (["diagram", "--format", "gif"], "diagram", "argument --format: invalid choice: 'gif'"),
        (["doctor", "--transport", "x"], "doctor", "argument --transport: invalid choice: 'x'"),
        (["check", "--strict", "x.jsonl"], "check", "unrecognized arguments: --strict"),
    ],
)
def test_a_bad_argument_of_another_command_is_one_line(args, command, names):
    assert names in one_line_error(lifecycle(*args), command)


def test_a_timeline_that_cannot_be_written_names_the_output(tmp_path):
    log = tmp_path / "rank0.jsonl"
    log.write_text(
        '{"event": "lifecycle.configured", "rank": 0, "role": "trainer", "state": "AWAKE", "t": 1.0, '
        '"residency": {"*": "resident"}, "policy": {}}\n'
    )
    line = one_line_error(lifecycle("timeline", str(log), "-o", "/proc/nope/t"), "timeline")
    assert "-o /proc/nope/t: cannot write" in line


def test_the_version_is_the_packages():
    proc = lifecycle("--version")
    import lifecycle as package

    assert proc.returncode == 0 and proc.stdout.strip() == f"lifecycle (rl-lifecycle) {package.__version__}"


def test_an_unknown_command_is_one_line():
    proc = lifecycle("sleep")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("lifecycle: error: argument command: invalid choice: 'sleep'")


class TestFaultSpecs:
    def test_the_rollout_machine_the_checks_use_is_the_rollout_actors(self):
        """ROLE_HOOKS' rollout policy and hook slots are RolloutActor's own (so the check follows it)."""
        from actor_integration.rollout.actor import ROLLOUT_POLICY, RolloutActor
        from actor_integration.rollout.reference import ReferenceEngine

        assert ROLLOUT_MACHINE.memory_tags == ROLLOUT_POLICY.memory_tags
        assert (ROLLOUT_MACHINE.destroy_process_groups, ROLLOUT_MACHINE.model_tag) == (
            ROLLOUT_POLICY.destroy_process_groups,
            ROLLOUT_POLICY.model_tag,
        )
        hooks = RolloutActor(ReferenceEngine()).lifecycle.hooks
        present = {Hook.GENERATION_PAUSE, Hook.GENERATION_RESUME} if hooks.generation is not None else set()
        assert frozenset(present) == ROLLOUT_SLOTS
        assert set(ROLE_HOOKS["rollout"]) == {
            "generation.pause",
            "generation.resume",
            "memory.pause",
            "memory.resume",
        }

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=40))
    def test_any_text_parses_or_is_refused_with_the_expected_form(self, text):
        try:
            role, hook, step = parse_fault(text)
        except argparse.ArgumentTypeError as exc:
            assert "expected [trainer:|rollout:]HOOK@STEP" in str(exc)
        else:
            assert role in ("trainer", "rollout") and hook in {h.value for h in Hook} and step >= 0


def test_gather_with_no_cluster_on_this_host_is_one_line(tmp_path, monkeypatch, capsys):
    """`lifecycle gather` defaults to the cluster on this host; with none there (Ray's ConnectionError:
    made here, since a test session's own cluster may be running) it says so in one line, exit 2."""
    ray = pytest.importorskip("ray")
    from actor_integration.tools import cli

    def no_cluster(**_: object) -> None:
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to."
        )

    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(SystemExit) as exited:
        cli.main(["gather", "-o", str(tmp_path / "logs")])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lifecycle gather: error: --address auto: Could not find")
    assert not (tmp_path / "logs").exists()

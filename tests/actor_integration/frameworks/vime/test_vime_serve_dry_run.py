"""The GPU test of vime's `VLLMEngine` on `vllm serve` (tests/gpu/test_vime_rollout_gpu.py), run on CPU.

The same launch (`tests/helpers/vime_serve.py`: vime's `_compute_server_args` and
`_build_subprocess_env`, its arguments as a `vllm serve` command line, a child process waited on at
`GET /health`, its tree killed) and the same checks (`tests/helpers/vime_serve_checks.py`), with the
program a fake `vllm serve` (vLLM 0.26.0's routes and killers) and the trainer's sender one whose
handles carry the tensors (no CUDA). What it cannot show: vLLM's own answers, its memory, its
tokens, and the timings. Needs vime's source folder (RL_LIFECYCLE_VIME_SOURCE); skips without it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import vime_serve_checks as checks
from tests.helpers.framework_source import suite_source
from tests.helpers.sglang_server import FakeRouter
from tests.helpers.vime_serve import inline_sender, installed_serve
from tests.helpers.vime_source import VimeSource

SOURCE: VimeSource | None
SOURCE, pytestmark, _source_readable = suite_source(VimeSource, "vime's")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.helpers.vllm_fake import weights
    from tests.helpers.vllm_source import cached_wheel, open_tree

    if SOURCE is None:
        pytest.fail("RL_LIFECYCLE_VIME_SOURCE is set but vime's source cannot be read")
    open_tree().close()  # the wheel, fetched once (or this suite skips offline)
    wheel = cached_wheel()
    assert wheel is not None
    router = FakeRouter()
    try:
        logs = tmp_path_factory.mktemp("vime-serve")
        with installed_serve(SOURCE, logs, fake_wheel=wheel, deadline_s=60.0) as (module, _group, launched):
            yield checks.start(
                module,
                router,
                launched,
                checks.job_args("tiny"),
                sets={"A": weights(1), "B": weights(2)},
                send=inline_sender,
                prompts=PROMPTS,
                new_tokens=4,
            )
    finally:
        router.close()


def test_0_vime_launches_vllm_serve_with_its_own_arguments_and_environment(rig: Any) -> None:
    launch = rig.figures["launch"]
    print(f"\n{launch}")
    argv = launch["argv"]
    assert argv[:2] == ["serve", "tiny"] and "--enable-sleep-mode" in argv
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "ipc"}'
    assert argv[argv.index("--load-format") + 1] == "dummy" and "--enforce-eager" in argv
    assert launch["dropped"] == ["enable_scale_out"]  # vime 8c1c944b's; vLLM 0.26.0 has no such field
    assert launch["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert launch["env"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert rig.engine.process.pid == rig.launched.process().pid > 0 and rig.router.urls() == []


def test_0b_every_flag_of_the_command_line_is_one_vllm_0_26_serve_defines(rig: Any) -> None:
    """vLLM's parser (not run here) defines each of them (`vime_serve.unknown_serve_flags`)."""
    from tests.helpers.vime_serve import unknown_serve_flags
    from tests.helpers.vllm_source import cached_wheel

    wheel = cached_wheel()
    assert wheel is not None
    flags, unknown = unknown_serve_flags(rig.figures["launch"]["argv"], wheel)
    assert flags and unknown == [], unknown


def test_1_vimes_own_calls_and_the_wrapped_ones_on_the_same_server(rig: Any) -> None:
    figures = checks.own_and_wrapped(rig, cycles=3)
    print(f"\n{figures}")
    assert figures["state"] == {"state": "AWAKE", "admitted": True, "served_version": str(rig.version)}
    assert figures["own"]["chunks"] == figures["wrapped"]["chunks"] == 2
    # a cycle of each in turn, every cycle's figures kept
    assert [len(figures["rows"][side]) for side in ("own", "wrapped")] == [3, 3]
    assert all(
        row["chunks"] == 2 and row["release_ms"] > 0 for side in figures["rows"].values() for row in side
    )


def test_2_cycles_under_the_wrap_serve_each_sets_tokens(rig: Any) -> None:
    figures = checks.wrapped_cycles(rig, cycles=4)
    print(f"\n{figures}")
    assert figures["freed_by_release_bytes"] is None  # no GPU to measure


def test_3_the_killers_are_refused_and_the_server_lives(rig: Any) -> None:
    out = checks.killers(rig)
    print(f"\n{out}")
    assert out["start_asleep"].startswith("IllegalTransitionError")
    assert out["second_start"].startswith("DuplicateWeightUpdateStartError")


def test_4_a_killed_server_is_a_typed_error_within_the_deadline(rig: Any) -> None:
    figures = checks.killed_server(rig, deadline_s=10.0)
    print(f"\n{figures}")
    assert figures["error"] == "EngineDiedError" and figures["exitcode"] == -9, figures
    assert figures["typed_error_s"] < 5, figures

"""vime's own `VLLMEngine` (its source at 8c1c944b) on a real `vllm serve` (0.26.0) with sleep mode, plain
and under `VimeRolloutMixin`: issue 49, item 4.

vime's wrapped class launches the server as vime's `ServerGroup` makes it (its `init`, its
`_compute_server_args`, its `_build_subprocess_env`) on this process's GPU, behind a local router
(`FakeRouter`: vllm-router is not on the GPU machine); vime's plain class is pointed at the same
server. Ray runs in this process (vime's actors are its classes, called directly). The test process
plays vime's colocated trainer: two weight sets (`QwenLM` of configs/qwen2-tiny, seeds 1 and 2, on
the GPU) pushed with vLLM's own `IPCWeightTransferEngine.trainer_send_weights` (packed, 2 MiB
buffers: a version in several chunks), whose `IPCWeightTransferUpdateInfo` fields go through vime's
own `start_weight_update` / `update_weights` per chunk / `finish_weight_update`. The server: dummy
weights, bfloat16, eager, 0.3 of the GPU, max_model_len 512, no tokenizer (vime's `--vllm-*` flags).
The checks are tests/helpers/vime_serve_checks.py's, which CI runs on a fake server in a child
process (tests/actor_integration/frameworks/vime/test_vime_serve_dry_run.py).

What differs from vime's HEAD, which builds on a patched vLLM 0.31, worked around in the test's launch
only (tests/helpers/vime_serve.py; vime's code is not changed):
- vime's launch waits on `GET /health_generate` (its `health_generate` asks it too); 0.26.0 does not
  serve it (404). The launch waits on `GET /health`; vime's own health check is called here only where
  the wrap answers it with `/health` (asleep) or refuses it (a dead server).
- vime's `_run_vllm_server` and `_vllm_server_field_names` import `vllm.entrypoints.launchers.cli_args`;
  0.26.0 has `vllm.entrypoints.openai.cli_args`. The launch starts `python -m vllm.entrypoints.cli.main
  serve` with vime's arguments as flags, its field names read from 0.26.0's `AsyncEngineArgs` and
  `FrontendArgs`.
- vime passes `enable_scale_out`, which 0.26.0 has no field for: left out (recorded in the launch figures).
- vime's `get_weight_version` / `set_weight_version` ask `/weight_info` and `/update_weight_version`,
  which 0.26.0 does not serve: not called (the wrap holds the version it saw loaded whole).
- The handles: vime's `update_weights` sends vLLM's `ipc_handles` cloudpickled as `ipc_handles_pickled`;
  0.26.0 unpickles them only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, which vime's
  `_build_subprocess_env` sets for a colocated job (and VLLM_SERVER_DEV_MODE=1 for the dev routes).

Passed on an H100 (2026-12-06, docs/measurements.md). Run on the GPU machine with vllm 0.26.0
installed, one GPU visible (vime sets the server's CUDA_VISIBLE_DEVICES to "0"), from the repository
root, with vime's files (tests/helpers/vime_manifest.json: `scripts/export_vime.py`):
RL_LIFECYCLE_VIME_SOURCE=<vime files> PYTHONPATH=$PWD python -m pytest -m gpu -q -s tests/gpu/test_vime_rollout_gpu.py
VIME_OWN_CYCLES (10), VIME_CYCLES (20) and VIME_TARGET_MS (3.0: the wrapped calls within that of
vime's own) change the run. Figures are printed and, when LIFECYCLE_GPU_OUT is set, written to
vime_rollout_*.json there, with the server's log and the wrapped engine's lifecycle log
(vime-rollout-logs, for `lifecycle check`). The tests share one server and run in file order; the
last one kills it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.framework_source import suite_source
from tests.helpers.gpu_results import record
from tests.helpers.vime_source import VimeSource

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

SOURCE: VimeSource | None
SOURCE, _source_mark, _source_readable = suite_source(VimeSource, "vime's")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    _source_mark,
]

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "configs" / "qwen2-tiny"
OWN_CYCLES = int(os.environ.get("VIME_OWN_CYCLES", "10"))  # per class
CYCLES = int(os.environ.get("VIME_CYCLES", "20"))
TARGET_MS = float(os.environ.get("VIME_TARGET_MS", "3.0"))
PROMPTS = [[11, 12, 13, 14], [100, 200, 300], [7] * 9, [151, 152, 153, 154, 155, 156]]
NEW_TOKENS = 16


def free_bytes() -> int:
    free, _total = torch.cuda.mem_get_info()
    return int(free)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from actor_integration.models.qwen2 import QwenConfig, QwenLM
    from tests.helpers import vime_serve_checks as checks
    from tests.helpers.sglang_server import FakeRouter
    from tests.helpers.vime_serve import installed_serve

    if SOURCE is None:
        pytest.fail("RL_LIFECYCLE_VIME_SOURCE is set but vime's source cannot be read")
    torch.cuda.set_device(0)
    given = os.environ.get("LIFECYCLE_GPU_OUT")
    out = Path(given) if given else tmp_path_factory.mktemp("vime-gpu")
    log_dir = os.environ.get("RL_LIFECYCLE_LOG_DIR")
    os.environ["RL_LIFECYCLE_LOG_DIR"] = str(out / "vime-rollout-logs")
    config = QwenConfig.from_json(MODEL)
    sets = {n: QwenLM(config, seed=s, device="cuda").named_weights() for n, s in (("A", 1), ("B", 2))}
    router = FakeRouter()
    free_before = free_bytes()
    try:
        with installed_serve(SOURCE, out / "vime-vllm-serve") as (module, _group, launched):
            rig = checks.start(
                module,
                router,
                launched,
                checks.job_args(str(MODEL)),
                sets=sets,
                send=IPCWeightTransferEngine.trainer_send_weights,
                prompts=PROMPTS,
                new_tokens=NEW_TOKENS,
                free_bytes=free_bytes,
            )
            rig.figures["server_bytes"] = free_before - free_bytes()
            record("vime_rollout_launch", rig.figures)
            yield rig
    finally:
        router.close()
        if log_dir is None:
            os.environ.pop("RL_LIFECYCLE_LOG_DIR", None)
        else:
            os.environ["RL_LIFECYCLE_LOG_DIR"] = log_dir


def test_1_vimes_own_calls_and_the_wrapped_ones_on_the_same_server(rig: Any) -> None:
    """vime's class, plain, then wrapped, on the same server: offload (level 2), onload_weights, the
    trainer's pause / push / continue, onload_kv, each call timed; medians side by side. The wrap
    moves the trainer's pause into its sleep and its continue to the end of onload_kv, so the target
    holds on the sleep + wake with the trainer's pause and continue (`with_trainer_ms`)."""
    from tests.helpers.vime_serve_checks import own_and_wrapped

    figures = own_and_wrapped(rig, OWN_CYCLES)
    figures["target_ms"] = TARGET_MS
    record("vime_rollout_own_and_wrapped", figures)
    assert figures["state"]["admitted"] and figures["state"]["state"] == "AWAKE", figures
    assert figures["wrapped_minus_own_with_trainer_ms"] <= TARGET_MS, figures


def test_2_cycles_under_the_wrap_serve_identical_greedy_tokens_per_set(rig: Any) -> None:
    """20 cycles of vime's sequence on the wrapped engine, the sets in turn: out of the router while
    released, the same greedy tokens through the router whenever the same set is loaded, other tokens
    for the other set, memory freed by every release."""
    from tests.helpers.vime_serve_checks import wrapped_cycles

    figures = wrapped_cycles(rig, CYCLES)
    record("vime_rollout_cycles", figures)
    assert figures["freed_by_release_bytes"] > 0.5 * rig.figures["server_bytes"], figures


def test_3_the_killers_are_refused_and_the_server_lives(rig: Any) -> None:
    """A second sleep (no-op), a rollout request while asleep (out of the router), an update while
    asleep (vllm #57853: start and chunk refused), a sleep while the KV cache sleeps, level 2 without a
    reload (kept out of the router), a second start (vime #57): the server alive after each, then set
    A's tokens again."""
    from tests.helpers.vime_serve_checks import killers

    record("vime_rollout_killers", killers(rig))


def test_4_a_killed_server_is_a_typed_error_within_the_deadline(rig: Any) -> None:
    """The server's process tree SIGKILLed while a client generates through the router: the wrapped
    engine's next offload is `EngineDiedError` naming it (its process watch sees the server gone)
    within 30 s, the router no longer lists it, its health check raises."""
    from tests.helpers.vime_serve_checks import killed_server

    record("vime_rollout_kill", killed_server(rig, deadline_s=30.0))

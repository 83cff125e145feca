"""The vLLM adapters against vLLM 0.26.0's own source (the pinned wheel, parsed, never imported):
every name they call or read exists with the shape they use, and the facts their guards rest on
still hold. The fakes bind each call at run time (test_vllm_engine/actor/http); this file checks
what a call-level fake cannot: the pin, the tags, the modes, the extension's hooks."""

import ast
import re
from pathlib import Path

import tomllib

from actor_integration.engines.vllm import PAUSE_MODES, SUPPORTED_VERSION, VLLM_TAGS
from actor_integration.engines.vllm.offline import llm_arguments
from actor_integration.engines.vllm.worker import METHODS, WORKER_EXTENSION
from tests.helpers.vllm_source import (
    EXECUTOR,
    GPU_WORKER,
    IPC_ENGINE,
    LLM,
    LLM_ENGINE,
    MP_CLIENT,
    PAUSE_MODE,
    SHA256,
    VERSION,
    cached_wheel,
    field_names,
    literal_choices,
    method,
)

REPO = Path(__file__).resolve().parents[4]


def test_the_vllm_extra_pins_exactly_the_wheel_checked_here(vllm_tree):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["vllm"] == ["rl-lifecycle[torch]", f"vllm=={VERSION}"]
    assert VERSION == SUPPORTED_VERSION
    assert not any("vllm" in r for r in extras["all"])  # a CUDA-13 wheel stays out of `all`
    assert re.fullmatch(r"[0-9a-f]{64}", SHA256) and cached_wheel() == vllm_tree.wheel


def test_vllms_sleep_releases_both_tags_and_ignores_a_second_sleep(vllm_tree):
    """What SleepGuard's table rests on: the executor's sleep marks both tags asleep at once, and a
    sleep while asleep returns with a warning (so a second sleep would silently do nothing)."""
    sleep = method(vllm_tree, EXECUTOR, "sleep").node
    assigned = [
        ast.literal_eval(node.value)
        for node in ast.walk(sleep)
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.sleeping_tags"
    ]
    assert assigned == [set(VLLM_TAGS)]
    first = sleep.body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "self.is_sleeping"
    assert isinstance(first.body[-1], ast.Return)
    wake = ast.unparse(method(vllm_tree, EXECUTOR, "wake_up").node)
    assert "self.sleeping_tags.remove(tag)" in wake  # a partial wake keeps the other tag asleep


def test_a_whole_wake_resumes_vllms_scheduler(vllm_tree):
    """What lets the adapters skip the /resume (or `resume_generation`) that would end a wake: the
    engine core resumes its scheduler once the executor holds no tag asleep, and not before."""
    wake = method(vllm_tree, "vllm.v1.engine.core.EngineCore", "wake_up").node
    last = wake.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.test) == "not self.model_executor.is_sleeping"
    assert [ast.unparse(s) for s in last.body] == ["self.resume_scheduler()"]
    executor = vllm_tree.cls(EXECUTOR)
    assert "is_sleeping" in executor.instance_attributes()


def test_the_pause_modes_are_vllms(vllm_tree):
    assert set(PAUSE_MODES.values()) <= set(literal_choices(vllm_tree, PAUSE_MODE))
    assert "retract" not in literal_choices(vllm_tree, PAUSE_MODE)


def test_every_llm_call_exists(vllm_tree):
    for name in (
        "generate",
        "sleep",
        "wake_up",
        "reset_prefix_cache",
        "collective_rpc",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        method(vllm_tree, LLM, name)
    for name in ("has_unfinished_requests", "get_num_unfinished_requests"):
        method(vllm_tree, LLM_ENGINE, name)
    wake = ast.unparse(method(vllm_tree, "vllm.v1.engine.core.EngineCore", "wake_up").node)
    assert "'scheduling' in tags" in wake  # wake_up(["scheduling"]) resumes a level-0 pause


def test_the_engine_core_processes_the_adapter_watches(vllm_tree):
    """What `VLLMEngine.engine_processes`, its death check and its shutdown read: the LLMEngine's
    `engine_core` client, the multiprocess client's `resources.engine_manager.processes` (named
    EngineCore), the client's `shutdown`, and the error vLLM's client raises once EngineCore died."""
    assert "engine_core" in vllm_tree.cls(LLM_ENGINE).instance_attributes()
    assert "resources" in vllm_tree.cls(MP_CLIENT).instance_attributes()
    assert "engine_manager" in field_names(vllm_tree, "vllm.v1.engine.core_client.BackgroundResources")
    manager = vllm_tree.cls("vllm.v1.engine.utils.CoreEngineProcManager")
    assert "processes" in manager.instance_attributes()
    assert "'EngineCore'" in ast.unparse(
        method(vllm_tree, "vllm.v1.engine.utils.CoreEngineProcManager", "__init__").node
    )
    method(vllm_tree, MP_CLIENT, "shutdown").signature(bound=True).bind()
    ensure = ast.unparse(method(vllm_tree, MP_CLIENT, "ensure_alive").node)
    assert "raise EngineDeadError()" in ensure  # every call after the death, as the fake raises it
    assert vllm_tree.cls("vllm.v1.engine.exceptions.EngineDeadError").name == "EngineDeadError"


def test_the_llm_arguments_are_engine_args_and_ipc_is_a_backend(vllm_tree):
    arguments = llm_arguments({"model": "/m"}, worker_receiver=True)
    assert set(arguments) - {"model"} <= field_names(vllm_tree, "vllm.engine.arg_utils.EngineArgs")
    assert arguments["worker_extension_cls"] == WORKER_EXTENSION
    factory = vllm_tree.source("vllm.distributed.weight_transfer.factory")
    assert re.search(r'register_engine\(\s*"ipc"', factory)


def test_the_worker_extension_shadows_nothing_and_finds_what_it_reads(vllm_tree):
    for name in METHODS:
        assert vllm_tree.cls(GPU_WORKER).method(name) is None, name
    worker = vllm_tree.cls(GPU_WORKER)
    assert "model_runner" in worker.instance_attributes() and "WorkerBase" in worker.external_bases
    assert "rank" in vllm_tree.cls("vllm.v1.worker.worker_base.WorkerBase").instance_attributes()
    runner = vllm_tree.cls("vllm.v1.worker.gpu_model_runner.GPUModelRunner").instance_attributes()
    assert {"model", "model_memory_usage", "kv_caches"} <= runner
    load = method(vllm_tree, "vllm.model_executor.models.qwen2.Qwen2ForCausalLM", "load_weights")
    assert list(load.signature(bound=True).parameters) == ["weights"]


def test_the_ipc_sender_and_the_weight_session(vllm_tree):
    send = method(vllm_tree, IPC_ENGINE, "trainer_send_weights").signature(bound=False)
    send.bind(iter(()), {"send_mode": print, "packed": True})
    assert {"send_mode", "packed", "packed_buffer_size_bytes"} <= field_names(
        vllm_tree, "vllm.distributed.weight_transfer.ipc_engine.IPCTrainerSendWeightsArgs"
    )
    from actor_integration.engines.vllm.base import PACKED_BUFFER_BYTES

    packed = vllm_tree.source("vllm.distributed.weight_transfer.packed_tensor")
    assert (
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024" in packed and PACKED_BUFFER_BYTES == 1 << 30
    )
    assert "exceeds buffer_size_bytes" in packed  # a larger tensor is refused, not split (a 7B's embedding)
    start = ast.unparse(method(vllm_tree, GPU_WORKER, "_start_weight_update").node)
    assert "already active" in start  # vLLM refuses a second start in the worker, after the RPC went out
    update = ast.unparse(method(vllm_tree, GPU_WORKER, "update_weights").node)
    assert "self._weight_update_active = False" in update  # a failed chunk ends vLLM's session


def test_completions_answer_token_ids(vllm_tree):
    choice = "vllm.entrypoints.openai.completion.protocol.CompletionResponseChoice"
    assert "token_ids" in field_names(vllm_tree, choice)


def test_the_package_the_worker_extension_and_the_guards_import_without_vllm_or_torch():
    """vLLM's workers import the extension by name; the package and the guards must not pull vLLM
    (nor torch) in at import."""
    import subprocess
    import sys

    modules = ["actor_integration.engines.vllm", "actor_integration.engines.vllm.worker"]
    modules.append("actor_integration.engines.vllm.guards")
    code = f"import sys; [__import__(m) for m in {modules!r}]; print(sorted({{'torch', 'vllm'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""SGLangEngine against SGLang's own source (the wheel pinned in pyproject), without importing SGLang.

The adapter runs against fakes shaped by the parsed source: a method, field or attribute that
SGLang does not have raises AttributeError, and every call is recorded and bound to the
`inspect.Signature` built from SGLang's definition. Nothing here lists the adapter's calls by
hand, so the check follows the code.
"""

import ast
import re
from pathlib import Path

import pytest
import torch

from actor_integration.rollout import ENGINE_TAGS, GENERATION_MODES, RolloutActor, SGLangEngine
from actor_integration.rollout.sglang import sglang_codec
from lifecycle import Contents
from tests.helpers.sglang_source import VERSION, SourceShapedSGLang, event_loop, literal_values

ENGINE = "sglang.srt.entrypoints.engine.Engine"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
IO = "sglang.srt.managers.io_struct"
LOAD_SNAPSHOT = "sglang.srt.managers.load_snapshot.LoadSnapshot"
REPO = Path(__file__).resolve().parents[3]

# What the adapter is expected to reach in SGLang; a scenario that stops reaching one fails.
ENGINE_SURFACE = {
    "Engine()",
    "Engine.release_memory_occupation",
    "Engine.resume_memory_occupation",
    "Engine.flush_cache",
    "Engine.update_weights_from_tensor",
    "Engine.generate",
    "TokenizerManager.pause_generation",
    "TokenizerManager.continue_generation",
    "TokenizerManager.get_loads",
    "PauseGenerationReqInput()",
    "ContinueGenerationReqInput()",
    "FlattenedTensorBucket()",
    "FlattenedTensorBucket.get_flattened_tensor",
    "FlattenedTensorBucket.get_metadata",
    "MultiprocessingSerializer.serialize",
}


@pytest.fixture
def shaped(sglang_tree):
    """A source-shaped `sglang` package, installed for the test; answers shaped as SGLang's are."""
    loop = event_loop()
    shaped = SourceShapedSGLang(sglang_tree)
    shaped.instance_values.update(
        {"Engine.loop": loop, "Engine.tokenizer_manager": shaped.make(TOKENIZER_MANAGER)}
    )
    flushed = {"success": True}
    shaped.answers.update(
        {
            "Engine.flush_cache": lambda: shaped.make(f"{IO}.FlushCacheReqOutput", **flushed),
            "Engine.update_weights_from_tensor": (True, "Success"),
            "Engine.generate": lambda **kw: [
                {"output_ids": [7] * kw["sampling_params"]["max_new_tokens"]} for _ in kw["input_ids"]
            ],
            "TokenizerManager.get_loads": lambda **kw: [
                shaped.make(LOAD_SNAPSHOT, dp_rank=0, num_running_reqs=1, num_waiting_reqs=2),
                shaped.make(LOAD_SNAPSHOT, dp_rank=1, num_running_reqs=0, num_waiting_reqs=3),
            ],
            "MultiprocessingSerializer.serialize": "base64-payload",
        }
    )
    shaped.flushed = flushed
    with shaped.installed():
        yield shaped
    loop.close()


def shards():
    rank0 = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16))]
    rank1 = [("w", torch.ones(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    return [rank0, rank1]


def assert_binds(shaped):
    problems = shaped.problems()
    assert not problems, "\n".join(problems)


class TestPin:
    def test_the_sglang_extra_pins_the_version_these_checks_read(self):
        """pyproject's `sglang` extra names exactly the version whose source is checked here."""
        text = (REPO / "pyproject.toml").read_text()
        assert re.search(r'^sglang = \["sglang==([^"]+)"\]$', text, re.M).group(1) == VERSION


class TestEngineCalls:
    def test_building_the_engine_and_the_codec_binds(self, shaped):
        """`SGLangEngine(**kwargs)` builds `sglang.Engine` and SGLang's flattened-bucket codec."""
        engine = SGLangEngine(model_path="/models/tiny", mem_fraction_static=0.4)
        encode, multi_dtype = sglang_codec()
        assert encode([("w", torch.zeros(2))]) == "base64-payload"
        assert multi_dtype is True  # FlattenedTensorBucket.supports_multi_dtypes in this version
        assert engine._takes_version is False  # Engine.update_weights_from_tensor has no weight_version
        assert_binds(shaped)

    def test_memory_and_generation_control_bind(self, shaped):
        """Release, resume, every pause mode, continue, flush and the queue report bind."""
        engine = SGLangEngine()
        engine.release_memory_occupation(["weights"])
        engine.resume_memory_occupation(None)
        for mode in GENERATION_MODES:
            engine.pause_generation(mode)
        engine.continue_generation()
        assert engine.flush_cache() is True
        shaped.flushed["success"] = False
        assert engine.flush_cache() is False
        assert engine.queued_requests() == {"running": 1, "waiting": 5}
        assert_binds(shaped)

    def test_weight_loading_and_generation_bind(self, shaped):
        """Versioned loads in one call or split by dtype, and greedy generation, bind."""
        engine = SGLangEngine()
        engine.load_weights(1, shards(), round_index=0, final=True)
        split = SGLangEngine(multi_dtype_buckets=False)
        split.load_weights(2, shards(), round_index=0, final=False)
        split.load_weights(2, shards(), round_index=1, final=True)
        assert engine.generate([[1, 2]], max_new_tokens=3) == [[7, 7, 7]]
        assert_binds(shaped)

    def test_the_rollout_actor_cycle_binds_and_reaches_the_whole_surface(self, shaped):
        """A rollout's sleep, partial wakes, sync and generation reach everything listed above."""
        actor = RolloutActor(SGLangEngine(model_path="/models/tiny"), generation_mode="retract")
        actor.sleep()
        actor.wake_up(["weights"])

        def load() -> None:  # the engine half of a sync (the receiver's half is tested elsewhere)
            actor.engine.load_weights(1, shards(), round_index=0, final=True)
            actor.lifecycle.note_weights(Contents.VALID, 1, reason="loaded")

        actor.lifecycle.run("sync", load)
        actor.wake_up(["kv_cache"])
        assert actor.generate([[3]], max_new_tokens=2) == [[7, 7]]
        assert actor.engine.queued_requests() == {"running": 1, "waiting": 5}
        assert_binds(shaped)
        assert not ENGINE_SURFACE - shaped.called(), sorted(ENGINE_SURFACE - shaped.called())


class TestAnswers:
    """The fakes answer what SGLang's source says those calls return."""

    def test_flush_cache_answers_a_flush_output_with_success(self, sglang_tree):
        """Engine.flush_cache returns the tokenizer manager's FlushCacheReqOutput(success, message)."""
        body = ast.unparse(sglang_tree.cls(ENGINE).method("flush_cache").node)
        assert "self.tokenizer_manager.flush_cache()" in body
        flush = sglang_tree.cls(TOKENIZER_MANAGER).method("flush_cache")
        assert ast.unparse(flush.node.returns) == "FlushCacheReqOutput"
        output = sglang_tree.cls(f"{IO}.FlushCacheReqOutput")
        assert {"success", "message"} <= {f.name for f in output.fields()}

    def test_update_weights_answers_success_and_message(self, sglang_tree):
        """Engine.update_weights_from_tensor returns the manager's (success, message) tuple."""
        body = ast.unparse(sglang_tree.cls(ENGINE).method("update_weights_from_tensor").node)
        assert "self.tokenizer_manager.update_weights_from_tensor(obj, None)" in body
        update = sglang_tree.cls(TOKENIZER_MANAGER).method("update_weights_from_tensor")
        assert ast.unparse(update.node.returns) == "Tuple[bool, str]"

    def test_loads_report_running_and_waiting_requests(self, sglang_tree):
        """get_loads returns LoadSnapshots, which count running and waiting requests."""
        loads = sglang_tree.cls(TOKENIZER_MANAGER).method("get_loads")
        assert ast.unparse(loads.node.returns) == "List[LoadSnapshot]"
        fields = {f.name for f in sglang_tree.cls(LOAD_SNAPSHOT).fields()}
        assert {"num_running_reqs", "num_waiting_reqs"} <= fields

    def test_batch_generation_returns_output_ids(self, sglang_tree):
        """Generation outputs carry `output_ids`, which the adapter returns."""
        assert '"output_ids"' in sglang_tree.source("sglang.srt.managers.tokenizer_manager")


class TestNames:
    def test_our_memory_tags_are_sglangs_gpu_memory_types(self, sglang_tree):
        """`weights` and `kv_cache` are GPU memory types SGLang releases and resumes by name."""
        constants = sglang_tree.constants("sglang.srt.constants")
        assert set(ENGINE_TAGS) <= set(constants["GPU_MEMORY_ALL_TYPES"])
        assert constants["GPU_MEMORY_TYPE_WEIGHTS"] == "weights"
        assert constants["GPU_MEMORY_TYPE_KV_CACHE"] == "kv_cache"

    def test_our_pause_modes_are_the_ones_sglang_accepts(self, sglang_tree):
        """GENERATION_MODES are the Literal values of PauseGenerationReqInput.mode."""
        mode = sglang_tree.cls(f"{IO}.PauseGenerationReqInput").field("mode")
        assert set(GENERATION_MODES) == set(literal_values(mode.annotation))

    def test_sampling_parameters_are_sglangs(self, sglang_tree):
        """The sampling parameters the adapter sends are SamplingParams fields."""
        signature = sglang_tree.cls("sglang.srt.sampling.sampling_params.SamplingParams").constructor()
        signature.bind(temperature=0.0, max_new_tokens=8)

    def test_the_codec_writes_the_keys_sglangs_bucket_loader_reads(self, sglang_tree):
        """`flattened_tensor` and `metadata` are the keys SGLang's flattened-bucket loader reads."""
        module = "sglang.srt.model_executor.model_runner_components.weight_updater"
        loader = sglang_tree.lookup(module, "WeightUpdater").method("_update_weights_from_flattened_bucket")
        read = {
            node.slice.value
            for node in ast.walk(loader.node)
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        }
        assert {"flattened_tensor", "metadata"} <= read


class TestTheCheckCanFail:
    """The source-shaped fakes catch calls SGLang would reject."""

    def test_a_method_sglang_lacks_raises(self, shaped):
        """Engine.pause_generation does not exist in this version: the fake says so."""
        import sglang

        engine = sglang.Engine()
        with pytest.raises(
            AttributeError, match=rf"sglang {re.escape(VERSION)}: .*Engine has no .*'pause_generation'"
        ):
            engine.pause_generation(mode="retract")

    def test_a_keyword_the_definition_lacks_is_reported(self, shaped):
        """Passing weight_version to this version's Engine.update_weights_from_tensor is reported."""
        import sglang

        sglang.Engine().update_weights_from_tensor(named_tensors=[], weight_version="3")
        (problem,) = shaped.problems()
        assert "unexpected keyword argument 'weight_version'" in problem
        assert "update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)" in problem

    def test_a_missing_argument_is_reported(self, shaped):
        """A misspelt keyword leaves a required parameter unbound, and that is reported."""
        import sglang

        sglang.Engine().update_weights_from_tensor(named_tensor=[])
        (problem,) = shaped.problems()
        assert "missing a required argument: 'named_tensors'" in problem

    def test_a_wrong_struct_field_is_reported(self, shaped):
        """A request struct built with a field it lacks is reported."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        PauseGenerationReqInput(pause_mode="retract")
        (problem,) = shaped.problems()
        assert "PauseGenerationReqInput()" in problem and "pause_mode" in problem

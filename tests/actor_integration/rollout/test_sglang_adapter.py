"""SGLangEngine: the calls it makes on `sglang.Engine`, against a recording fake with the signatures
of the pinned SGLang (test_sglang_source.py checks the adapter against that source itself);
against the real engine when sglang and a GPU are present."""

import asyncio
import dataclasses
import sys
import types

import pytest
import torch

from actor_integration.rollout import RolloutActor, SGLangEngine


@dataclasses.dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclasses.dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclasses.dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclasses.dataclass
class LoadSnapshot:
    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0


class FakeTokenizerManager:
    def __init__(self, log):
        self.log = log
        self.loads = [LoadSnapshot()]

    async def pause_generation(self, obj):
        self.log.append(("tokenizer_manager.pause_generation", obj.mode))

    async def continue_generation(self, obj):
        self.log.append(("tokenizer_manager.continue_generation",))

    async def get_loads(self, include=None, dp_rank=None):
        self.log.append(("tokenizer_manager.get_loads", include))
        return self.loads


class FakeSGLangEngine:
    """The offline `sglang.Engine` methods the adapter uses, with their real signatures (it has no
    pause_generation or continue_generation: those go through its tokenizer manager)."""

    def __init__(self, *, refuse=False):
        self.log = []
        self.refuse = refuse
        self.busy = False
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager(self.log)

    def release_memory_occupation(self, tags=None):
        self.log.append(("release_memory_occupation", tags))

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume_memory_occupation", tags))

    def flush_cache(self):
        self.log.append(("flush_cache",))
        return FlushCacheReqOutput(success=not self.busy)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append(("update_weights_from_tensor", list(named_tensors), load_format, flush_cache))
        return (False, "shape mismatch") if self.refuse else (True, "Succeeded")

    def generate(self, prompt=None, sampling_params=None, input_ids=None, **_):
        self.log.append(("generate", input_ids, sampling_params))
        return [{"output_ids": [7] * sampling_params["max_new_tokens"]} for _ in input_ids]


@pytest.fixture
def io_struct(monkeypatch):
    """sglang's request structs, as the adapter imports them, when sglang itself is absent."""
    if "sglang" in sys.modules or _sglang_installed():
        return
    modules = {}
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct"):
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["sglang.srt.managers.io_struct"].PauseGenerationReqInput = PauseGenerationReqInput
    modules["sglang.srt.managers.io_struct"].ContinueGenerationReqInput = ContinueGenerationReqInput


def _sglang_installed():
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def codec(named):
    """Stands in for FlattenedTensorBucket + MultiprocessingSerializer: records what one TP rank gets."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in named]


def shards():
    rank0 = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16))]
    rank1 = [("w", torch.ones(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    return [rank0, rank1]


class TestContract:
    def test_memory_tags_pass_through_as_lists(self):
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=True)
        engine.release_memory_occupation(("weights",))
        engine.resume_memory_occupation(None)
        assert fake.log == [("release_memory_occupation", ["weights"]), ("resume_memory_occupation", None)]

    def test_pause_and_continue_go_through_the_tokenizer_manager(self, io_struct):
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=True)
        engine.pause_generation("retract")
        engine.flush_cache()
        engine.continue_generation()
        assert fake.log == [
            ("tokenizer_manager.pause_generation", "retract"),
            ("flush_cache",),
            ("tokenizer_manager.continue_generation",),
        ]

    def test_a_refused_flush_reports_not_idle_and_the_queue(self):
        """SGLang's flush answers success=False while requests remain; the adapter answers False."""
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=True)
        assert engine.flush_cache() is True
        fake.busy = True
        fake.tokenizer_manager.loads = [LoadSnapshot(0, 2, 1), LoadSnapshot(1, 0, 4)]
        assert engine.flush_cache() is False
        assert engine.queued_requests() == {"running": 2, "waiting": 5}
        assert fake.log[-1] == ("tokenizer_manager.get_loads", ["core"])

    def test_each_tp_rank_gets_the_tensors_sent_for_its_gpu_as_a_flattened_bucket(self):
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=True)
        engine.load_weights(4, shards(), round_index=0, final=True)
        ((name, payloads, load_format, flush),) = fake.log
        assert name == "update_weights_from_tensor" and load_format == "flattened_bucket" and flush is True
        assert len(payloads) == 2  # one per TP rank, in slot-rank order
        assert engine.weight_version == 4

    def test_single_dtype_buckets_split_the_call_and_flush_once_at_the_end(self):
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=False)
        engine.load_weights(1, shards(), round_index=0, final=False)
        engine.load_weights(1, shards(), round_index=1, final=True)
        calls = [entry for entry in fake.log if entry[0] == "update_weights_from_tensor"]
        assert len(calls) == 4
        assert [c[3] for c in calls] == [False, False, False, True]
        assert {d for c in calls for rank in c[1] for _, _, d in rank} == {"torch.float32", "torch.bfloat16"}
        assert all(len({d for _, _, d in rank}) == 1 for c in calls for rank in c[1])

    def test_a_refused_update_raises_and_blocks_generation_until_a_whole_version_loads(self):
        fake = FakeSGLangEngine()
        engine = SGLangEngine(fake, codec=codec, multi_dtype_buckets=True)
        engine.load_weights(1, shards(), round_index=0, final=False)
        fake.refuse = True
        with pytest.raises(RuntimeError, match="refused weight version 1: shape mismatch"):
            engine.load_weights(1, shards(), round_index=1, final=True)
        with pytest.raises(RuntimeError, match="applied in part"):
            engine.generate([[1]])
        fake.refuse = False
        engine.load_weights(2, shards(), round_index=0, final=True)
        assert engine.generate([[1, 2]], max_new_tokens=3) == [[7, 7, 7]]
        assert fake.log[-1] == ("generate", [[1, 2]], {"temperature": 0.0, "max_new_tokens": 3})

    def test_the_rollout_actor_drives_it_through_the_lifecycle(self, io_struct):
        fake = FakeSGLangEngine()
        actor = RolloutActor(SGLangEngine(fake, codec=codec, multi_dtype_buckets=True))
        actor.sleep()
        assert [entry[0] for entry in fake.log] == [
            "tokenizer_manager.pause_generation",
            "flush_cache",
            "release_memory_occupation",
            "release_memory_occupation",
        ]
        assert [entry[1] for entry in fake.log if entry[0] == "release_memory_occupation"] == [
            ["weights"],
            ["kv_cache"],
        ]

    def test_without_sglang_the_error_says_how_to_get_it(self, monkeypatch):
        if _sglang_installed():
            pytest.skip("sglang is installed")
        monkeypatch.setitem(sys.modules, "sglang", None)
        with pytest.raises(ImportError, match=r"rl-lifecycle\[sglang\]"):
            SGLangEngine(FakeSGLangEngine())


@pytest.mark.gpu
class TestRealEngine:
    def test_the_real_codec_round_trips_through_sglang(self):
        pytest.importorskip("sglang")
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        from actor_integration.rollout.sglang import sglang_codec

        encode, _multi = sglang_codec()
        assert encode([("w", torch.ones(4, device="cuda"))])

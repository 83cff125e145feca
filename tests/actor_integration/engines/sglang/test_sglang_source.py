"""SGLangEngine against SGLang's own source, for the oldest and the newest release it supports
(0.5.17 and 0.5.23: every test here runs once per version), without importing SGLang.

The adapter runs against a fake shaped by the parsed source (`tests/helpers/sglang_fake.py`): a
method, field or attribute that SGLang does not have raises AttributeError, every call is bound to
the `inspect.Signature` of SGLang's definition, and the fake behaves as the real engine does where
the adapter depends on it (the calls that end SGLang's scheduler end the fake's). The scheduler-
side receiver runs as SGLang's scheduler runs a custom weight loader. The static checks read the
behaviour the fake models (and the adapter relies on) out of each version's source.
"""

import ast
import io
import os
import pickle
import re
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import tomllib
import torch

from actor_integration.engines.sglang.engine import (
    SCHEDULER_LOADER,
    SGLANG_TAGS,
    SUPPORTED_VERSIONS,
    sglang_codec,
)
from actor_integration.engines.sglang.receiver import encode_request
from actor_integration.errors import (
    EngineDiedError,
    EngineNotIdleError,
    MemoryStateError,
    SGLangServerTimeout,
)
from actor_integration.rollout import GENERATION_MODES, RolloutActor, SGLangEngine
from actor_integration.weight_sync import CorruptBucketError, RankSlot, WeightSender
from actor_integration.weight_sync.disk import DiskSender
from lifecycle import State
from lifecycle.events import capture_events
from tests.helpers.sglang_fake import ENGINE, IO, TOKENIZER_MANAGER, FakeSGLang, flattened_bucket_codec
from tests.helpers.sglang_source import VERSIONS, literal_values
from tests.helpers.weight_sync_doubles import shm_sender_into

REPO = Path(__file__).resolve().parents[4]
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
SCHEDULER_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
KWARGS = {"model_path": "/models/tiny", "enable_memory_saver": True}


@pytest.fixture
def fake(sglang_tree):
    fake = FakeSGLang(sglang_tree, **KWARGS)
    with fake.installed():
        yield fake
    fake.close()


def assert_binds(fake):
    problems = fake.shaped.problems()
    assert not problems, "\n".join(problems)


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def sender_into(actor):
    return shm_sender_into(actor, bucket_bytes=4 << 10)


def sync(actor, sender, version, tensors):
    actor.wake_up(["weights"])
    sender.send(version, tensors.items())
    actor.wake_up([t for t in actor.engine.memory_tags if t != "weights"])


class TestPin:
    def test_the_sglang_extra_spans_exactly_the_versions_these_checks_read(self):
        """pyproject's `sglang` extra accepts the oldest through the newest version checked here."""
        extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
            "sglang"
        ]
        (pin,) = [r for r in extra if r.startswith("sglang")]
        low, high = re.fullmatch(r"sglang>=([^,]+),<=(.+)", pin).groups()
        assert (low, high) == (VERSIONS[0], VERSIONS[-1]) == SUPPORTED_VERSIONS


class TestEngineCalls:
    def test_building_the_engine_adds_the_receiver_and_takes_over_sglangs_failure_handling(self, fake):
        """The engine gets the lifecycle's loader and SIGQUIT handler, SGLang's watchdog is stopped,
        the schedulers answer the receiver's hello, and the adapter says what it found."""
        engine = SGLangEngine(**KWARGS)
        (built,) = [c for c in fake.shaped.calls if c.qualname == "Engine()"]
        assert built.kwargs["custom_weight_loader"] == [SCHEDULER_LOADER]
        assert callable(built.kwargs["custom_sigquit_handler"])
        assert "SubprocessWatchdog.stop" in fake.shaped.called()
        assert engine.engine.tokenizer_manager.signal_handler_class.__name__ == "LifecycleSignals"
        assert engine.scheduler_pids == [os.getpid()]  # the fake runs the scheduler's loader in-process
        described = engine.describe()
        assert described["sglang"] == fake.version and described["supported"] is True
        assert described["memory_tags"] == list(SGLANG_TAGS) and described["weights_via"] == "scheduler"
        assert described["weight_sessions"] is fake.sessions
        assert engine.memory_bytes("weights") == int(1.5 * (1 << 30))
        assert engine.memory_bytes() == int(21.75 * (1 << 30))
        assert_binds(fake)

    def test_without_cuda_graphs_the_engine_has_two_tags(self, fake):
        """CUDA graphs off: `cuda_graph` is not a tag of the engine (nothing to release)."""
        engine = SGLangEngine(**KWARGS, disable_cuda_graph=True)
        assert engine.memory_tags == ("weights", "kv_cache")
        with pytest.raises(ValueError, match="cuda_graph only with CUDA graphs on"):
            engine.release_memory_occupation(["cuda_graph"])

    def test_memory_and_generation_control_bind(self, fake):
        """Release, resume, every pause mode, continue, flush, the queue, generation and the
        weights' checksum bind, and reach the scheduler in that order."""
        engine = SGLangEngine(**KWARGS)
        for mode in GENERATION_MODES:
            engine.pause_generation(mode)
        assert engine.flush_cache() is True
        engine.release_memory_occupation(None)
        assert fake.released == set(SGLANG_TAGS)
        engine.resume_memory_occupation(["weights"])
        engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
        engine.continue_generation()
        assert engine.queued_requests() == {"running": 0, "waiting": 0}
        assert len(engine.generate([[1, 2], [3]], max_new_tokens=3)[1]) == 3
        assert engine.weights_checksum() == fake.model.checksum()
        assert_binds(fake)

    def test_a_round_goes_to_the_scheduler_verified_and_loads_bit_exact(self, fake):
        """A real sender's round reaches the scheduler's receiver unopened; it verifies and loads
        exactly the tensors sent, inside a weight-update session where the version needs one."""
        actor = RolloutActor(SGLangEngine(**KWARGS))
        actor.sleep()
        sent = weights(1)
        sync(actor, sender_into(actor), 1, sent)
        assert fake.model.params.keys() == sent.keys()
        for name, tensor in sent.items():
            assert torch.equal(fake.model.params[name], tensor), name
        assert actor.weight_version() == 1 and actor.lifecycle.state is State.AWAKE
        calls = [c for c, _ in fake.log]
        assert ("begin_weight_update" in calls) is fake.sessions
        assert not fake.session_open
        assert_binds(fake)

    def test_a_corrupt_round_is_refused_before_anything_is_written(self, fake):
        """A bucket corrupted in the shm file after packing: the scheduler refuses the round with
        CorruptBucketError, nothing is loaded, the session is closed, the sender's resend loads."""
        actor = RolloutActor(SGLangEngine(**KWARGS))
        sender = sender_into(actor)
        actor.sleep()
        sync(actor, sender, 1, weights(1))
        loads = fake.model.loads
        corrupted = []

        def corrupt_once(version, payloads):
            if not corrupted:
                path = payloads[0].descriptors[0].path
                with open(path, "r+b") as f:
                    f.seek(5)
                    byte = f.read(1)
                    f.seek(5)
                    f.write(bytes([byte[0] ^ 0x40]))
                corrupted.append(path)
            return actor.update_weights(version, payloads)

        sender.engine_call = corrupt_once
        actor.sleep()
        actor.wake_up(["weights"])
        sender.corrupt_resends = 0
        with pytest.raises(Exception, match="checksum") as info:
            sender.send(2, weights(2).items())
        assert isinstance(info.value, CorruptBucketError) or isinstance(
            info.value.__cause__, CorruptBucketError
        )
        assert fake.model.loads == loads and not fake.session_open
        sender.corrupt_resends = 1
        corrupted.clear()
        sender.send(3, weights(3).items())  # corrupt once, resent, loaded
        assert torch.equal(fake.model.params["model.norm.weight"], weights(3)["model.norm.weight"])
        assert actor.weight_version() == 3
        assert_binds(fake)

    def test_without_the_scheduler_receiver_verified_buckets_go_as_flattened_buckets(self, fake):
        """An engine started without the lifecycle's loader takes SGLang's own flattened buckets,
        verified by the rollout's receiver; the tensors arrive bit-exact, sessions included."""
        engine = SGLangEngine(**KWARGS, scheduler_receiver=False, bucket_codec=flattened_bucket_codec)
        assert engine.describe()["weights_via"] == "flattened_bucket"
        actor = RolloutActor(engine)
        actor.sleep()
        sent = weights(4)
        sync(actor, sender_into(actor), 1, sent)
        for name, tensor in sent.items():
            assert torch.equal(fake.model.params[name], tensor), name
        assert not fake.session_open
        assert_binds(fake)

    def test_the_schedulers_own_timings_reach_the_loaded_event_of_their_version_only(self, fake, tmp_path):
        """A round the schedulers received reports their phases in `weight_sync.loaded` and
        `engine_timings()`; a later version that went as flattened buckets (disk, which the
        schedulers do not open) carries none, not the previous version's."""
        actor = RolloutActor(SGLangEngine(**KWARGS, bucket_codec=flattened_bucket_codec))
        actor.sleep()
        with capture_events() as events:
            sync(actor, sender_into(actor), 1, weights(1))
        (loaded,) = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert loaded["transport"] == "shm"
        assert {"verify_ms", "scheduler_ms", "call_ms", "load_path"} <= loaded["engine_ms"].keys()
        assert actor.engine_timings() == loaded["engine_ms"]
        actor.sleep()
        disk = WeightSender(
            RankSlot.single(0),
            None,
            DiskSender(tmp_path),
            rank=0,
            engine_call=actor.update_weights,
            bucket_bytes=4 << 10,
            deadline_s=30.0,
        )
        with capture_events() as events:
            sync(actor, disk, 2, weights(2))
        (loaded,) = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert loaded["transport"] == "disk" and "engine_ms" not in loaded
        assert actor.engine_timings() == {}
        assert_binds(fake)

    def test_the_codec_binds(self, fake):
        """SGLang's flattened-bucket codec builds and serializes through SGLang's own classes."""
        encode, multi_dtype = sglang_codec()
        assert isinstance(encode([("w", torch.zeros(2))]), str)
        assert multi_dtype is True
        assert_binds(fake)


class TestGuards:
    """Calls SGLang answers by ending its scheduler are refused before they are sent."""

    def test_a_second_release_is_refused_and_the_scheduler_lives(self, fake):
        engine = SGLangEngine(**KWARGS)
        engine.flush_cache()
        engine.release_memory_occupation(["kv_cache"])
        with pytest.raises(MemoryStateError, match="already released"):
            engine.release_memory_occupation(["kv_cache", "weights"])
        assert fake.alive and fake.released == {"kv_cache"}

    def test_a_resume_of_a_resident_tag_is_refused(self, fake):
        engine = SGLangEngine(**KWARGS)
        with pytest.raises(MemoryStateError, match="not released"):
            engine.resume_memory_occupation(["weights"])
        assert fake.alive

    def test_generation_and_weight_loads_into_released_memory_are_refused(self, fake):
        engine = SGLangEngine(**KWARGS)
        engine.flush_cache()
        engine.release_memory_occupation(["weights"])
        with pytest.raises(MemoryStateError, match="generate with \\['weights'\\] released"):
            engine.generate([[1]], max_new_tokens=1)
        with pytest.raises(MemoryStateError, match="update_weights with \\['weights'\\] released"):
            engine.load_weights(1, [[("w", torch.zeros(2))]], round_index=0, final=True)
        assert fake.alive

    def test_a_release_with_requests_queued_is_refused_where_sglang_asserts_idle(self, fake):
        """0.5.17 asserts an idle scheduler on release: with requests queued and no flush since,
        the adapter refuses with EngineNotIdleError; 0.5.23 releases a paused engine."""
        engine = SGLangEngine(**KWARGS)
        fake.queued = {"running": 1, "waiting": 2}
        if fake.version < "0.5.23":
            with pytest.raises(EngineNotIdleError, match="asserts an idle scheduler"):
                engine.release_memory_occupation(["kv_cache"])
            assert fake.alive and not fake.released
        else:
            fake.paused = True
            engine.release_memory_occupation(["kv_cache"])
            assert fake.alive and fake.released == {"kv_cache"}

    def test_a_scheduler_that_dies_while_a_call_waits_is_a_typed_error_at_once(self, fake):
        """The scheduler killed while generate waits: EngineDiedError names the process, its pid
        and exit code within a poll, and every later call raises it without waiting."""
        engine = SGLangEngine(**KWARGS, poll_s=0.05)
        pid = fake.scheduler.pid
        fake.hang.add("generate")
        fake.loop.call_later(0.2, fake.kill_scheduler, "killed by the test")
        started = time.monotonic()
        with pytest.raises(EngineDiedError) as info:
            engine.generate([[1]], max_new_tokens=1)
        assert time.monotonic() - started < 5
        assert info.value.pid == pid and info.value.exitcode == -9 and info.value.process == "scheduler_0"
        assert f"pid {pid}" in str(info.value) and info.value.call == "generate"
        started = time.monotonic()
        with pytest.raises(EngineDiedError, match="scheduler_0") as again:
            engine.flush_cache()
        assert time.monotonic() - started < 0.5 and again.value.call == "flush_cache"

    def test_the_rollout_lifecycle_fails_on_a_dead_engine_and_says_why(self, fake):
        """A sleep on a dead engine: the lifecycle goes FAILED with the typed error as its cause."""
        actor = RolloutActor(SGLangEngine(**KWARGS, poll_s=0.05))
        fake.kill_scheduler("killed by the test")
        with pytest.raises(EngineDiedError):
            actor.sleep()
        snapshot = actor.lifecycle_state()
        assert snapshot["state"] == "FAILED" and "EngineDiedError" in snapshot["failure"]["error"]

    def test_a_call_that_never_answers_times_out_typed(self, fake):
        engine = SGLangEngine(**KWARGS, call_timeout_s=0.3, poll_s=0.05)
        fake.hang.add("flush_cache")
        with pytest.raises(SGLangServerTimeout, match="did not answer flush_cache within 0 s"):
            engine.flush_cache()
        assert fake.alive

    def test_arguments_the_lifecycle_cannot_drive_are_refused_before_the_engine_starts(
        self, fake, monkeypatch
    ):
        with pytest.raises(ValueError, match="enable_memory_saver=True is needed"):
            SGLangEngine(model_path="/models/tiny")
        monkeypatch.setenv("LD_PRELOAD", "/x/torch_memory_saver_hook_mode_preload_cu13.abi3.so")
        with pytest.raises(ValueError, match="already preloads torch_memory_saver"):
            SGLangEngine(**KWARGS)
        assert not [c for c in fake.shaped.calls if c.qualname == "Engine()"]


class TestFromSource:
    """What the adapter relies on, read from each version's source."""

    def test_a_custom_loader_is_called_with_the_model_and_tensors_moved_to_the_device(self, sglang_tree):
        """SGLang calls `custom_loader(self.get_model(), named_tensors)` for a load_format listed in
        custom_weight_loader, after `_unwrap_tensor` moved each tensor with `.to(device)`."""
        body = ast.unparse(
            sglang_tree.lookup(WEIGHT_UPDATER, "WeightUpdater").method("update_weights_from_tensor").node
        )
        assert "load_format in self.custom_weight_loaders" in body
        assert "custom_loader(self.get_model(), named_tensors)" in body
        unwrap = ast.unparse(sglang_tree.lookup(WEIGHT_UPDATER, "_unwrap_tensor").node)
        assert "tensor.to(device)" in unwrap

    def test_every_class_our_request_pickles_is_on_sglangs_unpickling_allowlist(self, sglang_tree):
        """SGLang unpickles requests with SafeUnpickler: every global our request references (an
        empty tensor beside each name) is allowed, by module prefix (0.5.17) or exactly (0.5.23)."""
        safe = sglang_tree.cls("sglang.srt.utils.common.SafeUnpickler")
        names = encode_request("hello", call="c", reply="/dev/shm/r", ranks=2)
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump([(name, torch.empty(0)) for name in names])
        found = _pickled_globals(buffer.getvalue())
        assert found, "the pickle references no global at all: the scan is broken"
        exact = safe.class_attribute("ALLOWED_GLOBALS")
        if exact is not None:
            refused = sorted(found - {tuple(pair) for pair in exact.value})
        else:
            prefixes = tuple(safe.class_attribute("ALLOWED_MODULE_PREFIXES").value)
            refused = sorted(g for g in found if not any((g[0] + ".").startswith(p) for p in prefixes))
        assert not refused, refused

    def test_the_engine_arguments_the_adapter_sets_and_reads_exist(self, sglang_tree):
        fields = sglang_tree.server_args_fields()
        wanted = {
            "custom_weight_loader",
            "custom_sigquit_handler",
            "enable_memory_saver",
            "disable_cuda_graph",
            "tp_size",
        }
        assert wanted <= fields

    def test_the_demos_engine_arguments_exist(self, sglang_tree):
        """`lifecycle demo --engine sglang` builds its engine with these (CUDA graphs for its batches only)."""
        from actor_integration.tools.demo.rollout import sglang_arguments

        arguments = sglang_arguments("/models/tiny", mem_fraction=0.15, seed=0)
        assert arguments["cuda_graph_max_bs_decode"] == 8 and arguments["cuda_graph_max_bs_prefill"] == 64
        assert set(arguments) - sglang_tree.server_args_fields() == set()

    def test_sglangs_failure_handling_is_where_the_adapter_takes_it_over(self, sglang_tree):
        """The watchdog keeps `_processes`, `_names` and has `stop`; the tokenizer manager builds
        its signal handler from `self.signal_handler_class`, whose SIGQUIT handler kills the tree."""
        watchdog = sglang_tree.cls("sglang.srt.utils.watchdog.SubprocessWatchdog")
        assert {"_processes", "_names"} <= watchdog.instance_attributes() and watchdog.method("stop")
        manager = sglang_tree.cls(TOKENIZER_MANAGER)
        assert "signal_handler_class" in manager.instance_attributes()
        loop_body = ast.unparse(manager.method("auto_create_handle_loop").node)
        assert "self.signal_handler_class(self)" in loop_body and "running_phase_sigquit_handler" in loop_body
        assert sglang_tree.cls(ENGINE).method("get_all_child_pids") is not None

    def test_the_tp_group_gives_rank_size_and_cpu_group(self, sglang_tree):
        group = sglang_tree.cls("sglang.srt.distributed.parallel_state.GroupCoordinator")
        assert {"rank_in_group", "world_size", "cpu_group"} <= group.instance_attributes()
        assert sglang_tree.lookup("sglang.srt.distributed.parallel_state", "get_tp_group") is not None

    def test_memory_usage_reports_weights_kv_cache_and_graphs(self, sglang_tree):
        module = "sglang.srt.managers.scheduler_components.memory_usage"
        node = sglang_tree.lookup(module, "build_memory_usage").node
        keys = {
            k.value
            for d in ast.walk(node)
            if isinstance(d, ast.Dict)
            for k in d.keys
            if isinstance(k, ast.Constant)
        }
        assert {"weight", "kvcache", "graph"} <= keys
        # and the scheduler publishes it under this name in its internal state
        publishers = [
            "sglang.srt.managers.scheduler",
            "sglang.srt.managers.scheduler_components.internal_state",
        ]
        sources = [sglang_tree.source(m) for m in publishers if sglang_tree.has_module(m)]
        assert any(re.search(r'\["memory_usage"\] = build_memory_usage\(', text) for text in sources)

    def test_our_memory_tags_are_sglangs_gpu_memory_types(self, sglang_tree):
        assert set(sglang_tree.constants("sglang.srt.constants")["GPU_MEMORY_ALL_TYPES"]) == set(SGLANG_TAGS)

    def test_which_versions_release_a_paused_engine_is_what_the_adapter_assumes(self, sglang_tree):
        """0.5.17's release asserts a fully idle scheduler; 0.5.23 ignores the waiting queue of a
        paused engine. The adapter checks the queue itself before 0.5.23."""
        release = _release_source(sglang_tree)
        assert "is_fully_idle(" in release
        assert ("ignore_waiting" in release) is (sglang_tree.version >= "0.5.23")

    def test_weight_sessions_are_needed_exactly_where_the_engine_offers_them(self, sglang_tree):
        """Where Engine has begin_weight_update, the scheduler refuses a tensor update outside a session."""
        has_sessions = sglang_tree.cls(ENGINE).method("begin_weight_update") is not None
        assert has_sessions is (sglang_tree.version >= "0.5.23")
        source = sglang_tree.source(SCHEDULER_UPDATER)
        assert ("must run between" in source) is has_sessions

    def test_our_pause_modes_are_the_ones_sglang_accepts(self, sglang_tree):
        mode = sglang_tree.cls(f"{IO}.PauseGenerationReqInput").field("mode")
        assert set(GENERATION_MODES) == set(literal_values(mode.annotation))

    def test_sampling_parameters_are_sglangs(self, sglang_tree):
        signature = sglang_tree.cls("sglang.srt.sampling.sampling_params.SamplingParams").constructor()
        signature.bind(temperature=0.0, max_new_tokens=8)

    def test_generation_outputs_carry_output_ids(self, sglang_tree):
        assert '"output_ids"' in sglang_tree.source("sglang.srt.managers.tokenizer_manager")

    def test_the_codec_writes_the_keys_sglangs_bucket_loader_reads(self, sglang_tree):
        loader = sglang_tree.lookup(WEIGHT_UPDATER, "WeightUpdater").method(
            "_update_weights_from_flattened_bucket"
        )
        read = {
            node.slice.value
            for node in ast.walk(loader.node)
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        }
        assert {"flattened_tensor", "metadata"} <= read


class TestTheCheckCanFail:
    """The source-shaped fakes catch calls SGLang would reject."""

    def test_a_method_sglang_lacks_raises(self, fake):
        import sglang

        with pytest.raises(
            AttributeError, match=rf"sglang {re.escape(fake.version)}: .*Engine has no .*'pause_generation'"
        ):
            sglang.Engine().pause_generation(mode="retract")

    def test_a_keyword_the_definition_lacks_is_reported(self, fake):
        import sglang

        sglang.Engine().update_weights_from_tensor(named_tensors=[], weight_version="3")
        (problem,) = fake.shaped.problems()
        assert "unexpected keyword argument 'weight_version'" in problem

    def test_a_wrong_struct_field_is_reported(self, fake):
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        PauseGenerationReqInput(pause_mode="retract")
        (problem,) = fake.shaped.problems()
        assert "PauseGenerationReqInput()" in problem and "pause_mode" in problem


def _pickled_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) globals unpickling `data` imports, as SafeUnpickler's find_class sees them."""
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return found


def _release_source(tree):
    for node in ast.walk(tree.module(SCHEDULER_UPDATER)):
        if isinstance(node, ast.FunctionDef) and node.name == "release_memory_occupation":
            return ast.unparse(node)
    raise AssertionError(f"sglang {tree.version}: no release_memory_occupation in {SCHEDULER_UPDATER}")

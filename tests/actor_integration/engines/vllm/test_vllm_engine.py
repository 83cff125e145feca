"""The offline adapter called directly: the level/tag table, and each of the field's killers refused
before vLLM is called, the engine alive after. Every fake call binds to vLLM 0.26.0's signature; each
refusal test also shows what the unguarded call does to the fake engine."""

import threading

import pytest
import torch

from actor_integration.engines.vllm import VLLMEngine
from actor_integration.errors import (
    EngineDiedError,
    EngineNotIdleError,
    IpcSerializationError,
    MemoryStateError,
    SleepTagsError,
    WeightsDiscardedError,
    WeightUpdateBusyError,
)
from tests.helpers.vllm_fake import FakeLLM, weights

PROMPTS = [[1, 2, 3], [4, 5]]


def load_ipc(engine, version, tensors):
    engine.load_weights(version, [list(tensors.items())], round_index=0, final=True)


class TestTable:
    @pytest.mark.parametrize("tags", [None, ["weights", "kv_cache"], ["kv_cache", "weights"]])
    def test_both_tags_are_one_sleep_at_the_configured_level(self, fake, make_engine, tags):
        engine = make_engine(sleep_level=1)
        engine.release_memory_occupation(tags)
        assert fake.calls[-1] == "sleep" and fake.level == 1
        assert engine.residency == {"weights": False, "kv_cache": False}
        assert engine.weights_state() == "host"

    @pytest.mark.parametrize("tags", [["weights"], ["kv_cache"]])
    def test_one_tag_alone_is_refused_before_vllm(self, fake, make_engine, tags):
        engine = make_engine()
        before = list(fake.calls)
        with pytest.raises(SleepTagsError, match="together") as info:
            engine.release_memory_occupation(tags)
        assert info.value.fields["tags"] == tags and fake.calls == before
        assert engine.residency == {"weights": True, "kv_cache": True}

    def test_unknown_tags_and_a_string_are_refused(self, make_engine):
        engine = make_engine()
        with pytest.raises(ValueError, match="cuda_graph"):
            engine.release_memory_occupation(["cuda_graph", "weights"])
        with pytest.raises(TypeError, match="list of tag names"):
            engine.resume_memory_occupation("weights")

    def test_a_partial_wake_is_vllms_wake_up_of_those_tags(self, fake, make_engine):
        engine = make_engine()
        engine.release_memory_occupation(None)
        engine.resume_memory_occupation(["weights"])
        assert fake.sleeping_tags == {"kv_cache"} and fake.paused  # vLLM schedules once all are awake
        engine.resume_memory_occupation(["kv_cache"])
        assert not fake.sleeping_tags and not fake.paused and not fake.warnings

    def test_level_two_discards_and_a_whole_load_restores(self, fake, make_engine):
        engine = make_engine(sleep_level=2)
        expected = engine.generate(PROMPTS, max_new_tokens=4)
        engine.release_memory_occupation(None)
        assert engine.weights_state() == "discarded"
        engine.resume_memory_occupation(["weights"])
        load_ipc(engine, 1, weights(0))
        engine.resume_memory_occupation(["kv_cache"])
        assert engine.weights_state() == "resident" and engine.weight_version == 1
        assert engine.generate(PROMPTS, max_new_tokens=4) == expected

    def test_the_sleep_level_is_checked(self, fake):
        with pytest.raises(ValueError, match="sleep_level must be 1"):
            VLLMEngine(FakeLLM(fake), sleep_level=0)

    def test_an_llm_without_sleep_mode_is_refused(self, fake):
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            VLLMEngine(FakeLLM(fake, sleep_mode=False))


class TestKillers:
    """Each would end or corrupt the real engine; the fake shows the unguarded call doing so."""

    def test_a_weight_update_while_asleep(self, fake, make_engine):
        engine = make_engine()
        engine.release_memory_occupation(None)
        calls = list(fake.calls)
        with pytest.raises(MemoryStateError, match="57853"):
            load_ipc(engine, 1, weights(1))
        with pytest.raises(MemoryStateError, match="57853"):
            engine.begin_weight_update("trainer")
        assert fake.calls == calls and fake.dead is None
        fake.start_update()  # unguarded: vLLM's EngineCore segfaults
        with pytest.raises(RuntimeError, match="segfault"):
            fake.update({"names": [], "ipc_handles": []})

    @pytest.mark.parametrize("woken", [[], ["weights"], ["kv_cache"]])
    def test_generation_while_any_tag_sleeps(self, fake, make_engine, woken):
        engine = make_engine(sleep_level=1)
        engine.release_memory_occupation(None)
        for tag in woken:
            engine.resume_memory_occupation([tag])
        calls = list(fake.calls)
        match = "KV cache asleep" if woken == ["weights"] else "illegal memory access"
        with pytest.raises(MemoryStateError, match=match):
            engine.generate(PROMPTS, max_new_tokens=2)
        assert fake.calls == calls and fake.dead is None
        with pytest.raises(RuntimeError, match="illegal memory access"):
            fake.generate(PROMPTS, 2)  # unguarded

    def test_a_second_sleep_and_a_second_wake(self, fake, make_engine):
        engine = make_engine()
        engine.release_memory_occupation(None)
        calls = list(fake.calls)
        with pytest.raises(MemoryStateError, match="36651"):
            engine.release_memory_occupation(None)
        engine.resume_memory_occupation(["weights"])
        calls = list(fake.calls)
        with pytest.raises(MemoryStateError, match="already awake"):
            engine.resume_memory_occupation(["weights"])
        with pytest.raises(MemoryStateError, match="36651"):
            engine.release_memory_occupation(None)  # the KV cache still sleeps
        assert fake.calls == calls and not fake.warnings
        fake.sleep(2, "abort")  # unguarded: vLLM ignores it with a warning, the caller believes it slept
        assert fake.warnings == ["Executor is already sleeping."]

    def test_a_sleep_with_requests_in_flight(self, fake, make_engine):
        engine = make_engine()
        fake.unfinished = 2  # submitted to vLLM by someone else, generation not paused
        with pytest.raises(EngineNotIdleError, match="28714"):
            engine.release_memory_occupation(None)
        assert "sleep" not in fake.calls and fake.dead is None
        assert engine.queued_requests() == {"running": 2, "waiting": 0}
        engine.pause_generation("abort")  # vLLM's pause aborts them: then the sleep is safe
        engine.release_memory_occupation(None)
        assert fake.sleeping_tags == {"weights", "kv_cache"}

    def test_a_sleep_while_this_adapter_generates(self, fake, make_engine):
        engine = make_engine()
        started, release = threading.Event(), threading.Event()
        generate = fake.generate

        def slow(prompts, n):
            started.set()
            release.wait(5)
            return generate(prompts, n)

        fake.generate = slow
        worker = threading.Thread(target=engine.generate, args=(PROMPTS,), kwargs={"max_new_tokens": 2})
        worker.start()
        started.wait(5)
        try:
            with pytest.raises(EngineNotIdleError, match="in flight"):
                engine.release_memory_occupation(None)
        finally:
            release.set()
            worker.join(5)
        assert "sleep" not in fake.calls
        engine.release_memory_occupation(None)

    def test_level_two_without_a_reload(self, fake, make_engine):
        engine = make_engine(sleep_level=2)
        before = engine.generate(PROMPTS, max_new_tokens=4)
        engine.release_memory_occupation(None)
        engine.resume_memory_occupation(None)
        calls = list(fake.calls)
        with pytest.raises(WeightsDiscardedError, match="gibberish"):
            engine.generate(PROMPTS, max_new_tokens=4)
        assert fake.calls == calls
        fake.paused = False
        assert fake.generate(PROMPTS, 4) != before  # unguarded: vLLM answers, wrongly, without an error


class TestWeightTransfer:
    def test_one_coordinator_per_engine(self, fake, make_engine):
        """vime #57: two coordinators started one update on one slot; the second is refused."""
        engine = make_engine()
        first = engine.begin_weight_update("coordinator-0")
        with pytest.raises(WeightUpdateBusyError, match="vime #57") as info:
            engine.begin_weight_update("coordinator-1")
        assert info.value.fields["owner"] == "coordinator-0"
        assert fake.calls.count("start_weight_update") == 1
        with pytest.raises(MemoryStateError, match="in progress"):
            engine.release_memory_occupation(None)  # no sleep under an update either
        fake.ipc_sender(iter(weights(5).items()), {"send_mode": first.update})
        first.finish(5)
        assert engine.weight_version == 5 and torch.equal(
            fake.model.params["model.norm.weight"], weights(5)["model.norm.weight"]
        )
        engine.begin_weight_update("coordinator-1").abort()  # free again

    def test_load_weights_goes_through_vllms_ipc_session(self, fake, make_engine):
        engine = make_engine(worker_receiver=False)
        load_ipc(engine, 3, weights(3))
        assert fake.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        assert fake.model.digest() != "" and engine.weight_version == 3
        assert torch.equal(
            fake.model.params["model.embed_tokens.weight"], weights(3)["model.embed_tokens.weight"]
        )

    def test_a_chunk_failed_inside_vllm_leaves_its_layers_unloaded_until_a_whole_load(
        self, fake, make_engine
    ):
        engine = make_engine(worker_receiver=False)
        update = engine.begin_weight_update("trainer")
        fake.ipc_sender(iter(list(weights(4).items())[:1]), {"send_mode": update.update})
        with pytest.raises(TypeError, match="unexpected fields"):
            update.update({"names": [], "bogus": 1})
        update.abort()  # vLLM's worker ended the session: its finish is refused, the layers stay on meta
        assert fake.layers_on_meta and isinstance(update.finish_error, RuntimeError)
        with pytest.raises(WeightsDiscardedError, match="layers unloaded"):
            engine.generate(PROMPTS, max_new_tokens=2)
        calls = len(fake.calls)
        with pytest.raises(MemoryStateError, match="meta tensor"):
            engine.release_memory_occupation()  # level 2 would fail in vLLM's worker
        assert fake.calls[calls:] == []
        load_ipc(engine, 4, weights(4))
        assert not fake.layers_on_meta
        assert len(engine.generate(PROMPTS, max_new_tokens=2)[0]) == 2

    def test_a_chunk_failed_before_vllm_is_finished_there_and_the_version_mixed(
        self, fake, make_engine, monkeypatch
    ):
        """A chunk that never reached EngineCore (here vLLM's msgpack client refusing it, as on the H100):
        the abort's finish puts the layers back, so the engine can sleep at level 2 and serve the next load."""
        engine = make_engine(worker_receiver=False)
        monkeypatch.setattr(engine, "_check_ipc_transfer", lambda: None)  # let it reach vLLM's client
        monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
        with pytest.raises(TypeError, match="not serializable"):
            load_ipc(engine, 4, weights(4))
        assert not fake.layers_on_meta and not fake.update_active
        with pytest.raises(WeightsDiscardedError, match="in part"):
            engine.generate(PROMPTS, max_new_tokens=2)
        engine.release_memory_occupation()
        engine.resume_memory_occupation(["weights"])
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        load_ipc(engine, 5, weights(5))
        engine.resume_memory_occupation(["kv_cache"])
        assert len(engine.generate(PROMPTS, max_new_tokens=2)[0]) == 2

    def test_the_packed_buffer_holds_the_largest_tensor(self, fake, make_engine, monkeypatch):
        """vLLM's packed sender refuses a tensor larger than its buffer (1 GiB: a 7B's embedding is
        1.09 GB, seen on an H100); the adapter asks for a buffer that holds the largest."""
        import actor_integration.engines.vllm.base as base

        seen: list[dict] = []

        def sender(iterator, trainer_args):
            seen.append({k: v for k, v in trainer_args.items() if k != "send_mode"})
            fake.ipc_sender(iterator, trainer_args)

        tensors = weights(4)
        largest = max(t.numel() * t.element_size() for t in tensors.values())
        monkeypatch.setattr(base, "PACKED_BUFFER_BYTES", largest // 2)
        load_ipc(make_engine(worker_receiver=False, ipc_sender=sender), 4, tensors)
        monkeypatch.setattr(base, "PACKED_BUFFER_BYTES", largest * 2)
        load_ipc(make_engine(worker_receiver=False, ipc_sender=sender), 5, tensors)
        assert seen == [
            {"packed": True, "packed_buffer_size_bytes": largest},
            {"packed": True, "packed_buffer_size_bytes": largest * 2},
        ]

    def test_vllms_ipc_path_without_pickles_is_refused_before_vllm(self, fake, make_engine, monkeypatch):
        monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
        engine = make_engine(worker_receiver=False)
        calls = len(fake.calls)
        with pytest.raises(
            IpcSerializationError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1, unset when the engine"
        ):
            engine.begin_weight_update("trainer")
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # too late: EngineCore read it at start
        with pytest.raises(IpcSerializationError):
            load_ipc(engine, 4, weights(4))
        assert fake.calls[calls:] == [] and not fake.update_active and engine.guard.update_owner is None

    def test_pause_modes_map_onto_vllms(self, fake, make_engine):
        engine = make_engine()
        engine.pause_generation("in_place")
        assert fake.paused and fake.calls[-1] == "sleep"
        engine.continue_generation()
        assert not fake.paused
        with pytest.raises(ValueError, match="retract"):
            engine.pause_generation("retract")
        assert engine.flush_cache() is True


class TestEngineCoreDeath:
    """vLLM's EngineCore is a child process (the fake's: a real one): once it exited, every call is a
    typed `EngineDiedError` naming it, instead of vLLM's untyped `EngineDeadError`."""

    def test_a_killed_engine_core_is_a_typed_error_on_the_next_call(self, fake, make_engine):
        import os
        import signal

        core = fake.engine_core_process()
        engine = make_engine()
        assert engine.engine_processes() == {"EngineCore": core.pid}
        assert engine.generate(PROMPTS, max_new_tokens=2)
        os.kill(core.pid, signal.SIGKILL)
        core.join(timeout=10)
        calls = len(fake.calls)
        with pytest.raises(EngineDiedError, match=f"EngineCore process \\(pid {core.pid}\\) exited") as info:
            engine.generate(PROMPTS, max_new_tokens=2)
        assert info.value.pid == core.pid and info.value.exitcode == -signal.SIGKILL
        assert info.value.call == "generate" and fake.calls[calls:] == []  # refused before vLLM
        with pytest.raises(EngineDiedError) as again:  # every later call, named by what it was
            engine.pause_generation("abort")
        assert again.value.call == "pause" and again.value.pid == core.pid

    def test_vllms_engine_dead_error_becomes_the_typed_error(self, fake, make_engine):
        """EngineCore can tell the client it died before its process is gone (vLLM's ENGINE_CORE_DEAD)."""
        engine = make_engine()
        fake.reported_dead = True
        with pytest.raises(EngineDiedError, match="EngineCore died during sleep") as info:
            engine.release_memory_occupation(None)
        assert type(info.value.__cause__).__name__ == "EngineDeadError"
        assert engine.residency == {"weights": True, "kv_cache": True}  # nothing counted as released

    def test_an_in_process_engine_core_has_no_process_and_shuts_down(self, fake, make_engine):
        assert make_engine().engine_processes() == {}
        core = fake.engine_core_process()
        engine = make_engine()
        engine.shutdown()
        assert not core.is_alive()

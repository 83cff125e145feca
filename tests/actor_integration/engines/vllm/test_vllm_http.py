"""The HTTP adapter against a fake `vllm serve` on a real socket: every route, method, query
parameter and JSON field checked against vLLM 0.26.0's server source, the same refusals as the
offline adapter, and the server's failures typed."""

import pytest
import torch

from actor_integration.engines.vllm import VLLMHTTPEngine, VLLMRolloutActor, make_engine
from actor_integration.errors import MemoryStateError, SleepTagsError, VLLMServerError, VLLMServerTimeout
from tests.helpers.vllm_fake import weights
from tests.helpers.vllm_server import FakeVLLMServer
from tests.helpers.weight_sync_doubles import shm_sender_into

PROMPTS = [[2, 7], [1, 8, 2]]


@pytest.fixture
def server(fake):
    server = FakeVLLMServer(fake)
    yield server
    server.close()
    assert not server.problems, server.problems


def engine_at(server, **kwargs):
    kwargs.setdefault("ipc_sender", server.fake.ipc_sender)
    return VLLMHTTPEngine(server.url, timeout_s=5, **kwargs)


def test_a_colocated_cycle_through_the_server_with_the_workers_receiver(server, tmp_path):
    engine = engine_at(server, worker_receiver=True)
    actor = VLLMRolloutActor(engine, log_dir=str(tmp_path))
    sender = shm_sender_into(actor, bucket_bytes=1 << 10)
    for version in (1, 2, 3):
        actor.sleep()
        actor.wake_up(["weights"])
        sender.send(version, weights(version).items())
        actor.wake_up(["kv_cache"])
        assert len(actor.generate(PROMPTS, max_new_tokens=3)[1]) == 3
    assert engine.served_weight_version() == "3"
    paths = {r.split("?")[0] for r in server.requests}
    assert {"POST /sleep", "POST /wake_up"} <= paths
    # vLLM's wake of the last tag resumes its scheduler itself: the wake's continue sends no /resume,
    # and the server serves (the fake, as vLLM, refuses a generation while its scheduler is paused)
    assert "POST /resume" not in paths and not server.fake.paused
    # vLLM's /sleep pauses (abort) and clears the caches itself: the sleep sends no /pause (which
    # waits 20 ms after pausing) and no /reset_prefix_cache before it
    assert not {"POST /pause", "POST /reset_prefix_cache"} & paths
    assert "POST /sleep?level=2&mode=abort" in server.requests
    assert (
        "POST /wake_up?tags=weights" in server.requests and "POST /wake_up?tags=kv_cache" in server.requests
    )


def test_vllms_ipc_path_sends_the_handles_pickled_as_vllms_http_sender_does(server, fake):
    engine = engine_at(server)
    assert engine.served_weight_version() is None  # vLLM keeps no version without the extension
    engine.load_weights(4, [list(weights(4).items())], round_index=0, final=True)
    assert torch.equal(fake.model.params["model.norm.weight"], weights(4)["model.norm.weight"])
    assert [r for r in server.requests if "weight_update" in r or "update_weights" in r] == [
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
    ]


def test_the_killers_are_refused_before_the_server_hears_of_them(server, fake):
    engine = engine_at(server)
    engine.pause_generation("abort")
    engine.release_memory_occupation(None)
    seen = len(server.requests)
    with pytest.raises(MemoryStateError, match="57853"):
        engine.load_weights(1, [list(weights(1).items())], round_index=0, final=True)
    with pytest.raises(MemoryStateError):
        engine.generate(PROMPTS)
    with pytest.raises(MemoryStateError, match="36651"):
        engine.release_memory_occupation(None)
    with pytest.raises(SleepTagsError):
        engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation(None)
    seen += 1
    with pytest.raises(MemoryStateError, match="already awake"):
        engine.resume_memory_occupation(["weights"])
    assert len(server.requests) == seen and fake.dead is None


def test_a_sleep_while_the_server_serves_is_refused(server, fake):
    engine = engine_at(server)
    with pytest.raises(Exception, match="not paused"):
        engine.release_memory_occupation(None)
    assert 1 not in fake.sleeps and 2 not in fake.sleeps


def test_a_dead_engine_behind_a_live_server_is_a_typed_error(server, fake):
    engine = engine_at(server)
    engine.alive()
    fake.dead = "segfault (vllm #57853)"
    with pytest.raises(VLLMServerError) as info:
        engine.alive()
    assert info.value.fields["status"] == 503
    with pytest.raises(VLLMServerError, match="500"):
        engine.flush_cache()


def test_an_unreachable_server_and_bad_arguments(fake):
    with pytest.raises(ValueError, match="http"):
        VLLMHTTPEngine("localhost:8000")
    server = FakeVLLMServer(fake)
    server.close()
    with pytest.raises(ValueError, match="positive"):
        VLLMHTTPEngine(server.url, timeout_s=0)
    with pytest.raises(VLLMServerError) as info:
        VLLMHTTPEngine(server.url, timeout_s=2)
    assert info.value.fields["status"] is None and not server.requests


def test_a_server_without_dev_mode_is_named(fake, monkeypatch):
    server = FakeVLLMServer(fake)
    try:
        monkeypatch.setattr(
            "tests.helpers.vllm_server.route_problem",
            lambda tree, method, target: "vLLM serves no dev routes",
        )
        with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMHTTPEngine(server.url, timeout_s=2)
    finally:
        server.close()


def test_a_timeout_is_typed(fake, monkeypatch):
    import time

    server = FakeVLLMServer(fake)
    try:
        engine = VLLMHTTPEngine(server.url, timeout_s=0.5)
        monkeypatch.setattr(fake, "generate", lambda prompts, n: time.sleep(2) or [[0]])
        with pytest.raises(VLLMServerTimeout) as info:
            engine.generate(PROMPTS)
        assert info.value.fields["missing"] == [server.url]
    finally:
        server.close()


def test_make_engine_with_a_url_builds_the_http_adapter(server):
    engine = make_engine(url=server.url, timeout_s=5)
    assert isinstance(engine, VLLMHTTPEngine) and engine.describe()["adapter"] == "VLLMHTTPEngine"


def test_a_server_asleep_before_the_adapter_came_is_woken_before_it_serves(server, fake):
    fake.sleep(1, "abort")
    assert engine_at(server).weights_state() == "discarded"  # a level-2 adapter assumes the worst
    engine = engine_at(server, sleep_level=1)
    assert engine.residency == {"weights": False, "kv_cache": False}
    seen = len(server.requests)
    with pytest.raises(MemoryStateError):
        engine.generate(PROMPTS)
    assert len(server.requests) == seen
    engine.resume_memory_occupation(None)
    assert len(engine.generate(PROMPTS, max_new_tokens=2)) == 2


def test_a_continue_after_an_explicit_pause_asks_the_server_to_resume(server, fake):
    """Only the continue that ends a whole wake is skipped; a pause of the caller's own is resumed
    through /resume, and a partial wake leaves the next continue to ask."""
    engine = engine_at(server)
    engine.pause_generation("abort")
    engine.continue_generation()
    assert server.requests[-1] == "POST /resume" and not fake.paused
    engine.pause_with_release()
    engine.release_memory_occupation(None)
    engine.resume_memory_occupation(["weights"])
    assert fake.paused  # vLLM keeps scheduling paused until every allocation is back
    engine.resume_memory_occupation(["kv_cache"])
    assert not fake.paused
    seen = len(server.requests)
    engine.continue_generation()
    assert len(server.requests) == seen
    engine.pause_generation("abort")
    engine.continue_generation()
    assert server.requests[-1] == "POST /resume"
    # a whole wake, then a sleep straight away (no continue between): the sleep paused vLLM again
    engine.pause_with_release()
    engine.release_memory_occupation(None)
    engine.resume_memory_occupation(None)
    engine.release_memory_occupation(None)
    engine.continue_generation()
    assert server.requests[-1] == "POST /resume"

"""The engine-agnostic server-actor lifecycle's pieces: the client protocol, the memory hook, the state."""

import dataclasses

from actor_integration.engines.sglang.actor import SGLangActorLifecycle
from actor_integration.engines.sglang.http import SGLangHTTPEngine
from actor_integration.rollout.client import ServerClient
from actor_integration.rollout.server_actor import ServerActorLifecycle, ServerMemory, ServerState
from lifecycle import Hooks, Lifecycle, LifecyclePolicy
from lifecycle.hooks import MemoryBackend, MemoryBatches


class RecordingClient:
    def __init__(self):
        self.calls = []

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))


def test_sglangs_http_client_is_a_server_client():
    client = SGLangHTTPEngine("http://127.0.0.1:9", codec=lambda named: named, multi_dtype_buckets=False)
    assert isinstance(client, ServerClient)
    assert issubclass(SGLangActorLifecycle, ServerActorLifecycle)


def test_server_memory_sends_a_stage_s_tags_in_one_request():
    """Under a rollout machine: the sleep's three tags one release, the partial wake one tag, the
    rest of the wake one resume (what `ServerMemory.together()` used to work out in advance)."""
    client = RecordingClient()
    memory = ServerMemory(client)
    assert isinstance(memory, MemoryBackend) and isinstance(memory, MemoryBatches)
    tags = ("weights", "kv_cache", "cuda_graph")
    policy = LifecyclePolicy(
        memory_tags=tags,
        sync_requires=("weights",),
        discard_on_release=tags,
        model_tag=None,
        destroy_process_groups=False,
    )
    machine = Lifecycle(policy, Hooks(memory=memory), role="rollout", rank=0)
    machine.sleep()
    machine.wake_up(["weights"])
    machine.wake_up()
    assert client.calls == [
        ("release", ["weights", "kv_cache", "cuda_graph"]),
        ("resume", ["weights"]),
        ("resume", ["kv_cache", "cuda_graph"]),
    ]


def test_the_wraps_state_is_one_typed_object():
    class Actor(ServerActorLifecycle):
        pass

    actor = Actor()
    state = actor._lc_state
    assert isinstance(state, ServerState) and actor._lc_state is state
    assert not [key for key in vars(actor) if key.startswith("_lc_") and key != "_lc_state"]
    fields = {f.name: f.type for f in dataclasses.fields(ServerState)}
    assert {"lifecycle", "served", "loading", "interrupted", "router", "admitted"} <= set(fields)

"""The rollout actor under a real local Ray cluster, fed by a WeightSender in the driver."""

import functools

import pytest

from actor_integration.actors.ray_group import LifecycleGroup
from actor_integration.errors import GroupCallError
from actor_integration.models.tiny import TinyLMConfig, weights_checksum
from actor_integration.rollout import ReferenceEngine, RolloutActor
from actor_integration.weight_sync import RankSlot, WeightSender, WeightSyncError
from actor_integration.weight_sync.disk import DiskSender
from actor_integration.weight_sync.shm import ShmSender
from lifecycle.errors import InvalidWeightsError
from tests.helpers.models import perturbed

pytestmark = pytest.mark.ray

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


def trained(seed):
    return perturbed(CONFIG, seed, scale=0.2)


def test_a_colocated_step_through_ray(ray_cluster, tmp_path):
    """sleep → wake weights → versioned sync → wake kv → generate, across process boundaries."""
    ray = ray_cluster
    rollout = ray.remote(RolloutActor).options(num_cpus=0).remote(functools.partial(ReferenceEngine, CONFIG))

    def engine_call(version, payloads):
        return ray.get(rollout.update_weights.remote(version, payloads), timeout=30)

    prompts = [[3, 4, 5], [9]]
    for version, transport in ((1, ShmSender()), (2, DiskSender(tmp_path))):
        model = trained(version)
        sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=engine_call,
            bucket_bytes=2048,
            deadline_s=30.0,
        )
        ray.get(rollout.sleep.remote())
        assert ray.get(rollout.open_handles.remote()) == 0
        ray.get(rollout.wake_up.remote(["weights"]))
        report = sender.send(version, model.named_weights())
        ray.get(rollout.wake_up.remote(["kv_cache"]))
        state = ray.get(rollout.lifecycle_state.remote())
        assert (state["state"], state["residency"]) == (
            "AWAKE",
            {"weights": "resident", "kv_cache": "resident"},
        )
        assert ray.get(rollout.weights_checksum.remote()) == weights_checksum(model.named_weights())
        assert ray.get(rollout.generate.remote(prompts, 5)) == model.generate(prompts, max_new_tokens=5)
        assert report.buckets > 1
        sender.close()

    # A replayed version crosses Ray as a clear refusal, and the engine keeps version 2.
    replay = WeightSender(
        RankSlot.single(0),
        None,
        ShmSender(),
        rank=0,
        engine_call=engine_call,
        bucket_bytes=2048,
        deadline_s=30.0,
    )
    with pytest.raises(WeightSyncError, match="refused version 2"):
        replay.send(2, trained(9).named_weights())
    assert ray.get(rollout.weight_version.remote()) == 2
    replay.close()
    ray.kill(rollout)


def test_the_group_reports_loaded_versions_and_a_replaced_rollout_cannot_serve(ray_cluster):
    """miles #1724: a replacement engine serves its checkpoint while the trainer is ahead. The group
    shows each rank's loaded version; generate with the trainer's version is refused until a sync."""
    ray = ray_cluster
    actor_cls = ray.remote(RolloutActor).options(num_cpus=0)
    rollouts = [actor_cls.remote(functools.partial(ReferenceEngine, CONFIG), rank=r) for r in (0, 1)]
    group = LifecycleGroup(rollouts, timeout_s=30.0)

    def send(rank, version):
        def engine_call(v, payloads):
            return ray.get(group.actors[rank].update_weights.remote(v, payloads), timeout=30)

        sender = WeightSender(
            RankSlot.single(0),
            None,
            ShmSender(),
            rank=0,
            engine_call=engine_call,
            bucket_bytes=4096,
            deadline_s=30.0,
        )
        sender.send(version, trained(version).named_weights())
        sender.close()

    group.sleep()
    group.wake_up(["weights"])
    for rank in group.actors:
        send(rank, 3)
    group.wake_up(["kv_cache"])
    assert group.weight_versions() == {0: 3, 1: 3}

    ray.kill(group.actors[1])
    group.replace(1, actor_cls.remote(functools.partial(ReferenceEngine, CONFIG), rank=1))
    assert group.weight_versions() == {0: 3, 1: 0}
    assert group.stale(3) == {1: 0}
    with pytest.raises(GroupCallError) as info:
        group.call("generate", [[1, 2]], 3, min_weight_version=3)
    refused = info.value.errors
    assert list(refused) == [1] and isinstance(refused[1], InvalidWeightsError)
    assert refused[1].required_version == 3 and refused[1].weight_version == 0

    # The replacement is released and woken without a sync: discarded weights, no version to report.
    ray.get(group.actors[1].sleep.remote())
    ray.get(group.actors[1].wake_up.remote())
    assert group.weight_versions()[1] is None
    ray.get(group.actors[1].sleep.remote())
    ray.get(group.actors[1].wake_up.remote(["weights"]))
    send(1, 3)
    ray.get(group.actors[1].wake_up.remote(["kv_cache"]))
    assert group.weight_versions() == {0: 3, 1: 3} and group.stale(3) == {}
    served = group.call("generate", [[1, 2]], 3, min_weight_version=3)
    assert served[0] == served[1] == trained(3).generate([[1, 2]], max_new_tokens=3)
    for actor in group.actors.values():
        ray.kill(actor)

"""Weight sync from trainer ranks to rollout engines: slot topology, versioned protocol, transports.

    from actor_integration.weight_sync import SlotTopology, WeightSender, configure_sender

    topology = SlotTopology.plan(world_size, engine_gpu_counts, engine_gpu_offsets)
    groups = topology.create_groups(torch.distributed.new_group)  # on every rank
    me = topology.for_rank(rank)
    transport = configure_sender(args.update_weight_transport, colocated=True, memory=torch_memory_saver)
    sender = WeightSender(me, groups[me.slot] if me.colocated else None, transport, rank=rank,
                          engine_call=..., bucket_bytes=512 << 20, deadline_s=120)
    lifecycle.run("sync", sender.send, version, named_tensors)

The engine side is `WeightReceiver` + `VersionGate` (see `actor_integration.rollout`).
"""

from actor_integration.weight_sync.buckets import (
    CRC32,
    SUM32,
    Bucket,
    BucketManifest,
    TensorEntry,
    iter_buckets,
    pack_into,
    unpack,
)
from actor_integration.weight_sync.protocol import (
    RankPayload,
    ReceivedRound,
    StaleVersionError,
    SyncReport,
    VersionGate,
    WeightReceiver,
    WeightSender,
    WeightSyncTimeout,
)
from actor_integration.weight_sync.topology import RankSlot, SlotTopology, local_device_index, physical_gpu_id
from actor_integration.weight_sync.transport import (
    REQUESTABLE,
    TRANSPORTS,
    ReceiverTransport,
    SenderTransport,
    configure_sender,
    probe_cuda_ipc,
    receiver_class,
    select_transport,
    sender_class,
)
from lifecycle.errors import CorruptBucketError, WeightSyncError

__all__ = [
    "CRC32",
    "REQUESTABLE",
    "SUM32",
    "TRANSPORTS",
    "Bucket",
    "BucketManifest",
    "CorruptBucketError",
    "RankPayload",
    "RankSlot",
    "ReceivedRound",
    "ReceiverTransport",
    "SenderTransport",
    "SlotTopology",
    "StaleVersionError",
    "SyncReport",
    "TensorEntry",
    "VersionGate",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeout",
    "configure_sender",
    "iter_buckets",
    "local_device_index",
    "pack_into",
    "physical_gpu_id",
    "probe_cuda_ipc",
    "receiver_class",
    "select_transport",
    "sender_class",
    "unpack",
]

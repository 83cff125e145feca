"""Weight sync from trainer ranks to rollout engines: slot topology, versioned protocol, transports.

    from actor_integration.weight_sync import SlotTopology, WeightSender, configure_sender

    topology = SlotTopology.plan(world_size, engine_gpu_counts, engine_gpu_offsets)
    groups = topology.create_groups(torch.distributed.new_group)  # on every rank
    me = topology.for_rank(rank)
    transport = configure_sender(args.update_weight_transport, colocated=True, memory=torch_memory_saver)
    sender = WeightSender(me, groups[me.slot] if me.colocated else None, transport, rank=rank,
                          engine_call=..., bucket_bytes=512 << 20, deadline_s=120)
    lifecycle.run("sync", sender.send, version, named_tensors)

One file per side: `wire.py` (the payload one slot rank hands the engine per round, and the errors),
`sender.py` (`WeightSender`, the slot coordinator, `StagingArena`), `receiver.py` (`WeightReceiver`,
`WeightTargets`, `VersionGate`: what the rollout imports); the mechanisms are `buckets.py`
(layouts, manifests, checksums), `kernels.py` (the batched device copies with checksums in the
same pass, `_triton.py` their Triton kernel), `topology.py` (ranks, engines, GPU offsets),
`nodes.py` (the node and GPU of each, and the transport per pair of nodes), `transport.py` and one
file per transport.
"""

from actor_integration.weight_sync.buckets import (
    CRC32,
    SUM32,
    WSUM64,
    Bucket,
    BucketManifest,
    LayoutCache,
    PackedEntries,
    TensorEntry,
    iter_buckets,
    pack_into,
    unpack,
)
from actor_integration.weight_sync.nodes import (
    NodeTopology,
    Pair,
    Place,
    TransportRow,
    decide_transport,
    transport_table,
)
from actor_integration.weight_sync.receiver import (
    LoadedRound,
    ReceivedRound,
    VersionGate,
    WeightReceiver,
    WeightTargets,
)
from actor_integration.weight_sync.sender import StagingArena, SyncReport, WeightSender
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
from actor_integration.weight_sync.wire import (
    CorruptBucketError,
    RankPayload,
    StaleVersionError,
    WeightSyncError,
    WeightSyncTimeout,
    WrittenWeightsError,
    payload_mismatch,
)

__all__ = [
    "CRC32",
    "REQUESTABLE",
    "SUM32",
    "TRANSPORTS",
    "WSUM64",
    "Bucket",
    "BucketManifest",
    "CorruptBucketError",
    "LayoutCache",
    "LoadedRound",
    "NodeTopology",
    "PackedEntries",
    "Pair",
    "Place",
    "RankPayload",
    "RankSlot",
    "ReceivedRound",
    "ReceiverTransport",
    "SenderTransport",
    "SlotTopology",
    "StagingArena",
    "StaleVersionError",
    "SyncReport",
    "TensorEntry",
    "TransportRow",
    "VersionGate",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WeightTargets",
    "WrittenWeightsError",
    "configure_sender",
    "decide_transport",
    "iter_buckets",
    "local_device_index",
    "pack_into",
    "payload_mismatch",
    "physical_gpu_id",
    "probe_cuda_ipc",
    "receiver_class",
    "select_transport",
    "sender_class",
    "transport_table",
    "unpack",
]

"""Node-aware topology: slots against given node maps (vime #57's layouts among them), the transport
per (sender node, receiver node), and the refusals that come before anything is exported."""

from __future__ import annotations

import pytest

from actor_integration.errors import CrossNodeTransportError, PlacementError
from actor_integration.weight_sync import (
    NodeTopology,
    Place,
    SlotTopology,
    configure_sender,
    decide_transport,
    select_transport,
)

N0, N1 = "node-0", "node-1"
IPC_OK = {N0: lambda: (True, "probe passed"), N1: lambda: (True, "probe passed")}


def gpus(node: str, ids: range | list[int]) -> list[Place]:
    return [Place(node, g) for g in ids]


def table(topology: NodeTopology, requested: str = "auto", probe=None) -> dict:
    rows = topology.transport_table(requested, probe=probe)
    return {(r.sender_node, r.receiver_node, r.transport): (r.ranks, r.engines) for r in rows}


class TestVime57Layouts:
    """8 trainer ranks with TP=4 (two TP groups, so two ranks with tp_rank 0)."""

    def test_one_eight_gpu_engine_on_one_node_has_one_coordinator_and_eight_pairs(self):
        """The handles are gathered over the engine's whole slot (8 pairs, one coordinator), not
        over the TP subgroup (vime #57: 'IPC handle not found for GPU UUID')."""
        slots = SlotTopology.plan(8, [8])
        topology = NodeTopology.plan(slots, gpus(N0, range(8)), [gpus(N0, range(8))])
        assert slots.coordinators == (0,)
        pairs = topology.pairs()
        assert [(p.rank, p.engine, p.engine_rank) for p in pairs] == [(r, 0, r) for r in range(8)]
        assert all(p.same_node and p.sender == p.receiver for p in pairs)
        assert topology.followers(0) == ()
        assert table(topology, probe=IPC_OK) == {(N0, N0, "cuda_ipc"): (tuple(range(8)), (0,))}

    def test_one_eight_gpu_engine_over_two_four_gpu_nodes_is_multi_node_with_followers(self):
        """The slot spans two nodes only because the engine does (SGLang nnodes=2): one coordinator
        on the engine's head node, a follower node, and every pair still within one node."""
        slots = SlotTopology.plan(8, [8])
        ranks = gpus(N0, range(4)) + gpus(N1, range(4))
        topology = NodeTopology.plan(slots, ranks, [gpus(N0, range(4)) + gpus(N1, range(4))])
        assert topology.engine_nodes(0) == (N0, N1) and topology.followers(0) == (N1,)
        assert slots.coordinators == (0,) and topology.ranks[0].node == topology.engine_nodes(0)[0]
        assert all(p.same_node for p in topology.pairs())
        assert table(topology, probe=IPC_OK) == {
            (N0, N0, "cuda_ipc"): ((0, 1, 2, 3), (0,)),
            (N1, N1, "cuda_ipc"): ((4, 5, 6, 7), (0,)),
        }

    def test_two_four_gpu_engines_on_one_node(self):
        slots = SlotTopology.plan(8, [4, 4])
        topology = NodeTopology.plan(slots, gpus(N0, range(8)), [gpus(N0, range(4)), gpus(N0, range(4, 8))])
        assert slots.coordinators == (0, 4)
        assert [p.engine_rank for p in topology.pairs() if p.engine == 1] == [0, 1, 2, 3]
        assert table(topology, probe=IPC_OK) == {(N0, N0, "cuda_ipc"): (tuple(range(8)), (0, 1))}

    def test_two_four_gpu_engines_on_two_nodes_keep_each_slot_on_its_node(self):
        slots = SlotTopology.plan(8, [4, 4])
        ranks = gpus(N0, range(4)) + gpus(N1, range(4))
        topology = NodeTopology.plan(slots, ranks, [gpus(N0, range(4)), gpus(N1, range(4))])
        assert table(topology) == {
            (N0, N0, "shm"): ((0, 1, 2, 3), (0,)),
            (N1, N1, "shm"): ((4, 5, 6, 7), (1,)),
        }

    def test_an_engine_given_gpu_ids_computed_from_ranks_is_refused(self):
        """slime's get_base_gpu_id: engine 1's base GPU computed as 4 from its first rank, on a node
        whose GPUs are 0..3. Named with the engine rank, the trainer rank and both places."""
        slots = SlotTopology.plan(8, [4, 4])
        ranks = gpus(N0, range(4)) + gpus(N1, range(4))
        with pytest.raises(
            PlacementError, match=r"engine 1 rank 0 is at node-1 GPU 4 but trainer rank 4"
        ) as info:
            NodeTopology.plan(slots, ranks, [gpus(N0, range(4)), gpus(N1, range(4, 8))])
        assert info.value.slot == 1 and info.value.ranks == [4, 5, 6, 7]
        assert "not GPU ids computed from ranks" in str(info.value)


class TestPlacementRefusals:
    def test_a_slot_split_over_two_nodes_for_a_one_node_engine_is_refused(self):
        """Ray's PACK put rank 3 on another node than the rest of its 2-GPU slot."""
        slots = SlotTopology.plan(4, [2, 2])
        ranks = [*gpus(N0, range(3)), Place(N1, 0)]
        with pytest.raises(
            PlacementError, match=r"slot 1 \(trainer ranks \[2, 3\], engine 1\) spans nodes"
        ) as info:
            NodeTopology.plan(slots, ranks, [gpus(N0, range(2)), gpus(N0, range(2, 4))])
        assert info.value.nodes == {N0: [2], N1: [3]}
        assert "STRICT_PACK" in str(info.value)

    def test_cpu_engines_are_placed_by_node_alone(self):
        slots = SlotTopology.plan(4, [2, 2])
        ranks = [Place(N0), Place(N0), Place(N1), Place(N1)]
        topology = NodeTopology.plan(slots, ranks, [[Place(N0)] * 2, [Place(N1)] * 2])
        assert topology.pair_of(3) is not None and topology.pair_of(3).receiver == Place(N1)
        with pytest.raises(PlacementError, match="spans nodes"):
            NodeTopology.plan(slots, [*[Place(N0)] * 3, Place(N1)], [[Place(N0)] * 2] * 2)

    @pytest.mark.parametrize(
        ("ranks", "engines", "message"),
        [
            ([Place(N0)] * 3, [[Place(N0)] * 4], "3 rank places for world size 4"),
            ([Place(N0)] * 4, [[Place(N0)] * 3], r"engines have \[3\] places but \[4\] GPUs"),
        ],
    )
    def test_missing_places_are_refused(self, ranks, engines, message):
        with pytest.raises(ValueError, match=message):
            NodeTopology.plan(SlotTopology.plan(4, [4]), ranks, engines)


class TestTransportPerPair:
    def test_a_remote_engine_on_another_node_gets_nccl_and_one_on_the_same_node_too(self):
        """Engines beyond the trainer's GPUs are fed by one source rank; across nodes auto is nccl."""
        slots = SlotTopology.plan(2, [2, 1, 1])
        topology = NodeTopology.plan(
            slots, gpus(N0, range(2)), [gpus(N0, range(2)), [Place(N0, 2)], [Place(N1, 0)]]
        )
        rows = {(r.sender_node, r.receiver_node, r.transport): r for r in topology.transport_table("auto")}
        assert set(rows) == {(N0, N0, "shm"), (N0, N0, "nccl"), (N0, N1, "nccl")}
        assert rows[(N0, N1, "nccl")].engines == (2,) and "another node" in rows[(N0, N1, "nccl")].reason
        assert rows[(N0, N0, "nccl")].engines == (1,) and "not colocated" in rows[(N0, N0, "nccl")].reason
        assert "node-0 -> node-1: nccl (trainer ranks [0] -> engines [2]" in str(rows[(N0, N1, "nccl")])

    @pytest.mark.parametrize("requested", ["cuda_ipc", "shm"])
    def test_a_host_only_transport_between_nodes_is_refused_by_name(self, requested):
        slots = SlotTopology.plan(1, [1, 1])
        topology = NodeTopology.plan(slots, [Place(N0, 0)], [[Place(N0, 0)], [Place(N1, 0)]])
        with pytest.raises(
            CrossNodeTransportError, match=rf"{requested}' refused between nodes node-0 and node-1"
        ) as info:
            topology.transport_table(requested)
        assert (info.value.sender_node, info.value.receiver_node) == (N0, N1)
        assert "'nccl'" in str(info.value) and "'disk'" in str(info.value)

    def test_disk_between_nodes_says_the_filesystem_must_be_shared(self):
        assert decide_transport("disk", colocated=False, same_node=False) == (
            "disk",
            "requested explicitly; the directory must be on a filesystem both nodes mount",
        )

    def test_cuda_ipc_across_nodes_is_refused_before_cuda_is_touched(self, tmp_path):
        """configure_sender refuses on the pair's nodes, whether or not CUDA exists here: never attempted."""
        with pytest.raises(CrossNodeTransportError, match="refused between nodes a and b"):
            configure_sender("cuda_ipc", colocated=False, same_node=False, between=("a", "b"))
        with pytest.raises(CrossNodeTransportError):
            select_transport("shm", colocated=False, same_node=False)
        assert select_transport("auto", colocated=False, same_node=False) == "nccl"

    def test_a_colocated_pair_on_two_nodes_is_a_placement_error(self):
        with pytest.raises(PlacementError, match="must be on its trainer rank's node"):
            decide_transport("auto", colocated=True, same_node=False)

    def test_the_probe_decides_within_a_node_per_sender_node(self):
        slots = SlotTopology.plan(2, [1, 1])
        topology = NodeTopology.plan(slots, [Place(N0, 0), Place(N1, 0)], [[Place(N0, 0)], [Place(N1, 0)]])
        probes = {N0: lambda: (True, "ok"), N1: lambda: (False, "export failed under preload")}
        rows = {
            (r.sender_node, r.transport): r.reason for r in topology.transport_table("auto", probe=probes)
        }
        assert rows == {
            (N0, "cuda_ipc"): "ok",
            (N1, "shm"): "export failed under preload; falling back to shared host memory",
        }

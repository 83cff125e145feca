"""Slot topology: one coordinator per slot, ranks outside slots, group order, GPU ids."""

import pytest

from actor_integration.weight_sync import SlotTopology, local_device_index, physical_gpu_id


class TestPlan:
    def test_one_eight_gpu_engine_fed_by_tp4_has_one_coordinator(self):
        """vime #57: with TP=4, ranks 0 and 4 both have tp_rank 0, but the slot has one coordinator."""
        topology = SlotTopology.plan(8, [8])
        slots = [topology.for_rank(r) for r in range(8)]
        assert [s.is_coordinator for s in slots] == [True] + [False] * 7
        assert {s.coordinator for s in slots} == {0}
        assert all(s.ranks == tuple(range(8)) for s in slots)
        tp_rank_zero = [r for r in range(8) if r % 4 == 0]
        assert len(tp_rank_zero) == 2  # the old rule would have picked two coordinators

    def test_two_four_gpu_engines_have_two_coordinators(self):
        topology = SlotTopology.plan(8, [4, 4])
        assert topology.coordinators == (0, 4)
        assert topology.for_rank(5).slot == 1
        assert topology.for_rank(5).ranks == (4, 5, 6, 7)
        assert topology.for_rank(5).coordinator == 4
        assert topology.for_rank(5).index_in_slot == 1
        assert topology.for_rank(4).is_coordinator

    def test_ranks_outside_every_slot_are_non_colocated(self):
        topology = SlotTopology.plan(8, [2, 2], [0, 4])
        assert topology.non_colocated_ranks == (2, 3, 6, 7)
        outside = topology.for_rank(3)
        assert (outside.slot, outside.ranks, outside.coordinator, outside.is_coordinator) == (
            None,
            (),
            None,
            False,
        )
        assert not outside.colocated

    def test_sparse_offsets_with_placeholder_gaps(self):
        topology = SlotTopology.plan(10, [2, 2, 2, 2], [0, 2, 6, 8])
        assert topology.slots == ((0, 1), (2, 3), (6, 7), (8, 9))
        assert topology.non_colocated_ranks == (4, 5)

    def test_engines_beyond_the_trainer_are_remote(self):
        topology = SlotTopology.plan(4, [4, 4])
        assert topology.slots == ((0, 1, 2, 3),)
        assert topology.remote_engines == (1,)

    def test_coordinator_is_the_lowest_global_rank_of_the_slot(self):
        topology = SlotTopology.plan(8, [3, 2], [5, 1])
        assert topology.for_rank(6).coordinator == 5
        assert topology.for_rank(2).coordinator == 1
        assert topology.slot_engines == (0, 1)

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            ((8, [4, 4], [0, 2]), "overlap"),
            ((4, [4], [2]), "entirely"),
            ((0, [1]), "world_size"),
            ((4, [0]), "engine_gpu_counts"),
            ((4, [2, 2], [0]), "one offset per engine"),
            ((4, [2], [-1]), "non-negative"),
        ],
    )
    def test_bad_layouts_are_refused_with_the_reason(self, args, message):
        with pytest.raises(ValueError, match=message):
            SlotTopology.plan(*args)

    def test_for_rank_refuses_ranks_outside_the_world(self):
        with pytest.raises(ValueError, match=r"0\.\.3"):
            SlotTopology.plan(4, [4]).for_rank(4)


class TestCreateGroups:
    def test_every_slot_group_is_created_in_slot_order_with_gloo(self):
        calls = []

        def new_group(*, ranks, backend):
            calls.append((tuple(ranks), backend))
            return f"group{len(calls) - 1}"

        topology = SlotTopology.plan(8, [2, 2, 4])
        groups = topology.create_groups(new_group)
        assert calls == [((0, 1), "gloo"), ((2, 3), "gloo"), ((4, 5, 6, 7), "gloo")]
        assert groups[topology.for_rank(5).slot] == "group2"

    def test_the_call_sequence_does_not_depend_on_the_rank(self):
        """A group created inside a rank branch deadlocks: every rank must make the same calls."""
        topology = SlotTopology.plan(8, [4, 2], [0, 6])
        sequences = []
        for _rank in range(8):
            calls: list = []
            topology.create_groups(
                lambda *, ranks, backend, calls=calls: calls.append((tuple(ranks), backend))
            )
            sequences.append(calls)
        assert all(seq == sequences[0] for seq in sequences)
        assert len(sequences[0]) == 2


class TestGpuIds:
    @pytest.mark.parametrize(
        ("visible", "device", "physical"),
        [
            (None, 0, 0),
            (None, 3, 3),
            ("2,3", 0, 2),
            ("2,3", 1, 3),
            (" 4, 6 ,7", 2, 7),
            ("GPU-8d2f6a3c-aaaa-bbbb-cccc-000000000000,GPU-1111", 1, 1),
            ("MIG-GPU-abc/1/0", 0, 0),
        ],
    )
    def test_physical_gpu_id(self, visible, device, physical):
        assert physical_gpu_id(visible, device) == physical

    def test_a_device_beyond_the_visible_list_is_refused(self):
        with pytest.raises(ValueError, match="not visible"):
            physical_gpu_id("2,3", 2)

    def test_an_empty_list_hides_every_gpu(self):
        with pytest.raises(ValueError, match="hides every GPU"):
            physical_gpu_id("", 0)

    def test_local_index_inverts_the_mapping(self):
        for device in range(3):
            assert local_device_index(physical_gpu_id("5,1,3", device), "3,5,1") == [1, 2, 0][device]

    def test_a_gpu_the_engine_cannot_see_is_refused(self):
        with pytest.raises(ValueError, match="not visible in this process"):
            local_device_index(4, "0,1")

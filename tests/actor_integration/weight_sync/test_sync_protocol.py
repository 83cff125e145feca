"""The versioned protocol inside one process: a one-rank slot feeding a real RolloutActor.

The engine call goes straight to the actor here; test_sync_processes.py runs the same flow
across processes with real gloo slot groups.
"""

import threading
import time

import pytest
import torch

from actor_integration.models.tiny import TinyLMConfig, weights_checksum
from actor_integration.rollout import ReferenceEngine, RolloutActor
from actor_integration.weight_sync import (
    CorruptBucketError,
    RankPayload,
    RankSlot,
    SlotTopology,
    StaleVersionError,
    VersionGate,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeout,
    WrittenWeightsError,
    kernels,
)
from actor_integration.weight_sync.disk import DiskSender
from actor_integration.weight_sync.shm import ShmSender
from lifecycle import Contents, InvalidWeightsError, capture_events
from tests.helpers.models import perturbed
from tests.helpers.weight_sync_doubles import DeviceChecksumShm

CONFIG = TinyLMConfig(vocab_size=61, dim=16, n_layers=2, n_heads=2, max_seq_len=32, seed=3)


def trained(seed):
    return perturbed(CONFIG, seed, scale=0.1)


@pytest.fixture
def actor():
    return RolloutActor(ReferenceEngine(CONFIG))


def sender_for(actor, transport, **kwargs):
    options = {"bucket_bytes": 2048, "deadline_s": 5.0, "engine_call": actor.update_weights}
    options.update(kwargs)
    return WeightSender(RankSlot.single(0), None, transport, rank=0, **options)


class TestVersionedUpdates:
    @pytest.mark.parametrize("transport", ["shm", "disk"])
    def test_each_version_arrives_bit_exact(self, actor, transport, tmp_path):
        sender = sender_for(actor, ShmSender() if transport == "shm" else DiskSender(tmp_path))
        try:
            for version in (1, 2, 3):
                model = trained(version)
                report = sender.send(version, model.named_weights())
                assert actor.weights_checksum() == weights_checksum(model.named_weights())
                assert actor.weight_version() == version
                assert report.buckets > 1
                # shm reuses one host buffer, so one bucket per round; disk writes them all, one round.
                assert report.rounds == (report.buckets if transport == "shm" else 1)
        finally:
            sender.close()

    def test_generation_uses_the_new_weights(self, actor):
        sender = sender_for(actor, ShmSender())
        model = trained(11)
        prompts = [[1, 2, 3], [4, 5]]
        before = actor.generate(prompts, 6)
        sender.send(1, model.named_weights())
        after = actor.generate(prompts, 6)
        assert after == model.generate(prompts, max_new_tokens=6)
        assert after != before
        sender.close()

    def test_a_round_carries_as_many_buckets_as_configured(self, actor):
        sender = sender_for(actor, ShmSender(), round_buckets=3)
        report = sender.send(1, trained(1).named_weights())
        assert report.rounds == -(-report.buckets // 3)
        assert actor.weights_checksum() == weights_checksum(trained(1).named_weights())
        sender.close()

    def test_events_carry_the_fields_the_log_checker_reads(self, actor):
        sender = sender_for(actor, ShmSender())
        with capture_events() as events:
            sender.send(4, trained(4).named_weights())
        (update,) = [e for e in events if e["event"] == "weight_sync.update"]
        for field in (
            "slot",
            "version",
            "transport",
            "coordinator",
            "ranks",
            "bytes",
            "buckets",
            "duration_ms",
        ):
            assert field in update
        assert update["version"] == 4 and update["ok"] is True and update["coordinator"] is True
        assert update["ranks"] == [0] and update["bytes"] > 0 and update["gbps"] >= 0
        (loaded,) = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert loaded["version"] == 4 and loaded["checksum_ok"] is True and loaded["transport"] == "shm"
        assert loaded["bytes"] == update["bytes"] and loaded["role"] == "rollout"
        sender.close()

    def test_the_report_tells_waiting_in_the_pack_from_working_in_it(self, actor):
        """`pack_cpu_ms` is the sending thread's CPU time in the pack: a transport whose export
        blocks (here a 60 ms sleep per bucket, as a driver lock or another thread holding the GIL
        would make it wait) shows a pack far longer than its CPU time."""

        class BlockingExport(ShmSender):
            def export(self, position, bucket):
                time.sleep(0.06)
                return super().export(position, bucket)

        sender = sender_for(actor, BlockingExport(), bucket_bytes=1 << 20)
        try:
            phases = sender.send(1, trained(1).named_weights()).phases_ms
        finally:
            sender.close()
        assert phases["pack_ms"] >= 60
        assert phases["pack_cpu_ms"] < phases["pack_ms"] - 40, phases


class TestRefusals:
    def test_the_receiver_refuses_a_repeated_or_older_version(self, actor):
        sender = sender_for(actor, ShmSender())
        sender.send(2, trained(2).named_weights())
        loaded = actor.weights_checksum()
        replay = sender_for(actor, ShmSender())  # a restarted trainer whose counter went back
        for version in (2, 1):
            with pytest.raises(WeightSyncError, match=f"refused version {version}") as info:
                replay.send(version, trained(9).named_weights())
            assert isinstance(info.value.__cause__, StaleVersionError)
            assert "strictly increase" in str(info.value)
        assert actor.weights_checksum() == loaded and actor.weight_version() == 2
        sender.close()
        replay.close()

    def test_the_sender_refuses_a_version_that_does_not_increase(self, actor):
        sender = sender_for(actor, ShmSender())
        sender.send(3, trained(3).named_weights())
        with pytest.raises(ValueError, match="not newer than 3"):
            sender.send(3, trained(3).named_weights())
        sender.close()

    def test_a_corrupted_bucket_leaves_the_previous_weights_loaded(self, actor):
        good = trained(1)
        sender = sender_for(actor, ShmSender(), round_buckets=2)
        sender.send(1, good.named_weights())

        def tamper(version, payloads):
            if payloads[0].round == 1:  # round 0 was staged already: the damage comes later
                with open(payloads[0].descriptors[0].path, "r+b") as f:
                    f.write(b"\xff\xfe")
            return actor.update_weights(version, payloads)

        sender.engine_call = tamper
        with capture_events() as events, pytest.raises(WeightSyncError, match="checksum") as info:
            sender.send(2, trained(2).named_weights())
        assert isinstance(info.value.__cause__, CorruptBucketError)
        assert actor.weights_checksum() == weights_checksum(good.named_weights())
        assert actor.weight_version() == 1
        assert actor.generate([[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4)
        # The sender packed and sent the corrupt round once more (corrupt_resends=1): refused again.
        loaded = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert [(e["checksum_ok"], e["version"], e["written"]) for e in loaded] == [(False, 2, False)] * 2
        assert isinstance(info.value, CorruptBucketError) and info.value.resends == 1
        sender.engine_call = actor.update_weights
        sender.send(3, trained(3).named_weights())
        assert actor.weights_checksum() == weights_checksum(trained(3).named_weights())
        sender.close()

    def test_a_round_out_of_order_is_refused(self, actor):
        sender = ShmSender()
        try:
            sender.begin_round(5, 1)
            payload = RankPayload(5, 1, True, 0, 0, "shm", sender.sender_id, None, (), ())
            with pytest.raises(
                WeightSyncError, match="round 1 of version 5 arrived, but a round 0 was expected"
            ):
                actor.update_weights(5, [payload])
        finally:
            sender.close()

    def test_the_gate_accepts_a_new_version_after_an_interrupted_one(self):
        gate = VersionGate(committed=1)
        gate.admit(2, 0)
        gate.admit(3, 0)  # version 2 never finished: its staging is dropped
        gate.admit(3, 1)
        gate.commit(3)
        with pytest.raises(StaleVersionError):
            gate.admit(2, 0)


class TestDeadlines:
    def test_a_silent_engine_times_out_with_a_diagnosis(self, actor):
        release = threading.Event()

        def hung(version, payloads):
            release.wait(10)

        sender = sender_for(actor, ShmSender(), engine_call=hung, engine_deadline_s=0.3)
        start = time.monotonic()
        with capture_events() as events, pytest.raises(WeightSyncTimeout) as info:
            sender.send(1, trained(1).named_weights())
        release.set()
        assert time.monotonic() - start < 3
        error = info.value
        assert error.slot == 0 and error.version == 1 and error.missing == ["engine"]
        assert "engine's acknowledgement" in error.awaited and error.waited_s >= 0.3
        assert "still be generating" in str(error) and "slot 0" in str(error) and "version 1" in str(error)
        (update,) = [e for e in events if e["event"] == "weight_sync.update"]
        assert update["ok"] is False and "WeightSyncTimeout" in update["error"]
        with pytest.raises(WeightSyncError, match="unusable"):
            sender.send(2, trained(2).named_weights())
        sender.close()

    def test_an_engine_error_names_the_version(self, actor):
        def broken(version, payloads):
            raise RuntimeError("engine on fire")

        sender = sender_for(actor, ShmSender(), engine_call=broken)
        with pytest.raises(WeightSyncError, match=r"refused version 1 .*engine on fire"):
            sender.send(1, trained(1).named_weights())
        sender.close()


class TestSlots:
    def test_a_rank_outside_every_slot_sends_nothing_but_logs(self):
        topology = SlotTopology.plan(4, [2])
        calls = []
        sender = WeightSender(
            topology.for_rank(3),
            None,
            ShmSender(),
            rank=3,
            engine_call=lambda v, p: calls.append(v),
            bucket_bytes=1024,
            deadline_s=1.0,
        )
        with capture_events() as events:
            report = sender.send(1, trained(1).named_weights())
        assert calls == [] and report.slot is None and report.nbytes == 0
        (update,) = [e for e in events if e["event"] == "weight_sync.update"]
        assert update["slot"] is None and update["ok"] is True
        sender.close()

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"rank": 1}, "topology slot is for rank 0"),
            ({"engine_call": None}, "must be given"),
            ({"deadline_s": 0}, "deadline_s"),
            ({"bucket_bytes": 0}, "bucket_bytes"),
            ({"round_buckets": 0}, "round_buckets"),
        ],
    )
    def test_bad_configuration_is_refused(self, kwargs, message):
        options = {"rank": 0, "engine_call": lambda v, p: None, "bucket_bytes": 1024, "deadline_s": 1.0}
        options.update(kwargs)
        with pytest.raises(ValueError, match=message):
            WeightSender(RankSlot.single(0), None, ShmSender(), **options)

    def test_a_multi_rank_slot_needs_its_group(self):
        slot = SlotTopology.plan(2, [2]).for_rank(0)
        with pytest.raises(ValueError, match="create_groups"):
            WeightSender(slot, None, ShmSender(), rank=0, engine_call=print, bucket_bytes=1, deadline_s=1.0)

    def test_an_empty_update_is_refused(self, actor):
        sender = sender_for(actor, ShmSender())
        with pytest.raises(ValueError, match="no tensors"):
            sender.send(1, {})
        sender.close()


class TestLoadingInPlace:
    """The reference engine loads in place: the receiver checks the round, then writes it into the
    served parameters (one round) or the engine's staging tensors (several rounds)."""

    def one_round_sender(self, actor, **kwargs):
        return sender_for(actor, ShmSender(), round_buckets=None, **kwargs)

    def test_a_version_in_one_round_is_written_into_the_served_weights_with_one_plan(self, actor):
        sender = self.one_round_sender(actor)
        params = {n: p.data_ptr() for n, p in actor.engine.models[0].named_parameters()}
        for version in (1, 2, 3):
            model = trained(version)
            report = sender.send(version, model.named_weights())
            assert report.rounds == 1 and report.buckets > 1
            assert actor.weights_checksum() == weights_checksum(model.named_weights())
        assert actor.receiver.plans_built == 1  # the copy plan was built once and reused
        assert {n: p.data_ptr() for n, p in actor.engine.models[0].named_parameters()} == params
        assert actor.engine.calls[-1] == "load_weights(v3, round 0, final)"
        sender.close()

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (lambda named: named.pop("head.weight"), "incomplete"),
            (lambda named: named.__setitem__("extra.weight", torch.zeros(3)), "no tensor 'extra.weight'"),
            (lambda named: named.__setitem__("head.weight", torch.zeros(2, 2)), "arrived as"),
        ],
    )
    def test_a_round_that_does_not_match_the_engine_is_refused_before_any_write(self, actor, change, message):
        sender = self.one_round_sender(actor)
        good = trained(1)
        sender.send(1, good.named_weights())
        named = dict(trained(2).named_weights())
        change(named)
        with pytest.raises(WeightSyncError, match=message):
            sender.send(2, named)
        assert actor.weights_checksum() == weights_checksum(good.named_weights())
        assert actor.generate([[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4)
        sender.close()

    def test_a_corrupted_bucket_of_a_one_round_version_leaves_the_previous_weights(self, actor):
        sender = self.one_round_sender(actor)
        good = trained(1)
        sender.send(1, good.named_weights())

        def tamper(version, payloads):
            with open(payloads[0].descriptors[-1].path, "r+b") as f:
                f.write(b"\x00\x01\x02")
            return actor.update_weights(version, payloads)

        sender.engine_call = tamper
        with pytest.raises(WeightSyncError, match="checksum") as info:
            sender.send(2, trained(2).named_weights())
        assert isinstance(info.value.__cause__, CorruptBucketError)
        assert actor.weights_checksum() == weights_checksum(good.named_weights())
        assert actor.generate([[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4)
        sender.close()


class TestWrittenDigest:
    """After a round is written, the receiver reads back what the engine's tensors hold, where
    they were written, and compares it with what the senders checksummed."""

    def one_round_sender(self, actor):
        return sender_for(actor, ShmSender(), round_buckets=None)

    def test_every_version_is_confirmed_held_as_sent(self, actor):
        sender = self.one_round_sender(actor)
        with capture_events() as events:
            for version in (1, 2):
                sender.send(version, trained(version).named_weights())
        loaded = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert [e["digest_ok"] for e in loaded] == [True, True]
        assert actor.receiver.last_digest is True and "digest_ms" in actor.receiver.last_timings
        sender.close()

    def test_a_copy_that_wrote_other_bytes_is_a_typed_error_and_generation_is_refused(
        self, actor, monkeypatch
    ):
        """The copy writes the round, then one byte of a target changes (a faulty copy, a loader
        writing beside it): the buckets verified, but the engine does not hold what was sent."""
        sender = self.one_round_sender(actor)
        good = trained(1)
        sender.send(1, good.named_weights())
        original = kernels.scatter_slow

        def faulty(plan, regions):
            original(plan, regions)
            plan.slow[0][3].view(-1)[0] += 1.0

        monkeypatch.setattr(kernels, "scatter_slow", faulty)
        with (
            capture_events() as events,
            pytest.raises(WeightSyncError, match="differs from what was sent") as info,
        ):
            sender.send(2, trained(2).named_weights())
        assert isinstance(info.value.__cause__, WrittenWeightsError)
        assert info.value.__cause__.fields["written"] is True and info.value.__cause__.fields["version"] == 2
        (failed,) = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert failed["digest_ok"] is False and failed["ok"] is False
        with pytest.raises(InvalidWeightsError):
            actor.generate([[1, 2]], 4)
        monkeypatch.setattr(kernels, "scatter_slow", original)
        fixed = trained(3)
        sender.send(3, fixed.named_weights())
        assert actor.generate([[1, 2]], 4) == fixed.generate([[1, 2]], max_new_tokens=4)
        sender.close()

    def test_no_claim_where_the_receiver_does_not_verify(self):
        actor = RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(verify=False, digest=True))
        sender = sender_for(actor, ShmSender(), round_buckets=None, checksums=False)
        with capture_events() as events:
            sender.send(1, trained(1).named_weights())
        (loaded,) = [e for e in events if e["event"] == "weight_sync.loaded"]
        assert loaded["digest_ok"] is None and actor.receiver.last_digest is None
        sender.close()


class TestChecksumsOff:
    def test_a_verifying_receiver_refuses_buckets_without_checksums(self, actor):
        sender = sender_for(actor, ShmSender(), checksums=False)
        with pytest.raises(WeightSyncError, match="carries no checksum"):
            sender.send(1, trained(1).named_weights())
        assert actor.weight_version() == 0
        sender.close()

    def test_a_receiver_that_does_not_verify_loads_them(self):
        actor = RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(verify=False))
        sender = sender_for(actor, ShmSender(), checksums=False)
        model = trained(1)
        sender.send(1, model.named_weights())
        assert actor.weights_checksum() == weights_checksum(model.named_weights())
        sender.close()


class DoubleBufferedShm(ShmSender):
    """shm with one file per (round parity, position), so a round can be packed while the previous
    one loads: the pipelining of WeightSender on a host transport."""

    double_buffered = True
    exported: list

    def export(self, position, bucket):
        self.exported.append(self.round_index)
        return super().export(2 * position + self.round_index % 2, bucket)


class TestPipelinedRounds:
    def test_round_r_plus_1_is_packed_while_the_engine_loads_round_r(self, actor):
        transport = DoubleBufferedShm()
        transport.exported = []
        overlapped = []

        def engine(version, payloads):
            round_index = payloads[0].round
            if not payloads[0].final:  # wait (inside this call) for the next round's export
                deadline = time.monotonic() + 2
                while round_index + 1 not in transport.exported and time.monotonic() < deadline:
                    time.sleep(0.001)
                overlapped.append(round_index + 1 in transport.exported)
            return actor.update_weights(version, payloads)

        sender = sender_for(actor, transport, engine_call=engine, pipelined=True)
        model = trained(4)
        report = sender.send(1, model.named_weights())
        assert report.rounds == report.buckets > 2
        assert overlapped == [True] * (report.rounds - 1)
        assert actor.weights_checksum() == weights_checksum(model.named_weights())
        sender.close()

    def test_without_pipelining_the_next_round_waits_for_the_acknowledgement(self, actor):
        transport = DoubleBufferedShm()
        transport.exported = []
        seen = []

        def engine(version, payloads):
            seen.append(payloads[0].round + 1 in transport.exported)
            return actor.update_weights(version, payloads)

        sender_for(actor, transport, engine_call=engine).send(1, trained(4).named_weights())
        assert seen and not any(seen)
        transport.close()

    def test_pipelining_needs_a_double_buffered_transport(self, actor):
        with pytest.raises(ValueError, match="double-buffered"):
            sender_for(actor, ShmSender(), pipelined=True)


def damage(payload, position=-1, data=b"\x00\x01\x02"):
    """Write over the start of one bucket of a payload after it was packed and checksummed."""
    with open(payload.descriptors[position].path, "r+b") as f:
        f.write(data)


class TestTwoPassVerification:
    """`WeightReceiver(keep_previous=False)`: the round is written while checksummed and compared
    after; a corrupt round leaves the weights invalid (generation refused) and the sender sends
    the round again once. The version history never records the corrupt round."""

    @pytest.fixture
    def actor(self):
        return RolloutActor(ReferenceEngine(CONFIG), receiver=WeightReceiver(keep_previous=False))

    def one_round_sender(self, actor, **kwargs):
        return sender_for(actor, DeviceChecksumShm(), round_buckets=None, **kwargs)

    def test_a_clean_round_is_written_once_with_the_checksums_of_the_copy(self, actor, monkeypatch):
        checked = []
        scatter_checked = kernels.scatter_checked
        monkeypatch.setattr(kernels, "scatter_checked", lambda *a: checked.append(1) or scatter_checked(*a))
        monkeypatch.setattr(
            WeightReceiver,
            "_launch_verify",
            lambda *a: pytest.fail("the round was verified before the write"),
        )
        sender = self.one_round_sender(actor)
        model = trained(1)
        sender.send(1, model.named_weights())
        assert checked == [1] and actor.weights_checksum() == weights_checksum(model.named_weights())
        assert actor.weight_version() == 1 and actor.lifecycle.contents["weights"] is Contents.VALID
        sender.close()

    def test_a_corrupted_bucket_leaves_the_weights_invalid_until_the_resent_round_loads(self, actor):
        good, new = trained(1), trained(2)
        sender = self.one_round_sender(actor)
        sender.send(1, good.named_weights())
        seen = []

        def engine(version, payloads):
            if not seen:
                damage(payloads[0])
            else:  # the re-send: the corrupt round was written, and nothing serves it
                seen.append(
                    {
                        "contents": actor.lifecycle.contents["weights"],
                        "version": (actor.weight_version(), actor.lifecycle.weight_version),
                        "engine_version": actor.engine.weight_version,
                        "overwritten": actor.engine.weights_checksum()
                        != weights_checksum(good.named_weights()),
                    }
                )
                with pytest.raises(InvalidWeightsError, match="unknown"):
                    actor.generate([[1, 2]], 4)
            seen.append(payloads[0].round)
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        with capture_events() as events:
            report = sender.send(2, new.named_weights())
        assert seen[0] == 0 and seen[2] == 0 and report.resends == 1
        assert seen[1] == {
            "contents": Contents.UNKNOWN,
            "version": (1, 1),
            "engine_version": 1,
            "overwritten": True,
        }
        assert actor.weights_checksum() == weights_checksum(new.named_weights())
        assert actor.weight_version() == 2 and actor.lifecycle.weight_version == 2
        assert actor.generate([[1, 2]], 4) == new.generate([[1, 2]], max_new_tokens=4)
        loaded = [
            (e["version"], e["ok"], e.get("written")) for e in events if e["event"] == "weight_sync.loaded"
        ]
        assert loaded == [(2, False, True), (2, True, None)]
        reasons = [e["reason"] for e in events if e["event"] == "lifecycle.contents"]
        assert any("failed its checksum after it was written" in r for r in reasons)
        (update,) = [e for e in events if e["event"] == "weight_sync.update"]
        assert update["resends"] == 1 and update["ok"] is True
        sender.close()

    def test_a_round_corrupt_every_time_fails_with_the_typed_error_and_stays_invalid(self, actor):
        good = trained(1)
        sender = self.one_round_sender(actor)
        sender.send(1, good.named_weights())
        calls = []

        def engine(version, payloads):
            calls.append(version)
            damage(payloads[0])
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        with pytest.raises(CorruptBucketError, match="sent again 1 time") as info:
            sender.send(2, trained(2).named_weights())
        assert calls == [2, 2] and info.value.resends == 1 and info.value.version == 2
        assert isinstance(info.value.__cause__, CorruptBucketError)
        assert actor.lifecycle.contents["weights"] is Contents.UNKNOWN
        assert actor.weight_version() == 1 and actor.lifecycle.weight_version == 1
        with pytest.raises(InvalidWeightsError):
            actor.generate([[1, 2]], 4)
        sender.engine_call = actor.update_weights  # the next sync repairs them
        sender.send(3, trained(3).named_weights())
        assert actor.weights_checksum() == weights_checksum(trained(3).named_weights())
        assert actor.weight_version() == 3 and actor.lifecycle.contents["weights"] is Contents.VALID
        sender.close()

    def test_without_resends_the_first_corrupt_round_fails(self, actor):
        sender = self.one_round_sender(actor, corrupt_resends=0)
        sender.send(1, trained(1).named_weights())
        calls = []

        def engine(version, payloads):
            calls.append(version)
            damage(payloads[0])
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        with pytest.raises(CorruptBucketError, match="fails its wsum64 checksum") as info:
            sender.send(2, trained(2).named_weights())
        assert calls == [2] and "resends" not in info.value.fields
        sender.close()

    def test_a_corrupt_round_of_a_staged_version_keeps_the_served_weights_and_is_resent(self, actor):
        """Rounds of a version in several rounds go into the engine's staging tensors: a corrupt
        one does not touch the served weights, and its re-send continues the version."""
        good, new = trained(1), trained(2)
        sender = sender_for(actor, DeviceChecksumShm(), round_buckets=2)
        sender.send(1, good.named_weights())
        rounds = []

        def engine(version, payloads):
            if payloads[0].round == 1 and 1 not in rounds:
                damage(payloads[0], position=0)
            elif payloads[0].round == 1:  # the re-send: the served weights are the old ones, valid
                assert actor.lifecycle.contents["weights"] is Contents.VALID
                assert actor.generate([[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4)
            rounds.append(payloads[0].round)
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        report = sender.send(2, new.named_weights())
        assert report.rounds > 2 and rounds == [0, 1, *range(1, report.rounds)] and report.resends == 1
        assert actor.weights_checksum() == weights_checksum(new.named_weights())
        sender.close()

    def test_the_default_keeps_the_previous_weights_served_until_the_resent_round_loads(self):
        actor = RolloutActor(ReferenceEngine(CONFIG))
        good, new = trained(1), trained(2)
        sender = sender_for(actor, DeviceChecksumShm(), round_buckets=None)
        sender.send(1, good.named_weights())
        served = []

        def engine(version, payloads):
            if not served:
                damage(payloads[0])
            else:
                served.append(actor.generate([[1, 2]], 4) == good.generate([[1, 2]], max_new_tokens=4))
            served.append(payloads[0].round)
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        report = sender.send(2, new.named_weights())
        assert served == [0, True, 0] and report.resends == 1
        assert actor.weights_checksum() == weights_checksum(new.named_weights())
        sender.close()

    def test_rounds_the_copy_cannot_check_whole_are_verified_before_the_write(self, actor):
        """Host checksums (CRC32, what shm gives host tensors) are not computed by the copy: such a
        round is verified first, so a corrupt one leaves the previous weights, as by default."""
        good = trained(1)
        sender = sender_for(actor, ShmSender(), round_buckets=None, corrupt_resends=0)
        sender.send(1, good.named_weights())

        def engine(version, payloads):
            damage(payloads[0])
            return actor.update_weights(version, payloads)

        sender.engine_call = engine
        with pytest.raises(CorruptBucketError, match="crc32"):
            sender.send(2, trained(2).named_weights())
        assert actor.weights_checksum() == weights_checksum(good.named_weights())
        assert actor.lifecycle.contents["weights"] is Contents.VALID
        sender.close()

    def test_a_negative_resend_count_is_refused(self, actor):
        with pytest.raises(ValueError, match="corrupt_resends"):
            sender_for(actor, ShmSender(), corrupt_resends=-1)

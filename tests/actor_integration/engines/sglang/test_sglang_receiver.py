"""The scheduler-side receiver (`sglang_receiver.receive`), as SGLang's schedulers run it: its
refusal of foreign calls, and the TP ranks' agreement over a real gloo group (one rank's corrupt
bucket keeps every rank from loading). The payload codec is `weight_sync.wire`'s (test_wire.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from actor_integration.engines.sglang import receiver as sglang_receiver
from actor_integration.weight_sync import RankSlot, WeightSender
from actor_integration.weight_sync.shm import ShmSender
from tests.actor_integration.forked_ranks import ranks_from_one_import
from tests.helpers.spawn import no_crash, run_world

# run_world's ranks forked from one import of torch (tests/actor_integration/forked_ranks.py)
pytestmark = pytest.mark.usefixtures(ranks_from_one_import.__name__)


def rank_payload(rank: int, tensors: dict[str, torch.Tensor]) -> Any:
    """What a trainer rank's shm sender hands the engine for one round (the sender stays alive)."""
    captured: list[Any] = []

    def engine_call(version: int, payloads: list[Any]) -> dict[str, Any]:
        captured.extend(payloads)
        return {"version": version}

    sender = WeightSender(
        RankSlot.single(rank),
        None,
        ShmSender(),
        rank=rank,
        engine_call=engine_call,
        bucket_bytes=1 << 12,
        deadline_s=10,
    )
    sender.send(1, tensors.items())
    return sender, captured[0]


class Model(torch.nn.Module):
    """SGLang's model (an nn.Module) as its loaders see it."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


def install_tp_group(rank: int, world: int, group: Any, setitem: Any = sys.modules.__setitem__) -> None:
    """sglang's `get_tp_group()`, as the receiver imports it, for a process without sglang."""
    coordinator = types.SimpleNamespace(rank_in_group=rank, world_size=world, cpu_group=group)
    names = ("sglang", "sglang.srt", "sglang.srt.distributed", "sglang.srt.distributed.parallel_state")
    modules = {name: types.ModuleType(name) for name in names}
    modules["sglang.srt.distributed.parallel_state"].get_tp_group = lambda: coordinator  # type: ignore[attr-defined]
    modules["sglang"].__version__ = "0.5.17"  # type: ignore[attr-defined]
    for name, module in modules.items():
        setitem(name, module)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(32, 8, generator=g),
        "a.bias": torch.randn(8, generator=g).to(torch.bfloat16),
    }


class TestForeignCalls:
    def test_a_call_not_made_by_the_lifecycle_is_answered_without_raising(self, monkeypatch):
        """Foreign names reach the loader: nothing is loaded, nothing raises (SGLang would die)."""
        install_tp_group(0, 1, None, lambda name, module: monkeypatch.setitem(sys.modules, name, module))
        model = Model()
        sglang_receiver.receive(model, [("model.embed_tokens.weight", torch.zeros(1))])
        assert model.loaded == {}


class Params(torch.nn.Module):
    """SGLang's model with parameters its loaders copy into (`param.data.copy_`), as a dense
    model's loaders do: the copy plan records where each tensor went. `after`: what a loader does
    to a parameter once it copied it (None: nothing)."""

    def __init__(self, after: Any = None) -> None:
        super().__init__()
        self.a_weight = torch.nn.Parameter(torch.zeros(32, 8), requires_grad=False)
        self.a_bias = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
        self.after = after

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            param = self.a_weight if name == "a.weight" else self.a_bias
            param.data.copy_(tensor)
            if self.after is not None:
                self.after(param)


def wsum64_payload(payload: Any) -> Any:
    """The payload with device-style WSUM64 checksums of its shm buckets (a GPU sender's kind),
    so that what the scheduler wrote can be compared with what was sent on a CPU."""
    from actor_integration.weight_sync.buckets import WSUM64, checksum

    manifests = []
    for manifest, region in zip(payload.buckets, payload.descriptors, strict=True):
        data = torch.from_file(region.path, size=region.nbytes, dtype=torch.uint8)
        manifests.append(
            dataclasses.replace(
                manifest, checksum=checksum(data, region.nbytes, WSUM64), checksum_kind=WSUM64
            )
        )
    return dataclasses.replace(payload, buckets=tuple(manifests))


class TestWrittenDigest:
    """Each round's scheduler reads back what it wrote, where it wrote it, against the senders' sums."""

    def receive(
        self, monkeypatch: Any, tmp_path: Path, model: Any, payload: Any, call: str
    ) -> dict[str, Any]:
        install_tp_group(0, 1, None, lambda name, module: monkeypatch.setitem(sys.modules, name, module))
        reply = str(tmp_path / f"{call}.json")
        names = sglang_receiver.encode_request("round", call=call, reply=reply, ranks=1, payloads=[payload])
        sglang_receiver.receive(model, [(name, torch.empty(0)) for name in names])
        answer: dict[str, Any] = json.loads(Path(reply).read_text())
        return answer

    def test_parameters_that_hold_what_was_sent_are_confirmed_every_round(self, monkeypatch, tmp_path):
        monkeypatch.setattr(sglang_receiver, "_plans", sglang_receiver.LoadPlans())
        sent = tensors(4)
        sender, payload = rank_payload(0, sent)
        try:
            model = Params()
            for call in ("recorded", "checked", "replayed"):  # the plan's three ways, each read back
                reply = self.receive(monkeypatch, tmp_path, model, wsum64_payload(payload), call)
                assert reply["ok"] is True and reply["digest"] is True, reply
                assert "digest_ms" in reply["timings"]
            assert torch.equal(model.a_weight, sent["a.weight"]) and torch.equal(model.a_bias, sent["a.bias"])
        finally:
            sender.close()

    def test_a_loader_that_changes_a_parameter_after_its_copy_is_a_typed_refusal(self, monkeypatch, tmp_path):
        """The loader copies the sent bytes, then changes one value in place (a post-processing
        step, or a bug): the bucket verified, but the parameters do not hold what was sent."""
        monkeypatch.setattr(sglang_receiver, "_plans", sglang_receiver.LoadPlans())
        sender, payload = rank_payload(0, tensors(5))
        try:
            model = Params(after=lambda param: param.data.view(-1)[3].add_(1))
            reply = self.receive(monkeypatch, tmp_path, model, wsum64_payload(payload), "bad")
            assert reply["ok"] is False
            (rank,) = reply["ranks"]
            assert rank["error"] == "WrittenWeightsError" and rank["written"] is True
            assert rank["fields"]["buckets"] == [0] and rank["fields"]["version"] == 1
        finally:
            sender.close()

    def test_no_digest_where_the_loaders_leave_no_copy_plan(self, monkeypatch, tmp_path):
        """Loaders that transform what they copy (here: into another dtype) leave no plan: the
        reply says the round could not be read back (None), it does not claim a check."""
        monkeypatch.setattr(sglang_receiver, "_plans", sglang_receiver.LoadPlans())
        sender, payload = rank_payload(0, tensors(6))
        try:

            class Converting(Params):
                def load_weights(self, weights: Any) -> None:
                    for name, tensor in weights:
                        param = self.a_weight if name == "a.weight" else self.a_bias
                        param.data.copy_(tensor.to(param.dtype).clone())

            reply = self.receive(monkeypatch, tmp_path, Converting(), wsum64_payload(payload), "loaders")
            assert reply["ok"] is True and reply["digest"] is None and reply["load"] == "loaders"
        finally:
            sender.close()


def _agree_worker(rank: int, world: int, store: Any, out: str, corrupt_rank: int | None) -> dict[str, Any]:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    install_tp_group(rank, world, dist.group.WORLD)
    sent = tensors(rank)
    sender, payload = rank_payload(rank, sent)
    if rank == corrupt_rank:
        first = payload.buckets[0]
        payload = dataclasses.replace(
            payload, buckets=(dataclasses.replace(first, checksum=first.checksum ^ 1), *payload.buckets[1:])
        )
    # Every rank builds the same request list (SGLang gives every rank the same names): own payload in
    # its slot, the others' descriptors are not this rank's to open, so each rank fills its own.
    reply = str(Path(out) / "reply.json")
    names = sglang_receiver.encode_request(
        "round", call="c1", reply=reply, ranks=world, payloads=[payload] * world
    )
    model = Model()
    sglang_receiver.receive(model, [(name, torch.empty(0)) for name in names])
    # Drop the stand-in's reference to the group before it is destroyed: a process group still
    # referenced at interpreter exit is torn down with its threads running (std::terminate).
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    dist.barrier()
    loaded_exact = bool(model.loaded) and all(torch.equal(model.loaded[n], t) for n, t in sent.items())
    sender.close()
    dist.destroy_process_group()
    answer = json.loads(Path(reply).read_text()) if rank == 0 else None
    return {"loaded": bool(model.loaded), "loaded_exact": loaded_exact, "reply": answer}


class TestAgreement:
    def test_two_ranks_that_verify_both_load_exactly_what_they_were_sent(self, tmp_path):
        results = run_world(_agree_worker, 2, str(tmp_path), None)
        no_crash(results)
        assert [r["loaded_exact"] for r in results] == [True, True]
        reply = results[0]["reply"]
        assert reply["ok"] is True and [r["ok"] for r in reply["ranks"]] == [True, True]
        assert set(reply["timings"]) == {"verify_ms", "load_ms", "digest_ms", "close_ms"}
        assert reply["digest"] is None  # host checksums (CRC32) and no parameters: nothing to read back

    def test_one_ranks_corrupt_bucket_keeps_every_rank_from_loading(self, tmp_path):
        """Rank 1's bucket fails its checksum: rank 0 verified fine, but no rank loads, and rank 0's
        reply names rank 1's CorruptBucketError with written false."""
        results = run_world(_agree_worker, 2, str(tmp_path), 1)
        no_crash(results)
        assert [r["loaded"] for r in results] == [False, False]
        reply = results[0]["reply"]
        assert reply["ok"] is False and reply["ranks"][0]["ok"] is True
        assert reply["ranks"][1]["error"] == "CorruptBucketError" and reply["ranks"][1]["written"] is False

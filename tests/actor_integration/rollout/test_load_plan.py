"""LoadPlans: an engine's weight loaders' copies recorded once per layout, checked once, replayed;
and every way a plan must be refused, so that only the loaders' own result is ever served."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actor_integration.rollout.load_plan import CHECKED, LOADERS, RECORDED, REPLAYED, LoadPlans


class FusedModel(nn.Module):
    """SGLang's shape of the problem: q, k and v land in one fused parameter through narrowed views
    (QKVParallelLinear's loader), the rest one to one (default_weight_loader)."""

    def __init__(self, *, post: str | None = None) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.post = post
        self.loader_calls = 0

    def load_weights(self, weights):
        self.loader_calls += 1
        rows = {"q": 0, "k": 4, "v": 8}
        for name, tensor in weights:
            if name in rows:
                source = tensor * 2 if self.post == "transform" else tensor
                self.qkv.data.narrow(0, rows[name], 4).copy_(source)
            else:
                self.o.data.copy_(tensor)
                if self.post == "in_place":
                    self.o.data.mul_(2)  # a post-processing step no copy records


def round_of(seed: int) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """Views into two uint8 buckets, as a receiver hands them over."""
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(4, 4, generator=g).to(torch.bfloat16) for n in "qkv"}
    tensors["o"] = torch.randn(4, 4, generator=g)
    regions = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)]
    named, offset = [], [0, 0]
    for name, tensor in tensors.items():
        bucket = 0 if name in "qk" else 1
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        at = offset[bucket]
        regions[bucket][at : at + raw.numel()] = raw
        named.append((name, regions[bucket][at : at + raw.numel()].view(tensor.dtype).reshape(tensor.shape)))
        offset[bucket] += 64 * ((raw.numel() + 63) // 64)
    return named, regions


def loaders_only(seed: int, post: str | None = None) -> FusedModel:
    model = FusedModel(post=post)
    named, _regions = round_of(seed)
    model.load_weights(named)
    return model


class TestReplay:
    def test_a_layout_is_recorded_checked_then_replayed_bit_exact(self):
        plans, model = LoadPlans(), FusedModel()
        ways = []
        for seed in (1, 2, 3, 4):
            named, regions = round_of(seed)
            ways.append(plans.load(model, "layout", named, regions))
            expected = loaders_only(seed)
            assert torch.equal(model.qkv, expected.qkv) and torch.equal(model.o, expected.o), ways
        assert ways == [RECORDED, CHECKED, REPLAYED, REPLAYED]
        assert model.loader_calls == 2  # recording and the one check; replays skip the loaders

    def test_replay_follows_parameters_reallocated_since_the_recording(self):
        plans, model = LoadPlans(), FusedModel()
        for seed in (1, 2):
            plans.load(model, "layout", *round_of(seed))
        model.qkv.data = torch.zeros(12, 4, dtype=torch.bfloat16)  # e.g. a release and a fresh mapping
        assert plans.load(model, "layout", *round_of(3)) == REPLAYED
        assert torch.equal(model.qkv, loaders_only(3).qkv)

    def test_a_replay_is_one_foreach_copy_over_views_kept_while_the_parameters_stay(self, monkeypatch):
        """The parameters' views are made once and kept while the parameters stay at their addresses
        (as torch_memory_saver keeps them); the copies are one `torch._foreach_copy_`, no
        `Tensor.copy_` per tensor."""
        plans, model = LoadPlans(), FusedModel()
        for seed in (1, 2):
            plans.load(model, "layout", *round_of(seed))
        calls: list[int] = []
        foreach = torch._foreach_copy_

        def counted(targets, sources, **kwargs):
            calls.append(len(targets))
            return foreach(targets, sources, **kwargs)

        per_tensor: list[object] = []
        copy = torch.Tensor.copy_
        monkeypatch.setattr(torch, "_foreach_copy_", counted)
        monkeypatch.setattr(
            torch.Tensor, "copy_", lambda t, *a, **k: per_tensor.append(t) or copy(t, *a, **k)
        )
        before = plans.written(model, "layout")
        assert plans.load(model, "layout", *round_of(3)) == REPLAYED
        after = plans.written(model, "layout")
        assert calls == [4] and per_tensor == []
        assert [v for v, _b, _o in before] == [v for v, _b, _o in after] and all(
            a is b for (a, _x, _y), (b, _p, _q) in zip(before, after, strict=True)
        )
        monkeypatch.undo()
        assert torch.equal(model.qkv, loaders_only(3).qkv) and torch.equal(model.o, loaders_only(3).o)

    def test_a_plan_keeps_no_bucket_between_rounds(self):
        """The trainer's buffers close when the round ends: nothing of a round's buckets is held."""
        import gc
        import weakref

        plans, model = LoadPlans(), FusedModel()
        for seed in (1, 2, 3):
            named, regions = round_of(seed)
            plans.load(model, "layout", named, regions)
            plans.written(model, "layout")
            held = [weakref.ref(r.untyped_storage()) for r in regions]
            del named, regions
            gc.collect()
            assert all(ref() is None for ref in held), seed

    def test_each_layout_has_its_own_plan(self):
        plans, model = LoadPlans(), FusedModel()
        assert plans.load(model, "a", *round_of(1)) == RECORDED
        assert plans.load(model, "b", *round_of(2)) == RECORDED


class TestRefusals:
    @pytest.mark.parametrize("post", ["transform", "in_place"])
    def test_a_loader_that_does_more_than_copy_keeps_the_loaders_running(self, post):
        """A source transformed before its copy leaves the plan incomplete; a parameter changed in
        place after its copy fails the check. Either way the loaders run, and their result is served."""
        plans, model = LoadPlans(), FusedModel(post=post)
        ways = []
        for seed in (1, 2, 3):
            named, regions = round_of(seed)
            ways.append(plans.load(model, "layout", named, regions))
            expected = loaders_only(seed, post)
            assert torch.equal(model.qkv, expected.qkv) and torch.equal(model.o, expected.o), (post, ways)
        assert ways[-1] == LOADERS and REPLAYED not in ways

    def test_a_round_read_in_part_is_not_a_plan(self):
        """A TP rank's loaders copy a shard of each tensor: the copies do not read the whole round."""

        class Sharded(FusedModel):
            def load_weights(self, weights):
                for name, tensor in weights:
                    if name == "o":
                        self.o.data[:2].copy_(tensor[:2])

        plans, model = LoadPlans(), Sharded()
        assert plans.load(model, "layout", *round_of(1)) == LOADERS
        assert plans.load(model, "layout", *round_of(2)) == LOADERS

    def test_the_recording_leaves_tensor_copy_as_it_was(self):
        original = torch.Tensor.copy_
        LoadPlans().load(FusedModel(), "layout", *round_of(1))
        assert torch.Tensor.copy_ is original

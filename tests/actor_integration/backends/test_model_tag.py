"""CpuWeightBackup and ModelTagSwitch: bit-exact restores, reused host buffers, clear mismatch errors."""

from __future__ import annotations

import pytest
import torch

from actor_integration.backends.model_tag import (
    CpuWeightBackup,
    ModelTagSwitch,
    UnknownModelTagError,
    WeightMismatchError,
    named_model_tensors,
)
from lifecycle import Hooks, Lifecycle, LifecyclePolicy
from lifecycle.testing import FakeMemorySaver


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    net.register_buffer("step", torch.tensor([3], dtype=torch.int64))
    return net.to(torch.bfloat16)


def snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in named_model_tensors(net)}


def assert_bit_exact(net: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in named_model_tensors(net):
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), name


class TestCpuWeightBackup:
    def test_restore_after_overwrite_is_bit_exact(self) -> None:
        net, backup = model(), CpuWeightBackup(pin_memory=False)
        expected = snapshot(net)
        backup.backup("actor", named_model_tensors(net))
        with torch.no_grad():
            for _, tensor in named_model_tensors(net):
                tensor.fill_(7)
        backup.restore("actor", named_model_tensors(net))
        assert_bit_exact(net, expected)

    def test_backup_is_a_copy(self) -> None:
        net, backup = model(), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        before = {k: v.clone() for k, v in backup.tensors("actor").items()}
        with torch.no_grad():
            next(iter(net.parameters())).add_(1)
        assert all(torch.equal(before[k], v) for k, v in backup.tensors("actor").items())

    def test_buffers_are_reused_across_backups_of_a_tag(self) -> None:
        """No host allocation per step (vime #57: host RAM grew until the sync OOMed)."""
        net, backup = model(), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        pointers = {k: v.data_ptr() for k, v in backup.tensors("actor").items()}
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(2)
        backup.backup("actor", named_model_tensors(net))
        assert {k: v.data_ptr() for k, v in backup.tensors("actor").items()} == pointers
        assert_bit_exact(net, {k: v for k, v in backup.tensors("actor").items()})

    def test_tags_are_independent(self) -> None:
        actor, ref = model(0), model(1)
        backup = CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(actor))
        backup.backup("ref", named_model_tensors(ref))
        expected_ref = snapshot(ref)
        backup.restore("ref", named_model_tensors(actor))
        assert_bit_exact(actor, expected_ref)
        assert backup.tags == ("actor", "ref")

    def test_nbytes(self) -> None:
        net, backup = model(), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        assert backup.nbytes("actor") == sum(t.nbytes for _, t in named_model_tensors(net))

    def test_tensors_view_is_read_only(self) -> None:
        net, backup = model(), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        view = backup.tensors("actor")
        with pytest.raises(TypeError):
            view["0.weight"] = torch.zeros(1)  # type: ignore[index]

    def test_unknown_tag(self) -> None:
        backup = CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(model()))
        for call in (
            lambda: backup.restore("ref", []),
            lambda: backup.tensors("ref"),
            lambda: backup.nbytes("ref"),
        ):
            with pytest.raises(
                UnknownModelTagError,
                match=r"no weight backup under model tag 'ref'; backed-up tags: \['actor'\]",
            ):
                call()

    def test_name_mismatch(self) -> None:
        backup = CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(model()))
        other = torch.nn.Sequential(torch.nn.Linear(8, 16)).to(torch.bfloat16)
        with pytest.raises(
            WeightMismatchError,
            match=r"restore\('actor'\): .*missing \['1.bias', '1.weight', '2.bias', '2.weight', 'step'\]",
        ):
            backup.restore("actor", named_model_tensors(other))
        with pytest.raises(WeightMismatchError, match=r"unexpected \['extra'\]"):
            backup.backup("actor", [*named_model_tensors(model()), ("extra", torch.zeros(1))])

    def test_shape_and_dtype_mismatch_leave_the_target_untouched(self) -> None:
        backup = CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(model()))
        wrong_dtype = model(2).to(torch.float32)
        before = snapshot(wrong_dtype)
        with pytest.raises(
            WeightMismatchError, match=r"backup \(16, 8\) torch.bfloat16, given \(16, 8\) torch.float32"
        ):
            backup.restore("actor", named_model_tensors(wrong_dtype))
        assert_bit_exact(wrong_dtype, before)
        tensors = dict(named_model_tensors(model()))
        tensors["0.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        with pytest.raises(WeightMismatchError, match=r"0.weight: backup \(16, 8\)"):
            backup.backup("actor", tensors.items())

    def test_duplicate_names_and_empty_input(self) -> None:
        backup = CpuWeightBackup(pin_memory=False)
        with pytest.raises(WeightMismatchError, match="'w' appears twice"):
            backup.backup("actor", [("w", torch.zeros(1)), ("w", torch.zeros(1))])
        with pytest.raises(WeightMismatchError, match="no tensors given"):
            backup.backup("actor", [])

    def test_model_chunks_are_prefixed(self) -> None:
        chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        names = [name for name, _ in named_model_tensors(chunks)]
        assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


class TestModelTagSwitch:
    def test_switch_restores_and_records_the_active_tag(self) -> None:
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        actor = snapshot(net)
        backup.backup("actor", named_model_tensors(net))
        backup.backup("ref", named_model_tensors(model(1)))
        switch = ModelTagSwitch(backup, lambda: net)
        switch("ref")
        assert switch.active == "ref"
        switch("actor")
        assert switch.active == "actor"
        assert_bit_exact(net, actor)

    def test_failed_check_keeps_the_active_tag(self) -> None:
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        switch = ModelTagSwitch(backup, lambda: net)
        switch("actor")
        with pytest.raises(UnknownModelTagError):
            switch("old_actor")
        assert switch.active == "actor"

    def test_wake_restores_actor_after_the_paused_weights_were_lost(self) -> None:
        """The wake plan's switch_model('actor') brings back the actor weights a pause destroyed."""
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        actor = snapshot(net)
        backup.backup("actor", named_model_tensors(net))
        backup.backup("ref", named_model_tensors(model(1)))
        switch = ModelTagSwitch(backup, lambda: net)
        switch("ref")  # a ref forward left the ref weights in place
        memory = FakeMemorySaver()
        lifecycle = Lifecycle(LifecyclePolicy(model_tag="actor"), Hooks(memory=memory, switch_model=switch))
        lifecycle.sleep()
        with torch.no_grad():
            for _, tensor in named_model_tensors(net):
                tensor.fill_(-1)  # what paused memory holds after a resume without backup
        lifecycle.wake_up()
        assert switch.active == "actor"
        assert_bit_exact(net, actor)

    def test_train_sleep_wake_save_keeps_the_trained_weights(self) -> None:
        """Issue 14: the backup taken at configuration must not undo the training done since."""
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        switch = ModelTagSwitch(backup, lambda: net, active="actor")
        lifecycle = Lifecycle(
            LifecyclePolicy(model_tag="actor", offload_train=True),
            Hooks(memory=FakeMemorySaver(), switch_model=switch),
        )
        lifecycle.sleep()  # as slime's init ends

        def train() -> None:
            with torch.no_grad():
                for _, tensor in named_model_tensors(net):
                    tensor.add_(1)

        lifecycle.run("train", train)  # wake (switch to actor), train, sleep
        trained = snapshot(net)
        lifecycle.wake_up()
        saved = lifecycle.run("save", lambda: snapshot(net))
        assert_bit_exact(net, trained)
        assert all(torch.equal(saved[k], trained[k]) for k in trained)

    def test_switching_away_and_back_restores_the_backup(self) -> None:
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        backup.backup("actor", named_model_tensors(net))
        backup.backup("ref", named_model_tensors(model(1)))
        switch = ModelTagSwitch(backup, lambda: net, active="actor")
        switch("ref")
        assert_bit_exact(net, dict(backup.tensors("ref")))
        switch("actor")
        assert_bit_exact(net, dict(backup.tensors("actor")))

    def test_contents_not_kept_restores_every_time(self) -> None:
        net, backup = model(0), CpuWeightBackup(pin_memory=False)
        actor = snapshot(net)
        backup.backup("actor", named_model_tensors(net))
        switch = ModelTagSwitch(backup, lambda: net, active="actor", contents_kept=False)
        with torch.no_grad():
            for _, tensor in named_model_tensors(net):
                tensor.fill_(-1)  # a pause without CPU backup
        switch("actor")
        assert_bit_exact(net, actor)

    def test_active_must_have_a_backup(self) -> None:
        with pytest.raises(UnknownModelTagError, match="active='actor'"):
            ModelTagSwitch(CpuWeightBackup(pin_memory=False), lambda: model(), active="actor")

    def test_needs_a_backup_and_a_callable(self) -> None:
        with pytest.raises(TypeError, match="needs a CpuWeightBackup"):
            ModelTagSwitch(object(), lambda: model())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="model_getter"):
            ModelTagSwitch(CpuWeightBackup(), model())

"""LifecyclePolicy: invalid combinations fail at construction with a message that says what to do."""

import argparse

import pytest

from lifecycle import LifecyclePolicy


class TestValidation:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"memory_tags": ()}, "empty"),
            ({"memory_tags": ("weights", "weights")}, r"\['weights'\] more than once"),
            ({"memory_tags": ("weights", "")}, "empty or non-string"),
            ({"memory_tags": "weights"}, r"memory_tags=\('weights',\)"),
            ({"memory_tags": ("*",)}, "all memory"),
            ({"sync_requires": ("weights",)}, "memory_tags=None"),
            (
                {"memory_tags": ("kv_cache",), "sync_requires": ("weights",)},
                r"\['weights'\], which are not in",
            ),
            ({"offload_train": True, "auto_wake": False}, "contradicts itself"),
            ({"model_tag": ""}, "model_tag"),
            ({"offload_train": 1}, "must be a bool"),
        ],
    )
    def test_invalid(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            LifecyclePolicy(**kwargs)

    def test_keyword_only_and_frozen(self):
        with pytest.raises(TypeError):
            LifecyclePolicy(True)  # type: ignore[misc]
        policy = LifecyclePolicy()
        with pytest.raises(AttributeError):
            policy.offload_train = True  # type: ignore[misc]

    def test_tags_and_round_trip(self):
        policy = LifecyclePolicy(memory_tags=["weights", "kv_cache"], sync_requires=["weights"])
        assert policy.tags == ("weights", "kv_cache")
        assert LifecyclePolicy.from_dict(policy.to_dict()) == policy
        assert LifecyclePolicy().tags == ("*",)
        with pytest.raises(ValueError, match="unknown LifecyclePolicy fields"):
            LifecyclePolicy.from_dict({"offload": True})


class TestFromArgs:
    def ns(self, **kw):
        return argparse.Namespace(**kw)

    def test_colocate_implies_offload(self):
        """slime: --colocate offloads the trainer unless told otherwise."""
        policy = LifecyclePolicy.from_args(
            self.ns(colocate=True, offload_train=None, use_routing_replay=True)
        )
        assert (policy.offload_train, policy.use_routing_replay, policy.model_tag) == (True, True, "actor")

    def test_logs_with_the_retired_colocate_field_still_replay(self):
        """Policies logged before `colocate` left the policy (it was read nowhere) still load."""
        policy = LifecyclePolicy.from_dict({"offload_train": True, "colocate": True})
        assert policy.offload_train and not hasattr(policy, "colocate")

    def test_release_train_turns_offload_off(self):
        policy = LifecyclePolicy.from_args(self.ns(colocate=True, offload_train=True, release_train=True))
        assert policy.offload_train is False

    def test_critic_forces_offload_and_restores_no_tag(self):
        policy = LifecyclePolicy.from_args(self.ns(offload_train=False, use_critic=True), role="critic")
        assert policy.offload_train is True and policy.model_tag is None

    def test_offload_flag_and_overrides(self):
        policy = LifecyclePolicy.from_args(self.ns(offload=True), memory_tags=("model",))
        assert policy.offload_train and policy.memory_tags == ("model",)

    def test_bad_role(self):
        with pytest.raises(ValueError, match="role"):
            LifecyclePolicy.from_args(self.ns(), role="ref")

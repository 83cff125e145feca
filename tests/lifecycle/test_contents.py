"""Contents beside residency: a release without backup discards the weights, and generate is refused
until a sync has written them again (vllm #29341, SkyRL #2065), or while they are older than the
caller requires (miles #1724)."""

import pytest

from lifecycle import (
    Contents,
    Hooks,
    IllegalTransitionError,
    InvalidWeightsError,
    Lifecycle,
    LifecyclePolicy,
    Residency,
    State,
    capture_events,
)
from lifecycle.testing import FakeGeneration, FakeMemorySaver, FaultInjector

TAGS = ("weights", "kv_cache")


def rollout_policy(**overrides):
    fields = {
        "memory_tags": TAGS,
        "sync_requires": ("weights",),
        "discard_on_release": TAGS,
        "model_tag": None,
        "destroy_process_groups": False,
    }
    fields.update(overrides)
    return LifecyclePolicy(**fields)


def rollout(policy=None, *, faults=None, initial=State.AWAKE, weight_version=0):
    memory = FakeMemorySaver(TAGS, faults=faults)
    return Lifecycle(
        policy or rollout_policy(),
        Hooks(memory=memory, generation=FakeGeneration()),
        role="rollout",
        rank=0,
        initial=initial,
        weight_version=weight_version,
    )


class Engine:
    """Counts what reached it: a refused generate must never get here."""

    def __init__(self):
        self.generated = 0

    def generate(self):
        self.generated += 1
        return "tokens"


def sync(lc, version, *, fail_after_write=False, write=True):
    """A sync body as a receiving side writes it: unknown from its first write, valid at the end."""

    def body():
        if write:
            lc.note_weights(Contents.UNKNOWN, version, reason="writing")
        if fail_after_write:
            raise RuntimeError("bucket 3 failed to open")
        lc.note_weights(Contents.VALID, version, reason="loaded")

    lc.run("sync", body)


def wake_colocated(lc, version):
    lc.wake_up(["weights"])
    sync(lc, version)
    lc.wake_up(["kv_cache"])


class TestPolicy:
    def test_discarded_tags_must_be_tracked(self):
        with pytest.raises(ValueError, match=r"discard_on_release names \['kv'\]"):
            rollout_policy(discard_on_release=("kv",))

    def test_a_string_is_refused(self):
        with pytest.raises(ValueError, match="tuple of tag names"):
            rollout_policy(discard_on_release="weights")

    def test_one_unit_of_memory_discards_as_star(self):
        policy = LifecyclePolicy(discard_on_release=("*",))
        assert policy.view().weight_tags == ("*",)

    def test_the_weight_tags_are_the_ones_a_sync_writes(self):
        assert rollout_policy().view().weight_tags == ("weights",)

    def test_logged_policies_read_the_field_back(self):
        policy = rollout_policy()
        assert LifecyclePolicy.from_dict(policy.to_dict()) == policy


class TestDiscarded:
    def test_awake_starts_valid_paused_starts_discarded(self):
        assert rollout().contents == {"weights": Contents.VALID, "kv_cache": Contents.VALID}
        assert rollout(initial=State.PAUSED).contents == {
            "weights": Contents.DISCARDED,
            "kv_cache": Contents.DISCARDED,
        }

    def test_a_wake_without_sync_refuses_generate_before_the_engine(self):
        lc, engine = rollout(), Engine()
        lc.sleep()
        lc.wake_up()
        assert lc.residency == {"weights": Residency.RESIDENT, "kv_cache": Residency.RESIDENT}
        assert lc.contents["weights"] is Contents.DISCARDED
        with pytest.raises(InvalidWeightsError) as info:
            lc.run("generate", engine.generate)
        error = info.value
        assert isinstance(error, IllegalTransitionError)
        assert error.tags == {"weights": "discarded"} and error.fix == "sync"
        assert error.state is State.AWAKE and error.operation == "generate"
        assert "tag 'weights' holds discarded" in str(error) and "update_weights" in str(error)
        assert engine.generated == 0
        assert not lc.may("generate")

    def test_a_sync_makes_them_valid_at_its_version(self):
        lc, engine = rollout(), Engine()
        lc.sleep()
        wake_colocated(lc, 3)
        assert lc.contents["weights"] is Contents.VALID and lc.weight_version == 3
        assert lc.run("generate", engine.generate) == "tokens"
        assert lc.snapshot()["contents"] == {"weights": "valid", "kv_cache": "discarded"}
        assert lc.snapshot()["weight_version"] == 3

    def test_the_kv_cache_contents_do_not_matter(self):
        """Only the weight tags gate generation: a fresh KV cache is what a wake should give."""
        lc = rollout()
        lc.sleep()
        wake_colocated(lc, 1)
        assert lc.contents["kv_cache"] is Contents.DISCARDED
        assert lc.may("generate")

    def test_a_tag_with_backup_keeps_its_contents(self):
        lc, engine = rollout(rollout_policy(discard_on_release=("kv_cache",))), Engine()
        lc.sleep()
        lc.wake_up()
        assert lc.contents == {"weights": Contents.VALID, "kv_cache": Contents.DISCARDED}
        assert lc.run("generate", engine.generate) == "tokens"


class TestSync:
    def test_a_sync_that_failed_after_writing_leaves_them_unknown(self):
        lc = rollout()
        lc.sleep()
        lc.wake_up(["weights"])
        with pytest.raises(RuntimeError, match="bucket 3"):
            sync(lc, 1, fail_after_write=True)
        lc.wake_up(["kv_cache"])
        assert lc.contents["weights"] is Contents.UNKNOWN
        with pytest.raises(InvalidWeightsError, match="'weights' holds unknown") as info:
            lc.run("generate", Engine().generate)
        assert info.value.tags == {"weights": "unknown"}

    def test_a_sync_refused_before_writing_keeps_the_previous_weights(self):
        lc = rollout(weight_version=4)
        with pytest.raises(RuntimeError):
            sync(lc, 5, write=False, fail_after_write=True)
        assert lc.contents["weights"] is Contents.VALID and lc.weight_version == 4
        assert lc.may("generate")

    def test_note_weights_outside_a_sync_body_is_refused(self):
        lc = rollout()
        with pytest.raises(IllegalTransitionError, match="inside its sync body"):
            lc.note_weights(Contents.VALID, 1, reason="no")
        with pytest.raises(IllegalTransitionError, match="inside its sync body"):
            lc.run("generate", lambda: lc.note_weights(Contents.VALID, 1, reason="no"))

    def test_note_weights_checks_its_arguments(self):
        lc = rollout()
        with pytest.raises(ValueError, match="never discards"):
            lc.run("sync", lambda: lc.note_weights(Contents.DISCARDED, reason="x"))
        with pytest.raises(ValueError, match="version loaded"):
            lc.run("sync", lambda: lc.note_weights(Contents.VALID, None, reason="x"))

    def test_the_declaration_is_logged(self):
        lc = rollout()
        with capture_events() as events:
            sync(lc, 2)
        declared = [e for e in events if e["event"] == "lifecycle.contents"]
        assert [e["declared"] for e in declared] == [Contents.UNKNOWN, Contents.VALID]
        assert declared[-1]["weight_version"] == 2 and declared[-1]["contents"]["weights"] == "valid"


class TestVersion:
    def test_an_engine_older_than_required_is_refused(self):
        lc, engine = rollout(weight_version=0), Engine()
        with pytest.raises(InvalidWeightsError, match="requires at least version 5") as info:
            lc.run("generate", engine.generate, min_weight_version=5)
        assert info.value.required_version == 5 and info.value.weight_version == 0
        assert engine.generated == 0
        sync(lc, 5)
        assert lc.run("generate", engine.generate, min_weight_version=5) == "tokens"

    def test_an_unknown_version_is_never_recent_enough(self):
        lc = rollout(weight_version=None)
        with pytest.raises(InvalidWeightsError, match="unknown version"):
            lc.run("generate", Engine().generate, min_weight_version=0)

    def test_only_generate_takes_a_minimum(self):
        lc = rollout()
        with pytest.raises(ValueError, match="only generate"):
            lc.run("train", lambda: None, min_weight_version=1)

    def test_the_minimum_is_not_passed_to_the_body(self):
        lc = rollout(weight_version=2)
        assert lc.run("generate", lambda **kw: kw, min_weight_version=1) == {}


class TestHookFailures:
    @pytest.mark.parametrize("after_effect", [False, True])
    def test_a_failed_release_leaves_contents_unknown_until_recover_asks(self, after_effect):
        faults = FaultInjector()
        faults.arm("memory.pause", after_effect=after_effect)
        lc = rollout(faults=faults)
        with pytest.raises(Exception, match="injected"):
            lc.sleep()
        assert lc.contents["weights"] is Contents.UNKNOWN
        assert lc.failure is not None and lc.failure.contents["weights"] is Contents.UNKNOWN
        lc.recover(State.AWAKE)
        # Released after all (the effect happened): discarded, known now. Not released: still unknown,
        # since the release may have begun. Either way only a sync makes generation legal again.
        expected = Contents.DISCARDED if after_effect else Contents.UNKNOWN
        assert lc.contents["weights"] is expected
        with pytest.raises(InvalidWeightsError):
            lc.run("generate", Engine().generate)
        sync(lc, 1)
        assert lc.may("generate")

    def test_a_failed_resume_of_a_backed_up_tag_leaves_it_unknown(self):
        faults = FaultInjector()
        lc = rollout(rollout_policy(discard_on_release=()), faults=faults)
        lc.sleep()
        faults.arm("memory.resume")
        with pytest.raises(Exception, match="injected"):
            lc.wake_up()
        assert lc.contents["weights"] is Contents.UNKNOWN

    def test_transitions_log_the_contents(self):
        lc = rollout()
        with capture_events() as events:
            lc.sleep()
        (moved,) = [e for e in events if e["event"] == "lifecycle.transition"]
        assert moved["contents"] == {"weights": "discarded", "kv_cache": "discarded"}

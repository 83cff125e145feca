"""Random operation sequences with random hook failures never violate the backend protocol.

The fakes raise `ProtocolViolation` exactly where the real backends would crash (TMS exit(1) on a
double pause or a resume of a resident tag, a collective on destroyed groups, a body on released
memory, a sync body allocating inside memory-saver regions); the machine must never let one happen,
and its residency must always match the backends'.
"""

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lifecycle import IllegalTransitionError, LifecycleFailedError, LifecyclePolicy, Residency, State
from lifecycle.table import Groups, Hook
from lifecycle.testing import InjectedFault, ProtocolViolation, recording_lifecycle
from tests.helpers.bodies import make_body

TAGS = ("weights", "kv_cache")
EXPECTED = (IllegalTransitionError, LifecycleFailedError, InjectedFault)


@st.composite
def policies(draw):
    tagged = draw(st.booleans())
    offload = draw(st.booleans())
    return LifecyclePolicy(
        offload_train=offload,
        use_routing_replay=draw(st.booleans()),
        memory_tags=TAGS if tagged else None,
        destroy_process_groups=draw(st.booleans()),
        auto_wake=True if offload else draw(st.booleans()),
        sync_requires=draw(st.sampled_from([(), ("weights",)])) if tagged else (),
    )


tag_sets = st.one_of(st.none(), st.sampled_from([("weights",), ("kv_cache",), TAGS]))


class LifecycleProtocol(RuleBasedStateMachine):
    @initialize(
        policy=policies(), initial=st.sampled_from([State.AWAKE, State.PAUSED]), generation=st.booleans()
    )
    def build(self, policy, initial, generation):
        self.lc, self.rec = recording_lifecycle(policy, initial=initial, generation=generation)
        self.tagged = policy.memory_tags is not None

    def _do(self, action):
        try:
            action()
        except ProtocolViolation:
            raise
        except EXPECTED:
            pass

    @rule(tags=tag_sets)
    def sleep(self, tags):
        self._do(lambda: self.lc.sleep(tags if self.tagged else None))

    @rule(tags=tag_sets)
    def wake_up(self, tags):
        self._do(lambda: self.lc.wake_up(tags if self.tagged else None))

    @rule(
        op=st.sampled_from(["train", "save", "sync", "generate"]),
        nested=st.sampled_from(["", "wake", "both"]),
        raises=st.booleans(),
    )
    def run_body(self, op, nested, raises):
        inner = make_body(self.rec, self.lc, op)

        def body():
            if nested in ("wake", "both"):
                self.lc.wake_up()  # slime's bodies call these themselves: absorbed
            inner()
            if nested == "both":
                self.lc.sleep()
            if raises:
                raise KeyError("body failed")

        try:
            self._do(lambda: self.lc.run(op, body))
        except KeyError:
            assert self.lc.state is not State.FAILED or self.lc.failure is not None

    @rule(hook=st.sampled_from(list(Hook)), at=st.integers(1, 3), after=st.booleans())
    def arm_fault(self, hook, at, after):
        self.rec.faults.arm(hook, at=at, after_effect=after)

    @precondition(lambda self: self.lc.state is State.FAILED)
    @rule(goal=st.sampled_from([State.AWAKE, State.PAUSED]))
    def recover(self, goal):
        self._do(lambda: self.lc.recover(goal))

    @invariant()
    def residency_matches_the_backend(self):
        lc, memory = self.lc, self.rec.memory
        for tag, known in lc.residency.items():
            if known is Residency.UNKNOWN:
                assert lc.state is State.FAILED
                continue
            actual = memory.is_paused(None if tag == "*" else tag)
            assert actual == (known is Residency.RELEASED), (tag, known, memory.paused)
        groups = lc.groups
        if groups is Groups.UNKNOWN:
            assert lc.state is State.FAILED
        elif groups is not None:
            assert self.rec.process_groups.alive == (groups is Groups.ALIVE)

    @invariant()
    def state_matches_residency(self):
        lc = self.lc
        assert lc.state in (State.AWAKE, State.PAUSED, State.FAILED)  # bodies never leak SAVING/SYNCING
        resident = [r is Residency.RESIDENT for r in lc.residency.values()]
        if lc.state is State.AWAKE:
            assert all(resident)
            if lc.groups is not None:
                assert lc.groups is Groups.ALIVE
        elif lc.state is State.PAUSED:
            assert not all(resident)
        else:
            assert lc.failure is not None


CI_EXAMPLES = 2000
SLOW_EXAMPLES = int(os.environ.get("LIFECYCLE_PROPERTY_EXAMPLES", "10000"))


def _run(examples: int) -> None:
    LifecycleProtocol.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    LifecycleProtocol.TestCase().runTest()


def test_protocol_random_sequences():
    """≥ 2,000 random sequences (25 steps each) in CI."""
    _run(CI_EXAMPLES)


@pytest.mark.slow
def test_protocol_random_sequences_long():
    """≥ 10,000 sequences; `make test-slow`."""
    _run(SLOW_EXAMPLES)

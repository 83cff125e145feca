"""The model check of AReaL's colocate sequences: plain AReaL against SGLang's and the plugin's failures.

Every sequence of the driver's calls between the trainer and the rollout after init (rl_trainer's:
the rollout's pause, offloads and onloads, continue, a workflow request; the actor's onload,
offload, train step, save and AWEX weight update; RecoverHandler's colocate branch, with and
without a checkpoint), up to a length, runs on a fresh AReaL-shaped trainer rank and rollout
engine over one SGLang server (tests/helpers/areal_like.py, each call as AReaL cbff54d6 makes
it). Plain AReaL's shortest reproductions are listed (`areal_like.REPRODUCTIONS`, exactly what the
search finds); each runs again under `ArealTrainerMixin` and `ArealRolloutMixin`: no violation,
each machine's residency the backend's after every call (a typed refusal is allowed).
`pytest -s` prints the search. The counts are in docs/frameworks/areal.md.
"""

import pytest

from lifecycle.errors import LifecycleError, ProtocolViolation
from tests.helpers.areal_like import METHODS, REPRODUCTIONS, STEP, check, started
from tests.helpers.method_sequences import explore, render

PLAIN_DEPTH = 5
WRAPPED_DEPTH = 3  # every call under the adapters runs both machines' plans: ~3 ms a sequence
SLOW_WRAPPED_DEPTH = 4


@pytest.fixture(scope="module")
def plain_search():
    return explore(lambda: started(wrapped=False), METHODS, PLAIN_DEPTH, check)


class TestPlainAReaL:
    def test_the_search_finds_exactly_the_listed_reproductions(self, plain_search):
        found = {(finding.sequence, finding.kind) for finding in plain_search.shortest.values()}
        assert found == set(REPRODUCTIONS)

    def test_report(self, plain_search):
        print(f"\nplain AReaL, every driver call sequence after init up to length {PLAIN_DEPTH}:")
        print(render("awex colocate", plain_search))
        assert plain_search.sequences > 100_000 and plain_search.violations > 0

    def test_its_own_step_is_clean(self):
        """rl_trainer's colocate step, twice: AReaL's own order breaks nothing."""
        world = started(wrapped=False)
        for name in STEP + STEP:
            METHODS[name](world)
        assert world.server.label == "v2"

    @pytest.mark.parametrize(("sequence", "kind"), REPRODUCTIONS)
    def test_plain_areal_breaks(self, sequence, kind):
        world = started(wrapped=False)
        *before, last = sequence
        for name in before:
            METHODS[name](world)
        with pytest.raises(ProtocolViolation):
            METHODS[last](world)


class TestUnderTheAdapters:
    @pytest.mark.parametrize(("sequence", "kind"), REPRODUCTIONS)
    def test_each_reproduction_runs_clean_or_is_refused(self, sequence, kind):
        world = started(wrapped=True)
        for name in sequence:
            try:
                METHODS[name](world)
            except ProtocolViolation:
                raise
            except LifecycleError:
                pass  # a typed refusal: the actors are as they were
            assert check(world) is None, name

    def test_the_step_is_clean_and_serves_each_version(self):
        world = started(wrapped=True)
        for name in STEP + STEP:
            METHODS[name](world)
            assert check(world) is None, name
        assert world.server.label == "v2" and world.rollout.lifecycle.weight_version == 2

    def test_no_sequence_breaks(self):
        search = explore(lambda: started(wrapped=True), METHODS, WRAPPED_DEPTH, check)
        print(f"\nunder the AReaL adapters, up to length {WRAPPED_DEPTH}:")
        print(render("awex colocate", search))
        assert search.violations == 0, render("awex colocate", search)
        assert search.refusals > 0  # the refusals are counted apart, not hidden

    @pytest.mark.slow
    def test_no_longer_sequence_breaks(self):
        search = explore(lambda: started(wrapped=True), METHODS, SLOW_WRAPPED_DEPTH, check)
        print(render(f"awex colocate, up to length {SLOW_WRAPPED_DEPTH}", search))
        assert search.violations == 0, render("awex colocate", search)

"""The model check of miles' own method sequences: plain miles against torch_memory_saver's exits.

Every sequence of sleep, wake_up, train, save_model and update_weights after init (which ends
asleep), up to a length, runs on the miles-shaped actor (tests/helpers/miles_like.py) over the
strict fake, in each of miles' tag layouts. Plain miles' shortest reproductions are listed here
(`miles_like.REPRODUCTIONS`, exactly what the search finds); each one runs again under the adapter, clean.
`pytest -s` prints the search: sizes and, per kind of violation, its count and shortest sequence.
The same reproductions on miles' real class: test_miles_source.py.
"""

import pytest

from lifecycle.errors import IllegalTransitionError, LifecycleError, ProtocolViolation
from tests.helpers.method_sequences import explore, render
from tests.helpers.miles_like import (
    CONFIGS,
    DISCARDED,
    METHODS,
    REFUSED,
    REPRODUCTIONS,
    LifecycleMilesActor,
    MilesLikeActor,
    check,
    started,
)

PLAIN_DEPTH = 6
ADAPTER_DEPTH = 4  # every sequence under the adapter re-runs its machine's plans: ~1.5 ms a call
SLOW_ADAPTER_DEPTH = 6


def _searches(cls: type, depth: int) -> dict:
    return {
        config: explore(lambda config=config: started(cls, config), METHODS, depth, check)
        for config in CONFIGS
    }


@pytest.fixture(scope="module")
def plain_search() -> dict:
    return _searches(MilesLikeActor, PLAIN_DEPTH)


class TestPlainMiles:
    def test_the_search_finds_exactly_the_listed_reproductions(self, plain_search):
        found = {
            (config, finding.sequence, finding.kind)
            for config, search in plain_search.items()
            for finding in search.shortest.values()
        }
        assert found == set(REPRODUCTIONS)

    def test_report(self, plain_search):
        print(f"\nplain miles, every method sequence after init up to length {PLAIN_DEPTH}:")
        for config, search in plain_search.items():
            print(render(config, search))
        assert sum(s.sequences for s in plain_search.values()) > 20_000

    @pytest.mark.parametrize(("config", "sequence", "kind"), REPRODUCTIONS)
    def test_plain_miles_breaks(self, config, sequence, kind):
        actor = started(MilesLikeActor, config)
        *before, last = sequence
        for name in before:
            METHODS[name](actor)
        if kind == DISCARDED:
            METHODS[last](actor)
            assert check(actor) == DISCARDED
        else:
            with pytest.raises(ProtocolViolation):
                METHODS[last](actor)


class TestUnderTheAdapter:
    @pytest.mark.parametrize(("config", "sequence", "kind"), REPRODUCTIONS)
    def test_each_reproduction_runs_clean(self, config, sequence, kind):
        actor = started(LifecycleMilesActor, config)
        refused = REFUSED.get((config, sequence))
        for position, name in enumerate(sequence):
            if refused is not None and position == len(sequence) - 1:
                with pytest.raises(refused[1]):
                    METHODS[name](actor)
            else:
                METHODS[name](actor)
            assert check(actor) is None, name

    def test_no_sequence_breaks(self):
        searches = _searches(LifecycleMilesActor, ADAPTER_DEPTH)
        print(f"\nunder MilesLifecycleMixin, up to length {ADAPTER_DEPTH}:")
        for config, search in searches.items():
            print(render(config, search))
            assert search.violations == 0, render(config, search)

    @pytest.mark.slow
    def test_no_sequence_with_held_scopes_breaks(self):
        """A driver's hold and release between miles' calls (LifecycleGroup.held()): still nothing."""
        methods = {
            **METHODS,
            "hold": lambda actor: actor.lifecycle_hold(),
            "release": lambda actor: actor.lifecycle_release(),
        }
        for config in CONFIGS:
            search = explore(lambda config=config: started(LifecycleMilesActor, config), methods, 4, check)
            assert search.violations == 0, render(config, search)

    @pytest.mark.slow
    def test_no_longer_sequence_breaks(self):
        for config, search in _searches(LifecycleMilesActor, SLOW_ADAPTER_DEPTH).items():
            assert search.violations == 0, render(config, search)


def test_a_refused_call_is_a_typed_error_not_a_violation():
    """The search counts the lifecycle's refusals apart: the actor is as it was, the sequence goes on."""
    search = explore(lambda: started(LifecycleMilesActor, "rematerialize"), METHODS, 2, check)
    assert search.refusals == 1 and search.violations == 0
    assert issubclass(IllegalTransitionError, LifecycleError)

"""Every interleaving of a trainer and a rollout machine on one slot keeps exclusion, freshness, valid
weights and progress."""

import pytest

from lifecycle.modelcheck import BROKEN, explore


class TestColocatedLoop:
    @pytest.mark.parametrize("faults", [0, 1, 2])
    def test_invariants_hold_in_every_interleaving(self, faults):
        """No reachable state breaks exclusion or freshness, and none deadlocks, with hook failures anywhere."""
        report = explore(steps=3, save_every=2, faults=faults)
        print(
            f"model check ({faults} injected hook failures): {report.states} states, "
            f"{report.transitions} transitions explored"
        )
        assert report.violations == [] and report.deadlocks == 0
        assert report.completed >= 1
        assert report.states > 50 * (faults + 1)

    def test_waking_before_the_trainer_sleeps_breaks_exclusion(self):
        report = explore(steps=2, broken=BROKEN[0])
        assert any(v.startswith("exclusion: trainer AWAKE") for v in report.violations), report.violations

    def test_serving_before_the_sync_is_refused_by_the_contents_guard(self):
        """The rollout's weights were discarded by its release: the table refuses the early generate."""
        report = explore(steps=2, broken=BROKEN[1])
        assert any(
            v.startswith("refused: rollout generate refused on invalid weights (weights discarded)")
            for v in report.violations
        ), report.violations

    def test_serving_before_the_sync_serves_discarded_weights_without_the_guard(self):
        report = explore(steps=2, broken=BROKEN[1], contents_guard=False)
        assert any(
            v.startswith(
                "valid weights: rollout generates on invalid weights (weights discarded) at rollout step 2"
            )
            for v in report.violations
        ), report.violations

    def test_a_driver_that_skips_a_sync_is_refused(self):
        """The trainer skips step 1's sync but says it synced: the rollout's next generate is refused."""
        report = explore(steps=2, broken="skip_sync")
        assert any(
            v.startswith(
                "refused: rollout generate refused on invalid weights (weights discarded) at rollout step 2"
            )
            for v in report.violations
        ), report.violations
        assert not any(v.startswith("valid weights") for v in report.violations)

    def test_without_the_guard_the_skipped_sync_serves_discarded_weights(self):
        """The property is checked, not assumed: take the guard out and the same driver serves garbage."""
        report = explore(steps=2, broken="skip_sync", contents_guard=False)
        assert any(
            v.startswith(
                "valid weights: rollout generates on invalid weights (weights discarded) at rollout step 2"
            )
            for v in report.violations
        ), report.violations

    @pytest.mark.parametrize("faults", [0, 1])
    def test_the_guard_never_refuses_a_correct_driver(self, faults):
        report = explore(steps=2, faults=faults, contents_guard=False)
        assert report.violations == [] and report.deadlocks == 0

    def test_unknown_breakage_is_refused(self):
        with pytest.raises(ValueError, match="broken must be one of"):
            explore(broken="nope")


class TestHeldScope:
    """reef #202's trainer step inside a held scope: hold, wake (slot restore), train, save, sleep, release."""

    @pytest.mark.parametrize("faults", [0, 1, 2])
    def test_invariants_hold_with_the_trainer_step_in_a_scope(self, faults):
        """Exclusion, freshness, valid weights, progress, and no pause inside the scope, with hook failures
        anywhere, the scope's final sleep included."""
        report = explore(steps=3, save_every=2, faults=faults, held=True)
        assert report.violations == [] and report.deadlocks == 0
        assert report.completed >= 1
        assert report.states > explore(steps=3, save_every=2, faults=faults).states  # the scope's own steps

    def test_a_scope_released_after_the_sync_breaks_exclusion(self):
        """A driver that signals the rollout while still holding the trainer awake is caught."""
        report = explore(steps=2, broken="release_after_sync")
        assert any(v.startswith("exclusion: trainer AWAKE") for v in report.violations), report.violations

"""Every interleaving of a trainer and a rollout machine on one slot keeps exclusion, freshness, progress."""

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

    def test_serving_before_the_sync_breaks_freshness(self):
        report = explore(steps=2, broken=BROKEN[1])
        assert any(
            v.startswith("freshness: rollout generates with weights v0 while the trainer has v1")
            for v in report.violations
        ), report.violations

    def test_unknown_breakage_is_refused(self):
        with pytest.raises(ValueError, match="broken must be one of"):
            explore(broken="nope")

"""`EngineGeneration`'s pause modes: SGLang's three, and AReaL's two-step pause (abort, then in_place)."""

import pytest

from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout import EngineGeneration, ReferenceEngine
from actor_integration.rollout.engine import ABORT_THEN_IN_PLACE, GENERATION_MODES, PAUSE_MODES

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


class TestPauseModes:
    def test_the_two_step_pause_sends_abort_then_in_place_then_flushes(self):
        """ABORT_THEN_IN_PLACE: the abort drains, the in_place pause holds the scheduler, then the flush."""
        engine = ReferenceEngine(CONFIG)
        EngineGeneration(engine, mode=ABORT_THEN_IN_PLACE).pause()
        assert engine.calls[:3] == ["pause_generation(abort)", "pause_generation(in_place)", "flush_cache"]

    @pytest.mark.parametrize("mode", GENERATION_MODES)
    def test_sglangs_own_modes_send_one_pause(self, mode):
        """Each of SGLang's modes is one pause_generation(mode), as before."""
        engine = ReferenceEngine(CONFIG)
        EngineGeneration(engine, mode=mode).pause()
        assert engine.calls[:2] == [f"pause_generation({mode})", "flush_cache"]

    def test_the_two_step_mode_is_not_an_sglang_mode(self):
        """The engines' own pause_generation takes SGLang's modes only: the two-step mode is EngineGeneration's."""
        assert ABORT_THEN_IN_PLACE in PAUSE_MODES and ABORT_THEN_IN_PLACE not in GENERATION_MODES
        with pytest.raises(ValueError, match="mode must be one of"):
            ReferenceEngine(CONFIG).pause_generation(ABORT_THEN_IN_PLACE)

    def test_an_unknown_mode_is_refused_naming_the_modes(self):
        """A typo is refused at construction, listing every mode EngineGeneration takes."""
        with pytest.raises(ValueError, match="abort_then_in_place"):
            EngineGeneration(ReferenceEngine(CONFIG), mode="abort_in_place")


class TestPauseInRelease:
    """An engine whose release pauses itself (vLLM's sleep): the sleep's pause sends nothing."""

    class _SleepPauses(ReferenceEngine):
        def pause_with_release(self) -> None:
            self.calls.append("pause_with_release")

    def test_the_pause_tells_the_engine_and_sends_no_pause_or_flush(self):
        engine = self._SleepPauses(CONFIG)
        dropped = []
        EngineGeneration(engine, pause_in_release=True, on_pause=lambda: dropped.append(1)).pause()
        assert engine.calls == ["pause_with_release"] and dropped == [1]  # the rollout's handles still drop

    @pytest.mark.parametrize("mode", ["in_place", "retract", ABORT_THEN_IN_PLACE])
    def test_only_in_abort_mode(self, mode):
        """A release pauses in abort mode: a pause that keeps requests cannot be folded into it."""
        with pytest.raises(ValueError, match="pause_in_release needs mode 'abort'"):
            EngineGeneration(self._SleepPauses(CONFIG), mode=mode, pause_in_release=True)

    def test_only_for_an_engine_that_can(self):
        with pytest.raises(ValueError, match="an engine with pause_with_release"):
            EngineGeneration(ReferenceEngine(CONFIG), pause_in_release=True)

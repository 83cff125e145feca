"""A flush that reports the engine busy (FIELD.md #2, sglang #31962): retried within a deadline,
then EngineNotIdleError, and the sleep plan never releases memory under live requests."""

import threading

import pytest

from actor_integration.errors import EngineNotIdleError
from actor_integration.models.tiny import TinyLMConfig
from actor_integration.rollout import ROLLOUT_POLICY, EngineGeneration, ReferenceEngine, RolloutActor
from actor_integration.rollout import engine as engine_module
from actor_integration.rollout.engine import QueryableEngineMemory
from lifecycle import Hooks, Lifecycle, Residency, State
from lifecycle.errors import LifecycleError

CONFIG = TinyLMConfig(vocab_size=53, dim=16, n_layers=2, n_heads=4, max_seq_len=24, seed=1)


class FakeClock:
    """Time that passes only when slept; refuses to spin forever (a retry with no deadline)."""

    def __init__(self, max_sleeps=10_000):
        self.now = 100.0
        self.sleeps = []
        self.max_sleeps = max_sleeps

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        if len(self.sleeps) >= self.max_sleeps:
            raise AssertionError(
                f"slept {len(self.sleeps)} times without giving up: the retry has no deadline"
            )
        self.sleeps.append(seconds)
        self.now += seconds


class DrainingEngine(ReferenceEngine):
    """A reference engine with requests queued for the next `busy` flushes (None: never drains)."""

    def __init__(self, busy):
        super().__init__(CONFIG)
        self.busy = busy

    def flush_cache(self):
        if self.busy is None or self.busy > 0:
            self.calls.append("flush_cache")
            if self.busy is not None:
                self.busy -= 1
            return False
        return super().flush_cache()

    def queued_requests(self):
        return {"running": 0, "waiting": 3 if self.busy is None or self.busy > 0 else 0}


def rollout_lifecycle(engine, clock, *, deadline=5.0, mode="retract"):
    generation = EngineGeneration(
        engine, mode=mode, flush_deadline_s=deadline, flush_backoff_s=0.05, clock=clock
    )
    return Lifecycle(
        ROLLOUT_POLICY, Hooks(memory=QueryableEngineMemory(engine), generation=generation), role="rollout"
    )


def releases(engine):
    return [call for call in engine.calls if call.startswith("release_memory_occupation")]


class TestFlushRetry:
    def test_a_flush_refused_until_the_queue_drains_is_retried_and_the_sleep_completes(self):
        """Requests that drain within the deadline: the flush is retried, then memory is released."""
        engine, clock = DrainingEngine(busy=3), FakeClock()
        lc = rollout_lifecycle(engine, clock)
        lc.sleep()
        assert lc.state is State.PAUSED
        assert engine.residency == {"weights": False, "kv_cache": False}
        assert engine.calls[:5] == ["pause_generation(retract)", *["flush_cache"] * 4]
        assert len(clock.sleeps) == 3

    def test_waits_back_off_and_end_exactly_at_the_deadline(self):
        """The waits grow and their sum stops at the deadline, not past it."""
        engine, clock = DrainingEngine(busy=None), FakeClock()
        lc = rollout_lifecycle(engine, clock, deadline=2.0)
        with pytest.raises(EngineNotIdleError):
            lc.sleep()
        assert clock.sleeps[:4] == [0.05, 0.1, 0.2, 0.4]
        assert max(clock.sleeps) <= 1.0 and sum(clock.sleeps) == pytest.approx(2.0)

    def test_a_zero_deadline_tries_once(self):
        """flush_deadline_s=0: one flush, no wait."""
        engine, clock = DrainingEngine(busy=None), FakeClock()
        with pytest.raises(EngineNotIdleError) as raised:
            rollout_lifecycle(engine, clock, deadline=0).sleep()
        assert raised.value.attempts == 1 and clock.sleeps == []

    def test_the_deadline_and_backoff_are_checked_at_construction(self):
        """A negative deadline or a non-positive backoff is refused with what was given."""
        with pytest.raises(ValueError, match="flush_deadline_s must be >= 0"):
            EngineGeneration(ReferenceEngine(CONFIG), flush_deadline_s=-1)
        with pytest.raises(ValueError, match="flush_backoff_s > 0"):
            EngineGeneration(ReferenceEngine(CONFIG), flush_backoff_s=0)


class TestNotIdle:
    def test_a_flush_still_refused_at_the_deadline_fails_the_sleep_with_memory_resident(self):
        """EngineNotIdleError names the queue; the machine is FAILED and nothing was released."""
        engine, clock = DrainingEngine(busy=None), FakeClock()
        lc = rollout_lifecycle(engine, clock)
        with pytest.raises(EngineNotIdleError) as raised:
            lc.sleep()
        error = raised.value
        assert isinstance(error, LifecycleError)
        assert error.queued == {"running": 0, "waiting": 3} and error.mode == "retract"
        assert error.waited_s == pytest.approx(5.0) and error.attempts > 1
        assert "'waiting': 3" in str(error) and "recover(target=State.PAUSED)" in str(error)
        assert lc.state is State.FAILED and lc.failure.hook == "generation.pause"
        assert lc.residency == {"weights": Residency.RESIDENT, "kv_cache": Residency.RESIDENT}
        assert engine.residency == {"weights": True, "kv_cache": True} and releases(engine) == []

    def test_recover_sleeps_once_the_requests_have_drained(self):
        """After the queue drains, recover(target=PAUSED) pauses, flushes and releases."""
        engine, clock = DrainingEngine(busy=None), FakeClock()
        lc = rollout_lifecycle(engine, clock)
        with pytest.raises(EngineNotIdleError):
            lc.sleep()
        engine.busy = 0
        lc.recover(State.PAUSED)
        assert lc.state is State.PAUSED and engine.residency == {"weights": False, "kv_cache": False}

    def test_an_engine_that_cannot_report_its_queue_says_so(self):
        """Without queued_requests the error says the engine cannot tell what is queued."""

        class Opaque(DrainingEngine):
            queued_requests = None  # type: ignore[assignment]

        engine, clock = Opaque(busy=None), FakeClock()
        with pytest.raises(EngineNotIdleError, match="cannot say what is queued") as raised:
            rollout_lifecycle(engine, clock, deadline=0).sleep()
        assert raised.value.queued is None

    def test_the_error_crosses_processes_with_its_fields(self):
        """Ray ships exceptions by pickling: the fields survive."""
        import pickle

        engine, clock = DrainingEngine(busy=None), FakeClock()
        with pytest.raises(EngineNotIdleError) as raised:
            rollout_lifecycle(engine, clock, deadline=0).sleep()
        copy = pickle.loads(pickle.dumps(raised.value))
        assert copy.queued == raised.value.queued and str(copy) == str(raised.value)


class TestReferenceEngine:
    """The reference engine refuses a flush while a generation runs, as SGLang does."""

    @pytest.fixture
    def in_flight(self):
        """A reference engine with one generation held inside the model, served outside the actor
        (as SGLang serves HTTP clients); the generation finishes when the fixture ends."""
        engine = ReferenceEngine(CONFIG)
        entered, release = threading.Event(), threading.Event()
        model_generate = engine.models[0].generate

        def held(*args, **kwargs):
            entered.set()
            release.wait(timeout=60)
            return model_generate(*args, **kwargs)

        engine.models[0].generate = held
        thread = threading.Thread(target=engine.generate, args=([[1, 2]],), kwargs={"max_new_tokens": 2})
        thread.start()
        assert entered.wait(timeout=60)

        def finish():
            release.set()
            thread.join(timeout=60)

        engine.finish = finish
        yield engine
        finish()

    def test_a_flush_during_a_generation_reports_not_idle_and_the_running_request(self, in_flight):
        """flush_cache answers False and queued_requests counts the running generation."""
        assert in_flight.flush_cache() is False
        assert in_flight.queued_requests() == {"running": 1, "waiting": 0}

    def test_an_idle_engine_flushes(self):
        """flush_cache answers True when nothing runs."""
        engine = ReferenceEngine(CONFIG)
        assert engine.flush_cache() is True and engine.queued_requests() == {"running": 0, "waiting": 0}

    def test_the_rollout_actor_fails_its_sleep_with_memory_resident(self, in_flight, monkeypatch):
        """Through RolloutActor: the sleep fails before any release; after the generation ends,
        recovery sleeps."""
        monkeypatch.setattr(engine_module, "FLUSH_DEADLINE_S", 0.0)  # one attempt: no waiting in tests
        actor = RolloutActor(in_flight, generation_mode="retract")
        with pytest.raises(EngineNotIdleError, match=r"'running': 1"):
            actor.sleep()
        snapshot = actor.lifecycle_state()
        assert actor.lifecycle.state is State.FAILED
        assert actor.lifecycle.residency == {"weights": Residency.RESIDENT, "kv_cache": Residency.RESIDENT}
        assert in_flight.residency == {"weights": True, "kv_cache": True} and releases(in_flight) == []
        assert snapshot["state"] == "FAILED"
        in_flight.finish()
        actor.lifecycle_recover("PAUSED")
        assert actor.lifecycle.state is State.PAUSED and in_flight.residency == {
            "weights": False,
            "kv_cache": False,
        }

"""16 threads x 1,000 random calls on one machine: hook sequences never interleave, state matches residency."""

import random
import threading

from lifecycle import IllegalTransitionError, LifecyclePolicy, Residency, State, capture_events
from lifecycle.testing import recording_lifecycle
from tests.helpers.bodies import make_body

THREADS, CALLS = 16, 1000


def test_threads_never_interleave_hooks():
    lc, rec = recording_lifecycle(
        LifecyclePolicy(offload_train=True, use_routing_replay=True, memory_tags=("weights", "kv_cache"))
    )
    errors: list[BaseException] = []
    observed: list[tuple[State, dict]] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(CALLS):
                op = rng.choice(["sleep", "wake", "wake_weights", "train", "save", "sync", "generate"])
                try:
                    if op == "sleep":
                        lc.sleep()
                    elif op == "wake":
                        lc.wake_up()
                    elif op == "wake_weights":
                        lc.wake_up(tags=["weights"])
                    else:
                        lc.run(op, make_body(rec, lc, op))
                except IllegalTransitionError:
                    pass  # e.g. generate while PAUSED: refused, nothing ran
                with lc._lock:  # a consistent snapshot between operations
                    observed.append((lc.state, lc.residency))
        except BaseException as exc:  # a ProtocolViolation from a fake, or anything unexpected
            errors.append(exc)

    with capture_events() as events:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert len(observed) == THREADS * CALLS
    for state, residency in observed:
        resident = [r is Residency.RESIDENT for r in residency.values()]
        assert (state is State.AWAKE and all(resident)) or (state is State.PAUSED and not all(resident))
    # The hooks each event logs, concatenated in event order, are exactly the calls the backends saw.
    logged = []
    for event in events:
        if event["event"] in ("lifecycle.transition", "lifecycle.failed"):
            logged += [h["name"] + (f"[{h['tag']}]" if "tag" in h else "") for h in event["hooks"]]
    made = [c for c in rec.log.names() if not c.startswith(("body.", "memory.disable"))]
    made = [c.replace("switch_model[actor]", "switch_model") for c in made]
    assert logged == made
    assert sum(e["event"] == "lifecycle.transition" for e in events) > 1000

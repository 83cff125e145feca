"""A failure injected at every hook call of every plan, before and after its effect.

After each one the machine is FAILED with the exact residency, nothing else ran (but, where the
plan runs a stage's hooks together, the rest of that stage), and `recover` reaches both AWAKE and
PAUSED without a protocol violation (the fakes raise where TMS would exit). Rows of a held scope
are included: the first wake inside it, and the release of the last hold, whose sleep fails like
any other.
"""

import itertools

import pytest

from lifecycle import LifecycleFailedError, LifecyclePolicy, Residency, State
from lifecycle.table import PLANS, TABLE, Groups, Hook, Row
from lifecycle.testing import InjectedFault, recording_lifecycle
from tests.helpers.bodies import make_body

TAGS = ("weights", "kv_cache")


def _policy(row: Row) -> LifecyclePolicy:
    offload = row.when.name in ("OFFLOAD", "AUTO_WAKE_OFFLOAD")
    return LifecyclePolicy(
        offload_train=offload, use_routing_replay=True, memory_tags=TAGS, sync_requires=("weights",)
    )


def _setup(row: Row, lc) -> None:
    """Bring the machine to the row's source state, with the residency its guard needs."""
    if row.source is State.PAUSED:
        lc.sleep()
        if row.when.name in ("SOME_RESIDENT", "SYNC_TAGS_RESIDENT") or row.operation == "release":
            lc.wake_up(tags=["weights"])
    if row.held:
        lc.hold()
    if row.operation == "release":
        lc.sleep()  # deferred: the release sleeps it


def _operate(row: Row, lc, rec) -> None:
    if row.operation == "release":
        lc.release()
    elif row.operation == "sleep":
        lc.sleep()
    elif row.operation == "wake_up":
        lc.wake_up(tags=["weights"] if row.when.name == "PARTIAL" else None)
    else:
        lc.run(row.operation, make_body(rec, lc, row.operation))


def _calls(row: Row) -> list[str]:
    """The hook calls the row makes, in plan order, found by running it once without a fault."""
    lc, rec = recording_lifecycle(_policy(row), generation=True)
    _setup(row, lc)
    rec.log.clear()
    _operate(row, lc, rec)
    return [c for c in rec.log.names() if not c.startswith(("body.", "memory.disable"))]


def _together(hook: str) -> set[str]:
    """The hooks a plan runs in the same stage as `hook`."""
    return {h.value for p in PLANS for st in p.stages if Hook(hook) in st for h in st} - {hook}


def _made_with(calls: list[str], index: int) -> list[str]:
    """The calls made when calls[index] fails while the rest of its stage runs together.

    In plan order the stage's calls are contiguous: its other branches' calls before and after
    the failing one run; its own branch stops at the failure.
    """
    hook = calls[index].split("[")[0]
    partners = _together(hook)
    made = calls[: index + 1]
    for call in calls[index + 1 :]:
        name = call.split("[")[0]
        if name not in partners and name != hook:
            break
        if name in partners:
            made.append(call)
    return made


CASES = [
    (row, index, after, target, overlap)
    for row in TABLE
    if not row.noop and row.operation != "recover"
    for index, call in enumerate(_calls(row))
    for after, target in itertools.product((False, True), (State.AWAKE, State.PAUSED))
    for overlap in ((False, True) if _together(call.split("[")[0]) else (False,))
]


def test_there_are_enough_cases():
    assert len({(id(r), i) for r, i, _, _, _ in CASES}) >= 50
    assert len([c for c in CASES if c[4]]) >= 40  # failures inside stages that run together


@pytest.mark.parametrize(
    ("row", "index", "after", "target", "overlap"),
    CASES,
    ids=[
        f"{r.operation}-{r.source}>{r.dest}-{r.when.name}-call{i}-{'after' if a else 'before'}-to-{t}"
        + ("-together" if o else "")
        for r, i, a, t, o in CASES
    ],
)
def test_failure_at_every_hook_call(row, index, after, target, overlap):
    calls = _calls(row)
    failing = calls[index]
    hook = failing.split("[")[0]
    lc, rec = recording_lifecycle(_policy(row), generation=True, overlap=overlap)
    _setup(row, lc)
    # The injector counts calls per hook name: fail the one at this position.
    same_hook = [c for c in calls[: index + 1] if c.split("[")[0] == hook]
    rec.faults.arm(Hook(hook), at=len(same_hook), after_effect=after)
    rec.log.clear()
    with pytest.raises(InjectedFault):
        _operate(row, lc, rec)
    made = [c for c in rec.log.names() if not c.startswith(("body.", "memory.disable"))]
    if overlap:
        assert sorted(made) == sorted(_made_with(calls, index)), "the failing stage finished, nothing after"
    else:
        assert made == calls[: index + 1], "nothing after the failing hook ran"
    assert lc.state is State.FAILED and lc.failure is not None and lc.failure.hook == hook

    # Exact residency: the failed resource is unknown, everything else is what the backends hold.
    for tag, known in lc.residency.items():
        if failing in (f"memory.pause[{tag}]", f"memory.resume[{tag}]"):
            assert known is Residency.UNKNOWN
        else:
            assert (known is Residency.RELEASED) == rec.memory.paused[tag]
    if hook.startswith("process_groups"):
        assert lc.groups is Groups.UNKNOWN
    else:
        assert (lc.groups is Groups.ALIVE) == rec.process_groups.alive

    with pytest.raises(LifecycleFailedError):
        lc.sleep()  # nothing runs while FAILED
    if row.held and row.operation != "release":
        lc.release()  # gives the hold back on FAILED, runs nothing
    assert lc.holds == 0
    lc.recover(target)
    assert lc.state is target
    resident = not any(rec.memory.paused.values())
    assert resident if target is State.AWAKE else not resident
    assert all((r is Residency.RESIDENT) == resident for r in lc.residency.values())
    # The machine works normally afterwards.
    lc.wake_up()
    lc.run("train", make_body(rec, lc, "train"))
    lc.sleep()
    assert lc.state is State.PAUSED

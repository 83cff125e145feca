"""`side_by_side.alternate`: the order of the cycles, the medians, the totals, and its refusals."""

from __future__ import annotations

import pytest

from tests.helpers.side_by_side import alternate


def sides(log: list[str]) -> tuple:
    def own(i: int) -> dict[str, float]:
        log.append(f"own{i}")
        return {"a": 10.0 + i, "b": 1.0}

    def wrapped(i: int) -> dict[str, float]:
        log.append(f"wrapped{i}")
        return {"a": 12.0 + i, "b": 2.0}

    return own, wrapped


@pytest.mark.parametrize(
    ("cycles", "order"),
    [
        (2, ["wrapped", "own", "own", "wrapped"]),
        (3, ["own", "wrapped", "wrapped", "own", "own", "wrapped"]),
    ],
)
def test_the_pairs_first_alternates_and_the_wrapped_cycle_is_last(cycles: int, order: list[str]) -> None:
    log: list[str] = []
    figures = alternate(*sides(log), cycles, totals={"ab": ("a", "b")})
    assert figures["order"] == order
    assert [entry.rstrip("0123456789") for entry in log] == order
    assert log[-1] == f"wrapped{cycles - 1}"


def test_medians_leave_out_each_sides_first_cycle_and_totals_are_summed_per_cycle() -> None:
    figures = alternate(*sides([]), 4, totals={"ab": ("a", "b")})
    assert figures["own"] == {"a": 12.0, "b": 1.0, "ab": 13.0}  # cycles 1..3: a = 11, 12, 13
    assert figures["wrapped"] == {"a": 14.0, "b": 2.0, "ab": 16.0}
    assert figures["wrapped_minus_own_ab"] == 3.0
    assert [row["a"] for row in figures["rows"]["own"]] == [10.0, 11.0, 12.0, 13.0]
    assert figures["cycles"] == 4


def test_refuses_one_cycle_and_a_total_over_a_phase_a_side_does_not_give() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        alternate(*sides([]), 1, totals={})
    with pytest.raises(KeyError, match=r"no \['c'\] for 'ac'"):
        alternate(*sides([]), 2, totals={"ac": ("a", "c")})

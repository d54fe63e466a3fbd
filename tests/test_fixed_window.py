"""Fixed window counter on a fake clock: expected values worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.clock import FakeClock

S = 1_000_000  # microseconds per second
# 2520 s is a multiple of every window length used here (1..10 s): tests start on a boundary.
START_US = 2520 * S


def test_limit_per_window_then_reset_at_the_boundary() -> None:
    algo = FixedWindow(3, 10)
    clock = FakeClock(START_US)
    state = None
    remaining = []
    for _ in range(3):
        decision, state = algo.decide(state, clock.now_us())
        assert decision.allowed
        remaining.append(decision.remaining)
        clock.advance(1)
    assert remaining == [2, 1, 0]
    # Three used at +0, +1, +2 s; at +3 s the window [+0, +10) still has 7 s to go.
    decision, rejected_state = algo.decide(state, clock.now_us())
    assert not decision.allowed
    assert rejected_state is state
    assert decision.retry_after_s == pytest.approx(7.0)
    assert decision.reset_s == pytest.approx(7.0)
    assert (decision.limit, decision.remaining) == (3, 0)
    clock.set(START_US + 10 * S - 1)
    decision, _ = algo.decide(state, clock.now_us())
    assert not decision.allowed
    assert decision.retry_after_s == pytest.approx(1e-6)
    clock.set(START_US + 10 * S)
    decision, state = algo.decide(state, clock.now_us())
    assert decision.allowed
    assert decision.remaining == 2
    assert decision.reset_s == pytest.approx(10.0)


def test_edge_burst_is_twice_the_limit_across_a_boundary() -> None:
    """The documented weakness: limit at the end of one window, limit again at the start of the
    next, 2 * limit within 0.2 s."""
    algo = FixedWindow(3, 10)
    state = None
    admitted = 0
    for now_us in [START_US + 9_900_000] * 4 + [START_US + 10_100_000] * 4:
        decision, state = algo.decide(state, now_us)
        admitted += decision.allowed
    assert admitted == 6


def test_costs_count_as_units_all_or_nothing() -> None:
    algo = FixedWindow(10, 60)
    state = None
    decision, state = algo.decide(state, START_US, cost=4)
    assert (decision.allowed, decision.remaining) == (True, 6)
    decision, state = algo.decide(state, START_US, cost=4)
    assert (decision.allowed, decision.remaining) == (True, 2)
    decision, same = algo.decide(state, START_US, cost=4)  # 8 + 4 > 10
    assert not decision.allowed and same is state
    assert decision.remaining == 2
    decision, state = algo.decide(state, START_US, cost=2)
    assert (decision.allowed, decision.remaining) == (True, 0)


def test_cost_above_limit_can_never_pass() -> None:
    decision, state = FixedWindow(5, 1).decide(None, START_US, cost=6)
    assert not decision.allowed
    assert state is None
    assert decision.retry_after_s == math.inf
    assert decision.remaining == 5


def test_clock_stepping_back_keeps_counting_in_the_newer_window() -> None:
    algo = FixedWindow(2, 10)
    _, state = algo.decide(None, START_US + 15 * S)  # window [+10, +20)
    _, state = algo.decide(state, START_US + 15 * S)
    decision, _ = algo.decide(state, START_US + 5 * S)  # back into [+0, +10)
    assert not decision.allowed
    assert decision.retry_after_s == pytest.approx(15.0)  # until +20 s


def test_idle_once_the_window_is_over() -> None:
    algo = FixedWindow(2, 10)
    _, state = algo.decide(None, START_US + 3 * S)
    assert state is not None
    assert not algo.is_idle(state, START_US + 10 * S - 1)
    assert algo.is_idle(state, START_US + 10 * S)


def test_refund_is_exact_with_the_charge_time_and_a_no_op_without() -> None:
    algo = FixedWindow(2, 10)
    _, state = algo.decide(None, START_US + 1 * S)
    _, state = algo.decide(state, START_US + 2 * S)
    assert state is not None
    assert algo.refund(state, START_US + 3 * S) == state
    refunded = algo.refund(state, START_US + 3 * S, charged_us=START_US + 2 * S)
    assert algo.unpack_state(refunded) == (START_US // (10 * S), 1)
    assert algo.decide(refunded, START_US + 3 * S)[0].allowed
    # Charged in the previous window: the current window owes it nothing.
    _, later = algo.decide(None, START_US + 12 * S)
    assert later is not None
    assert algo.refund(later, START_US + 13 * S, charged_us=START_US + 9 * S) == later


def test_rescale_keeps_the_share_used() -> None:
    old = FixedWindow(10, 10)
    state = None
    for _ in range(4):
        _, state = old.decide(state, START_US)
    assert state is not None
    doubled = FixedWindow(20, 10)
    assert doubled.unpack_state(doubled.rescale(state, old, START_US + S) or 0)[1] == 8
    third = FixedWindow(3, 10)  # 4/10 of 3 is 1.2: rounded up to 2
    assert third.unpack_state(third.rescale(state, old, START_US + S) or 0)[1] == 2
    longer = FixedWindow(10, 60)
    rescaled = longer.rescale(state, old, START_US + S)
    assert rescaled is not None
    assert longer.unpack_state(rescaled) == ((START_US + S) // (60 * S), 4)
    assert doubled.rescale(state, old, START_US + 10 * S) is None  # window over: start afresh
    assert doubled.rescale(state, SlidingWindow(10, 10), START_US) is None


@pytest.mark.parametrize(
    ("limit", "window_s"), [(0, 1), (-1, 1), (False, 1), (1, 0), (1, -2), (1, 1e-9)]
)
def test_rejects_impossible_parameters(limit: int, window_s: float) -> None:
    with pytest.raises(ValueError):
        FixedWindow(limit, window_s)


@pytest.mark.parametrize(("limit", "window_s"), [(1.5, 1), ("1", 1), (1, "1")])
def test_rejects_parameters_of_the_wrong_type_alike_in_both_builds(
    limit: object, window_s: object
) -> None:
    """The compiled build's typed arguments refuse a float for an int with ``TypeError``; the
    pure build refuses it with the same exception."""
    with pytest.raises(TypeError):
        FixedWindow(limit, window_s)  # type: ignore[arg-type]


def test_rejects_cost_below_one() -> None:
    with pytest.raises(ValueError):
        FixedWindow(1, 1).decide(None, START_US, cost=0)


arrivals = st.lists(st.tuples(st.integers(0, 3 * S), st.integers(1, 4)), min_size=1, max_size=200)


@settings(deadline=None)
@given(limit=st.integers(1, 20), window_s=st.integers(1, 5), steps=arrivals)
def test_never_more_than_limit_in_an_aligned_window(
    limit: int, window_s: int, steps: list[tuple[int, int]]
) -> None:
    algo = FixedWindow(limit, window_s)
    window_us = window_s * S
    now_us = START_US
    state = None
    per_window: dict[int, int] = {}
    for gap_us, cost in steps:
        now_us += gap_us
        before = state
        decision, state = algo.decide(state, now_us, cost)
        if decision.allowed:
            per_window[now_us // window_us] = per_window.get(now_us // window_us, 0) + cost
            assert decision.remaining == limit - per_window[now_us // window_us]
        else:
            assert state is before  # a rejection charges nothing
            assert decision.retry_after_s > 0
    assert all(count <= limit for count in per_window.values())


@settings(deadline=None)
@given(
    limit=st.integers(1, 50),
    window_s=st.integers(1, 10),
    overload=st.integers(2, 5),
    windows=st.integers(20, 40),
)
def test_long_run_rate_under_saturation_is_the_configured_rate(
    limit: int, window_s: int, overload: int, windows: int
) -> None:
    algo = FixedWindow(limit, window_s)
    gap_us = window_s * S // (limit * overload)
    state = None
    admitted = 0
    now_us = START_US
    while now_us < START_US + windows * window_s * S:
        decision, state = algo.decide(state, now_us)
        admitted += decision.allowed
        now_us += gap_us
    # Arrivals at `overload` times the rate fill every window: limit per window, exactly.
    assert admitted == limit * windows


@given(now_us=st.integers(0, 10**15), cost=st.integers(1, 5))
def test_decide_is_pure(now_us: int, cost: int) -> None:
    algo = FixedWindow(5, 2)
    _, state = algo.decide(None, now_us)
    assert state is not None
    snapshot = int(state)
    first = algo.decide(state, now_us + 1, cost)
    second = algo.decide(state, now_us + 1, cost)
    assert first == second
    assert state == snapshot

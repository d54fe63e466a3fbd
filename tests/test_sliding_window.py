"""Sliding window counter on a fake clock: expected values worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_window import SlidingWindow

S = 1_000_000
START_US = 2520 * S  # a multiple of every window length used here (1..10 s)


def _admit(algo: SlidingWindow, state: int | None, now_us: int, times: int) -> int | None:
    for _ in range(times):
        decision, state = algo.decide(state, now_us)
        assert decision.allowed
    return state


def test_previous_window_weighted_by_its_share_still_inside() -> None:
    algo = SlidingWindow(10, 10)
    state = _admit(algo, None, START_US - 5 * S, 6)  # previous window [-10, 0): 6 requests
    now_us = START_US + 2_500_000
    # At +2.5 s, 7.5 s of the previous window is still inside: 6 * 0.75 = 4.5, rounded down 4.
    # So 4 + current + 1 <= 10 admits current = 0..5: six requests, remaining 5 down to 0.
    remaining = []
    for _ in range(6):
        decision, state = algo.decide(state, now_us)
        assert decision.allowed
        remaining.append(decision.remaining)
        assert decision.reset_s == pytest.approx(17.5)  # current slides out at +20 s
    assert remaining == [5, 4, 3, 2, 1, 0]
    decision, same = algo.decide(state, now_us)
    assert not decision.allowed and same is state
    # Admitted once floor(6 * weight / 10 s) <= 3, i.e. weight <= 6_666_666 us, at
    # +3_333_334 us: 0.833334 s from now. One microsecond earlier the weight is 6_666_667 us
    # and 6 * 6.666667 / 10 = 4.0000002 rounds down to 4.
    assert decision.retry_after_s == pytest.approx(0.833334)
    assert not algo.decide(state, START_US + 3_333_333)[0].allowed
    assert algo.decide(state, START_US + 3_333_334)[0].allowed


def test_full_current_window_waits_for_the_next_one() -> None:
    algo = SlidingWindow(3, 10)
    state = _admit(algo, None, START_US + S, 3)
    decision, _ = algo.decide(state, START_US + 2 * S)
    assert not decision.allowed
    # Next window: previous = 3, so floor(3 * weight / 10 s) + 1 <= 3 needs weight <= 9_999_999
    # us: 1 us after the boundary, 8.000001 s from now.
    assert decision.retry_after_s == pytest.approx(8.000001)
    assert not algo.decide(state, START_US + 10 * S)[0].allowed
    assert algo.decide(state, START_US + 10 * S + 1)[0].allowed


def test_no_double_burst_at_the_boundary_unlike_a_fixed_window() -> None:
    sliding, fixed = SlidingWindow(5, 10), FixedWindow(5, 10)
    sliding_state = _admit(sliding, None, START_US - 1, 5)
    fixed_state = None
    for _ in range(5):
        _, fixed_state = fixed.decide(fixed_state, START_US - 1)
    assert not sliding.decide(sliding_state, START_US)[0].allowed
    assert fixed.decide(fixed_state, START_US)[0].allowed


def test_saturated_small_limit_gets_its_full_rate() -> None:
    """limit 1 per 10 s, a request every second for 100 s: one per window, ten in all (the
    unrounded comparison would admit one every other window)."""
    algo = SlidingWindow(1, 10)
    state = None
    admitted = 0
    for second in range(100):
        decision, state = algo.decide(state, START_US + second * S + 1)
        admitted += decision.allowed
    assert admitted == 10


def test_costs_and_impossible_cost() -> None:
    algo = SlidingWindow(10, 60)
    decision, state = algo.decide(None, START_US, cost=7)
    assert (decision.allowed, decision.remaining) == (True, 3)
    decision, same = algo.decide(state, START_US, cost=4)
    assert not decision.allowed and same is state
    assert decision.remaining == 3
    decision, _ = algo.decide(state, START_US, cost=11)
    assert decision.retry_after_s == math.inf


def test_idle_after_the_counts_slide_out() -> None:
    algo = SlidingWindow(4, 10)
    state = _admit(algo, None, START_US + S, 1)
    assert state is not None
    assert not algo.is_idle(state, START_US + 19 * S)  # still weighted in [+10, +20)
    assert algo.is_idle(state, START_US + 20 * S)


def test_refund_takes_the_cost_off_the_window_it_was_counted_in() -> None:
    algo = SlidingWindow(4, 10)
    state = _admit(algo, None, START_US + 5 * S, 2)
    state = _admit(algo, state, START_US + 12 * S, 1)
    assert state is not None
    assert algo.unpack_state(state) == (START_US // (10 * S) + 1, 2, 1)
    assert algo.refund(state, START_US + 13 * S) == state  # charge time unknown: no-op
    from_previous = algo.refund(state, START_US + 13 * S, charged_us=START_US + 5 * S)
    assert algo.unpack_state(from_previous) == (START_US // (10 * S) + 1, 1, 1)
    from_current = algo.refund(state, START_US + 13 * S, charged_us=START_US + 12 * S)
    assert algo.unpack_state(from_current) == (START_US // (10 * S) + 1, 2, 0)
    assert algo.refund(state, START_US + 13 * S, charged_us=START_US - 5 * S) == state


def test_rescale() -> None:
    old = SlidingWindow(10, 10)
    state = _admit(old, None, START_US - 5 * S, 6)
    state = _admit(old, state, START_US + 5 * S, 2)
    assert state is not None
    index = START_US // (10 * S)
    half = SlidingWindow(5, 10)
    assert half.unpack_state(half.rescale(state, old, START_US + 5 * S) or 0) == (index, 3, 1)
    longer = SlidingWindow(10, 20)
    # At +5 s: 6 * 5/10 + 2 = 5 of 10 used; the new 20 s window holding now starts at +0 s.
    assert longer.unpack_state(longer.rescale(state, old, START_US + 5 * S) or 0) == (
        START_US // (20 * S),
        0,
        5,
    )
    assert half.rescale(state, old, START_US + 20 * S) is None
    assert half.rescale(state, FixedWindow(10, 10), START_US) is None


def test_clock_stepping_back_counts_in_the_newer_window() -> None:
    algo = SlidingWindow(2, 10)
    state = _admit(algo, None, START_US + 15 * S, 2)
    assert not algo.decide(state, START_US + 5 * S)[0].allowed


arrivals = st.lists(st.tuples(st.integers(0, 3 * S), st.integers(1, 4)), min_size=1, max_size=200)


@settings(deadline=None)
@given(limit=st.integers(1, 20), window_s=st.integers(1, 5), steps=arrivals)
def test_never_more_than_limit_per_aligned_window_or_instant(
    limit: int, window_s: int, steps: list[tuple[int, int]]
) -> None:
    algo = SlidingWindow(limit, window_s)
    window_us = window_s * S
    now_us = START_US
    state = None
    per_window: dict[int, int] = {}
    per_instant: dict[int, int] = {}
    for gap_us, cost in steps:
        now_us += gap_us
        before = state
        decision, state = algo.decide(state, now_us, cost)
        if decision.allowed:
            index = now_us // window_us
            per_window[index] = per_window.get(index, 0) + cost
            per_instant[now_us] = per_instant.get(now_us, 0) + cost
        else:
            assert state is before
            assert decision.retry_after_s > 0
            # The retry-after is exact: one microsecond earlier is still too early.
            if decision.retry_after_s != math.inf:
                retry_at = now_us + round(decision.retry_after_s * S)
                assert not algo.decide(state, retry_at - 1, cost)[0].allowed
                assert algo.decide(state, retry_at, cost)[0].allowed
    assert all(count <= limit for count in per_window.values())
    assert all(count <= limit for count in per_instant.values())


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
    algo = SlidingWindow(limit, window_s)
    gap_us = window_s * S // (limit * overload) + 7  # not in step with the windows
    state = None
    admitted = 0
    now_us = START_US
    while now_us < START_US + windows * window_s * S:
        decision, state = algo.decide(state, now_us)
        admitted += decision.allowed
        now_us += gap_us
    assert limit * (windows - 1) <= admitted <= limit * windows


@given(now_us=st.integers(0, 10**15), cost=st.integers(1, 5))
def test_decide_is_pure(now_us: int, cost: int) -> None:
    algo = SlidingWindow(5, 2)
    _, state = algo.decide(None, now_us)
    assert state is not None
    snapshot = int(state)
    first = algo.decide(state, now_us + 1, cost)
    assert algo.decide(state, now_us + 1, cost) == first
    assert state == snapshot

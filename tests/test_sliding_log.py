"""Sliding log on a fake clock: expected values worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_log import SlidingLog, pack_log, unpack_log

S = 1_000_000
T0 = 5_000 * S


def test_exact_window_with_retry_after_to_the_microsecond() -> None:
    algo = SlidingLog(3, 10)
    state = None
    for second in range(3):
        decision, state = algo.decide(state, T0 + second * S)
        assert decision.allowed
        assert decision.remaining == 2 - second
        assert decision.reset_s == pytest.approx(10.0)  # the newest entry leaves 10 s on
    decision, same = algo.decide(state, T0 + 3 * S)
    assert not decision.allowed and same is state
    # The entry at +0 s counts during [+0, +10): a fourth fits at +10 s, 7 s after +3 s.
    assert decision.retry_after_s == pytest.approx(7.0)
    assert decision.reset_s == pytest.approx(9.0)  # the entry at +2 s leaves at +12 s
    assert not algo.decide(state, T0 + 10 * S - 1)[0].allowed
    decision, state = algo.decide(state, T0 + 10 * S)
    assert decision.allowed and decision.remaining == 0
    assert state is not None
    # The entry at +0 s is gone; +1, +2 and +10 s remain.
    assert unpack_log(state) == [T0 + S, T0 + 2 * S, T0 + 10 * S]
    decision, _ = algo.decide(state, T0 + 10_500_000)
    assert not decision.allowed
    assert decision.retry_after_s == pytest.approx(0.5)  # the entry at +1 s leaves at +11 s


def test_costs_are_entries_all_or_nothing() -> None:
    algo = SlidingLog(5, 10)
    _, state = algo.decide(None, T0, cost=3)
    _, state = algo.decide(state, T0 + S, cost=2)
    assert state is not None
    assert len(state) == 5 * 8  # 8 bytes per unit admitted in the window
    decision, same = algo.decide(state, T0 + 2 * S)
    assert not decision.allowed and same is state
    assert decision.retry_after_s == pytest.approx(8.0)  # the three at +0 s leave at +10 s
    decision, state = algo.decide(state, T0 + 10 * S, cost=3)
    assert decision.allowed and decision.remaining == 0
    # The log is now +1, +1, +10, +10, +10 s. At +10.5 s a cost of 2 needs the two entries at
    # +1 s gone (at +11 s); a cost of 3 also needs one at +10 s gone (at +20 s).
    decision, _ = algo.decide(state, T0 + 10_500_000, cost=2)
    assert (decision.allowed, decision.remaining) == (False, 0)
    assert decision.retry_after_s == pytest.approx(0.5)
    decision, _ = algo.decide(state, T0 + 10_500_000, cost=3)
    assert decision.retry_after_s == pytest.approx(9.5)


def test_cost_above_limit_can_never_pass() -> None:
    algo = SlidingLog(2, 1)
    decision, state = algo.decide(None, T0, cost=3)
    assert not decision.allowed and state is None
    assert decision.retry_after_s == math.inf
    _, state = algo.decide(None, T0)
    decision, _ = algo.decide(state, T0, cost=3)
    assert decision.retry_after_s == math.inf
    assert decision.remaining == 1


def test_log_never_holds_more_than_limit_entries() -> None:
    algo = SlidingLog(4, 1)
    state = None
    for step in range(100):
        _, state = algo.decide(state, T0 + step * 300_000)
        assert state is not None
        assert len(state) <= 4 * 8


def test_clock_stepping_back_keeps_the_log_sorted() -> None:
    algo = SlidingLog(3, 10)
    _, state = algo.decide(None, T0 + 5 * S)
    _, state = algo.decide(state, T0 + 2 * S)  # back 3 s: recorded at +5 s, not +2 s
    assert state is not None
    assert unpack_log(state) == [T0 + 5 * S, T0 + 5 * S]


def test_idle_when_the_newest_entry_has_left() -> None:
    algo = SlidingLog(3, 10)
    _, state = algo.decide(None, T0)
    _, state = algo.decide(state, T0 + 4 * S)
    assert state is not None
    assert not algo.is_idle(state, T0 + 14 * S - 1)
    assert algo.is_idle(state, T0 + 14 * S)
    assert algo.is_idle(b"", T0)


def test_refund_removes_the_entries_of_that_time_only() -> None:
    algo = SlidingLog(5, 10)
    _, state = algo.decide(None, T0, cost=2)
    _, state = algo.decide(state, T0 + S, cost=2)
    assert state is not None
    assert algo.refund(state, T0 + 2 * S) == state  # charge time unknown: unchanged
    refunded = algo.refund(state, T0 + 2 * S, cost=2, charged_us=T0 + S)
    assert unpack_log(refunded) == [T0, T0]
    partly = algo.refund(state, T0 + 2 * S, cost=1, charged_us=T0)
    assert unpack_log(partly) == [T0, T0 + S, T0 + S]
    assert algo.refund(state, T0 + 2 * S, charged_us=T0 + 500_000) == state


def test_rescale_resamples_the_entries_in_the_window() -> None:
    old = SlidingLog(4, 10)
    state = pack_log([T0, T0 + S, T0 + 2 * S, T0 + 3 * S])
    half = SlidingLog(2, 10)
    # ceil(4 * 2/4) = 2 entries, evenly spread and ending at the newest: #1 and #3.
    assert unpack_log(half.rescale(state, old, T0 + 4 * S) or b"") == [T0 + S, T0 + 3 * S]
    double = SlidingLog(8, 10)
    rescaled = double.rescale(state, old, T0 + 4 * S) or b""
    assert unpack_log(rescaled) == [t for t in unpack_log(state) for _ in range(2)]
    # At +10.5 s the entry at +0 s has left: 3 of 4 used becomes ceil(3 * 2/4) = 2 of 2.
    assert unpack_log(half.rescale(state, old, T0 + 10_500_000) or b"") == [
        T0 + 2 * S,
        T0 + 3 * S,
    ]
    assert half.rescale(state, old, T0 + 20 * S) is None
    assert half.rescale(state, FixedWindow(4, 10), T0) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("limit", "window_s"), [(0, 1), (2, 0), (2, -1), (False, 1)])
def test_rejects_impossible_parameters(limit: int, window_s: float) -> None:
    with pytest.raises(ValueError):
        SlidingLog(limit, window_s)


arrivals = st.lists(st.tuples(st.integers(0, 2 * S), st.integers(1, 4)), min_size=1, max_size=300)


@settings(deadline=None)
@given(limit=st.integers(1, 12), window_us=st.integers(1, 3 * S), steps=arrivals)
def test_never_more_than_limit_in_any_window(
    limit: int, window_us: int, steps: list[tuple[int, int]]
) -> None:
    algo = SlidingLog(limit, window_us / S)
    now_us = T0
    state = None
    admitted: list[tuple[int, int]] = []
    for gap_us, cost in steps:
        now_us += gap_us
        before = state
        decision, state = algo.decide(state, now_us, cost)
        if decision.allowed:
            admitted.append((now_us, cost))
        else:
            assert state is before
            if decision.retry_after_s != math.inf:
                retry_at = now_us + round(decision.retry_after_s * S)
                assert not algo.decide(state, retry_at - 1, cost)[0].allowed
                assert algo.decide(state, retry_at, cost)[0].allowed
    # Every span [t, t + window) starting at an admission holds at most `limit` units; any
    # other span holds no more than the one starting at its first admission.
    for start_us, _ in admitted:
        in_span = sum(cost for t, cost in admitted if start_us <= t < start_us + window_us)
        assert in_span <= limit


@settings(deadline=None)
@given(limit=st.integers(1, 30), window_s=st.integers(1, 10), overload=st.integers(2, 5))
def test_long_run_rate_under_saturation_is_the_configured_rate(
    limit: int, window_s: int, overload: int
) -> None:
    algo = SlidingLog(limit, window_s)
    window_us = window_s * S
    gap_us = window_us // (limit * overload)
    windows = 30
    state = None
    admitted = 0
    now_us = T0
    while now_us < T0 + windows * window_us:
        decision, state = algo.decide(state, now_us)
        admitted += decision.allowed
        now_us += gap_us
    # A unit's slot frees `window` after its admission and the next arrival takes it within
    # `gap`: every slot serves at least once per window + gap, at most once per window.
    assert limit * (windows * window_us // (window_us + gap_us)) <= admitted
    assert admitted <= limit * windows


@given(now_us=st.integers(0, 10**15), cost=st.integers(1, 5))
def test_decide_is_pure(now_us: int, cost: int) -> None:
    algo = SlidingLog(5, 2)
    _, state = algo.decide(None, now_us, 2)
    assert state is not None
    snapshot = bytes(state)
    first = algo.decide(state, now_us + 1, cost)
    assert algo.decide(state, now_us + 1, cost) == first
    assert state == snapshot

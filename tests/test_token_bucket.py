"""Token bucket and Guava reservations on a fake clock.

Expected waits are Guava's documented ones (the issue's cases and ``RateLimiterTest``), each
worked out by hand from ``SmoothRateLimiter``'s formulas in the comments.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.token_bucket import (
    TokenBucket,
    WarmingUpTokenBucket,
    token_bucket,
)
from gateway.clock import FakeClock

S = 1_000_000
T0 = 7_000 * S

Limiter = TokenBucket | WarmingUpTokenBucket


class GuavaCaller:
    """Calls like Guava's ``acquire``: reserve, then sleep the wait on the (fake) clock."""

    def __init__(self, limiter: Limiter, state: int | None = None) -> None:
        self.limiter = limiter
        self.state = state
        self.clock = FakeClock(T0)

    def acquire(self, permits: int = 1) -> float:
        decision, self.state = self.limiter.decide(self.state, self.clock.now_us(), permits)
        assert decision.allowed
        self.clock.advance(decision.delay_s)
        return decision.delay_s

    def try_acquire(self, permits: int = 1, timeout_s: float = 0.0) -> bool:
        decision, self.state = self.limiter.decide(
            self.state, self.clock.now_us(), permits, max_delay_s=timeout_s
        )
        if decision.allowed:
            self.clock.advance(decision.delay_s)
        return decision.allowed


def test_issue_warm_up_case() -> None:
    """Rate 4/s, warm-up 2 s: stable interval 250 ms, cold interval 750 ms, thresholdPermits
    0.5 * 2 s / 250 ms = 4, maxPermits 4 + 2 * 2 s / (250 + 750 ms) = 8, slope 500 ms / 4
    = 125 ms per permit. Cold: 8 stored permits.

    t=0 acquire(1): waits 0; costs the trapezoid from 8 to 7 permits, (750 + 625) / 2 = 687.5 ms.
    t=1 acquire(3): next free was 0.6875, so waits 0; 312.5 ms idle adds 1.25 permits (capped
    at 8); costs 8 -> 5: 3 * (750 + 375) / 2 = 1687.5 ms, next free 2.6875.
    t=2 acquire(10): waits 0.6875; 5 stored: 1 above the threshold (375 + 250) / 2 = 312.5 ms,
    4 at 250 ms, 5 fresh at 250 ms: 2562.5 ms, next free 5.25.
    t=3.6875 (a second after that call returned) acquire(1): waits 5.25 - 3.6875 = 1.5625.
    """
    caller = GuavaCaller(WarmingUpTokenBucket(4, 1, 2.0, mode="queue"))
    waits = [caller.acquire(1)]
    caller.clock.set(T0 + 1 * S)
    waits.append(caller.acquire(3))
    caller.clock.set(T0 + 2 * S)
    waits.append(caller.acquire(10))
    caller.clock.advance(1.0)
    waits.append(caller.acquire(1))
    assert waits == [0.0, 0.0, 0.6875, 1.5625]


@pytest.mark.parametrize("guava_initial_state", [False, True])
def test_issue_bursty_case(guava_initial_state: bool) -> None:
    """Rate 4/s, max burst 1 s (4 permits). From Guava's empty start: t=0 acquire(1) waits 0,
    borrows 1 (next free 0.25); t=1: 0.75 s idle stored 3, acquire(3) waits 0; t=2: 1 s idle
    stored 4, acquire(10) waits 0, spends 4 and borrows 6 (next free 3.5); t=3 waits 0.5.
    Starting full (a new key) gives the same waits: the cap at 4 absorbs the difference."""
    limiter = TokenBucket(4, 1, 4, mode="queue")
    caller = GuavaCaller(limiter, limiter.state(0.0, T0) if guava_initial_state else None)
    waits = []
    for second, permits in [(0, 1), (1, 3), (2, 10), (3, 1)]:
        caller.clock.set(T0 + second * S)
        waits.append(caller.acquire(permits))
    assert waits == [0.0, 0.0, 0.0, 0.5]


def test_guava_warm_up_goes_cold_again() -> None:
    """``RateLimiterTest.testWarmUp``: rate 2/s, warm-up 4 s. Stable 500 ms, cold 1500 ms,
    threshold 4, max 8, slope 250 ms. From 8 stored permits each acquire pays the previous
    one's trapezoid: (1500+1250)/2, (1250+1000)/2, (1000+750)/2, (750+500)/2 ms, then 500 ms."""
    caller = GuavaCaller(WarmingUpTokenBucket(2, 1, 4.0, mode="queue"))
    warming = [0.0, 1.375, 1.125, 0.875, 0.625, 0.5, 0.5, 0.5]
    assert [caller.acquire() for _ in range(8)] == warming
    caller.clock.advance(0.5 + 4.0)  # repay the last acquire, then 4 s idle: 8 permits again
    assert [caller.acquire() for _ in range(8)] == warming
    caller.clock.advance(0.5 + 2.0)  # 2 s idle: 4 permits, all at the stable interval
    assert [caller.acquire() for _ in range(8)] == [0.0] + [0.5] * 7


def test_guava_simple_weights() -> None:
    """``RateLimiterTest.testSimpleWeights``: rate 1/s, created empty; each acquire pays for
    the permits of the one before it."""
    limiter = TokenBucket(1, 1, 1, mode="queue")
    caller = GuavaCaller(limiter, limiter.state(0.0, T0))
    waits = [caller.acquire(permits) for permits in (1, 1, 2, 4, 8, 1)]
    assert waits == [0.0, 1.0, 1.0, 2.0, 4.0, 8.0]


def test_guava_try_acquire_with_timeouts() -> None:
    """``RateLimiterTest.testTryAcquire_someWaitAllowed``: rate 5/s (200 ms a permit)."""
    limiter = TokenBucket(5, 1, 5, mode="queue")
    caller = GuavaCaller(limiter, limiter.state(0.0, T0))
    assert caller.try_acquire(timeout_s=0.0)  # next free 0.2
    assert caller.try_acquire(timeout_s=0.2)  # waits 0.2 (clock 0.2), next free 0.4
    state = caller.state
    assert not caller.try_acquire(timeout_s=0.1)  # would wait 0.2
    assert caller.state == state  # refused: charged nothing
    caller.clock.advance(0.1)
    assert caller.try_acquire(timeout_s=0.1)


def test_queue_rejection_beyond_max_delay_says_when_to_retry() -> None:
    limiter = TokenBucket(2, 1, 1, mode="queue", max_delay_s=1.0)
    state = None
    delays = []
    for _ in range(4):
        decision, state = limiter.decide(state, T0)
        delays.append(decision.delay_s)
    # The stored token, then one borrowed (the next caller pays), then 500 ms a token.
    assert delays == [0.0, 0.0, 0.5, 1.0]
    decision, same = limiter.decide(state, T0)
    assert not decision.allowed and same is state
    assert decision.retry_after_s == pytest.approx(0.5)  # when the wait is down to 1 s
    assert limiter.decide(state, T0, max_delay_s=2.0)[0].allowed


def test_reject_mode_is_a_classic_bucket() -> None:
    bucket = TokenBucket(1, 1, 3)
    state = None
    seen = []
    for _ in range(3):
        decision, state = bucket.decide(state, T0)
        seen.append((decision.allowed, decision.delay_s, decision.remaining, decision.reset_s))
    assert seen == [(True, 0.0, 2, 1.0), (True, 0.0, 1, 2.0), (True, 0.0, 0, 3.0)]
    decision, same = bucket.decide(state, T0)
    assert not decision.allowed and same is state
    assert (decision.retry_after_s, decision.limit, decision.remaining) == (1.0, 3, 0)
    assert not bucket.decide(state, T0 + S - 1)[0].allowed
    decision, state = bucket.decide(state, T0 + S)
    assert decision.allowed and decision.remaining == 0
    decision, _ = bucket.decide(state, T0 + S, cost=4)
    assert decision.retry_after_s == math.inf  # more than the bucket holds


def test_rates_that_do_not_divide_a_second_are_exact() -> None:
    """3/s: a token every 333_333.33 us. Three from a full bucket at once, and the next token
    is there after 333_334 us, not 333_333 (no rounding either way)."""
    bucket = TokenBucket(3, 1, 3)
    state = None
    for _ in range(3):
        decision, state = bucket.decide(state, T0)
        assert decision.allowed
    decision, _ = bucket.decide(state, T0)
    assert decision.retry_after_s == pytest.approx(1 / 3)
    assert not bucket.decide(state, T0 + 333_333)[0].allowed
    assert bucket.decide(state, T0 + 333_334)[0].allowed


def test_per_minute_rate() -> None:
    bucket = token_bucket(30, 60, 2)  # a token every 2 s
    state = None
    for _ in range(2):
        decision, state = bucket.decide(state, T0)
        assert decision.allowed
    decision, _ = bucket.decide(state, T0)
    assert decision.retry_after_s == pytest.approx(2.0)


def test_warm_up_reject_mode_is_try_acquire() -> None:
    """Cold at 4/s with 2 s warm-up, the first request costs 687.5 ms (see the issue case):
    ``tryAcquire()`` refuses until then."""
    limiter = WarmingUpTokenBucket(4, 1, 2.0)
    decision, state = limiter.decide(None, T0)
    assert decision.allowed and decision.delay_s == 0.0
    decision, same = limiter.decide(state, T0)
    assert not decision.allowed and same is state
    assert decision.retry_after_s == pytest.approx(0.6875)
    assert not limiter.decide(state, T0 + 687_499)[0].allowed
    assert limiter.decide(state, T0 + 687_500)[0].allowed


def test_idle_means_full_or_cold_again() -> None:
    bucket = TokenBucket(2, 1, 4)
    _, state = bucket.decide(None, T0, cost=3)
    assert state is not None
    assert not bucket.is_idle(state, T0 + 1_499_999)  # 3 tokens at 500 ms each
    assert bucket.is_idle(state, T0 + 1_500_000)
    warm = WarmingUpTokenBucket(4, 1, 2.0)
    _, state = warm.decide(None, T0)
    assert state is not None
    assert warm.stored_permits(state, T0) == 7.0
    # Idle again once 1 permit is stored back (250 ms) after the next free time (687.5 ms).
    assert not warm.is_idle(state, T0 + 937_499)
    assert warm.is_idle(state, T0 + 937_500)


def test_refund_right_after_the_charge_restores_the_state() -> None:
    bucket = TokenBucket(10, 1, 10)
    _, half = bucket.decide(None, T0, cost=5)
    assert half is not None
    _, charged = bucket.decide(half, T0 + 1000, cost=2)
    assert charged is not None
    assert bucket.tokens(charged, T0 + 1000) == pytest.approx(5.01 - 2)
    assert bucket.refund(charged, T0 + 1000, cost=2) == half
    # Never beyond a full bucket.
    assert bucket.refund(half, T0 + 10 * S, cost=5) == (T0 + 10 * S) - 10 * 100_000
    queued = TokenBucket(1, 1, 1, mode="queue")
    _, state = queued.decide(None, T0)
    _, state = queued.decide(state, T0)  # borrows: the bucket owes 1 s
    assert state is not None
    assert queued.tokens(state, T0) == -1.0
    assert queued.tokens(queued.refund(state, T0), T0) == 0.0


def test_warm_up_refund_pulls_the_next_free_time_back() -> None:
    limiter = WarmingUpTokenBucket(4, 1, 2.0, mode="queue")
    _, state = limiter.decide(None, T0)
    assert state is not None
    # Next free at +687.5 ms; a refund of 1 permit moves it back by 250 ms.
    refunded = limiter.refund(state, T0, 1)
    decision, _ = limiter.decide(refunded, T0)
    assert decision.delay_s == pytest.approx(0.4375)
    assert limiter.stored_permits(refunded, T0) == 7.0  # coldness is not given back


def test_rescale_keeps_the_bucket_as_full() -> None:
    old = TokenBucket(1, 1, 10)
    _, state = old.decide(None, T0, cost=6)  # 4 of 10 tokens left
    assert state is not None
    bigger = TokenBucket(5, 1, 20)
    rescaled = bigger.rescale(state, old, T0)
    assert rescaled is not None
    assert bigger.tokens(rescaled, T0) == 8.0
    full = old.rescale(old.decide(None, T0)[1] or 0, old, T0 + 10 * S)
    assert full is None  # full again: start afresh
    queued_old = TokenBucket(1, 1, 1, mode="queue")
    _, debt = queued_old.decide(None, T0)
    _, debt = queued_old.decide(debt, T0)  # owes 1 s
    queued_new = TokenBucket(4, 1, 1, mode="queue")
    decision, _ = queued_new.decide(queued_new.rescale(debt or 0, queued_old, T0), T0)
    assert decision.delay_s == 1.0  # the debt keeps its length in time
    assert bigger.rescale(state, FixedWindow(1, 1), T0) is None
    warm = WarmingUpTokenBucket(4, 1, 2.0)
    _, cold_state = warm.decide(None, T0)
    longer = WarmingUpTokenBucket(4, 1, 4.0)
    assert longer.stored_permits(longer.rescale(cold_state or 0, warm, T0), T0) == 14.0


def test_factory_validates_the_policy() -> None:
    assert isinstance(token_bucket(10, 1, 5), TokenBucket)
    warm = token_bucket(10, 1, mode="queue", warmup_s=3.0, max_delay_s=2.0)
    assert isinstance(warm, WarmingUpTokenBucket)
    assert warm.name == "token_bucket"
    with pytest.raises(ValueError, match="no burst"):
        token_bucket(10, 1, 5, warmup_s=3.0)
    with pytest.raises(ValueError, match="mode"):
        token_bucket(10, 1, 5, mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TokenBucket(0)
    with pytest.raises(ValueError):
        TokenBucket(1, 0)
    with pytest.raises(ValueError):
        TokenBucket(1, 1, 0)
    with pytest.raises(ValueError):
        TokenBucket(1, 1, 1, mode="queue", max_delay_s=-1)
    with pytest.raises(ValueError):
        WarmingUpTokenBucket(1, 1, 0)
    with pytest.raises(ValueError):
        TokenBucket(1).decide(None, T0, cost=0)


rates = st.tuples(st.integers(1, 50), st.sampled_from([1, 60]))
arrivals = st.lists(st.tuples(st.integers(0, 400_000), st.integers(1, 3)), min_size=1, max_size=150)


@settings(deadline=None)
@given(rate=rates, capacity=st.integers(1, 8), steps=arrivals)
def test_reject_mode_never_admits_more_than_capacity_plus_rate_times_t(
    rate: tuple[int, int], capacity: int, steps: list[tuple[int, int]]
) -> None:
    requests, period_s = rate
    bucket = TokenBucket(requests, period_s, capacity)
    period_us = period_s * S
    now_us = T0
    state = None
    admitted: list[tuple[int, int]] = []
    for gap_us, cost in steps:
        now_us += gap_us
        before = state
        decision, state = bucket.decide(state, now_us, cost)
        if decision.allowed:
            admitted.append((now_us, cost))
        else:
            assert state is before
    for i, (start_us, _) in enumerate(admitted):
        units = 0
        for end_us, cost in admitted[i:]:
            units += cost
            # units <= capacity + requests * (end - start) / period, in integers.
            assert units * period_us <= capacity * period_us + requests * (end_us - start_us)


@settings(deadline=None)
@given(rate=rates, capacity=st.integers(1, 8), steps=arrivals, max_delay_s=st.integers(0, 5))
def test_queue_mode_releases_at_most_capacity_plus_rate_times_t_plus_the_borrower(
    rate: tuple[int, int], capacity: int, steps: list[tuple[int, int]], max_delay_s: int
) -> None:
    """Releases (arrival + delay) in any span T: at most capacity + rate * T, plus the cost of
    the last request, which Guava lets borrow against the future."""
    requests, period_s = rate
    bucket = TokenBucket(requests, period_s, capacity, mode="queue", max_delay_s=max_delay_s)
    period_us = period_s * S
    now_us = T0
    state = None
    released: list[tuple[float, int]] = []
    for gap_us, cost in steps:
        now_us += gap_us
        before = state
        decision, state = bucket.decide(state, now_us, cost)
        if decision.allowed:
            assert decision.delay_s <= max_delay_s
            released.append((now_us + decision.delay_s * S, cost))
        else:
            assert state is before
    released.sort()
    slack_us = 1e-3  # float rounding of delay_s
    for i, (start_us, _) in enumerate(released):
        units = 0
        for end_us, cost in released[i:]:
            units += cost
            bound = (capacity + cost) * period_us + requests * (end_us - start_us + slack_us)
            assert units * period_us <= bound


@settings(deadline=None)
@given(rate=rates, capacity=st.integers(1, 20), overload=st.integers(2, 6))
def test_long_run_rate_under_saturation_is_the_configured_rate(
    rate: tuple[int, int], capacity: int, overload: int
) -> None:
    requests, period_s = rate
    bucket = TokenBucket(requests, period_s, capacity)
    period_us = period_s * S
    gap_us = period_us // (requests * overload)
    duration_us = 40 * period_us
    state = None
    admitted = 0
    now_us = T0
    while now_us < T0 + duration_us:
        decision, state = bucket.decide(state, now_us)
        admitted += decision.allowed
        now_us += gap_us
    if capacity >= 2:
        # The full bucket, then every token made until the last arrival (at least duration -
        # gap): arrivals come faster than tokens, so after the first burst the bucket holds
        # less than 1 + gap / interval < 2 tokens, never overflows, and less than one is left.
        assert capacity + requests * (duration_us - gap_us) / period_us - 1 <= admitted
    else:
        # A bucket of one is full again an interval after each admission and overflows until
        # the next arrival, at most `gap` later: one admission per interval + gap at least.
        assert duration_us * requests // (period_us + requests * gap_us) <= admitted
    assert admitted <= capacity + requests * duration_us / period_us


@settings(deadline=None)
@given(requests=st.integers(1, 20), warmup_s=st.integers(1, 5))
def test_warm_up_reaches_the_stable_rate(requests: int, warmup_s: int) -> None:
    """Saturated from cold: after the warm-up the waits settle at the stable interval, and the
    time to serve N permits is never shorter than N stable intervals."""
    limiter = WarmingUpTokenBucket(requests, 1, warmup_s, mode="queue")
    caller = GuavaCaller(limiter)
    interval_s = 1 / requests
    waits = [caller.acquire() for _ in range(requests * warmup_s * 2 + 10)]
    assert waits[-1] == pytest.approx(interval_s, abs=2e-6)  # the fake clock moves in whole us
    assert max(waits) <= 3 * interval_s + 1e-6  # never slower than the cold rate
    # Guava truncates each stored permit's price to a whole microsecond.
    assert sum(waits) >= (len(waits) - 1) * interval_s - len(waits) * 1e-6


@given(now_us=st.integers(0, 10**15), cost=st.integers(1, 5), queue=st.booleans())
def test_decide_is_pure(now_us: int, cost: int, queue: bool) -> None:
    for limiter in (
        TokenBucket(5, 1, 5, mode="queue" if queue else "reject"),
        WarmingUpTokenBucket(5, 1, 2.0, mode="queue" if queue else "reject"),
    ):
        _, state = limiter.decide(None, now_us, 2)
        assert state is not None
        snapshot = int(state)
        first = limiter.decide(state, now_us + 1, cost)
        assert limiter.decide(state, now_us + 1, cost) == first
        assert state == snapshot

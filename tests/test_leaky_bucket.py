"""The nginx leaky bucket on a fake clock.

Expected values are worked out by hand from the formulas in ngx_http_limit_req_module.c:
rate_milli = r * 1000 // period, excess = max(0, excess - rate_milli * ms // 1000 + 1000),
reject when excess > burst * 1000, delay (excess - delay * 1000) * 1000 // rate_milli ms,
and a new key's first request leaves excess 0.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.base import Decision
from gateway.algorithms.leaky_bucket import LeakyBucket, pack_state, unpack_state
from gateway.clock import FakeClock

MS = 1000  # microseconds


def run(bucket: LeakyBucket, clock: FakeClock, state: int | None) -> tuple[Decision, int | None]:
    return bucket.decide(state, clock.now_us())


# --- hand-derived cases -------------------------------------------------------------------------


def test_five_at_once_with_rate_2_burst_3_admits_four_and_queues_them_half_a_second_apart() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=3)
    clock = FakeClock()
    state: int | None = None
    got = []
    for _ in range(5):
        decision, state = run(bucket, clock, state)
        got.append(decision)
    # excess after each: 0 (new key), 1000, 2000, 3000, then 4000 > 3000 rejects.
    assert [d.allowed for d in got] == [True, True, True, True, False]
    # delay = excess * 1000 // 2000 ms
    assert [d.delay_s for d in got[:4]] == [0.0, 0.5, 1.0, 1.5]
    assert [d.remaining for d in got] == [3, 2, 1, 0, 0]
    assert {d.limit for d in got} == {4}
    # full recovery once excess + 1000 drained at 2000 milli/s: 0.5 s per queued request.
    assert [d.reset_s for d in got] == [0.5, 1.0, 1.5, 2.0, 2.0]
    # the fifth needs 4000 - 3000 = 1000 milli drained: 500 ms.
    assert got[4].retry_after_s == 0.5
    assert got[4].delay_s == 0.0
    assert state is not None
    assert unpack_state(state) == (3000, clock.now_us() // MS)


def test_one_drained_ms_short_is_still_rejected() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=3)
    clock = FakeClock()
    state: int | None = None
    for _ in range(4):
        _, state = run(bucket, clock, state)
    full = state
    clock.advance(us=499 * MS)
    # 3000 - 2000 * 499 // 1000 + 1000 = 3002 > 3000
    decision, state = run(bucket, clock, full)
    assert not decision.allowed
    assert state == full
    assert decision.retry_after_s == pytest.approx(0.001)
    clock.advance(us=1 * MS)
    # 3000 - 1000 + 1000 = 3000: admitted, queued 1.5 s
    decision, state = run(bucket, clock, full)
    assert decision.allowed
    assert decision.delay_s == 1.5
    assert state is not None and unpack_state(state) == (3000, clock.now_us() // MS)


def test_burst_zero_admits_one_per_period_and_the_new_key_starts_empty() -> None:
    bucket = LeakyBucket.from_nginx("1r/s")
    clock = FakeClock()
    first, state = run(bucket, clock, None)
    assert first.allowed and first.delay_s == 0.0 and first.limit == 1 and first.remaining == 0
    again, same = run(bucket, clock, state)
    assert not again.allowed and same == state
    clock.advance(us=999 * MS)  # excess 0 - 999 + 1000 = 1 > 0
    assert not run(bucket, clock, state)[0].allowed
    clock.advance(us=1 * MS)  # excess 0
    decision, _ = run(bucket, clock, state)
    assert decision.allowed and decision.delay_s == 0.0


def test_time_counts_in_whole_milliseconds_like_ngx_current_msec() -> None:
    bucket = LeakyBucket.from_nginx("1r/s")
    _, state = bucket.decide(None, 5_000_000_999)  # ms 5_000_000
    # 999.999 ms later in real time, but ms 5_000_999: 999 ms drained -> excess 1, rejected
    assert not bucket.decide(state, 5_000_999_999)[0].allowed
    # only 999.001 ms later, but ms 5_001_000: a whole second drained
    assert bucket.decide(state, 5_001_000_000)[0].allowed


def test_rate_per_minute_is_truncated_like_nginx() -> None:
    # 7r/m: rate_milli = 7000 // 60 = 116, not 116.67; so the next request passes at 8621 ms
    # (116 * 8621 // 1000 = 1000), not at 60/7 s = 8571 ms.
    bucket = LeakyBucket.from_nginx("7r/m")
    assert bucket.rate_milli == 116
    clock = FakeClock()
    _, state = run(bucket, clock, None)
    clock.advance(us=8571 * MS)
    assert not run(bucket, clock, state)[0].allowed
    clock.advance(us=(8620 - 8571) * MS)  # 116 * 8620 // 1000 = 999 -> excess 1
    rejected, _ = run(bucket, clock, state)
    assert not rejected.allowed
    assert rejected.retry_after_s == pytest.approx(0.001)
    clock.advance(us=1 * MS)
    assert run(bucket, clock, state)[0].allowed


def test_thirty_per_minute_drains_one_request_every_two_seconds() -> None:
    bucket = LeakyBucket.from_nginx("30r/m", burst=1)
    assert bucket.rate_milli == 500
    clock = FakeClock()
    _, state = run(bucket, clock, None)
    decision, state = run(bucket, clock, state)  # excess 1000, delay 1000 * 1000 // 500 = 2 s
    assert decision.allowed and decision.delay_s == 2.0
    assert not run(bucket, clock, state)[0].allowed
    clock.advance(us=1999 * MS)  # 1000 - 999 + 1000 = 1001 > 1000
    assert not run(bucket, clock, state)[0].allowed
    clock.advance(us=1 * MS)
    decision, _ = run(bucket, clock, state)
    assert decision.allowed and decision.delay_s == 2.0


def test_nodelay_serves_the_whole_burst_at_once() -> None:
    bucket = LeakyBucket.from_nginx("1r/s", burst=5, nodelay=True)
    clock = FakeClock()
    state: int | None = None
    got = []
    for _ in range(7):
        decision, state = run(bucket, clock, state)
        got.append(decision)
    assert [d.allowed for d in got] == [True] * 6 + [False]
    assert all(d.delay_s == 0.0 for d in got)
    assert [d.remaining for d in got] == [5, 4, 3, 2, 1, 0, 0]


def test_delay_n_serves_the_first_n_excess_at_once_and_queues_the_rest() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=5, delay=2)
    clock = FakeClock()
    state: int | None = None
    got = []
    for _ in range(7):
        decision, state = run(bucket, clock, state)
        got.append(decision)
    # excess 0, 1000, 2000 (<= 2000: at once), 3000, 4000, 5000, then 6000 rejected
    assert [d.allowed for d in got] == [True] * 6 + [False]
    # (excess - 2000) * 1000 // 2000 ms
    assert [d.delay_s for d in got[:6]] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5]


def test_an_excess_of_a_few_milli_requests_rounds_to_no_delay() -> None:
    bucket = LeakyBucket.from_nginx("3r/s", burst=5)
    clock = FakeClock()
    _, state = run(bucket, clock, None)
    clock.advance(us=333 * MS)
    # 0 - 3000 * 333 // 1000 + 1000 = 1 milli; delay 1 * 1000 // 3000 = 0 ms: nginx passes it.
    decision, state = run(bucket, clock, state)
    assert decision.allowed and decision.delay_s == 0.0
    assert state is not None and unpack_state(state)[0] == 1
    decision, _ = run(bucket, clock, state)  # 1001 * 1000 // 3000 = 333 ms
    assert decision.delay_s == 0.333


def test_clock_stepping_back_less_than_a_minute_drains_nothing_and_keeps_last() -> None:
    bucket = LeakyBucket.from_nginx("10r/s", burst=10)
    clock = FakeClock(start_us=200_000_000 * MS)
    t0_ms = clock.now_us() // MS
    _, state = run(bucket, clock, None)
    _, state = run(bucket, clock, state)
    assert state is not None and unpack_state(state) == (1000, t0_ms)
    clock.set((t0_ms - 5000) * MS)
    _, state = run(bucket, clock, state)  # ms -5000 -> 0: +1000, last stays t0
    assert state is not None and unpack_state(state) == (2000, t0_ms)
    clock.set((t0_ms - 60_000) * MS)  # exactly -60000 is still "a small step"
    _, state = run(bucket, clock, state)
    assert state is not None and unpack_state(state) == (3000, t0_ms)
    clock.set((t0_ms + 100) * MS)  # 100 ms after last: drain 10000 * 100 // 1000 = 1000
    _, state = run(bucket, clock, state)
    assert state is not None and unpack_state(state) == (3000, t0_ms + 100)


def test_clock_jumping_back_more_than_a_minute_counts_as_one_ms_and_moves_last_back() -> None:
    bucket = LeakyBucket.from_nginx("10r/s", burst=10)
    t0_ms = 300_000_000
    state: int | None = pack_state(2000, t0_ms)
    back_ms = t0_ms - 60_001
    decision, state = bucket.decide(state, back_ms * MS)
    # ms = 1: drain 10000 * 1 // 1000 = 10
    assert decision.allowed
    assert state is not None and unpack_state(state) == (2990, back_ms)
    _, state = bucket.decide(state, (back_ms + 1) * MS)
    assert state is not None and unpack_state(state) == (3980, back_ms + 1)


def test_cost_counts_as_that_many_requests_at_once_all_or_nothing() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=3)
    clock = FakeClock()
    decision, state = bucket.decide(None, clock.now_us(), cost=4)  # 0 + 3 * 1000
    assert decision.allowed and decision.delay_s == 1.5 and decision.remaining == 0
    assert state is not None and unpack_state(state)[0] == 3000
    too_big, same = bucket.decide(None, clock.now_us(), cost=5)
    assert not too_big.allowed and same is None and math.isinf(too_big.retry_after_s)
    with pytest.raises(ValueError, match="cost"):
        bucket.decide(None, clock.now_us(), cost=0)


def test_refund_takes_requests_back_out_of_the_queue_floored_at_empty() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=5)
    state = pack_state(3000, 123_456)
    assert unpack_state(bucket.refund(state, 0, cost=2)) == (1000, 123_456)
    assert unpack_state(bucket.refund(state, 0, cost=5)) == (0, 123_456)


def test_is_idle_when_a_request_would_find_the_bucket_as_a_new_key_does() -> None:
    bucket = LeakyBucket.from_nginx("2r/s", burst=3)
    t0_ms = 1_000_000
    empty = pack_state(0, t0_ms)
    # a request at +499 ms: 0 - 998 + 1000 = 2 (not what a new key gets); at +500 ms: 0
    assert not bucket.is_idle(empty, (t0_ms + 499) * MS)
    assert bucket.is_idle(empty, (t0_ms + 500) * MS)
    queued = pack_state(2000, t0_ms)
    assert not bucket.is_idle(queued, (t0_ms + 1499) * MS)
    assert bucket.is_idle(queued, (t0_ms + 1500) * MS)
    # small step back: nothing drained
    assert not bucket.is_idle(empty, (t0_ms - 1000) * MS)


def test_rescale_keeps_the_bucket_as_full_relative_to_its_capacity() -> None:
    old = LeakyBucket.from_nginx("2r/s", burst=3)  # capacity 4 requests
    new = LeakyBucket.from_nginx("2r/s", burst=7)  # capacity 8 requests
    now_us = 1_000_000 * MS
    state: int | None = None
    for _ in range(3):  # 3 of 4 used
        _, state = old.decide(state, now_us)
    assert state is not None
    rescaled = new.rescale(state, old, now_us)
    assert rescaled is not None
    # 6 of 8 used: two more pass now, the third is rejected
    outcomes = []
    for _ in range(3):
        decision, rescaled = new.decide(rescaled, now_us)
        outcomes.append(decision.allowed)
    assert outcomes == [True, True, False]


def test_rescale_of_a_partly_drained_request_keeps_the_credit_under_a_new_rate() -> None:
    old = LeakyBucket.from_nginx("2r/s", burst=3)
    new = LeakyBucket.from_nginx("4r/s", burst=3)
    t0_us = 1_000_000 * MS
    _, state = old.decide(None, t0_us)
    assert state is not None
    now_us = t0_us + 250 * MS  # old: 0 - 500 + 1000 = 500 milli still in use
    rescaled = new.rescale(state, old, now_us)
    assert rescaled is not None
    assert new.excess_milli_at(rescaled, now_us) == 500
    assert new.rescale(state, old, t0_us + 500 * MS) is None  # fully drained: start afresh


def test_rescale_from_another_algorithm_starts_afresh() -> None:
    class Other:
        name = "other"

    bucket = LeakyBucket.from_nginx("2r/s")
    assert bucket.rescale(pack_state(1000, 5), Other(), 0) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": "10r/h"}, "invalid rate"),
        ({"rate": "0r/s"}, "at least 1"),
        ({"rate": "10r/s", "burst": -1}, "burst"),
        ({"rate": "10r/s", "nodelay": True, "delay": 2}, "either nodelay or delay"),
        ({"rate": "10r/s", "delay": 0}, "delay >= 1"),
    ],
)
def test_from_nginx_refuses_what_nginx_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LeakyBucket.from_nginx(**kwargs)  # type: ignore[arg-type]


def test_constructor_refuses_a_period_nginx_cannot_express() -> None:
    with pytest.raises(ValueError, match="period_s"):
        LeakyBucket(10, period_s=3600)


def test_from_nginx_builds_the_same_bucket_as_the_constructor() -> None:
    assert LeakyBucket.from_nginx("30r/m", burst=4, delay=2) == LeakyBucket(30, 60, 4, 2)
    assert LeakyBucket.from_nginx("5r/s", nodelay=True) == LeakyBucket(5, 1, 0, None)
    assert LeakyBucket.from_nginx("5r/s") != LeakyBucket(5, 1, 0, None)


# --- properties ---------------------------------------------------------------------------------

buckets = st.builds(
    LeakyBucket,
    rate=st.integers(1, 50),
    period_s=st.sampled_from([1, 60]),
    burst=st.integers(0, 20),
    delay=st.one_of(st.none(), st.integers(0, 20)),
)
START_US = 1_000_000_000_000
# Gaps between arrivals: often the same ms, often sub-period, sometimes long idles.
gaps_us = st.one_of(
    st.integers(0, 999),
    st.integers(0, 200_000),
    st.integers(0, 5_000_000),
    st.integers(0, 200_000_000),
)


def admitted_times(bucket: LeakyBucket, arrivals_us: list[int]) -> list[int]:
    state: int | None = None
    admitted = []
    for now_us in arrivals_us:
        decision, state = bucket.decide(state, now_us)
        if decision.allowed:
            admitted.append(now_us)
    return admitted


def cumulative(gaps: list[int]) -> list[int]:
    times = []
    now = START_US
    for gap in gaps:
        now += gap
        times.append(now)
    return times


@given(bucket=buckets, gaps=st.lists(gaps_us, min_size=1, max_size=200))
def test_never_more_than_burst_plus_one_plus_rate_times_t_in_any_interval(
    bucket: LeakyBucket, gaps: list[int]
) -> None:
    admitted = admitted_times(bucket, cumulative(gaps))
    per_ms = bucket.rate / bucket.period_s / 1000
    for i, first in enumerate(admitted):
        for j in range(i, len(admitted)):
            span_ms = admitted[j] // MS - first // MS
            assert j - i + 1 <= bucket.burst + 1 + per_ms * span_ms


@settings(max_examples=50)
@given(
    bucket=buckets.filter(lambda bucket: bucket.burst >= 1),
    overload=st.integers(2, 5),
    jitter=st.lists(st.integers(0, 999), min_size=50, max_size=50),
)
def test_admitted_rate_converges_to_the_configured_rate_under_saturation(
    bucket: LeakyBucket, overload: int, jitter: list[int]
) -> None:
    """With a burst the saturated bucket never empties, so no drain is lost to the clamp at 0
    and admissions follow the drain exactly. (Burst 0 is different: see the next test.)"""
    period_us = bucket.period_s * 1_000_000 // bucket.rate
    spacing_us = period_us // overload
    count = 200 * overload
    arrivals = [START_US + k * spacing_us + jitter[k % 50] for k in range(count)]
    admitted = admitted_times(bucket, arrivals)
    span_s = (arrivals[-1] - arrivals[0]) / 1e6
    configured = bucket.rate / bucket.period_s * span_s
    # nginx drains at its truncated rate (7r/m drains 0.116 r/s): converge to that, and it is
    # within one milli-request per second of the configured rate.
    effective = bucket.rate_milli / 1000 * span_s
    assert 0 <= bucket.rate / bucket.period_s - bucket.rate_milli / 1000 < 0.001
    assert len(admitted) <= bucket.burst + 1 + configured
    assert len(admitted) >= effective - 1
    assert len(admitted) / effective == pytest.approx(
        1.0, rel=0.01, abs=(bucket.burst + 1) / effective
    )


def test_without_burst_periodic_arrivals_get_the_rate_rounded_down_to_their_spacing() -> None:
    # 1r/m (rate_milli 16, so 62.5 s per request), one arrival every 30 s, burst 0: after an
    # admission the arrivals at +30 s (excess 520) and +60 s (excess 40) are rejected, +90 s
    # passes. The drain past 0 is lost to the clamp: one request per 90 s, not per 62.5 s.
    bucket = LeakyBucket.from_nginx("1r/m")
    arrivals = [START_US + k * 30_000_000 for k in range(31)]
    admitted = admitted_times(bucket, arrivals)
    assert [(t - START_US) // 1_000_000 for t in admitted] == list(range(0, 901, 90))


@given(bucket=buckets, gaps=st.lists(gaps_us, min_size=1, max_size=60), cost=st.integers(1, 4))
def test_decide_is_pure_and_a_rejection_returns_the_state_it_was_given(
    bucket: LeakyBucket, gaps: list[int], cost: int
) -> None:
    state: int | None = None
    for now_us in cumulative(gaps):
        first = bucket.decide(state, now_us, cost)
        bucket.decide(None, now_us + 17)  # unrelated calls must not leak into the next one
        again = bucket.decide(state, now_us, cost)
        assert first == again
        decision, new_state = first
        if not decision.allowed:
            assert new_state is state
            assert decision.remaining == 0 and decision.delay_s == 0.0
        state = new_state


@given(bucket=buckets, gaps=st.lists(gaps_us, min_size=1, max_size=60))
def test_remaining_is_exactly_how_many_more_pass_at_the_same_instant(
    bucket: LeakyBucket, gaps: list[int]
) -> None:
    state: int | None = None
    for now_us in cumulative(gaps):
        decision, state = bucket.decide(state, now_us)
        if not decision.allowed:
            continue
        probe = state
        for _ in range(decision.remaining):
            extra, probe = bucket.decide(probe, now_us)
            assert extra.allowed
        assert not bucket.decide(probe, now_us)[0].allowed


@given(bucket=buckets, gaps=st.lists(gaps_us, min_size=1, max_size=60))
def test_retry_after_is_the_first_moment_a_retry_passes(
    bucket: LeakyBucket, gaps: list[int]
) -> None:
    state: int | None = None
    for now_us in cumulative(gaps):
        decision, new_state = bucket.decide(state, now_us)
        if not decision.allowed:
            retry_us = now_us + round(decision.retry_after_s * 1e6)
            assert bucket.decide(state, retry_us)[0].allowed
            if retry_us // MS - 1 >= now_us // MS:
                assert not bucket.decide(state, (retry_us // MS - 1) * MS)[0].allowed
        state = new_state


@given(bucket=buckets, gaps=st.lists(gaps_us, min_size=1, max_size=60))
def test_reset_is_when_the_key_becomes_idle_and_idle_means_like_new(
    bucket: LeakyBucket, gaps: list[int]
) -> None:
    state: int | None = None
    for now_us in cumulative(gaps):
        decision, state = bucket.decide(state, now_us)
        assert state is not None
        reset_us = now_us + round(decision.reset_s * 1e6)
        assert bucket.is_idle(state, reset_us)
        if reset_us // MS - 1 >= now_us // MS:
            assert not bucket.is_idle(state, (reset_us // MS - 1) * MS)
        assert bucket.decide(state, reset_us) == bucket.decide(None, reset_us)


shaping_buckets = st.builds(
    LeakyBucket,
    rate=st.integers(1, 50),
    period_s=st.sampled_from([1, 60]),
    burst=st.integers(0, 20),
)


@given(bucket=shaping_buckets, gaps=st.lists(st.integers(0, 3_000_000), min_size=2, max_size=80))
def test_default_delay_forwards_at_most_one_request_per_period(
    bucket: LeakyBucket, gaps: list[int]
) -> None:
    """Without nodelay/delay=, admitted requests leave spaced by the rate: traffic shaping."""
    state: int | None = None
    forwarded_ms = []
    for now_us in cumulative(gaps):
        decision, state = bucket.decide(state, now_us)
        if decision.allowed:
            forwarded_ms.append(now_us // MS + round(decision.delay_s * 1000))
    gap_ms = 1_000_000 // bucket.rate_milli  # nginx's own period, from its truncated rate
    for earlier, later in itertools.pairwise(forwarded_ms):
        assert later - earlier >= gap_ms - 1

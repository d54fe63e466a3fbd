"""Realistic quotas on Redis: the window algorithms with limits up to 10**9 (and to the codec's
bound, 2**52 - 1) and windows up to 30 days (and to 2**51 microseconds), against the Python
algorithms, on a real Redis with a fake clock.

Requests cost 1, so a key is started in a state near its limit (written to Redis as the
store would have written it, and given to the Python algorithm alike), at instants near the
edges of its windows; then the same operations run through the store and the algorithms
(``run_against_python``), and every verdict and stored state must agree.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket, pack_state
from gateway.algorithms.sliding_log import SlidingLog, pack_log
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.stores.redis.codecs import codec_for
from tests.support import redis_harness
from tests.support.conformance import (
    T0_US,
    Op,
    close_client,
    delay_bounds,
    make_backend,
    run_against_python,
    run_rescale_against_python,
)

redis_server = redis_harness.redis_server

DAY_US = 86_400 * 10**6
MAX_LIMIT = 2**52 - 1  # the codecs' bound: 2 * limit + 1 below 2**53
MAX_WINDOW_US = 2**51 - 1  # and 4 * window below 2**53

limits = st.one_of(
    st.sampled_from([1, 2, 52_000, 100_000, 2_000_000, 10**9, MAX_LIMIT]),
    st.integers(1, 5),
    st.integers(1, 10**9),
)
windows_us = st.one_of(
    st.sampled_from([3_600 * 10**6, DAY_US, 30 * DAY_US, MAX_WINDOW_US]),
    st.integers(1, 30 * DAY_US),
)
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def near(value: int, limit: int) -> st.SearchStrategy[int]:
    """Integers in ``[0, limit]`` near ``value`` (its edges most often), or anywhere."""
    return st.one_of(
        st.integers(max(value - 3, 0), min(value + 3, limit)),
        st.integers(0, limit),
    )


@st.composite
def scenario(draw: st.DrawFn, window_us: int) -> tuple[int, list[Op]]:
    """A start instant near a window edge, and operations stepping to and across edges."""
    index = T0_US // window_us
    start_us = index * window_us + draw(near(0, window_us - 1) | near(window_us - 1, window_us - 1))
    step = st.one_of(
        st.just(0),
        st.integers(0, 3),
        st.integers(0, window_us),
        st.integers(max(window_us - 3, 0), window_us + 3),
        st.integers(-3, 0),
    )
    ops = draw(
        st.lists(
            st.tuples(
                step,
                st.sampled_from(["decide", "decide", "decide", "peek", "refund", "refund_exact"]),
                st.sampled_from(["a", "a", "b"]),
                delay_bounds,
            ),
            min_size=1,
            max_size=10,
        )
    )
    # The codecs leave the clock half the range of exact integers (below 2**52 microseconds,
    # the year 2112): a clock run from 0 through windows of 2**51 stops there.
    now_us = start_us
    for i, (step_us, *_) in enumerate(ops):
        now_us += step_us
        if now_us >= 2**52:
            return start_us, ops[:i]
    return start_us, ops


def run(
    request: pytest.FixtureRequest,
    algorithm: Any,
    start_us: int,
    ops: list[Op],
    seed: tuple[bytes, Any] | None,
) -> None:
    codec_for(algorithm)  # accepted by the Redis store
    backend = make_backend("redis", request)
    try:
        asyncio.run(
            run_against_python(
                backend,
                ["big"],
                ops,
                algorithms={"big": lambda: algorithm},
                start_us=start_us,
                seeds=None if seed is None else {"a": [seed]},
            )
        )
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


@SETTINGS
@given(data=st.data(), limit=limits, window_us=windows_us)
def test_fixed_window_quotas_match_python_at_the_extremes(
    request: pytest.FixtureRequest, data: st.DataObject, limit: int, window_us: int
) -> None:
    algorithm = FixedWindow(limit, window_us / 1e6)
    window_us = algorithm.window_us
    start_us, ops = data.draw(scenario(window_us))
    index = start_us // window_us - data.draw(st.integers(0, 1))
    count = data.draw(near(limit, limit))
    seed = (struct.pack("<dd", index, count), algorithm.pack_state(index, count))
    run(request, algorithm, start_us, ops, seed)


@SETTINGS
@given(data=st.data(), limit=limits, window_us=windows_us)
def test_sliding_window_quotas_match_python_at_the_extremes(
    request: pytest.FixtureRequest, data: st.DataObject, limit: int, window_us: int
) -> None:
    """The weighing of the previous count (``previous * span // window``) passes 2**53 here:
    the scripts compute it, and when to retry, in exact limbs."""
    algorithm = SlidingWindow(limit, window_us / 1e6)
    window_us = algorithm.window_us
    start_us, ops = data.draw(scenario(window_us))
    index = start_us // window_us - data.draw(st.integers(0, 1))
    previous = data.draw(near(limit, limit))
    current = data.draw(near(limit, limit))
    seed = (
        struct.pack("<ddd", index, previous, current),
        algorithm.pack_state(index, previous, current),
    )
    run(request, algorithm, start_us, ops, seed)


@SETTINGS
@given(data=st.data(), limit=limits, window_us=windows_us)
def test_sliding_log_quotas_match_python_at_the_extremes(
    request: pytest.FixtureRequest, data: st.DataObject, limit: int, window_us: int
) -> None:
    """A log holds one entry per unit: seeded with up to five, spread over the last window."""
    algorithm = SlidingLog(limit, window_us / 1e6)
    window_us = algorithm.window_us
    start_us, ops = data.draw(scenario(window_us))
    ages = data.draw(st.lists(near(window_us, window_us), max_size=min(limit, 5)))
    times = sorted(start_us - age for age in ages)
    seed = None
    if times:
        seed = (struct.pack(f"<{len(times)}d", *times), pack_log(times))
    run(request, algorithm, start_us, ops, seed)


# Reloads between large quotas: a sliding window's rescale to a new window length weighs the
# counts by old spans and old limits, products past 2**53 (the scripts' limbs).
BIG_VARIANTS: dict[str, list[Any]] = {
    "fixed": [
        lambda: FixedWindow(10**9, 30 * 86_400.0),
        lambda: FixedWindow(100_000, 86_400.0),
        lambda: FixedWindow(999_999_937, 86_400.000_001),
    ],
    "sliding": [
        lambda: SlidingWindow(10**9, 30 * 86_400.0),
        lambda: SlidingWindow(2_000_000, 3_600.0),
        lambda: SlidingWindow(999_999_937, 86_400.000_001),
        lambda: SlidingWindow(3, 29 * 86_400.0),
    ],
    # Not a small log next to a large one: a full log of 3 reloaded to 10**9 is resampled to
    # 10**9 entries (8 GB), in Redis and in Python alike.
    "log": [
        lambda: SlidingLog(10**9, 30 * 86_400.0),
        lambda: SlidingLog(10**9 - 7, 86_400.0),
    ],
}
big_steps_us = st.one_of(
    st.just(0),
    st.integers(0, 3),
    st.integers(0, 3_600 * 10**6),
    st.integers(0, 40 * DAY_US),
    st.integers(-3, 0),
)
big_rescale_operations = st.lists(
    st.tuples(
        big_steps_us,
        st.sampled_from(["decide", "decide", "decide", "peek", "refund", "refund_exact", "reload"]),
        st.integers(0, 1),
        st.sampled_from(["a", "b"]),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.parametrize("family", sorted(BIG_VARIANTS))
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=big_rescale_operations, offset_us=st.integers(0, 30 * DAY_US))
def test_large_quotas_are_rescaled_on_reload_as_in_python(
    family: str, request: pytest.FixtureRequest, ops: list[Any], offset_us: int
) -> None:
    backend = make_backend("redis", request)
    try:
        asyncio.run(
            run_rescale_against_python(
                backend, family, ops, table=BIG_VARIANTS, start_us=T0_US + offset_us
            )
        )
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


def _accepted(algorithm: Any) -> bool:
    try:
        codec_for(algorithm)
    except ValueError:
        return False
    return True


@SETTINGS
@given(
    data=st.data(),
    rate=st.one_of(st.sampled_from([1, 100_000, 2_000_000, 10**9]), st.integers(1, 10**9)),
    period_s=st.one_of(
        st.sampled_from([1, 3_600, 86_400, 30 * 86_400]), st.integers(1, 30 * 86_400)
    ),
    mode=st.sampled_from(["reject", "queue"]),
)
def test_token_bucket_quotas_match_python_at_the_extremes(
    request: pytest.FixtureRequest, data: st.DataObject, rate: int, period_s: int, mode: str
) -> None:
    """A daily, hourly or monthly quota as a bucket of up to 10**9 tokens: times are kept
    relative to now, so only the bucket in ticks must stay below 2**53 (a rate sharing no
    factor with its period is refused at load, see test_redis_codecs)."""
    capacity = data.draw(st.one_of(st.just(rate), near(rate, 10**9), st.integers(1, 10**9)))
    max_delay_s = data.draw(st.sampled_from([float("inf"), 0.0, 1.0, float(period_s)]))
    algorithm = TokenBucket(rate, period_s, max(capacity, 1), mode=mode, max_delay_s=max_delay_s)  # type: ignore[arg-type]
    assume(_accepted(algorithm))
    window_us = period_s * 10**6
    start_us, ops = data.draw(scenario(window_us))
    tpu = algorithm.ticks_per_us
    full = algorithm.max_credit_ticks
    # A theoretical arrival time near a full bucket, an empty one, or a debt (queue mode).
    offset = data.draw(
        st.one_of(near(full, full), st.integers(0, 3), st.integers(-algorithm.interval_ticks, 0))
    )
    tat = start_us * tpu - offset
    seed = (struct.pack("<dd", tat // tpu, tat % tpu), tat)
    run(request, algorithm, start_us, ops, seed)


@SETTINGS
@given(
    data=st.data(),
    rate=st.one_of(st.sampled_from([1, 1_000, 10**6, 10**7]), st.integers(1, 10**7)),
    period_s=st.sampled_from([1, 60]),
)
def test_leaky_bucket_quotas_match_python_at_the_extremes(
    request: pytest.FixtureRequest, data: st.DataObject, rate: int, period_s: int
) -> None:
    """High rates and bursts up to the codec's bound, after idle times of up to 30 days (the
    drain ``rate * ms`` passes 2**53 there)."""
    burst = data.draw(st.one_of(st.sampled_from([0, 10**9, 9 * 10**9 - 3]), st.integers(0, 10**6)))
    delay = data.draw(st.sampled_from([None, 0, burst // 2]))
    algorithm = LeakyBucket(rate, period_s, burst, delay)
    assume(_accepted(algorithm))
    start_us, ops = data.draw(scenario(30 * DAY_US))
    excess = data.draw(near(burst * 1000, burst * 1000))
    last_ms = start_us // 1000 - data.draw(st.one_of(near(0, 30 * 86_400_000), st.just(0)))
    seed = (struct.pack("<dd", excess, last_ms), pack_state(excess, last_ms))
    run(request, algorithm, start_us, ops, seed)

"""The Redis store's codecs: each limit's parameters for Lua, its share when divided between
replicas, and stored values read back as the Python algorithm's state."""

from __future__ import annotations

import struct

import pytest

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket, WarmingUpTokenBucket
from gateway.stores.redis.codecs import codec_for
from tests.support.conformance import T0_US


def test_each_limit_divided_between_replicas_is_never_more_lenient() -> None:
    assert LeakyBucket(10, 1, 20, 10).share(2) == LeakyBucket(5, 1, 10, 5)
    # 10r/s over 3: 200r/m (3.33 r/s), burst 20 -> 6, delay 10 -> 3
    assert LeakyBucket(10, 1, 20, 10).share(3) == LeakyBucket(200, 60, 6, 3)
    assert LeakyBucket(1, 60, 5, None).share(4) == LeakyBucket(1, 60, 1, None)
    assert SlidingWindow(600, 60.0).share(4) == SlidingWindow(150, 60.0)
    assert FixedWindow(5, 1.0).share(10) == FixedWindow(1, 1.0)
    assert SlidingLog(9, 2.0).share(2) == SlidingLog(4, 2.0)
    assert TokenBucket(1000, 1, 2000).share(3) == TokenBucket(1000, 3, 666)
    bucket = TokenBucket(1000, 1, 2000).share(3)
    assert isinstance(bucket, TokenBucket) and bucket.tokens(None, 0) == 666
    assert WarmingUpTokenBucket(6, 1, 2.0).share(2) == WarmingUpTokenBucket(6, 2, 2.0)
    limit = LeakyBucket(5, 1, 3, None)
    assert limit.share(1) is limit


def test_limits_whose_arithmetic_would_not_be_exact_in_lua_are_refused() -> None:
    with pytest.raises(ValueError, match=r"2 \* limit \+ 1 .*too large for the Redis store"):
        codec_for(SlidingWindow(2**52, 60.0))
    with pytest.raises(ValueError, match=r"4 \* window in microseconds .*2\*\*53"):
        codec_for(FixedWindow(10, 2.0**51 / 1e6))
    with pytest.raises(ValueError, match="too large for the Redis store"):
        codec_for(TokenBucket(999_983, 1, 10**10))
    # Realistic quotas: a billion in 30 days, a daily quota, the largest limit and window.
    codec_for(SlidingWindow(10**9, 30 * 86_400.0))
    codec_for(FixedWindow(100_000, 86_400.0))
    codec_for(SlidingLog(2**52 - 1, (2**51 - 1) / 1e6))
    # Token buckets keep times relative to now: the bucket in ticks bounds them. A round
    # quota's rate divides its period in microseconds (a tick is a microsecond or more); a
    # prime rate over 30 days makes ticks of 1 / 999_999_937 us, a bucket of 2.6e21 ticks.
    for rate, period_s in ((10**9, 30 * 86_400), (100_000, 86_400), (2_000_000, 3_600)):
        codec_for(TokenBucket(rate, period_s, rate))
    with pytest.raises(ValueError, match=r"4 \* bucket capacity in ticks .*2\*\*53"):
        codec_for(TokenBucket(999_999_937, 30 * 86_400, 10**9))


def test_state_codecs_read_back_what_the_python_algorithm_holds() -> None:
    """The codecs' view of a stored value (the parameters it was written under, then the
    state), on values written by hand."""
    leaky = codec_for(LeakyBucket(5, 1, 3, None))
    assert leaky.decode_state(leaky.params + struct.pack("<dd", 2000, 123_456)) == (
        2000 << 44 | 123_456
    )
    log = codec_for(SlidingLog(3, 1.0))
    packed = log.params + struct.pack("<ddd", T0_US, T0_US + 1, T0_US + 2)
    assert log.decode_state(packed) == struct.pack("=3q", T0_US, T0_US + 1, T0_US + 2)
    bucket = codec_for(TokenBucket(7, 1, 3))  # 7 ticks per microsecond
    assert bucket.decode_state(bucket.params + struct.pack("<dd", T0_US, 5)) == T0_US * 7 + 5
    with pytest.raises(ValueError, match="other parameters"):
        codec_for(TokenBucket(8, 1, 3)).decode_state(bucket.params + struct.pack("<dd", T0_US, 5))

"""One codec per algorithm: its parameters for Lua, and the script's reply as a Decision.

Codecs read only what the algorithms publish (their properties); a limit's share when Redis is
down is the algorithm's own ``share(replicas)``.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Final, Protocol

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.calendar_period import Period
from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.concurrency import Concurrency
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket, pack_state
from gateway.algorithms.sliding_log import SlidingLog, pack_log
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket, WarmingUpTokenBucket

_INF: Final = float("inf")
# Lua numbers are doubles: integers are exact below 2**53. Each codec checks the largest
# intermediate value its script can form (requests cost 1).
_EXACT_LIMIT: Final = 2**53


def _exact(what: str, value: float) -> None:
    if not value < _EXACT_LIMIT:
        raise ValueError(
            f"{what} ({value:g}) is too large for the Redis store: its Lua arithmetic is exact "
            "only below 2**53"
        )


class Codec(Protocol):
    params: bytes
    nominal_limit: int

    def decision(self, allowed: int, a: int, b: int, c: int, d: int) -> Decision:
        """The Python algorithm's Decision from the script's four integers."""
        ...

    def decode_state(self, raw: bytes) -> Any:
        """The Python algorithm's state for a stored Redis value, written under this codec's
        parameters (tests, debugging)."""
        ...


def _state_of(raw: bytes, params: bytes) -> bytes:
    """The state in a stored value: the parameters it was written under come first."""
    if not raw.startswith(params):
        raise ValueError("the value was written under other parameters")
    return raw[len(params) :]


class LeakyBucketCodec:
    __slots__ = ("_limit", "nominal_limit", "params")

    def __init__(self, algorithm: LeakyBucket) -> None:
        burst_milli = algorithm.burst * 1000
        _exact("(burst + 2) * 10**6", (burst_milli + 2000) * 1000)
        delay_milli = _INF if algorithm.delay is None else algorithm.delay * 1000
        self.params = b"L" + struct.pack("<ddd", algorithm.rate_milli, burst_milli, delay_milli)
        self._limit = self.nominal_limit = algorithm.burst + 1

    def decision(
        self, allowed: int, delay_ms: int, retry_us: int, remaining: int, reset_us: int
    ) -> Decision:
        if allowed:
            return Decision(
                True,
                delay_ms / 1000,
                0.0,
                self._limit,
                remaining,
                reset_us / 1e6 if reset_us > 0 else 0.0,
            )
        if retry_us < 0:
            return Decision(False, 0.0, _INF, self._limit, 0, 0.0)
        return Decision(False, 0.0, retry_us / 1e6, self._limit, 0, reset_us / 1e6)

    def decode_state(self, raw: bytes) -> int:
        excess_milli, last_ms = struct.unpack("<dd", _state_of(raw, self.params))
        return pack_state(int(excess_milli), int(last_ms))


class _WindowCodec:
    """Fixed window, sliding window and sliding log reply alike."""

    __slots__ = ("_algorithm", "_limit", "nominal_limit", "params")

    def __init__(self, code: bytes, algorithm: FixedWindow | SlidingWindow | SlidingLog) -> None:
        # Counts stay below 2 * limit + cost; instants below now + 2 * window, which leaves
        # the clock half the range (2**52 microseconds is the year 2112). Products of a count
        # and a span (a sliding window's weighing) are exact in the scripts' limbs.
        _exact("2 * limit + 1", 2 * algorithm.limit + 1)
        _exact("4 * window in microseconds", 4 * algorithm.window_us)
        self._algorithm = algorithm
        self._limit = self.nominal_limit = algorithm.limit
        self.params = code + struct.pack("<dd", algorithm.limit, algorithm.window_us)

    def decision(
        self, allowed: int, _: int, retry_us: int, remaining: int, reset_us: int
    ) -> Decision:
        if allowed:
            return Decision(True, 0.0, 0.0, self._limit, remaining, reset_us / 1e6)
        retry_after_s = _INF if retry_us < 0 else retry_us / 1e6
        return Decision(False, 0.0, retry_after_s, self._limit, remaining, reset_us / 1e6)

    def decode_state(self, raw: bytes) -> Any:
        raw = _state_of(raw, self.params)
        algorithm = self._algorithm
        if isinstance(algorithm, SlidingLog):
            return pack_log([int(t) for t in struct.unpack(f"<{len(raw) // 8}d", raw)])
        if isinstance(algorithm, SlidingWindow):
            index, previous, current = struct.unpack("<ddd", raw)
            return algorithm.pack_state(int(index), int(previous), int(current))
        index, count = struct.unpack("<dd", raw)
        return algorithm.pack_state(int(index), int(count))


class CalendarCodec:
    """A calendar window: a fixed window's reply, and each call the periods the script picks
    from (``periods``), read off the calendar by the gateway."""

    __slots__ = ("_algorithm", "_last", "_limit", "nominal_limit", "params")

    def __init__(self, algorithm: CalendarWindow) -> None:
        _exact("2 * limit + 1", 2 * algorithm.limit + 1)
        self._algorithm = algorithm
        self._limit = self.nominal_limit = algorithm.limit
        # The period and zone as a number: another of either starts the keys afresh.
        calendar = zlib.crc32(f"{algorithm.period} {algorithm.timezone}".encode())
        self.params = b"C" + struct.pack("<dd", algorithm.limit, calendar)
        self._last: tuple[Period, bytes] | None = None

    def periods(self, unix_us: int) -> bytes:
        """``o0 s0 o1 s1 e1 o2 e2``: the period holding ``unix_us`` (its first day's ordinal,
        start and end), the one before it (ordinal, start) and the one after (ordinal, end);
        encoded once per period."""
        algorithm = self._algorithm
        current = algorithm.period_at(unix_us)
        last = self._last
        if last is not None and last[0] is current:
            return last[1]
        before = algorithm.period_before(current)
        after = algorithm.period_after(current)
        text = b"%d %d %d %d %d %d %d" % (
            before.ordinal,
            before.start_us,
            current.ordinal,
            current.start_us,
            current.end_us,
            after.ordinal,
            after.end_us,
        )
        self._last = (current, text)
        return text

    def decision(
        self, allowed: int, _: int, retry_us: int, remaining: int, reset_us: int
    ) -> Decision:
        if allowed:
            return Decision(True, 0.0, 0.0, self._limit, remaining, reset_us / 1e6)
        retry_after_s = _INF if retry_us < 0 else retry_us / 1e6
        return Decision(False, 0.0, retry_after_s, self._limit, remaining, reset_us / 1e6)

    def decode_state(self, raw: bytes) -> int:
        index, count = struct.unpack("<dd", _state_of(raw, self.params))
        return self._algorithm.pack_state(int(index), int(count))


def _ticks(algorithm: TokenBucket | WarmingUpTokenBucket) -> tuple[int, int, float]:
    """``(ticks_per_us, interval_ticks, ticks_per_s)`` of a token bucket's exact tick clock."""
    _exact("ticks per second", algorithm.ticks_per_us * 1_000_000)
    return algorithm.ticks_per_us, algorithm.interval_ticks, algorithm.ticks_per_s


class TokenBucketCodec:
    __slots__ = ("_capacity", "_ticks_per_s", "_tpu", "nominal_limit", "params")

    def __init__(self, algorithm: TokenBucket) -> None:
        tpu, interval, ticks_per_s = _ticks(algorithm)
        max_credit = algorithm.max_credit_ticks
        _exact("4 * bucket capacity in ticks", 4 * max_credit)
        self._tpu = tpu
        self._ticks_per_s = ticks_per_s
        self._capacity = self.nominal_limit = algorithm.capacity
        self.params = b"T" + struct.pack(
            "<dddddd",
            tpu,
            interval,
            max_credit,
            1 if algorithm.mode == "queue" else 0,
            algorithm.capacity,
            algorithm.max_delay_ticks,
        )

    def decision(
        self, allowed: int, delay_ticks: int, retry_ticks: int, remaining: int, reset_ticks: int
    ) -> Decision:
        ticks_per_s = self._ticks_per_s
        if allowed:
            return Decision(
                True,
                delay_ticks / ticks_per_s if delay_ticks > 0 else 0.0,
                0.0,
                self._capacity,
                remaining,
                reset_ticks / ticks_per_s,
            )
        retry_after_s = _INF if retry_ticks < 0 else retry_ticks / ticks_per_s
        return Decision(
            False, 0.0, retry_after_s, self._capacity, remaining, reset_ticks / ticks_per_s
        )

    def decode_state(self, raw: bytes) -> int:
        whole_us, frac = struct.unpack("<dd", _state_of(raw, self.params))
        return int(whole_us) * self._tpu + int(frac)


class WarmingUpCodec:
    __slots__ = ("_credit_bits", "_ticks_per_s", "_tpu", "nominal_limit", "params")

    def __init__(self, algorithm: WarmingUpTokenBucket) -> None:
        tpu, interval, ticks_per_s = _ticks(algorithm)
        warmup_ticks = algorithm.warmup_ticks
        _exact("4 * warm-up in ticks", 4 * (warmup_ticks + interval))
        self._tpu = tpu
        self._ticks_per_s = ticks_per_s
        self._credit_bits = algorithm.credit_bits
        self.nominal_limit = 1
        self.params = b"W" + struct.pack(
            "<ddddddd",
            tpu,
            interval,
            warmup_ticks,
            algorithm.max_delay_ticks,
            algorithm.stable_interval_us,
            algorithm.threshold_permits,
            algorithm.slope,
        )

    def decision(
        self, allowed: int, delay_ticks: int, retry_ticks: int, remaining: int, reset_ticks: int
    ) -> Decision:
        ticks_per_s = self._ticks_per_s
        if allowed:
            return Decision(
                True,
                delay_ticks / ticks_per_s if delay_ticks > 0 else 0.0,
                0.0,
                1,
                remaining,
                reset_ticks / ticks_per_s,
            )
        return Decision(False, 0.0, retry_ticks / ticks_per_s, 1, 0, reset_ticks / ticks_per_s)

    def decode_state(self, raw: bytes) -> int:
        whole_us, frac, credit = struct.unpack("<ddd", _state_of(raw, self.params))
        return ((int(whole_us) * self._tpu + int(frac)) << self._credit_bits) | int(credit)


class ConcurrencyCodec:
    """A concurrency limit's slots, held by replicas (``lua/concurrency.lua``): the parameters
    end with the replica's id, under which its slots are kept, and the time they live unless
    renewed."""

    __slots__ = ("_limit", "nominal_limit", "params")

    def __init__(self, algorithm: Concurrency, owner: bytes, slot_ttl_s: float) -> None:
        _exact("limit", algorithm.limit)
        self._limit = self.nominal_limit = algorithm.limit
        retry_us = round(algorithm.retry_after_s * 1e6)
        _exact("retry_after in microseconds", retry_us)
        self.params = b"N" + struct.pack("<ddd", algorithm.limit, retry_us, slot_ttl_s * 1e6)
        self.params += owner

    def decision(self, allowed: int, _: int, retry_us: int, remaining: int, __: int) -> Decision:
        if allowed:
            return Decision(True, 0.0, 0.0, self._limit, remaining, 0.0)
        retry_after_s = _INF if retry_us < 0 else retry_us / 1e6
        return Decision(False, 0.0, retry_after_s, self._limit, remaining, 0.0)

    def decode_state(self, raw: bytes) -> int:
        held, _ = struct.unpack("<dd", raw)
        return int(held)


def codec_for(algorithm: Algorithm[Any], owner: bytes = b"", slot_ttl_s: float = 10.0) -> Codec:
    """The Lua mirror's codec for an algorithm; ``ValueError`` if there is none or its
    parameters cannot be computed exactly in Lua (refused when the policy is loaded).
    A concurrency limit's slots are kept under ``owner``, this replica's id, for
    ``slot_ttl_s`` unless renewed."""
    if isinstance(algorithm, LeakyBucket):
        return LeakyBucketCodec(algorithm)
    if isinstance(algorithm, SlidingLog):
        return _WindowCodec(b"G", algorithm)
    if isinstance(algorithm, SlidingWindow):
        return _WindowCodec(b"S", algorithm)
    if isinstance(algorithm, FixedWindow):
        return _WindowCodec(b"F", algorithm)
    if isinstance(algorithm, CalendarWindow):
        return CalendarCodec(algorithm)
    if isinstance(algorithm, WarmingUpTokenBucket):
        return WarmingUpCodec(algorithm)
    if isinstance(algorithm, TokenBucket):
        return TokenBucketCodec(algorithm)
    if isinstance(algorithm, Concurrency):
        return ConcurrencyCodec(algorithm, owner, slot_ttl_s)
    raise ValueError(f"the Redis store has no Lua mirror of {algorithm!r}")

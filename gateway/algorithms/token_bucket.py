"""Token bucket with Guava ``RateLimiter`` semantics: bursty, or warming up from cold.

Two classes, one policy name (``token_bucket``); ``token_bucket()`` builds the right one from
a policy's rate, burst, mode, warm-up and max delay.

``TokenBucket`` is Guava's ``SmoothBursty``: ``capacity`` tokens, refilled at ``rate`` per
``period_s``. In ``reject`` mode it is the classic bucket: a request of ``cost`` passes when
``cost`` tokens are there and is rejected otherwise, so no span T ever admits more than
``capacity + rate * T``. In ``queue`` mode it is ``RateLimiter.tryAcquire(cost, max_delay)``:
a request waits for the tokens owed by the requests before it (its delay), takes its own
tokens at once, borrowing against the future if the bucket is short, and the *next* caller
pays the debt. A request whose wait would exceed ``max_delay_s`` is rejected and charged
nothing.

Guava keeps ``storedPermits`` (a double) and ``nextFreeTicketMicros``. With ``SmoothBursty``
stored permits are free (``storedPermitsToWaitTime`` is 0) and refill at one per stable
interval, so ``storedPermits > 0`` only while ``nextFreeTicketMicros <= now``: both collapse
into one time, ``tat = nextFreeTicket - storedPermits * interval`` (the generic cell rate
algorithm's theoretical arrival time). ``resync`` is ``tat = max(tat, now - capacity *
interval)``; ``reserveEarliestAvailable`` waits ``max(tat - now, 0)`` and adds ``cost *
interval``; tokens now are ``(now - tat) / interval``. Times are kept in ticks of ``1 / r``
microseconds, ``r = rate / gcd(rate, period_us)`` (1 for any rate dividing 10**6 per second),
so one token is a whole number of ticks and nothing is ever rounded: the state is one int.

One deliberate difference: Guava creates a limiter empty, just before its first use; a key
seen for the first time here starts full, because its client has been idle forever. The
documented Guava waits do not depend on it (see the tests).

``WarmingUpTokenBucket`` is Guava's ``SmoothWarmingUp`` with ``coldFactor`` 3, starting cold:
stored permits mean coldness, and spending them costs the integral of a line from the stable
interval (at ``thresholdPermits``) up to three times it (at ``maxPermits``), so a cold key
gets a third of the rate and reaches the full rate over ``warmup_s`` of saturation. Its
arithmetic is Guava's (``thresholdPermits = 0.5 * warmup / stableInterval``, ``maxPermits =
thresholdPermits + 2 * warmup / (stableInterval + coldInterval)``, ``slope``,
``storedPermitsToWaitTime``), with stored permits kept as ticks of credit: with coldFactor 3
``coolDownIntervalMicros == stableIntervalMicros``, so a tick of idle time is a tick of credit
and ``resync`` is exact. Guava's warm-up has no burst; its ``reject`` mode is
``tryAcquire(cost)``: admitted when no earlier reservation is outstanding.

Both states are ints and ``now_us`` must not be negative.
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal

from gateway.algorithms.base import Algorithm, Decides, Decision, require_int, require_number

Mode = Literal["reject", "queue"]
COLD_FACTOR: Final = 3.0
_INF: Final = float("inf")
_MODES: Final = ("reject", "queue")


class _Rate:
    """``rate`` tokens per ``period_s`` in exact ticks (``ticks_per_us`` ticks a microsecond)."""

    __slots__ = ("interval_ticks", "period_us", "rate", "ticks_per_s", "ticks_per_us")

    def __init__(self, rate: int, period_s: float) -> None:
        require_int("rate", rate)
        if rate < 1:
            raise ValueError(f"rate must be a positive integer, got {rate!r}")
        require_number("period", period_s)
        if not period_s > 0:
            raise ValueError(f"period must be a positive number of seconds, got {period_s!r}")
        period_us = round(period_s * 1_000_000)
        if period_us < 1:
            raise ValueError(f"period must be at least 1 microsecond, got {period_s!r} s")
        common = math.gcd(rate, period_us)
        self.rate = rate
        self.period_us = period_us
        self.ticks_per_us = rate // common
        self.interval_ticks = period_us // common  # one token
        self.ticks_per_s = float(self.ticks_per_us * 1_000_000)

    def us_to_ticks(self, us: float) -> int | float:
        """A duration in ticks; infinity stays infinity."""
        if us == _INF:
            return _INF
        return round(us) * self.ticks_per_us


def _max_delay_us(max_delay_s: float) -> float:
    require_number("max_delay", max_delay_s)
    if not max_delay_s >= 0:
        raise ValueError(f"max_delay must not be negative, got {max_delay_s!r}")
    return max_delay_s * 1_000_000 if max_delay_s != _INF else _INF


def _check_mode(mode: str) -> Mode:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'reject' or 'queue', got {mode!r}")
    return mode  # type: ignore[return-value]


class _Bucket(Decides):
    """What both token buckets share: their name, their rate, and equality by parameters
    (the policy engine keeps a limit's state across a reload when its algorithm is equal)."""

    __slots__ = ()
    _rate: _Rate
    _max_delay_ticks: int | float

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return "token_bucket"

    @property
    def rate(self) -> int:
        return self._rate.rate

    @property
    def period_s(self) -> float:
        return self._rate.period_us / 1e6

    # The exact tick clock (``_Rate``) and the bounds in ticks, as the Lua mirror needs them.
    @property
    def ticks_per_us(self) -> int:
        return self._rate.ticks_per_us

    @property
    def interval_ticks(self) -> int:
        """One token, in ticks."""
        return self._rate.interval_ticks

    @property
    def ticks_per_s(self) -> float:
        return self._rate.ticks_per_s

    @property
    def max_delay_ticks(self) -> int | float:
        """The longest wait in queue mode, in ticks (infinity: no bound)."""
        return self._max_delay_ticks

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Bucket)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self), *self._key()))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return _rebuild, (type(self).__name__, self._arguments())

    def _arguments(self) -> tuple[object, ...]:
        raise NotImplementedError


class TokenBucket(_Bucket):
    """Guava ``SmoothBursty`` per key: ``capacity`` tokens, ``rate`` per ``period_s``.

    The state is the bucket's theoretical arrival time in ticks (see the module docstring):
    full when at most ``now - capacity * interval``, in debt when after ``now``.
    """

    __slots__ = (
        "_max_credit_ticks",
        "_max_delay_ticks",
        "_rate",
        "capacity",
        "max_delay_s",
        "mode",
    )

    def __init__(
        self,
        rate: int,
        period_s: float = 1,
        capacity: int = 1,
        *,
        mode: Mode = "reject",
        max_delay_s: float = _INF,
    ) -> None:
        """``rate`` tokens per ``period_s`` into a bucket of ``capacity``; ``queue`` mode waits
        (Guava ``tryAcquire(cost, max_delay)``), ``reject`` mode never borrows. Guava's
        ``maxBurstSeconds`` is ``capacity * period_s / rate``."""
        self._rate = _Rate(rate, period_s)
        require_int("capacity", capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self.mode = _check_mode(mode)
        self.max_delay_s = max_delay_s
        self._max_delay_ticks = self._rate.us_to_ticks(_max_delay_us(max_delay_s))
        self._max_credit_ticks = capacity * self._rate.interval_ticks

    @property
    def max_credit_ticks(self) -> int:
        """A full bucket, in ticks."""
        return self._max_credit_ticks

    def share(self, replicas: int) -> TokenBucket:
        if replicas == 1:
            return self
        return TokenBucket(
            self.rate,
            self.period_s * replicas,
            max(self.capacity // replicas, 1),
            mode=self.mode,
            max_delay_s=self.max_delay_s,
        )

    def __repr__(self) -> str:
        return (
            f"TokenBucket(rate={self.rate}, period_s={self.period_s:g}, "
            f"capacity={self.capacity}, mode={self.mode!r}, max_delay_s={self.max_delay_s:g})"
        )

    def _key(self) -> tuple[int, int, int, str, float]:
        return (self.rate, self._rate.period_us, self.capacity, self.mode, self.max_delay_s)

    def _arguments(self) -> tuple[object, ...]:
        return (self.rate, self.period_s, self.capacity, self.mode, self.max_delay_s)

    def state(self, stored_permits: float, next_free_us: int) -> int:
        """The state Guava's ``(storedPermits, nextFreeTicketMicros)`` describe (rounded down to
        a tick of stored credit); ``state(0, t)`` is a limiter Guava created at ``t``."""
        rate = self._rate
        credit = math.floor(stored_permits * rate.interval_ticks)
        return next_free_us * rate.ticks_per_us - min(credit, self._max_credit_ticks)

    def tokens(self, state: int | None, now_us: int) -> float:
        """Tokens in the bucket at ``now_us``; negative while the bucket owes (queue mode)."""
        rate = self._rate
        floor_ticks = now_us * rate.ticks_per_us - self._max_credit_ticks
        tat = floor_ticks if state is None or state < floor_ticks else state
        return (now_us * rate.ticks_per_us - tat) / rate.interval_ticks

    def decide(
        self, state: int | None, now_us: int, cost: int = 1, *, max_delay_s: float | None = None
    ) -> tuple[Decision, int | None]:
        """One request of ``cost``; ``max_delay_s`` overrides the limit's own in queue mode."""
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        rate = self._rate
        ticks_per_us = rate.ticks_per_us
        # Most rates count in microseconds (one tick each): compiled, multiplying an instant in
        # microseconds goes through Python ints, about 650 instructions.
        now = now_us if ticks_per_us == 1 else now_us * ticks_per_us
        max_credit = self._max_credit_ticks
        # resync: credit beyond a full bucket is lost.
        tat = now - max_credit
        if state is not None and state > tat:
            tat = state
        interval = rate.interval_ticks
        tat_new = tat + cost * interval
        if self.mode == "queue":
            wait = tat - now
            max_delay = self._max_delay_ticks
            if max_delay_s is not None:
                max_delay = rate.us_to_ticks(_max_delay_us(max_delay_s))
            if wait > max_delay:
                return self._rejection(now, tat, wait - max_delay), state
            delay_s = wait / rate.ticks_per_s if wait > 0 else 0.0
        else:
            if tat_new > now:
                retry = tat_new - now if cost <= self.capacity else _INF
                return self._rejection(now, tat, retry), state
            delay_s = 0.0
        return (
            Decision(
                True,
                delay_s,
                0.0,
                self.capacity,
                (now - tat_new) // interval if tat_new < now else 0,
                (tat_new + max_credit - now) / rate.ticks_per_s,
            ),
            tat_new,
        )

    def _rejection(self, now: int, tat: int, retry_ticks: float) -> Decision:
        rate = self._rate
        return Decision(
            False,
            0.0,
            retry_ticks / rate.ticks_per_s,
            self.capacity,
            (now - tat) // rate.interval_ticks if tat < now else 0,
            (tat + self._max_credit_ticks - now) / rate.ticks_per_s,
        )

    def is_idle(self, state: int, now_us: int) -> bool:
        return state <= now_us * self._rate.ticks_per_us - self._max_credit_ticks

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Put ``cost`` tokens back (paying off debt first), up to a full bucket; exact when
        nothing was charged since. It may return tokens the bucket would have lost to
        overflowing while the request waited, at most ``cost``."""
        floor_ticks = now_us * self._rate.ticks_per_us - self._max_credit_ticks
        refunded = state - cost * self._rate.interval_ticks
        return refunded if refunded > floor_ticks else floor_ticks

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Keep the bucket as full relative to its capacity (rounded down); a debt (queue
        mode) keeps its length in time, rounded up to a microsecond."""
        if not isinstance(previous, TokenBucket):
            return None
        old_rate = previous._rate
        old_now = now_us * old_rate.ticks_per_us
        old_tat = max(state, old_now - previous._max_credit_ticks)
        now = now_us * self._rate.ticks_per_us
        if old_tat > old_now:
            debt_us = -(-(old_tat - old_now) // old_rate.ticks_per_us)
            return now + debt_us * self._rate.ticks_per_us
        credit = (old_now - old_tat) * self._max_credit_ticks // previous._max_credit_ticks
        if credit >= self._max_credit_ticks:
            return None
        return now - credit


class WarmingUpTokenBucket(_Bucket):
    """Guava ``SmoothWarmingUp`` (coldFactor 3) per key, starting cold.

    The state packs Guava's two fields: ``next_free_ticks << credit_bits | credit_ticks``, the
    credit being ``storedPermits * stableInterval`` in ticks.
    """

    __slots__ = (
        "_credit_bits",
        "_credit_mask",
        "_max_delay_ticks",
        "_rate",
        "_warmup_ticks",
        "max_delay_s",
        "max_permits",
        "mode",
        "slope",
        "stable_interval_us",
        "threshold_permits",
        "warmup_s",
    )

    def __init__(
        self,
        rate: int,
        period_s: float = 1,
        warmup_s: float = 1.0,
        *,
        mode: Mode = "reject",
        max_delay_s: float = _INF,
    ) -> None:
        """Stable ``rate`` per ``period_s``, reached after ``warmup_s`` of saturation."""
        self._rate = _Rate(rate, period_s)
        require_number("warmup", warmup_s)
        if not warmup_s > 0:
            raise ValueError(f"warmup must be a positive number of seconds, got {warmup_s!r}")
        warmup_us = round(warmup_s * 1_000_000)
        if warmup_us < 1:
            raise ValueError(f"warmup must be at least 1 microsecond, got {warmup_s!r} s")
        self.warmup_s = warmup_s
        self.mode = _check_mode(mode)
        self.max_delay_s = max_delay_s
        # Guava's tryAcquire(permits) (no timeout) is its reject mode.
        self._max_delay_ticks = (
            self._rate.us_to_ticks(_max_delay_us(max_delay_s)) if mode == "queue" else 0
        )
        self._warmup_ticks = warmup_us * self._rate.ticks_per_us
        self._credit_bits = self._warmup_ticks.bit_length()
        self._credit_mask = (1 << self._credit_bits) - 1
        # SmoothWarmingUp.doSetRate, in Guava's doubles.
        stable_interval_us = self._rate.period_us / self._rate.rate
        cold_interval_us = stable_interval_us * COLD_FACTOR
        self.stable_interval_us = stable_interval_us
        self.threshold_permits = 0.5 * warmup_us / stable_interval_us
        self.max_permits = self.threshold_permits + 2.0 * warmup_us / (
            stable_interval_us + cold_interval_us
        )
        self.slope = (cold_interval_us - stable_interval_us) / (
            self.max_permits - self.threshold_permits
        )

    @property
    def warmup_ticks(self) -> int:
        return self._warmup_ticks

    @property
    def credit_bits(self) -> int:
        """Bits of the packed state that hold the credit (below them: next-free ticks)."""
        return self._credit_bits

    def share(self, replicas: int) -> WarmingUpTokenBucket:
        if replicas == 1:
            return self
        return WarmingUpTokenBucket(
            self.rate,
            self.period_s * replicas,
            self.warmup_s,
            mode=self.mode,
            max_delay_s=self.max_delay_s,
        )

    def __repr__(self) -> str:
        return (
            f"WarmingUpTokenBucket(rate={self.rate}, period_s={self.period_s:g}, "
            f"warmup_s={self.warmup_s:g}, mode={self.mode!r}, max_delay_s={self.max_delay_s:g})"
        )

    def _key(self) -> tuple[int, int, int, str, float]:
        return (self.rate, self._rate.period_us, self._warmup_ticks, self.mode, self.max_delay_s)

    def _arguments(self) -> tuple[object, ...]:
        return (self.rate, self.period_s, self.warmup_s, self.mode, self.max_delay_s)

    def state(self, stored_permits: float, next_free_us: int) -> int:
        """The state Guava's ``(storedPermits, nextFreeTicketMicros)`` describe."""
        credit = math.floor(stored_permits * self._rate.interval_ticks)
        credit = min(max(credit, 0), self._warmup_ticks)
        return (next_free_us * self._rate.ticks_per_us) << self._credit_bits | credit

    def stored_permits(self, state: int | None, now_us: int) -> float:
        """Guava's ``storedPermits`` after ``resync(now_us)``: ``max_permits`` when cold."""
        _, credit = self._resync(state, now_us * self._rate.ticks_per_us)
        return credit / self._rate.interval_ticks

    def _resync(self, state: int | None, now: int) -> tuple[int, int]:
        """Guava's ``resync``: idle time becomes stored permits, up to cold."""
        if state is None:
            return now, self._warmup_ticks
        next_free = state >> self._credit_bits
        credit = state & self._credit_mask
        if now > next_free:
            credit += now - next_free
            if credit > self._warmup_ticks:
                credit = self._warmup_ticks
            next_free = now
        return next_free, credit

    def stored_permits_to_wait_time_us(self, stored_permits: float, permits_to_take: float) -> int:
        """Guava's ``SmoothWarmingUp.storedPermitsToWaitTime``: the area under the throttling
        line over ``[stored_permits - permits_to_take, stored_permits]``."""
        available_above_threshold = stored_permits - self.threshold_permits
        micros = 0
        if available_above_threshold > 0.0:
            above_to_take = min(available_above_threshold, permits_to_take)
            length = self._permits_to_time(available_above_threshold) + self._permits_to_time(
                available_above_threshold - above_to_take
            )
            micros = int(above_to_take * length / 2.0)
            permits_to_take -= above_to_take
        micros += int(self.stable_interval_us * permits_to_take)
        return micros

    def _permits_to_time(self, permits: float) -> float:
        return self.stable_interval_us + permits * self.slope

    def decide(
        self, state: int | None, now_us: int, cost: int = 1, *, max_delay_s: float | None = None
    ) -> tuple[Decision, int | None]:
        """Guava ``tryAcquire(cost, max_delay)``; ``max_delay_s`` overrides the limit's own in
        queue mode."""
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        rate = self._rate
        now = now_us * rate.ticks_per_us
        next_free, credit = self._resync(state, now)
        wait = next_free - now
        max_delay = self._max_delay_ticks
        if max_delay_s is not None and self.mode == "queue":
            max_delay = rate.us_to_ticks(_max_delay_us(max_delay_s))
        if wait > max_delay:
            return (
                Decision(
                    False,
                    0.0,
                    (wait - max_delay) / rate.ticks_per_s,
                    1,
                    0,
                    (next_free + self._warmup_ticks - credit - now) / rate.ticks_per_s,
                ),
                state,
            )
        # reserveEarliestAvailable: stored permits first, at their warm-up price, then fresh
        # ones at the stable interval.
        interval = rate.interval_ticks
        required = cost * interval
        spend = required if credit >= required else credit
        wait_ticks = (
            self.stored_permits_to_wait_time_us(credit / interval, spend / interval)
            * rate.ticks_per_us
            + required
            - spend
        )
        next_free += wait_ticks
        credit -= spend
        return (
            Decision(
                True,
                wait / rate.ticks_per_s if wait > 0 else 0.0,
                0.0,
                1,
                1 if next_free <= now else 0,
                (next_free + self._warmup_ticks - credit - now) / rate.ticks_per_s,
            ),
            next_free << self._credit_bits | credit,
        )

    def is_idle(self, state: int, now_us: int) -> bool:
        now = now_us * self._rate.ticks_per_us
        next_free, credit = self._resync(state, now)
        return next_free <= now and credit >= self._warmup_ticks

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Pull the next free time back by ``cost`` stable intervals, never before now; stored
        permits (coldness) are not given back, so the key stays as warm as it got."""
        now = now_us * self._rate.ticks_per_us
        next_free = state >> self._credit_bits
        if next_free <= now:
            return state
        next_free -= cost * self._rate.interval_ticks
        if next_free < now:
            next_free = now
        return next_free << self._credit_bits | (state & self._credit_mask)

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Keep the same share of coldness (rounded up: colder is stricter) and the same next
        free time (rounded up to a microsecond)."""
        if not isinstance(previous, WarmingUpTokenBucket):
            return None
        old_rate = previous._rate
        next_free, credit = previous._resync(state, now_us * old_rate.ticks_per_us)
        credit_new = -(-credit * self._warmup_ticks // previous._warmup_ticks)
        next_free_us = -(-next_free // old_rate.ticks_per_us)
        if credit_new >= self._warmup_ticks and next_free_us <= now_us:
            return None
        return (next_free_us * self._rate.ticks_per_us) << self._credit_bits | credit_new


def _rebuild(kind: str, arguments: tuple[Any, ...]) -> TokenBucket | WarmingUpTokenBucket:
    """A pickled bucket, made again from its parameters."""
    rate, period_s, size, mode, max_delay_s = arguments
    if kind == "WarmingUpTokenBucket":
        return WarmingUpTokenBucket(rate, period_s, size, mode=mode, max_delay_s=max_delay_s)
    return TokenBucket(rate, period_s, size, mode=mode, max_delay_s=max_delay_s)


def token_bucket(
    rate: int,
    period_s: float = 1,
    capacity: int = 1,
    *,
    mode: Mode = "reject",
    warmup_s: float | None = None,
    max_delay_s: float = _INF,
) -> TokenBucket | WarmingUpTokenBucket:
    """The token bucket a policy describes: ``rate`` per ``period_s``, ``capacity`` (the
    policy's ``burst``), ``mode``, optional ``warmup_s`` and ``max_delay_s`` (queue mode)."""
    if warmup_s is None:
        return TokenBucket(rate, period_s, capacity, mode=mode, max_delay_s=max_delay_s)
    if capacity != 1:
        raise ValueError(
            "a token bucket with warm-up has no burst (Guava's SmoothWarmingUp never serves "
            f"stored permits faster than the stable rate): leave burst at 1, got {capacity!r}"
        )
    return WarmingUpTokenBucket(rate, period_s, warmup_s, mode=mode, max_delay_s=max_delay_s)

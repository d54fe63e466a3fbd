"""Leaky bucket with nginx ``limit_req`` semantics, bit for bit.

This is the arithmetic of ``src/http/modules/ngx_http_limit_req_module.c`` as of nginx 1.15.7
(which added ``delay=``), checked against the Debian 1.22.1 binary by the differential test, in
the same integer units:

* ``rate_milli``: the zone's rate in milli-requests per second, ``requests * 1000 // period_s``
  (so ``7r/m`` is 116, not 116.67: nginx truncates, and so do we).
* ``excess_milli``: the requests queued beyond the one being served, in milli-requests.
* times in whole milliseconds, ``now_ms = now_us // 1000`` (nginx reads ``ngx_current_msec``,
  ``CLOCK_MONOTONIC`` cached once per event-loop iteration).

For a key seen before, with ``ms = now_ms - last_ms``::

    if ms < -60000: ms = 1          # the clock jumped far back: treat as 1 ms elapsed
    elif ms < 0:    ms = 0          # a small step back: nothing drained
    excess = max(0, excess_prev - rate_milli * ms // 1000 + 1000)
    reject if excess > burst * 1000 (state untouched)
    otherwise store excess, and move last_ms to now only when ms != 0

A key nginx has never seen gets a new node with excess 0 (not 1000): its first request leaves
the bucket empty, so ``burst + 1`` requests pass in an instant. An admitted request is served at
once when ``excess <= delay * 1000`` and otherwise delayed ``(excess - delay*1000) * 1000 //
rate_milli`` ms; a computed delay of 0 ms (excess a few milli-requests over) is served at once too.
``nodelay`` is an unbounded ``delay``.

A request of ``cost`` c counts as c requests arriving in the same millisecond, all or none:
``excess = max(0, excess_prev - drained + 1000) + (c - 1) * 1000``. nginx has no cost; for c = 1
this is nginx exactly.

State is one packed int, ``excess_milli << 44 | last_ms`` (about 32 bytes per key instead of
about 90 for a tuple), since millions of keys are tracked; ``pack_state``/``unpack_state`` name
the fields. Timestamps must be non-negative and below 2**44 ms (557 years), which any monotonic
clock or Redis ``TIME`` satisfies.
"""

from __future__ import annotations

from typing import Final

from gateway.algorithms.base import Algorithm, Decides, Decision, require_int
from gateway.policy.units import parse_rate

_LAST_BITS: Final = 44
_LAST_MASK: Final = (1 << _LAST_BITS) - 1
# nginx parses ``nodelay`` as delay = NGX_MAX_INT_T_VALUE / 1000: larger than any excess.
_NODELAY_MILLI: Final = (1 << 63) - 1
# How far back the clock may step before nginx stops treating it as "no time passed".
_BACKWARDS_TOLERANCE_MS: Final = 60_000
_INF: Final = float("inf")


def pack_state(excess_milli: int, last_ms: int) -> int:
    """The packed per-key state for ``excess_milli`` queued at ``last_ms``."""
    return (excess_milli << _LAST_BITS) | last_ms


def unpack_state(state: int) -> tuple[int, int]:
    """``(excess_milli, last_ms)`` from a packed state."""
    return state >> _LAST_BITS, state & _LAST_MASK


class LeakyBucket(Decides):
    """nginx ``limit_req`` for one zone and one ``limit_req`` directive; state per key is an int."""

    __slots__ = (
        "_burst_milli",
        "_delay_milli",
        "_limit",
        "_rate_milli",
        "burst",
        "delay",
        "period_s",
        "rate",
    )

    def __init__(self, rate: int, period_s: int = 1, burst: int = 0, delay: int | None = 0) -> None:
        """``rate`` requests per ``period_s`` (1 for r/s, 60 for r/m); ``delay=None`` is nodelay."""
        require_int("rate", rate)
        if rate < 1:
            raise ValueError(f"rate must be a positive integer, got {rate!r}")
        if period_s not in (1, 60):
            raise ValueError(f"period_s must be 1 (r/s) or 60 (r/m), got {period_s!r}")
        require_int("burst", burst)
        if burst < 0:
            raise ValueError(f"burst must be a non-negative integer, got {burst!r}")
        if delay is not None:
            require_int("delay", delay)
        if delay is not None and delay < 0:
            raise ValueError(f"delay must be a non-negative integer or None, got {delay!r}")
        self.rate = rate
        self.period_s = period_s
        self.burst = burst
        self.delay = delay
        self._rate_milli = rate * 1000 // period_s
        self._burst_milli = burst * 1000
        self._delay_milli = _NODELAY_MILLI if delay is None else delay * 1000
        self._limit = burst + 1

    @classmethod
    def from_nginx(
        cls, rate: str = "10r/s", burst: int = 0, nodelay: bool = False, delay: int | None = None
    ) -> LeakyBucket:
        """Build from nginx directive values: ``rate=`` of the zone, ``burst=``, ``nodelay``,
        ``delay=``. Giving both ``nodelay`` and ``delay`` is refused (nginx lets the last one
        written win, which is an easy mistake to miss)."""
        if nodelay and delay is not None:
            raise ValueError("give either nodelay or delay=N, not both")
        if delay is not None and delay < 1:
            raise ValueError(f"invalid delay value {delay!r}: nginx requires delay >= 1")
        parsed = parse_rate(rate)
        return cls(parsed.requests, parsed.period_s, burst, None if nodelay else (delay or 0))

    @property
    def name(self) -> str:
        return "leaky_bucket"

    @property
    def rate_milli(self) -> int:
        """nginx's stored rate: milli-requests per second, truncated."""
        return self._rate_milli

    def share(self, replicas: int) -> LeakyBucket:
        if replicas == 1:
            return self
        burst = self.burst // replicas
        delay = None if self.delay is None else min(self.delay // replicas, burst)
        if self.period_s == 1 and self.rate % replicas == 0:
            return LeakyBucket(self.rate // replicas, 1, burst, delay)
        per_minute = self.rate * (60 // self.period_s)
        return LeakyBucket(max(per_minute // replicas, 1), 60, burst, delay)

    def __repr__(self) -> str:
        unit = "s" if self.period_s == 1 else "m"
        shaping = "nodelay" if self.delay is None else f"delay={self.delay}"
        return f"LeakyBucket({self.rate}r/{unit}, burst={self.burst}, {shaping})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LeakyBucket):
            return NotImplemented
        return (self.rate, self.period_s, self.burst, self.delay) == (
            other.rate,
            other.period_s,
            other.burst,
            other.delay,
        )

    def __hash__(self) -> int:
        return hash((self.rate, self.period_s, self.burst, self.delay))

    def __reduce__(self) -> tuple[type[LeakyBucket], tuple[int, int, int, int | None]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return LeakyBucket, (self.rate, self.period_s, self.burst, self.delay)

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[Decision, int | None]:
        now_ms = now_us // 1000
        rate_milli = self._rate_milli
        if state is None:
            # nginx: a new node starts with excess 0 and last = now.
            excess = 0
            last_ms = now_ms
        else:
            last_ms = state & _LAST_MASK
            ms = now_ms - last_ms
            if ms < 0:
                ms = 1 if ms < -_BACKWARDS_TOLERANCE_MS else 0
            excess = (state >> _LAST_BITS) - rate_milli * ms // 1000 + 1000
            if excess < 0:
                excess = 0
            if ms:
                last_ms = now_ms
        if cost != 1:
            if cost < 1:
                raise ValueError(f"cost must be at least 1, got {cost!r}")
            excess += (cost - 1) * 1000
        burst_milli = self._burst_milli
        if excess > burst_milli:
            return self._rejection(state, now_us, cost), state
        delay_milli = self._delay_milli
        delay_s = (
            0.0 if excess <= delay_milli else (excess - delay_milli) * 1000 // rate_milli / 1000
        )
        # Full recovery (what a new key would see) once excess + 1000 has drained: the ceiling
        # of a non-negative quotient, and the microseconds to it counted from ``now_ms`` (never
        # after ``last_ms``), so that compiled, each product is of machine words: a negative
        # operand, or an instant in microseconds, takes mypyc's multiplication through Python
        # ints (about 650 instructions each; bench/README.md, "Fifth round").
        recovered_ms = last_ms + ((excess + 1000) * 1000 + rate_milli - 1) // rate_milli
        reset_us = (recovered_ms - now_ms) * 1000 - now_us % 1000
        return (
            Decision(
                True,
                delay_s,
                0.0,
                self._limit,
                (burst_milli - excess) // 1000,
                reset_us / 1e6 if reset_us > 0 else 0.0,
            ),
            (excess << _LAST_BITS) | last_ms,
        )

    def _rejection(self, state: int | None, now_us: int, cost: int) -> Decision:
        """The decision for a rejected request; the state it was judged on stays as it was."""
        # A rejection needs an existing node: a new key's excess is (cost - 1) * 1000.
        burst_milli = self._burst_milli
        if state is None or (cost - 1) * 1000 > burst_milli:
            # More than burst + 1 at once can never pass.
            return Decision(False, 0.0, _INF, self._limit, 0, 0.0)
        excess_prev, last_ms = state >> _LAST_BITS, state & _LAST_MASK
        rate_milli = self._rate_milli
        # Admitted once rate_milli * elapsed_ms // 1000 >= excess_prev + cost*1000 - burst_milli.
        needed_milli = excess_prev + cost * 1000 - burst_milli
        admit_us = (last_ms + -(-needed_milli * 1000 // rate_milli)) * 1000
        recovered_us = (last_ms + -(-(excess_prev + 1000) * 1000 // rate_milli)) * 1000
        return Decision(
            False,
            0.0,
            max(admit_us - now_us, 0) / 1e6,
            self._limit,
            0,
            max(recovered_us - now_us, 0) / 1e6,
        )

    def excess_milli_at(self, state: int | None, now_us: int) -> int:
        """The excess a one-unit request at ``now_us`` would leave, as nginx computes it before the
        burst check (what it logs as ``excess:``); for logs and the nginx comparison."""
        if state is None:
            return 0
        return self._used_milli(state, now_us // 1000)

    def is_idle(self, state: int, now_us: int) -> bool:
        """True once a request would see the bucket as a new key does (excess + 1000 drained).

        nginx's own zone cleanup is looser (it frees nodes idle 60 s whose excess has drained to
        0, which can cost a returning client up to one request of credit); dropping only exact
        equivalents keeps expiry invisible to clients.
        """
        excess_prev, last_ms = state >> _LAST_BITS, state & _LAST_MASK
        ms = now_us // 1000 - last_ms
        if ms < 0:
            ms = 1 if ms < -_BACKWARDS_TOLERANCE_MS else 0
        return excess_prev - self._rate_milli * ms // 1000 + 1000 <= 0

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Take ``cost`` requests back out of the queue (floored at empty); nginx never does this,
        the gateway does when a delayed client hangs up before being served."""
        excess_prev, last_ms = state >> _LAST_BITS, state & _LAST_MASK
        excess = excess_prev - cost * 1000
        return ((excess if excess > 0 else 0) << _LAST_BITS) | last_ms

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Keep the bucket as full, relative to its capacity of ``burst + 1`` requests, under new
        parameters; a changed rate only changes how fast it drains from now on."""
        if not isinstance(previous, LeakyBucket):
            return None
        now_ms = now_us // 1000
        # "used": what the next request would find, 0 for a fresh key, (burst+1)*1000 when full.
        used_milli = previous._used_milli(state, now_ms)
        if used_milli <= 0:
            return None
        capacity_prev = previous._burst_milli + 1000
        capacity_new = self._burst_milli + 1000
        used_new = -(-used_milli * capacity_new // capacity_prev)  # round up: never more lenient
        if used_new >= 1000:
            return ((used_new - 1000) << _LAST_BITS) | now_ms
        # Partly drained below one request: express it as an empty bucket last touched a little
        # while ago, leaving (up to rounding, towards stricter) the same credit.
        drained_ms = (1000 - used_new) * 1000 // self._rate_milli
        return max(now_ms - drained_ms, 0)

    def _used_milli(self, state: int, now_ms: int) -> int:
        """The excess a one-unit request at ``now_ms`` would leave, which is also the capacity in
        use, out of ``(burst + 1) * 1000``: 0 for a key as good as new, full at the limit."""
        excess_prev, last_ms = state >> _LAST_BITS, state & _LAST_MASK
        ms = now_ms - last_ms
        if ms < 0:
            ms = 1 if ms < -_BACKWARDS_TOLERANCE_MS else 0
        level = excess_prev - self._rate_milli * ms // 1000 + 1000
        return level if level > 0 else 0

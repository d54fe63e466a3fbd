"""The one clock the gateway reads, injected so tests can drive time by hand.

Limiter algorithms never read a clock: callers pass ``now_us`` (integer microseconds), which is
exact enough for nginx's millisecond arithmetic and Guava's microsecond arithmetic alike.

``now_us`` is the monotonic clock set to the wall clock once, when this module is imported (in
the supervisor, before it forks the workers: every worker, a restarted one too, has the same
offset). So windows aligned on ``now_us`` are aligned on the wall clock as operators expect (a
15-minute window ends at :00, :15, :30 and :45 UTC, as Redis ``TIME`` has them), while the time
between two decisions is still measured on the monotonic clock: a step of the wall clock (NTP
after a suspend, an operator's ``date -s``) neither shortens nor stretches a window. Windows
keep the alignment of the start until the gateway restarts; calendar windows (a month in a
time zone) read ``unix_us``, which follows the step at once.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Final, Protocol


class Clock(Protocol):
    def now_us(self) -> int:
        """Monotonic time in integer microseconds, on the wall clock's epoch as of the start."""
        ...

    def unix_us(self) -> int:
        """Calendar time: integer microseconds since the Unix epoch, what calendar windows
        (a month in a time zone) are read by. It may step; ``now_us`` does not."""
        ...


def _wall_offset_us() -> int:
    """The wall clock minus the monotonic clock, in microseconds: each read twice around the
    other, the pair closest together kept (a preemption between two reads would skew it)."""
    best_gap = best_offset = 0
    for attempt in range(3):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if attempt == 0 or after - before < best_gap:
            best_gap = after - before
            best_offset = (wall - (before + after) // 2) // 1000
    return best_offset


# Captured once per gateway: forked workers inherit it.
WALL_OFFSET_US: Final = _wall_offset_us()
# Compiled, a C static: ``time.monotonic_ns`` would be looked up on the module at each read
# (every decision reads the clock; some 270 instructions).
_MONOTONIC_NS: Final = time.monotonic_ns


class Reads:
    """The class this module's clocks derive from. Compiled, a read through the ``Clock``
    protocol is a Python method call; one through this class is a C call through its method
    table: the in-process store reads its clock through ``reads`` on every decision."""

    __slots__ = ()

    def now_us(self) -> int:
        raise NotImplementedError

    def unix_us(self) -> int:
        raise NotImplementedError


class ReadByProtocol(Reads):
    """A ``Clock`` that does not derive from ``Reads`` (a test's), read through the protocol."""

    __slots__ = ("clock",)

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def now_us(self) -> int:
        return self.clock.now_us()

    def unix_us(self) -> int:
        return self.clock.unix_us()


def reads(clock: Clock) -> Reads:
    """``clock`` as a ``Reads``: itself, or read through the protocol."""
    return clock if isinstance(clock, Reads) else ReadByProtocol(clock)


class MonotonicClock(Reads):
    __slots__ = ()

    def now_us(self) -> int:
        return _MONOTONIC_NS() // 1000 + WALL_OFFSET_US

    def unix_us(self) -> int:
        return time.time_ns() // 1000


class FakeClock(Reads):
    """A clock that moves only when told to; for tests. Its time stands for the gateway's
    monotonic clock, which reads the wall clock's instant at start (a test of wall-clock
    windows starts it at one); its calendar time is its time plus ``unix_offset_us`` (a wall
    clock stepped since the start)."""

    __slots__ = ("_now_us", "unix_offset_us")

    def __init__(self, start_us: int = 1_000_000_000, unix_offset_us: int = 0) -> None:
        self._now_us = start_us
        self.unix_offset_us = unix_offset_us

    def now_us(self) -> int:
        return self._now_us

    def unix_us(self) -> int:
        return self._now_us + self.unix_offset_us

    def advance(self, seconds: float = 0.0, *, us: int = 0) -> None:
        self._now_us += round(seconds * 1_000_000) + us

    def set(self, now_us: int) -> None:
        self._now_us = now_us


def rfc3339(epoch_s: float | None) -> str | None:
    """Wall-clock epoch seconds as RFC 3339 in UTC (``2026-01-02T03:04:05.678Z``), for what
    admin endpoints show beside the epoch figure."""
    if epoch_s is None:
        return None
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"

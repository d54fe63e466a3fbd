"""The one clock the gateway reads, injected so tests can drive time by hand.

Limiter algorithms never read a clock: callers pass ``now_us`` (integer microseconds), which is
exact enough for nginx's millisecond arithmetic and Guava's microsecond arithmetic alike.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now_us(self) -> int:
        """Monotonic time in integer microseconds."""
        ...

    def unix_us(self) -> int:
        """Calendar time: integer microseconds since the Unix epoch, what calendar windows
        (a month in a time zone) are read by. It may step; ``now_us`` does not."""
        ...


class MonotonicClock:
    __slots__ = ()

    def now_us(self) -> int:
        return time.monotonic_ns() // 1000

    def unix_us(self) -> int:
        return time.time_ns() // 1000


class FakeClock:
    """A clock that moves only when told to; for tests. Its calendar time is its time plus
    ``unix_offset_us`` (0: a test of calendar windows sets it to an instant since the epoch;
    otherwise it stands for a monotonic clock counting from boot)."""

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

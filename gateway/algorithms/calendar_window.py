"""Fixed window on the calendar: at most ``limit`` units per day, ISO week, month or year in a
time zone (``fixed_window`` with ``calendar: true``), the quota of a contract ("10,000 calls a
month") reset on the 1st at midnight where the customer is, not every 30 days from the epoch.

The window is the calendar period holding ``now_us`` (``calendar_period``): a day is 23 or 25
hours when the clocks move, so ``reset_s`` and ``retry_after_s`` count to the period's real
end. ``now_us`` is Unix time in microseconds (UTC), the clock the calendar is on.

State is one int, ``period_index << count_bits | count`` as ``FixedWindow``'s, the index
being the ordinal of the period's first day. A clock step backwards into an older period keeps
counting in the newer one (stricter, never lenient), as ``FixedWindow`` does. The period last
looked up is kept, so a decision finds its bounds without reading the time zone database.
"""

from __future__ import annotations

from datetime import date
from typing import Any, Final

from gateway.algorithms.base import Algorithm, Decides, Decision
from gateway.algorithms.calendar_period import (
    Period,
    next_first_day,
    period_at,
    period_of,
    unknown_period,
)
from gateway.algorithms.fixed_window import check_limit
from gateway.policy.units import CALENDAR_PERIODS, time_zone

_INF: Final = float("inf")


class CalendarWindow(Decides):
    """At most ``limit`` units per calendar ``period`` (``1d``, ``1w``, ``1mo``, ``1y``) in the
    time zone ``timezone`` (an IANA name)."""

    __slots__ = ("_count_bits", "_count_mask", "_last", "limit", "period", "timezone", "zone")

    def __init__(self, limit: int, period: str, timezone: str = "UTC") -> None:
        self.limit = check_limit(limit)
        if period not in CALENDAR_PERIODS:
            raise unknown_period(period)
        self.period = period
        self.timezone = timezone
        self.zone = time_zone(timezone)
        self._count_bits = limit.bit_length()
        self._count_mask = (1 << self._count_bits) - 1
        self._last = period_at(0, period, self.zone)

    @property
    def name(self) -> str:
        return "fixed_window"

    def share(self, replicas: int) -> CalendarWindow:
        if replicas == 1:
            return self
        return CalendarWindow(max(self.limit // replicas, 1), self.period, self.timezone)

    def __repr__(self) -> str:
        return (
            f"CalendarWindow(limit={self.limit}, period={self.period!r}, "
            f"timezone={self.timezone!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CalendarWindow):
            return NotImplemented
        return (self.limit, self.period, self.timezone) == (
            other.limit,
            other.period,
            other.timezone,
        )

    def __hash__(self) -> int:
        return hash((CalendarWindow, self.limit, self.period, self.timezone))

    def __reduce__(self) -> tuple[Any, tuple[int, str, str]]:
        # The parameters only: the period looked up last is no part of the limit (the shared
        # store compares pickled algorithms).
        return (CalendarWindow, (self.limit, self.period, self.timezone))

    def period_at(self, now_us: int) -> Period:
        """The period holding ``now_us``: ``start_us <= now_us < end_us``."""
        last = self._last
        if last.start_us <= now_us < last.end_us:
            return last
        found = self._last = period_at(now_us, self.period, self.zone)
        return found

    def period_numbered(self, index: int) -> Period:
        """The period whose first day has the ordinal ``index``."""
        last = self._last
        if last.ordinal == index:
            return last
        return period_of(date.fromordinal(index), self.period, self.zone)

    def period_after(self, period: Period) -> Period:
        """The period that starts where ``period`` ends."""
        first = next_first_day(self.period, date.fromordinal(period.ordinal))
        return period_of(first, self.period, self.zone)

    def period_before(self, period: Period) -> Period:
        """The period that ends where ``period`` starts."""
        return period_at(period.start_us - 1, self.period, self.zone)

    def pack_state(self, period_index: int, count: int) -> int:
        """The state for ``count`` units charged in the period numbered ``period_index``."""
        return (period_index << self._count_bits) | count

    def unpack_state(self, state: int) -> tuple[int, int]:
        """``(period_index, count)``."""
        return state >> self._count_bits, state & self._count_mask

    def _current(self, state: int | None, now_us: int) -> tuple[Period, int]:
        """The period a request at ``now_us`` counts in and the count already there."""
        period = self.period_at(now_us)
        if state is not None:
            state_index = state >> self._count_bits
            if state_index == period.ordinal:
                return period, state & self._count_mask
            if state_index > period.ordinal:  # a newer period the clock stepped back from
                return self.period_numbered(state_index), state & self._count_mask
        return period, 0

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[Decision, int | None]:
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        period, count = self._current(state, now_us)
        limit = self.limit
        reset_s = (period.end_us - now_us) / 1e6
        count += cost
        if count > limit:
            retry_after_s = reset_s if cost <= limit else _INF
            remaining = limit - count + cost
            return Decision(False, 0.0, retry_after_s, limit, remaining, reset_s), state
        return (
            Decision(True, 0.0, 0.0, limit, limit - count, reset_s),
            (period.ordinal << self._count_bits) | count,
        )

    def is_idle(self, state: int, now_us: int) -> bool:
        return (state >> self._count_bits) < self.period_at(now_us).ordinal

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Exact when ``charged_us`` is given and falls in the period holding ``now_us``, the
        one before or the one after (those the Redis script is given); a charge to an older
        period has nothing left to give back, and without ``charged_us`` the state is
        returned unchanged."""
        if charged_us is None:
            return state
        index, count = state >> self._count_bits, state & self._count_mask
        current = self.period_at(now_us)
        if current.start_us <= charged_us < current.end_us:
            charged_index = current.ordinal
        elif charged_us >= current.end_us:
            following = self.period_after(current)
            if charged_us >= following.end_us:
                return state
            charged_index = following.ordinal
        else:
            before = self.period_before(current)
            if charged_us < before.start_us:
                return state
            charged_index = before.ordinal
        if charged_index != index:
            return state
        count = count - cost if count > cost else 0
        return (index << self._count_bits) | count

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Keep the same fraction of the quota used, rounded up (never more lenient), in the
        same period; another period or time zone is another calendar: its keys start afresh."""
        if not isinstance(previous, CalendarWindow) or (previous.period, previous.timezone) != (
            self.period,
            self.timezone,
        ):
            return None
        if previous.is_idle(state, now_us):
            return None
        index, count = previous.unpack_state(state)
        count_new = min(-(-count * self.limit // previous.limit), self.limit)
        if count_new == 0:
            return None
        return (index << self._count_bits) | count_new

"""Calendar periods: the day, ISO week, month or year holding an instant, in a time zone.

A period starts at the first instant whose local date is its first day or later, and ends
where the next one starts, so the periods of a zone tile time with no gap and no overlap
whatever its clocks do. A daylight-saving day is 23 or 25 hours long; in a zone whose clocks
jump forward at midnight (as Chile's do) the day starts at 01:00; a day a zone skipped (Samoa,
30 December 2011) holds no instant, and the day before ends where the day after starts.

Instants are integer microseconds since the Unix epoch (UTC). Weeks start on Monday (ISO
8601). A period is named by the ordinal (``date.toordinal``) of its first day: a small int that
grows with time, which a window's state can hold.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Final, NamedTuple

from gateway.policy.units import CALENDAR_PERIODS

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US: Final = timedelta(microseconds=1)


def unknown_period(period: str) -> ValueError:
    return ValueError(
        f"unknown calendar period {period!r}: expected one of {', '.join(CALENDAR_PERIODS)}"
    )


class Period(NamedTuple):
    """One calendar period: ``[start_us, end_us)``, named by the ordinal of its first day
    (``date.toordinal``)."""

    ordinal: int
    start_us: int
    end_us: int


def first_day(period: str, day: date) -> date:
    """The first day of the ``period`` (``1d``, ``1w``, ``1mo``, ``1y``) holding ``day``."""
    if period == "1d":
        return day
    if period == "1w":
        return day - timedelta(days=day.weekday())
    if period == "1mo":
        return day.replace(day=1)
    if period == "1y":
        return day.replace(month=1, day=1)
    raise unknown_period(period)


def next_first_day(period: str, first: date) -> date:
    """The first day of the period after the one starting on ``first``."""
    if period == "1d":
        return first + timedelta(days=1)
    if period == "1w":
        return first + timedelta(days=7)
    if period == "1mo":
        if first.month == 12:
            return date(first.year + 1, 1, 1)
        return date(first.year, first.month + 1, 1)
    if period == "1y":
        return date(first.year + 1, 1, 1)
    raise unknown_period(period)


def local_date(instant_us: int, zone: tzinfo) -> date:
    """The date on the clocks of ``zone`` at ``instant_us``."""
    return (_EPOCH + timedelta(microseconds=instant_us)).astimezone(zone).date()


def _instant_us(moment: datetime) -> int:
    return (moment - _EPOCH) // _ONE_US


def day_start_us(day: date, zone: tzinfo) -> int:
    """The first instant whose local date in ``zone`` is ``day`` or later.

    Local midnight, read with each of the two offsets around it (``fold``), brackets that
    instant: they agree on an ordinary day, give the first of two midnights when the clocks
    went back over it, and straddle the jump when midnight is skipped; a jump that skips
    midnight but not at it is found by bisection between them.
    """
    midnight = datetime.combine(day, time())
    first = _instant_us(midnight.replace(tzinfo=zone, fold=0))
    second = _instant_us(midnight.replace(tzinfo=zone, fold=1))
    low, high = (first, second) if first <= second else (second, first)
    if local_date(low, zone) >= day:
        return low
    # local_date(low) < day <= local_date(high): one transition lies between them.
    while high - low > 1:
        middle = (low + high) // 2
        if local_date(middle, zone) >= day:
            high = middle
        else:
            low = middle
    return high


def period_of(first: date, period: str, zone: tzinfo) -> Period:
    """The period that starts on the day ``first`` (the first day of a ``period``)."""
    return Period(
        first.toordinal(),
        day_start_us(first, zone),
        day_start_us(next_first_day(period, first), zone),
    )


def period_at(instant_us: int, period: str, zone: tzinfo) -> Period:
    """The ``period`` holding ``instant_us`` in ``zone``: ``start_us <= instant_us < end_us``."""
    found = period_of(first_day(period, local_date(instant_us, zone)), period, zone)
    # Where the clocks went back across midnight, an instant may show the date before a day
    # that had already begun: it belongs to that day (the periods tile time).
    while instant_us >= found.end_us:
        found = period_of(next_first_day(period, date.fromordinal(found.ordinal)), period, zone)
    return found

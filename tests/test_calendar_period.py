"""Calendar periods: the bounds of days, weeks, months and years in a time zone, checked against
dates and offsets read off a calendar (and the tz database's history), and properties for every
instant: a period holds it, and periods tile time with no gap or overlap."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.calendar_period import day_start_us, local_date, period_at
from gateway.policy.units import CALENDAR_PERIODS, time_zone

HOUR_US = 3600 * 1_000_000
DAY_US = 24 * HOUR_US
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def us(text: str) -> int:
    """Microseconds since the epoch of an ISO 8601 time with its UTC offset."""
    return (datetime.fromisoformat(text) - EPOCH) // timedelta(microseconds=1)


def bounds(text: str, period: str, zone: str) -> tuple[date, int, int]:
    found = period_at(us(text), period, time_zone(zone))
    return date.fromordinal(found.ordinal), found.start_us, found.end_us


@pytest.mark.parametrize(
    ("inside", "first", "start", "end", "days"),
    [
        ("2023-02-14T12:00:00+00:00", "2023-02-01", "2023-02-01", "2023-03-01", 28),
        ("2024-02-29T23:59:59+00:00", "2024-02-01", "2024-02-01", "2024-03-01", 29),
        ("2024-04-30T00:00:00+00:00", "2024-04-01", "2024-04-01", "2024-05-01", 30),
        ("2024-01-01T00:00:00+00:00", "2024-01-01", "2024-01-01", "2024-02-01", 31),
        ("2024-12-31T23:59:59+00:00", "2024-12-01", "2024-12-01", "2025-01-01", 31),
    ],
)
def test_months_of_28_29_30_and_31_days(
    inside: str, first: str, start: str, end: str, days: int
) -> None:
    assert bounds(inside, "1mo", "UTC") == (
        date.fromisoformat(first),
        us(f"{start}T00:00:00+00:00"),
        us(f"{end}T00:00:00+00:00"),
    )
    assert us(f"{end}T00:00:00+00:00") - us(f"{start}T00:00:00+00:00") == days * DAY_US


def test_a_month_ends_at_the_last_microsecond_before_the_first() -> None:
    last = us("2024-03-01T00:00:00+00:00") - 1
    assert period_at(last, "1mo", time_zone("UTC")).ordinal == date(2024, 2, 1).toordinal()
    assert period_at(last + 1, "1mo", time_zone("UTC")).ordinal == date(2024, 3, 1).toordinal()


@pytest.mark.parametrize(
    ("zone", "inside", "start", "end", "hours"),
    [
        # Clocks forward at 02:00 (CET -> CEST) and back at 03:00 (CEST -> CET).
        (
            "Europe/Berlin",
            "2024-03-31T12:00:00+02:00",
            "2024-03-31T00:00:00+01:00",
            "2024-04-01T00:00:00+02:00",
            23,
        ),
        (
            "Europe/Berlin",
            "2024-10-27T02:30:00+01:00",  # the second 02:30 of the day
            "2024-10-27T00:00:00+02:00",
            "2024-10-28T00:00:00+01:00",
            25,
        ),
        # Forward at 02:00 EST -> EDT, back at 02:00 EDT -> EST.
        (
            "America/New_York",
            "2024-03-10T01:59:59-05:00",
            "2024-03-10T00:00:00-05:00",
            "2024-03-11T00:00:00-04:00",
            23,
        ),
        (
            "America/New_York",
            "2024-11-03T01:30:00-05:00",  # the second 01:30
            "2024-11-03T00:00:00-04:00",
            "2024-11-04T00:00:00-05:00",
            25,
        ),
    ],
)
def test_daylight_saving_days_are_23_and_25_hours(
    zone: str, inside: str, start: str, end: str, hours: int
) -> None:
    _, found_start, found_end = bounds(inside, "1d", zone)
    assert (found_start, found_end) == (us(start), us(end))
    assert found_end - found_start == hours * HOUR_US


def test_a_month_and_a_week_with_a_clock_change_are_an_hour_short() -> None:
    _, start, end = bounds("2024-03-15T12:00:00+01:00", "1mo", "Europe/Berlin")
    assert (start, end) == (us("2024-03-01T00:00:00+01:00"), us("2024-04-01T00:00:00+02:00"))
    assert end - start == 31 * DAY_US - HOUR_US
    first, start, end = bounds("2024-03-10T12:00:00-04:00", "1w", "America/New_York")
    assert first == date(2024, 3, 4)  # a Monday
    assert end - start == 7 * DAY_US - HOUR_US


def test_weeks_start_on_monday() -> None:
    first, start, end = bounds("2024-06-05T09:00:00+00:00", "1w", "UTC")  # a Wednesday
    assert first == date(2024, 6, 3)
    assert (start, end) == (us("2024-06-03T00:00:00+00:00"), us("2024-06-10T00:00:00+00:00"))
    # Sunday night is still the week that began on Monday.
    assert bounds("2024-06-09T23:59:59+00:00", "1w", "UTC")[0] == date(2024, 6, 3)


def test_new_year_in_utc_and_in_berlin() -> None:
    # 23:30 UTC on 31 December is already 00:30 on 1 January in Berlin.
    instant = "2024-12-31T23:30:00+00:00"
    assert bounds(instant, "1y", "UTC") == (
        date(2024, 1, 1),
        us("2024-01-01T00:00:00+00:00"),
        us("2025-01-01T00:00:00+00:00"),
    )
    assert bounds(instant, "1y", "Europe/Berlin") == (
        date(2025, 1, 1),
        us("2025-01-01T00:00:00+01:00"),
        us("2026-01-01T00:00:00+01:00"),
    )
    # The week holding New Year's Day 2025 began on Monday 30 December 2024.
    assert bounds("2025-01-01T00:00:00+01:00", "1w", "Europe/Berlin")[0] == date(2024, 12, 30)
    assert bounds("2024-12-31T23:59:59.999999+01:00", "1d", "Europe/Berlin")[0] == date(
        2024, 12, 31
    )


def test_a_zone_whose_clocks_jump_at_midnight() -> None:
    """Chile moves its clocks at 24:00: on 8 September 2024 midnight never happened (the day
    began at 01:00), and 6 April 2024 had its last hour twice."""
    assert bounds("2024-09-08T12:00:00-03:00", "1d", "America/Santiago")[1:] == (
        us("2024-09-08T01:00:00-03:00"),
        us("2024-09-09T00:00:00-03:00"),
    )
    start, end = bounds("2024-04-06T23:30:00-04:00", "1d", "America/Santiago")[1:]
    assert (start, end) == (us("2024-04-06T00:00:00-03:00"), us("2024-04-07T00:00:00-04:00"))
    assert end - start == 25 * HOUR_US
    # The month holding that day began at an ordinary midnight, a week before the change.
    assert bounds("2024-09-08T12:00:00-03:00", "1mo", "America/Santiago")[1] == us(
        "2024-09-01T00:00:00-04:00"
    )


def test_a_jump_across_midnight_starts_the_day_at_the_jump() -> None:
    """Toronto went from 23:30 EST to 00:30 EDT on 30/31 March 1919 (the tz database): 31 March
    began at 00:30, the instant of the jump, read from neither offset at midnight."""
    zone = time_zone("America/Toronto")
    start = day_start_us(date(1919, 3, 31), zone)
    assert start == us("1919-03-31T00:30:00-04:00") == us("1919-03-30T23:30:00-05:00")
    assert local_date(start - 1, zone) == date(1919, 3, 30)


def test_a_skipped_day_holds_no_instant() -> None:
    """Samoa skipped 30 December 2011, from 24:00 on the 29th (-10:00) to the 31st (+14:00)."""
    first, start, end = bounds("2011-12-29T23:59:59-10:00", "1d", "Pacific/Apia")
    assert first == date(2011, 12, 29)
    assert (start, end) == (us("2011-12-29T00:00:00-10:00"), us("2011-12-31T00:00:00+14:00"))
    assert end - start == 24 * HOUR_US
    assert bounds("2011-12-31T00:00:00+14:00", "1d", "Pacific/Apia")[0] == date(2011, 12, 31)


# Zones with something unusual: half-hour offsets and shifts, jumps at midnight, skipped days,
# negative daylight saving, two-hour shifts, Ramadan suspensions.
ZONES = (
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "America/Santiago",
    "America/Toronto",
    "Pacific/Apia",
    "Australia/Lord_Howe",
    "Asia/Kathmandu",
    "Europe/Dublin",
    "Antarctica/Troll",
    "Africa/Casablanca",
    "America/Havana",
    "Asia/Beirut",
)
instants = st.integers(
    min_value=us("1900-01-01T00:00:00+00:00"), max_value=us("2100-01-01T00:00:00+00:00")
)


@settings(max_examples=300, deadline=None)
@given(instants, st.sampled_from(CALENDAR_PERIODS), st.sampled_from(ZONES))
def test_a_period_holds_its_instant_and_starts_on_its_first_day(
    instant_us: int, period: str, zone_name: str
) -> None:
    zone = time_zone(zone_name)
    found = period_at(instant_us, period, zone)
    assert found.start_us <= instant_us < found.end_us
    first = date.fromordinal(found.ordinal)
    assert {
        "1d": True,
        "1w": first.weekday() == 0,
        "1mo": first.day == 1,
        "1y": (first.month, first.day) == (1, 1),
    }[period]
    # Its start is the first instant of its first day (or of a later one, if that was skipped).
    assert local_date(found.start_us, zone) >= first
    assert local_date(found.start_us - 1, zone) < first


@settings(max_examples=300, deadline=None)
@given(instants, st.sampled_from(CALENDAR_PERIODS), st.sampled_from(ZONES))
def test_periods_tile_time_with_no_gap_or_overlap(
    instant_us: int, period: str, zone_name: str
) -> None:
    zone = time_zone(zone_name)
    found = period_at(instant_us, period, zone)
    after = period_at(found.end_us, period, zone)
    before = period_at(found.start_us - 1, period, zone)
    assert after.start_us == found.end_us
    assert before.end_us == found.start_us
    assert before.ordinal < found.ordinal < after.ordinal
    assert period_at(found.end_us - 1, period, zone) == found

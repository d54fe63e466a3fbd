"""Fixed windows on the calendar, on a fake clock: quotas reset at local midnight of the period's
first day, and a decision's reset and retry-after count to the period's real end (expected
values read off a calendar)."""

from __future__ import annotations

import math
import pickle
from datetime import UTC, datetime, timedelta

import pytest

from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.charging import charge_what_fits
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.policy.models import WindowLimit, tier_specs

HOUR_S = 3600
DAY_S = 24 * HOUR_S
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def us(text: str) -> int:
    return (datetime.fromisoformat(text) - EPOCH) // timedelta(microseconds=1)


def test_a_monthly_quota_resets_at_midnight_on_the_first_in_its_zone() -> None:
    algo = CalendarWindow(3, "1mo", "Europe/Berlin")
    clock = FakeClock(us("2024-01-31T22:00:00+01:00"))
    state = None
    for remaining in (2, 1, 0):
        decision, state = algo.decide(state, clock.now_us())
        assert (decision.allowed, decision.remaining) == (True, remaining)
    assert decision.reset_s == 2 * HOUR_S
    clock.advance(HOUR_S)  # 23:00 in Berlin, 22:00 UTC: still January here
    decision, same = algo.decide(state, clock.now_us())
    assert not decision.allowed and same is state
    assert decision.retry_after_s == decision.reset_s == HOUR_S
    clock.set(us("2024-01-31T23:59:59.999999+01:00"))
    assert not algo.decide(state, clock.now_us())[0].allowed
    clock.set(us("2024-02-01T00:00:00+01:00"))
    decision, state = algo.decide(state, clock.now_us())
    assert (decision.allowed, decision.remaining) == (True, 2)
    assert decision.reset_s == 29 * DAY_S  # February 2024 has 29 days


@pytest.mark.parametrize(
    ("zone", "now", "reset_s"),
    [
        # 00:30 on a 23-hour day: 22.5 hours left; on a 25-hour day, 24.5.
        ("Europe/Berlin", "2024-03-31T00:30:00+01:00", 22.5 * HOUR_S),
        ("Europe/Berlin", "2024-10-27T00:30:00+02:00", 24.5 * HOUR_S),
        ("America/New_York", "2024-03-10T00:00:00-05:00", 23 * HOUR_S),
        ("America/New_York", "2024-11-03T00:00:00-04:00", 25 * HOUR_S),
        # After the change: an ordinary count of hours to midnight.
        ("America/New_York", "2024-11-03T01:30:00-05:00", 22.5 * HOUR_S),
    ],
)
def test_a_daily_quota_counts_to_the_real_end_of_a_daylight_saving_day(
    zone: str, now: str, reset_s: float
) -> None:
    algo = CalendarWindow(1, "1d", zone)
    decision, state = algo.decide(None, us(now))
    assert decision.allowed and decision.reset_s == reset_s
    rejected, _ = algo.decide(state, us(now))
    assert rejected.retry_after_s == rejected.reset_s == reset_s


def test_new_year_starts_a_fresh_yearly_quota() -> None:
    algo = CalendarWindow(2, "1y")
    _, state = algo.decide(None, us("2024-06-01T00:00:00+00:00"))
    _, state = algo.decide(state, us("2024-12-31T23:59:59+00:00"))
    rejected, _ = algo.decide(state, us("2024-12-31T23:59:59+00:00"))
    assert not rejected.allowed and rejected.retry_after_s == 1
    decision, _ = algo.decide(state, us("2025-01-01T00:00:00+00:00"))
    assert (decision.allowed, decision.remaining) == (True, 1)
    assert decision.reset_s == 365 * DAY_S


def test_the_same_instant_is_in_different_periods_in_different_zones() -> None:
    instant = us("2024-12-31T20:00:00+00:00")  # 05:00 on 1 January in Tokyo
    utc = CalendarWindow(1, "1d")
    tokyo = CalendarWindow(1, "1d", "Asia/Tokyo")
    assert utc.decide(None, instant)[0].reset_s == 4 * HOUR_S
    assert tokyo.decide(None, instant)[0].reset_s == 19 * HOUR_S


def test_a_week_runs_from_monday_and_a_clock_step_back_keeps_the_newer_period() -> None:
    algo = CalendarWindow(5, "1w")
    # Monday 3 June 2024, 00:00:01: the week ends on Monday the 10th.
    decision, state = algo.decide(None, us("2024-06-03T00:00:01+00:00"))
    assert decision.reset_s == 7 * DAY_S - 1
    # The clock steps back into the week before: the count stays in the newer week, which
    # ends a week and two seconds later.
    decision, state = algo.decide(state, us("2024-06-02T23:59:59+00:00"))
    assert (decision.allowed, decision.remaining) == (True, 3)
    assert decision.reset_s == 7 * DAY_S + 1


def test_a_request_costing_more_than_the_limit_can_never_pass() -> None:
    decision, state = CalendarWindow(5, "1d").decide(None, us("2024-06-03T12:00:00+00:00"), 6)
    assert not decision.allowed and state is None
    assert decision.retry_after_s == math.inf


def test_charging_after_the_response_takes_what_is_left_of_the_month() -> None:
    algo = CalendarWindow(5, "1mo")
    now = us("2024-06-03T12:00:00+00:00")
    charged, state = charge_what_fits(algo, None, now, 2)
    assert charged == 2 and algo.decide(state, now)[0].remaining == 2
    charged, state = charge_what_fits(algo, state, now, 10)
    assert charged == 3
    decision, _ = algo.decide(state, now)
    assert not decision.allowed and decision.remaining == 0
    assert decision.retry_after_s == (us("2024-07-01T00:00:00+00:00") - now) / 1e6
    # The next month starts from nothing.
    assert charge_what_fits(algo, state, us("2024-07-01T00:00:00+00:00"), 10)[0] == 5


def test_refund_takes_back_from_the_period_charged_only() -> None:
    algo = CalendarWindow(5, "1d", "Europe/Berlin")
    charged = us("2024-10-27T23:00:00+01:00")
    _, state = algo.decide(None, charged, 2)
    assert state is not None
    refunded = algo.refund(state, charged + 1, 1, charged_us=charged)
    assert algo.decide(refunded, charged + 1)[0].remaining == 3
    assert algo.refund(state, charged, 1) == state  # when it was charged is unknown
    # Charged on the day before (24 hours before is still the same 25-hour day): nothing of
    # that day's count is left to give back.
    assert algo.refund(state, charged, 1, charged_us=charged - 24 * HOUR_S * 10**6) != state
    day_before = us("2024-10-26T23:59:59+02:00")
    assert algo.refund(state, charged, 1, charged_us=day_before) == state


def test_rescale_keeps_the_share_used_and_another_calendar_starts_afresh() -> None:
    now = us("2024-06-15T12:00:00+00:00")
    old = CalendarWindow(10, "1mo")
    _, state = old.decide(None, now, 3)
    assert state is not None
    smaller = CalendarWindow(5, "1mo")
    rescaled = smaller.rescale(state, old, now)
    assert smaller.decide(rescaled, now)[0].remaining == 5 - 2 - 1  # ceil(3 * 5 / 10) = 2
    # Another period or time zone is another calendar (the Redis script cannot map one
    # period onto another's): its keys start afresh.
    assert CalendarWindow(10, "1d", "Europe/Berlin").rescale(state, old, now) is None
    assert CalendarWindow(10, "1w").rescale(state, old, now) is None
    assert old.rescale(state, old, us("2024-07-01T00:00:00+00:00")) is None  # idle
    assert smaller.rescale(state, FixedWindow(10, 60), now) is None


def test_is_idle_once_the_period_is_over() -> None:
    algo = CalendarWindow(3, "1d")
    _, state = algo.decide(None, us("2024-06-03T23:59:59+00:00"))
    assert state is not None
    assert not algo.is_idle(state, us("2024-06-03T23:59:59.999999+00:00"))
    assert algo.is_idle(state, us("2024-06-04T00:00:00+00:00"))


def test_share_parameters_equality_and_pickling() -> None:
    algo = CalendarWindow(10, "1mo", "America/New_York")
    assert algo.share(1) is algo
    assert algo.share(3) == CalendarWindow(3, "1mo", "America/New_York")
    assert algo.name == "fixed_window"
    assert algo != CalendarWindow(10, "1mo", "Europe/Berlin")
    assert algo != CalendarWindow(10, "1w", "America/New_York")
    assert hash(algo) == hash(CalendarWindow(10, "1mo", "America/New_York"))
    before = pickle.dumps(algo)
    algo.decide(None, us("2030-01-15T00:00:00+00:00"))  # looks up another period
    assert pickle.dumps(algo) == before  # the shared store compares pickled algorithms
    assert pickle.loads(before) == algo


def test_parameters_refused() -> None:
    with pytest.raises(ValueError, match="unknown calendar period '1q'"):
        CalendarWindow(1, "1q")
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        CalendarWindow(1, "1d", "Mars/Olympus")
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        CalendarWindow(0, "1d")


def test_the_policy_builds_a_calendar_window() -> None:
    spec = WindowLimit.model_validate(
        {
            "algorithm": "fixed_window",
            "limit": 100,
            "window": "1mo",
            "calendar": True,
            "timezone": "Europe/Berlin",
        }
    )
    assert build_algorithm(spec) == CalendarWindow(100, "1mo", "Europe/Berlin")
    assert spec.window_s == 30 * DAY_S


def test_a_plan_gives_a_customer_a_month_in_their_own_time_zone() -> None:
    spec = WindowLimit.model_validate(
        {
            "algorithm": "fixed_window",
            "limit": 10_000,
            "window": "1mo",
            "calendar": True,
            "timezone": "Europe/Berlin",
            "key": ["header:X-Api-Key"],
            "plans": {"enterprise": {"limit": 1_000_000, "timezone": "America/New_York"}},
            "overrides": {"acme": "enterprise", "globex": {"window": "1y"}},
        }
    )
    tiers = tier_specs(spec, spec.overrides)
    assert build_algorithm(tiers.specs[tiers.of_value["acme"]]) == CalendarWindow(
        1_000_000, "1mo", "America/New_York"
    )
    assert build_algorithm(tiers.specs[tiers.of_value["globex"]]) == CalendarWindow(
        10_000, "1y", "Europe/Berlin"
    )
    with pytest.raises(ValueError, match="a calendar window is 1d, 1w, 1mo or 1y"):
        tier_specs(spec, {"initech": {"window": "720h"}})

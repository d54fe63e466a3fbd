"""Limits charged after the response (``count:``, ``cost_header:``): what a response is charged,
and each algorithm's ``charge`` against a model of the quota written from its documentation,
over random interleavings of admissions and responses on a fake clock."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from fractions import Fraction
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.charging import charge_what_fits, room
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.sliding_log import SlidingLog, unpack_log
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.limits.response_charge import ResponseCharge, parse_cost
from gateway.policy.models import ResponseCount

S = 1_000_000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# 2520 s is a multiple of every window used here; Saturday 26 October 2024, 22:00 in Berlin
# (20:00 UTC), a few hours before the clocks go back.
START_US = ((datetime(2024, 10, 26, 20, tzinfo=UTC) - EPOCH) // timedelta(seconds=2520)) * (
    2520 * S
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10", 10),
        (" 7\t", 7),
        ("0", 0),
        ("000012", 12),
        ("999999999999999999", 999_999_999_999_999_999),
        (None, None),
        ("", None),
        ("-1", None),
        ("+3", None),
        ("1.5", None),
        ("1e3", None),
        ("12 13", None),
        ("\u0661\u0662", None),  # Arabic-Indic digits: str.isdigit() says yes
        ("1" * 19, None),
    ],
)
def test_a_cost_header_value_is_a_plain_decimal_count(
    value: str | None, expected: int | None
) -> None:
    assert parse_cost(value) == expected


def test_statuses_name_codes_and_classes() -> None:
    count = ResponseCount.model_validate({"statuses": [401, "5XX", "403"]})
    assert count.statuses == (401, "5xx", 403)
    assert count.codes() == {401, 403} | set(range(500, 600))


def test_what_a_response_is_charged() -> None:
    login = ResponseCharge(ResponseCount(statuses=(401,)), None, False)
    assert [login.charge(status, None, 1) for status in (200, 302, 401, 403, 500)] == [
        0,
        0,
        1,
        0,
        0,
    ]
    assert login.charge(401, "10", 2) == 2  # no cost header: the configured cost
    metered = ResponseCharge(None, "X-Request-Cost", False)
    assert metered.cost_header == "x-request-cost"
    assert metered.charge(200, "10", 1) == 10
    assert metered.charge(500, "1", 3) == 1
    assert metered.charge(200, "0", 3) == 0
    assert metered.charge(200, None, 3) == 3  # missing: the configured cost
    assert metered.charge(200, "lots", 3) == 3  # invalid: the configured cost
    failures = ResponseCharge(ResponseCount(statuses=("5xx",)), "X-Cost", True)
    assert failures.charge(200, "10", 1) == 0  # a status not counted is never charged
    assert failures.charge(503, "10", 1) == 10


def test_requests_in_flight_are_all_admitted_with_one_unit_left() -> None:
    """The documented semantics: five failed logins per window; with four counted, three
    requests in flight at once are all admitted (the charge comes after), and once they have
    failed the key is full: the first failure takes the unit left, the others find no room."""
    algo = FixedWindow(5, 900)
    state = None
    for _ in range(4):
        _, state = charge_what_fits(algo, state, START_US, 1)
    in_flight = [algo.decide(state, START_US)[0] for _ in range(3)]
    assert all(decision.allowed for decision in in_flight)
    charged = []
    for _ in in_flight:
        units, state = charge_what_fits(algo, state, START_US + S, 1)
        charged.append(units)
    assert charged == [1, 0, 0]
    assert not algo.decide(state, START_US + S)[0].allowed


# A model of each algorithm's quota, written from its documentation, over a ledger of what
# was charged when: (time, units), each charge what the model had room for, up to its cost.
@dataclass
class Ledger:
    charges: list[tuple[int, int]] = field(default_factory=list)

    def units(self, keep: Callable[[int], bool]) -> int:
        return sum(units for at, units in self.charges if keep(at))


def fixed_used(window_us: int) -> Callable[[Ledger, int], Fraction]:
    def used(ledger: Ledger, now: int) -> Fraction:
        index = now // window_us
        return Fraction(ledger.units(lambda at: at // window_us == index))

    return used


def berlin_day_used() -> Callable[[Ledger, int], Fraction]:
    zone = ZoneInfo("Europe/Berlin")

    def day(at: int) -> date:
        return (EPOCH + timedelta(microseconds=at)).astimezone(zone).date()

    def used(ledger: Ledger, now: int) -> Fraction:
        today = day(now)
        return Fraction(ledger.units(lambda at: day(at) == today))

    return used


def log_used(window_us: int) -> Callable[[Ledger, int], Fraction]:
    def used(ledger: Ledger, now: int) -> Fraction:
        return Fraction(ledger.units(lambda at: now - window_us < at <= now))

    return used


def sliding_used(window_us: int) -> Callable[[Ledger, int], Fraction]:
    def used(ledger: Ledger, now: int) -> Fraction:
        index = now // window_us
        current = ledger.units(lambda at: at // window_us == index)
        previous = ledger.units(lambda at: at // window_us == index - 1)
        elapsed = now - index * window_us
        # The previous window's count weighted by its share still in the window, rounded down.
        return Fraction(previous * (window_us - elapsed) // window_us + current)

    return used


def bucket_used(rate: int, period_s: int, capacity: int) -> Callable[[Ledger, int], Fraction]:
    def used(ledger: Ledger, now: int) -> Fraction:
        # Tokens refill at rate / period up to capacity, from full.
        tokens = Fraction(capacity)
        last = START_US
        for at, units in [*ledger.charges, (now, 0)]:
            tokens = min(Fraction(capacity), tokens + Fraction((at - last) * rate, period_s * S))
            tokens -= units
            last = at
        return capacity - tokens

    return used


CASES: dict[str, tuple[Any, Callable[[Ledger, int], Fraction], int, int]] = {
    # name: (algorithm, its model, its limit, the longest step between events in us)
    "fixed_window": (FixedWindow(5, 10), fixed_used(10 * S), 5, 4 * S),
    "calendar_window": (
        CalendarWindow(4, "1d", "Europe/Berlin"),
        berlin_day_used(),
        4,
        3 * 3600 * S,
    ),
    "sliding_window": (SlidingWindow(6, 10), sliding_used(10 * S), 6, 4 * S),
    "sliding_log": (SlidingLog(5, 10), log_used(10 * S), 5, 4 * S),
    "token_bucket": (TokenBucket(2, 3, 5), bucket_used(2, 3, 5), 5, 2 * S),
}

events = st.lists(
    st.tuples(
        st.integers(0, 100),  # how far the clock moves, in hundredths of the longest step
        st.booleans(),  # a request arrives (True) or one in flight gets its response
        st.integers(0, 7),  # the request's cost, or the response's charge
        st.booleans(),  # the response's status matches count: (or the upstream says so)
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=400, deadline=None)
@given(steps=events)
def test_admitted_while_there_is_room_and_charged_only_for_matching_responses(
    name: str, steps: list[tuple[int, bool, int, bool]]
) -> None:
    algo, used, limit, step_us = CASES[name]
    ledger = Ledger()
    state: Any = None
    now = START_US
    in_flight = 0
    for advance, arrives, amount, matches in steps:
        now += advance * step_us // 100
        room = math.floor(limit - used(ledger, now))
        if arrives:
            cost = amount % 3 + 1
            decision, _ = algo.decide(state, now, cost)  # admitted without being charged
            assert decision.allowed == (room >= cost), (name, now, room, cost)
            in_flight += decision.allowed
        elif in_flight:
            in_flight -= 1
            if matches:  # else not charged: the state stays as it was
                charged, state = charge_what_fits(algo, state, now, amount)
                assert charged == min(amount, max(room, 0)), (name, now, room, amount)
                ledger.charges.append((now, charged))


def probe_room(algo: Any, state: Any, now: int) -> int:
    """Units the key has left, as a one-unit request sees them (an admitted one has taken its
    unit from ``remaining`` already)."""
    decision, _ = algo.decide(state, now, 1)
    return int(decision.remaining) + 1 if decision.allowed else 0


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=200, deadline=None)
@given(charges=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 9)), max_size=30))
def test_a_charge_takes_what_is_left_up_to_its_cost_and_never_more(
    name: str, charges: list[tuple[int, int]]
) -> None:
    algo, _, _, step_us = CASES[name]
    state: Any = None
    now = START_US
    for advance, cost in charges:
        now += advance * step_us // 100
        before = probe_room(algo, state, now)
        charged, state = charge_what_fits(algo, state, now, cost)
        assert charged == min(cost, before) == before - probe_room(algo, state, now)
        assert room(algo, state, now) == before - charged


def test_a_charge_that_finds_no_room_leaves_the_state_as_it_was() -> None:
    for algo, _, limit, _ in CASES.values():
        assert charge_what_fits(algo, None, START_US, 0) == (0, None)
        _, full = charge_what_fits(algo, None, START_US, limit)
        assert charge_what_fits(algo, full, START_US, 3) == (0, full)
        assert charge_what_fits(algo, full, START_US, 0) == (0, full)


def test_a_sliding_log_records_only_the_units_that_fit() -> None:
    log = SlidingLog(3, 10)
    _, state = charge_what_fits(log, None, START_US, 2)
    charged, state = charge_what_fits(log, state, START_US + S, 2)
    assert charged == 1
    assert unpack_log(state) == [START_US, START_US, START_US + S]
    # Refused until the first two leave the window, 10 s after they were charged.
    assert not log.decide(state, START_US + 10 * S - 1)[0].allowed
    assert log.decide(state, START_US + 10 * S)[0].allowed

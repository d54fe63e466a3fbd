"""Calendar windows in every store: the same decisions and states as the Python algorithm
across a period's end (Redis is handed the periods by the gateway and picks by its own clock),
the in-process stores reading the calendar rather than their monotonic clock, two replicas
with skewed clocks agreeing at the boundary, and a gateway's headers counting to the period's
real end."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.algorithms.calendar_window import CalendarWindow
from gateway.clock import FakeClock
from gateway.limits.compiled import Check
from gateway.stores import MemoryStore, RedisStore
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support import redis_harness
from tests.support.conformance import (
    STORE_KINDS,
    Op,
    close_client,
    compiled,
    make_backend,
    run_against_python,
)
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
_prefixes = redis_harness.key_prefixes()

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
HOUR_S = 3600
DAY_S = 24 * HOUR_S


def us(text: str) -> int:
    return (datetime.fromisoformat(text) - EPOCH) // timedelta(microseconds=1)


CALENDARS = {
    "day": lambda: CalendarWindow(3, "1d"),
    "month in Berlin": lambda: CalendarWindow(4, "1mo", "Europe/Berlin"),
    "day in New York": lambda: CalendarWindow(2, "1d", "America/New_York"),
}
# Ten seconds before a period ends: a leap day, New Year in Berlin, the 25-hour day on which
# New York's clocks went back.
STARTS = {
    "day": us("2024-02-28T23:59:50+00:00"),
    "month in Berlin": us("2024-12-31T23:59:50+01:00"),
    "day in New York": us("2024-11-03T23:59:50-05:00"),
}
operations = st.lists(
    st.tuples(
        st.one_of(st.integers(0, 3_000_000), st.integers(-2_000_000, 0)),
        st.sampled_from(["decide", "decide", "decide", "peek", "refund", "refund_exact"]),
        st.sampled_from(["a", "b"]),
        st.just(float("inf")),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("kind", STORE_KINDS)
@pytest.mark.parametrize("name", sorted(CALENDARS))
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=operations)
def test_every_store_decides_a_calendar_window_across_its_end(
    kind: str, name: str, request: pytest.FixtureRequest, ops: list[Op]
) -> None:
    backend = make_backend(kind, request)
    try:
        asyncio.run(
            run_against_python(backend, [name], ops, algorithms=CALENDARS, start_us=STARTS[name])
        )
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


# A clock counting from boot, as the in-process stores' is, while the calendar says it is two
# seconds to midnight on New Year's Eve in Berlin.
BOOT_US = 5_000_000_000
NEW_YEAR_US = us("2025-01-01T00:00:00+01:00")


@pytest.mark.parametrize("kind", ["memory", "shared"])
async def test_in_process_stores_read_the_calendar_not_their_monotonic_clock(
    kind: str, tmp_path: Path
) -> None:
    clock = FakeClock(BOOT_US, unix_offset_us=NEW_YEAR_US - 2_000_000 - BOOT_US)
    store = MemoryStore(clock) if kind == "memory" else SharedStore(tmp_path / "shared", clock)
    limit = compiled("monthly", CalendarWindow(2, "1mo", "Europe/Berlin"))
    store.configure([limit], ())
    check = Check(limit, "k")
    try:
        assert [(await store.decide([check])).allowed for _ in range(3)] == [True, True, False]
        refused = (await store.decide([check])).decisions[0]
        assert refused.retry_after_s == refused.reset_s == 2.0
        clock.advance(2)  # midnight: a new month, a new quota
        admitted = (await store.decide([check])).decisions[0]
        assert admitted.allowed and admitted.remaining == 1
        assert admitted.reset_s == 31 * DAY_S  # to 1 February
        # A charge after a response takes what is left of the new month's quota.
        assert await store.charge([check], [5]) == [1]
        assert not (await store.decide([check])).allowed
    finally:
        await store.close()


async def test_two_replicas_with_skewed_clocks_agree_at_the_boundary(
    redis_server: RedisServer,
) -> None:
    """Replica A's clock is 3 s behind Redis's, B's 3 s ahead: at 23:59:59 on 31 January by
    Redis TIME, A thinks it is 23:59:56 and B that February has begun. Each hands the script
    the periods around its own time and the script counts by Redis's: both count in January,
    then both in February."""
    redis_time = FakeClock(us("2024-01-31T23:59:59+01:00"))
    behind = FakeClock(redis_time.now_us() - 3_000_000)
    ahead = FakeClock(redis_time.now_us() + 3_000_000)
    prefix = f"calendar{next(_prefixes)}:"
    stores = [
        RedisStore(redis_server.url, clock=clock, time_source=redis_time, key_prefix=prefix)
        for clock in (behind, ahead)
    ]
    limit = compiled("monthly", CalendarWindow(2, "1mo", "Europe/Berlin"))
    for store in stores:
        store.configure([limit], ())
    check = Check(limit, "customer")

    async def decide(replica: int) -> tuple[bool, int, float]:
        decision = (await stores[replica].decide([check])).decisions[0]
        return decision.allowed, decision.remaining, decision.reset_s

    try:
        assert await decide(0) == (True, 1, 1.0)
        assert await decide(1) == (True, 0, 1.0)  # January too, though B's clock says not
        assert await decide(0) == (False, 0, 1.0)
        for clock in (redis_time, behind, ahead):
            clock.advance(1)
        # Midnight by Redis: February for both, though A's clock still says January.
        assert await decide(0) == (True, 1, 29 * DAY_S)
        assert await decide(1) == (True, 0, 29 * DAY_S)
        assert (await decide(1))[0] is False
    finally:
        for store in stores:
            await store.close()


def _calendar_policy(upstream_url: str, window: str, zone: str) -> str:
    return policy_for(
        upstream_url,
        "headers: {ietf: true, x_ratelimit: true, retry_after: true}\n"
        f"limits:\n  quota:\n    algorithm: fixed_window\n    limit: 2\n    window: {window}\n"
        f"    calendar: true\n    timezone: {zone}\n",
    )


@pytest.mark.parametrize(
    ("window", "zone", "now", "left_s", "nominal_s"),
    [
        # 00:30 on the 25-hour day Berlin's clocks go back: 24.5 hours to midnight.
        ("1d", "Europe/Berlin", "2024-10-27T00:30:00+02:00", 24.5 * HOUR_S, DAY_S),
        # The first of a 31-day month, past the 30 days a month is advertised as.
        ("1mo", "UTC", "2024-01-01T00:00:00+00:00", 31 * DAY_S, 30 * DAY_S),
        # Monday in New York, the week its clocks go forward: an hour short.
        ("1w", "America/New_York", "2024-03-04T00:00:00-05:00", 7 * DAY_S - HOUR_S, 7 * DAY_S),
    ],
)
async def test_headers_count_to_the_real_end_of_the_period(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    window: str,
    zone: str,
    now: str,
    left_s: float,
    nominal_s: int,
) -> None:
    clock = FakeClock(us(now))
    gw = await start_gateway(_calendar_policy(upstream.url, window, zone), clock=clock)
    async with aiohttp.ClientSession() as session:
        for remaining in (1, 0):
            async with session.get(gw.url + "/") as resp:
                assert resp.status == 200
                assert resp.headers["RateLimit-Policy"] == f'"quota";q=2;w={nominal_s}'
                assert resp.headers["RateLimit"] == f'"quota";r={remaining};t={int(left_s)}'
                assert resp.headers["X-RateLimit-Reset"] == str(int(left_s))
        clock.advance(1)
        async with session.get(gw.url + "/") as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == str(int(left_s) - 1)
            assert resp.headers["RateLimit"] == f'"quota";r=0;t={int(left_s) - 1}'
            assert resp.headers["X-RateLimit-Reset"] == str(int(left_s) - 1)
        clock.set(us(now) + int(left_s) * 1_000_000)  # the next period's first instant
        async with session.get(gw.url + "/") as resp:
            assert resp.status == 200
            assert resp.headers["RateLimit"].startswith('"quota";r=1;')
    assert len(upstream.requests) == 3

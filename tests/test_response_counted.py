"""Limits counted by their responses (``count:``, ``cost_header:``), end to end: the real gateway,
a real upstream, real clients over loopback, in process, in the workers' shared store and in
real Redis; and each store's charge against the Python algorithm's."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.algorithms.charging import charge_what_fits
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.registry import build_algorithm
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import FakeClock
from gateway.engine.limit_engine import LimitEngine, Outcome
from gateway.engine.preflight import parse_and_build
from gateway.limits.compiled import Check
from gateway.limits.keys import RequestFacts
from gateway.stores import LimitStore, MemoryStore, RedisStore
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support import redis_harness
from tests.support.conformance import (
    STORE_KINDS,
    T0_US,
    Backend,
    close_client,
    compiled,
    make_backend,
)
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.metrics import scrape_until, value
from tests.support.processes import run_workers, wait_serving
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordedRequest, RecordingUpstream
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
_prefixes = itertools.count()

STORES = ("memory", "shared", "redis")


def _store(
    kind: str, request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> dict[str, Any]:
    """A gateway's store of ``kind`` on ``clock`` (Redis: the clock stands in for TIME)."""
    if kind == "memory":
        return {}
    if kind == "shared":
        return {"store": SharedStore(tmp_path / "shared", clock)}
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"counted{next(_prefixes)}-{time.monotonic_ns()}:"
    store = RedisStore(server.url, clock=clock, time_source=clock, key_prefix=prefix, timeout_s=2.0)
    return {"store": store}


def _policy(upstream_url: str, limits: str) -> str:
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  backend:\n    url: {upstream_url}\n    read_timeout: 5s\n"
        "routes:\n"
        "  - name: login\n    match: {path: /login}\n    upstream: backend\n"
        "  - name: api\n    upstream: backend\n"
        "limits:\n" + limits
    )


LOGIN = """  failed_logins:
    algorithm: fixed_window
    limit: 5
    window: 15m
    match: {routes: [login]}
    count: {statuses: [401]}
"""


async def _check_password(request: web.BaseRequest, recorded: RecordedRequest) -> web.Response:
    if request.headers.get("X-Password") == "right":
        return web.Response(text="welcome")
    return web.Response(status=401, text="wrong password")


async def _settled(gw: RunningGateway) -> None:
    """Wait for the charges in flight (Redis: a call made after the response)."""
    await gw.gateway.handler.runtime.engine.charges_done()


@pytest.mark.parametrize("kind", STORES)
async def test_failed_logins_are_counted_and_the_sixth_is_refused_before_the_upstream(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    upstream.reply = _check_password
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(upstream.url, LOGIN), clock=clock, **_store(kind, request, clock, tmp_path)
    )

    async def login(password: str) -> int:
        async with session.post(gw.url + "/login", headers={"X-Password": password}) as resp:
            await resp.read()
            await _settled(gw)
            return resp.status

    async with aiohttp.ClientSession() as session:
        # Successful logins are not counted, however many.
        assert [await login("right") for _ in range(8)] == [200] * 8
        # Five wrong passwords are: each reaches the upstream and is charged after its 401.
        assert [await login("wrong") for _ in range(5)] == [401] * 5
        reached = len(upstream.requests)
        # The sixth attempt, right password or wrong, is refused before the upstream, until
        # the window ends (T0 is 800 s into a 15-minute window).
        async with session.post(gw.url + "/login", headers={"X-Password": "wrong"}) as resp:
            assert resp.status == 429
            assert resp.headers["RateLimit"] == '"failed_logins";r=0;t=100'
        assert await login("right") == 429
        assert len(upstream.requests) == reached
        # Other routes are not limited by it (the upstream's own 401 comes through).
        async with session.get(gw.url + "/api") as resp:
            assert resp.status == 401
        # A new window: failures may be counted again.
        clock.advance(100)
        assert await login("right") == 200
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda got: (
                value(got, "gateway_limit_charged_responses_total", limit="failed_logins") == 5
            ),
        )
    assert value(samples, "gateway_limit_charged_units_total", limit="failed_logins", model="") == 5
    assert value(samples, "gateway_limit_charge_failures_total", limit="failed_logins") == 0


METERED = """  metered:
    algorithm: fixed_window
    limit: 20
    window: 1h
    cost: 3
    cost_header: X-Cost
"""


async def _report_cost(request: web.BaseRequest, recorded: RecordedRequest) -> web.Response:
    """The upstream says what a request cost: what the client asked it to say."""
    wanted = request.headers.get("X-Want-Cost")
    return web.Response(text="done", headers={"X-Cost": wanted} if wanted is not None else {})


async def _quota_left(session: aiohttp.ClientSession, gw: RunningGateway) -> int:
    """What the key has left, as /explain says: a next request's remaining plus its cost."""
    async with session.get(gw.admin_url + "/explain", params={"path": "/api"}) as resp:
        explained = await resp.json()
    (entry,) = [limit for limit in explained["limits"] if limit["name"] == "metered"]
    assert entry["charged_after_response"] == {"statuses": "all", "cost_header": "X-Cost"}
    decision = entry["next_request"]
    return int(decision["remaining"]) + (entry["cost"] if decision["allowed"] else 0)


# What the upstream reports, and what the key has left after each response: 1 and 10 as
# said, an invalid or a missing value the limit's cost (3), 0 nothing, 7 the 3 units left.
REPORTS = [("1", 19), ("10", 9), ("lots", 6), (None, 3), ("0", 3), ("7", 0)]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_the_upstreams_cost_header_is_charged_and_hidden(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    upstream.reply = _report_cost
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(upstream.url, METERED), clock=clock, **_store(kind, request, clock, tmp_path)
    )
    async with aiohttp.ClientSession() as session:
        for wanted, left in REPORTS:
            headers = {"X-Want-Cost": wanted} if wanted is not None else {}
            async with session.get(gw.url + "/api", headers=headers) as resp:
                assert resp.status == 200
                assert "X-Cost" not in resp.headers  # for the gateway, not for the client
                assert resp.headers["RateLimit-Policy"] == '"metered";q=20;w=3600'
            await _settled(gw)
            assert await _quota_left(session, gw) == left, wanted
        reached = len(upstream.requests)
        async with session.get(gw.url + "/api") as resp:
            assert resp.status == 429
        assert len(upstream.requests) == reached
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda got: value(got, "gateway_limit_charged_responses_total", limit="metered") == 5,
        )
    assert value(samples, "gateway_limit_charged_units_total", limit="metered", model="") == 20


async def test_keep_cost_header_lets_the_client_see_it(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    upstream.reply = _report_cost
    gw = await start_gateway(
        _policy(upstream.url, METERED + "    keep_cost_header: true\n"), clock=FakeClock(T0_US)
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/api", headers={"X-Want-Cost": "4"}) as resp:
            assert resp.headers["X-Cost"] == "4"
        assert await _quota_left(session, gw) == 16


# Stores charge alike: each the same units as the Python algorithm, with the same decisions
# after. (The Redis script bisects for the largest cost that fits; in process, one look at
# the key's room.)
CHARGED = {
    "fixed window": lambda: FixedWindow(5, 10),
    "sliding window": lambda: SlidingWindow(6, 10),
    "sliding log": lambda: SlidingLog(5, 10),
    "token bucket": lambda: TokenBucket(2, 3, 5),
}


@pytest.mark.parametrize("name", sorted(CHARGED))
@pytest.mark.parametrize("kind", [*STORE_KINDS, "shared"])
async def test_every_store_charges_what_the_python_algorithm_does(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, name: str
) -> None:
    clock = FakeClock(T0_US)
    backend: Backend | None = None
    if kind == "shared":
        store: LimitStore = SharedStore(tmp_path / "shared", clock)
    else:
        backend = make_backend(kind, request)
        store = backend.make(clock)
    algorithm = CHARGED[name]()
    limit = compiled("lim", algorithm)
    store.configure([limit], ())
    check = Check(limit, "k")
    state = None
    try:
        for step_s, cost in [(0, 2), (0, 7), (1.5, 1), (2, 4), (0, 0), (9, 12), (4, 3)]:
            clock.advance(step_s)
            want, state = charge_what_fits(algorithm, state, clock.now_us(), cost)
            assert await store.charge([check], [cost]) == [want]
            got = (await store.decide([check], commit=False)).decisions[0]
            assert got == algorithm.decide(state, clock.now_us())[0]
    finally:
        await store.close()
        if backend is not None and backend.inspect is not None:
            close_client(backend.inspect)


@pytest.mark.parametrize("on_failure", ["local", "allow"])
async def test_a_charge_redis_cannot_make_is_counted_and_follows_on_failure(
    on_failure: str,
) -> None:
    """Nothing listens where the store looks for Redis: the charge fails at once. With
    ``local`` the fallback takes it (and owes it to Redis); with ``allow`` it is dropped."""
    clock = FakeClock(T0_US)
    store = RedisStore(
        "redis://127.0.0.1:1",
        on_failure=on_failure,
        clock=clock,
        timeout_s=0.5,
    )
    limit = compiled("lim", FixedWindow(5, 60))
    store.configure([limit], ())
    check = Check(limit, "k")
    try:
        taken = await store.charge([check], [3])
        assert limit.counters.charge_failures == 1
        if on_failure == "local":
            assert taken == [3]
            assert (await store.decide([check], commit=False)).decisions[0].remaining == 1
            assert len(store.owed) == 1  # charged to Redis when it answers again
        else:
            assert taken == [0]
            assert not store.owed
    finally:
        await store.close()


# Real gateway processes (a supervisor and two forked workers sharing the LMDB store): failed
# logins counted across workers, what the upstream reports charged there, and a yearly quota
# whose headers count to the end of the year. The failures slide over 30 days: on the workers'
# real clock a day's window ends at midnight UTC, and the three failures carried into the next
# day, weighted a little under whole, round down to admit the refused request.
WORKERS_POLICY = """\
limits:
  failed_logins:
    algorithm: sliding_window
    limit: 3
    window: 720h
    count: {statuses: [401]}
  yearly:
    algorithm: fixed_window
    limit: 1000
    window: 1y
    calendar: true
    cost_header: X-Cost
    key: [global]
"""


async def _costly_login(request: web.BaseRequest, recorded: RecordedRequest) -> web.Response:
    status = 200 if request.headers.get("X-Password") == "right" else 401
    return web.Response(status=status, text="checked", headers={"X-Cost": "10"})


async def test_workers_count_responses_in_the_shared_store(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    upstream.reply = _costly_login
    async with run_workers(upstream.url, tmp_path, WORKERS_POLICY, 2) as (url, admin, pids):
        await wait_serving(tmp_path, 2)
        assert len(pids()) == 2

        async def login(password: str) -> aiohttp.ClientResponse:
            return await _login_over_new_connection(url, password, "127.0.0.1")

        assert [(await login("right")).status for _ in range(4)] == [200] * 4
        assert [(await login("wrong")).status for _ in range(3)] == [401] * 3
        reached = len(upstream.requests)
        refused = await login("right")
        assert refused.status == 429
        assert len(upstream.requests) == reached
        seen = await _login_over_new_connection(url, "right", "127.0.0.2")  # another key
        assert "X-Cost" not in seen.headers
        # 7 responses charged 10 units each before it (the refused request none): the yearly
        # quota's remaining is what this request's decision left (cost 1 at admission, charged
        # nothing then), and t counts to New Year in UTC.
        now = datetime.now(UTC)
        new_year = datetime(now.year + 1, 1, 1, tzinfo=UTC)
        yearly = [item for item in seen.headers["RateLimit"].split(", ") if "yearly" in item]
        assert yearly and yearly[0].startswith('"yearly";r=929;t=')
        left_s = int(yearly[0].rsplit("t=", 1)[1])
        assert abs(left_s - (new_year - now).total_seconds()) < 30
        async with aiohttp.ClientSession() as session:
            samples = await scrape_until(
                session,
                admin,
                lambda got: (
                    value(got, "gateway_limit_charged_units_total", limit="yearly", model="") == 80
                ),
            )
        assert value(samples, "gateway_limit_charged_responses_total", limit="failed_logins") == 3


async def _login_over_new_connection(
    url: str, password: str, client: str
) -> aiohttp.ClientResponse:
    """A login on a new connection from ``client``: SO_REUSEPORT spreads those over the
    workers."""
    connector = aiohttp.TCPConnector(force_close=True, local_addr=(client, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(url + "/login", headers={"X-Password": password}) as resp,
    ):
        await resp.read()
        return resp


# With the other pieces: a plan giving one client fewer failures, a dry-run copy that counts
# what it would refuse, and a leaky bucket stacked on the same route that delays.
STACKED = """  failed_logins:
    algorithm: fixed_window
    limit: 5
    window: 15m
    match: {routes: [login]}
    count: {statuses: [401]}
    overrides: {127.0.0.1: {limit: 2}}
  candidate:
    algorithm: sliding_window
    limit: 1
    window: 15m
    match: {routes: [login]}
    count: {statuses: [401]}
    dry_run: true
  shaping:
    algorithm: leaky_bucket
    rate: 10r/s
    burst: 20
    delay: 20
"""


async def test_overrides_dry_run_and_stacking_with_a_delaying_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    upstream.reply = _check_password
    gw = await start_gateway(_policy(upstream.url, STACKED), clock=FakeClock(T0_US))
    async with aiohttp.ClientSession() as session:

        async def login(password: str) -> int:
            async with session.post(gw.url + "/login", headers={"X-Password": password}) as resp:
                await resp.read()
                return resp.status

        # The override's 2 failures, not the limit's 5; the dry-run copy (1 failure) was
        # charged for the first, would have refused the second and third, and refused nothing.
        assert [await login("wrong") for _ in range(3)] == [401, 401, 429]
        assert len(upstream.requests) == 2
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda got: (
                value(got, "gateway_limit_charged_responses_total", limit="failed_logins") == 2
            ),
        )
        decided = "gateway_limit_decisions_total"
        assert value(samples, decided, limit="candidate", result="dry_run_rejected") == 2
        assert value(samples, "gateway_limit_charged_responses_total", limit="candidate") == 1
        # The stacked leaky bucket admitted the two that went through; the refused request
        # charged it nothing (nginx's rule: a refused request charges no limit).
        assert value(samples, decided, limit="shaping", result="allowed") == 2
        assert value(samples, decided, limit="shaping", result="rejected") == 0


async def test_a_request_whose_client_leaves_the_queue_is_not_charged(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A leaky bucket delays the second request a minute; its client leaves while it waits:
    it never reaches the upstream, and the limit charged per response charges nothing."""
    limits = METERED + (
        "  shaping:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 1\n"
        "    max_delay: 120s\n"
    )
    # A fake clock: on the real one the hour could end between the first response's charge
    # and the read of what is left.
    gw = await start_gateway(_policy(upstream.url, limits), clock=FakeClock(T0_US))
    metered = next(lim for lim in gw.gateway.handler.runtime.engine.limits if lim.name == "metered")
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/api") as resp:
            assert resp.status == 200
        await _settled(gw)
        assert metered.counters.charged_units == 3
        with pytest.raises(TimeoutError):
            async with session.get(gw.url + "/api", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        shaping = next(
            lim for lim in gw.gateway.handler.runtime.engine.limits if lim.name == "shaping"
        )
        await wait_until(lambda: shaping.counters.waiting == 0, "the client to leave the queue")
        # Nor is anything given back to it: the first response's charge stays.
        assert await _quota_left(session, gw) == 17
    assert len(upstream.requests) == 1
    assert (metered.counters.charged_responses, metered.counters.charged_units) == (1, 3)


# The engine over the in-process store, against a model of a fixed window counted by its
# responses: requests overlap (each admitted one completes some steps later), statuses and
# reported costs are drawn at random.
PROPERTY_LIMIT = 4
PROPERTY_WINDOW_S = 60
PROPERTY_POLICY = (
    "server:\n  listen: 127.0.0.1:0\nupstreams:\n  backend:\n    url: http://127.0.0.1:9\n"
    "routes:\n  - name: all\n    upstream: backend\n"
    "limits:\n  failures:\n    algorithm: fixed_window\n"
    f"    limit: {PROPERTY_LIMIT}\n    window: {PROPERTY_WINDOW_S}s\n"
    "    count: {statuses: [401, 5xx]}\n    cost_header: X-Cost\n    cost: 2\n"
    "    hold: %s\n"
)
request_steps = st.lists(
    st.tuples(
        st.integers(0, 40),  # seconds before the request arrives
        st.integers(0, 3),  # requests that complete before it, oldest first
        st.sampled_from([200, 401, 404, 500, 503]),
        st.sampled_from([None, "0", "1", "3", "9", "x"]),
    ),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("hold", ["none", "in_flight"])
@settings(max_examples=150, deadline=None)
@given(steps=request_steps)
def test_the_engine_admits_and_charges_as_the_model_does(
    hold: str, steps: list[tuple[int, int, int, str | None]]
) -> None:
    """``hold: none``: admitted while the key has room, charged what fits after. ``hold:
    in_flight``: the cost (2) is taken at admission, and the response settles it: the part
    of the hold it does not need given back (in the window it was taken in), a charge beyond
    it taken as far as there is room."""
    asyncio.run(_engine_against_the_model(steps, hold == "in_flight"))


async def _engine_against_the_model(
    steps: list[tuple[int, int, int, str | None]], holds: bool
) -> None:
    policy = parse_and_build(
        PROPERTY_POLICY % ("in_flight" if holds else "none"), "test.yaml"
    ).policy
    clock = FakeClock(T0_US)
    store = MemoryStore(clock)
    engine = LimitEngine(policy, store, build_algorithm)
    store.configure(engine.limits, ())
    (route,) = policy.routes
    (limit,) = engine.limits
    used: dict[int, int] = {}  # the model: units charged per window
    # Each request in flight: its outcome, status, reported cost, and the window it was
    # admitted in (where its hold was taken).
    in_flight: list[tuple[Outcome, int, str | None, int]] = []
    matching = 0

    def complete(outcome: Outcome, status: int, reported: str | None, held_in: int) -> None:
        nonlocal matching
        window = clock.now_us() // (PROPERTY_WINDOW_S * 1_000_000)
        units = 0
        if status == 401 or status >= 500:
            units = 2 if reported is None or not reported.isdigit() else int(reported)
            matching += units > 0  # a response that costs nothing is not a charge
        before = limit.counters.charged_units
        engine.charge_after(outcome, status, {b"x-cost": reported.encode()} if reported else None)
        if not holds:
            taken = min(units, PROPERTY_LIMIT - used.get(window, 0))
            assert limit.counters.charged_units - before == taken
            used[window] = used.get(window, 0) + taken
            return
        if units < 2 and held_in == window:  # the rest of the hold back, in its window
            used[window] = max(0, used[window] - (2 - units))
        top_up = min(max(0, units - 2), PROPERTY_LIMIT - used.get(window, 0))
        used[window] = used.get(window, 0) + top_up
        assert limit.counters.charged_units - before == min(units, 2) + top_up

    for wait_s, completing, status, reported in steps:
        clock.advance(wait_s)
        for _ in range(min(completing, len(in_flight))):
            complete(*in_flight.pop(0))
        facts = RequestFacts("10.0.0.1", route.name, "GET", CIMultiDictProxy(CIMultiDict()), dict)
        outcome = await engine.evaluate(facts, route, "", "/", "10.0.0.1")
        window = clock.now_us() // (PROPERTY_WINDOW_S * 1_000_000)
        # Admitted exactly while the key has room for the request's cost (2) at decision time.
        assert (not outcome.status) == (used.get(window, 0) + 2 <= PROPERTY_LIMIT)
        if not outcome.status:
            in_flight.append((outcome, status, reported, window))
            if holds:
                used[window] = used.get(window, 0) + 2
    while in_flight:
        complete(*in_flight.pop(0))
    assert limit.counters.charged_responses == matching
    assert all(units <= PROPERTY_LIMIT for units in used.values())

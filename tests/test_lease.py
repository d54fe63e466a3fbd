"""Quota leasing: the grant arithmetic (pure, property tests), its Lua mirror, the policy's
refusals in ``gateway check``, and two Redis stores (two replicas) leasing one limit on a real
Redis with a fake clock. The multi-process tests are in ``test_lease_replicas.py``."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from playwright.async_api import Browser

from gateway.algorithms.registry import build_algorithm
from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import Policy
from gateway.stores import RedisStore
from gateway.stores.redis.circuit import CircuitBreaker
from gateway.stores.redis.clients import PipelineClient, ThinClient
from gateway.stores.redis.lease import load_lease_script
from gateway.stores.redis.lease_grant import first_ask, grant_size, want_within
from tests.support import redis_harness
from tests.support.browser import dashboard_field, until_shown
from tests.support.conformance import T0_US, burst
from tests.support.gateways import GatewayFactory
from tests.support.metrics import Samples, scrape_until, value
from tests.support.network import get_status
from tests.support.policies import limited_policy
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server
_prefixes = itertools.count()

shares = st.integers(1, 1000)
low_waters = st.integers(0, 999)


# --- the grant arithmetic ---------------------------------------------------------------------


@given(
    quota=st.integers(1, 10**9),
    data=st.data(),
    want=st.integers(0, 10**9),
    asking=st.integers(1, 64),
    share_pm=shares,
    low_water_pm=low_waters,
    first=st.integers(1, 10**9),
)
def test_a_grant_never_exceeds_its_share_of_what_remains(
    quota: int,
    data: st.DataObject,
    want: int,
    asking: int,
    share_pm: int,
    low_water_pm: int,
    first: int,
) -> None:
    remaining = data.draw(st.integers(0, quota))
    granted = grant_size(remaining, quota, want, asking, share_pm, low_water_pm, first)
    assert 0 <= granted <= remaining
    assert granted <= math.ceil(remaining * share_pm / 1000)
    # Never more than an even part among the askers: when the quota runs out, none holds
    # much more than another.
    assert granted <= math.ceil(remaining / asking)
    if remaining > 0:
        assert granted >= 1  # the last units can still be had
    if want > 0:
        assert granted <= want
    else:  # no history: at most an interval of the quota's rate, split
        assert granted <= math.ceil(first / asking)
    if remaining * 1000 <= quota * low_water_pm:  # near exhaustion: the share split
        assert granted <= math.ceil(math.ceil(remaining * share_pm / 1000) / asking)


@settings(max_examples=200)
@given(
    quota=st.integers(1, 5000),
    share_pm=shares,
    low_water_pm=low_waters,
    steps=st.lists(
        st.tuples(
            st.integers(0, 4), st.sampled_from(["ask", "spend", "return"]), st.integers(0, 500)
        ),
        max_size=200,
    ),
)
def test_live_leases_and_spent_units_never_exceed_the_quota(
    quota: int, share_pm: int, low_water_pm: int, steps: list[tuple[int, str, int]]
) -> None:
    """Five replicas ask (wanting what they like), spend and give back in any order within one
    window: what they hold plus what they spent never passes the quota."""
    held = [0] * 5
    spent = 0
    given_out = 0  # what the script counts: granted minus returned
    for replica, action, amount in steps:
        if action == "ask":
            granted = grant_size(quota - given_out, quota, amount, 5, share_pm, low_water_pm, quota)
            held[replica] += granted
            given_out += granted
        elif action == "spend":
            used = min(amount, held[replica])
            held[replica] -= used
            spent += used
        else:
            back = min(amount, held[replica])
            held[replica] -= back
            given_out -= back
        assert sum(held) + spent == given_out <= quota


def test_grants_shrink_near_exhaustion() -> None:
    """A busy replica takes at most half of what remains, and no more than an even part of it
    among the replicas asking; under the low water the rest is spread over them rather than
    stranded on one."""
    assert grant_size(1000, 1000, 900, 1, 500, 100, 200) == 500  # alone: half
    assert grant_size(1000, 1000, 900, 3, 500, 100, 200) == 334  # ceil(1000 / 3)
    assert grant_size(1000, 1000, 300, 3, 500, 100, 200) == 300  # what it wants
    assert grant_size(100, 1000, 900, 3, 500, 100, 200) == 17  # ceil(ceil(100 / 2) / 3)
    assert grant_size(1, 1000, 900, 3, 500, 100, 200) == 1
    assert grant_size(0, 1000, 900, 3, 500, 100, 200) == 0
    # No history: a fair share, and at most an interval of the quota's rate split.
    assert grant_size(1000, 1000, 0, 4, 500, 100, 1000) == 125
    assert grant_size(1000, 1000, 0, 1, 500, 100, 200) == 200
    assert grant_size(1000, 1000, 0, 4, 500, 100, 200) == 50


def test_a_first_ask_is_an_interval_of_the_quota_at_its_rate() -> None:
    # 3,000 per 10 s window, interval 2 s: 600; a window ending in 0.5 s: 150.
    assert first_ask(3000, 10_000_000, 10_000_000, 2_000_000, False) == 600
    assert first_ask(3000, 10_000_000, 500_000, 2_000_000, False) == 150
    assert first_ask(3000, 10_000_000, None, 2_000_000, False) == 600
    # A bucket refilling a token every 100 ms: 20 over a 2 s interval.
    assert first_ask(1000, 100_000.0, None, 2_000_000, True) == 20


@pytest.fixture
def plain(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    quota=st.integers(1, 10**6),
    data=st.data(),
    want=st.integers(0, 10**6),
    asking=st.integers(1, 6),
    share_pm=shares,
    low_water_pm=low_waters,
)
def test_the_script_grants_what_the_python_mirror_computes(
    plain: redis.Redis,
    quota: int,
    data: st.DataObject,
    want: int,
    asking: int,
    share_pm: int,
    low_water_pm: int,
) -> None:
    remaining = data.draw(st.integers(0, quota))
    # The window ends in 999,877 us; an interval longer than that scales the want down.
    interval_us = data.draw(st.integers(1, 2_000_000))
    prefix = f"mirror{next(_prefixes)}:"
    window_us = 1_000_000
    now_us = T0_US + 123
    index = now_us // window_us
    plain.set(prefix + "state", struct.pack("<dd", index, quota - remaining))
    for other in range(asking - 1):
        plain.zadd(prefix + "askers", {f"other{other}": now_us})
    script = plain.register_script(load_lease_script())
    reply: Any = script(
        keys=[prefix + "state", prefix + "askers"],
        args=[
            "g7",
            now_us,
            "F",
            quota,
            window_us,
            "me",
            want,
            0,
            "",
            share_pm,
            low_water_pm,
            window_us,
            interval_us,
        ],
    )
    lasts_us = (index + 1) * window_us - now_us
    wanted = want_within(want, lasts_us, interval_us)
    first = first_ask(quota, window_us, lasts_us, interval_us, False)
    expected = grant_size(remaining, quota, wanted, asking, share_pm, low_water_pm, first)
    assert reply == [
        expected,
        index,
        (index + 1) * window_us - now_us,
        remaining - expected,
        0 if expected else (index + 1) * window_us - now_us,
        7,
    ]
    plain.delete(prefix + "state", prefix + "askers")


# --- the policy -------------------------------------------------------------------------------

POLICY = """\
upstreams:
  backend:
    url: http://127.0.0.1:8000
routes:
  - name: api
    upstream: backend
limits:
  global:
{limit}
    key: [global]
    lease: {{}}
"""


@pytest.mark.parametrize(
    ("limit", "reason"),
    [
        (
            "    algorithm: leaky_bucket\n    rate: 10r/s",
            "a leaky_bucket that delays cannot be leased: its delays are computed per request "
            "from the shared state (nginx-exact), a batch taken ahead cannot shape them; lease "
            "one with nodelay: true",
        ),
        (
            "    algorithm: sliding_log\n    limit: 10\n    window: 1s",
            "sliding_log cannot be leased: it is exact per request timestamp, a batch taken "
            "ahead has none",
        ),
        (
            "    algorithm: token_bucket\n    rate: 10r/s\n    burst: 5\n    mode: queue",
            "a token_bucket with mode: queue or warmup cannot be leased: its delays and ramp are "
            "computed per request; lease one in reject mode without warmup",
        ),
    ],
    ids=["leaky_bucket", "sliding_log", "token_bucket queue"],
)
def test_check_refuses_a_lease_the_algorithm_cannot_keep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str, reason: str
) -> None:
    path = tmp_path / "leased.yaml"
    path.write_text(POLICY.format(limit=limit))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"{path}:8: limits.global: {reason}"


@pytest.mark.parametrize(
    "limit",
    [
        "    algorithm: fixed_window\n    limit: 10\n    window: 1s",
        "    algorithm: sliding_window\n    limit: 10\n    window: 1s",
        "    algorithm: token_bucket\n    rate: 10r/s\n    burst: 5",
        "    algorithm: leaky_bucket\n    rate: 10r/s\n    burst: 5\n    nodelay: true",
    ],
    ids=["fixed_window", "sliding_window", "token_bucket", "leaky_bucket nodelay"],
)
def test_check_accepts_a_lease_on_windows_and_buckets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    path = tmp_path / "leased.yaml"
    path.write_text(POLICY.format(limit=limit) + "store:\n  url: redis://127.0.0.1:1/0\n")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


# --- two replicas on one Redis, a fake clock --------------------------------------------------


def leased_limit(spec_yaml: dict[str, Any]) -> CompiledLimit:
    policy = Policy.model_validate({"limits": {"global": spec_yaml}})
    spec = policy.limits["global"]
    return CompiledLimit(
        "global",
        spec,
        build_algorithm(spec),
        KeyBuilder(spec.key),
        None,
        None,
        1.0,
        LimitCounters(),
    )


def replicas(
    server: RedisServer, clock: FakeClock, limit: CompiledLimit, n: int
) -> list[RedisStore]:
    prefix = f"lease{next(_prefixes)}:"
    stores = [
        RedisStore(server.url, key_prefix=prefix, timeout_s=2.0, clock=clock, time_source=clock)
        for _ in range(n)
    ]
    for store in stores:
        store.configure([limit], ())
    return stores


async def test_replicas_sharing_a_leased_window_admit_exactly_the_limit(
    redis_server: RedisServer,
) -> None:
    """Three replicas, uneven traffic (6:3:1), three windows: each window admits exactly its
    limit, in far fewer Redis calls than requests, and rejections past exhaustion cost none."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    limit = leased_limit(
        {"algorithm": "fixed_window", "limit": 200, "window": "1s", "key": ["global"], "lease": {}}
    )
    stores = replicas(redis_server, clock, limit, 3)
    check = Check(limit, "g")
    weights = [6, 3, 1]
    try:
        for _window in range(3):
            admitted = 0
            requests = 0
            calls_before = sum(s.stats.calls for s in stores)
            for step in range(100):  # 100 steps of 10 ms, 10 requests each
                for store, weight in zip(stores, weights, strict=True):
                    for _ in range(weight):
                        verdict = await store.decide([check])
                        admitted += verdict.allowed
                        requests += 1
                clock.advance(0.01)
                del step
            calls = sum(s.stats.calls for s in stores) - calls_before
            assert admitted == 200
            assert calls / requests <= 0.05, (calls, requests)
    finally:
        for store in stores:
            await store.close()


def exact_split(
    arrivals: list[tuple[int, int]], limit: int, window_us: int
) -> Counter[tuple[int, int]]:
    """What a per-request limit admits of each replica's requests, per window: the first
    ``limit`` of each window in arrival order. ``arrivals``: (instant, replica), sorted."""
    admitted: Counter[tuple[int, int]] = Counter()
    taken: Counter[int] = Counter()
    for at_us, replica in arrivals:
        window = at_us // window_us
        if taken[window] < limit:
            taken[window] += 1
            admitted[window, replica] += 1
    return admitted


@pytest.mark.parametrize("arrivals", ["even", "poisson"])
async def test_equal_replicas_share_a_leased_window_fairly_from_a_cold_start(
    redis_server: RedisServer, arrivals: str
) -> None:
    """Three equal replicas, 150 requests a second each, start together on a 3,000 per 10 s
    window nobody has asked for. Each is admitted in every window, the first included, what a
    per-request limit would admit of its requests, within 2 % of the limit. Before, the first
    to ask found no other asking and was granted half of the quota, more than it could spend
    before the others ran the rest out: 1,500 / 750 / 750 in the first window."""
    window_us = 10_000_000
    clock = FakeClock(T0_US - T0_US % window_us)
    limit = leased_limit(
        {
            "algorithm": "fixed_window",
            "limit": 3000,
            "window": "10s",
            "key": ["global"],
            "lease": {},
        }
    )
    stores = replicas(redis_server, clock, limit, 3)
    check = Check(limit, "g")
    start_us = clock.now_us()
    events: list[tuple[int, int]] = []
    for replica in range(3):
        rng = random.Random(replica)
        at_s = replica * 0.0003
        while at_s < 3 * window_us / 1e6:
            events.append((start_us + round(at_s * 1e6), replica))
            at_s += rng.expovariate(150.0) if arrivals == "poisson" else 1 / 150
    events.sort()
    admitted: Counter[tuple[int, int]] = Counter()
    try:
        for at_us, replica in events:
            clock.advance((at_us - clock.now_us()) / 1e6)
            store = stores[replica]
            verdict = store.try_decide_now([check]) or await store.decide([check])
            if verdict.allowed:
                admitted[at_us // window_us, replica] += 1
    finally:
        for store in stores:
            await store.close()
    exact = exact_split(events, 3000, window_us)
    windows = sorted({window for window, _ in exact})
    table = [[admitted[w, r] for r in range(3)] for w in windows]
    assert [sum(row) for row in table] == [3000] * 3, table
    for window in windows:
        for replica in range(3):
            assert abs(admitted[window, replica] - exact[window, replica]) <= 0.02 * 3000, (
                table,
                [[exact[w, r] for r in range(3)] for w in windows],
            )


async def test_a_replica_that_stops_gives_its_lease_back(redis_server: RedisServer) -> None:
    """Graceful shutdown returns the unused units: the other replica can spend them in the same
    window. A replica that vanishes without closing strands at most its lease."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    limit = leased_limit(
        {"algorithm": "fixed_window", "limit": 100, "window": "1s", "key": ["global"], "lease": {}}
    )
    first, second = replicas(redis_server, clock, limit, 2)
    check = Check(limit, "g")
    try:
        assert (await first.decide([check])).allowed
        held = first.leases.leases["global"]["g"].units
        assert held >= 1
        await first.close()
        assert first.leases.counters["global"].units_returned == held
        admitted = 0
        for _ in range(150):
            admitted += (await second.decide([check])).allowed
        assert admitted == 99  # everything but the one unit the first replica spent
    finally:
        await second.close()


@pytest.mark.parametrize(
    "spec",
    [
        {"algorithm": "token_bucket", "rate": "100r/s", "burst": 50},
        # nodelay: leased as a token bucket of burst + 1.
        {"algorithm": "leaky_bucket", "rate": "100r/s", "burst": 49, "nodelay": True},
    ],
    ids=["token_bucket", "leaky_bucket nodelay"],
)
async def test_a_leased_token_bucket_never_passes_capacity_plus_refill(
    redis_server: RedisServer, spec: dict[str, Any]
) -> None:
    clock = FakeClock(T0_US)
    limit = leased_limit({**spec, "key": ["global"], "lease": {}})
    stores = replicas(redis_server, clock, limit, 2)
    check = Check(limit, "g")
    admitted = 0
    try:
        for _step in range(200):  # 2 s in 10 ms steps, 5 requests per replica per step
            for store in stores:
                for _ in range(5):
                    admitted += (await store.decide([check])).allowed
            clock.advance(0.01)
        # Capacity + 2 s of refill at most; and the leases are spent, not stranded.
        assert 50 + 200 - 10 <= admitted <= 50 + 200
    finally:
        for store in stores:
            await store.close()


async def test_redis_down_spends_the_lease_then_follows_on_failure(
    redis_factory: redis_harness.RedisFactory,
) -> None:
    server = redis_factory.start()
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    limit = leased_limit(
        {"algorithm": "fixed_window", "limit": 100, "window": "1s", "key": ["global"], "lease": {}}
    )
    prefix = f"lease{next(_prefixes)}:"
    store = RedisStore(
        server.url,
        key_prefix=prefix,
        timeout_s=0.5,
        clock=clock,
        time_source=clock,
        on_failure="deny",
    )
    store.configure([limit], ())
    check = Check(limit, "g")
    try:
        assert (await store.decide([check])).allowed
        held = store.leases.leases["global"]["g"].units
        server.stop()
        for _ in range(held):
            assert (await store.decide([check])).allowed  # spent from the lease, no call
        from gateway.stores import StoreUnavailableError

        with pytest.raises(StoreUnavailableError):
            await store.decide([check])
    finally:
        await store.close()


redis_factory = redis_harness.redis_factory


# --- metrics and the dashboard ----------------------------------------------------------------


async def test_lease_metrics_and_dashboard(
    redis_server: RedisServer,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    browser: Browser,
) -> None:
    """A gateway leasing its global limit: 50 requests take one lease (a first ask) and
    make one Redis call; /metrics, the dashboard's state and the page (in Chromium) show it
    beside the limit."""
    limits = """\
  global:
    algorithm: fixed_window
    limit: 1000
    window: 10s
    key: [global]
    lease: {}
"""
    # The first ask is sized by the time left in the window (at most an interval, 2 s), and
    # the lease ends with the window: on a fake clock, at a window's start, for Redis too (on
    # its TIME the window could end before the 50 requests were decided).
    clock = FakeClock(T0_US - T0_US % 10_000_000)
    store = RedisStore(
        redis_server.url,
        key_prefix=f"metrics{next(_prefixes)}:",
        timeout_s=2.0,
        clock=clock,
        time_source=clock,
    )
    gateway = await start_gateway(limited_policy(upstream.url, limits), clock=clock, store=store)
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            assert await get_status(session, gateway.url + "/") == 200

        def leased(samples: Samples) -> bool:
            return value(samples, "gateway_limit_lease_decisions_total", limit="global") == 50

        samples = await scrape_until(session, gateway.admin_url, leased)
        assert value(samples, "gateway_limit_leases_total", limit="global", event="granted") == 1
        # No history yet: the quota's units over an interval (2 s of 10), one replica asking.
        assert value(samples, "gateway_limit_lease_size", limit="global") == 200
        assert value(samples, "gateway_limit_lease_store_calls_total", limit="global") == 1
        async with session.get(gateway.admin_url + "/dashboard/state") as response:
            state = await response.json()
        lease = state["state"]["limits"]["global"]["lease"]
        assert lease["granted"] == 1 and lease["last_size"] == 200 and lease["decided"] == 50
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gateway.admin_url + "/dashboard/")

    async def lease_shown() -> bool:
        if not await page.locator("#limit-global .lease").is_visible():
            return False
        return await dashboard_field(page, "global", "lease-size") == "200"

    await until_shown(lease_shown, "the lease line beside the limit")
    assert await dashboard_field(page, "global", "lease-granted") == "1"
    assert (
        await dashboard_field(page, "global", "lease-calls") == "0.0200"
    )  # 1 call for 50 requests
    assert not errors


async def test_an_expired_bucket_lease_goes_back_with_the_sweep(redis_server: RedisServer) -> None:
    """A token bucket lease left unspent is given back once its interval is over (the sweep,
    as no ask of this replica took it back): the other replica can take those tokens."""
    clock = FakeClock(T0_US)
    limit = leased_limit(
        {"algorithm": "token_bucket", "rate": "1r/s", "burst": 100, "key": ["global"], "lease": {}}
    )
    first, second = replicas(redis_server, clock, limit, 2)
    check = Check(limit, "g")
    try:
        assert (await first.decide([check])).allowed
        held = first.leases.leases["global"]["g"].units
        # A first ask: the refill over an interval (20 s at 1 r/s), less the one spent.
        assert held == 19
        clock.advance(first.leases.plans["global"].interval_us * 2 / 1e6)
        await first.leases.sweep()
        counters = first.leases.counters["global"]
        assert (counters.expired, counters.returned, counters.units_returned) == (1, 1, 19)
        # 99 tokens back in the bucket, plus what 200 s of refill... capped at the capacity.
        admitted = 0
        for _ in range(120):
            admitted += (await second.decide([check])).allowed
        assert admitted == 100
    finally:
        for store in (first, second):
            await store.close()


async def test_a_bucket_lease_that_arrives_late_is_still_spent(
    redis_factory: redis_harness.RedisFactory,
) -> None:
    """A token bucket lease lasts its interval from its arrival: an ask held up longer than
    that (a frozen Redis, a stalled machine) still admits the request that asked, instead of
    rejecting it with the lease just granted."""
    server = redis_factory.start()
    clock = FakeClock(T0_US)
    limit = leased_limit(
        {"algorithm": "token_bucket", "rate": "10r/s", "burst": 100, "key": ["global"], "lease": {}}
    )
    (store,) = replicas(server, clock, limit, 1)
    check = Check(limit, "g")
    try:
        server.pause()
        asked = asyncio.ensure_future(store.decide([check]))
        await asyncio.sleep(0.1)  # the call is out, Redis frozen
        clock.advance(store.leases.plans["global"].interval_us * 3 / 1e6)
        server.resume()
        assert (await asked).allowed
    finally:
        await store.close()


class _LaggingRedisClock:
    """Redis's clock for the lease calls (``time_source``): it stays a few microseconds before
    a window's end, while each call it stamps moves the replica's clock on by the call's
    latency (Redis's clock behind the replica's, as two machines' clocks are)."""

    def __init__(self, replica: FakeClock, now_us: int, latency_us: int) -> None:
        self.replica = replica
        self.now = now_us
        self.latency_us = latency_us

    def now_us(self) -> int:
        self.replica.advance(us=self.latency_us)
        return self.now

    def unix_us(self) -> int:
        return self.now


@pytest.mark.parametrize("algorithm", ["sliding_window", "fixed_window"])
async def test_a_window_lease_that_arrives_past_its_window_still_admits_its_request(
    redis_server: RedisServer, algorithm: str
) -> None:
    """A lease granted in a window's last microseconds may arrive after its window ended on
    the replica's clock, and the next ask too. The request that asked is still admitted: Redis
    counted its unit in that window, as an exact decision would have (it was rejected with
    'retry after 0.001s' at a window boundary, far from the limit)."""
    window_end_us = T0_US - T0_US % 1_000_000 + 1_000_000
    replica_clock = FakeClock(window_end_us - 10)
    redis_clock = _LaggingRedisClock(replica_clock, window_end_us - 10, latency_us=50)
    limit = leased_limit(
        {"algorithm": algorithm, "limit": 1000, "window": "1s", "key": ["global"], "lease": {}}
    )
    prefix = f"lease{next(_prefixes)}:"
    store = RedisStore(
        redis_server.url,
        key_prefix=prefix,
        timeout_s=2.0,
        clock=replica_clock,
        time_source=redis_clock,
    )
    store.configure([limit], ())
    check = Check(limit, "g")
    try:
        verdict = await store.decide([check])
        assert verdict.allowed, verdict
        # The grant arrived after its window's end on the replica's clock.
        assert replica_clock.now_us() > window_end_us
        redis_clock.now = window_end_us + 100  # Redis's next window: a live lease
        for _ in range(5):
            assert (await store.decide([check])).allowed
    finally:
        await store.close()


async def test_a_request_rejected_by_a_stacked_limit_is_charged_to_no_lease(
    redis_server: RedisServer,
) -> None:
    """nginx's rule across a leased and an exact limit: a request the exact limit rejects
    gives its unit back to the lease; one the lease rejects is not charged to the other."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    leased = leased_limit(
        {"algorithm": "fixed_window", "limit": 3, "window": "1s", "key": ["global"], "lease": {}}
    )
    policy = Policy.model_validate(
        {"limits": {"per_ip": {"algorithm": "fixed_window", "limit": 2, "window": "1s"}}}
    )
    spec = policy.limits["per_ip"]
    exact = CompiledLimit(
        "per_ip",
        spec,
        build_algorithm(spec),
        KeyBuilder(spec.key),
        None,
        None,
        1.0,
        LimitCounters(),
    )
    store = RedisStore(
        redis_server.url,
        key_prefix=f"stack{next(_prefixes)}:",
        timeout_s=2.0,
        clock=clock,
        time_source=clock,
    )
    store.configure([exact, leased], ())
    try:
        verdicts = [await store.decide([Check(exact, "a"), Check(leased, "g")]) for _ in range(4)]
        assert [v.allowed for v in verdicts] == [True, True, False, False]
        assert verdicts[2].rejected_by == (0,)
        lease = store.leases.leases["global"]["g"]
        # A first lease of 2 (half of 3) spent by the two admitted; then a lease of the last
        # unit, which the two rejected took in turn and gave back.
        assert store.leases.counters["global"].units_granted == 3
        assert (lease.size, lease.units) == (1, 1)
        # The lease's last unit, then nothing left: the third client is charged nothing.
        assert (await store.decide([Check(exact, "b"), Check(leased, "g")])).allowed
        rejected = await store.decide([Check(exact, "c"), Check(leased, "g")])
        assert not rejected.allowed and rejected.rejected_by == (1,)
        look = await store.decide([Check(exact, "c")], commit=False)
        assert look.decisions[0].remaining == 1  # nothing charged to "c": 2 - 1 for the look
    finally:
        await store.close()


async def test_a_reload_that_changes_a_leased_limit_gives_its_leases_back(
    redis_server: RedisServer,
) -> None:
    """A reload that changes a leased limit's parameters drops its leases: their unused units
    go back to Redis (as at shutdown), so the other replica can spend them in the same window;
    left to expire, they would be stranded until the window ends."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    spec = {"algorithm": "fixed_window", "limit": 100, "window": "1s", "key": ["global"]}
    limit = leased_limit({**spec, "lease": {}})
    first, second = replicas(redis_server, clock, limit, 2)
    check = Check(limit, "g")
    try:
        assert (await first.decide([check])).allowed
        held = first.leases.leases["global"]["g"].units
        # A first ask: the quota over an interval (200 ms of 1 s), less the one spent.
        assert held == 19
        changed = leased_limit({**spec, "limit": 120, "lease": {}})
        first.configure([changed], [limit])
        await first.leases.returns_done()
        counters = first.leases.counters["global"]
        assert (counters.returned, counters.units_returned) == (1, held)
        admitted = 0
        for _ in range(150):
            admitted += (await second.decide([check])).allowed
        assert admitted == 99  # all but the unit the first replica spent
    finally:
        for store in (first, second):
            await store.close()


@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_lease_calls_go_through_the_configured_client(
    redis_server: RedisServer, client: Any
) -> None:
    """``client: redis-py`` makes the lease calls with redis-py too, not the thin client."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    limit = leased_limit(
        {"algorithm": "fixed_window", "limit": 100, "window": "1s", "key": ["global"], "lease": {}}
    )
    store = RedisStore(
        redis_server.url,
        key_prefix=f"client{next(_prefixes)}:",
        timeout_s=2.0,
        clock=clock,
        time_source=clock,
        client=client,
    )
    store.configure([limit], ())
    try:
        # Two leases: a first ask (the quota over an interval, 20), then 20 by demand.
        for _ in range(30):
            assert (await store.decide([Check(limit, "g")])).allowed
        expected = PipelineClient if client == "redis-py" else ThinClient
        assert type(store.leases.client) is expected
        assert type(store.client) is expected
        assert store.leases.counters["global"].calls == 2
        assert store.leases.client.round_trips == 2
    finally:
        await store.close()


LEASED_OUTAGE: dict[str, dict[str, Any]] = {
    # Long windows and a slow refill: nothing comes back during the test, so the quota is exact.
    "fixed_window": {"algorithm": "fixed_window", "limit": 40, "window": "720h"},
    "sliding_window": {"algorithm": "sliding_window", "limit": 40, "window": "720h"},
    "token_bucket": {"algorithm": "token_bucket", "rate": "1r/m", "burst": 40},
}


@pytest.mark.reliability
@pytest.mark.parametrize("name", sorted(LEASED_OUTAGE))
async def test_a_leased_quota_is_admitted_once_across_an_outage(
    redis_factory: redis_harness.RedisFactory, name: str
) -> None:
    """A real Redis frozen (SIGSTOP) while the replica holds a lease, then resumed, with
    ``on_failure: local``: the replica spends its lease, then the fallback admits only what
    its share has left after what the leases admitted (seeded); once Redis answers again, what
    the fallback admitted is charged to the lease state before the next grant (carried back).
    Across the outage the quota is admitted once: 40, not 40 per side."""
    server = redis_factory.start()
    limit = leased_limit({**LEASED_OUTAGE[name], "key": ["global"], "lease": {}})
    store = RedisStore(
        server.url,
        key_prefix=f"outage{next(_prefixes)}:",
        timeout_s=0.05,
        breaker=CircuitBreaker(
            "test", failure_threshold=2, reset_timeout_s=0.2, max_reset_timeout_s=0.4
        ),
    )
    store.configure([limit], ())
    check = Check(limit, "g")
    loop = asyncio.get_running_loop()
    try:
        # Leases (a first ask: the quota over an interval; then by demand), 10 spent.
        before = await burst(store, check, 10)
        held = store.leases.leases["global"]["g"].units
        assert before == 10

        server.pause()
        during = await burst(store, check, 120)
        assert store.breaker.state == "open" and store.counters.local_decisions > 0
        # What the lease held, then the fallback's quota (40) less the 10 + held the leases
        # admitted: 30 in all, however the grants were cut.
        assert during == 30, (held, during)

        server.resume()
        after = 0
        deadline = loop.time() + 10.0
        while store.breaker.state != "closed" and loop.time() < deadline:
            after += await burst(store, check, 8)
            await asyncio.sleep(0.05)
        assert store.breaker.state == "closed"
        # Redis was charged with what the fallback admitted before the next grant: nothing
        # is left (without it, the fallback's 20 are granted again).
        after += await burst(store, check, 120)
        assert after == 0, (before, during, after)
        assert not store.leases.owed and store.leases.carried_back > 0
    finally:
        server.resume()
        await store.close()


async def test_a_slow_replica_is_granted_what_it_spends_not_what_it_is_asked(
    redis_server: RedisServer,
) -> None:
    """Closed-loop clients on a fake clock: a fast replica (an admitted request takes 1 ms, a
    rejected one 0.1 ms) and a slow one (20 ms and 0.5 ms). The slow one's rejections, once a
    window is spent, come back 40 times as fast as its admissions: sized by the requests it saw,
    its next grant was more than it could spend before the window ended (275 of 300 admitted in
    every other window). Sized by how fast it spent its last lease, every window admits 300."""
    clock = FakeClock(T0_US - T0_US % 1_000_000)
    limit = leased_limit(
        {"algorithm": "fixed_window", "limit": 300, "window": "1s", "key": ["global"], "lease": {}}
    )
    stores = replicas(redis_server, clock, limit, 2)
    costs_us = [(1_000, 100), (20_000, 500)]  # (admitted, rejected) per replica
    next_us = [clock.now_us(), clock.now_us() + 50]
    end_us = clock.now_us() + 5_000_000
    check = Check(limit, "g")
    admitted: dict[int, int] = {}
    try:
        for _ in range(200_000):  # bounded: about 40,000 requests in the 5 s
            replica = min(range(2), key=lambda index: next_us[index])
            at_us = next_us[replica]
            if at_us >= end_us:
                break
            clock.advance((at_us - clock.now_us()) / 1e6)
            verdict = await stores[replica].decide([check])
            if verdict.allowed:
                admitted[at_us // 1_000_000] = admitted.get(at_us // 1_000_000, 0) + 1
            next_us[replica] = at_us + costs_us[replica][0 if verdict.allowed else 1]
        windows = [admitted[index] for index in sorted(admitted)]
        assert len(windows) == 5
        # The first window's grants are sized with no history (a fair share).
        assert windows[1:] == [300] * 4, windows
    finally:
        for store in stores:
            await store.close()

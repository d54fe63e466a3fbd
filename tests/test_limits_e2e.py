"""Rate limiting end to end: the real gateway, a real upstream, real clients, an injected clock."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.engine.limit_engine import LimitEngine
from gateway.engine.preflight import parse_and_build
from gateway.limits.compiled import Check
from gateway.stores import RedisStore
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support import redis_harness
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server


def limited_policy(upstream_url: str, limits: str, extra: str = "") -> str:
    return policy_for(upstream_url) + "limits:\n" + limits + extra


async def _get(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with session.get(url, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_leaky_bucket_nodelay_rejects_beyond_burst_with_headers(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  per_ip:
    algorithm: leaky_bucket
    rate: 1r/s
    burst: 2
    nodelay: true
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        results = [await _get(session, gw.url + "/") for _ in range(4)]
        # rate 1r/s, burst 2, no time passing: 1 + 2 admitted, the 4th rejected.
        assert [status for status, _, _ in results] == [200, 200, 200, 429]
        _, ok_headers, _ = results[0]
        assert ok_headers["RateLimit-Policy"] == '"per_ip";q=3;w=3'
        assert ok_headers["RateLimit"].startswith('"per_ip";r=2;')
        _, headers, body = results[3]
        assert headers["Content-Type"] == "application/problem+json"
        assert headers["Retry-After"] == "1"
        assert headers["RateLimit"].startswith('"per_ip";r=0;')
        problem = json.loads(body)
        assert problem["status"] == 429 and problem["limit"] == "per_ip"
        assert len(upstream.requests) == 3

        clock.advance(1.0)
        assert (await _get(session, gw.url + "/"))[0] == 200
        assert (await _get(session, gw.url + "/"))[0] == 429


async def test_rejected_request_consumes_from_no_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  per_client:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 3
    nodelay: true
    key: ['header:X-Client']
  global:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 1
    nodelay: true
    key: [global]
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        # Client b spends the global allowance (2 requests); client a is then refused by it.
        for _ in range(2):
            assert (await _get(session, gw.url + "/", {"X-Client": "b"}))[0] == 200
        for _ in range(5):
            assert (await _get(session, gw.url + "/", {"X-Client": "a"}))[0] == 429
        async with session.get(
            gw.admin_url + "/explain",
            params={"path": "/", "header": "X-Client: a"},
        ) as resp:
            explained = await resp.json()
    per_client = next(x for x in explained["limits"] if x["name"] == "per_client")
    # None of a's five rejected requests was charged to its own per-client bucket.
    assert per_client["next_request"]["remaining"] == 3
    assert per_client["key"] == "a"


async def test_explain_refuses_a_question_about_no_possible_client(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A client_ip that is no address, or a header without its value: a 400 saying what to
    ask, not an answer about a key no client can have."""
    limit = "  per_client:\n    algorithm: fixed_window\n    limit: 5\n    window: 1m\n"
    gw = await start_gateway(limited_policy(upstream.url, limit))
    async with aiohttp.ClientSession() as session:
        for params, error in (
            (
                {"path": "/", "client_ip": "300.1.1.1"},
                "client_ip='300.1.1.1': not an IP address (203.0.113.9, 2001:db8::1)",
            ),
            (
                {"path": "/", "header": "X-API-Key"},
                "header='X-API-Key': write header=Name:value (X-API-Key:abc)",
            ),
        ):
            async with session.get(gw.admin_url + "/explain", params=params) as resp:
                assert (resp.status, await resp.json()) == (400, {"error": error})
        params = {"path": "/", "client_ip": "2001:db8::1", "header": "X-API-Key: abc"}
        async with session.get(gw.admin_url + "/explain", params=params) as resp:
            assert resp.status == 200
            assert (await resp.json())["limits"][0]["key"] == "2001:db8::/64"


async def test_dry_run_limit_counts_but_never_enforces(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  real:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 5
    nodelay: true
  candidate:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 1
    nodelay: true
    dry_run: true
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        statuses = [(await _get(session, gw.url + "/"))[0] for _ in range(8)]
    assert statuses == [200] * 6 + [429] * 2
    engine = gw.gateway.handler.runtime.engine
    candidate = next(x for x in engine.limits if x.name == "candidate")
    # The candidate (burst 1) would have let 2 through: the other 6 would have been rejected.
    assert candidate.counters.dry_run_rejected == 6
    real = next(x for x in engine.limits if x.name == "real")
    assert real.counters.rejected == 2


async def test_shaping_delays_then_forwards(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = limited_policy(
        upstream.url,
        """\
  shaped:
    algorithm: leaky_bucket
    rate: 10r/s
    burst: 10
""",
    )
    gw = await start_gateway(policy)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        started = loop.time()
        results = await asyncio.gather(*[_get(session, gw.url + "/") for _ in range(4)])
        elapsed = loop.time() - started
    assert [r[0] for r in results] == [200] * 4
    # nginx without nodelay: the 2nd..4th requests wait 100, 200 and 300 ms.
    assert elapsed >= 0.28


async def test_queue_bounds_reject_at_once(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = limited_policy(
        upstream.url,
        """\
  shaped:
    algorithm: leaky_bucket
    rate: 2r/s
    burst: 20
    max_queue: 2
    max_delay: 10s
""",
    )
    # Decided on a fake clock (the queued requests still wait on the loop's): on the real one
    # a pause of 0.5 s after the first request drains the bucket, the next is served at once,
    # and three requests are admitted instead of two.
    gw = await start_gateway(policy, clock=FakeClock())
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:

        async def timed() -> tuple[int, float]:
            started = loop.time()
            status = (await _get(session, gw.url + "/"))[0]
            return status, loop.time() - started

        first = await timed()  # served at once, the bucket is empty
        assert first[0] == 200
        results = await asyncio.gather(*[timed() for _ in range(4)])
    statuses = sorted(s for s, _ in results)
    assert statuses == [200, 200, 429, 429]
    # The two over the queue bound were refused at once, not held.
    assert all(t < 0.3 for s, t in results if s == 429)


async def test_max_delay_rejects_instead_of_waiting(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  shaped:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 10
    max_delay: 5s
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        first = await _get(session, gw.url + "/")
        second = await _get(session, gw.url + "/")
    assert first[0] == 200
    # The second would wait 60 s: over max_delay, so it is rejected at once.
    assert second[0] == 429
    assert int(second[1]["Retry-After"]) >= 5


async def test_client_leaving_the_queue_gets_its_charge_back(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  shaped:
    algorithm: leaky_bucket
    rate: 1r/s
    burst: 5
    max_delay: 30s
""",
    )
    gw = await start_gateway(policy, clock=clock)
    engine = gw.gateway.handler.runtime.engine
    shaped = engine.limits[0]
    async with aiohttp.ClientSession() as session:
        assert (await _get(session, gw.url + "/"))[0] == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"GET /queued HTTP/1.1\r\nHost: h\r\n\r\n")
        await wait_until(lambda: shaped.counters.waiting == 1, "the request to be queued")
        assert shaped.counters.waiting == 1
        writer.close()
        await wait_until(lambda: shaped.counters.waiting == 0, "the queued request to leave")
        assert shaped.counters.waiting == 0
        async with session.get(gw.admin_url + "/explain", params={"path": "/"}) as resp:
            explained = await resp.json()
    # One request admitted and served, the queued one refunded: 4 of burst 5 left.
    assert explained["limits"][0]["next_request"]["remaining"] == 4
    assert [r.raw_path for r in upstream.requests] == ["/"]
    del reader


async def test_access_lists(upstream: RecordingUpstream, start_gateway: GatewayFactory) -> None:
    policy = limited_policy(
        upstream.url,
        """\
  tight:
    algorithm: leaky_bucket
    rate: 1r/m
    nodelay: true
""",
        """\
access:
  allow: [127.0.0.0/8]
""",
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession() as session:
        statuses = [(await _get(session, gw.url + "/"))[0] for _ in range(5)]
    assert statuses == [200] * 5  # allowed clients bypass every limit

    deny_all = """\
access:
  deny: [127.0.0.1/32]
"""
    denied = await start_gateway(policy_for(upstream.url) + deny_all)
    async with aiohttp.ClientSession() as session:
        assert (await _get(session, denied.url + "/"))[0] == 403


async def test_missing_key_part_skips_or_falls_back(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  by_key_skip:
    algorithm: leaky_bucket
    rate: 1r/m
    nodelay: true
    key: ['header:X-API-Key']
    match: {path_prefix: /skip}
  by_key_ip:
    algorithm: leaky_bucket
    rate: 1r/m
    nodelay: true
    key: ['header:X-API-Key']
    on_missing_key: client_ip
    match: {path_prefix: /fallback}
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        skip = [(await _get(session, gw.url + "/skip"))[0] for _ in range(3)]
        fallback = [(await _get(session, gw.url + "/fallback"))[0] for _ in range(3)]
        keyed = [(await _get(session, gw.url + "/skip", {"X-API-Key": "k1"}))[0] for _ in range(2)]
    assert skip == [200, 200, 200]
    assert fallback == [200, 429, 429]
    assert keyed == [200, 429]


async def test_throttled_upload_is_refused_before_its_body_is_sent(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = limited_policy(
        upstream.url,
        """\
  uploads:
    algorithm: leaky_bucket
    rate: 1r/m
    nodelay: true
""",
    )
    gw = await start_gateway(policy, clock=FakeClock())
    head = b"PUT /file HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(head)
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"hello")
    assert b" 200 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(head)
    answer = await asyncio.wait_for(reader.read(), 5)  # the gateway closes after the 429
    writer.close()
    assert answer.startswith(b"HTTP/1.1 429 ")
    assert b"100 Continue" not in answer
    assert [r.body for r in upstream.requests] == [b"hello"]


async def test_queue_refusal_charges_no_stacked_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        """\
  window:
    algorithm: fixed_window
    limit: 3
    window: 1h
  shaped:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 10
    max_queue: 0
""",
    )
    gw = await start_gateway(policy, clock=clock)
    async with aiohttp.ClientSession() as session:
        statuses = [(await _get(session, gw.url + "/"))[0] for _ in range(5)]
        async with session.get(gw.admin_url + "/explain", params={"path": "/"}) as resp:
            explained = {x["name"]: x for x in (await resp.json())["limits"]}
    # The first goes at once; the others would wait a minute in a queue that takes none.
    assert statuses == [200, 429, 429, 429, 429]
    # A window cannot take a charge back: the refusals must never have charged it.
    assert explained["window"]["next_request"]["remaining"] == 1


def _rate_limit_fields(value: str) -> dict[str, int]:
    """``"name";r=0;t=60`` -> ``{"r": 0, "t": 60}`` (one limit)."""
    return {k: int(v) for k, v in (item.split("=") for item in value.split(";")[1:])}


@pytest.mark.parametrize(
    "limit",
    [
        """\
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 1
    nodelay: true
""",
        """\
    algorithm: leaky_bucket
    rate: 2r/m
    burst: 3
""",
        """\
    algorithm: token_bucket
    rate: 1r/m
    burst: 2
""",
        """\
    algorithm: fixed_window
    limit: 3
    window: 1m
""",
        """\
    algorithm: sliding_window
    limit: 3
    window: 1m
""",
        """\
    algorithm: sliding_log
    limit: 3
    window: 1m
""",
    ],
)
async def test_ratelimit_t_agrees_with_retry_after_and_stays_within_the_window(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, limit: str
) -> None:
    """On a rejection the rejecting limit's t is its Retry-After (a client reading either waits
    as long); otherwise t, the time until the quota is full again, is at most w."""
    clock = FakeClock()
    clock.advance(10.0)  # not on a window boundary
    gw = await start_gateway(
        limited_policy(upstream.url, "  only:\n" + limit + "    max_delay: 0s\n"), clock=clock
    )
    rejections = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(12):
            status, headers, _ = await _get(session, gw.url + "/")
            window = int(headers["RateLimit-Policy"].rsplit("w=", 1)[1])
            fields = _rate_limit_fields(headers["RateLimit"])
            if status == 429:
                rejections += 1  # over the quota, or over max_delay (r may then be above 0)
                assert fields["t"] == int(headers["Retry-After"]), headers
            else:
                assert 0 <= fields["t"] <= window, headers
            clock.advance(7.0)
    assert rejections > 0


QUARTER_HOURLY = """\
  quota:
    algorithm: fixed_window
    limit: 100
    window: 15m
"""
X_RATELIMIT = "headers:\n  x_ratelimit: true\n"
# Saturday 28 November 2026, 20:16:52 UTC: the quarter hour ends at 20:30:00, 788 s later.
AT_20_16_52_US = 1_795_897_012 * 1_000_000
QUARTER_S = 15 * 60


def _reset_of(headers: dict[str, str]) -> tuple[int, int]:
    """``X-RateLimit-Reset`` and ``RateLimit``'s ``t``: the seconds to the window's end."""
    t = int(headers["RateLimit"].rpartition(";t=")[2])
    return int(headers["X-RateLimit-Reset"]), t


def _store_policy(store: str, request: pytest.FixtureRequest) -> str:
    if store != "redis":
        return ""
    server = request.getfixturevalue("redis_server")
    return f"store:\n  url: {server.url}\n  key_prefix: 'quarter{time.time_ns()}:'\n"


@pytest.mark.parametrize("store", ["memory", "shared", "redis"])
async def test_a_fixed_window_resets_on_the_wall_clocks_quarter_hour(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    store: str,
) -> None:
    """The gateway's own clocks (no fake one): a 15-minute window ends at :00, :15, :30 or :45
    of the wall clock in every store, as Redis ``TIME`` has it; not at multiples of 15 minutes
    since the host booted."""
    policy = limited_policy(
        upstream.url, QUARTER_HOURLY, X_RATELIMIT + _store_policy(store, request)
    )
    shared = {"store": SharedStore(tmp_path / "shared")} if store == "shared" else {}
    gw = await start_gateway(policy, **shared)
    async with aiohttp.ClientSession() as session:
        before = time.time()
        status, headers, _ = await _get(session, gw.url + "/")
        after = time.time()
    assert status == 200
    # The seconds to the next quarter hour, rounded up, as the request was decided.
    earliest = math.ceil(QUARTER_S - after % QUARTER_S)
    latest = math.ceil(QUARTER_S - before % QUARTER_S)
    expected = {earliest, latest} if earliest <= latest else {earliest, latest, QUARTER_S}
    reset, t = _reset_of(headers)
    assert reset == t and reset in expected, (reset, before % QUARTER_S, after % QUARTER_S)


@pytest.mark.parametrize("store", ["memory", "shared"])
async def test_at_20_16_52_a_quarter_hourly_window_resets_at_20_30(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path, store: str
) -> None:
    clock = FakeClock(AT_20_16_52_US)
    shared = {"store": SharedStore(tmp_path / "shared", clock)} if store == "shared" else {}
    gw = await start_gateway(
        limited_policy(upstream.url, QUARTER_HOURLY, X_RATELIMIT), clock=clock, **shared
    )
    async with aiohttp.ClientSession() as session:
        assert _reset_of((await _get(session, gw.url + "/"))[1]) == (788, 788)
        clock.advance(788 - 1e-6)
        assert _reset_of((await _get(session, gw.url + "/"))[1]) == (1, 1)
        clock.advance(1e-6)  # 20:30:00: a new window, to 20:45:00
        _, headers, _ = await _get(session, gw.url + "/")
    assert _reset_of(headers) == (QUARTER_S, QUARTER_S)
    assert headers["X-RateLimit-Remaining"] == "99"


async def test_at_20_16_52_a_quarter_hourly_window_resets_at_20_30_on_redis(
    redis_server: RedisServer,
) -> None:
    """The script decides on the time it is given (Redis ``TIME`` unless a test passes one)."""
    clock = FakeClock(AT_20_16_52_US)
    policy = parse_and_build(limited_policy("http://127.0.0.1:1", QUARTER_HOURLY)).policy
    store = RedisStore(redis_server.url, key_prefix=f"q2030-{time.time_ns()}:", time_source=clock)
    engine = LimitEngine(policy, store, build_algorithm)
    store.configure(engine.limits, ())
    (limit,) = engine.limits
    check = Check(limit, "client", 1)
    try:
        verdict = await store.decide([check])
        assert verdict.allowed and verdict.decisions[0].reset_s == pytest.approx(788.0)
        clock.advance(788.0)
        verdict = await store.decide([check])
        assert verdict.decisions[0].reset_s == pytest.approx(QUARTER_S)
        assert verdict.decisions[0].remaining == 99  # a new window
    finally:
        await store.close()

"""A limit counted by its responses holds budget while its requests are in flight (``hold:
in_flight``, the default): a request takes its cost at admission and the response settles it,
so at most the budget left can be in flight at once. Through a real gateway, in front of an
upstream that holds its answers until the test lets them go, over real connections, in
process, in the workers' shared store and in real Redis.

The burst case is the login recipe: 200 wrong passwords at once against 5 failures a minute.
With ``hold: none`` (the old behaviour) all 200 reached the upstream."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest

from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.stores import RedisStore
from tests.support import redis_harness
from tests.support.conformance import T0_US, gateway_store_of
from tests.support.gateways import GatewayFactory, RunningGateway, hang_up_while_queued
from tests.support.held_upstream import HeldUpstream
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
redis_factory = redis_harness.redis_factory

BURST = 200
LIMIT = 5
TIMEOUT = aiohttp.ClientTimeout(total=30)


def _policy(upstream: HeldUpstream, hold: str | None = None, read_timeout: str = "1s") -> str:
    """5 failed logins a minute; the upstream's read timeout short for the endings that time
    out, long for a burst (200 held while the rest arrive)."""
    return (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  backend:\n    url: {upstream.url}\n    read_timeout: {read_timeout}\n"
        "    max_connections: 512\n"
        "routes:\n  - name: login\n    upstream: backend\n"
        "limits:\n  failed_logins:\n    algorithm: fixed_window\n"
        f"    limit: {LIMIT}\n    window: 1m\n    count: {{statuses: [401]}}\n"
        + (f"    hold: {hold}\n" if hold is not None else "")
    )


async def _burst(gw: RunningGateway, upstream: HeldUpstream, name: str) -> Counter[int]:
    """``BURST`` wrong logins sent at once, each held by the upstream until all have either
    reached it or been answered by the gateway; then the upstream answers 401: the statuses."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:

        async def login() -> int:
            async with session.post(f"{gw.url}/hold/{name}?status=401") as resp:
                await resp.read()
                return resp.status

        tasks = [asyncio.create_task(login()) for _ in range(BURST)]
        await wait_until(
            lambda: upstream.in_flight.get(name, 0) + sum(t.done() for t in tasks) == BURST,
            "every login upstream or answered",
            within_s=20,
        )
        upstream.release(name)
        statuses = Counter(await asyncio.gather(*tasks))
    await gw.gateway.handler.runtime.engine.charges_done()
    return statuses


async def _left(gw: RunningGateway) -> int:
    """What the key has left, as /explain says (the next request's remaining plus its own
    unit when it would be admitted)."""
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/explain", params={"path": "/hold/x"}) as resp,
    ):
        explained = await resp.json()
    (entry,) = explained["limits"]
    decision = entry["next_request"]
    return int(decision["remaining"]) + (1 if decision["allowed"] else 0)


@pytest.mark.reliability
@pytest.mark.parametrize("kind", ["memory", "shared", "redis", "cluster"])
async def test_a_burst_of_wrong_logins_reaches_the_upstream_at_most_the_limit_times(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(held_upstream, read_timeout="30s"),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "holds"),
    )
    statuses = await _burst(gw, held_upstream, "burst")
    print(
        f"\n{kind}: {BURST} wrong logins at once, {LIMIT} a minute: "
        f"{held_upstream.arrived} reached the upstream, answers {dict(statuses)}"
    )
    assert held_upstream.arrived == LIMIT
    assert statuses == {401: LIMIT, 429: BURST - LIMIT}
    # The five failures are charged: the key has nothing left until the window ends.
    assert await _left(gw) == 0
    clock.advance(60)
    assert await _left(gw) == LIMIT


@pytest.mark.reliability
@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_hold_none_admits_the_whole_burst_as_before(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(held_upstream, "none", "30s"),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "holds"),
    )
    statuses = await _burst(gw, held_upstream, "burst")
    print(
        f"\n{kind}, hold: none: {BURST} wrong logins at once, {LIMIT} a minute: "
        f"{held_upstream.arrived} reached the upstream, answers {dict(statuses)}"
    )
    assert held_upstream.arrived == BURST
    assert statuses == {401: BURST}
    assert await _left(gw) == 0  # the charges stop at the limit


async def _answered_200(url: str, session: aiohttp.ClientSession) -> None:
    async with session.post(url + "/fast") as resp:
        assert resp.status == 200


async def _upstream_fails(url: str, session: aiohttp.ClientSession) -> None:
    async with session.post(url + "/fail") as resp:
        assert resp.status == 502


async def _upstream_times_out(url: str, session: aiohttp.ClientSession) -> None:
    async with session.post(url + "/sleep") as resp:
        assert resp.status == 504


async def _gone_before_the_answer(url: str, session: aiohttp.ClientSession) -> None:
    request = asyncio.create_task(session.post(url + "/hold/gone?status=401"))
    await wait_until(lambda: _UPSTREAM[0].in_flight.get("gone") == 1, "the request upstream")
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def _gone_mid_answer(url: str, session: aiohttp.ClientSession) -> None:
    resp = await session.post(url + "/stream/mid?status=401")
    assert resp.status == 401
    assert len(await resp.content.readexactly(65536)) == 65536
    resp.close()  # the client hangs up with half of the body unread


_UPSTREAM: list[HeldUpstream] = []
ENDINGS = {
    "answered 200": _answered_200,
    "upstream failed (502)": _upstream_fails,
    "upstream timed out (504)": _upstream_times_out,
    "client gone before the answer (499)": _gone_before_the_answer,
}


@pytest.mark.reliability
@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("kind", ["memory", "shared", "redis", "cluster"])
async def test_a_hold_comes_back_when_the_response_does_not_match(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
    ending: str,
) -> None:
    """However the request ends without a 401, its hold is given back: the key has its
    whole budget again; an ending that is a 401 (the client gone in the middle of it) keeps
    it."""
    _UPSTREAM[:] = [held_upstream]
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(held_upstream),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "holds"),
    )
    engine = gw.gateway.handler.runtime.engine
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(3):
            await ENDINGS[ending](gw.url, session)

    async def settled() -> bool:
        await engine.charges_done()
        return await _left(gw) == LIMIT

    await wait_until(settled, f"the holds back after {ending}")
    (limit,) = engine.limits
    assert limit.counters.charged_responses == 0
    # However it ended, no request counts as holding units in flight any more.
    await wait_until(lambda: gw.gateway.handler.runtime.inflight == 0, "the requests to end")
    assert limit.counters.units_in_flight == 0


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_client_gone_in_the_middle_of_a_counted_answer_is_charged(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """The status the client got was a 401 (it left in the middle of the body): the hold is
    kept as the charge."""
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _policy(held_upstream),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "holds"),
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _gone_mid_answer(gw.url, session)
    await wait_until(lambda: held_upstream.in_flight.get("mid", 0) == 1, "the stream upstream")
    held_upstream.release("mid")
    engine = gw.gateway.handler.runtime.engine
    (limit,) = engine.limits

    async def charged() -> bool:
        await engine.charges_done()
        return limit.counters.charged_responses == 1

    await wait_until(charged, "the charge")
    assert await _left(gw) == LIMIT - 1
    assert limit.counters.units_in_flight == 0


async def test_a_client_gone_while_redis_decides_leaves_no_hold_behind(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    redis_factory: redis_harness.RedisFactory,
) -> None:
    """The client hangs up while its admission's script call is in flight (Redis frozen):
    once Redis runs the call, the hold it took is given back (it would otherwise stay until
    the window ends, the request never settled)."""
    server = redis_factory.start()
    clock = FakeClock(T0_US)
    store = RedisStore(server.url, clock=clock, time_source=clock, timeout_s=10.0)
    gw = await start_gateway(_policy(held_upstream), clock=clock, store=store)
    runtime = gw.gateway.handler.runtime
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert await _left(gw) == LIMIT  # the connection to Redis is made
        calls = store.counters.calls
        server.pause()
        try:
            login = asyncio.create_task(session.post(gw.url + "/hold/x?status=401"))
            await wait_until(lambda: store.counters.calls > calls, "the admission's call")
            login.cancel()
            with pytest.raises(asyncio.CancelledError):
                await login
            await wait_until(lambda: runtime.inflight == 0, "the request to end")
        finally:
            server.resume()

        async def given_back() -> bool:
            await runtime.engine.charges_done()
            return await _left(gw) == LIMIT

        await wait_until(given_back, "the hold back")
    assert held_upstream.arrived == 0


def _dry_run_beside(upstream: HeldUpstream, enforced: str) -> str:
    """The login limit in dry run (its holds taken as if enforced), beside an enforced one."""
    return (
        _policy(upstream).replace(
            "    count: {statuses: [401]}\n", "    count: {statuses: [401]}\n    dry_run: true\n"
        )
        + enforced
    )


async def _refused_by_the_other_limit(gw: RunningGateway, session: aiohttp.ClientSession) -> None:
    statuses = []
    for _ in range(4):
        async with session.post(gw.url + "/fast") as resp:
            statuses.append(resp.status)
    assert statuses == [200, 429, 429, 429]


async def _gone_from_the_queue(gw: RunningGateway, session: aiohttp.ClientSession) -> None:
    async with session.post(gw.url + "/fast") as resp:
        assert resp.status == 200
    for _ in range(3):
        queued = b"POST /fast HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
        await hang_up_while_queued(gw, "gate", queued)


async def _waited_in_line_for_a_slot(gw: RunningGateway, session: aiohttp.ClientSession) -> None:
    upstream = _UPSTREAM[0]
    first = asyncio.create_task(session.post(gw.url + "/hold/slot?status=200"))
    await wait_until(lambda: upstream.in_flight.get("slot") == 1, "the slot taken")
    for _ in range(3):  # each waits its 0.2 s in line, then a 429
        async with session.post(gw.url + "/fast") as resp:
            assert resp.status == 429
    upstream.release("slot")
    async with await first as resp:
        assert resp.status == 200


DRY_RUN_ENDINGS = {
    "refused by an enforced limit": (
        _refused_by_the_other_limit,
        "  gate:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n",
    ),
    "gone from the queue": (
        _gone_from_the_queue,
        "  gate:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 5\n    max_delay: 1h\n",
    ),
    "waited in line for a slot": (
        _waited_in_line_for_a_slot,
        "  gate:\n    algorithm: concurrency\n    limit: 1\n    max_delay: 200ms\n",
    ),
}


@pytest.mark.parametrize("ending", sorted(DRY_RUN_ENDINGS))
@pytest.mark.parametrize("kind", ["memory", "shared", "redis"])
async def test_a_dry_run_hold_comes_back_when_the_request_never_reaches_the_upstream(
    held_upstream: HeldUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
    ending: str,
) -> None:
    """A dry-run limit holds as an enforced one would; a request another limit refuses, or
    whose client leaves the shaping queue, never reaches the upstream: its hold comes back
    (an enforced limit would have charged nothing), and the dry-run limit keeps its budget."""
    send, enforced = DRY_RUN_ENDINGS[ending]
    _UPSTREAM[:] = [held_upstream]
    clock = FakeClock(T0_US)
    gw = await start_gateway(
        _dry_run_beside(held_upstream, enforced),
        clock=clock,
        **gateway_store_of(kind, request, clock, tmp_path, "dryholds"),
    )
    engine = gw.gateway.handler.runtime.engine
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await send(gw, session)

        async def left() -> int:
            await engine.charges_done()
            async with session.get(gw.admin_url + "/explain", params={"path": "/x"}) as resp:
                explained = await resp.json()
            entry = next(e for e in explained["limits"] if e["name"] == "failed_logins")
            decision = entry["next_request"]
            return int(decision["remaining"]) + (1 if decision["allowed"] else 0)

        await wait_until(lambda: gw.gateway.handler.runtime.inflight == 0, "the requests to end")
        await engine.charges_done()
        assert await left() == LIMIT


def test_a_replay_gives_dry_run_holds_back_for_the_requests_it_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gateway replay`` decides as the gateway does: ten requests in a minute, the gate
    admits one; the nine it refuses give back what the dry-run login limit held for them, so
    that limit never would have refused one (before: holds of five, then four 'would
    reject')."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        _dry_run_beside(
            HeldUpstream(port=9),
            "  gate:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n",
        )
    )
    start = datetime(2026, 1, 1, tzinfo=UTC)
    stamps = [(start + timedelta(seconds=s)).strftime("%d/%b/%Y:%H:%M:%S +0000") for s in range(10)]
    log = tmp_path / "access.log"
    log.write_text(
        "".join(f'203.0.113.1 - - [{at}] "GET / HTTP/1.1" 200 12 "-" "curl/8.5"\n' for at in stamps)
    )
    assert main(["replay", "--json", "--config", str(policy), str(log)]) == 0
    doc = json.loads(capsys.readouterr().out)
    limits = {lim["name"]: lim for lim in doc["policies"][0]["limits"]}
    assert (limits["gate"]["allowed"], limits["gate"]["rejected"]) == (1, 9)
    assert limits["failed_logins"]["dry_run_rejected"] == 0

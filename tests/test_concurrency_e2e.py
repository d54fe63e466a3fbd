"""Concurrency limits (nginx ``limit_conn`` semantics) through a real gateway process, in front of
an upstream whose requests stay in flight until the test lets them go: exactly ``limit`` in
flight per key and the next one refused; every way a request can end gives its slot back (the
response sent, the client gone, before or in the middle of the answer, the upstream failed or
timed out, a WebSocket closed); nothing is left held after ten thousand mixed requests.

Clients are loopback addresses of their own (the limit's key is the client address); the slots
in use are read from ``/metrics`` and checked by what the gateway admits next."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp
import pytest

from tests.support.gateways import GatewayFactory
from tests.support.held_upstream import HeldUpstream
from tests.support.metrics import scrape_until, value
from tests.support.policies import policy_for, policy_template
from tests.support.processes import GatewayProcess, StartGateway
from tests.support.waiting import wait_until

TIMEOUT = aiohttp.ClientTimeout(total=20)


def _policy(upstream: HeldUpstream, limit: int, extra: str = "") -> str:
    return (
        policy_template(upstream.url).replace("read_timeout: 60s", "read_timeout: 1s")
        + "limits:\n  in_flight:\n    algorithm: concurrency\n"
        + f"    limit: {limit}\n    retry_after: 2s\n"
        + extra
    )


def _client(address: str, **options: object) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(local_addr=(address, 0), force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=TIMEOUT, **options)  # type: ignore[arg-type]


async def _get(address: str, url: str) -> tuple[int, dict[str, str], str]:
    async with _client(address) as session, session.get(url) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def _slots_in_use(gateway: GatewayProcess, expected: int) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await scrape_until(
            session,
            gateway.admin_url,
            lambda s: value(s, "gateway_limit_slots_in_use", limit="in_flight") == expected,
        )


async def _admits(gateway: GatewayProcess, upstream: HeldUpstream, address: str, n: int) -> None:
    """``n`` requests of ``address`` held in flight at once are all admitted (its slots are
    all free), the next is refused; then they finish."""
    name = f"check{upstream.arrived}"
    held = [asyncio.create_task(_get(address, f"{gateway.url}/hold/{name}")) for _ in range(n)]
    await wait_until(lambda: upstream.in_flight.get(name) == n, f"{n} requests in flight")
    assert (await _get(address, gateway.url + "/fast"))[0] == 429
    upstream.release(name)
    assert [status for status, _, _ in await asyncio.gather(*held)] == [200] * n


async def test_exactly_the_limit_is_in_flight_per_key_and_the_next_is_refused(
    gateway_process: StartGateway, held_upstream: HeldUpstream
) -> None:
    gateway = await gateway_process(policy=_policy(held_upstream, 2))
    url = gateway.url
    held = [asyncio.create_task(_get("127.0.0.2", f"{url}/hold/a")) for _ in range(2)]
    await wait_until(lambda: held_upstream.in_flight.get("a") == 2, "two requests in flight")
    status, headers, body = await _get("127.0.0.2", url + "/fast")
    assert status == 429
    assert headers["Retry-After"] == "2"
    assert "RateLimit" not in headers and "RateLimit-Policy" not in headers
    assert '"limit": "in_flight"' in body
    assert held_upstream.arrived == 2  # the refused request never reached the upstream
    # Another client has slots of its own.
    assert (await _get("127.0.0.3", url + "/fast"))[0] == 200
    await _slots_in_use(gateway, 2)
    held_upstream.release("a")
    assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
    await _slots_in_use(gateway, 0)
    await _admits(gateway, held_upstream, "127.0.0.2", 2)


async def _complete(url: str) -> None:
    assert (await _get("127.0.0.2", url + "/fast"))[0] == 200


async def _abort_mid_response(url: str, upstream: HeldUpstream) -> None:
    async with _client("127.0.0.2") as session:
        resp = await session.get(url + "/stream/mid")
        assert resp.status == 200
        assert len(await resp.content.readexactly(65536)) == 65536
        resp.close()  # the client hangs up with half of the body unread
    await wait_until(lambda: upstream.in_flight.get("mid", 0) == 1, "the stream upstream")


async def _gone_before_the_answer(url: str, upstream: HeldUpstream) -> None:
    async with _client("127.0.0.2") as session:
        request = asyncio.create_task(session.get(url + "/hold/gone"))
        await wait_until(lambda: upstream.in_flight.get("gone") == 1, "the request upstream")
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request


async def _upstream_fails(url: str) -> None:
    assert (await _get("127.0.0.2", url + "/fail"))[0] == 502


async def _upstream_times_out(url: str) -> None:
    assert (await _get("127.0.0.2", url + "/sleep"))[0] == 504


async def _websocket_closes(url: str) -> None:
    async with _client("127.0.0.2") as session:
        async with session.ws_connect(url + "/ws") as ws:
            await ws.send_str("hello")
            assert (await ws.receive_str()) == "hello"
            # Open, the WebSocket holds the key's one slot.
            assert (await _get("127.0.0.2", url + "/fast"))[0] == 429
        assert ws.closed


@pytest.mark.parametrize(
    "ending",
    [
        "complete",
        "abort_mid_response",
        "gone_before_the_answer",
        "upstream_fails",
        "upstream_times_out",
        "websocket_closes",
    ],
)
async def test_every_ending_gives_the_slot_back(
    gateway_process: StartGateway, held_upstream: HeldUpstream, ending: str
) -> None:
    gateway = await gateway_process(policy=_policy(held_upstream, 1))
    url = gateway.url
    if ending == "complete":
        await _complete(url)
    elif ending == "abort_mid_response":
        await _abort_mid_response(url, held_upstream)
    elif ending == "gone_before_the_answer":
        await _gone_before_the_answer(url, held_upstream)
    elif ending == "upstream_fails":
        await _upstream_fails(url)
    elif ending == "upstream_times_out":
        await _upstream_times_out(url)
    else:
        await _websocket_closes(url)
    await _slots_in_use(gateway, 0)
    await _admits(gateway, held_upstream, "127.0.0.2", 1)


@pytest.mark.slow
async def test_nothing_is_held_after_ten_thousand_mixed_requests(
    gateway_process: StartGateway, held_upstream: HeldUpstream
) -> None:
    """Eight clients, 48 connections at once, each request one of: answered at once, the
    upstream failing, a stream the client abandons halfway, a client that gives up while the
    upstream holds its request; some over the limit (6 connections per key, limit 4)."""
    gateway = await gateway_process(policy=_policy(held_upstream, 4))
    url = gateway.url
    rng = random.Random(28)
    kinds = rng.choices(["fast", "fail", "abandon", "give_up"], [85, 5, 5, 5], k=10_000)
    outcomes: Counter[str] = Counter()

    async def connection(address: str, share: list[str]) -> None:
        async with _client(address) as session:
            for kind in share:
                if kind in ("fast", "fail"):
                    async with session.get(f"{url}/{kind}") as resp:
                        await resp.read()
                        outcomes[f"{kind} {resp.status}"] += 1
                elif kind == "abandon":
                    async with session.get(url + "/stream/mix") as resp:
                        if resp.status == 200:
                            await resp.content.readexactly(65536)
                        outcomes[f"{kind} {resp.status}"] += 1
                        resp.close()
                else:
                    try:
                        async with asyncio.timeout(0.05):
                            async with session.get(url + "/hold/mix") as resp:
                                outcomes[f"{kind} {resp.status}"] += 1
                    except TimeoutError:
                        outcomes[f"{kind} gone"] += 1

    addresses = [f"127.0.0.{n}" for n in range(2, 10)]
    shares = [kinds[i::48] for i in range(48)]
    async with asyncio.timeout(300):
        await asyncio.gather(
            *(connection(addresses[i % 8], share) for i, share in enumerate(shares))
        )
    assert sum(outcomes.values()) == 10_000
    assert outcomes["fast 200"] > 5000 and outcomes["fast 429"] > 0, outcomes
    assert outcomes["fail 502"] > 0 and outcomes["abandon 200"] > 0, outcomes
    await _slots_in_use(gateway, 0)
    held_upstream.release("mix")
    for address in addresses:
        await _admits(gateway, held_upstream, address, 4)


async def test_stacked_with_a_leaky_bucket_a_request_either_refuses_is_charged_to_neither(
    gateway_process: StartGateway, held_upstream: HeldUpstream
) -> None:
    """One slot, and a leaky bucket that takes two requests a minute: refused by the slot, a
    request costs the bucket nothing; refused by the bucket, it takes no slot."""
    bucket = (
        "  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 1\n    nodelay: true\n"
    )
    gateway = await gateway_process(policy=_policy(held_upstream, 1, bucket))
    url = gateway.url
    holder = asyncio.create_task(_get("127.0.0.2", f"{url}/hold/stack"))
    await wait_until(lambda: held_upstream.in_flight.get("stack") == 1, "the first request")
    status, _, body = await _get("127.0.0.2", url + "/fast")
    assert status == 429 and '"limit": "in_flight"' in body
    held_upstream.release("stack")
    assert (await holder)[0] == 200
    # The bucket's second request: the refused one above was not charged to it.
    assert (await _get("127.0.0.2", url + "/fast"))[0] == 200
    status, _, body = await _get("127.0.0.2", url + "/fast")
    assert status == 429 and '"limit": "per_ip"' in body
    await _slots_in_use(gateway, 0)


@pytest.mark.reliability
async def test_a_concurrency_limits_line_shows_in_the_queue_metrics(
    held_upstream: HeldUpstream, start_gateway: GatewayFactory
) -> None:
    """Requests waiting in a concurrency limit's line for a slot are its queue: their number in
    ``gateway_limit_queue_depth`` while they wait, and how long each waited in
    ``gateway_limit_queue_wait_seconds`` once it is through (the probe found the wait in no
    queue metric)."""
    limits = (
        "limits:\n  conc:\n    algorithm: concurrency\n    limit: 1\n    max_delay: 10s\n"
        "    key: [global]\n"
    )
    gw = await start_gateway(policy_for(held_upstream.url, limits))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:

        async def get() -> int:
            async with session.get(gw.url + "/hold/a") as response:
                await response.read()
                return response.status

        first = asyncio.create_task(get())
        await wait_until(lambda: held_upstream.holding() == 1, "the first request upstream")
        waiting = [asyncio.create_task(get()) for _ in range(3)]
        await scrape_until(
            session,
            gw.admin_url,
            lambda s: value(s, "gateway_limit_queue_depth", limit="conc") == 3,
        )
        held_upstream.release("a")
        assert await asyncio.gather(first, *waiting) == [200] * 4
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda s: value(s, "gateway_limit_queue_wait_seconds_count", limit="conc") == 3,
        )
    assert value(samples, "gateway_limit_queue_depth", limit="conc") == 0
    assert value(samples, "gateway_limit_queue_wait_seconds_sum", limit="conc") > 0

"""Upstream pools end to end: a gateway in front of several real backends on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gateway.engine.preflight import parse_and_build
from gateway.serving.lifecycle import Gateway
from tests.support.gateways import GatewayFactory
from tests.support.metrics import parse_metrics, value
from tests.support.network import TIMEOUT
from tests.support.pools import Backend, DnsServer, HangUp, process_policy
from tests.support.processes import StartGateway

# Its spread, ejection and recovery figures are measured under load: runs alone (scripts/test.sh).
pytestmark = pytest.mark.serial

SERVER = "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"


def pool_policy(servers: str, extra: str = "", routes: str = "") -> str:
    """A policy with upstream ``pool`` (``servers`` is its YAML body) and a catch-all route."""
    return (
        SERVER
        + "upstreams:\n  pool:\n"
        + servers
        + extra
        + "routes:\n"
        + routes
        + "  - name: all\n    upstream: pool\n"
    )


def servers_of(*backends: Backend, weights: tuple[int, ...] = ()) -> str:
    lines = "    servers:\n"
    for index, backend in enumerate(backends):
        weight = weights[index] if weights else 1
        lines += f"      - {{url: {backend.url}, weight: {weight}}}\n"
    return lines


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., asyncio.Future[Backend]]]:
    started: list[Backend] = []

    async def start(name: str, **kwargs: object) -> Backend:
        backend = await Backend(name, **kwargs).start()  # type: ignore[arg-type]
        started.append(backend)
        return backend

    yield start  # type: ignore[misc]
    for backend in started:
        await backend.stop()


async def fetch(
    session: aiohttp.ClientSession, url: str, method: str = "GET", **kwargs: object
) -> tuple[int, str]:
    async with session.request(method, url, **kwargs) as resp:  # type: ignore[arg-type]
        return resp.status, await resp.text()


async def spread(
    session: aiohttp.ClientSession, url: str, count: int, concurrency: int = 16, **kwargs: object
) -> Counter[str]:
    """``count`` GETs, ``concurrency`` at a time: which answer each got (status and body)."""
    seen: Counter[str] = Counter()
    queue = iter(range(count))

    async def worker() -> None:
        for _ in queue:
            status, text = await fetch(session, url, **kwargs)
            seen[f"{status} {text}"] += 1

    async with asyncio.timeout(60):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return seen


async def test_round_robin_spreads_by_weight_within_one_percent(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    a, b, c = [await backends(name) for name in "abc"]
    gw = await start_gateway(pool_policy(servers_of(a, b, c, weights=(1, 2, 3))))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        seen = await spread(session, gw.url + "/", 3000)
    assert sum(seen.values()) == 3000
    for backend, weight in ((a, 1), (b, 2), (c, 3)):
        share = seen[f"200 backend {backend.name}"] / 3000
        assert abs(share - weight / 6) <= 0.01, seen
        assert backend.requests == seen[f"200 backend {backend.name}"]


async def test_least_inflight_favours_the_fast_server(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    fast = await backends("fast")
    # 300 ms: far slower than the fast one even when a loaded machine makes that one slow too
    # (at 100 ms, a load of 9 on 2 cores brought the split down to 238 / 62).
    slow = await backends("slow", delay_s=0.3)
    gw = await start_gateway(
        pool_policy(servers_of(fast, slow), extra="    balance: least_inflight\n")
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        seen = await spread(session, gw.url + "/", 300, concurrency=8)
    # Round robin would send each half; the slow one holds its requests 300 ms.
    assert seen["200 backend fast"] > 5 * seen["200 backend slow"], seen


async def test_consistent_hash_keeps_a_key_on_its_server_and_moves_only_a_leaver_keys(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    pool = [await backends(name) for name in "abcd"]
    extra = "    balance: hash\n    hash_key: [header:X-Tenant]\n"
    gw = await start_gateway(pool_policy(servers_of(*pool), extra=extra))
    tenants = [f"tenant-{n}" for n in range(200)]

    async def owners() -> dict[str, str]:
        out = {}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for tenant in tenants:
                status, text = await fetch(session, gw.url + "/", headers={"X-Tenant": tenant})
                assert status == 200
                out[tenant] = text
        return out

    before = await owners()
    assert before == await owners()  # each key stays on its server
    assert len(set(before.values())) == 4
    # Server d leaves the pool (a reload without it): only its keys move.
    gw.gateway.apply(parse_and_build(pool_policy(servers_of(*pool[:3]), extra=extra)))
    after = await owners()
    moved = {t for t in tenants if before[t] != after[t]}
    assert moved == {t for t in tenants if before[t] == "backend d"}
    assert 25 <= len(moved) <= 75  # about a quarter


@pytest.mark.parametrize("retry", ["", "    retry: {tries: 1}\n"], ids=["retried", "not-retried"])
async def test_a_server_killed_under_load_is_taken_out_then_comes_back_after_its_trial(
    backends: Callable[..., asyncio.Future[Backend]], gateway_process: StartGateway, retry: str
) -> None:
    a, b, c = [await backends(name) for name in "abc"]
    max_fails = 2
    policy = (
        "upstreams:\n  pool:\n"
        + servers_of(a, b, c)
        + f"    max_fails: {max_fails}\n    fail_timeout: 3s\n"
        + retry
        + "routes:\n  - name: all\n    upstream: pool\n"
    )
    gw = await gateway_process(policy=process_policy(policy))
    url = f"http://127.0.0.1:{gw.port}/"
    statuses: Counter[int] = Counter()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

        async def one() -> None:
            status, _ = await fetch(session, url)
            statuses[status] += 1

        async def load(seconds: float, rate: int = 500) -> None:
            """``rate`` requests a second for ``seconds``, each on its own."""
            tasks = []
            loop = asyncio.get_running_loop()
            start = loop.time()
            for n in range(int(seconds * rate)):
                delay = start + n / rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one()))
            async with asyncio.timeout(30):
                await asyncio.gather(*tasks)

        await load(0.5)
        assert statuses == {200: 250}, statuses
        port = b.port
        await b.stop()  # killed under load
        await load(2.0)
        errors = sum(n for status, n in statuses.items() if status >= 500)
        if retry:  # each failure reached a client until the server was taken out (its
            # trial, a fail_timeout later, would be one more: the load ends before)
            assert 1 <= errors <= max_fails, statuses
        else:  # each failed GET went on to another server
            assert errors == 0, statuses
        assert sum(statuses.values()) == 1250
        revived = await backends("b", port=port)
        await asyncio.sleep(3.2)  # past fail_timeout: its next pick is its trial
        seen = await spread(session, url, 60, concurrency=4)
    assert seen["200 backend b"] >= 15, seen  # back in the rotation
    assert revived.requests == seen["200 backend b"]


async def policy_pools(session: aiohttp.ClientSession, admin_url: str) -> dict[str, Any]:
    async with session.get(admin_url + "/policy") as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
    return body["pools"]


async def test_a_server_failing_half_its_requests_is_ejected_and_a_slow_one_too(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    good = [await backends(name) for name in ("a", "b", "c")]
    failing = await backends("failing", fail_every=2)
    slow = await backends("slow", delay_s=0.08)
    extra = (
        "    retry: {when: []}\n"  # every answer reaches the client: counted as it comes
        "    outlier_detection:\n      interval: 1s\n      min_requests: 5\n"
        "      latency_factor: 5\n      min_latency: 20ms\n      max_ejection_percent: 50\n"
    )
    gw = await start_gateway(pool_policy(servers_of(*good, failing, slow), extra=extra))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        states: dict[str, str] = {}
        while loop.time() < deadline:
            await spread(session, gw.url + "/", 50, concurrency=10)
            pools = await policy_pools(session, gw.admin_url)
            states = {s["server"]: s["state"] for s in pools["pool"]}
            if states[f"127.0.0.1:{failing.port}"] == states[f"127.0.0.1:{slow.port}"] == "ejected":
                break
        assert states[f"127.0.0.1:{failing.port}"] == "ejected", states
        assert states[f"127.0.0.1:{slow.port}"] == "ejected", states
        assert [states[f"127.0.0.1:{b.port}"] for b in good] == ["up"] * 3
        # Ejected: no request reaches either while the others are up.
        failing_before, slow_before = failing.requests, slow.requests
        seen = await spread(session, gw.url + "/", 60, concurrency=6)
        assert failing.requests == failing_before and slow.requests == slow_before
        assert set(seen) == {f"200 backend {b.name}" for b in good}
        async with session.get(gw.admin_url + "/metrics") as resp:
            samples = parse_metrics(await resp.text())
        for backend in (failing, slow):
            server = f"127.0.0.1:{backend.port}"
            assert (
                value(
                    samples,
                    "gateway_upstream_server_ejections_total",
                    upstream="pool",
                    server=server,
                )
                == 1
            )
            assert value(
                samples, "gateway_upstream_server_state", upstream="pool", server=server,
                state="ejected",
            ) == 1  # fmt: skip


async def test_never_more_than_max_ejection_percent_of_the_pool_is_ejected(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    pool = [await backends(name) for name in ("a", "b")]
    pool += [await backends(name, fail_every=2) for name in ("x", "y")]
    extra = (
        "    retry: {when: []}\n"
        "    outlier_detection: {interval: 1s, min_requests: 5, max_ejection_percent: 25}\n"
    )
    gw = await start_gateway(pool_policy(servers_of(*pool), extra=extra))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        ejected_seen = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3.5
        while loop.time() < deadline:
            await spread(session, gw.url + "/", 40, concurrency=8)
            pools = await policy_pools(session, gw.admin_url)
            ejected = [s["server"] for s in pools["pool"] if s["state"] == "ejected"]
            assert len(ejected) <= 1, pools  # 25% of four
            ejected_seen = max(ejected_seen, len(ejected))
    assert ejected_seen == 1


async def test_a_get_is_tried_exactly_tries_times_and_a_streamed_post_once() -> None:
    hangups = [await HangUp().start() for _ in range(4)]
    servers = "    servers: [" + ", ".join(h.url for h in hangups) + "]\n"
    extra = "    max_fails: 0\n    retry: {tries: 3}\n"
    loaded = parse_and_build(pool_policy(servers, extra=extra))
    gateway = Gateway(loaded)
    await gateway.start()
    url = f"http://127.0.0.1:{gateway.proxy_port}/"
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            assert (await fetch(session, url))[0] == 502
            assert sum(h.attempts for h in hangups) == 3  # tries, each on its own server
            assert max(h.attempts for h in hangups) == 1

            async def body() -> AsyncIterator[bytes]:
                for _ in range(20):
                    yield b"x" * 1000
                    await asyncio.sleep(0.02)

            for h in hangups:
                h.attempts = 0
            status, _ = await fetch(session, url, "POST", data=body())
            assert status == 502
            assert sum(h.attempts for h in hangups) == 1  # its body went out: never again
            # A PUT whose small body is held whole is idempotent: tried again.
            for h in hangups:
                h.attempts = 0
            status, _ = await fetch(session, url, "PUT", data=b"y" * 100)
            assert status == 502
            assert sum(h.attempts for h in hangups) == 3
        admin = f"http://127.0.0.1:{gateway.admin_port}/metrics"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.get(admin) as resp:
            samples = parse_metrics(await resp.text())
        # 2 retries of the GET, 2 of the PUT: each after a reset
        retries = value(samples, "gateway_upstream_retries_total", upstream="pool", reason="reset")
        assert retries == 4
    finally:
        await gateway.stop()
        for h in hangups:
            await h.stop()


async def test_a_post_is_tried_again_when_its_connection_was_refused(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    """Nothing of it went out: the next server gets it, body and all."""
    alive = await backends("alive")
    dead = await backends("dead")
    await dead.stop()
    gw = await start_gateway(pool_policy(servers_of(dead, alive), extra="    max_fails: 0\n"))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(4):
            status, text = await fetch(session, gw.url + "/", "POST", data=b"z" * 200_000)
            assert (status, text) == (200, "backend alive")
    assert alive.requests == 4


async def test_routes_override_the_upstream_timeouts_and_the_body_size(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    slow = await backends("slow", delay_s=0.5)
    routes = (
        "  - name: impatient\n    match: {path_prefix: /fast}\n    upstream: pool\n"
        "    read_timeout: 100ms\n"
        "  - name: upload\n    match: {path_prefix: /upload}\n    upstream: pool\n"
        "    max_body_size: 1m\n"
    )
    gw = await start_gateway(
        pool_policy(servers_of(slow), routes=routes).replace(
            "  admin_listen: 127.0.0.1:0\n", "  admin_listen: 127.0.0.1:0\n  max_body_size: 1k\n"
        )
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert (await fetch(session, gw.url + "/fast"))[0] == 504
        assert (await fetch(session, gw.url + "/other"))[0] == 200  # the upstream's 60 s
        body = b"b" * 100_000
        assert (await fetch(session, gw.url + "/upload", "POST", data=body))[0] == 200
        assert (await fetch(session, gw.url + "/other", "POST", data=body))[0] == 413

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b"c" * 10_000

        assert (await fetch(session, gw.url + "/upload", "POST", data=chunked()))[0] == 200
        assert (await fetch(session, gw.url + "/other", "POST", data=chunked()))[0] == 413


async def test_a_host_name_is_resolved_again_and_its_new_addresses_take_the_requests(
    start_gateway: GatewayFactory,
) -> None:
    dns = await DnsServer().start()
    first = await Backend("first", host="127.0.0.2").start()
    second = await Backend("second", host="127.0.0.3", port=first.port).start()
    dns.records["api.test"] = ["127.0.0.2"]
    servers = f"    servers: [http://api.test:{first.port}]\n"
    extra = f"    resolve_interval: 300ms\n    resolver: 127.0.0.1:{dns.port}\n"
    try:
        gw = await start_gateway(pool_policy(servers, extra=extra))
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            assert await spread(session, gw.url + "/", 10, 2) == {"200 backend first": 10}
            dns.records["api.test"] = ["127.0.0.3"]  # the pod moved
            loop = asyncio.get_running_loop()
            changed_at = loop.time()
            while (await fetch(session, gw.url + "/"))[1] != "backend second":
                assert loop.time() - changed_at < 0.3 + 1.0, "not picked up in time"
                await asyncio.sleep(0.02)
            assert await spread(session, gw.url + "/", 10, 2) == {"200 backend second": 10}
            pools = await policy_pools(session, gw.admin_url)
            assert [s["server"] for s in pools["pool"]] == [f"127.0.0.3:{first.port}"]
            # The address that left: its series end (pods that come and go must not pile up).
            async with session.get(gw.admin_url + "/metrics") as resp:
                text = await resp.text()
            assert f'server="127.0.0.3:{first.port}"' in text
            assert f'server="127.0.0.2:{first.port}"' not in text
            # Two pods: both take requests.
            dns.records["api.test"] = ["127.0.0.2", "127.0.0.3"]
            await asyncio.sleep(0.6)
            seen = await spread(session, gw.url + "/", 20, 2)
            assert seen == {"200 backend first": 10, "200 backend second": 10}
    finally:
        dns.stop()
        await first.stop()
        await second.stop()


async def test_active_checks_take_a_failing_server_out_and_bring_it_back(
    backends: Callable[..., asyncio.Future[Backend]], start_gateway: GatewayFactory
) -> None:
    steady = await backends("steady")
    flaky = await backends("flaky")
    extra = (
        "    health_check: {path: /healthz, interval: 100ms, timeout: 1s, healthy: 2,"
        " unhealthy: 2}\n"
    )
    gw = await start_gateway(pool_policy(servers_of(steady, flaky), extra=extra))
    flaky_label = f"127.0.0.1:{flaky.port}"
    loop = asyncio.get_running_loop()

    async def wait_for_state(session: aiohttp.ClientSession, state: str) -> None:
        deadline = loop.time() + 5
        while True:
            pools = await policy_pools(session, gw.admin_url)
            if {s["server"]: s["state"] for s in pools["pool"]}[flaky_label] == state:
                return
            assert loop.time() < deadline, pools
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert await spread(session, gw.url + "/", 10, 1) == {
            "200 backend steady": 5,
            "200 backend flaky": 5,
        }
        flaky.health_status = 503  # its checks fail: out, while it still answers requests
        await wait_for_state(session, "down")
        before = flaky.requests
        assert await spread(session, gw.url + "/", 10, 1) == {"200 backend steady": 10}
        assert flaky.requests == before
        flaky.health_status = 200
        await wait_for_state(session, "up")
        seen = await spread(session, gw.url + "/", 10, 1)
        assert seen["200 backend flaky"] == 5, seen
    assert flaky.health_checks >= 4 and steady.health_checks >= 4

"""Upstream pools end to end: a gateway in front of several real backends on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from gateway.engine.preflight import parse_and_build
from tests.conftest import GatewayFactory
from tests.pool_harness import Backend, gateway_process
from tests.support import TIMEOUT

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
    slow = await backends("slow", delay_s=0.1)
    gw = await start_gateway(
        pool_policy(servers_of(fast, slow), extra="    balance: least_inflight\n")
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        seen = await spread(session, gw.url + "/", 300, concurrency=8)
    # Round robin would send each half; the slow one holds its requests 100 ms.
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
    backends: Callable[..., asyncio.Future[Backend]], tmp_path: Path, retry: str
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
    with gateway_process(tmp_path, policy) as gw:
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

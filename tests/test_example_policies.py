"""The policy files shipped in policies/, run end to end through the real gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build, parse_and_build
from tests.support.gateways import GatewayFactory
from tests.support.upstreams import RecordingUpstream

POLICIES = Path(__file__).parent.parent / "policies"


def _local(name: str, upstream_url: str | None = None) -> str:
    text = (POLICIES / name).read_text()
    text = text.replace("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0")
    text = text.replace("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:0")
    if upstream_url is not None:
        text = text.replace("http://127.0.0.1:8000", upstream_url)
    return text


async def test_default_policy_runs_on_its_demo_backend(start_gateway: GatewayFactory) -> None:
    gw = await start_gateway(_local("default.yaml"), clock=FakeClock())
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(12):
            async with session.get(gw.url + "/api/hello") as resp:
                statuses.append(resp.status)
                if resp.status == 200:
                    assert (await resp.json())["service"] == "gateway demo upstream"
    # per_ip: 5r/s burst 10 nodelay, no time passing: 11 served, then rejected.
    assert statuses == [200] * 11 + [429]


async def test_layered_policy_login_window(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    gw = await start_gateway(_local("layered.yaml", upstream.url), clock=clock)
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(7):
            async with session.post(gw.url + "/api/login", data=b"u=p") as resp:
                statuses.append(resp.status)
                last = resp
        assert statuses == [200] * 5 + [429] * 2
        assert '"login";r=0' in last.headers["RateLimit"]
        # Other API routes are not under the login limit.
        async with session.get(gw.url + "/api/items") as resp:
            assert resp.status == 200
        # A minute and a bit later the login window has slid past all five.
        clock.advance(121)
        async with session.post(gw.url + "/api/login", data=b"u=p") as resp:
            assert resp.status == 200


async def test_layered_policy_per_ip_shapes_then_rejects(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_local("layered.yaml", upstream.url), clock=FakeClock())
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:

        async def timed() -> tuple[int, float]:
            started = loop.time()
            async with session.get(gw.url + "/static/x") as resp:
                await resp.read()
                return resp.status, loop.time() - started

        first = [await timed() for _ in range(11)]
        # rate 10r/s burst 20 delay 10: the first 1 + 10 go at once, the next 10 are delayed
        # 100, 200, ... 1000 ms (the clock stands still), the 22nd is rejected. Whether one
        # was delayed is read from the limit's own counts, not from how long it took (a busy
        # machine can take 100 ms to answer at once).
        per_ip = next(
            lim for lim in gw.gateway.handler.runtime.engine.limits if lim.name == "per_ip"
        )
        assert [status for status, _ in first] == [200] * 11
        assert (per_ip.counters.allowed, per_ip.counters.delayed) == (11, 0)
        delayed = await asyncio.gather(*[timed() for _ in range(10)])
        assert sorted(status for status, _ in delayed) == [200] * 10
        assert per_ip.counters.delayed == 10
        assert max(t for _, t in delayed) >= 0.95
        status, _ = await timed()
        assert status == 429


async def test_layered_policy_explain_shows_every_stacked_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_local("layered.yaml", upstream.url), clock=FakeClock())
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            gw.admin_url + "/explain",
            params={"method": "POST", "path": "/api/login?x=1", "client_ip": "203.0.113.9"},
        ) as resp,
    ):
        explained = await resp.json()
    assert explained["route"] == "login"
    applies = {x["name"]: (x["applies"], x.get("key")) for x in explained["limits"]}
    assert applies == {
        "per_ip": (True, "203.0.113.9"),
        "login": (True, "203.0.113.9"),
        "api": (True, "203.0.113.9"),
        "global": (True, ""),
    }
    global_limit = next(x for x in explained["limits"] if x["name"] == "global")
    assert global_limit["next_request"]["limit"] == 2000
    # Explaining consumed nothing.
    assert all(x["tracked_keys"] == 0 for x in explained["limits"])


def test_every_shipped_policy_is_valid() -> None:
    for path in POLICIES.glob("*.yaml"):
        if not path.name.endswith(".tests.yaml"):  # a policy's test cases, beside it
            parse_and_build(path.read_text(), str(path))


async def test_layered_policy_explain_gives_the_combined_verdict(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """Explain says what the next request would get from all its limits together."""
    gw = await start_gateway(_local("layered.yaml", upstream.url), clock=FakeClock())

    async def explain(session: aiohttp.ClientSession, method: str, path: str) -> Any:
        params = {"method": method, "path": path, "client_ip": "127.0.0.1"}
        async with session.get(gw.admin_url + "/explain", params=params) as resp:
            return (await resp.json())["verdict"]

    async with aiohttp.ClientSession() as session:
        for _ in range(5):  # the login limit's 5 a minute, and 5 of per_ip's 10 served at once
            async with session.post(gw.url + "/api/login") as resp:
                assert resp.status == 200
        for _ in range(6):  # per_ip: 11 in all, excess 10 = its delay threshold
            async with session.get(gw.url + "/api/items") as resp:
                assert resp.status == 200
        login = await explain(session, "POST", "/api/login")
        items = await explain(session, "GET", "/api/items")
        assert await explain(session, "GET", "/api/items") == items  # a look charges nothing
        elsewhere = await explain(session, "GET", "/nothing-limits-this")
    # The 6th login in a minute is over the login limit (per_ip would only delay it).
    assert login["status"] == 429 and login["rejected_by"] == ["login"]
    # The 12th request: per_ip excess 11 > delay 10, so (11000 - 10000) / 10 r/s = 100 ms.
    assert items == {"status": 200, "delay_s": 0.1, "delayed_by": "per_ip"}
    # Outside /api/ only per_ip and global apply, and they delay the same.
    assert elsewhere["delayed_by"] == "per_ip"


async def test_tiers_policy_gives_plans_their_quota(
    tmp_path: Path, start_gateway: GatewayFactory
) -> None:
    (tmp_path / "tiers").mkdir()
    (tmp_path / "tiers" / "keys.yaml").write_text((POLICIES / "tiers" / "keys.yaml").read_text())
    (tmp_path / "tiers.yaml").write_text(_local("tiers.yaml"))
    gw = await start_gateway(load_and_build(tmp_path / "tiers.yaml"), clock=FakeClock())
    async with aiohttp.ClientSession() as session:

        async def served(key: str, path: str = "/api/hello") -> int:
            statuses = []
            for _ in range(25):
                async with session.get(gw.url + path, headers={"X-API-Key": key}) as resp:
                    statuses.append(resp.status)
            return statuses.count(200)

        # A search costs 10: one fits in the default burst of 10, which every key the
        # overrides do not list shares (unlisted: shared): another made-up key gets nothing.
        assert await served("another", "/api/search") == 1
        assert await served("anyone") == 0
        # Burst 20 for silver (from the generated file), 100 for gold, each its own.
        assert await served("key-0001") == 20
        assert await served("key-7f3a") == 25

"""The keys' API on the admin listener: a limit's keys listed (the most used first), one key's
state, reset, block and unblock, each change logged with who and why; with and without the
admin token. The real gateway, a real upstream, real clients over loopback, a fake clock."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.algorithms.penalty_box import PenaltyRefusal
from gateway.algorithms.sliding_log import SlidingLog
from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.limits.compiled import Check
from gateway.redact import hashed
from gateway.stores import RedisStore
from gateway.stores.redis.key_scan import RedisKeys
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support import redis_harness
from tests.support.conformance import compiled
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.policies import policy_for
from tests.support.processes import run_workers, wait_serving
from tests.support.redis_harness import RedisClusterHarness, RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster

TOKEN = "a-test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = """limits:
  per_key:
    algorithm: fixed_window
    limit: 5
    window: 1h
    key: ['header:X-Api-Key']
"""
S = 1_000_000


async def _start(start_gateway: GatewayFactory, upstream: RecordingUpstream) -> RunningGateway:
    policy = policy_for(upstream.url, LIMITS, server=f"  admin_token: {TOKEN}\n")
    return await start_gateway(policy, clock=FakeClock(start_us=3600 * S))


async def _admin(
    session: aiohttp.ClientSession,
    gw: RunningGateway,
    path: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] = AUTH,
    **params: str,
) -> tuple[int, Any]:
    method = "POST" if body is not None else "GET"
    async with session.request(
        method, gw.admin_url + path, json=body, params=params, headers=headers
    ) as response:
        return response.status, await response.json()


async def _use(
    session: aiohttp.ClientSession, gw: RunningGateway, key: str, times: int
) -> list[int]:
    statuses = []
    for _ in range(times):
        async with session.get(gw.url + "/", headers={"X-Api-Key": key}) as response:
            statuses.append(response.status)
    return statuses


async def test_list_read_reset_block_and_unblock(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await _start(start_gateway, upstream)
    async with aiohttp.ClientSession() as session:
        await _use(session, gw, "key-heavy", 4)
        await _use(session, gw, "key-light", 1)
        status, listing = await _admin(session, gw, "/keys/per_key", top="10")
        assert status == 200
        # The most used first; header parts (API keys) shown by their hash, never whole.
        assert [(k["id"], k["key"], k["remaining"]) for k in listing["keys"]] == [
            (hashed("key-heavy"), hashed("key-heavy"), 1),
            (hashed("key-light"), hashed("key-light"), 4),
        ]
        status, state = await _admin(session, gw, "/keys/per_key/key", key="key-heavy")
        assert (status, state["remaining"], state["quota"]) == (200, 1, 5)
        assert state["reset_s"] == 3600 and state["blocked_for_s"] is None
        # A change needs a reason.
        status, refused = await _admin(session, gw, "/keys/per_key/reset", {"key": "key-heavy"})
        assert status == 400 and "reason" in refused["error"]
        with caplog.at_level(logging.INFO, logger="gateway.admin"):
            status, reset = await _admin(
                session,
                gw,
                "/keys/per_key/reset",
                {"id": hashed("key-heavy"), "reason": "ticket 42: customer upgraded"},
            )
        assert status == 200 and reset["reset"] is True
        assert reset["state"]["remaining"] == 5
        assert await _use(session, gw, "key-heavy", 1) == [200]
        logged = [r.getMessage() for r in caplog.records if r.name == "gateway.admin"]
        assert logged == [
            f"keys: reset of limit per_key key {hashed('key-heavy')} by token {hashed(TOKEN)}, "
            "reason: 'ticket 42: customer upgraded'"
        ]
        assert TOKEN not in caplog.text
        status, blocked = await _admin(
            session,
            gw,
            "/keys/per_key/block",
            {"key": "key-light", "for": "10m", "reason": "abuse report"},
        )
        assert status == 200 and blocked["state"]["blocked_for_s"] == 600
        async with session.get(gw.url + "/", headers={"X-Api-Key": "key-light"}) as response:
            assert response.status == 429
            assert response.headers["Retry-After"] == "600"
        assert await _use(session, gw, "key-other", 1) == [200]
        status, unblocked = await _admin(
            session, gw, "/keys/per_key/unblock", {"key": "key-light", "reason": "resolved"}
        )
        assert status == 200 and unblocked["unblocked"] is True
        assert await _use(session, gw, "key-light", 1) == [200]


async def test_without_the_token_nothing_is_read_or_changed(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _start(start_gateway, upstream)
    async with aiohttp.ClientSession() as session:
        await _use(session, gw, "key-a", 2)
        for path, body in (
            ("/keys/per_key", None),
            ("/keys/per_key/key", None),
            ("/keys/per_key/reset", {"key": "key-a", "reason": "x"}),
            ("/keys/per_key/block", {"key": "key-a", "for": "1h", "reason": "x"}),
        ):
            status, _ = await _admin(session, gw, path, body, headers={}, key="key-a")
            assert status == 401, path
        status, state = await _admin(session, gw, "/keys/per_key/key", key="key-a")
        assert state["remaining"] == 3  # nothing was reset
        assert await _use(session, gw, "key-a", 1) == [200]  # nothing was blocked


async def test_unknown_limits_and_keys_and_stores_that_cannot(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    gw = await _start(start_gateway, upstream)
    server = f"  admin_token: {TOKEN}\n"
    dead_redis = policy_for(
        upstream.url,
        LIMITS + "store: {url: 'redis://127.0.0.1:1', on_failure: allow, timeout: 1s}\n",
        server=server,
    )
    on_dead_redis = await start_gateway(dead_redis, clock=FakeClock())
    clock = FakeClock()
    on_shared = await start_gateway(
        policy_for(upstream.url, LIMITS, server=server),
        clock=clock,
        store=SharedStore(tmp_path / "shared", clock),
    )
    async with aiohttp.ClientSession() as session:
        status, body = await _admin(session, gw, "/keys/nope")
        assert status == 404 and "per_key" in body["error"]
        status, body = await _admin(session, gw, "/keys/per_key/key", id="sha256:000000000000")
        assert status == 404
        status, body = await _admin(session, on_dead_redis, "/keys/per_key")
        assert status == 503 and "could not answer" in body["error"]
        status, body = await _admin(session, on_shared, "/keys/per_key")
        assert status == 200 and body["keys"] == []
        # The shared store blocks keys (for every worker).
        status, body = await _admin(
            session,
            on_shared,
            "/keys/per_key/block",
            {"key": "key-s", "for": "1m", "reason": "shared block"},
        )
        assert status == 200 and body["state"]["blocked_for_s"] == 60
        async with session.get(on_shared.url + "/", headers={"X-Api-Key": "key-s"}) as response:
            assert response.status == 429 and response.headers["Retry-After"] == "60"


async def test_list_and_reset_every_workers_keys_on_the_shared_store(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """``--workers 2``: each request on a new connection (SO_REUSEPORT spreads them over the
    workers); the list shows what all of them counted, and a reset holds for all of them."""
    server = f"  admin_token: {TOKEN}\n"
    # sliding_log: exact over any span, so no window edge falls between the requests.
    limits = LIMITS.replace("fixed_window", "sliding_log")
    async with run_workers(upstream.url, tmp_path, limits, 2, server=server) as (url, admin, _):
        await wait_serving(tmp_path, 2)
        timeout = aiohttp.ClientTimeout(total=15)

        async def use(key: str) -> int:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url + "/", headers={"X-Api-Key": key}) as response,
            ):
                return response.status

        assert [await use("key-w") for _ in range(6)] == [200] * 5 + [429]
        assert await use("key-v") == 200
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(
                admin + "/keys/per_key", params={"top": "10"}, headers=AUTH
            ) as response:
                assert response.status == 200
                listing = await response.json()
            assert [(k["id"], k["remaining"]) for k in listing["keys"]] == [
                (hashed("key-w"), 0),
                (hashed("key-v"), 4),
            ]
            async with session.post(
                admin + "/keys/per_key/reset",
                json={"id": hashed("key-w"), "reason": "workers test"},
                headers=AUTH,
            ) as response:
                assert response.status == 200
                reset = await response.json()
        assert reset["reset"] is True and reset["state"]["remaining"] == 5
        assert [await use("key-w") for _ in range(6)] == [200] * 5 + [429]


async def test_the_cli_speaks_to_the_admin_listener(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gw = await _start(start_gateway, upstream)
    async with aiohttp.ClientSession() as session:
        await _use(session, gw, "key-cli", 2)
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    admin = gw.admin_url
    # The CLI blocks on its HTTP call: run it off the loop that serves the gateway.
    import asyncio

    async def cli(*args: str) -> int:
        return await asyncio.to_thread(main, ["keys", "--admin", admin, *args])

    assert await cli("list", "per_key") == 0
    assert hashed("key-cli") in capsys.readouterr().out
    assert await cli("reset", "per_key", "--key", "key-cli", "--reason", "cli test") == 0
    assert '"reset": true' in capsys.readouterr().out
    assert await cli("reset", "per_key", "--key", "key-cli") == 2  # no reason: argparse says
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "a-wrong-token-0123456789")
    assert await cli("list", "per_key") == 1
    assert "401" in capsys.readouterr().err


async def test_list_read_and_reset_in_redis(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    """In Redis: the keys found with SCAN, one read as /explain reads it, reset with DEL."""
    policy = policy_for(
        upstream.url,
        # sliding_log: exact over any span, so Redis's own clock (TIME) changes no count.
        LIMITS.replace("fixed_window", "sliding_log")
        # A prefix of its own (glob characters in it: SCAN's pattern escapes them).
        + f"store: {{url: '{redis_server.url}', key_prefix: 'keys[{time.monotonic_ns()}]*:', "
        "timeout: 2s}\n",
        server=f"  admin_token: {TOKEN}\n",
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession() as session:
        await _use(session, gw, "key-r", 3)
        await _use(session, gw, "key-s", 1)
        status, listing = await _admin(session, gw, "/keys/per_key", top="10")
        assert status == 200
        assert [(k["id"], k["remaining"]) for k in listing["keys"]] == [
            (hashed("key-r"), 2),
            (hashed("key-s"), 4),
        ]
        status, reset = await _admin(
            session, gw, "/keys/per_key/reset", {"id": hashed("key-r"), "reason": "redis test"}
        )
        assert status == 200 and reset["reset"] is True and reset["state"]["remaining"] == 5
        assert await _use(session, gw, "key-r", 1) == [200]
        # A limit without a penalty: the block is put in a box its calls read from now on.
        status, blocked = await _admin(
            session, gw, "/keys/per_key/block", {"key": "key-s", "for": "1m", "reason": "x"}
        )
        assert status == 200 and 59 < blocked["state"]["blocked_for_s"] <= 60
        assert await _use(session, gw, "key-s", 1) == [429]  # the limit's status
        assert await _use(session, gw, "key-r", 1) == [200]  # another key
        status, unblocked = await _admin(
            session, gw, "/keys/per_key/unblock", {"key": "key-s", "reason": "x"}
        )
        assert status == 200 and unblocked["state"]["blocked_for_s"] is None
        assert await _use(session, gw, "key-s", 1) == [200]


async def test_a_block_of_a_limit_without_penalty_reaches_every_replica(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    """Only the limits with blocked keys read boxes (block_watch.py): the replica that blocks
    at once, another once it has read which limits have blocks (every second; here by hand).
    """
    clock = FakeClock(start_us=3600 * S)
    prefix = f"unboxed{time.monotonic_ns()}:"
    policy = policy_for(
        upstream.url,
        LIMITS.replace("fixed_window", "sliding_log"),
        server=f"  admin_token: {TOKEN}\n",
    )
    stores = [
        RedisStore(redis_server.url, key_prefix=prefix, clock=clock, time_source=clock)
        for _ in range(2)
    ]
    first, second = [await start_gateway(policy, clock=clock, store=store) for store in stores]
    async with aiohttp.ClientSession() as session:
        assert await _use(session, second, "key-b", 1) == [200]
        status, _ = await _admin(
            session, first, "/keys/per_key/block", {"key": "key-b", "for": "10m", "reason": "x"}
        )
        assert status == 200 and stores[0].blocks.names == {"per_key"}
        assert await _use(session, first, "key-b", 1) == [429]
        await stores[1].blocks.read()
        assert stores[1].blocks.names == {"per_key"}
        async with session.get(second.url + "/", headers={"X-Api-Key": "key-b"}) as response:
            assert response.status == 429 and response.headers["Retry-After"] == "600"
        assert await _use(session, second, "key-c", 1) == [200]
        status, state = await _admin(session, second, "/keys/per_key/key", key="key-b")
        assert state["blocked_for_s"] == 600 and state["remaining"] == 4
        await _admin(
            session, second, "/keys/per_key/unblock", {"key": "key-b", "reason": "resolved"}
        )
        assert await _use(session, first, "key-b", 1) == [200]


async def test_a_block_in_redis_holds_on_every_replica(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    """Two gateways on one Redis (a fake clock for both, as Redis's): a key blocked through
    one's admin listener is refused by the other, read as blocked there, and unblocked by it."""
    clock = FakeClock(start_us=3600 * S)
    prefix = f"block{time.monotonic_ns()}:"
    penalized = LIMITS.replace("fixed_window", "sliding_log") + (
        "    penalty: {after: 3, within: 1m, block: 15m, status: 403}\n"
    )
    policy = policy_for(upstream.url, penalized, server=f"  admin_token: {TOKEN}\n")
    first, second = [
        await start_gateway(
            policy,
            clock=clock,
            store=RedisStore(redis_server.url, key_prefix=prefix, clock=clock, time_source=clock),
        )
        for _ in range(2)
    ]
    async with aiohttp.ClientSession() as session:
        assert await _use(session, second, "key-b", 1) == [200]
        status, blocked = await _admin(
            session, first, "/keys/per_key/block", {"key": "key-b", "for": "10m", "reason": "x"}
        )
        assert status == 200 and blocked["state"]["blocked_for_s"] == 600
        async with session.get(second.url + "/", headers={"X-Api-Key": "key-b"}) as response:
            assert response.status == 403 and response.headers["Retry-After"] == "600"
        clock.advance(60)
        status, state = await _admin(session, second, "/keys/per_key/key", key="key-b")
        assert state["blocked_for_s"] == 540 and state["remaining"] == 4  # the limit untouched
        assert await _use(session, first, "key-other", 1) == [200]
        status, unblocked = await _admin(
            session, second, "/keys/per_key/unblock", {"key": "key-b", "reason": "resolved"}
        )
        assert status == 200 and unblocked["unblocked"] is True
        assert unblocked["state"]["blocked_for_s"] is None
        assert await _use(session, first, "key-b", 1) == [200]
        # A key blocked before it was ever seen: listed (first), and found by its id.
        await _admin(
            session, first, "/keys/per_key/block", {"key": "key-new", "for": "1m", "reason": "x"}
        )
        status, listing = await _admin(session, second, "/keys/per_key", top="10")
        top = listing["keys"][0]
        assert (top["id"], top["blocked_for_s"]) == (hashed("key-new"), 60)
        status, unblocked = await _admin(
            session, second, "/keys/per_key/unblock", {"id": hashed("key-new"), "reason": "x"}
        )
        assert status == 200 and unblocked["unblocked"] is True
        # A block that is not lifted ends on Redis's clock.
        await _admin(
            session, second, "/keys/per_key/block", {"key": "key-b", "for": "1m", "reason": "x"}
        )
        assert await _use(session, first, "key-b", 1) == [403]
        clock.advance(60)
        assert await _use(session, first, "key-b", 1) == [200]


async def test_which_limits_have_blocks_is_read_from_its_node_on_a_cluster(
    redis_cluster: RedisClusterHarness,
) -> None:
    """On a Cluster the hash naming the limits with blocks lives on one node: another
    replica reads it there, and its calls then read the boxes of that limit's keys."""
    limit = compiled("per_key", SlidingLog(5, 3600.0), ("header:X-Api-Key",))
    prefix = f"cluster-blocks{time.monotonic_ns()}:"
    first, second = [RedisStore(redis_cluster.url, key_prefix=prefix) for _ in range(2)]
    try:
        for store in (first, second):
            store.configure([limit], ())
            await store.prepare()
        assert (await second.decide([Check(limit, "key-c")])).allowed
        await RedisKeys(first).block(limit, "key-c", 600.0)
        await second.blocks.read()
        assert second.blocks.names == {"per_key"}
        verdict = await second.decide([Check(limit, "key-c")])
        assert not verdict.allowed and isinstance(verdict.states[0], PenaltyRefusal)
        assert (await second.decide([Check(limit, "key-d")])).allowed
    finally:
        for store in (first, second):
            await store.close()

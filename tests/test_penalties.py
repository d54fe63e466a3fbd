"""Penalties: a key a limit rejects too often is refused outright for a while, before the
upstream and without touching the limit. The pure box on given times, then the real gateway
(a real upstream, real clients over loopback) on a fake clock."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
import redis
import redis.cluster

from gateway.algorithms.penalty_box import CLEAR, PenaltyBox
from gateway.cli.main import main
from gateway.clock import FakeClock
from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import PolicyError
from gateway.stores import RedisStore
from gateway.stores.penalty_table import PenaltyTable
from tests.support import redis_harness
from tests.support.gateways import GatewayFactory
from tests.support.metrics import scrape_until, value
from tests.support.policies import policy_for, policy_template
from tests.support.processes import StartGateway, run_workers, wait_serving
from tests.support.redis_harness import RedisClusterHarness, RedisFactory, RedisServer
from tests.support.upstreams import RecordingUpstream

S = 1_000_000  # microseconds
redis_server = redis_harness.redis_server
redis_factory = redis_harness.redis_factory
redis_cluster = redis_harness.redis_cluster
_prefixes = redis_harness.key_prefixes()


def test_strikes_within_the_span_block_and_start_afresh() -> None:
    box = PenaltyBox(after=3, within_s=60, block_s=900)
    state = CLEAR
    for at in (0, 10, 20):
        assert box.blocked_until(state, at * S) == 0
        state = box.strike(state, at * S)
    assert box.blocked_until(state, 20 * S) == 920 * S
    assert box.blocked_until(state, 919 * S) == 920 * S
    assert box.blocked_until(state, 920 * S) == 0
    # Strikes further apart than the span never add up to a block.
    state = CLEAR
    for at in (0, 50, 110, 170, 230):
        state = box.strike(state, at * S)
        assert box.blocked_until(state, at * S) == 0


def test_a_full_table_drops_what_says_nothing_first() -> None:
    table = PenaltyTable(PenaltyBox(after=1, within_s=1, block_s=100), max_keys=2)
    table.strike("blocked", 0)
    table.strike("old", 0)
    assert table.blocked_until("old", 50 * S) and table.blocked_until("blocked", 50 * S)
    table.strike("new", 200 * S)  # both blocks are over by now: they go, not "new"
    assert len(table) == 1
    table.strike("newer", 250 * S)
    table.strike("newest", 260 * S)  # full of live entries: the oldest goes
    assert len(table) == 2 and not table.blocked_until("new", 260 * S)
    assert table.blocked_until("newest", 260 * S) == 360 * S
    assert table.clear("newer") and not table.clear("newer")


# sliding_log: exact over any span, so no window edge falls between a test's requests.
PENALIZED = """limits:
  per_key:
    algorithm: sliding_log
    limit: 1
    window: 1h
    key: ['header:X-Api-Key']
    penalty: {after: 2, within: 1m, block: 15m, status: 403}
"""


async def test_a_key_rejected_too_often_is_refused_at_once_for_the_block(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock(start_us=3600 * S)  # a window's start: its end an hour away
    gw = await start_gateway(policy_for(upstream.url, PENALIZED), clock=clock)
    key = {"X-Api-Key": "abuser"}
    async with aiohttp.ClientSession() as session:

        async def get(headers: dict[str, str] = key) -> tuple[int, dict[str, str], bytes]:
            async with session.get(gw.url + "/", headers=headers) as response:
                return response.status, dict(response.headers), await response.read()

        assert [(await get())[0] for _ in range(3)] == [200, 429, 429]  # the 2nd 429 blocks
        status, headers, body = await get()
        assert status == 403
        assert headers["Retry-After"] == "900"  # to the block's end, not the window's
        assert json.loads(body)["limit"] == "per_key"
        assert len(upstream.requests) == 1
        assert (await get({"X-Api-Key": "someone-else"}))[0] == 200  # only that key
        async with session.get(
            gw.admin_url + "/explain", params={"path": "/", "header": "X-Api-Key: abuser"}
        ) as response:
            explained = await response.json()
        assert explained["limits"][0]["penalty"]["blocked_for_s"] == 900
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda s: (
                s.get(
                    (
                        "gateway_limit_decisions_total",
                        frozenset({("limit", "per_key"), ("result", "penalized")}),
                    )
                )
                == 1
            ),
        )
        # The blocked request did not touch the limit: two rejections, one allowed each key.
        assert (
            value(samples, "gateway_limit_decisions_total", limit="per_key", result="rejected") == 2
        )
        clock.advance(900)
        assert (await get())[0] == 429  # the block is over; the limit's window is not
        clock.advance(3600)
        assert (await get())[0] == 200


def test_redis_keeps_penalties_but_not_on_leased_or_waiting_limits() -> None:
    """A leased limit decides most requests in the replica, where no strike reaches Redis."""
    redis_store = "store: {url: 'redis://127.0.0.1:1'}\n"
    parse_and_build(policy_for("http://127.0.0.1:9", PENALIZED + redis_store), "test.yaml")
    leased = PENALIZED.replace("sliding_log", "fixed_window").replace(
        "    window: 1h\n", "    window: 1h\n    lease: {}\n"
    )
    with pytest.raises(PolicyError) as raised:
        parse_and_build(policy_for("http://127.0.0.1:9", leased + redis_store), "test.yaml")
    message = raised.value.format()
    assert "limits.per_key: a leased limit decides most requests in this replica" in message
    slots = (
        "limits:\n  per_key:\n    algorithm: concurrency\n    limit: 1\n    max_delay: 5s\n"
        "    key: ['header:X-Api-Key']\n    penalty: {after: 2, within: 1m, block: 15m}\n"
    )
    with pytest.raises(PolicyError) as raised:
        parse_and_build(policy_for("http://127.0.0.1:9", slots + redis_store), "test.yaml")
    assert "give it max_delay: 0, or remove penalty" in raised.value.format()
    no_wait = slots.replace("    max_delay: 5s\n", "")  # rejected at once, as nginx does
    parse_and_build(policy_for("http://127.0.0.1:9", no_wait + redis_store), "test.yaml")


@pytest.mark.parametrize("calls", ["functions", "script"])
async def test_replicas_on_one_redis_share_the_penalty_box(
    redis_server: RedisServer,
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    calls: str,
) -> None:
    """Two gateways on one Redis (a fake clock for both, as Redis's): the strikes add up
    across them, the block holds on both, and ends on both; by FCALL, and by EVALSHA where
    Redis refuses functions."""
    url = redis_server.url
    if calls == "script":
        url = redis_factory.start(
            "--rename-command", "FUNCTION", "", "--rename-command", "FCALL", ""
        ).url
    clock = FakeClock(start_us=3600 * S)
    prefix = f"penalty{next(_prefixes)}:"
    gateways = [
        await start_gateway(
            policy_for(upstream.url, PENALIZED),
            store=RedisStore(url, key_prefix=prefix, clock=clock, time_source=clock),
        )
        for _ in range(2)
    ]
    async with aiohttp.ClientSession() as session:

        async def get(index: int, key: str = "abuser") -> int:
            async with session.get(
                gateways[index].url + "/", headers={"X-Api-Key": key}
            ) as response:
                await response.read()
                return response.status

        # Admitted by one, rejected by the other, rejected by the first: the 2nd strike.
        assert [await get(0), await get(1)] == [200, 429]
        assert await get(0) == 429
        assert [await get(1), await get(0)] == [403, 403]
        assert len(upstream.requests) == 1
        assert await get(1, "someone-else") == 200
        clock.advance(899)
        assert [await get(0), await get(1)] == [403, 403]
        clock.advance(1)
        assert [await get(0), await get(1)] == [429, 429]  # the block is over, the window not
        assert await get(0) == 403  # two more strikes within a minute: blocked again
        # An explain on a blocked key says so, and changes nothing.
        async with session.get(
            gateways[1].admin_url + "/explain",
            params={"path": "/", "header": "X-Api-Key: abuser"},
        ) as response:
            explained = await response.json()
        assert explained["limits"][0]["penalty"]["blocked_for_s"] == 900
        assert await get(0) == 403  # the look changed nothing
        clock.advance(900 + 3600)
        assert [await get(1), await get(0)] == [200, 429]


async def test_the_local_fallback_keeps_penalties_while_redis_is_away(
    redis_factory: RedisFactory, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """``on_failure: local`` with Redis stopped: the fallback strikes and blocks as the
    in-process store does, and a block met in Redis before the outage holds through it."""
    server = redis_factory.start()
    clock = FakeClock(start_us=3600 * S)
    store = RedisStore(
        server.url,
        key_prefix=f"outage{next(_prefixes)}:",
        clock=clock,
        time_source=clock,
        timeout_s=1.0,
    )
    gw = await start_gateway(policy_for(upstream.url, PENALIZED), clock=clock, store=store)
    async with aiohttp.ClientSession() as session:

        async def get(key: str) -> tuple[int, str | None]:
            async with session.get(gw.url + "/", headers={"X-Api-Key": key}) as response:
                await response.read()
                return response.status, response.headers.get("Retry-After")

        assert [(await get("early"))[0] for _ in range(4)] == [200, 429, 429, 403]
        server.stop()
        clock.advance(60)
        assert await get("early") == (403, "840")  # the block Redis gave, to its end
        assert [(await get("abuser"))[0] for _ in range(4)] == [200, 429, 429, 403]
        assert await get("abuser") == (403, "900")
        assert store.counters.local_decisions >= 6
        assert (await get("someone-else"))[0] == 200  # only those keys
        clock.advance(900)
        assert (await get("abuser"))[0] == 429  # the block is over; the limit's window is not


async def test_two_gateway_processes_on_one_redis_share_the_box(
    redis_server: RedisServer, upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    """Two ``gateway run`` processes, one Redis (its own clock): the key's strikes add up
    across them and both refuse it (the block, an hour, outlasts the test)."""
    store = f"store: {{url: '{redis_server.url}', key_prefix: 'procs{next(_prefixes)}:'}}\n"
    limits = PENALIZED.replace("block: 15m", "block: 1h") + store
    policy = policy_template(upstream.url).replace("{", "{{").replace("}", "}}")
    policy = policy.replace("{{port}}", "{port}").replace("{{admin_port}}", "{admin_port}")
    policy += limits.replace("{", "{{").replace("}", "}}")
    first, second = [(await gateway_process(policy=policy)).url for _ in range(2)]
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def get(url: str, key: str = "abuser") -> int:
            async with session.get(url + "/", headers={"X-Api-Key": key}) as response:
                await response.read()
                return response.status

        assert [await get(first), await get(second), await get(first)] == [200, 429, 429]
        assert [await get(second), await get(first)] == [403, 403]
        assert await get(second, "someone-else") == 200
    assert len(upstream.requests) == 2


async def test_the_penalty_box_shares_the_limits_slot_on_a_cluster(
    redis_cluster: RedisClusterHarness, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """On a Redis Cluster a box is declared to the call and lives in its limit's slot."""
    clock = FakeClock(start_us=3600 * S)
    prefix = f"penalty{next(_prefixes)}:"
    store = RedisStore(redis_cluster.url, key_prefix=prefix, clock=clock, time_source=clock)
    gw = await start_gateway(policy_for(upstream.url, PENALIZED), store=store)
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(4):
            async with session.get(gw.url + "/", headers={"X-Api-Key": "abuser"}) as response:
                statuses.append(response.status)
    assert statuses == [200, 429, 429, 403]
    plan = store.plan(gw.gateway.handler.runtime.engine.limits[0])
    plain = redis.cluster.RedisCluster.from_url(f"redis://127.0.0.1:{redis_cluster.nodes[0].port}")
    try:
        box, state = plan.penalty_key("abuser"), plan.redis_key("abuser")
        assert plain.keyslot(box) == plain.keyslot(state) and plain.exists(box)
    finally:
        plain.close()


async def test_limits_without_penalty_make_the_same_calls_on_redis(
    redis_server: RedisServer, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A policy with no penalty sends the script no box: no key beside the limit's."""
    prefix = f"plain{next(_prefixes)}:"
    plain = PENALIZED.replace("    penalty: {after: 2, within: 1m, block: 15m, status: 403}\n", "")
    gw = await start_gateway(
        policy_for(upstream.url, plain), store=RedisStore(redis_server.url, key_prefix=prefix)
    )
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            async with session.get(gw.url + "/", headers={"X-Api-Key": "k"}) as response:
                await response.read()
    with redis.Redis.from_url(redis_server.url) as plain:
        found = plain.keys(prefix + "*")
    assert len(found) == 1 and b":penalty:" not in found[0]


async def test_a_key_blocked_by_one_worker_is_refused_by_all(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """``--workers 2``: each request on a new connection (SO_REUSEPORT spreads them over the
    workers); the strikes add up and the block holds whichever worker answers."""
    async with run_workers(upstream.url, tmp_path, PENALIZED, 2) as (url, _, pids):
        await wait_serving(tmp_path, 2)
        statuses = []
        for _ in range(8):
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session,
                session.get(url + "/", headers={"X-Api-Key": "abuser"}) as response,
            ):
                statuses.append(response.status)
        assert statuses == [200, 429, 429] + [403] * 5
        assert len(upstream.requests) == 1
        assert len(pids()) == 2


def test_replay_plays_penalties_as_the_live_gateway_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One client, a request a second: 1 admitted, 2 rejected (the second blocks the key),
    then 3 refused by the penalty without the limit being asked."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_for("http://127.0.0.1:9", PENALIZED.replace("['header:X-Api-Key']", "[client_ip]"))
    )
    start = datetime(2026, 1, 1, tzinfo=UTC)
    log = tmp_path / "access.log"
    stamps = [(start + timedelta(seconds=s)).strftime("%d/%b/%Y:%H:%M:%S +0000") for s in range(6)]
    log.write_text(
        "".join(f'203.0.113.1 - - [{at}] "GET / HTTP/1.1" 200 12 "-" "curl/8.5"\n' for at in stamps)
    )
    assert main(["replay", "--json", "--config", str(policy), str(log)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"][0]["rejected_by"] == {"per_key": 5}
    limit = next(lim for lim in doc["policies"][0]["limits"] if lim["name"] == "per_key")
    assert (limit["allowed"], limit["rejected"]) == (1, 2)


def test_blocks_outlive_a_reload_while_the_limit_keeps_its_penalty() -> None:
    from gateway.algorithms.registry import build_algorithm
    from gateway.engine.key_admin import block_key, limit_named
    from gateway.engine.limit_engine import LimitEngine
    from gateway.stores import MemoryStore

    other = "  other:\n    algorithm: fixed_window\n    limit: 5\n    window: 1m\n"
    clock = FakeClock()
    store = MemoryStore(clock)

    def engine(limits: str, previous: LimitEngine | None = None) -> LimitEngine:
        policy = parse_and_build(policy_for("http://127.0.0.1:9", limits), "test.yaml").policy
        return LimitEngine(policy, store, build_algorithm, previous=previous)

    first = engine(PENALIZED + other)
    first.penalties["per_key"].strike("k", clock.now_us())
    first.penalties["per_key"].strike("k", clock.now_us())
    asyncio.run(
        block_key(first, limit_named(first, "other"), "10.0.0.1", 60)
    )  # a limit without penalty
    kept = engine(PENALIZED + other, first)
    assert kept.penalty_until(limit_named(kept, "per_key"), "k") == 900
    assert kept.penalty_until(limit_named(kept, "other"), "10.0.0.1") == 60
    changed = engine(PENALIZED.replace("block: 15m", "block: 1m") + other, kept)
    assert changed.penalty_until(limit_named(changed, "per_key"), "k") is None
    assert changed.penalty_until(limit_named(changed, "other"), "10.0.0.1") == 60

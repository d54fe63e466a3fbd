"""Concurrency slots in Redis, held by the replica that took them (real Redis, real cluster).

Each ``RedisStore`` here is one replica. The limit is counted over every replica's live slots
in one script call; a replica's slots live ``slot_ttl`` unless it renews them, which it does
every third of that while it runs. The expiry is on Redis ``TIME`` (or the scripts' test
clock): tests that check it drive a fake clock, or wait out a short ``slot_ttl`` once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import redis

import gateway.stores.redis
from gateway.algorithms.concurrency import Concurrency
from gateway.algorithms.fixed_window import FixedWindow
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit
from gateway.stores import RedisStore
from gateway.stores.redis.circuit import CircuitBreaker
from tests.support import redis_harness
from tests.support.conformance import T0_US, close_client, compiled
from tests.support.gateways import GatewayFactory
from tests.support.held_upstream import HeldUpstream
from tests.support.policies import policy_for
from tests.support.processes import StartGateway
from tests.support.redis_harness import RedisClusterHarness, RedisFactory, RedisServer
from tests.support.waiting import wait_until

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
redis_factory = redis_harness.redis_factory
_prefixes = redis_harness.key_prefixes()

Replicas = Callable[..., RedisStore]


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Replicas]:
    """Replicas of one gateway on the shared server, on keys of their own."""
    prefix = f"slots{next(_prefixes)}:"
    made: list[RedisStore] = []

    def make(*limits: CompiledLimit, url: str = redis_server.url, **options: object) -> RedisStore:
        options.setdefault("timeout_s", 2.0)
        store = RedisStore(url, key_prefix=prefix, **options)  # type: ignore[arg-type]
        store.configure(limits, ())
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def admitted(store: RedisStore, *checks: Check) -> bool:
    return (await store.decide(checks)).allowed


async def test_the_limit_holds_across_replicas_and_a_release_admits_the_next(
    replicas: Replicas,
) -> None:
    limit = compiled("in_flight", Concurrency(3))
    a, b = replicas(limit), replicas(limit)
    key = Check(limit, "10.0.0.1")
    assert [await admitted(a, key), await admitted(a, key), await admitted(b, key)] == [True] * 3
    verdict = await b.decide([key])
    assert not verdict.allowed and verdict.retry_after_s == 1.0
    assert not await admitted(a, key)
    assert await admitted(b, Check(limit, "10.0.0.2"))  # another key, its own slots
    done = a.release([key])
    assert done is not None
    await done
    assert await admitted(b, key)
    assert not await admitted(a, key)
    # Each replica's slots are its own: b's release gives back b's, not a's.
    for _ in range(2):
        done = b.release([key])
        assert done is not None
        await done
    assert [await admitted(a, key), await admitted(a, key), await admitted(a, key)] == [
        True,
        True,
        False,
    ]


async def test_a_request_rejected_by_a_rate_limit_takes_no_slot(replicas: Replicas) -> None:
    slots = compiled("in_flight", Concurrency(2))
    rate = compiled("per_day", FixedWindow(1, 86_400.0))
    a, b = replicas(slots, rate), replicas(slots, rate)
    assert await admitted(a, Check(slots, "k"), Check(rate, "k"))
    assert not await admitted(b, Check(slots, "k"), Check(rate, "k"))  # the window refuses
    assert await admitted(b, Check(slots, "k"))  # so its slot is still free
    assert not await admitted(a, Check(slots, "k"))


async def test_a_replica_that_stops_renewing_loses_its_slots_after_the_ttl(
    replicas: Replicas,
) -> None:
    """On the scripts' clock: slots taken at t expire at t + slot_ttl, not one microsecond
    sooner, unless renewed; a renewal counts from its own instant."""
    clock = FakeClock(T0_US)
    limit = compiled("in_flight", Concurrency(2))
    dead = replicas(limit, time_source=clock, slot_ttl_s=3.0)
    alive = replicas(limit, time_source=clock, slot_ttl_s=3.0)
    key = Check(limit, "k")
    assert await admitted(dead, key)
    assert await admitted(alive, key)
    dead.slots.close()  # as if killed: nothing renews its slot
    alive.slots.close()  # renewed below, by hand
    clock.advance(2.0)
    await alive._renew_slots([(key, alive.plan(limit), 0)])
    clock.advance(0.999_999)
    assert not await admitted(alive, key)  # both still held, at 3 s less 1 us
    clock.advance(0.000_001)
    assert await admitted(alive, key)  # the dead replica's slot expired; the renewed one not
    assert not await admitted(alive, key)
    # A replica's slots of a key are one record: the take at 3 s renewed it until 6 s.
    clock.advance(2.999_999)
    assert not await admitted(alive, key)
    clock.advance(0.000_001)
    assert await admitted(alive, key)


async def test_slots_held_longer_than_the_ttl_stay_held_while_the_replica_runs(
    replicas: Replicas,
) -> None:
    """Real time: the keeper renews every third of ``slot_ttl``."""
    limit = compiled("in_flight", Concurrency(1))
    holder, other = replicas(limit, slot_ttl_s=0.9), replicas(limit, slot_ttl_s=0.9)
    key = Check(limit, "k")
    assert await admitted(holder, key)
    await asyncio.sleep(2.0)
    assert holder.slots.renewals >= 3
    assert not await admitted(other, key)
    done = holder.release([key])
    assert done is not None
    await done
    assert await admitted(other, key)


async def test_a_renewal_writes_back_slots_redis_lost_and_keeps_the_count_it_has(
    replicas: Replicas,
) -> None:
    """A replica cut off longer than ``slot_ttl`` finds its slots gone: the renewal writes back
    the ones it still holds. Otherwise it keeps Redis's count (a take or release may be on its
    way): a release whose answer was lost is not undone, and stays counted until the replica
    holds none of the key and its field expires."""
    clock = FakeClock(T0_US)
    limit = compiled("in_flight", Concurrency(2))
    store = replicas(limit, time_source=clock, slot_ttl_s=3.0)
    other = replicas(limit, time_source=clock, slot_ttl_s=3.0)
    key = Check(limit, "k")
    plan = store.plan(limit)
    assert await admitted(store, key) and await admitted(store, key)
    store.slots.close()
    clock.advance(3.0)  # cut off that long: Redis has none of its slots left
    await store._renew_slots([(key, plan, 2)])
    assert not await admitted(other, key)
    store.slots.give_back(key, plan)  # given back here; Redis never heard of it
    await store._renew_slots([(key, plan, 1)])
    assert not await admitted(other, key)  # under-admits, never over
    store.slots.give_back(key, plan)
    clock.advance(2.999_999)
    assert not await admitted(other, key)
    clock.advance(0.000_001)
    assert await admitted(other, key) and await admitted(other, key)


async def test_slots_taken_in_the_fallback_are_local_and_given_back_there(
    redis_factory: RedisFactory, replicas: Replicas
) -> None:
    """Redis stopped: ``on_failure: local`` holds slots in process (the limit divided by the
    replicas), released there; none is owed to Redis once it answers again."""
    server = redis_factory.start()
    limit = compiled("in_flight", Concurrency(4))
    breaker = CircuitBreaker(
        "test", failure_threshold=2, reset_timeout_s=0.2, max_reset_timeout_s=0.4
    )
    store = replicas(limit, url=server.url, replicas=2, timeout_s=0.2, breaker=breaker)
    key = Check(limit, "k")
    assert await admitted(store, key)  # in Redis
    server.stop()
    assert [await admitted(store, key) for _ in range(3)] == [True, True, False]  # 4 / 2 local
    assert store.local.slots_in_use("in_flight") == 2
    assert store.release([key]) is not None  # the Redis one: a call, which fails
    assert store.local.slots_in_use("in_flight") == 2
    assert store.release([key]) is None  # local ones, at once
    assert store.release([key]) is None
    assert store.local.slots_in_use("in_flight") == 0
    assert not store.owed.due("")


async def test_a_keys_slots_live_in_its_hash_slot_in_a_cluster(
    redis_cluster: RedisClusterHarness,
) -> None:
    prefix = f"cslots{next(_prefixes)}:"
    limit = compiled("in_flight", Concurrency(2), key=("client_ip", "route"))
    rate = compiled("per_ip", FixedWindow(100, 3600.0))
    stores = [RedisStore(redis_cluster.url, key_prefix=prefix, timeout_s=2.0) for _ in range(2)]
    plain = redis.cluster.RedisCluster.from_url(f"redis://127.0.0.1:{redis_cluster.nodes[0].port}")
    try:
        for store in stores:
            store.configure([limit, rate], ())
        for n in range(20):
            ip = f"10.2.0.{n}"
            checks = [Check(limit, f"{ip}\x1fapi"), Check(rate, ip)]
            assert await admitted(stores[0], *checks)
            assert await admitted(stores[1], *checks)
            assert not await admitted(stores[n % 2], *checks)
            hash_key = stores[0].redis_key(checks[0])
            assert plain.keyslot(hash_key) == plain.keyslot(stores[0].redis_key(checks[1]))
            assert plain.hlen(hash_key) == 2  # one field per replica
            done = stores[1].release([checks[0]])
            assert done is not None
            await done
            assert plain.hlen(hash_key) == 1
            assert await admitted(stores[n % 2], *checks)
    finally:
        close_client(plain)
        for store in stores:
            await store.close()


# -- real gateway processes, two replicas on one Redis --

REPLICA_POLICY = """\
server:
  listen: 127.0.0.1:{{port}}
  admin_listen: 127.0.0.1:{{admin_port}}
upstreams:
  backend:
    url: {upstream}
routes:
  - name: all
    upstream: backend
store:
  url: {redis}
  key_prefix: "{prefix}"
  replicas: 2
  timeout: 2.0
  slot_ttl: {ttl}
limits:
  in_flight:
    algorithm: concurrency
    limit: 4
"""


async def _get(url: str) -> int | str:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
            session.get(url) as resp,
        ):
            await resp.read()
            return resp.status
    except aiohttp.ClientError as exc:
        return type(exc).__name__


@pytest.mark.reliability
@pytest.mark.parametrize("where", ["server", "cluster"])
async def test_two_replicas_share_the_limit_and_a_killed_replicas_slots_expire_within_the_ttl(
    where: str,
    request: pytest.FixtureRequest,
    held_upstream: HeldUpstream,
    gateway_process: StartGateway,
) -> None:
    """Four slots over two gateway processes: two requests held through each, the fifth
    refused by either, also once they were held longer than ``slot_ttl`` (renewed). SIGKILL
    one: its two slots are still counted at once, then no later than ``slot_ttl`` (1.5 s
    here) after the kill the other admits exactly two more."""
    ttl = 1.5
    url = request.getfixturevalue(f"redis_{where}").url
    policy = REPLICA_POLICY.format(
        upstream=held_upstream.url, redis=url, prefix=f"p{next(_prefixes)}:", ttl=ttl
    )
    a = await gateway_process(policy=policy)
    b = await gateway_process(policy=policy)
    held_a = [asyncio.create_task(_get(f"{a.url}/hold/a")) for _ in range(2)]
    held_b = [asyncio.create_task(_get(f"{b.url}/hold/b")) for _ in range(2)]
    await wait_until(lambda: held_upstream.holding() == 4, "4 in flight", 20)
    assert [await _get(f"{a.url}/fast"), await _get(f"{b.url}/fast")] == [429, 429]
    await asyncio.sleep(ttl + 0.5)  # held past the ttl: renewed by both replicas
    assert [await _get(f"{a.url}/fast"), await _get(f"{b.url}/fast")] == [429, 429]
    loop = asyncio.get_running_loop()
    os.kill(a.proc.pid, signal.SIGKILL)
    killed_at = loop.time()
    await a.proc.wait()
    assert await _get(f"{b.url}/fast") == 429  # renewed at most ttl/3 ago: still counted
    while (status := await _get(f"{b.url}/fast")) == 429:
        assert loop.time() - killed_at < ttl + 1.0, "the killed replica's slots did not expire"
        await asyncio.sleep(0.05)
    freed_after = loop.time() - killed_at
    print(f"\nthe killed replica's slots freed {freed_after:.2f} s after SIGKILL (ttl {ttl} s)")
    assert status == 200
    assert freed_after >= ttl / 2 - 0.2  # not before its last renewal's ttl could run out
    more = [asyncio.create_task(_get(f"{b.url}/hold/c")) for _ in range(2)]
    await wait_until(lambda: held_upstream.in_flight.get("c") == 2, "2 more in flight", 20)
    assert await _get(f"{b.url}/fast") == 429
    for name in ("a", "b", "c"):
        held_upstream.release(name)
    assert await asyncio.gather(*held_b, *more) == [200] * 4
    assert all(task.done() for task in held_a)
    assert [await _get(f"{b.url}/fast") for _ in range(4)] == [200] * 4


def test_every_lua_mirror_has_a_letter_of_its_own() -> None:
    """The script picks a mirror by its parameters' first letter: two under one letter would
    decide one algorithm's keys by the other's rules."""
    lua = Path(gateway.stores.redis.__file__).parent / "lua"
    letters = re.findall(r"MAKE\['(.)'\]", "".join(p.read_text() for p in lua.glob("*.lua")))
    assert len(letters) == len(set(letters)) >= 8, letters


async def test_a_request_waiting_for_a_slot_gets_the_one_another_replica_gives_back(
    replicas: Replicas, held_upstream: HeldUpstream, start_gateway: GatewayFactory
) -> None:
    """Two gateways on one Redis, one slot per key, ``max_delay`` 5 s: a request through the
    second waits while the first holds the slot, and is admitted once it is given back (the
    front of the line looks again now and then: the other replica sends no word)."""
    limits = (
        "limits:\n  in_flight:\n    algorithm: concurrency\n    limit: 1\n"
        "    max_delay: 5s\n    max_queue: 4\n"
    )
    policy = policy_for(held_upstream.url, limits)
    limit = compiled("in_flight", Concurrency(1))
    first = await start_gateway(policy, store=replicas(limit))
    second = await start_gateway(policy, store=replicas(limit))
    holding = asyncio.create_task(_get(f"{first.url}/hold/first"))
    await wait_until(lambda: held_upstream.in_flight.get("first") == 1, "the slot taken", 10)
    waiting = asyncio.create_task(_get(f"{second.url}/hold/second"))
    await asyncio.sleep(0.3)
    assert not waiting.done() and held_upstream.in_flight.get("second", 0) == 0
    held_upstream.release("first")
    assert await holding == 200
    await wait_until(lambda: held_upstream.in_flight.get("second") == 1, "admitted", 5)
    held_upstream.release("second")
    assert await waiting == 200

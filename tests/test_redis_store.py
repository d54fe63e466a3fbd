"""The Redis store against real Redis (one server, and a real 3-master cluster).

The behaviour tests run over every store: the in-process ``MemoryStore``, ``RedisStore`` with
its own client on one server and on the cluster, and ``RedisStore`` on redis-py's pipelines.
Each drives the store with a fake clock (the scripts take ``now`` as an argument) and compares
every decision, and for Redis every stored state, with the pure Python algorithms computing
the same requests at the same instants: that is what proves the Lua mirrors.

Then what only Redis has: atomicity between replicas (with a naive read-then-write store that
the same test catches over-admitting), Redis ``TIME`` for replicas whose clocks disagree, key
expiry, hash tags in the cluster, and failure: a stopped or frozen Redis, the three
``on_failure`` modes and the circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis
import redis.cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.registry import build_algorithm
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import Policy
from gateway.stores import MemoryStore, RedisStore, StoreUnavailableError
from gateway.stores.redis.circuit import CircuitBreaker
from gateway.stores.redis.store import load_script, parse_store_url
from tests.support import redis_harness
from tests.support.conformance import (
    ALGORITHMS,
    STORE_KINDS,
    T0_US,
    VARIANTS,
    Backend,
    Op,
    RescaleOp,
    close_client,
    compiled,
    make_backend,
    operations,
    rescale_operations,
    run_against_python,
    run_rescale_against_python,
    stacks,
    verdict_of,
)
from tests.support.gateways import GatewayFactory
from tests.support.metrics import scrape
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisClusterHarness, RedisFactory, RedisServer
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

# The harness's fixtures, made visible to pytest in this module.
redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster
redis_factory = redis_harness.redis_factory
_prefixes = redis_harness.key_prefixes()


@pytest.mark.parametrize("kind", STORE_KINDS)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stack=stacks, ops=operations)
def test_decisions_and_states_match_the_python_algorithms(
    kind: str, request: pytest.FixtureRequest, stack: list[str], ops: list[Op]
) -> None:
    backend = make_backend(kind, request)
    try:
        asyncio.run(run_against_python(backend, stack, ops))
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=operations)
def test_each_lua_mirror_matches_its_python_algorithm(
    name: str, request: pytest.FixtureRequest, ops: list[Op]
) -> None:
    """One algorithm at a time (on one server: the mirror does not depend on the client), so
    that every branch of every script is reached."""
    backend = make_backend("redis", request)
    try:
        asyncio.run(run_against_python(backend, [name], ops))
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
async def test_each_algorithm_through_a_burst_and_recovery(backend: Backend, name: str) -> None:
    """Every algorithm over a fixed script: a burst at one instant, then time passing, then
    refunds (with and without the instant charged); the same as the Python algorithm at every
    step (the property test's worked case)."""
    inf = math.inf
    ops: list[Op] = [(0, "decide", "a", inf)] * 8
    ops += [(50_000, "decide", "a", inf), (0, "refund", "a", inf)]
    ops += [(300_000, "peek", "a", inf), (0, "decide", "a", inf), (2_000_000, "decide", "a", inf)]
    ops += [(-30_000, "decide", "a", inf), (0, "decide", "b", inf)]
    # Saturated, then walking through window edges: a request every 37 ms for 2.2 s, then
    # every 213 ms, some given back; every third may wait at most 0.1 s.
    ops += [(37_000, "decide", "a", 0.1 if n % 3 == 0 else inf) for n in range(60)]
    ops += [(213_000, op, "a", inf) for op in ("decide", "decide", "refund", "peek") * 5]
    # Given back exactly, at once and after a window edge.
    ops += [(0, "decide", "a", inf), (0, "refund_exact", "a", inf), (0, "peek", "a", inf)]
    ops += [(400_000, "decide", "a", inf), (700_000, "refund_exact", "a", inf)]
    ops += [(0, "decide", "a", inf)]
    await run_against_python(backend, [name], ops)


async def test_a_request_rejected_by_one_limit_is_charged_to_none(backend: Backend) -> None:
    clock = FakeClock(T0_US)
    per_client = compiled("per_client", LeakyBucket(1, 60, 3, None))
    site = compiled("site", FixedWindow(2, 60.0), key=("global",))
    store = backend.make(clock)
    store.configure([per_client, site], ())
    try:
        for client in ("b", "b"):  # b spends the site's two
            assert (await store.decide([Check(per_client, client), Check(site, "")])).allowed
        for _ in range(5):
            verdict = await store.decide([Check(per_client, "a"), Check(site, "")])
            assert not verdict.allowed and verdict.rejected_by == (1,)
        # a's own bucket was charged nothing: its next request would find all 4 there.
        alone = await store.decide([Check(per_client, "a")], commit=False)
        assert alone.decisions[0].remaining == 3
    finally:
        await store.close()


@pytest.mark.parametrize("count", [10, 1700])
async def test_a_request_of_many_limits_is_decided_as_in_process(
    redis_backend: Backend, count: int
) -> None:
    """Ten limits on one request: a key count of two digits (the thin client once wrote every
    key count as one byte long). 1,700: the script's reply (8,502 integers) is past the values
    Lua's unpack makes at once (8,000), where the script makes its tables at their size."""
    limits = [compiled(f"l{i}", FixedWindow(3, 60.0)) for i in range(count)]
    checks = [Check(limit, "a") for limit in limits]
    verdicts = []
    for store in (MemoryStore(FakeClock(T0_US)), redis_backend.make(FakeClock(T0_US))):
        store.configure(limits, ())
        try:
            verdicts.append([verdict_of(await store.decide(checks)) for _ in range(4)])
        finally:
            await store.close()
    assert verdicts[0] == verdicts[1]
    assert [verdict.allowed for verdict in verdicts[1]] == [True, True, True, False]


async def test_explain_peeks_without_charging(backend: Backend) -> None:
    clock = FakeClock(T0_US)
    limit = compiled("only", FixedWindow(2, 10.0))
    store = backend.make(clock)
    store.configure([limit], ())
    try:
        for _ in range(5):
            peek = await store.decide([Check(limit, "k")], commit=False)
            assert peek.allowed and peek.decisions[0].remaining == 1
        assert [(await store.decide([Check(limit, "k")])).allowed for _ in range(3)] == [
            True,
            True,
            False,
        ]
    finally:
        await store.close()


# --- what only a shared store has -------------------------------------------------------------


class NaiveRedisStore:
    """Read, decide in Python, write back: what a store without a script does. Two requests
    that read before either writes both see the old state; the atomicity test must catch it."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url, max_connections=200)
        self.prefix = prefix

    async def decide(self, limit: CompiledLimit, key: str, now_us: int) -> bool:
        name = f"{self.prefix}{limit.name}:{key}"
        raw = await self.client.get(name)
        state = int(raw) if raw is not None else None
        decision, new_state = limit.algorithm.decide(state, now_us)
        if decision.allowed:
            await self.client.set(name, str(new_state))
        return decision.allowed

    async def close(self) -> None:
        await self.client.aclose()


@pytest.mark.reliability
async def test_replicas_hammering_one_key_never_over_admit(redis_backend: Backend) -> None:
    """Four replicas (stores with their own connections), 400 requests at once, one key, a
    limit of 50 per window: exactly 50 admitted. The naive store on the same Redis admits more,
    which shows this test would see a race."""
    limit = compiled("hot", FixedWindow(50, 3600.0), key=("global",))
    prefix = f"hot{next(_prefixes)}:"
    # One fake clock for the scripts: on Redis TIME an hour could end during the burst and
    # admit up to 50 more in the next window.
    clock = FakeClock(T0_US)
    stores = [redis_backend.make(clock, key_prefix=prefix, max_in_flight=4) for _ in range(4)]
    try:
        for store in stores:
            store.configure([limit], ())
        verdicts = await asyncio.gather(
            *[stores[i % 4].decide([Check(limit, "")]) for i in range(400)]
        )
        assert sum(v.allowed for v in verdicts) == 50
        assert all(isinstance(s, RedisStore) and s.counters.failed_calls == 0 for s in stores)
    finally:
        for store in stores:
            await store.close()
    assert redis_backend.url is not None
    if redis_backend.kind == "cluster":
        return  # the naive store is a single-server client
    naive_prefix = f"naive{next(_prefixes)}:"
    naive = [NaiveRedisStore(redis_backend.url, naive_prefix) for _ in range(4)]
    try:
        now_us = time.time_ns() // 1000
        admitted = await asyncio.gather(
            *[naive[i % 4].decide(limit, "", now_us) for i in range(400)]
        )
        assert sum(admitted) > 50
    finally:
        for store in naive:
            await store.close()


@pytest.mark.reliability
async def test_replicas_with_skewed_clocks_enforce_one_limit(redis_backend: Backend) -> None:
    """Two replicas whose own clocks are two minutes apart share one bucket, because the scripts
    read Redis TIME. Had each used its own clock, the one ahead would find two more tokens."""
    limit = compiled("skew", TokenBucket(1, 60, 5))  # 5 at once, then 1 a minute
    behind, ahead = FakeClock(T0_US), FakeClock(T0_US + 120_000_000)
    shared_keys, own_keys = f"skew{next(_prefixes)}:", f"skew{next(_prefixes)}:"
    stores = [
        redis_backend.make(clock=behind, key_prefix=shared_keys),
        redis_backend.make(clock=ahead, key_prefix=shared_keys),
    ]
    skewed = [
        redis_backend.make(behind, key_prefix=own_keys),
        redis_backend.make(ahead, key_prefix=own_keys),
    ]
    try:
        for store in (*stores, *skewed):
            store.configure([limit], ())
        shared = [(await stores[i % 2].decide([Check(limit, "c")])).allowed for i in range(10)]
        assert shared == [True] * 5 + [False] * 5
        # The same traffic with each replica on its own clock: one limit no more.
        local = [(await skewed[i % 2].decide([Check(limit, "c")])).allowed for i in range(10)]
        assert sum(local) == 6
    finally:
        for store in (*stores, *skewed):
            await store.close()


async def test_idle_keys_expire_and_carry_prefix_and_limit(redis_backend: Backend) -> None:
    """With Redis TIME, a key lives until its state is as good as new: 500 ms for one request
    on a 2r/s bucket (long enough for a loaded CI machine to look at it in time)."""
    limit = compiled("ttl", LeakyBucket(2, 1, 0, None))
    store = redis_backend.make(time_source=None, key_prefix="ttltest:")
    assert isinstance(store, RedisStore) and redis_backend.inspect is not None
    store.configure([limit], ())
    try:
        assert (await store.decide([Check(limit, "10.0.0.1")])).allowed
        assert not (await store.decide([Check(limit, "10.0.0.1")], commit=False)).allowed
        key = store.redis_key(Check(limit, "10.0.0.1"))
        assert key.startswith("ttltest:{10.0.0.1}ttl:") and key.endswith(":10.0.0.1")
        ttl_ms = redis_backend.inspect.pttl(key)
        assert 0 < ttl_ms <= 502
        for _ in range(60):  # expiry is Redis's job: poll it, bounded
            if not redis_backend.inspect.exists(key):
                break
            await asyncio.sleep(0.05)
        assert not redis_backend.inspect.exists(key)
        assert (await store.decide([Check(limit, "10.0.0.1")], commit=False)).allowed
    finally:
        await store.close()


async def test_a_changed_limit_keeps_its_keys_and_rescales_its_state(
    redis_backend: Backend,
) -> None:
    clock = FakeClock(T0_US)
    before = compiled("lim", FixedWindow(3, 60.0))
    store = redis_backend.make(clock)
    assert isinstance(store, RedisStore)
    store.configure([before], ())
    try:
        for _ in range(3):
            await store.decide([Check(before, "k")])
        same = compiled("lim", FixedWindow(3, 60.0))
        store.configure([same], [before])
        assert store.redis_key(Check(same, "k")) == store.redis_key(Check(before, "k"))
        assert not (await store.decide([Check(same, "k")])).allowed
        # Twice the limit: the window is still full (6 of 6), not fresh.
        changed = compiled("lim", FixedWindow(6, 60.0))
        store.configure([changed], [same])
        assert store.redis_key(Check(changed, "k")) == store.redis_key(Check(same, "k"))
        assert not (await store.decide([Check(changed, "k")])).allowed
        # Another key part, or another algorithm, is another limit: a key of its own.
        other_key = compiled("lim", FixedWindow(6, 60.0), key=("client_ip", "method"))
        other_algorithm = compiled("lim", SlidingWindow(6, 60.0))
        for other in (other_key, other_algorithm):
            assert store.redis_key(Check(other, "k")) != store.redis_key(Check(changed, "k"))
    finally:
        await store.close()


# --- a reload that changes a limit's parameters, on replicas that reload at different moments --


@st.composite
def muldiv_cases(draw: st.DrawFn) -> tuple[int, int, int]:
    """``a * b // c`` below 2**53 with ``a * b`` often far above it (a count times a ratio of
    parameters, in a rescale)."""
    big = st.integers(0, 2**53 - 1)
    a, b = draw(big), draw(big)
    c = draw(st.integers(max(a * b >> 53, 0) + 1, 2**53 - 1))
    return a, b, c


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(muldiv_cases(), min_size=50, max_size=50))
def test_the_scripts_muldiv_is_exact_past_2_to_the_53(
    redis_server: RedisServer, cases: list[tuple[int, int, int]]
) -> None:
    """The scripts' doubles estimate ``a * b / c``; their limbs make it exact."""
    prelude = load_script().split("MAKE['L']")[0].rsplit("\n", 1)[0]
    script = prelude + (
        "\nlocal out = {}\nfor i = 1, #ARGV, 3 do\n"
        "  local a, b, c = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])\n"
        "  out[#out + 1] = string.format('%d', muldiv(a, b, c))\n"
        "  out[#out + 1] = string.format('%d', muldiv(a, b, c, true))\nend\nreturn out\n"
    )
    client = redis.Redis.from_url(redis_server.url)
    try:
        got = client.eval(script, 0, *[x for case in cases for x in case])
    finally:
        client.close()
    want = []
    for a, b, c in cases:
        want += [str(a * b // c).encode(), str(-(-a * b // c)).encode()]
    assert got == want


@pytest.mark.parametrize("kind", [k for k in STORE_KINDS if k != "memory"])
@pytest.mark.parametrize("family", sorted(VARIANTS))
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=rescale_operations)
def test_states_written_under_other_parameters_are_rescaled_as_in_python(
    kind: str, family: str, request: pytest.FixtureRequest, ops: list[RescaleOp]
) -> None:
    backend = make_backend(kind, request)
    try:
        asyncio.run(run_rescale_against_python(backend, family, ops))
    finally:
        if backend.inspect is not None:
            close_client(backend.inspect)


async def test_script_flushed_from_redis_is_loaded_again(redis_backend: Backend) -> None:
    """Scripts and function libraries flushed (a new master, a restart without persistence):
    NOSCRIPT or 'Function not found', the program loaded again, the call sent again."""
    limit = compiled("ns", FixedWindow(5, 60.0))
    store = redis_backend.make(FakeClock(T0_US))
    assert isinstance(store, RedisStore) and redis_backend.inspect is not None
    store.configure([limit], ())
    try:
        assert (await store.decide([Check(limit, "k")])).allowed
        recoveries = store.counters.recoveries
        redis_backend.inspect.script_flush()  # on every master of a cluster
        redis_backend.inspect.function_flush()
        assert (await store.decide([Check(limit, "k")])).decisions[0].remaining == 3
        assert store.counters.recoveries == recoveries + 1
    finally:
        await store.close()


def leased_compiled(name: str, spec_yaml: dict[str, Any]) -> CompiledLimit:
    spec = Policy.model_validate(
        {"limits": {name: {**spec_yaml, "key": ["global"], "lease": {}}}}
    ).limits[name]
    return CompiledLimit(
        name, spec, build_algorithm(spec), KeyBuilder(spec.key), None, None, 1.0, LimitCounters()
    )


def _script_calls(server: RedisServer) -> dict[str, int]:
    client = redis.Redis.from_url(server.url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {
        name.removeprefix("cmdstat_"): int(entry["calls"])
        for name, entry in stats.items()
        if name in ("cmdstat_fcall", "cmdstat_evalsha", "cmdstat_eval")
    }


async def test_decisions_are_function_calls_on_redis_7(redis_factory: RedisFactory) -> None:
    """On Redis 7 the thin client loads the algorithms once, as a function library, and each
    decision (and lease ask) is an FCALL: no EVALSHA re-running the whole script."""
    server = redis_factory.start()
    window = compiled("w", FixedWindow(5, 60.0))
    leased = leased_compiled("g", {"algorithm": "fixed_window", "limit": 1000, "window": "1s"})
    clock = FakeClock(T0_US)  # Redis TIME's minute could end between the two decisions
    store = RedisStore(server.url, key_prefix="fn:", clock=clock, time_source=clock)
    store.configure([window, leased], ())
    try:
        for remaining in (4, 3):
            verdict = await store.decide([Check(window, "k"), Check(leased, "g")])
            assert verdict.decisions[0].remaining == remaining
        assert set(_script_calls(server)) == {"fcall"}  # decisions and lease asks
    finally:
        await store.close()


async def test_a_redis_that_refuses_functions_gets_the_script(
    redis_factory: RedisFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """FUNCTION and FCALL renamed away (as a managed service may, or Redis 6 has neither):
    the same decisions by EVALSHA, said once in the log."""
    server = redis_factory.start(
        "--rename-command", "FUNCTION", "", "--rename-command", "FCALL", ""
    )
    limit = compiled("ns", FixedWindow(5, 60.0))
    clock = FakeClock(T0_US)  # Redis TIME's minute could end between the decisions
    store = RedisStore(server.url, key_prefix="nofn:", clock=clock, time_source=clock)
    store.configure([limit], ())
    caplog.set_level(logging.WARNING, "gateway.store")
    try:
        for remaining in (4, 3, 2):
            verdict = await store.decide([Check(limit, "k")])
            assert verdict.decisions[0].remaining == remaining
        refused = [r for r in caplog.records if "refused functions" in r.getMessage()]
        assert len(refused) == 1, caplog.text
        assert set(_script_calls(server)) == {"evalsha"}
    finally:
        await store.close()


async def test_cluster_keys_of_a_request_share_a_slot_and_clients_spread(
    redis_cluster: RedisClusterHarness,
) -> None:
    """Limits that all key on the client: each client's keys in one slot, clients spread over
    the three masters. A global limit stacked on them: every key has the same tag (one node)."""
    per_ip = compiled("per_ip", LeakyBucket(1, 60, 10, None))  # keys live a minute
    api = compiled("api", SlidingWindow(100, 60.0), key=("client_ip", "route"))
    prefix = f"spread{next(_prefixes)}:"
    store = RedisStore(redis_cluster.url, key_prefix=prefix)
    plain = redis.cluster.RedisCluster.from_url(f"redis://127.0.0.1:{redis_cluster.nodes[0].port}")
    try:
        store.configure([per_ip, api], ())
        for n in range(60):
            ip = f"10.1.{n // 250}.{n % 250}"
            checks = [Check(per_ip, ip), Check(api, f"{ip}\x1fapi")]
            assert (await store.decide(checks)).allowed
            slots = {plain.keyslot(store.redis_key(check)) for check in checks}
            assert len(slots) == 1
        added = redis_cluster.keys_per_node(prefix + "*")
        assert sum(added) == 120 and all(n > 0 for n in added)

        site = compiled("site", FixedWindow(10_000, 60.0), key=("global",))
        store.configure([per_ip, api, site], [per_ip, api])
        tags = set()
        for n in range(20):
            ip = f"10.2.0.{n}"
            checks = [Check(per_ip, ip), Check(api, f"{ip}\x1fapi"), Check(site, "")]
            assert (await store.decide(checks)).allowed
            tags |= {store.redis_key(check).partition("}")[0] for check in checks}
        assert len(tags) == 1
        assert store.counters.failed_calls == 0
    finally:
        close_client(plain)
        await store.close()


async def test_cluster_a_leased_global_limit_leaves_the_clients_spread(
    redis_cluster: RedisClusterHarness,
) -> None:
    """The global limit leased: it is not in the request's call, so the per-client keys keep the
    client as their tag and spread over the masters again (exact, the global limit put every
    key of every client on one node: the test above)."""
    per_ip = compiled("per_ip", LeakyBucket(1, 60, 10, None))
    api = compiled("api", SlidingWindow(100, 60.0), key=("client_ip", "route"))
    site = leased_compiled("site", {"algorithm": "fixed_window", "limit": 100_000, "window": "60s"})
    prefix = f"spreadlease{next(_prefixes)}:"
    store = RedisStore(redis_cluster.url, key_prefix=prefix)
    try:
        store.configure([per_ip, api, site], ())
        calls_before = store.counters.calls
        for n in range(60):
            ip = f"10.3.{n // 250}.{n % 250}"
            checks = [Check(per_ip, ip), Check(api, f"{ip}\x1fapi"), Check(site, "g")]
            assert (await store.decide(checks)).allowed
        added = redis_cluster.keys_per_node(prefix + "{10.3.*")
        assert sum(added) == 120 and all(n > 0 for n in added), added
        assert store.counters.calls - calls_before == 60  # one call per request, per client
        assert store.counters.failed_calls == 0
    finally:
        await store.close()


# --- when Redis fails -----------------------------------------------------------------------------


def fast_breaker() -> CircuitBreaker:
    return CircuitBreaker("test", failure_threshold=2, reset_timeout_s=0.2, max_reset_timeout_s=0.4)


@pytest.mark.reliability
async def test_stopped_redis_falls_back_to_local_limits_then_comes_back(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory.start()
    # Three replicas share 9 per window; alone, each enforces a third. Redis and the fallback
    # decide on a fake clock: on the real ones an hour could end between the request Redis
    # admitted and the fallback's, which would then start from an empty window.
    limit = compiled("shared", FixedWindow(9, 3600.0))
    clock = FakeClock(T0_US)
    store = RedisStore(
        server.url,
        replicas=3,
        timeout_s=0.05,
        clock=clock,
        time_source=clock,
        breaker=fast_breaker(),
    )
    store.configure([limit], ())
    loop = asyncio.get_running_loop()
    try:
        assert (await store.decide([Check(limit, "k")])).decisions[0].remaining == 8
        server.stop()
        started = loop.time()
        first = await store.decide([Check(limit, "k")])
        assert loop.time() - started < 0.5  # connection refused: no need to wait at all
        assert first.allowed and first.decisions[0].limit == 3  # 9 / 3 replicas
        # The share already holds the request this replica admitted through Redis.
        verdicts = [await store.decide([Check(limit, "k")]) for _ in range(4)]
        assert [v.allowed for v in verdicts] == [True, False, False, False]
        assert store.breaker.state == "open"
        # What the metrics read: the state, failed calls, and successful calls timed.
        assert store.stats.state == "open" and store.stats.errors == 2 and store.stats.calls == 1
        assert store.counters.local_decisions == 5
        failed = store.counters.failed_calls
        await store.decide([Check(limit, "k")])
        assert store.counters.failed_calls == failed  # open: Redis not even tried

        server.start(same_port=True)
        deadline = loop.time() + 5.0
        while loop.time() < deadline:
            verdict = await store.decide([Check(limit, "k")])
            if store.breaker.state == "closed":
                break
            await asyncio.sleep(0.05)
        assert store.breaker.state == "closed" and store.stats.state == "ok"
        # Back on Redis: a restarted, empty Redis, whose limit is 9 again.
        assert verdict.decisions[0].limit == 9
        assert store.breaker.transitions["open->half_open"] >= 1
        assert store.breaker.transitions["half_open->closed"] == 1
        # What gateway_store_state_transitions_total counts: the circuit's moves too, so an
        # outage between two scrapes shows (its state gauge was back to ok by then).
        assert store.stats.transitions["ok>fallback"] == 1
        assert store.stats.transitions["fallback>open"] == 1
        assert store.stats.transitions["open>half_open"] >= 1
        assert store.stats.transitions["half_open>ok"] == 1
    finally:
        await store.close()


@pytest.mark.reliability
@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_frozen_redis_costs_one_timeout_then_the_circuit_opens(
    redis_factory: RedisFactory, client: str
) -> None:
    """SIGSTOP: connections stay open and nothing answers. The first requests wait one timeout
    (not redis-py's default 5 s), the circuit opens, the rest do not wait at all."""
    server = redis_factory.start()
    limit = compiled("frozen", FixedWindow(100, 3600.0))
    # The scripts decide on a fake clock: on Redis TIME an hour could end during the outage,
    # and the last decision find a new window (99 left).
    store = RedisStore(
        server.url,
        timeout_s=0.05,
        client=client,  # type: ignore[arg-type]
        time_source=FakeClock(T0_US),
        breaker=fast_breaker(),
    )
    store.configure([limit], ())
    loop = asyncio.get_running_loop()
    try:
        assert (await store.decide([Check(limit, "k")])).allowed
        server.pause()
        started = loop.time()
        verdicts = await asyncio.gather(*[store.decide([Check(limit, "k")]) for _ in range(20)])
        assert loop.time() - started < 0.5
        assert all(v.allowed for v in verdicts)
        assert store.breaker.state == "open"
        failed, refused = store.counters.failed_calls, store.breaker.short_circuited
        await store.decide([Check(limit, "k")])
        # Open: Redis not even tried, so no timeout is waited for.
        assert store.counters.failed_calls == failed
        assert store.breaker.short_circuited == refused + 1
        server.resume()
        deadline = loop.time() + 5.0
        while store.breaker.state != "closed" and loop.time() < deadline:
            await store.decide([Check(limit, "k")])
            await asyncio.sleep(0.05)
        assert store.breaker.state == "closed"
        # The state written before the freeze is still there: Redis decides again.
        assert (await store.decide([Check(limit, "k")])).decisions[0].remaining < 99
    finally:
        server.resume()
        await store.close()


@pytest.mark.reliability
async def test_allow_mode_fails_open_and_deny_mode_fails_closed(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory.start()
    limit = compiled("modes", LeakyBucket(1, 60, 0, None))
    allow = RedisStore(server.url, on_failure="allow", breaker=fast_breaker())
    deny = RedisStore(server.url, on_failure="deny", breaker=fast_breaker())
    try:
        for store in (allow, deny):
            store.configure([limit], ())
        server.stop()
        for _ in range(5):
            verdict = await allow.decide([Check(limit, "k")])
            assert verdict.allowed and verdict.decisions[0].limit == 1
        assert allow.counters.allowed_open == 5
        for _ in range(3):
            with pytest.raises(StoreUnavailableError) as caught:
                await deny.decide([Check(limit, "k")])
            assert caught.value.retry_after_s > 0
        assert deny.counters.denied_closed == 3 and deny.breaker.state == "open"
        # Dry-run limits are never enforced: decided locally whatever the mode.
        (dry,) = await deny.decide_each([Check(limit, "k")])
        assert dry.allowed
        await deny.refund([Check(limit, "k")])  # never raises
    finally:
        await allow.close()
        await deny.close()


async def _call(store: RedisStore, call: str, check: Check) -> None:
    if call == "decide":
        await store.decide([check])
    elif call == "decide_each":
        await store.decide_each([check])
    else:
        await store.refund([check])


@pytest.mark.parametrize(
    ("call", "client"),
    [("decide", "thin"), ("decide", "redis-py"), ("decide_each", "thin"), ("refund", "thin")],
)
async def test_a_cancelled_probe_does_not_leave_the_circuit_half_open(
    redis_factory: RedisFactory, call: str, client: str
) -> None:
    """The gateway cancels a handler whose client hangs up. If that request was the half-open
    probe and nothing released it, the breaker would refuse every call from then on: the
    gateway would never use Redis again (and in deny mode answer 503 for ever)."""
    server = redis_factory.start()
    limit = compiled("probe", FixedWindow(100, 3600.0))
    # The breaker's own clock, moved by hand: the store's timer would probe first otherwise
    # (an open circuit probes on its own once due), and the request is to be the probe here.
    clock = FakeClock()
    breaker = CircuitBreaker(
        "test", failure_threshold=1, reset_timeout_s=0.1, max_reset_timeout_s=0.1, clock=clock
    )
    # The timeout is long enough that the probe is still waiting when it is cancelled. The
    # scripts decide on a fake clock too: on Redis TIME an hour could end during the outage,
    # and the last decision find a new window (99 left).
    store = RedisStore(
        server.url,
        timeout_s=1.0,
        client=client,  # type: ignore[arg-type]
        time_source=FakeClock(T0_US),
        breaker=breaker,
    )
    store.configure([limit], ())
    check = Check(limit, "k")
    loop = asyncio.get_running_loop()
    try:
        assert (await store.decide([check])).allowed
        server.pause()  # SIGSTOP: calls hang until their timeout
        await store.decide([check])
        assert breaker.state == "open"
        clock.advance(0.15)  # past the reset timeout: the next call is the probe
        probe = asyncio.create_task(_call(store, call, check))
        await asyncio.sleep(0.05)  # the probe is out, waiting on the frozen Redis
        assert breaker.state == "half_open" and not probe.done() and breaker.probes == 1
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        # Back to open, due at once (the store's timer may have sent the next probe since).
        assert breaker.transitions["half_open->open"] == 1
        server.resume()
        deadline = loop.time() + 3.0
        while breaker.state != "closed" and loop.time() < deadline:
            await store.decide([check])
            await asyncio.sleep(0.05)
            clock.advance(0.1)
        assert breaker.state == "closed" and store.stats.state == "ok"
        # Redis decides again: the count written before the freeze is still there.
        assert (await store.decide([check])).decisions[0].remaining < 99
    finally:
        server.resume()
        await store.close()


# --- configuration checks ---------------------------------------------------------------------


def test_store_urls_and_options_are_checked() -> None:
    assert parse_store_url("redis://h:1/2") == ("redis://h:1/2", False)
    assert parse_store_url("rediss+cluster://h:1") == ("rediss://h:1", True)
    with pytest.raises(ValueError, match="invalid store url 'memcached://h'"):
        parse_store_url("memcached://h")
    with pytest.raises(ValueError, match="on_failure must be local, allow or deny"):
        RedisStore("redis://127.0.0.1:1", on_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_prefix must not contain braces"):
        RedisStore("redis://127.0.0.1:1", key_prefix="{gw}")


@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_password_and_database_from_the_url(redis_factory: RedisFactory, client: str) -> None:
    server = redis_factory.start(
        "--requirepass", "s3cret", "--user", "gw", "on", ">pw", "~*", "+@all"
    )
    # A sliding log's key lives a whole window after its request (an epoch-aligned fixed
    # window's may have only milliseconds left, which TTL rounds to 0).
    limit = compiled("auth", SlidingLog(5, 60.0))
    for url in (
        f"redis://:s3cret@127.0.0.1:{server.port}/2",
        f"redis://gw:pw@127.0.0.1:{server.port}/2",
    ):
        store = RedisStore(url, client=client, key_prefix="auth:")  # type: ignore[arg-type]
        store.configure([limit], ())
        try:
            assert (await store.decide([Check(limit, "k")])).allowed
            assert store.counters.failed_calls == 0
        finally:
            await store.close()
    with redis.Redis(port=server.port, password="s3cret", db=2) as db2:
        key = db2.keys("auth:*")
        assert len(key) == 1 and 50_000 < db2.pttl(key[0]) <= 60_001
    wrong = RedisStore(f"redis://:nope@127.0.0.1:{server.port}", client=client)  # type: ignore[arg-type]
    wrong.configure([limit], ())
    try:
        assert (await wrong.decide([Check(limit, "k")])).allowed  # decided locally
        assert wrong.counters.failed_calls == 1 and wrong.counters.local_decisions == 1
    finally:
        await wrong.close()


async def test_tracked_keys_counts_the_local_fallback(redis_factory: RedisFactory) -> None:
    """tracked_keys reports keys held in this process (the fallback's, charged with what
    Redis admitted too); Redis keys expire on their own."""
    server = redis_factory.start()
    limit = compiled("tk", FixedWindow(5, 60.0))
    store = RedisStore(server.url, breaker=fast_breaker())
    store.configure([limit], ())
    try:
        await store.decide([Check(limit, "a")])
        assert store.tracked_keys("tk") == 1
        server.stop()
        await store.decide([Check(limit, "a")])
        await store.decide([Check(limit, "b")])
        assert store.tracked_keys("tk") == 2
    finally:
        await store.close()


# --- through the gateway: Redis stops under load ---------------------------------------------


@dataclass
class Served:
    started_s: float
    status: int
    latency_s: float


@dataclass
class LoadRun:
    served: list[Served]
    phase_started_s: list[float]  # when each phase's action had finished, from the load's start
    action_started_s: list[float]  # when each phase's action began


async def load_while(
    url: str, phases: list[tuple[float, Any]], workers: int = 8, max_requests: int = 200_000
) -> LoadRun:
    """Requests from ``workers`` clients until the last phase ends; each phase's action runs
    when the phase starts, and its duration counts from when the action is done (starting or
    killing a Redis takes a while on a loaded machine). Bounded in count by ``max_requests``,
    and in time by the phases plus 30 s for the actions. The count bound is a guard, far above
    what the phases take (a 503 while Redis is down comes back in tens of microseconds: 20,000
    were spent before the last phase on a quiet machine): reaching it fails the run."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    hard_end = t0 + sum(duration for duration, _ in phases) + 30.0
    phases_done = asyncio.Event()
    served: list[Served] = []
    phase_started_s: list[float] = []
    action_started_s: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not phases_done.is_set() and loop.time() < hard_end and len(served) < max_requests:
            started = loop.time()
            async with session.get(url) as response:
                await response.read()
            served.append(Served(started - t0, response.status, loop.time() - started))

    async def director() -> None:
        try:
            for duration, action in phases:
                action_started_s.append(loop.time() - t0)
                if action is not None:
                    await loop.run_in_executor(None, action)
                phase_started_s.append(loop.time() - t0)
                await asyncio.sleep(duration)
        finally:
            phases_done.set()

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(director(), *[client(session) for _ in range(workers)])
    assert len(served) < max_requests, f"the load stopped at {len(served)} requests, not its end"
    return LoadRun(served, phase_started_s, action_started_s)


LOAD_LIMITS = """\
limits:
  per_ip:
    algorithm: leaky_bucket
    rate: 100000r/s
    burst: 100000
    nodelay: true
  global:
    algorithm: token_bucket
    rate: 100000r/s
    burst: 100000
    key: [global]
"""


@pytest.mark.reliability
@pytest.mark.parametrize("on_failure", ["local", "allow", "deny"])
async def test_redis_stopped_under_load_no_5xx_fallback_then_back(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    on_failure: str,
) -> None:
    """Redis killed (SIGKILL) under load from 8 clients, then restarted: no 5xx but deny's
    503 while it is down, no request held long, back on Redis once it answers."""
    server = redis_factory.start()
    store = RedisStore(
        server.url,
        on_failure=on_failure,  # type: ignore[arg-type]
        # A killed Redis refuses connections at once: the call deadline plays no part here
        # (a frozen one is tested above). 50 ms of it timed out now and then on a loaded
        # 2-core machine after Redis was back, and each timeout counts as a failure.
        timeout_s=0.25,
        key_prefix=f"load{next(_prefixes)}:",
        breaker=fast_breaker(),
    )
    gw = await start_gateway(policy_for(upstream.url, LOAD_LIMITS), store=store)
    run = await load_while(
        gw.url + "/",
        [(0.7, None), (1.5, server.stop), (2.5, lambda: server.start(same_port=True))],
    )
    served = run.served
    down = 503 if on_failure == "deny" else 200
    statuses = {s.status for s in served}
    assert statuses <= {200, down}, statuses  # these limits reject nothing
    # From Redis killed (the kill done) to the restart begun: starting takes a while on a loaded
    # machine, and Redis answers (a probe may close the circuit) before the start returns.
    _, killed_s, restarted_s = run.phase_started_s
    restarting_s = run.action_started_s[2]
    outage = [s for s in served if killed_s + 0.05 < s.started_s < restarting_s - 0.05]
    assert outage and {s.status for s in outage} == {down}
    # No request waits long on a dead Redis (redis-py's defaults would hold it 5 s and more).
    assert max(s.latency_s for s in outage) < 1.0
    recovered = [s for s in served if s.started_s > restarted_s + 1.5]
    assert recovered and sum(s.status == 200 for s in recovered) >= 0.9 * len(recovered)
    print(
        f"\nRedis killed under load, on_failure {on_failure}: {len(served)} requests, "
        f"{len(outage)} while down (slowest {max(s.latency_s for s in outage) * 1000:.0f} ms), "
        f"statuses {sorted(statuses)}"
    )
    assert store.breaker.transitions["closed->open"] >= 1
    assert store.breaker.transitions["half_open->closed"] >= 1  # back on Redis
    answered_without_redis = {
        "local": store.counters.local_decisions,
        "allow": store.counters.allowed_open,
        "deny": store.counters.denied_closed,
    }[on_failure]
    assert answered_without_redis >= len(outage) // 2
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # a circuit a late slow call opened probes again within 0.4 s
            calls_before = store.counters.calls
            async with session.get(gw.url + "/") as response:
                status = response.status
            if store.breaker.state == "closed" and store.counters.calls == calls_before + 1:
                break
            await asyncio.sleep(0.05)
    assert status == 200 and store.breaker.state == "closed"


@pytest.mark.reliability
async def test_deny_mode_answers_503_while_redis_is_down(
    redis_factory: RedisFactory, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    server = redis_factory.start()
    store = RedisStore(server.url, on_failure="deny", timeout_s=0.05, breaker=fast_breaker())
    gw = await start_gateway(policy_for(upstream.url, LOAD_LIMITS), store=store)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/") as response:
            assert response.status == 200
        server.stop()
        for _ in range(5):
            async with session.get(gw.url + "/") as response:
                assert response.status == 503
        # The admin explanation says the same, and does not fail itself.
        async with session.get(gw.admin_url + "/explain", params={"path": "/"}) as response:
            assert response.status == 200
            explained = await response.json()
        verdicts = [x["next_request"] for x in explained["limits"] if x["applies"]]
        assert verdicts and all(v["allowed"] is False and v["status"] == 503 for v in verdicts)
        assert all("unavailable" in v["reason"] for v in verdicts)
        server.start(same_port=True)
        statuses = []
        for _ in range(50):  # the breaker probes again within its reset timeout
            async with session.get(gw.url + "/") as response:
                statuses.append(response.status)
            if statuses[-1] == 200:
                break
            await asyncio.sleep(0.05)
        assert statuses[-1] == 200


async def store_state(session: aiohttp.ClientSession, admin_url: str) -> str:
    """The one state ``gateway_store_state`` counts this (single-worker) gateway in."""
    samples, _ = await scrape(session, admin_url)
    states = [
        dict(labels)["state"]
        for (name, labels), count in samples.items()
        if name == "gateway_store_state" and dict(labels)["store"] == "redis" and count == 1
    ]
    assert len(states) == 1, states
    return states[0]


@pytest.mark.reliability
@pytest.mark.parametrize("on_failure", ["local", "allow", "deny"])
async def test_metrics_and_log_follow_the_store_from_fallback_to_open_and_back_to_ok(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    on_failure: str,
) -> None:
    """/metrics says what answers: ``fallback`` after a failed call (the circuit still closed),
    then the circuit's ``open``, then ``ok`` once Redis answers. One log line per change of
    state, however many requests pass meanwhile."""
    caplog.set_level(logging.INFO, logger="gateway.store")
    caplog.set_level(logging.INFO, logger="gateway.circuit")
    server = redis_factory.start()
    breaker = CircuitBreaker(
        "redis store", failure_threshold=3, reset_timeout_s=0.2, max_reset_timeout_s=0.4
    )
    store = RedisStore(
        server.url,
        on_failure=on_failure,  # type: ignore[arg-type]
        timeout_s=0.05,
        key_prefix=f"state{next(_prefixes)}:",
        breaker=breaker,
    )
    gw = await start_gateway(policy_for(upstream.url, LOAD_LIMITS), store=store)
    down = 503 if on_failure == "deny" else 200
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def get() -> int:
            async with session.get(gw.url + "/") as response:
                await response.read()
                return response.status

        async def until_ok() -> None:
            for _ in range(60):  # the breaker probes again within its reset timeout
                if await get() == 200 and await store_state(session, gw.admin_url) == "ok":
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the store did not return to Redis")

        assert await get() == 200
        assert await store_state(session, gw.admin_url) == "ok"
        # A blip below the breaker's threshold: on_failure answers, the circuit stays closed.
        server.stop()
        assert [await get() for _ in range(2)] == [down, down]
        assert await store_state(session, gw.admin_url) == "fallback"
        assert breaker.state == "closed"
        server.start(same_port=True)
        await until_ok()
        assert breaker.state == "closed"
        # An outage: the third failure in a row opens the circuit.
        server.stop()
        assert [await get() for _ in range(2)] == [down, down]
        assert await store_state(session, gw.admin_url) == "fallback"
        assert await get() == down
        assert await store_state(session, gw.admin_url) == "open"
        assert [await get() for _ in range(5)] == [down] * 5
        server.start(same_port=True)
        await until_ok()
    # The transitions only: on a busy machine the store's prepare step (its script loaded
    # before the first request, within the 50 ms call timeout) may time out and say so in a
    # line of its own, which changes nothing the store reports.
    store_lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.store" and r.getMessage().startswith("store state ")
    ]
    assert len(store_lines) == 3, store_lines
    assert store_lines[0].startswith("store state ok -> fallback: ")
    assert store_lines[0].endswith(f"(on_failure: {on_failure})")
    assert store_lines[1] == "store state fallback -> ok: Redis answered"
    assert store_lines[2].startswith("store state ok -> fallback: ")
    # The circuit's own moves are logged once each by the breaker, and not again by the store.
    circuit_lines = [r.getMessage() for r in caplog.records if r.name == "gateway.circuit"]
    assert len(circuit_lines) == sum(breaker.transitions.values())
    assert circuit_lines[0].startswith("redis store circuit closed->open (3 failures in a row")
    assert circuit_lines[-1] == "redis store circuit half_open->closed (probe succeeded)"


@pytest.mark.reliability
@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_an_idle_gateway_closes_the_circuit_once_redis_is_back(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    client: str,
) -> None:
    """An open circuit probes on a timer when its probe is due, not when a request comes: with
    Redis restarted and no request at all, the store's state in /metrics is ``ok`` again
    within a few probe intervals (the probe: an idle gateway showed ``open`` 16 s after "next
    probe in 1 s")."""
    server = redis_factory.start()
    breaker = CircuitBreaker(
        "redis store", failure_threshold=2, reset_timeout_s=0.2, max_reset_timeout_s=0.4
    )
    store = RedisStore(
        server.url,
        client=client,  # type: ignore[arg-type]
        timeout_s=0.05,
        key_prefix=f"idle{next(_prefixes)}:",
        breaker=breaker,
    )
    gw = await start_gateway(policy_for(upstream.url, LOAD_LIMITS), store=store)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(gw.url + "/") as response:
            assert response.status == 200
        server.stop()
        for _ in range(2):  # the threshold: the circuit opens
            async with session.get(gw.url + "/") as response:
                assert response.status == 200  # on_failure: local
        # Open, or half open while a timer's probe is in flight (a scrape can land between the
        # probe's start and its refused connect, more often on a busy machine): not ok.
        down = ("open", "half_open")
        assert await store_state(session, gw.admin_url) in down
        requests = len(upstream.requests)
        # Idle while down: the timer's probes fail and keep it open (the admin listener's
        # scrapes are no requests to the store).
        await wait_until(lambda: breaker.probes >= 2, "two probes on the timer")
        assert await store_state(session, gw.admin_url) in down
        server.start(same_port=True)
        started = loop.time()
        state = "open"
        # Bounded: probes every 0.4 s at most, each within the 50 ms call timeout, which a busy
        # machine can miss a few times in a row (without probes on the timer: never ok).
        while loop.time() - started < 15.0:
            state = await store_state(session, gw.admin_url)
            if state == "ok":
                break
            await asyncio.sleep(0.05)
        back_after_s = loop.time() - started
        assert len(upstream.requests) == requests  # no request came meanwhile
    print(f"\n[{client}] idle gateway: the store ok {back_after_s:.2f} s after Redis restarted")
    assert state == "ok" and breaker.state == "closed"


async def test_local_fallback_evictions_reach_the_metrics(
    redis_factory: RedisFactory, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """With Redis down the local fallback's tables are bounded by ``max_keys`` as the memory
    store's are: the keys they evict are counted in /metrics the same way."""
    server = redis_factory.start()
    store = RedisStore(server.url, timeout_s=0.05, breaker=fast_breaker())
    limits = (
        "limits:\n  per_key:\n    algorithm: fixed_window\n    limit: 100\n    window: 1h\n"
        "    key: ['header:X-Key']\n    max_keys: 2\n"
    )
    gw = await start_gateway(policy_for(upstream.url, limits), store=store)
    server.stop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for index in range(6):
            async with session.get(gw.url + "/", headers={"X-Key": f"k{index}"}) as response:
                assert response.status == 200
        samples, _ = await scrape(session, gw.admin_url)
    evicted = samples[("gateway_limit_evictions_total", frozenset({("limit", "per_key")}))]
    assert store.counters.local_decisions == 6
    assert evicted >= 1
    assert evicted == store.evictions("per_key")

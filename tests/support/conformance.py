"""The store conformance harness: every store (in process, Redis on one server and on a
cluster, with its own client and with redis-py's pipelines, the shared LMDB store) driven
through the same operations under a fake clock, each decision and each stored state compared
with the pure Python algorithms computing the same requests at the same instants.

The fixtures ``backend`` and ``redis_backend`` need ``redis_server`` and ``redis_cluster`` from
``redis_harness`` in the requesting test module.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from hypothesis import strategies as st

from gateway.algorithms.base import Algorithm
from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.combine import CombinedDecision, decide_all, refuse_long_delays
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket, WarmingUpTokenBucket
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import LeakyBucketLimit
from gateway.stores import LimitStore, MemoryStore, RedisStore
from gateway.stores.redis.codecs import codec_for
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support import redis_harness
from tests.support.redis_harness import RedisClusterHarness, RedisServer

# An epoch-sized start, like Redis TIME: the Lua arithmetic must stay exact at this magnitude.
T0_US = 1_763_000_000_000_000

STORE_KINDS = ("memory", "redis", "redis-py", "cluster")
_prefixes = redis_harness.key_prefixes()  # unique in the session: see key_prefixes


def compiled(
    name: str, algorithm: Algorithm[Any], key: tuple[str, ...] = ("client_ip",)
) -> CompiledLimit:
    """A limit as the engine compiles it. The stores read only the name, the algorithm and the
    spec's key parts and ``max_keys``, so one stand-in spec serves every algorithm."""
    spec = LeakyBucketLimit(algorithm="leaky_bucket", rate="1r/s", key=key)
    return CompiledLimit(name, spec, algorithm, KeyBuilder(key), None, None, 1.0, LimitCounters())


@dataclass
class Backend:
    """One kind of store, and (for Redis) a plain client to look at what it wrote."""

    kind: str
    url: str | None
    inspect: redis.Redis | redis.cluster.RedisCluster | None

    def make(self, fake_clock: FakeClock | None = None, **options: Any) -> LimitStore:
        """A new store; for Redis, on keys of its own, reading ``fake_clock`` instead of TIME."""
        if self.kind == "memory":
            return MemoryStore(fake_clock)
        assert self.url is not None
        options.setdefault("key_prefix", f"t{next(_prefixes)}:")
        # Tests of behaviour, not of timeouts: a busy shared machine must not turn them into
        # fallback decisions (the failure tests set their own).
        options.setdefault("timeout_s", 2.0)
        options.setdefault("client", "redis-py" if self.kind == "redis-py" else "thin")
        options.setdefault("time_source", fake_clock)
        return RedisStore(self.url, **options)

    def raw_state(self, store: LimitStore, check: Check) -> bytes | None:
        assert isinstance(store, RedisStore) and self.inspect is not None
        raw: bytes | None = self.inspect.get(store.redis_key(check))
        return raw


def close_client(client: redis.Redis | redis.cluster.RedisCluster) -> None:
    """Close a plain client. ``RedisCluster.close`` leaves its nodes' pooled sockets open (each
    node's ``Redis`` does not own the pool it was given), and a socket the garbage collector
    finds later fails the run with a ResourceWarning; so disconnect those pools too."""
    if isinstance(client, redis.cluster.RedisCluster):
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
    client.close()


def make_backend(kind: str, request: pytest.FixtureRequest) -> Backend:
    if kind == "memory":
        return Backend(kind, None, None)
    if kind == "cluster":
        cluster: RedisClusterHarness = request.getfixturevalue("redis_cluster")
        plain = f"redis://127.0.0.1:{cluster.nodes[0].port}"
        return Backend(kind, cluster.url, redis.cluster.RedisCluster.from_url(plain))
    server: RedisServer = request.getfixturevalue("redis_server")
    return Backend(kind, server.url, redis.Redis.from_url(server.url))


@pytest.fixture(params=STORE_KINDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    made = make_backend(request.param, request)
    yield made
    if made.inspect is not None:
        close_client(made.inspect)


@pytest.fixture(params=[k for k in STORE_KINDS if k != "memory"])
def redis_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    made = make_backend(request.param, request)
    yield made
    if made.inspect is not None:
        close_client(made.inspect)


def verdict_of(verdict: CombinedDecision) -> CombinedDecision:
    """A verdict without the states (the Redis store keeps those in Redis) or the instant a
    store may note for a later refund."""
    return verdict.replace(states=(), now_us=None)


# --- the same decisions as the Python algorithms ---------------------------------------------

ALGORITHMS: dict[str, Any] = {
    "leaky nodelay": lambda: LeakyBucket(5, 1, 3, None),
    "leaky delay=2": lambda: LeakyBucket(10, 1, 6, 2),
    "leaky shaping r/m": lambda: LeakyBucket(7, 60, 4, 0),
    "leaky burst 0": lambda: LeakyBucket(3, 1, 0, 0),
    "fixed window": lambda: FixedWindow(4, 1.0),
    "fixed window 0.25s": lambda: FixedWindow(3, 0.25),
    "sliding window": lambda: SlidingWindow(5, 1.0),
    "sliding window 7/0.3s": lambda: SlidingWindow(7, 0.3),
    "sliding log": lambda: SlidingLog(4, 1.0),
    "sliding log 2/0.2s": lambda: SlidingLog(2, 0.2),
    # 7r/s and 999r/s: several ticks per microsecond, whose absolute count passes 2**53.
    "token bucket": lambda: TokenBucket(7, 1, 3),
    "token bucket queue": lambda: TokenBucket(999, 1, 5, mode="queue", max_delay_s=0.01),
    "token bucket queue r/m": lambda: TokenBucket(30, 60, 2, mode="queue"),
    "warm-up": lambda: WarmingUpTokenBucket(5, 1, 2.0),
    "warm-up queue": lambda: WarmingUpTokenBucket(7, 1, 1.5, mode="queue", max_delay_s=0.5),
    # Its periods are read off the calendar by the store (at T0, not near a period's end:
    # tests/test_calendar_stores.py crosses those).
    "calendar day": lambda: CalendarWindow(4, "1d", "Europe/Berlin"),
}

steps_us = st.one_of(
    st.just(0),
    st.integers(0, 3_000),
    st.integers(0, 400_000),
    st.integers(0, 5_000_000),
    st.integers(-100_000, 0),  # the clock steps back a little
    st.just(-61_000_000),  # and far: nginx treats more than 60 s back as 1 ms forward
)
# The longest a request may wait on each of its limits (0: the limit's queue is full).
delay_bounds = st.sampled_from([math.inf, math.inf, 0.0, 0.05, 0.3, 2.0])
operations = st.lists(
    st.tuples(
        steps_us,
        st.sampled_from(["decide", "decide", "decide", "peek", "refund", "refund_exact"]),
        st.sampled_from(["a", "b"]),
        delay_bounds,
    ),
    min_size=1,
    max_size=40,
)
stacks = st.lists(st.sampled_from(sorted(ALGORITHMS)), min_size=1, max_size=3, unique=True)


Op = tuple[int, str, str, float]  # clock step (us), operation, key, delay bound (s)


def refunded(algorithm: Algorithm[Any], state: Any, now_us: int, charged_us: int | None) -> Any:
    """What the Python algorithm gives back, as the stores call it."""
    return algorithm.refund(state, now_us, charged_us=charged_us)


async def run_against_python(
    backend: Backend,
    stack: list[str],
    ops: list[Op],
    *,
    algorithms: dict[str, Any] = ALGORITHMS,
    start_us: int = T0_US,
    seeds: dict[str, list[tuple[bytes, Any]]] | None = None,
) -> None:
    """Apply ``ops`` to a store and to the pure algorithms (combined by ``decide_all``, a delay
    over its bound refused by ``refuse_long_delays``); every verdict, and for Redis every
    stored state, must be the same. ``seeds`` (Redis only) starts keys in given states: per
    key, one ``(stored state, Python state)`` per limit of the stack."""
    if backend.kind == "memory":
        # It drops idle keys, which no request can tell from kept ones while time goes forward
        # (its clock is monotonic). Under a test clock Redis keeps every key 10 minutes, so
        # for Redis the clock also steps back.
        ops = [(max(step_us, 0), op, key, bound) for step_us, op, key, bound in ops]
    clock = FakeClock(start_us)
    limits = [compiled(f"l{i}", algorithms[name]()) for i, name in enumerate(stack)]
    store = backend.make(clock)
    store.configure(limits, ())
    reference: dict[tuple[int, str], Any] = {}
    for key, states in (seeds or {}).items():
        assert isinstance(store, RedisStore) and backend.inspect is not None
        for i, (stored, state) in enumerate(states):
            check = Check(limits[i], key)
            params = store.plan(limits[i]).codec.params
            backend.inspect.set(store.redis_key(check), params + stored, px=10**11)
            reference[(i, key)] = state
    # The instant each key was last charged: what a refund after a client left would pass.
    charged_at: dict[str, int] = {}
    try:
        for step_us, op, key, bound in ops:
            clock.advance(us=step_us)
            now_us = clock.now_us()
            checks = [Check(limit, key, bound) for limit in limits]
            if op in ("refund", "refund_exact"):
                charged_us = charged_at.get(key) if op == "refund_exact" else None
                await store.refund(checks, charged_us)
                for i, limit in enumerate(limits):
                    state = reference.get((i, key))
                    if state is not None:
                        reference[(i, key)] = refunded(limit.algorithm, state, now_us, charged_us)
            else:
                got = await store.decide(checks, commit=op == "decide")
                items = [
                    (limit.algorithm, reference.get((i, key))) for i, limit in enumerate(limits)
                ]
                want = decide_all(items, now_us)
                if want.delay_s > 0.0:
                    want = refuse_long_delays(
                        want, [state for _, state in items], [bound] * len(items)
                    )
                assert verdict_of(got) == verdict_of(want), (op, now_us - start_us)
                if want.allowed and want.delay_s > 0.0:
                    # A delayed verdict carries the instant it was decided at, for a refund.
                    assert got.now_us == now_us
                if op == "decide" and want.allowed:
                    charged_at[key] = now_us
                    for i, state in enumerate(want.states):
                        reference[(i, key)] = state
            if isinstance(store, RedisStore):
                for i, check in enumerate(checks):
                    raw = backend.raw_state(store, check)
                    state = reference.get((i, key))
                    if raw is None:
                        assert state is None
                    else:
                        assert store.plan(check.limit).codec.decode_state(raw) == state
        if isinstance(store, RedisStore):
            assert store.counters.local_decisions == 0 and store.counters.failed_calls == 0
    finally:
        await store.close()


# Parameter sets of one algorithm a reload may move between; the last of the leaky buckets and
# of the token buckets multiply past 2**53 when rescaled (the script's exact muldiv).
VARIANTS: dict[str, list[Any]] = {
    "leaky": [
        lambda: LeakyBucket(5, 1, 3, None),
        lambda: LeakyBucket(10, 1, 6, 2),
        lambda: LeakyBucket(7, 60, 4, 0),
        lambda: LeakyBucket(3, 1, 0, 0),
        lambda: LeakyBucket(100_000, 1, 200_000, None),
    ],
    "fixed": [
        lambda: FixedWindow(4, 1.0),
        lambda: FixedWindow(3, 0.25),
        lambda: FixedWindow(10, 1.0),
    ],
    "sliding": [
        lambda: SlidingWindow(5, 1.0),
        lambda: SlidingWindow(7, 0.3),
        lambda: SlidingWindow(2, 1.0),
        lambda: SlidingWindow(5, 0.5),
    ],
    "log": [
        lambda: SlidingLog(4, 1.0),
        lambda: SlidingLog(2, 0.2),
        lambda: SlidingLog(9, 1.0),
    ],
    "token": [
        lambda: TokenBucket(7, 1, 3),
        lambda: TokenBucket(999, 1, 5, mode="queue", max_delay_s=0.01),
        lambda: TokenBucket(30, 60, 2, mode="queue"),
        lambda: TokenBucket(1, 60, 100),
    ],
    "calendar": [
        lambda: CalendarWindow(4, "1d", "Europe/Berlin"),
        lambda: CalendarWindow(9, "1d", "Europe/Berlin"),
        lambda: CalendarWindow(4, "1d"),
        lambda: CalendarWindow(4, "1w", "Europe/Berlin"),
    ],
    "warm-up": [
        lambda: WarmingUpTokenBucket(5, 1, 2.0),
        lambda: WarmingUpTokenBucket(7, 1, 1.5, mode="queue", max_delay_s=0.5),
        lambda: WarmingUpTokenBucket(1, 60, 3000.0),
    ],
}

RescaleOp = tuple[int, str, int, str, int]  # step (us), operation, replica, key, variant

rescale_operations = st.lists(
    st.tuples(
        steps_us,
        st.sampled_from(["decide", "decide", "decide", "peek", "refund", "refund_exact", "reload"]),
        st.integers(0, 1),
        st.sampled_from(["a", "b"]),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=40,
)


async def run_rescale_against_python(
    backend: Backend,
    family: str,
    ops: list[RescaleOp],
    *,
    table: dict[str, list[Any]] = VARIANTS,
    start_us: int = T0_US,
) -> None:
    """Two replicas share one limit in Redis and reload it at different moments. A state
    written under other parameters is rescaled when a replica next touches it, as the Python
    algorithm's ``rescale`` does at that instant (and stays rescaled, even if the request is
    rejected); every verdict and every stored value (parameters, then state) must agree."""
    variants = table[family]
    clock = FakeClock(start_us)
    prefix = f"rescale{next(_prefixes)}:"
    stores = [backend.make(clock, key_prefix=prefix) for _ in range(2)]
    limits = [compiled("lim", variants[0]()) for _ in stores]
    for store, limit in zip(stores, limits, strict=True):
        store.configure([limit], ())
    # key -> (the algorithm the state was written under, the state)
    reference: dict[str, tuple[Algorithm[Any], Any]] = {}
    charged_at: dict[str, int] = {}
    try:
        for step_us, op, replica, key, variant in ops:
            clock.advance(us=step_us)
            now_us = clock.now_us()
            store = stores[replica]
            if op == "reload":
                new = compiled("lim", variants[variant % len(variants)]())
                store.configure([new], [limits[replica]])
                limits[replica] = new
                continue
            limit = limits[replica]
            algorithm = limit.algorithm
            check = Check(limit, key)
            written = reference.get(key)
            state = None
            if written is not None:
                state = written[1]
                if codec_for(written[0]).params != codec_for(algorithm).params:
                    state = algorithm.rescale(state, written[0], now_us)
            if op in ("refund", "refund_exact"):
                charged_us = charged_at.get(key) if op == "refund_exact" else None
                await store.refund([check], charged_us)
                if state is not None:
                    state = refunded(algorithm, state, now_us, charged_us)
                after = state
            else:
                got = await store.decide([check], commit=op == "decide")
                want = decide_all([(algorithm, state)], now_us)
                assert verdict_of(got) == verdict_of(want), (op, now_us - T0_US)
                after = state
                if op == "decide" and want.allowed:
                    after = want.states[0]
                    charged_at[key] = now_us
            # A rejection charges nothing, but a rescaled state is written back: either way
            # the key now holds `after` under this replica's parameters.
            if op != "peek":
                if after is None:
                    reference.pop(key, None)
                else:
                    reference[key] = (algorithm, after)
            raw = backend.raw_state(store, check)
            expected = reference.get(key)
            if expected is None:
                assert raw is None, (op, now_us - T0_US)
            else:
                codec = codec_for(expected[0])
                assert raw is not None and raw.startswith(codec.params), (op, now_us - T0_US)
                assert codec.decode_state(raw) == expected[1], (op, now_us - T0_US)
        for store in stores:
            assert isinstance(store, RedisStore) and store.counters.failed_calls == 0
    finally:
        for store in stores:
            await store.close()


async def burst(store: RedisStore, check: Check, requests: int, clients: int = 8) -> int:
    """``requests`` decisions from ``clients`` concurrent clients; how many were admitted."""
    admitted = 0

    async def client(count: int) -> None:
        nonlocal admitted
        for _ in range(count):
            verdict = await store.decide([check])  # awaited before `admitted` is read
            admitted += verdict.allowed

    shares = [requests // clients + (i < requests % clients) for i in range(clients)]
    async with asyncio.timeout(20):
        await asyncio.gather(*(client(share) for share in shares))
    return admitted


_gateway_prefixes = itertools.count()


def gateway_store_of(
    kind: str, request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path, name: str
) -> dict[str, Any]:
    """A gateway's store of ``kind`` (memory, shared, redis, cluster) on ``clock``, as keyword
    arguments for ``start_gateway`` (Redis: the clock stands in for TIME; keys under a prefix of
    their own, ``name`` first)."""
    if kind == "memory":
        return {}
    if kind == "shared":
        return {"store": SharedStore(tmp_path / "shared", clock)}
    if kind == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
    prefix = f"{name}{next(_gateway_prefixes)}-{time.monotonic_ns()}:"
    store = RedisStore(url, clock=clock, time_source=clock, key_prefix=prefix, timeout_s=2.0)
    return {"store": store}

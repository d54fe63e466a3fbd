"""The local fallback at each switch (issue 17, item 6): a real Redis frozen (SIGSTOP) and
resumed under bounded load, with one replica. Entering the outage, the fallback's state
already holds what this replica admitted through Redis; leaving it, Redis is charged with what
the fallback admitted before it decides again. Across the outage a quota is admitted once,
not once per side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import FakeClock
from gateway.limits.compiled import Check
from gateway.stores import RedisStore
from gateway.stores.redis.circuit import CircuitBreaker
from gateway.stores.redis.fallback import CARRY_BACK_BATCH, Owed, carry_back
from tests.support import redis_harness
from tests.support.conformance import burst, compiled
from tests.support.redis_harness import RedisFactory

redis_factory = redis_harness.redis_factory

QUOTA = 40
MONTH_S = 30 * 86_400.0
# Long windows and slow refills: nothing comes back during the test, so the quota is exact.
ALGORITHMS: dict[str, Callable[[], Any]] = {
    "fixed_window": lambda: FixedWindow(QUOTA, MONTH_S),
    "sliding_window": lambda: SlidingWindow(QUOTA, MONTH_S),
    "sliding_log": lambda: SlidingLog(QUOTA, MONTH_S),
    "token_bucket": lambda: TokenBucket(QUOTA, MONTH_S, QUOTA),
}
CLIENTS = 8


def breaker() -> CircuitBreaker:
    return CircuitBreaker("test", failure_threshold=2, reset_timeout_s=0.2, max_reset_timeout_s=0.4)


@pytest.mark.reliability
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
async def test_a_quota_is_admitted_once_across_an_outage(
    redis_factory: RedisFactory, name: str
) -> None:
    server = redis_factory.start()
    limit = compiled("switch", ALGORITHMS[name]())
    store = RedisStore(server.url, timeout_s=0.05, breaker=breaker())
    store.configure([limit], ())
    check = Check(limit, "k")
    loop = asyncio.get_running_loop()
    try:
        before = await burst(store, check, QUOTA // 2)
        assert before == QUOTA // 2 and store.counters.local_decisions == 0

        server.pause()
        # A timeout or two, then the open circuit: all decided here. The fallback has room
        # for the other half only (it started empty: a whole quota).
        during = await burst(store, check, 3 * QUOTA)
        assert store.breaker.state == "open" and store.counters.local_decisions >= 3 * QUOTA
        assert during == QUOTA - before, (before, during)

        server.resume()
        after = 0
        deadline = loop.time() + 10.0
        while store.breaker.state != "closed" and loop.time() < deadline:
            after += await burst(store, check, CLIENTS)
            await asyncio.sleep(0.05)
        assert store.breaker.state == "closed"
        # Redis was charged with what the fallback admitted before it decided again (it once
        # admitted a second half on top).
        after += await burst(store, check, 3 * QUOTA)
        assert after == 0, (before, during, after)
        assert store.counters.carried_back == during
        assert not store.owed
    finally:
        server.resume()
        await store.close()


@pytest.mark.parametrize("name", [*sorted(ALGORITHMS), "leaky_bucket"])
async def test_a_carried_back_charge_fills_a_limit_at_most(
    redis_factory: RedisFactory, name: str
) -> None:
    """Charged back: the whole count when it fits, else as much as fits (the limit full)."""
    server = redis_factory.start()
    make = ALGORITHMS.get(name) or (lambda: LeakyBucket(1, 60, QUOTA - 1, None))
    limit = compiled("charge", make())
    store = RedisStore(server.url, timeout_s=2.0)
    store.configure([limit], ())
    try:
        store.owed.add([Check(limit, "fits")], QUOTA - 3)
        first = await store.decide([Check(limit, "fits")])
        assert store.counters.carried_back == QUOTA - 3 and not store.owed
        assert first.allowed and first.decisions[0].remaining == 2
        store.owed.add([Check(limit, "fits")], 10 * QUOTA)
        assert not (await store.decide([Check(limit, "fits")])).allowed
        # An untouched key, charged past its limit at once, is full, not left empty.
        store.owed.add([Check(limit, "over")], QUOTA + 1)
        assert not (await store.decide([Check(limit, "over")])).allowed
    finally:
        await store.close()


async def test_a_failed_carry_back_keeps_owing_what_it_did_not_charge() -> None:
    """Three batches owed; a call of the second fails: its units and the whole third batch
    are owed again, the charged ones are not, and the failure is raised."""
    limit = compiled("owed", FixedWindow(QUOTA, MONTH_S))
    owed = Owed()
    keys = [f"k{index}" for index in range(2 * CARRY_BACK_BATCH + 5)]
    for units, key in enumerate(keys, start=1):
        owed.add([Check(limit, key)], units)
    charged: dict[str, int] = {}
    failing = keys[CARRY_BACK_BATCH + 3]

    async def charge(check: Check, units: int) -> None:
        await asyncio.sleep(0)
        if check.key == failing:
            raise ConnectionError("Redis went away")
        charged[check.key] = units

    with pytest.raises(ConnectionError):
        await carry_back(owed, charge)
    again = {check.key: units for check, units in owed.take()}
    assert set(charged) == set(keys[: 2 * CARRY_BACK_BATCH]) - {failing}
    assert again == {key: units for units, key in enumerate(keys, start=1) if key not in charged}
    assert all(charged[key] == keys.index(key) + 1 for key in charged)


async def test_a_cancelled_carry_back_owes_all_it_had_not_finished() -> None:
    """Cancelled in its second batch: that batch and the third are owed again (whether or not
    their calls reached Redis: never under), the first batch, charged, is not."""
    limit = compiled("owed", FixedWindow(QUOTA, MONTH_S))
    owed = Owed()
    keys = [f"k{index}" for index in range(2 * CARRY_BACK_BATCH + 5)]
    for key in keys:
        owed.add([Check(limit, key)])
    charged: list[str] = []
    second_batch = asyncio.Event()

    async def charge(check: Check, units: int) -> None:
        if len(charged) >= CARRY_BACK_BATCH:
            second_batch.set()
            await asyncio.Event().wait()  # a call that never answers
        await asyncio.sleep(0)
        charged.append(check.key)

    task = asyncio.ensure_future(carry_back(owed, charge))
    await asyncio.wait_for(second_batch.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert charged == keys[:CARRY_BACK_BATCH]
    assert sorted(check.key for check, _ in owed.take()) == sorted(keys[CARRY_BACK_BATCH:])


def test_what_is_owed_is_bounded_in_keys() -> None:
    limit = compiled("owed", FixedWindow(QUOTA, MONTH_S))
    owed = Owed(max_keys=2)
    owed.add([Check(limit, "a"), Check(limit, "b")])
    owed.add([Check(limit, "a")], 3)
    owed.add([Check(limit, "c")], 5)  # a third key: not kept, counted
    assert owed.dropped == 5 and len(owed) == 2
    assert sorted((check.key, cost) for check, cost in owed.take()) == [("a", 4), ("b", 1)]
    assert not owed


# --- what Redis admitted, charged to the fallback late (shadow.py) --------------------------------

STACKED = {**ALGORITHMS, "leaky_bucket": lambda: LeakyBucket(1, 60, QUOTA - 1, None)}


@pytest.mark.parametrize("name", sorted(STACKED))
async def test_the_fallback_first_charges_what_redis_admitted(
    redis_factory: RedisFactory, name: str
) -> None:
    """Admitted through Redis and not yet charged to the fallback (no periodic fold in
    between): the fallback's first decision charges them first, so the outage starts from
    them, as when each request was charged at once."""
    server = redis_factory.start()
    limit = compiled("late", STACKED[name]())
    other = compiled("other", FixedWindow(QUOTA, MONTH_S))
    clock = FakeClock()
    store = RedisStore(server.url, timeout_s=2.0, clock=clock, breaker=breaker())
    store.fold_interval_s = 3600.0  # only the fold before the fallback decides
    store.configure([limit, other], ())
    try:
        for _ in range(QUOTA // 2 - 1):
            assert (await store.decide([Check(limit, "k"), Check(other, "k")])).allowed
        assert (await store.decide([Check(limit, "k")])).allowed
        assert store.pending.keys == 2  # counted, not charged yet
        server.stop()
        verdicts = [(await store.decide([Check(limit, "k")])).allowed for _ in range(QUOTA)]
        assert store.counters.local_decisions == QUOTA and not store.pending
        assert verdicts == [True] * (QUOTA // 2) + [False] * (QUOTA // 2)
        # The other limit's share holds its 19 too.
        remaining = (await store.decide([Check(other, "k")])).decisions[0].remaining
        assert remaining == QUOTA - QUOTA // 2
    finally:
        await store.close()


async def test_what_redis_admitted_reaches_the_fallback_within_the_interval(
    redis_factory: RedisFactory,
) -> None:
    """Without an outage: charged by the store's timer (here at once), and at once when more
    keys wait than the bound allows."""
    server = redis_factory.start()
    limit = compiled("timer", FixedWindow(QUOTA, MONTH_S))
    store = RedisStore(server.url, timeout_s=2.0, clock=FakeClock())
    store.fold_interval_s = 0.0
    store.configure([limit], ())
    try:
        for _ in range(3):
            assert (await store.decide([Check(limit, "k")])).allowed
        for _ in range(100):  # bounded: the timer runs on one of the loop's next turns
            if not store.pending:
                break
            await asyncio.sleep(0)
        assert not store.pending
        look = store.local.decide_now([store._local_check(Check(limit, "k"))], commit=False)
        assert look.decisions[0].remaining == QUOTA - 3 - 1

        store.fold_interval_s = 3600.0
        store.pending.max_keys = 2
        for key in ("a", "b"):
            assert (await store.decide([Check(limit, key)])).allowed
        assert store.pending.keys == 2 and store.local.tracked_keys("timer") == 1
        assert (await store.decide([Check(limit, "c")])).allowed  # a third key: over the bound
        assert not store.pending and store.local.tracked_keys("timer") == 4
    finally:
        await store.close()


async def test_a_reload_charges_what_redis_admitted_under_the_limits_it_admitted_by(
    redis_factory: RedisFactory,
) -> None:
    """A reload that gives a limit's name another key starts its fallback state afresh: what
    the old limit admitted is charged before the reload (to the state it drops), not after
    it to the new limit's keys."""
    server = redis_factory.start()
    before = compiled("renamed", FixedWindow(QUOTA, MONTH_S), key=("client_ip",))
    after = compiled("renamed", FixedWindow(QUOTA, MONTH_S), key=("route",))
    store = RedisStore(server.url, timeout_s=2.0, clock=FakeClock(), breaker=breaker())
    store.fold_interval_s = 3600.0
    store.configure([before], ())
    try:
        for _ in range(QUOTA // 2):
            assert (await store.decide([Check(before, "k")])).allowed
        store.configure([after], [before])
        assert not store.pending
        server.stop()
        verdicts = [(await store.decide([Check(after, "k")])).allowed for _ in range(QUOTA + 1)]
        assert verdicts == [True] * QUOTA + [False]
    finally:
        await store.close()


async def test_a_refund_the_fallback_gives_comes_after_what_redis_admitted(
    redis_factory: RedisFactory,
) -> None:
    """A refund Redis cannot take is given in the fallback, to a state that already holds
    what Redis admitted (a bucket gives a token back; before the charge there is nothing to
    give it back to)."""
    server = redis_factory.start()
    limit = compiled("refunded", TokenBucket(QUOTA, MONTH_S, QUOTA))
    store = RedisStore(server.url, timeout_s=2.0, clock=FakeClock(), breaker=breaker())
    store.fold_interval_s = 3600.0
    store.configure([limit], ())
    try:
        for _ in range(QUOTA // 2):
            assert (await store.decide([Check(limit, "k")])).allowed
        server.stop()
        await store.refund([Check(limit, "k")])
        assert store.counters.local_decisions == 1
        verdicts = [(await store.decide([Check(limit, "k")])).allowed for _ in range(QUOTA)]
        assert verdicts == [True] * (QUOTA // 2 + 1) + [False] * (QUOTA // 2 - 1)
    finally:
        await store.close()

"""The policy engine on its own: which limits apply, under which keys, how stacked limits and
queue bounds decide, and that ``explain`` gives the verdict ``evaluate`` would, committing
nothing. A ``MemoryStore`` on a fake clock; no listener, no sleeping."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.engine.delay_queue import ShuttingDown
from gateway.engine.limit_engine import LimitEngine, Outcome
from gateway.engine.preflight import parse_and_build
from gateway.limits.keys import RequestFacts
from gateway.limits.routing import RouteTable
from gateway.policy.models import Route
from gateway.stores import MemoryStore
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support.policies import policy_for
from tests.support.virtual_clock import run_on_virtual_clock

ROUTES = (
    "  - name: api\n    upstream: backend\n    match: {path_prefix: /api/}\n"
    "  - name: all\n    upstream: backend\n"
)


class Bench:
    """One engine over a memory store on a fake clock, and a way to describe requests."""

    def __init__(self, limits: str, extra: str = "") -> None:
        text = policy_for("http://127.0.0.1:1", extra=extra).replace(
            "routes:\n  - name: all\n    upstream: backend\n", "routes:\n" + ROUTES
        )
        policy = self.policy = parse_and_build(text + "limits:\n" + limits, "test.yaml").policy
        self.clock = FakeClock()
        self.store = MemoryStore(self.clock)
        self.engine = LimitEngine(policy, self.store, build_algorithm)
        self.store.configure(self.engine.limits, ())
        self.routes = RouteTable(policy.routes)

    def request(
        self, path: str = "/", client: str = "10.0.0.1", **headers: str
    ) -> tuple[RequestFacts, Route, str, str, str]:
        route = self.routes.match("", path, "GET")
        assert route is not None
        facts = RequestFacts(
            client, route.name, "GET", CIMultiDictProxy(CIMultiDict(headers)), lambda: {}
        )
        return facts, route, "", path, client

    async def evaluate(self, path: str = "/", client: str = "10.0.0.1", **headers: str) -> Outcome:
        return await self.engine.evaluate(*self.request(path, client, **headers))

    def counts(self) -> dict[str, tuple[int, ...]]:
        return {
            # allowed, delayed, rejected, dry-run delayed and rejected, then waiting.
            limit.name: (*limit.counters.decisions()[:5], limit.counters.waiting)
            for limit in self.engine.limits
        }


def _nodelay(name: str, burst: int, extra: str = "") -> str:
    return (
        f"  {name}:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: {burst}\n"
        f"    nodelay: true\n{extra}"
    )


def _verdict(outcome: Outcome) -> tuple[object, ...]:
    decisions = outcome.verdict.decisions if outcome.verdict is not None else ()
    return (outcome.status, outcome.delay_s, outcome.retry_after_s, outcome.rejected_by, decisions)


async def test_limits_apply_by_route_and_key_and_a_missing_key_part_skips() -> None:
    bench = Bench(
        _nodelay("api_only", 3, "    match: {routes: [api]}\n")
        + _nodelay("per_client", 3, "    key: ['header:X-Client']\n")
        + _nodelay("per_ip", 3)
    )
    engine = bench.engine
    facts, route, host, path, _ = bench.request("/api/items", **{"X-Client": "a"})
    enforced, dry = engine.checks_for(facts, route, host, path, reserve=False)
    assert [(c.limit.name, c.key) for c in enforced] == [
        ("api_only", "10.0.0.1"),
        ("per_client", "a"),
        ("per_ip", "10.0.0.1"),
    ]
    assert dry == []
    # Outside /api/ the route-bound limit does not apply; without the header per_client skips.
    facts, route, host, path, _ = bench.request("/elsewhere")
    enforced, _ = engine.checks_for(facts, route, host, path, reserve=False)
    assert [c.limit.name for c in enforced] == ["per_ip"]


async def test_a_request_one_stacked_limit_rejects_is_charged_to_none() -> None:
    bench = Bench(_nodelay("tight", 0) + _nodelay("loose", 5))
    assert (await bench.evaluate()).status == 0
    rejected = await bench.evaluate()
    assert (rejected.status, rejected.rejected_by) == (429, "tight")
    assert "exceeded" in rejected.reason
    # loose admitted both but was charged for the first only: 6 - 1 remain.
    explanation = await bench.engine.explain(*bench.request())
    loose = next(look for look in explanation.limits if look.limit.name == "loose")
    assert loose.decision is not None and loose.decision.remaining == 5 - 1
    assert bench.counts() == {"tight": (1, 0, 1, 0, 0, 0), "loose": (1, 0, 0, 0, 0, 0)}


async def test_a_full_queue_rejects_what_would_otherwise_wait() -> None:
    bench = Bench(
        "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 5\n    max_queue: 1\n"
    )
    engine = bench.engine
    assert (await bench.evaluate()).delay_s == 0.0
    waiting = await bench.evaluate()
    assert waiting.status == 0 and waiting.delay_s == pytest.approx(1.0)
    assert waiting.holds_places
    waiter = engine.enter_queue(waiting)
    try:
        assert bench.counts()["shaped"][-1] == 1  # one waiting: the queue is full
        # The algorithm would admit it with a 2 s delay; the queue's bound refuses it.
        look = await engine.explain(*bench.request())
        full = await bench.evaluate()
        assert (full.status, full.rejected_by) == (429, "shaped")
        assert "queue is full" in full.reason
        assert _verdict(look.outcome) == _verdict(full)
        assert not full.holds_places
        assert engine.limits[0].counters.deciding == 0
    finally:
        waiter.cancel()
        engine.leave_queue(waiting)
    assert bench.counts()["shaped"] == (1, 1, 1, 0, 0, 0)


async def test_access_lists_decide_before_any_limit() -> None:
    bench = Bench(
        _nodelay("per_ip", 0), extra="access:\n  allow: [10.1.0.0/16]\n  deny: [10.2.0.0/16]\n"
    )
    denied = await bench.evaluate(client="10.2.3.4")
    assert (denied.status, denied.reason) == (403, "client address is denied")
    for _ in range(3):
        assert (await bench.evaluate(client="10.1.3.4")).status == 0
    explanation = await bench.engine.explain(*bench.request(client="10.1.3.4"))
    assert explanation.access == "allow" and explanation.outcome.status == 0
    assert bench.counts()["per_ip"] == (0, 0, 0, 0, 0, 0)


async def test_explain_commits_nothing_and_takes_no_place_in_a_queue() -> None:
    bench = Bench(
        _nodelay("per_ip", 2)
        + "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 5\n"
        + _nodelay("shadow", 0, "    dry_run: true\n")
    )
    await bench.evaluate()
    before = bench.counts()
    looks = [await bench.engine.explain(*bench.request()) for _ in range(3)]
    assert bench.counts() == before
    assert all(limit.counters.deciding == 0 for limit in bench.engine.limits)
    assert {_verdict(look.outcome) for look in looks} == {_verdict(looks[0].outcome)}
    shadow = next(look for look in looks[0].limits if look.limit.name == "shadow")
    assert shadow.decision is not None and not shadow.decision.allowed  # shown, not enforced


# Requests as (client, path, seconds to advance first).
_requests = st.lists(
    st.tuples(
        st.sampled_from(["10.0.0.1", "10.0.0.2"]),
        st.sampled_from(["/api/x", "/y"]),
        st.sampled_from([0.0, 0.0, 0.25, 2.0, 30.0]),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(_requests)
def test_explain_gives_the_verdict_evaluate_then_gives(
    requests: list[tuple[str, str, float]],
) -> None:
    """Whatever came before, a look at the next request says what deciding it says."""

    async def run() -> None:
        bench = Bench(
            _nodelay("api", 2, "    match: {routes: [api]}\n")
            + "  per_ip:\n    algorithm: sliding_window\n    limit: 4\n    window: 10s\n"
            + "  shaped:\n    algorithm: token_bucket\n    rate: 2r/s\n    burst: 2\n"
            + "    mode: queue\n    max_delay: 1s\n"
        )
        for client, path, advance_s in requests:
            bench.clock.advance(advance_s)
            look = await bench.engine.explain(*bench.request(path, client))
            outcome = await bench.evaluate(path, client)
            assert _verdict(look.outcome) == _verdict(outcome)
            if outcome.holds_places:  # a delayed request: served at once here
                waiter = bench.engine.enter_queue(outcome)
                waiter.cancel()
                bench.engine.leave_queue(outcome)

    asyncio.run(run())


async def test_a_store_error_gives_back_the_queue_places_the_request_held() -> None:
    """A store that cannot decide (here the shared store before its runtime directory is
    open) raises out of ``evaluate``; the places the request's checks held against
    ``max_queue`` go back, or every such error would shrink the queue for good. The dry-run
    limit is decided first, so its error comes before the enforced limits' decision."""
    bench = Bench(
        "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 5\n    max_queue: 3\n"
        + _nodelay("shadow", 0, "    dry_run: true\n")
    )
    store = SharedStore(None, bench.clock)
    engine = LimitEngine(bench.policy, store, build_algorithm)
    assert engine.decides_now
    with pytest.raises(RuntimeError, match="runtime directory"):
        await engine.evaluate(*bench.request())
    assert all(limit.counters.deciding == 0 for limit in engine.limits)


# -- concurrency limits --


def _slots(name: str, limit: int, extra: str = "") -> str:
    return f"  {name}:\n    algorithm: concurrency\n    limit: {limit}\n{extra}"


def _held(bench: Bench, name: str) -> int:
    return bench.store.slots_in_use(name)


async def test_a_concurrency_limit_holds_slots_until_each_request_gives_them_back() -> None:
    bench = Bench(_slots("in_flight", 2, "    retry_after: 3s\n"))
    engine = bench.engine
    first, second = await bench.evaluate(), await bench.evaluate()
    assert [len(o.held) for o in (first, second)] == [1, 1]
    third = await bench.evaluate()
    assert (third.status, third.rejected_by, third.retry_after_s) == (429, "in_flight", 3.0)
    assert "concurrency limit 'in_flight' exceeded" in third.reason
    assert not third.held
    # Another key has slots of its own.
    assert (await bench.evaluate(client="10.0.0.2")).status == 0
    assert _held(bench, "in_flight") == 3
    engine.release(first)
    engine.release(first)  # once, however often called
    assert _held(bench, "in_flight") == 2
    assert (await bench.evaluate()).status == 0
    assert engine.limits[0].counters.slots_held == 3


async def test_a_plan_gives_a_key_its_own_slots_and_exempt_clients_hold_none() -> None:
    bench = Bench(
        _slots(
            "in_flight",
            1,
            "    plans: {wide: {limit: 3}}\n    overrides: {10.0.0.2: wide}\n"
            "    exempt: [10.9.0.0/16]\n",
        )
    )
    engine = bench.engine
    one = await bench.evaluate(client="10.0.0.1")
    assert one.status == 0 and one.held
    assert (await bench.evaluate(client="10.0.0.1")).rejected_by == "in_flight"
    wide = [await bench.evaluate(client="10.0.0.2") for _ in range(3)]
    assert all(o.status == 0 and o.held for o in wide)
    assert (await bench.evaluate(client="10.0.0.2")).rejected_by == "in_flight"
    exempt = [await bench.evaluate(client="10.9.0.1") for _ in range(5)]
    assert all(o.status == 0 and not o.held for o in exempt)
    for outcome in (one, *wide):
        engine.release(outcome)
    again = [await bench.evaluate(client="10.0.0.2") for _ in range(3)]
    assert all(o.status == 0 for o in again)
    assert (await bench.evaluate(client="10.0.0.1")).status == 0


async def test_cost_is_the_slots_held_and_no_ratelimit_quota_is_advertised() -> None:
    bench = Bench(_slots("in_flight", 3, "    cost: 2\n") + _nodelay("per_ip", 5))
    engine = bench.engine
    admitted = await bench.evaluate()
    assert _held(bench, "in_flight") == 2
    block = engine.header_block(admitted).decode()
    assert '"per_ip"' in block and "in_flight" not in block
    rejected = await bench.evaluate()
    assert rejected.rejected_by == "in_flight"
    assert engine.header_block(rejected).decode().startswith("Retry-After: 1\r\n")
    engine.release(admitted)
    assert _held(bench, "in_flight") == 0


async def test_stacked_with_a_rate_limit_a_rejected_request_holds_no_slot_and_no_charge() -> None:
    bench = Bench(_slots("in_flight", 1) + _nodelay("per_ip", 1))
    engine = bench.engine
    first = await bench.evaluate()
    # The slot is taken: refused by the concurrency limit, and charged nothing by per_ip.
    refused = await bench.evaluate()
    assert refused.rejected_by == "in_flight"
    engine.release(first)
    second = await bench.evaluate()
    assert second.status == 0  # per_ip's burst of 1 still had room: charged once so far
    engine.release(second)
    # per_ip now rejects, and the slot it would have taken stays free.
    third = await bench.evaluate()
    assert third.rejected_by == "per_ip"
    assert _held(bench, "in_flight") == 0


async def test_a_dry_run_concurrency_limit_counts_and_gives_back() -> None:
    bench = Bench(_slots("candidate", 1, "    dry_run: true\n") + _nodelay("tight", 1))
    engine = bench.engine
    first = await bench.evaluate()
    assert first.status == 0 and len(first.held) == 1
    second = await bench.evaluate()  # tight admits it (burst 1); candidate would reject
    assert [c.limit.name for c in second.would_reject] == ["candidate"]
    engine.release(second)
    engine.release(first)
    assert _held(bench, "candidate") == 0
    # Refused by an enforced limit: the dry-run slot it took is given back at once.
    refused = await bench.evaluate()
    assert refused.rejected_by == "tight" and not refused.held
    assert _held(bench, "candidate") == 0


async def test_a_new_key_in_a_full_slot_table_is_refused_and_none_is_evicted() -> None:
    bench = Bench(_slots("in_flight", 1, "    max_keys: 2\n"))
    held = [await bench.evaluate(client=f"10.0.0.{n}") for n in (1, 2)]
    refused = await bench.evaluate(client="10.0.0.3")
    assert refused.rejected_by == "in_flight"
    assert bench.store.slot_tables["in_flight"].refusals == 1
    bench.engine.release(held[0])
    assert (await bench.evaluate(client="10.0.0.3")).status == 0


def test_a_request_over_the_limit_waits_first_come_first_served_for_a_slot() -> None:
    async def main() -> list[str]:
        bench = Bench(_slots("in_flight", 1, "    max_delay: 5s\n    max_queue: 2\n"))
        engine = bench.engine
        loop = asyncio.get_running_loop()
        order: list[str] = []
        holder = await bench.evaluate()

        async def client(name: str) -> Outcome:
            outcome = await bench.evaluate()
            assert outcome.waits_on is not None and outcome.status == 0
            outcome = await engine.wait_for_slot(outcome)
            order.append(f"{name}@{loop.time():g}")
            loop.call_later(1.0, engine.release, outcome)
            return outcome

        first = asyncio.create_task(client("a"))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(client("b"))
        await asyncio.sleep(0.1)
        # The line is full (max_queue 2): rejected at once, charged to nothing.
        full = await bench.evaluate()
        assert (full.status, full.rejected_by) == (429, "in_flight")
        assert "queue is full" in full.reason
        loop.call_later(0.8, engine.release, holder)
        await asyncio.gather(first, second)
        await asyncio.sleep(1.5)
        assert _held(bench, "in_flight") == 0
        assert engine.slot_lines.waiting == 0
        assert engine.limits[0].counters.waiting == 0
        return order

    assert run_on_virtual_clock(main) == ["a@1", "b@2"]


def test_a_waiting_request_times_out_and_one_cancelled_leaves_the_line() -> None:
    async def main() -> None:
        bench = Bench(_slots("in_flight", 1, "    max_delay: 2s\n    retry_after: 4s\n"))
        engine = bench.engine
        loop = asyncio.get_running_loop()
        holder = await bench.evaluate()
        waiting = await bench.evaluate()
        gone = asyncio.create_task(engine.wait_for_slot(await bench.evaluate()))
        timed = asyncio.create_task(engine.wait_for_slot(waiting))
        await asyncio.sleep(0.5)
        gone.cancel()  # the client hung up: it leaves the line holding nothing
        with pytest.raises(asyncio.CancelledError):
            await gone
        started = loop.time()
        outcome = await timed
        assert (outcome.status, outcome.retry_after_s) == (429, 4.0)
        assert outcome.rejected_by == "in_flight"
        assert "no slot within max_delay" in outcome.reason
        assert loop.time() - started == pytest.approx(1.5)
        assert engine.slot_lines.waiting == 0 and not outcome.held
        engine.release(holder)
        assert _held(bench, "in_flight") == 0
        counters = engine.limits[0].counters
        assert (counters.rejected, counters.waiting, counters.deciding) == (1, 0, 0)

    run_on_virtual_clock(main)


def test_a_request_woken_for_a_slot_that_a_rate_limit_now_refuses_is_charged_nothing() -> None:
    async def main() -> None:
        bench = Bench(
            _slots("in_flight", 1, "    max_delay: 5s\n")
            + "  per_ip:\n    algorithm: fixed_window\n    limit: 2\n    window: 1m\n"
        )
        engine = bench.engine
        holder = await bench.evaluate()
        waiter = asyncio.create_task(engine.wait_for_slot(await bench.evaluate()))
        await asyncio.sleep(0.1)
        # Another client of this key spends the window's last unit meanwhile.
        explanation = await engine.explain(*bench.request())
        assert explanation.outcome.waits_on is not None
        bench.store.decide_now([engine.checks_for(*bench.request()[:4], reserve=False)[0][1]])
        engine.release(holder)
        outcome = await waiter
        assert outcome.rejected_by == "per_ip" and not outcome.held
        assert _held(bench, "in_flight") == 0
        assert engine.slot_lines.waiting == 0

    run_on_virtual_clock(main)


def test_shutdown_sends_waiters_that_would_outlast_it_away() -> None:
    async def main() -> None:
        bench = Bench(_slots("in_flight", 1, "    max_delay: 30s\n"))
        engine = bench.engine
        await bench.evaluate()
        waiter = asyncio.create_task(engine.wait_for_slot(await bench.evaluate()))
        await asyncio.sleep(0.1)
        engine.slot_lines.close(asyncio.get_running_loop().time() + 5)
        with pytest.raises(ShuttingDown):
            await waiter
        assert engine.slot_lines.waiting == 0

    run_on_virtual_clock(main)


slot_steps = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from("ab"), st.integers(1, 2)),
        st.tuples(st.just("arrive"), st.sampled_from("ab"), st.integers(1, 2)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("hang_up"), st.integers(0, 40)),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(2, 4), script=slot_steps)
def test_lines_grant_slots_in_arrival_order_and_nothing_is_left_behind(
    limit: int, script: list[tuple]
) -> None:
    """Requests arrive, give their slots back, or hang up while waiting, in any order: never
    more than the limit held per key, those that waited get their slots in the order they
    came, and once all are done nothing is held, nobody waits, no place is counted."""

    async def main() -> None:
        bench = Bench(
            _slots(
                "in_flight",
                limit,
                "    max_delay: 1h\n    max_queue: 100\n    cost: {routes: {api: 2}}\n",
            )
        )
        engine = bench.engine
        holding: list[Outcome] = []
        waiting: list[asyncio.Task[Outcome]] = []
        served: dict[str, list[int]] = {"a": [], "b": []}

        async def wait(key: str, number: int, outcome: Outcome) -> Outcome:
            outcome = await engine.wait_for_slot(outcome)
            assert outcome.status == 0
            served[key].append(number)
            holding.append(outcome)
            return outcome

        for number, step in enumerate(script):
            if step[0] == "arrive":
                _, key, cost = step
                client = {"a": "10.0.0.1", "b": "10.0.0.2"}[key]
                outcome = await bench.evaluate("/api/x" if cost == 2 else "/", client)
                if outcome.waits_on is not None:
                    waiting.append(asyncio.create_task(wait(key, number, outcome)))
                else:
                    assert outcome.status == 0
                    holding.append(outcome)
            elif step[0] == "release" and holding:
                engine.release(holding.pop(step[1] % len(holding)))
            elif step[0] == "hang_up" and waiting:
                waiting.pop(step[1] % len(waiting)).cancel()
            await asyncio.sleep(0.01)
            table = bench.store.slot_tables.get("in_flight")
            if table is not None:
                assert all(table.held(key) <= limit for key in table.held_keys())
        while waiting or holding:
            while holding:
                engine.release(holding.pop())
            await asyncio.sleep(0.01)
            waiting = [task for task in waiting if not task.done()]
        for numbers in served.values():
            assert numbers == sorted(numbers)
        counters = engine.limits[0].counters
        assert _held(bench, "in_flight") == 0
        assert (counters.slots_held, counters.waiting, counters.deciding) == (0, 0, 0)
        assert engine.slot_lines.waiting == 0

    run_on_virtual_clock(main)


async def test_each_ratelimit_header_says_its_own_requests_numbers() -> None:
    """A limit's ``RateLimit`` item is kept for the numbers it last said (the header bytes
    are not made again while they repeat): a request with other numbers, another key's or
    a later one's, gets its own, under one limit and under several."""
    clients = ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1")
    # Per client: 3, 2, 1, 0 left, full again 63 s after each request (1r/m: 62.5 s each).
    per_ip = [(3, 63), (2, 125), (3, 63), (1, 188), (2, 125), (0, 240)]
    one = Bench(_nodelay("per_ip", 3))
    blocks = [one.engine.header_block(await one.evaluate(client=c)).decode() for c in clients]
    assert blocks == [
        f'RateLimit-Policy: "per_ip";q=4;w=240\r\nRateLimit: "per_ip";r={r};t={t}\r\n'
        for r, t in per_ip
    ]
    several = Bench(_nodelay("per_ip", 3) + _nodelay("wide", 9, "    key: [global]\n"))
    blocks = [
        several.engine.header_block(await several.evaluate(client=c)).decode() for c in clients
    ]
    wide = [(9, 63), (8, 125), (7, 188), (6, 250), (5, 313), (4, 375)]
    assert blocks == [
        'RateLimit-Policy: "per_ip";q=4;w=240, "wide";q=10;w=600\r\n'
        f'RateLimit: "per_ip";r={r};t={t}, "wide";r={wr};t={wt}\r\n'
        for (r, t), (wr, wt) in zip(per_ip, wide, strict=True)
    ]
    # Drained between requests, the same numbers again and again; then, at once, fewer.
    blocks = []
    for _ in range(3):
        several.clock.advance(3600.0)
        blocks.append(several.engine.header_block(await several.evaluate()).decode())
    blocks.append(several.engine.header_block(await several.evaluate()).decode())
    several.clock.advance(3600.0)
    blocks.append(several.engine.header_block(await several.evaluate()).decode())
    # Another client at once: its per_ip item as the one before, the global one's fewer.
    blocks.append(several.engine.header_block(await several.evaluate(client="10.0.0.3")).decode())
    full = 'RateLimit: "per_ip";r=3;t=63, "wide";r=9;t=63\r\n'
    less = 'RateLimit: "per_ip";r=2;t=125, "wide";r=8;t=125\r\n'
    other = 'RateLimit: "per_ip";r=3;t=63, "wide";r=8;t=125\r\n'
    policy = 'RateLimit-Policy: "per_ip";q=4;w=240, "wide";q=10;w=600\r\n'
    assert blocks == [policy + line for line in (full, full, full, less, full, other)]


async def test_a_repeated_key_reuses_its_check_and_holds_its_place_each_time() -> None:
    """A limit keeps the check its last reserving request made: a request with the same key
    and cost gets that one (a ``Check`` is never changed), another key gets its own, and
    each request still takes and gives back its own place in the queue."""
    bench = Bench(_nodelay("per_ip", 9) + _nodelay("wide", 9, "    key: [global]\n"))
    first = await bench.evaluate()
    again = await bench.evaluate()
    other = await bench.evaluate(client="10.0.0.2")
    assert [(c.limit.name, c.key, c.reserved) for c in first.checks] == [
        ("per_ip", "10.0.0.1", True),
        ("wide", "", True),
    ]
    assert all(a is b for a, b in zip(first.checks, again.checks, strict=True))
    assert other.checks[0] is not first.checks[0] and other.checks[0].key == "10.0.0.2"
    assert other.checks[1] is first.checks[1]  # the global key repeats
    assert [limit.counters.deciding for limit in bench.engine.limits] == [0, 0]
    assert bench.counts() == {"per_ip": (3, 0, 0, 0, 0, 0), "wide": (3, 0, 0, 0, 0, 0)}

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
from gateway.engine.limit_engine import LimitEngine, Outcome
from gateway.engine.preflight import parse_and_build
from gateway.limits.keys import RequestFacts
from gateway.limits.routing import RouteTable
from gateway.policy.models import Route
from gateway.stores import MemoryStore
from gateway.stores.shared.lmdb_store import SharedStore
from tests.support.policies import policy_for

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
            limit.name: (*limit.counters.decisions(), limit.counters.waiting)
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

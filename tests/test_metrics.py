"""Metrics: the heavy-hitters sketch, histogram arithmetic, cross-worker sums, and ``/metrics`` of
a real gateway (in process, and ``--workers 2`` as a real subprocess) under real traffic.

Expected figures come from the limits' own definitions (an nginx bucket of rate r and burst b
admits b + 1 at one instant), never from running the implementation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from gateway.clock import FakeClock
from gateway.observability.prometheus import make_registry
from gateway.observability.sketch import RecentTopKeys, SpaceSaving
from gateway.observability.snapshot import (
    AdaptiveData,
    GatewaySnapshot,
    HistogramData,
    LimitData,
    StoreData,
    WorkerSnapshot,
    merge,
)
from gateway.observability.stats import QUEUE_WAIT_BUCKETS, RequestStats
from gateway.stores.store_stats import StoreStats
from tests.support.gateways import GatewayFactory
from tests.support.metrics import Samples, scrape, scrape_until, value
from tests.support.network import TIMEOUT, free_port, get_status
from tests.support.policies import PER_IP_BURST_4, limited_policy, policy_for, replace_file
from tests.support.processes import Workers, run_workers
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

# -- the space-saving sketch ----------------------------------------------------------------------


def test_sketch_counts_exactly_while_under_capacity() -> None:
    sketch = SpaceSaving(8)
    stream = ["a"] * 5 + ["b"] * 3 + ["c"]
    for key in stream:
        sketch.offer(key)
    assert [(h.key, h.count, h.error) for h in sketch.top(3)] == [
        ("a", 5, 0),
        ("b", 3, 0),
        ("c", 1, 0),
    ]


def test_sketch_keeps_heavy_hitters_and_fixed_memory_under_a_flood_of_addresses() -> None:
    sketch = SpaceSaving(32)
    attackers = [f"198.51.100.{i}" for i in range(3)]
    for i in range(60_000):
        sketch.offer(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")  # each address once
        if i % 20 == 0:
            for attacker in attackers:  # 3000 each: more than n / capacity = 69000 / 32
                sketch.offer(attacker)
    assert len(sketch) == 32
    top = sketch.top(3)
    assert {h.key for h in top} == set(attackers)
    for hitter in top:
        assert hitter.count - hitter.error <= 3000 <= hitter.count


@settings(max_examples=200, deadline=None)
@given(
    stream=st.lists(st.integers(min_value=0, max_value=40), max_size=400),
    capacity=st.integers(min_value=1, max_value=12),
)
def test_sketch_bounds_hold_for_any_stream(stream: list[int], capacity: int) -> None:
    sketch = SpaceSaving(capacity)
    for item in stream:
        sketch.offer(str(item))
    true = Counter(str(item) for item in stream)
    table = {h.key: h for h in sketch.top(capacity)}
    assert len(table) <= capacity
    assert sum(h.count for h in table.values()) == len(stream)  # space-saving invariant
    for key, hitter in table.items():
        assert hitter.count - hitter.error <= true[key] <= hitter.count
    # Every key seen more than n / capacity times is guaranteed to be tracked.
    for key, count in true.items():
        if count > len(stream) / capacity:
            assert key in table


def test_recent_top_keys_forget_what_is_two_periods_old() -> None:
    top = RecentTopKeys(capacity=8, period_s=60.0)
    top.rotate(1000.0)
    top.offer("old")
    top.rotate(1061.0)  # "old" is now in the previous generation: still shown
    top.offer("new")
    assert {h.key for h in top.top(5)} == {"old", "new"}
    top.rotate(1122.0)
    assert {h.key for h in top.top(5)} == {"new"}
    top.rotate(1183.0)
    assert top.top(5) == []


async def test_top_keys_hash_header_and_query_parts_unless_the_limit_says_plain(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """An API key used as a limit key is a credential: the dashboard shows its hash."""
    limits = (
        "  by_key:\n    algorithm: fixed_window\n    limit: 1\n    window: 1h\n"
        "    key: [header:X-API-Key, client_ip]\n"
        "  by_query:\n    algorithm: fixed_window\n    limit: 1\n    window: 1h\n"
        "    key: [query:token]\n    top_keys: plain\n    match: {path: /q}\n"
    )
    gw = await start_gateway(limited_policy(upstream.url, limits))
    api_key = "live-api-key-DO-NOT-SHOW"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(3):
            assert await get_status(session, gw.url + "/x", headers={"X-API-Key": api_key}) in (
                200,
                429,
            )
            await get_status(session, gw.url + "/q?token=visible-on-purpose")
        async with session.get(gw.admin_url + "/dashboard/state") as resp:
            text = await resp.text()
            state = json.loads(text)["state"]
    digest = hashlib.sha256(api_key.encode()).hexdigest()[:12]
    assert api_key not in text
    shown = [h["key"] for h in state["limits"]["by_key"]["top_keys"]]
    assert shown == [f"sha256:{digest}\x1f127.0.0.1"]
    assert [h["key"] for h in state["limits"]["by_query"]["top_keys"]] == ["visible-on-purpose"]


# -- histogram arithmetic and folding -----------------------------------------------------------


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # Buckets le=0.001: 0, le=0.005: 10, le=0.01: 10 (cumulative 0, 10, 20, then nothing).
    counts = [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
    counts[1] = 10
    counts[2] = 10
    histogram = HistogramData(counts=tuple(counts), total=0.1)
    # rank 10 of 20 ends the second bucket exactly: its upper bound.
    assert histogram.quantile(0.5, QUEUE_WAIT_BUCKETS) == pytest.approx(0.005)
    # rank 15: halfway through (0.005, 0.01].
    assert histogram.quantile(0.75, QUEUE_WAIT_BUCKETS) == pytest.approx(0.0075)
    assert HistogramData.empty(QUEUE_WAIT_BUCKETS).quantile(0.5, QUEUE_WAIT_BUCKETS) is None


def test_methods_are_folded_and_status_kept_as_a_class() -> None:
    stats = RequestStats()
    for method in ("GET", "PROPFIND", "get", "BREW"):
        stats.record("api", method, 201, 0.01)
    stats.record("api", "GET", 404, 0.01)
    assert stats.requests == {("api", "GET", 2): 1, ("api", "OTHER", 2): 3, ("api", "GET", 4): 1}


# -- adding up workers ---------------------------------------------------------------------------


def _worker(worker: int, at: float, allowed: int, waiting: int, requests: int) -> WorkerSnapshot:
    return WorkerSnapshot(
        worker=worker,
        pid=1000 + worker,
        at=at,
        started_at=0.0,
        policy_sha256="ab" * 32,
        policy_source="p.yaml",
        requests=(("all", "GET", 2, requests),),
        limits={
            "per_ip": LimitData(
                algorithm="leaky_bucket", dry_run=False, allowed=allowed, waiting=waiting
            )
        },
        store=StoreData(name="memory"),
    )


def test_merge_sums_counters_of_all_workers_and_gauges_of_live_ones() -> None:
    now = 10_000.0
    live = _worker(0, now - 0.5, allowed=7, waiting=2, requests=10)
    dead = _worker(1, now - 60.0, allowed=5, waiting=3, requests=4)
    total = merge([live, dead], now)
    assert total.workers == 1 and total.worker_ids == (0,)
    assert total.limits["per_ip"].allowed == 12  # a dead worker's counts stay in the sum
    assert total.limits["per_ip"].waiting == 2  # its queue does not
    assert total.requests == (("all", "GET", 2, 14),)


def test_a_restarted_worker_continues_from_its_predecessors_counters() -> None:
    before = _worker(0, 100.0, allowed=40, waiting=5, requests=50)
    fresh = _worker(0, 200.0, allowed=3, waiting=1, requests=4)
    continued = fresh.with_base(before)
    assert continued.limits["per_ip"].allowed == 43
    assert continued.limits["per_ip"].waiting == 1
    assert continued.requests == (("all", "GET", 2, 54),)


def test_adaptive_limits_add_up_over_live_workers_and_sheds_over_all() -> None:
    """Each worker runs its own adaptive limit: the gateway's is their sum, its latency the
    slowest worker's view; a dead worker's sheds stay counted, its limit does not, and a
    restarted one continues its predecessor's count."""

    def snap(worker: int, at: float, **gate: float) -> WorkerSnapshot:
        data = AdaptiveData.model_validate(gate)
        return _worker(worker, at, 1, 0, 1).model_copy(update={"adaptive": {"api": data}})

    now = 10_000.0
    one = snap(0, now, limit=9, in_flight=9, waiting=2, min_latency_s=0.1, latency_s=0.12, shed=5)
    two = snap(1, now, limit=11, in_flight=4, min_latency_s=0.11, latency_s=0.115, shed=1)
    dead = snap(2, now - 60, limit=30, in_flight=30, latency_s=0.5, shed=7, probes=2)
    restarted = snap(3, now, limit=3, shed=2, probes=1).with_base(snap(3, now - 30, shed=4))
    total = merge([one, two, dead, restarted], now).adaptive["api"]
    assert (total.limit, total.in_flight, total.waiting) == (23, 13, 2)
    assert (total.min_latency_s, total.latency_s) == (0.11, 0.12)
    assert (total.shed, total.probes) == (19, 3)
    registry = make_registry(lambda: merge([one, two, dead, restarted], now))
    text = generate_latest(registry).decode()
    assert 'gateway_adaptive_limit{upstream="api"} 23.0' in text
    assert 'gateway_adaptive_shed_total{upstream="api"} 19.0' in text


def test_tokens_by_model_add_up_over_workers_and_restarts() -> None:
    """A limit with cost_from: each worker's units by model are summed (a dead worker's and a
    restarted worker's predecessor's too) into one series per model, the label of no model
    always there; a limit without cost_from has its units under no model. The units held in
    flight are a gauge of the live workers."""

    def snap(worker: int, at: float, charged: dict[str, int], in_flight: int) -> WorkerSnapshot:
        tokens = LimitData(
            algorithm="fixed_window",
            dry_run=False,
            cost_from=True,
            charged_units=sum(charged.values()),
            charged_units_by_model=charged,
            holds_budget=True,
            units_in_flight=in_flight,
        )
        plain = LimitData(algorithm="fixed_window", dry_run=False, charged_units=4)
        return _worker(worker, at, 1, 0, 1).model_copy(
            update={"limits": {"tokens": tokens, "logins": plain}}
        )

    now = 10_000.0
    one = snap(0, now, {"gpt-4o": 100, "other": 5}, 300)
    dead = snap(1, now - 60, {"gpt-4o": 30, "o3": 7}, 500)
    restarted = snap(2, now, {"o3": 1}, 100).with_base(snap(2, now - 30, {"o3": 2, "": 9}, 700))
    total = merge([one, dead, restarted], now).limits["tokens"]
    assert total.charged_units_by_model == {"gpt-4o": 130, "other": 5, "o3": 10, "": 9}
    assert total.charged_units == 154
    # The units held now: the live workers' (a dead worker's calls are gone, and a restarted
    # worker's predecessor's with it).
    assert total.units_in_flight == 400
    text = generate_latest(make_registry(lambda: merge([one, dead, restarted], now))).decode()
    series = [line for line in text.splitlines() if line.startswith("gateway_limit_charged_units")]
    assert series == [
        'gateway_limit_charged_units_total{limit="logins",model=""} 16.0',
        'gateway_limit_charged_units_total{limit="tokens",model=""} 9.0',
        'gateway_limit_charged_units_total{limit="tokens",model="gpt-4o"} 130.0',
        'gateway_limit_charged_units_total{limit="tokens",model="o3"} 10.0',
        'gateway_limit_charged_units_total{limit="tokens",model="other"} 5.0',
    ]
    assert 'gateway_limit_held_units_total{limit="tokens",model=""} 0.0' in text
    gauges = [line for line in text.splitlines() if line.startswith("gateway_limit_units_in")]
    assert gauges == ['gateway_limit_units_in_flight{limit="tokens"} 400.0']


def test_store_state_changes_are_counted_across_workers_and_restarts() -> None:
    """Each worker's StoreStats counts its changes of state; /metrics adds them all up, so a
    circuit that opened and closed between two scrapes still shows."""
    stats = [StoreStats(), StoreStats(), StoreStats()]
    for one in stats:
        one.set_state("fallback", "call failed")
        one.set_state("open", "3 failures")
        one.set_state("half_open")
        one.set_state("ok")
    stats[0].set_state("fallback")

    def snap(worker: int, at: float, of: StoreStats) -> WorkerSnapshot:
        data = StoreData(name="redis", state=of.state, transitions=dict(of.transitions))
        return _worker(worker, at, 1, 0, 1).model_copy(update={"store": data})

    now = 10_000.0
    # Worker 1 restarted: its new incarnation continues from its predecessor's counters.
    restarted = snap(1, now, stats[2]).with_base(snap(1, now - 30, stats[1]))
    total = merge([snap(0, now, stats[0]), restarted], now)
    registry = make_registry(lambda: total)
    found = {
        (sample.labels["from_state"], sample.labels["to_state"]): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "gateway_store_state_transitions"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert found == {
        ("ok", "fallback"): 4,
        ("fallback", "open"): 3,
        ("open", "half_open"): 3,
        ("half_open", "ok"): 3,
    }


# -- /metrics of a real gateway ------------------------------------------------------------------


async def test_metrics_count_requests_and_decisions_as_the_limit_implies(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    shadow = (
        "  shadow:\n    algorithm: fixed_window\n    limit: 6\n    window: 1h\n    dry_run: true\n"
    )
    gw = await start_gateway(limited_policy(upstream.url, PER_IP_BURST_4 + shadow), clock=clock)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = [await get_status(session, gw.url + f"/item/{i}") for i in range(12)]
        samples, text = await scrape(session, gw.admin_url)
    # rate 1r/m, burst 4, clock frozen: 5 admitted, 7 rejected.
    assert statuses == [200] * 5 + [429] * 7
    assert value(samples, "gateway_requests_total", route="all", method="GET", status="2xx") == 5
    assert value(samples, "gateway_requests_total", route="all", method="GET", status="4xx") == 7
    assert value(samples, "gateway_limit_decisions_total", limit="per_ip", result="allowed") == 5
    assert value(samples, "gateway_limit_decisions_total", limit="per_ip", result="rejected") == 7
    assert value(samples, "gateway_limit_decisions_total", limit="per_ip", result="delayed") == 0
    # The dry-run limit saw all 12 (it is decided before the enforced one): 6 fit its window.
    assert value(samples, "gateway_limit_decisions_total", limit="shadow", result="allowed") == 6
    assert (
        value(samples, "gateway_limit_decisions_total", limit="shadow", result="dry_run_rejected")
        == 6
    )
    assert value(samples, "gateway_limit_dry_run", limit="shadow") == 1
    assert value(samples, "gateway_limit_tracked_keys", limit="per_ip") == 1
    assert value(samples, "gateway_request_duration_seconds_count", route="all") == 12
    assert value(samples, "gateway_workers") == 1
    assert value(samples, "gateway_store_calls_total", store="memory") > 0
    assert value(samples, "gateway_store_state", store="memory", state="ok") == 1
    # Labels never carry paths, client addresses or keys (a ``server`` label names an upstream
    # server of the policy, here on loopback too).
    client_side = "\n".join(
        line for line in text.splitlines() if "gateway_upstream_server_" not in line
    )
    assert "/item/" not in text and "127.0.0.1" not in client_side


async def test_unknown_methods_fold_to_other_and_unrouted_requests_have_their_own_route(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  backend:\n    url: {upstream.url}\n"
        "routes:\n  - name: api\n    match: {path_prefix: /api/}\n    upstream: backend\n"
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method in ("GET", "PROPFIND", "PURGE"):
            async with session.request(method, gw.url + "/api/x") as resp:
                await resp.read()
        assert await get_status(session, gw.url + "/elsewhere") == 404
        samples, text = await scrape(session, gw.admin_url)
    assert value(samples, "gateway_requests_total", route="api", method="GET", status="2xx") == 1
    assert value(samples, "gateway_requests_total", route="api", method="OTHER", status="2xx") == 2
    assert (
        value(samples, "gateway_requests_total", route="_unmatched", method="GET", status="4xx")
        == 1
    )
    assert "PURGE" not in text and "PROPFIND" not in text


async def test_queue_depth_and_wait_of_delayed_requests(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock()
    # rate 10r/s, burst 5, no nodelay: at one instant the 2nd request waits 100 ms, the 3rd
    # 200 ms, the 4th 300 ms (nginx delays each excess request by excess / rate).
    limits = "  smooth:\n    algorithm: leaky_bucket\n    rate: 10r/s\n    burst: 5\n"
    gw = await start_gateway(limited_policy(upstream.url, limits), clock=clock)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        first = await get_status(session, gw.url + "/")
        waiting = [asyncio.create_task(get_status(session, gw.url + "/")) for _ in range(3)]
        await asyncio.sleep(0.05)
        during, _ = await scrape(session, gw.admin_url)
        statuses = await asyncio.gather(*waiting)
        after, _ = await scrape(session, gw.admin_url)
    assert first == 200 and statuses == [200, 200, 200]
    assert value(during, "gateway_limit_queue_depth", limit="smooth") == 3
    assert value(after, "gateway_limit_queue_depth", limit="smooth") == 0
    assert value(after, "gateway_limit_decisions_total", limit="smooth", result="delayed") == 3
    assert value(after, "gateway_limit_queue_wait_seconds_count", limit="smooth") == 3
    assert value(after, "gateway_limit_queue_wait_seconds_sum", limit="smooth") == pytest.approx(
        0.6, abs=0.03
    )
    # 100 ms is in (0.05, 0.1], 200 ms in (0.1, 0.25], 300 ms in (0.25, 0.5].
    assert value(after, "gateway_limit_queue_wait_seconds_bucket", limit="smooth", le="0.05") == 0
    assert value(after, "gateway_limit_queue_wait_seconds_bucket", limit="smooth", le="0.25") == 2
    assert value(after, "gateway_limit_queue_wait_seconds_bucket", limit="smooth", le="0.5") == 3


async def test_upstream_errors_are_counted_by_reason(start_gateway: GatewayFactory) -> None:
    async def hang(request: web.BaseRequest) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response()

    async def reset(request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()  # mid-exchange: no response byte
        await asyncio.sleep(1)
        return web.Response()

    runners = []
    ports = {}
    for name, handler in (("hang", hang), ("reset", reset)):
        runner = web.ServerRunner(web.Server(handler), shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        ports[name] = runner.addresses[0][1]
    closed_port = free_port()
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        "upstreams:\n"
        f"  down:\n    url: http://127.0.0.1:{closed_port}\n    connect_timeout: 2s\n"
        f"  slow:\n    url: http://127.0.0.1:{ports['hang']}\n    read_timeout: 200ms\n"
        f"  flaky:\n    url: http://127.0.0.1:{ports['reset']}\n"
        "routes:\n"
        "  - name: down\n    match: {path_prefix: /down}\n    upstream: down\n"
        "  - name: slow\n    match: {path_prefix: /slow}\n    upstream: slow\n"
        "  - name: flaky\n    match: {path_prefix: /flaky}\n    upstream: flaky\n"
    )
    try:
        gw = await start_gateway(policy)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            assert await get_status(session, gw.url + "/down") == 502
            assert await get_status(session, gw.url + "/slow") == 504
            assert await get_status(session, gw.url + "/flaky") == 502
            samples, _ = await scrape(session, gw.admin_url)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert value(samples, "gateway_upstream_errors_total", route="down", reason="connect") == 1
    assert value(samples, "gateway_upstream_errors_total", route="slow", reason="timeout") == 1
    assert value(samples, "gateway_upstream_errors_total", route="flaky", reason="reset") == 1
    assert value(samples, "gateway_requests_total", route="slow", method="GET", status="5xx") == 1
    for route, code in (("down", "502"), ("slow", "504"), ("flaky", "502")):
        assert value(samples, "gateway_local_responses_total", route=route, code=code) == 1


async def test_the_gateways_own_answers_are_counted_by_exact_code(
    start_gateway: GatewayFactory,
) -> None:
    """A limit's 429, a missing route's 404, the access list's 403 and a body's 413 are told
    apart by code; the same codes from the upstream are relayed, not counted as the gateway's."""

    async def answer(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=int(request.path.rsplit("/", 1)[1]))

    runner = web.ServerRunner(web.Server(answer))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n  max_body_size: 10\n"
        f"upstreams:\n  backend:\n    url: http://127.0.0.1:{port}\n"
        "routes:\n  - name: api\n    match: {path_prefix: /api/}\n    upstream: backend\n"
        "limits:\n  per_ip:\n    algorithm: fixed_window\n    limit: 5\n    window: 1h\n"
        "access:\n  deny: [127.0.0.2/32]\n"
    )
    try:
        # A fake clock: on the real one the hour could end between the requests.
        gw = await start_gateway(policy, clock=FakeClock())
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for code in (429, 404, 503):  # the upstream's own answers, relayed
                assert await get_status(session, gw.url + f"/api/{code}") == code
            assert await get_status(session, gw.url + "/elsewhere") == 404
            async with session.post(gw.url + "/api/200", data=b"x" * 11) as resp:
                assert resp.status == 413
            for _ in range(3):
                assert await get_status(session, gw.url + "/api/200") in (200, 429)
        denied = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=denied) as session:
            assert await get_status(session, gw.url + "/api/200") == 403
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            samples = await scrape_until(
                session,
                gw.admin_url,
                lambda s: (
                    (
                        "gateway_local_responses_total",
                        frozenset({("route", "api"), ("code", "429")}),
                    )
                    in s
                ),
            )
    finally:
        await runner.cleanup()
    local = {
        (dict(labels)["route"], dict(labels)["code"]): count
        for (name, labels), count in samples.items()
        if name == "gateway_local_responses_total"
    }
    # 5 admitted (3 relayed answers, the 413's request, one 200), then 2 rejected
    assert local == {
        ("_unmatched", "404"): 1,
        ("api", "403"): 1,
        ("api", "413"): 1,
        ("api", "429"): 2,
    }
    assert value(samples, "gateway_requests_total", route="api", method="GET", status="4xx") == 5


async def test_reloads_are_counted_by_result_and_logged(
    upstream: RecordingUpstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gateway.engine.preflight import load_and_build
    from gateway.serving.lifecycle import Gateway

    path = tmp_path / "policy.yaml"
    path.write_text(limited_policy(upstream.url, PER_IP_BURST_4))
    gateway = Gateway(load_and_build(path), policy_path=str(path))
    await gateway.start()
    admin = f"http://127.0.0.1:{gateway.admin_port}"
    try:
        with caplog.at_level(logging.INFO, logger="gateway.reload"):
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                before, _ = await scrape(session, admin)
                replace_file(path, limited_policy(upstream.url, PER_IP_BURST_4.replace("4", "6")))
                async with session.post(admin + "/reload") as resp:
                    # the file watcher may have reloaded it first
                    assert (await resp.json())["result"] in ("ok", "unchanged")
                replace_file(path, "limits: [not, a, mapping]\n")
                async with session.post(admin + "/reload") as resp:
                    assert resp.status == 422
                after, text = await scrape(session, admin)
    finally:
        await gateway.stop()
    reload_logs = [
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "gateway.reload"
    ]
    reloaded = [m for level, m in reload_logs if m.startswith("policy reloaded")]
    failed = [(level, m) for level, m in reload_logs if m.startswith("policy reload failed")]
    assert reloaded == [f"policy reloaded from {path} (sha256 {gateway.loaded.sha256[:12]})"]
    assert failed  # the watcher may have seen the bad file before /reload did
    for level, message in failed:
        assert level == logging.ERROR
        assert message.startswith("policy reload failed, keeping the running policy: ")
        assert str(path) in message  # the error names the file
    assert value(after, "gateway_policy_reloads_total", result="ok") == 1
    assert value(after, "gateway_policy_reloads_total", result="failed") >= 1
    assert value(after, "gateway_policy_last_reload_success_timestamp_seconds") > value(
        before, "gateway_policy_last_reload_success_timestamp_seconds"
    )
    assert f'gateway_policy_info{{sha256="{gateway.loaded.sha256[:12]}"}} 1.0' in text


async def test_access_log_line_carries_the_limiter_outcome(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    policy = limited_policy(
        upstream.url,
        PER_IP_BURST_4.replace("burst: 4", "burst: 0"),
        server="  access_log: true\n  access_log_format: json\n",
    )
    gw = await start_gateway(policy, clock=clock)
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            assert await get_status(session, gw.url + "/a?x=1") == 200
            assert await get_status(session, gw.url + "/b") == 429
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(line["path"], line["status"], line["limit"]) for line in lines] == [
        ("/a?x=1", 200, "allowed"),
        ("/b", 429, "rejected"),
    ]
    assert lines[1]["limit_name"] == "per_ip" and lines[1]["client"] == "127.0.0.1"
    assert lines[0]["route"] == "all" and lines[0]["duration_ms"] >= 0


_LOGFMT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_logfmt(line: str) -> dict[str, str | None]:
    """A text access-log line: ``key=value`` pairs, a value JSON-quoted when it needs to be and
    ``-`` for none."""
    fields: dict[str, str | None] = {}
    for key, raw in _LOGFMT_FIELD.findall(line):
        fields[key] = json.loads(raw) if raw.startswith('"') else None if raw == "-" else raw
    assert _LOGFMT_FIELD.sub("", line).strip() == "", f"not key=value pairs: {line!r}"
    return fields


async def test_text_access_log_carries_a_delayed_requests_delay(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    # rate 10r/s, burst 5, no nodelay, clock frozen: the 2nd request waits 100 ms (nginx: excess
    # over rate), the 3rd 200 ms.
    limits = "  smooth:\n    algorithm: leaky_bucket\n    rate: 10r/s\n    burst: 5\n"
    policy = limited_policy(upstream.url, limits, server="  access_log: true\n")
    gw = await start_gateway(policy, clock=clock)
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for path in ("/first", '/second?q="a%20b"', "/third"):
                # sent as written (a quote, an equals sign: the value needs quoting in the log)
                assert await get_status(session, URL(gw.url + path, encoded=True)) == 200
    lines = [parse_logfmt(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [line["path"] for line in lines] == ["/first", '/second?q="a%20b"', "/third"]
    assert [(line["limit"], line["delay_ms"]) for line in lines] == [
        ("allowed", "0.0"),
        ("delayed", "100.0"),
        ("delayed", "200.0"),
    ]
    for line in lines:
        assert line["status"] == "200" and line["route"] == "all" and line["method"] == "GET"
        assert line["client"] == "127.0.0.1"
        assert line["limit_name"] is None and line["upstream_error"] is None
    # The request waited its delay before it was answered.
    assert float(lines[2]["duration_ms"] or 0) >= 200.0


# -- several workers ------------------------------------------------------------------------------


@pytest.fixture
async def two_workers(upstream: RecordingUpstream, tmp_path: Path) -> AsyncIterator[Workers]:
    async with run_workers(upstream.url, tmp_path) as workers:
        yield workers


def published_pids(metrics_dir: Path) -> set[int]:
    """The pids of the workers whose snapshot files are in the shared directory."""
    pids = set()
    for file in metrics_dir.glob("worker-*.json"):
        try:
            pids.add(json.loads(file.read_text())["pid"])
        except (OSError, ValueError):
            continue
    return pids


def published_ok_requests(metrics_dir: Path) -> int:
    """The 2xx requests counted in the workers' snapshot files."""
    total = 0
    for file in metrics_dir.glob("worker-*.json"):
        try:
            requests = json.loads(file.read_text())["requests"]
        except (OSError, ValueError):
            continue
        total += sum(count for _, _, status_class, count in requests if status_class == 2)
    return total


def _ok_requests(samples: Samples) -> float:
    return samples.get(
        (
            "gateway_requests_total",
            frozenset({("route", "all"), ("method", "GET"), ("status", "2xx")}),
        ),
        0.0,
    )


@pytest.mark.slow
async def test_every_scrape_sees_the_whole_gateway_across_workers_and_restarts(
    two_workers: Workers, tmp_path: Path
) -> None:
    proxy_url, admin_url, workers = two_workers
    metrics_dir = tmp_path / "metrics"
    requests = 200
    # A new connection per request and per scrape, so the kernel spreads them over both workers.
    new_connections = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=new_connections) as session:
        await scrape_until(session, admin_url, lambda s: value(s, "gateway_workers") == 2, 20)
        for i in range(requests):
            assert await get_status(session, proxy_url + f"/r{i}") == 200
        # Each scrape lands on either worker; every one must see all requests.
        for _ in range(6):
            samples = await scrape_until(
                session, admin_url, lambda s: _ok_requests(s) == requests, 5
            )
            assert value(samples, "gateway_workers") == 2
        # Each worker's own process figures, told apart by a worker label.
        cpu = {
            dict(labels)["worker"]: v
            for (name, labels), v in samples.items()
            if name == "process_cpu_seconds_total"
        }
        assert len(cpu) == 2 and all(seconds > 0 for seconds in cpu.values())
        for worker in cpu:
            assert value(samples, "process_resident_memory_bytes", worker=worker) > 10_000_000
            assert value(samples, "process_open_fds", worker=worker) > 3
        # A worker killed outright is restarted, and its predecessor's counts stay in the sum.
        await wait_until(
            lambda: published_ok_requests(metrics_dir) == requests,
            "both workers' final figures published",
            5.0,
        )
        victim = workers()[0]
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            pids = set(workers())
            return victim not in pids and len(pids) == 2 and published_pids(metrics_dir) == pids

        await wait_until(replaced, "the killed worker to be replaced and publish", 20)
        for _ in range(6):
            samples = await scrape_until(session, admin_url, lambda s: True, 5)
            assert _ok_requests(samples) == requests


def _requests_total(samples: Samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "gateway_requests_total")


@pytest.mark.slow
async def test_totals_never_go_down_whichever_worker_answers(two_workers: Workers) -> None:
    """A scrape answered by one worker, then one answered by the other, while traffic flows:
    Prometheus reads any decrease of a counter as a reset, so no total may ever go back. The
    dashboard's feed (``/dashboard/state``) is read in the same sequence and held to the same.
    """
    proxy_url, admin_url, _ = two_workers
    # All traffic over one kept-alive connection, so on one worker: the other worker's view of
    # it is that worker's published file, which is when a stale file would show.
    one_connection = aiohttp.TCPConnector(limit=1)
    new_connections = aiohttp.TCPConnector(force_close=True)
    sent = 0
    stop = asyncio.Event()

    async def traffic(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while not stop.is_set():
            assert await get_status(session, proxy_url + f"/t{sent}") == 200
            sent += 1

    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, connector=one_connection) as traffic_session,
        aiohttp.ClientSession(timeout=TIMEOUT, connector=new_connections) as session,
    ):
        await scrape_until(session, admin_url, lambda s: value(s, "gateway_workers") == 2, 20)
        sender = asyncio.create_task(traffic(traffic_session))
        seen: list[tuple[str, float]] = []
        answered_by: set[int] = set()

        def observe(source: str, total: float) -> None:
            if seen:
                assert seen[-1][1] <= total, f"a total went down: {[*seen[-3:], (source, total)]}"
            seen.append((source, total))

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4.0
        try:
            for _ in range(2000):  # bounded; the deadline ends it first
                if loop.time() > deadline:
                    break
                samples, _ = await scrape(session, admin_url)
                observe("metrics", _requests_total(samples))
                async with session.get(admin_url + "/dashboard/state") as resp:
                    body = await resp.json()
                observe("dashboard", body["state"]["requests"])
                answered_by.add(body["worker"])
        finally:
            stop.set()
            await sender
        # Fresh connections landed on both workers, and traffic was counted as it flowed.
        assert answered_by == {0, 1}
        assert len(seen) >= 20 and seen[0][1] < seen[-1][1]
        # Once both workers have published (once a second), every answer has every request.
        await scrape_until(session, admin_url, lambda s: _requests_total(s) == sent, 5)
        for _ in range(4):
            samples, _ = await scrape(session, admin_url)
            assert _requests_total(samples) == sent


def test_stale_metrics_directories_go_even_when_another_worker_removes_one_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers of one gateway start together and each cleans what exited gateways left: a
    directory listed by one may be gone (removed by another) before it is reached. That raised
    in the worker, which died with a traceback and was restarted."""
    from gateway.observability.snapshot_files import DIR_PREFIX, _remove_dirs_of_gone_supervisors

    gone = [pid for pid in range(4_000_000, 4_000_100) if not Path(f"/proc/{pid}").exists()]
    stale = tmp_path / f"{DIR_PREFIX}{gone[0]}"
    stale.mkdir()
    (stale / "worker-0.json").write_text("{}")
    removed_meanwhile = tmp_path / f"{DIR_PREFIX}{gone[1]}"
    listed = Path.glob

    def glob(self: Path, pattern: str) -> Iterator[Path]:
        yield removed_meanwhile  # listed, then removed by another worker before we reach it
        yield from listed(self, pattern)

    monkeypatch.setattr(Path, "glob", glob)
    _remove_dirs_of_gone_supervisors(tmp_path)
    assert not stale.exists()


def test_a_snapshot_written_late_from_a_thread_never_replaces_a_newer_one(tmp_path: Path) -> None:
    """The tick writes its snapshot from a thread while the loop may answer a scrape, which
    publishes a newer one at once: the older write, finishing last, must not bring the file
    back to fewer requests (another worker's scrape would show a counter going down)."""
    from gateway.observability.snapshot_files import SnapshotDirectory

    mine = SnapshotDirectory(tmp_path, worker_id=0)
    other = SnapshotDirectory(tmp_path, worker_id=1)
    older = _worker(0, 100.0, allowed=7, waiting=0, requests=10)
    newer = _worker(0, 100.2, allowed=9, waiting=0, requests=12)
    mine.publish(newer, taken=2)  # the scrape's, taken after the tick's snapshot
    mine.publish(older, taken=1)  # the tick's thread, done last
    (seen,) = other.others()
    assert seen.requests == (("all", "GET", 2, 12),)
    mine.publish(_worker(0, 101.0, allowed=9, waiting=0, requests=15), taken=3)
    (seen,) = other.others()
    assert seen.requests == (("all", "GET", 2, 15),)


async def test_the_tick_never_shows_fewer_than_a_scrape_published_during_its_write(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tick writes this worker's snapshot from a thread; a scrape answered meanwhile
    publishes (and shows) newer figures. The sum the tick then feeds the dashboard must not
    hold the older ones, or the live page's totals would go back after the scrape's."""
    monkeypatch.setenv("GATEWAY_METRICS_DIR", str(tmp_path / "metrics"))
    gw = await start_gateway(policy_for(upstream.url))
    obs = gw.gateway.observability
    directory = obs.directory
    assert directory is not None

    async def requests(count: int) -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for _ in range(count):
                assert await get_status(session, gw.url + "/") == 200

    def total(snapshot: GatewaySnapshot) -> int:
        return sum(count for *_, count in snapshot.requests)

    await requests(3)
    own = await obs._publish_from_thread(directory, (0.0, 0.0))  # the tick's write
    await requests(2)
    assert total(obs.gateway_snapshot()) == 5  # a scrape in between, published and shown
    assert total(obs._tick_sum(directory, own)) == 5
    # Without a scrape in between, the tick adds up what it published itself.
    own = await obs._publish_from_thread(directory, (0.0, 0.0))
    await requests(1)
    assert total(obs._tick_sum(directory, own)) == 5

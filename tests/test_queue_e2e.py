"""The shaping queue end to end: its bound under concurrent decisions, refunds on leaving."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest

from gateway.clock import FakeClock
from tests.support import redis_harness
from tests.support.conformance import T0_US, gateway_store_of
from tests.support.gateways import GatewayFactory, hang_up_while_queued
from tests.support.metrics import scrape_until, value
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server


async def test_requests_decided_together_never_overfill_the_queue(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A dry-run limit beside the shaping one makes every decision wait on the store, so many
    requests are between the queue-bound check and the queue at once; still only max_queue
    of them may wait."""
    policy = policy_for(upstream.url) + (
        "limits:\n"
        "  shaped:\n    algorithm: leaky_bucket\n    rate: 2r/s\n    burst: 50\n"
        "    max_queue: 3\n    max_delay: 30s\n"
        "  candidate:\n    algorithm: sliding_window\n    limit: 1000\n    window: 1m\n"
        "    dry_run: true\n"
    )
    # Decided on a fake clock (the queued requests still wait on the loop's): on the real one
    # a pause of 0.5 s after the first request drains the bucket, and the next is served at
    # once instead of queued.
    gw = await start_gateway(policy, clock=FakeClock())
    engine = gw.gateway.handler.runtime.engine
    shaped = next(limit for limit in engine.limits if limit.name == "shaped")
    most_waiting = 0

    async def watch(stop: asyncio.Event) -> None:
        nonlocal most_waiting
        while not stop.is_set():
            most_waiting = max(most_waiting, shaped.counters.waiting)
            await asyncio.sleep(0)

    async with aiohttp.ClientSession() as session:

        async def get() -> int:
            async with session.get(gw.url + "/") as resp:
                await resp.read()
                return resp.status

        assert await get() == 200  # served at once: the bucket was empty
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        statuses = await asyncio.wait_for(asyncio.gather(*[get() for _ in range(12)]), 20)
        stop.set()
        await watcher
    # Each of the 12 would be delayed (no nodelay); 3 find a place in the queue.
    assert sorted(statuses) == [200] * 3 + [429] * 9
    assert most_waiting == 3
    assert (shaped.counters.waiting, shaped.counters.deciding) == (0, 0)


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("window", ["fixed_window", "sliding_window", "sliding_log"])
async def test_leaving_the_queue_gives_a_stacked_window_its_charge_back(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    window: str,
    store: str,
) -> None:
    """A bucket delays the request and a window stacked on it counted it; the client hangs up
    while queued, and the window forgets it as exactly as the bucket does (in Redis too: the
    script's instant comes back with the verdict and goes out with the refund).

    Redis decides on the fake clock too: on its own ``TIME`` the one-minute window could end
    between the requests and ``/explain`` (once in some 60 s / a run's length)."""
    clock = FakeClock(T0_US)
    policy = policy_for(upstream.url) + (
        "limits:\n"
        "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/s\n    burst: 5\n"
        "    max_delay: 30s\n"
        f"  window:\n    algorithm: {window}\n    limit: 3\n    window: 1m\n"
    )
    gw = await start_gateway(
        policy, clock=clock, **gateway_store_of(store, request, clock, tmp_path, "queue")
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/") as resp:
            assert resp.status == 200
        await hang_up_while_queued(gw, "shaped")
        async with session.get(gw.admin_url + "/explain", params={"path": "/"}) as resp:
            explained = {e["name"]: e["next_request"] for e in (await resp.json())["limits"]}
    # One request served and one refunded: the next request would leave the window 1 of 3
    # (0 had the queued one stayed counted) and the bucket 4 of its 5 burst.
    assert explained["window"]["remaining"] == 1
    assert explained["shaped"]["remaining"] == 4
    assert [r.raw_path for r in upstream.requests] == ["/"]


async def test_a_client_gone_from_the_queue_is_counted_499_and_its_delay_logged(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that hangs up while its request waits in the shaping queue is counted as nginx
    counts it (499), and the delay's log line is written.

    Compiled, a bare ``raise`` after an ``await`` in the queue wait's ``except`` clause raised
    nothing: mypyc keeps the exception being handled in the thread's state, which the awaiting
    handler reset while the wait was suspended. The handler then missed the cancellation (a
    500 counted) and the delay's log line crashed the process (segmentation fault)."""
    caplog.set_level(logging.INFO, logger="gateway.limits")
    policy = policy_for(upstream.url) + (
        "limits:\n"
        "  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 5\n"
        "    max_delay: 10m\n"
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/") as resp:
            assert resp.status == 200
        # The next one waits a minute in the queue: the client leaves long before.
        await hang_up_while_queued(gw, "shaped")
        gone = ("gateway_local_responses_total", frozenset({("route", "all"), ("code", "499")}))
        samples = await scrape_until(session, gw.admin_url, lambda s: gone in s)
    assert samples[gone] == 1
    assert value(samples, "gateway_requests_total", route="all", method="GET", status="2xx") == 1
    failed = (
        "gateway_requests_total",
        frozenset({("route", "all"), ("method", "GET"), ("status", "5xx")}),
    )
    assert samples.get(failed, 0) == 0  # not the 500 a missed cancellation leaves
    delayed = [r.getMessage() for r in caplog.records if r.name == "gateway.limits"]
    assert len(delayed) == 1 and delayed[0].startswith("limit shaped delayed a request by")
    assert [r.raw_path for r in upstream.requests] == ["/"]

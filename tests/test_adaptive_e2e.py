"""An upstream's adaptive limit through a real gateway process, in front of the capacity-C test
upstream (bench/capacity_upstream.py: C requests served at once in ``service`` each, the rest
queue in order), under an open-loop Poisson load of about twice its capacity
(bench/offered_load.py).

The properties the adaptive limit exists for: within 10 s the limit settles between 0.75 C and
1.5 C; the admitted requests' p99 stays within 2.5 times the unloaded latency; the upstream
serves at least 85 % of what it can (C every unloaded latency); when C changes the limit
follows; and without the adaptive block the same load makes the p99 grow with the upstream's
queue.

Sized for a loaded two-core machine: a 100 ms service time makes the gateway's and the load
generator's own milliseconds small beside it, and 200 requests a second is light work for
either, so the margins test the controller rather than the machine.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from offered_load import Offered, offer

from tests.support.capacity import capacity_upstream
from tests.support.metrics import scrape, value
from tests.support.policies import policy_template
from tests.support.processes import StartGateway

pytestmark = [pytest.mark.slow, pytest.mark.serial]

CAPACITY = 10
SERVICE_S = 0.1
RATE = 180.0  # offered requests a second: 1.8 C / service
SETTLE_S = 10.0


def _policy(upstream: str, adaptive: bool) -> str:
    block = "    adaptive: {{}}\n" if adaptive else ""
    return policy_template(upstream).replace(
        "    read_timeout: 60s\n", "    read_timeout: 60s\n    max_connections: 400\n" + block
    )


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _unloaded_latency(session: aiohttp.ClientSession, url: str) -> float:
    """The median of requests sent one at a time: the upstream's service, the gateway's hop
    and the client's own time, with nothing queued anywhere."""
    latencies = []
    for _ in range(15):
        started = time.monotonic()
        async with session.get(url) as resp:
            await resp.read()
            assert resp.status == 200
        latencies.append(time.monotonic() - started)
    return statistics.median(latencies)


async def _limits_between(
    session: aiohttp.ClientSession, admin_url: str, start_s: float, end_s: float, began: float
) -> list[float]:
    """The adaptive limit read every half second from ``start_s`` to ``end_s`` of the run."""
    seen: list[float] = []
    while (now := time.monotonic() - began) < end_s:
        if now >= start_s:
            samples, _ = await scrape(session, admin_url)
            seen.append(value(samples, "gateway_adaptive_limit", upstream="backend"))
        await asyncio.sleep(0.5)
    return seen


def _goodput(offered: Offered, start_s: float, end_s: float) -> float:
    return len(offered.between(start_s, end_s, 200)) / (end_s - start_s)


async def test_the_adaptive_limit_finds_the_capacity_keeps_latency_and_follows_a_change(
    gateway_process: StartGateway,
) -> None:
    with capacity_upstream(CAPACITY, SERVICE_S * 1000) as upstream:
        gateway = await gateway_process(policy=_policy(upstream, adaptive=True))
        async with aiohttp.ClientSession() as session:
            unloaded = await _unloaded_latency(session, gateway.url + "/")
            began = time.monotonic()
            load = asyncio.ensure_future(offer(gateway.url + "/", RATE, SETTLE_S + 14.0, seed=28))
            settled = await _limits_between(session, gateway.admin_url, SETTLE_S, 14.0, began)
            # The upstream now serves half as many at once: the limit must come down.
            await asyncio.sleep(max(0.0, began + 14.0 - time.monotonic()))
            async with session.put(f"{upstream}/_capacity?c={CAPACITY // 2}") as resp:
                assert resp.status == 200
            followed = await _limits_between(
                session, gateway.admin_url, 14.0 + SETTLE_S - 2.0, 14.0 + SETTLE_S, began
            )
            offered = await load
            samples, _ = await scrape(session, gateway.admin_url)

    low, high = 0.75 * CAPACITY, 1.5 * CAPACITY
    assert settled and all(low <= limit <= high for limit in settled), settled
    half = CAPACITY // 2
    assert followed and all(0.75 * half <= limit <= 1.5 * half for limit in followed), followed
    admitted = offered.between(SETTLE_S, 14.0, 200)
    p99 = _p99([s.latency_s for s in admitted])
    assert p99 <= 2.5 * unloaded, (p99, unloaded)
    # C requests every unloaded latency is what the upstream can serve through the gateway.
    goodput = _goodput(offered, SETTLE_S, 14.0)
    assert goodput >= 0.85 * CAPACITY / unloaded, (goodput, unloaded)
    shed = offered.between(SETTLE_S, 14.0, 503)
    assert shed and all(s.retry_after == "1" for s in shed)
    assert value(samples, "gateway_adaptive_shed_total", upstream="backend") >= len(shed)
    assert value(samples, "gateway_adaptive_min_latency_seconds", upstream="backend") >= SERVICE_S
    # Every answer is a 200 or a 503: nothing timed out or failed.
    assert {s.status for s in offered.sent} <= {200, 503}, {s.status for s in offered.sent}


async def test_without_the_adaptive_limit_the_queue_makes_latency_grow(
    gateway_process: StartGateway,
) -> None:
    """The control: the same load, no adaptive block, and the upstream's queue (and every
    request's latency) grows for as long as the load lasts."""
    with capacity_upstream(CAPACITY, SERVICE_S * 1000) as upstream:
        gateway = await gateway_process(policy=_policy(upstream, adaptive=False))
        async with aiohttp.ClientSession() as session:
            unloaded = await _unloaded_latency(session, gateway.url + "/")
        offered = await offer(gateway.url + "/", RATE, 5.0, seed=28)
    late = [s.latency_s for s in offered.between(3.0, 5.0, 200)]
    assert _p99(late) > 2.5 * unloaded, (_p99(late), unloaded)

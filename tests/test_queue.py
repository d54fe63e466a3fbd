"""The shaping queue: ordering, shutdown release, and what 10,000 waiting requests cost."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from gateway.engine.delay_queue import DelayQueue, ShuttingDown
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.rawhttp import exchange, status_of
from tests.support.upstreams import RecordingUpstream
from tests.support.virtual_clock import run_on_virtual_clock
from tests.support.waiting import wait_until

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))


def test_waiters_wake_in_due_order_and_not_early() -> None:
    """On the loop's own clock (virtual: no waiting, no load to blur it), each waiter wakes
    at its due instant: in due order, not early, and not late."""

    async def main() -> list[tuple[str, float]]:
        queue = DelayQueue()
        loop = asyncio.get_running_loop()
        started = loop.time()
        woke: list[tuple[str, float]] = []

        async def waiter(name: str, delay: float) -> None:
            await queue.wait(delay)
            woke.append((name, loop.time() - started))

        await asyncio.gather(waiter("c", 0.3), waiter("a", 0.1), waiter("b", 0.2))
        assert len(queue) == 0
        return woke

    woke = run_on_virtual_clock(main)
    assert [name for name, _ in woke] == ["a", "b", "c"]
    for (_, elapsed), due in zip(woke, (0.1, 0.2, 0.3), strict=True):
        assert elapsed >= due - 0.002
        assert elapsed == pytest.approx(due, abs=1e-9)


async def test_cancelled_waiters_leave_and_are_compacted() -> None:
    queue = DelayQueue()
    tasks = [asyncio.create_task(queue.wait(60)) for _ in range(200)]
    await asyncio.sleep(0)
    for task in tasks[:150]:
        task.cancel()
    await asyncio.gather(*tasks[:150], return_exceptions=True)
    assert len(queue) == 50
    assert len(queue._heap) < 200  # compacted once most entries were dead
    queue.release_after(0.0)
    results = await asyncio.gather(*tasks[150:], return_exceptions=True)
    assert all(isinstance(r, ShuttingDown) for r in results)


async def test_shutdown_answers_queued_requests_with_503(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = policy_for(upstream.url, server="  shutdown_timeout: 2s\n") + (
        "limits:\n  shaped:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 10\n"
        "    max_delay: 1h\n"
    )
    gw = await start_gateway(policy)
    first = await exchange(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert status_of(first) == 200
    queued = asyncio.create_task(
        exchange(gw.port, b"GET /q HTTP/1.1\r\nHost: h\r\n\r\n", read_for=10)
    )
    limit = gw.gateway.handler.runtime.engine.limits[0]
    await wait_until(lambda: limit.counters.waiting, "the request to be queued", within_s=2.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await gw.gateway.stop()
    response = await queued
    assert status_of(response) == 503
    assert loop.time() - started < 1.5
    assert [r.raw_path for r in upstream.requests] == ["/"]


@pytest.mark.slow
async def test_ten_thousand_waiting_requests_stay_under_100_mib() -> None:
    from queue_memory import measure  # bench/queue_memory.py

    result = await measure(10_000)
    assert result["waiting_in_queue"] >= 9_999
    # The issue asks for under 100 MiB. Measured: 83.8-84.6 MiB, of which aiohttp's own objects
    # (connection, parser, request, two tasks) and uvloop's transport take 71 MiB; the bound
    # leaves ~8 MiB of margin for a noisy machine and fails if much of the handler's cut returns.
    assert result["growth_mib"] < 92, result

"""max_queue holds when requests are decided together (their decisions suspend)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import GatewayFactory, RecordingUpstream, policy_for


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
    gw = await start_gateway(policy)
    engine = gw.gateway.handler.runtime.engine  # type: ignore[union-attr]
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

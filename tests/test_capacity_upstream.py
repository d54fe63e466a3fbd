"""The capacity-C test upstream (bench/capacity_upstream.py): its queue by hand, then the real
process over loopback, since the adaptive tests and bench/adaptive_curves.py rely on it."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from capacity_upstream import CapacityQueue
from offered_load import offer

from tests.support.capacity import capacity_upstream

# Its latency and queue figures are measured in real time: runs alone (scripts/test.sh).
pytestmark = pytest.mark.serial


def test_the_queue_serves_capacity_at_once_and_the_rest_in_order() -> None:
    queue: CapacityQueue[str] = CapacityQueue(2)
    assert [queue.arrive(name) for name in "abcd"] == [True, True, False, False]
    assert (queue.in_service, queue.queued, queue.peak_in_flight) == (2, 2, 4)
    assert queue.finish() == ["c"]
    queue.leave("d")  # gave up waiting
    assert queue.finish() == []
    assert (queue.in_service, queue.queued) == (1, 0)


def test_the_capacity_changes_at_run_time() -> None:
    queue: CapacityQueue[str] = CapacityQueue(1)
    for name in "abcd":
        queue.arrive(name)
    assert queue.set_capacity(3) == ["b", "c"]
    assert queue.set_capacity(1) == []
    # Down to one: the three in service finish before the next starts.
    assert queue.finish() == [] and queue.finish() == []
    assert queue.finish() == ["d"]
    with pytest.raises(ValueError):
        queue.set_capacity(0)


@pytest.fixture
def base() -> Iterator[str]:
    with capacity_upstream(capacity=2, service_ms=200) as url:
        yield url


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def _timed_get(session: aiohttp.ClientSession, url: str) -> float:
    start = time.monotonic()
    async with session.get(url) as response:
        assert response.status == 200
        await response.read()
    return time.monotonic() - start


async def _stats(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/_stats") as response:
        stats: dict[str, float] = await response.json()
        return stats


async def _until(session: aiohttp.ClientSession, base: str, **want: float) -> dict[str, float]:
    for _ in range(200):
        stats = await _stats(session, base)
        if all(stats[name] == value for name, value in want.items()):
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {want}: {stats}")


async def test_beyond_its_capacity_requests_queue(
    base: str, session: aiohttp.ClientSession
) -> None:
    latencies = sorted(await asyncio.gather(*(_timed_get(session, base) for _ in range(4))))
    # Two served at once (200 ms), two after them (400 ms): sleeps are never short.
    assert latencies[0] >= 0.2
    assert latencies[2] >= 0.4
    stats = await _stats(session, base)
    assert stats["peak_in_flight"] == 4 and stats["served"] == 4


async def test_up_to_its_capacity_nothing_waits(base: str, session: aiohttp.ClientSession) -> None:
    first = asyncio.gather(*(_timed_get(session, base) for _ in range(2)))
    await _until(session, base, in_service=2)
    assert (await _stats(session, base))["queued"] == 0
    await first


async def test_raising_the_capacity_starts_the_waiting_at_once(
    base: str, session: aiohttp.ClientSession
) -> None:
    requests = asyncio.gather(*(_timed_get(session, f"{base}/?ms=2000") for _ in range(4)))
    await _until(session, base, in_service=2, queued=2)
    async with session.put(f"{base}/_capacity?c=4") as response:
        assert response.status == 200
        assert (await response.json())["in_service"] == 4
    await _until(session, base, in_service=4, queued=0)
    async with session.put(f"{base}/_capacity?c=0") as response:
        assert response.status == 400
    async with session.put(f"{base}/_capacity?c=1&ms=5") as response:
        stats = await response.json()
        assert (stats["capacity"], stats["service_ms"]) == (1, 5.0)
    await requests


async def test_a_client_that_leaves_the_line_is_not_served(
    base: str, session: aiohttp.ClientSession
) -> None:
    held = asyncio.gather(*(_timed_get(session, f"{base}/?ms=1000") for _ in range(2)))
    await _until(session, base, in_service=2)
    async with aiohttp.ClientSession() as impatient:
        leaving = asyncio.ensure_future(_timed_get(impatient, base))
        await _until(session, base, queued=1)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
    await _until(session, base, queued=0, in_service=2)
    await held
    stats = await _until(session, base, in_service=0)
    assert stats["served"] == 2


async def test_an_open_loop_keeps_sending_while_the_queue_grows(base: str) -> None:
    """bench/offered_load.py at 25 requests a second for a second, against 10 a second of
    capacity: the stream does not slow down with the upstream, so the last wait longest."""
    offered = await offer(base, 25, 1.0, seed=7)
    assert offered.dropped == 0
    assert 10 <= len(offered.sent) <= 45
    assert all(sent.status == 200 for sent in offered.sent)
    assert max(s.at_s for s in offered.sent) > 0.5  # sent over the second, not in a burst
    # n requests at 10 a second take (n - 2) / 10 s at least after the first two.
    slowest = max(s.latency_s for s in offered.sent)
    assert slowest >= (len(offered.sent) - 2) / 10 - 1.0

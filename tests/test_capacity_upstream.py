"""The capacity-C test upstream (bench/capacity_upstream.py): its queue by hand, then the real
process over loopback, since the adaptive tests and bench/adaptive_curves.py rely on it."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from capacity_upstream import CapacityQueue

BENCH = Path(__file__).parent.parent / "bench"


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
def upstream_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, str(BENCH / "capacity_upstream.py"), "--port", "0",
         "--capacity", "2", "--service-ms", "200"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r":(\d+)$", line.strip())
        assert match, line
        yield process, f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


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
    upstream_process: tuple[subprocess.Popen[str], str], session: aiohttp.ClientSession
) -> None:
    _, base = upstream_process
    latencies = sorted(await asyncio.gather(*(_timed_get(session, base) for _ in range(4))))
    # Two served at once (200 ms), two after them (400 ms): sleeps are never short.
    assert latencies[0] >= 0.2
    assert latencies[2] >= 0.4
    stats = await _stats(session, base)
    assert stats["peak_in_flight"] == 4 and stats["served"] == 4


async def test_up_to_its_capacity_nothing_waits(
    upstream_process: tuple[subprocess.Popen[str], str], session: aiohttp.ClientSession
) -> None:
    _, base = upstream_process
    first = asyncio.gather(*(_timed_get(session, base) for _ in range(2)))
    await _until(session, base, in_service=2)
    assert (await _stats(session, base))["queued"] == 0
    await first


async def test_raising_the_capacity_starts_the_waiting_at_once(
    upstream_process: tuple[subprocess.Popen[str], str], session: aiohttp.ClientSession
) -> None:
    _, base = upstream_process
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
    upstream_process: tuple[subprocess.Popen[str], str], session: aiohttp.ClientSession
) -> None:
    _, base = upstream_process
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

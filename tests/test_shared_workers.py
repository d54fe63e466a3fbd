"""``gateway run --workers N`` with in-process limits: the workers share one exact state.

Real gateway processes (the CLI's supervisor and its forked workers) in front of a real
upstream, real HTTP clients over loopback, each client its own loopback address; every
connection is new (SO_REUSEPORT spreads them over the workers). The limits do not refill
within a test (rates per minute, windows of a day), so the number admitted on a trace is the
same whatever the timing: the single-process gateway's, exactly.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from tests.support.metrics import scrape_until, value
from tests.support.policies import replace_file
from tests.support.processes import run_workers
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.reliability

TIMEOUT = aiohttp.ClientTimeout(total=15)

# Stacked on every request: a leaky bucket with burst and delay (the 11th request of a client
# would wait a minute, longer than max_delay: refused, charged nothing), a sliding window per
# route, a global token bucket that never binds.
STACK = """\
limits:
  per_ip:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 30
    delay: 9
    key: [client_ip]
  per_route:
    algorithm: sliding_window
    limit: 100
    window: 24h
    key: [route]
  global:
    algorithm: token_bucket
    rate: 1r/m
    burst: 100000
    key: [global]
"""


async def wait_serving(tmp_path: Path, processes: int, within_s: float = 60.0) -> None:
    """Until the log says each of ``processes`` workers is serving."""
    log = tmp_path / "gateway.log"

    def text() -> str:
        return log.read_text() if log.exists() else ""

    def serving() -> bool:
        return all(f"worker {i} serving" in text() for i in range(processes))

    await wait_until(serving, f"{processes} workers serving", within_s, 0.1, text)


async def load(
    url: str, client: str, connections: int, each: int, method: str = "GET"
) -> Counter[int | str]:
    """``connections`` concurrent clients from ``client`` (a loopback address), ``each``
    requests apiece, each on a new connection; the statuses (or the error) counted. aiohttp
    sends a GET again once when its connection is cut; a POST never."""
    statuses: Counter[int | str] = Counter()

    async def one_connection() -> None:
        connector = aiohttp.TCPConnector(force_close=True, local_addr=(client, 0))
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
            for _ in range(each):
                try:
                    async with session.request(method, url + "/x") as resp:
                        await resp.read()
                        statuses[resp.status] += 1
                except aiohttp.ClientError as exc:
                    statuses[type(exc).__name__] += 1

    await asyncio.gather(*(one_connection() for _ in range(connections)))
    return statuses


async def run_trace(url: str) -> tuple[int, int]:
    """One client hammering, then twelve at once; the admitted count of each phase."""
    one = await load(url, "127.0.0.2", connections=16, each=10)
    many: Counter[int | str] = Counter()
    for counted in await asyncio.gather(
        *(load(url, f"127.0.1.{i}", connections=4, each=5) for i in range(1, 13))
    ):
        many.update(counted)
    assert set(one) | set(many) <= {200, 429}, (one, many)
    return one[200], many[200]


@pytest.mark.parametrize("processes", [1, 2, 4])
async def test_workers_admit_what_one_process_admits(
    upstream: RecordingUpstream, tmp_path: Path, processes: int
) -> None:
    """The same trace on 1 process (in-process state) and on 2 and 4 workers (the shared
    store): 10 of the one client's 160 (the leaky bucket's delay + 1), then 90 of the others'
    240 (the sliding window's 100 less those 10); the upstream saw exactly those."""
    async with run_workers(upstream.url, tmp_path, STACK, processes) as (url, admin, pids):
        await wait_serving(tmp_path, processes)
        assert await run_trace(url) == (10, 90)
        assert len(upstream.requests) == 100
        if processes > 1:
            assert len(pids()) == processes
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                # Counted in the shared state once, not once per worker.
                await scrape_until(
                    session,
                    admin,
                    lambda s: (
                        value(s, "gateway_limit_tracked_keys", limit="per_ip") == 13
                        and value(s, "gateway_limit_tracked_keys", limit="global") == 1
                    ),
                )


async def test_a_worker_killed_under_load_admits_nothing_twice_and_comes_back(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """One client with room for 400 requests sends 320 while a worker is SIGKILLed. Every
    admitted request was charged once; one the killed worker could not answer was charged
    once or not at all, never twice; the supervisor starts another worker, which finds the
    same state: the client has the rest of its 400."""
    stack = STACK.replace("delay: 9", "nodelay: true").replace("burst: 30", "burst: 399")
    stack = stack.replace("limit: 100\n", "limit: 100000\n")
    async with run_workers(upstream.url, tmp_path, stack, 2) as (url, _, pids):
        await wait_serving(tmp_path, 2)
        before = sorted(pids())
        assert len(before) == 2

        async def kill_one_soon() -> None:
            await asyncio.sleep(0.3)
            os.kill(before[0], signal.SIGKILL)

        statuses, _ = await asyncio.gather(
            load(url, "127.0.0.2", connections=8, each=40, method="POST"), kill_one_soon()
        )
        lost = sum(n for status, n in statuses.items() if isinstance(status, str))
        assert statuses[429] == 0 and statuses[200] + lost == 320, statuses
        assert len(upstream.requests) >= statuses[200]
        # The supervisor starts another worker; the state it finds is the same.
        await wait_until(
            lambda: len(pids()) == 2 and before[0] not in pids(), "a new worker", within_s=60.0
        )
        await wait_serving_again(tmp_path, worker_id=0)
        after = await load(url, "127.0.0.2", connections=4, each=30)
        assert set(after) == {200, 429}, after
        # Each admitted request charged once; a lost one charged once or not at all.
        charged = 400 - after[200]
        assert statuses[200] <= charged <= statuses[200] + lost, (statuses, after)


async def wait_serving_again(tmp_path: Path, worker_id: int, within_s: float = 60.0) -> None:
    """Until the log says worker ``worker_id`` is serving a second time (restarted)."""
    log = tmp_path / "gateway.log"
    await wait_until(
        lambda: log.read_text().count(f"worker {worker_id} serving") >= 2,
        f"worker {worker_id} restarted",
        within_s,
        every_s=0.1,
        context=log.read_text,
    )


async def test_a_reload_under_load_rescales_once_across_workers(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """Every worker adopts the new policy; the state is rescaled once: a client that used 6
    of 10 has used 12 of 20 after the reload, so 8 more (rescaled by each of 2 workers, it
    would have none)."""
    window = "limits:\n  per_ip:\n    algorithm: fixed_window\n    limit: {}\n    window: 24h\n"
    async with run_workers(upstream.url, tmp_path, window.format(10), 2) as (url, _, _pids):
        await wait_serving(tmp_path, 2)
        assert (await load(url, "127.0.0.2", connections=2, each=3))[200] == 6
        policy = tmp_path / "policy.yaml"
        background = asyncio.ensure_future(
            many_clients(url, [f"127.0.2.{i}" for i in range(1, 9)], rounds=6)
        )
        await asyncio.sleep(0.2)
        replace_file(policy, policy.read_text().replace("limit: 10", "limit: 20"))
        log = tmp_path / "gateway.log"
        await wait_until(
            lambda: log.read_text().count("policy reloaded from") == 2,
            "two workers reloading",
            within_s=60.0,
        )
        await background
        assert (await load(url, "127.0.0.2", connections=4, each=4))[200] == 8


async def many_clients(url: str, clients: Sequence[str], rounds: int) -> None:
    for _ in range(rounds):
        await asyncio.gather(*(load(url, client, connections=1, each=2) for client in clients))

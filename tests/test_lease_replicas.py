"""Quota leasing across real gateway processes on one real Redis.

Three gateways (``python -m gateway run``) share one global fixed window of 1 s, leased. The
load is uneven (7, 2 and 1 connections: about 70/20/10 % of the requests) and saturating. The
upstream stamps each request it receives with the wall clock, the clock Redis ``TIME`` (the
windows' clock) reads on this host, so admissions are counted per window.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import redis
from aiohttp import web

from tests.support import redis_harness
from tests.support.processes import GatewayProcess as Gateway
from tests.support.processes import gateway_processes
from tests.support.redis_harness import RedisFactory, RedisServer
from tests.support.upstreams import RecordedRequest, RecordingUpstream

redis_factory = redis_harness.redis_factory
pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.serial]

REPO_ROOT = Path(__file__).resolve().parent.parent
LIMIT = 300
CONNECTIONS = (7, 2, 1)
STRANDED_BOUND = LIMIT // 2  # one grant is at most half of what remains (lease.share)


def policy(
    upstream_url: str,
    store_url: str,
    prefix: str,
    on_failure: str = "local",
    limit: int = LIMIT,
    window: str = "1s",
) -> str:
    return f"""\
server:
  listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
upstreams:
  backend:
    url: {upstream_url}
routes:
  - name: all
    upstream: backend
limits:
  global:
    algorithm: fixed_window
    limit: {limit}
    window: {window}
    key: [global]
    lease: {{}}
headers:
  ietf: false
store:
  url: {store_url}
  key_prefix: "{prefix}"
  timeout: 500ms
  on_failure: {on_failure}
"""


def gateways(
    policy_path: Path, count: int = len(CONNECTIONS)
) -> contextlib.AbstractAsyncContextManager[list[Gateway]]:
    """``count`` gateway processes (``python -m gateway run``) on one policy."""

    def argv(port: int, admin_port: int) -> list[str]:
        return [
            *("-m", "gateway", "run", "--config", str(policy_path)),
            *("--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"),
        ]

    return gateway_processes(argv, count, policy_path.parent)


@dataclasses.dataclass
class Tally:
    sent: list[int]
    # Per replica, when each request was sent (wall clock).
    sent_at: list[list[float]] = dataclasses.field(default_factory=lambda: [[], [], []])
    admitted: int = 0
    rejected: int = 0
    other: int = 0


def saturated(tally: Tally, first: float, last: float) -> list[bool]:
    """For each whole window between ``first`` and ``last``: was every replica offered at
    least 3 requests in each tenth of it, and the limit at least twice in all? The load is
    closed-loop, so a replica's requests pause when its process does: on a busy shared
    machine a process is sometimes not scheduled for a good part of a second, and what it
    holds then stays unspent when the window ends (at most its lease: the bound a replica
    that stops for good strands, see the SIGKILL test)."""
    slices = [Counter(int(t * 10) for t in sent_at) for sent_at in tally.sent_at]
    offered = Counter(int(t) for sent_at in tally.sent_at for t in sent_at)
    return [
        offered[window] >= 2 * LIMIT
        and all(counts[window * 10 + tenth] >= 3 for counts in slices for tenth in range(10))
        for window in range(int(first) + 1, int(last))
    ]


async def press(
    gateways: list[Gateway],
    seconds: float,
    tally: Tally,
    windows_wanted: int = 0,
    server: RedisServer | None = None,
) -> dict[int, int]:
    """Closed-loop load, ``CONNECTIONS[i]`` connections on gateway ``i``, for ``seconds`` (and
    at most 400,000 requests), or until ``windows_wanted`` saturated windows are over; a
    gateway that stops answering is left alone. With ``server``: the script calls it had
    answered at the start of each window."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    first = time.time()
    calls_at: dict[int, int] = {}

    async def count_calls() -> None:
        assert server is not None
        while loop.time() < end:
            await asyncio.sleep(1.0 - time.time() % 1.0)
            calls_at[int(time.time())] = script_calls(server)

    async def watch() -> None:
        nonlocal end
        while loop.time() < end:
            await asyncio.sleep(0.5)
            if sum(saturated(tally, first, time.time())) >= windows_wanted:
                end = loop.time()

    async def connection(index: int, session: aiohttp.ClientSession) -> None:
        url = f"http://127.0.0.1:{gateways[index].port}/"
        while loop.time() < end and sum(tally.sent) < 400_000:
            tally.sent[index] += 1
            tally.sent_at[index].append(time.time())
            try:
                async with session.get(url) as response:
                    await response.read()
            except aiohttp.ClientError:
                if gateways[index].proc.returncode is not None:
                    return  # killed by the test
                tally.other += 1
                continue
            if response.status == 200:
                tally.admitted += 1
            elif response.status == 429:
                tally.rejected += 1
            else:
                tally.other += 1

    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        connections = [
            connection(index, session)
            for index, count in enumerate(CONNECTIONS)
            for _ in range(count)
        ]
        watchers = [watch()] if windows_wanted else []
        if server is not None:
            watchers.append(count_calls())
        await asyncio.gather(*connections, *watchers)
    return calls_at


async def window_start() -> float:
    """Wait for a window to begin: the windows counted are then saturated from their start,
    and none admits late in its window (a request admitted then may reach the upstream just
    after the boundary, and be counted in the next window)."""
    await asyncio.sleep(1.0 - time.time() % 1.0)
    return time.time()


def stamp(upstream: RecordingUpstream) -> list[float]:
    """The wall-clock arrival of each request at the upstream."""
    arrivals: list[float] = []

    async def reply(request: web.BaseRequest, recorded: RecordedRequest) -> web.StreamResponse:
        arrivals.append(time.time())
        return web.Response(text="ok")

    upstream.reply = reply
    return arrivals


def per_window(arrivals: list[float], first: float, last: float) -> list[int]:
    """Admissions in each whole 1 s window between ``first`` and ``last``."""
    counts = Counter(int(t) for t in arrivals)
    return [counts[index] for index in range(int(first) + 1, int(last))]


def script_calls(server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(
        int(entry["calls"])
        for name, entry in stats.items()
        if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
    )


async def test_three_replicas_with_uneven_traffic_admit_the_limit_each_window(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = redis_factory.start()
    path = tmp_path / "policy.yaml"
    path.write_text(policy(upstream.url, server.url, f"rep{os.getpid()}:"))
    arrivals = stamp(upstream)
    tally = Tally([0, 0, 0])
    async with gateways(path) as started:
        first = await window_start()
        calls_at = await press(started, 40.0, tally, windows_wanted=10, server=server)
        last = time.time()
    windows = per_window(arrivals, first, last)
    offered = per_window([t for sent_at in tally.sent_at for t in sent_at], first, last)
    requests = sum(tally.sent)
    share = [round(100 * sent / requests) for sent in tally.sent]
    full = saturated(tally, first, last)
    # The first whole window is held to the bound too. It once admitted 287 of 300 in a CI run
    # (offered 2,401 there): a slow replica was granted, by the requests it saw (rejections
    # included), more than it could spend before the window ended. Grants are now capped by
    # how fast a replica spends (test_lease.py, the slow replica).
    counted = [count for count, ok in zip(windows, full, strict=True) if ok]
    # Redis calls per request in the saturated windows (their calls sampled at each start).
    indices = [i for i, ok in zip(range(int(first) + 1, int(last)), full, strict=True) if ok]
    calls = sum(
        calls_at[i + 1] - calls_at[i] for i in indices if i in calls_at and i + 1 in calls_at
    )
    requests_in = sum(sent for sent, ok in zip(offered, full, strict=True) if ok)
    with capsys.disabled():
        print(
            f"\nleased fixed window {LIMIT}/1s, 3 replicas, requests split {share} %: admitted "
            f"per window {windows}, offered {offered}; in the {len(counted)} saturated windows "
            f"min {min(counted)}, max {max(counted)}, {requests_in} requests and {calls} Redis "
            f"calls: {calls / requests_in:.4f} per request ({requests} requests in all)"
        )
    assert tally.other == 0
    assert len(counted) >= 10
    assert all(abs(count - LIMIT) <= 0.02 * LIMIT for count in counted), (windows, full)
    assert calls / requests_in <= 0.05


async def test_a_replica_killed_holding_a_lease_strands_at_most_its_bound(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGKILL the busiest replica a quarter into a window, while it holds a lease: no window
    admits more than the limit; the window it died in loses at most the stranded bound; the
    others go on admitting the whole limit from the next window."""
    server = redis_factory.start()
    path = tmp_path / "policy.yaml"
    path.write_text(policy(upstream.url, server.url, f"kill{os.getpid()}:"))
    arrivals = stamp(upstream)
    tally = Tally([0, 0, 0])
    async with gateways(path) as started:
        first = await window_start()

        async def kill() -> float:
            await asyncio.sleep(2.0)
            now = time.time()
            await asyncio.sleep(1.25 - (now % 1.0) if now % 1.0 > 0.25 else 0.25 - now % 1.0)
            started[0].proc.send_signal(signal.SIGKILL)
            return time.time()

        killed_at, _ = await asyncio.gather(kill(), press(started, 6.5, tally))
        last = time.time()
    windows = per_window(arrivals, first, last)
    offered = per_window([t for sent_at in tally.sent_at for t in sent_at], first, last)
    killed_window = int(killed_at) - (int(first) + 1)
    with capsys.disabled():
        print(
            f"\nreplica killed at {killed_at % 1:.2f} s into window {killed_window}: admitted "
            f"per window {windows}, offered {offered}; stranded bound {STRANDED_BOUND}"
        )
    # Never over. The upstream stamps a request a moment after the gateway admitted it, so a
    # request admitted just before a boundary may count in the next window: a few, no more.
    assert all(count <= LIMIT + 3 for count in windows), windows
    assert sum(windows) <= LIMIT * len(windows) + 3, windows
    assert windows[killed_window] >= LIMIT - STRANDED_BOUND
    after = windows[killed_window + 1 :]
    # The others go on: from the next window on they admit what they are offered, up to the
    # limit (within 2 %; on a busy machine the two left may be offered less than the limit).
    assert after
    for count, sent in zip(after, offered[killed_window + 1 :], strict=True):
        assert count >= 0.98 * min(sent, LIMIT), (windows, offered)


async def test_redis_down_replicas_spend_their_leases_then_follow_on_failure(
    redis_factory: RedisFactory, upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """Two replicas hold leases when Redis stops: each admits what its lease holds, then
    answers as ``on_failure: deny`` says (503), never more than the limit in all."""
    server = redis_factory.start()
    path = tmp_path / "policy.yaml"
    # A long window, so that the whole test stays in one; each replica's first ask gets the
    # quota over an interval, split among the replicas that asked.
    path.write_text(
        policy(upstream.url, server.url, f"down{os.getpid()}:", "deny", limit=200, window="10s")
    )
    async with gateways(path, count=2) as started:
        if time.time() % 10 > 6:  # too near the end of a window: wait for the next
            await asyncio.sleep(10.2 - time.time() % 10)
        async with aiohttp.ClientSession() as session:

            async def get(gateway: Gateway) -> int:
                async with session.get(f"http://127.0.0.1:{gateway.port}/") as response:
                    await response.read()
                    return response.status

            # A first ask is the quota over an interval (2 s of the 10 s window: 40): the
            # first to ask gets 40 (alone in asking), the second 40 split between the two.
            assert await get(started[0]) == 200
            assert await get(started[1]) == 200
            server.stop()
            statuses: list[list[int]] = [[], []]
            for index, gateway in enumerate(started):
                for _ in range(150):
                    status = await get(gateway)
                    statuses[index].append(status)
                    if status != 200:
                        break
    # Each spent the lease it held (less the unit its first request took), then deny.
    assert [replica.count(200) for replica in statuses] == [39, 19]
    assert [replica[-1] for replica in statuses] == [503, 503]
    assert len(upstream.requests) == 40 + 20


async def test_equal_replicas_from_a_cold_start_share_the_first_window_fairly(
    redis_factory: RedisFactory,
    upstream: RecordingUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Three gateways that have never asked for the limit, each offered 150 requests a second
    (open loop) from the start of a 5 s window of 1,500: each is admitted in that first window
    what a per-request limit would admit of its requests (the first 1,500 sent), within 2 % of
    the limit. The probe found 1,500 / 750 / 750 of 3,000 there (the first to ask was granted
    half of the quota, more than it could spend before the others ran the rest out)."""
    limit, window_s, rate = 1500, 5, 150.0
    server = redis_factory.start()
    path = tmp_path / "policy.yaml"
    path.write_text(
        policy(upstream.url, server.url, f"cold{os.getpid()}:", limit=limit, window=f"{window_s}s")
    )
    sent: list[tuple[float, int]] = []  # (wall clock when sent, replica)
    admitted = [0, 0, 0]
    statuses: Counter[int] = Counter()
    async with gateways(path) as started:
        # From the start of a window (Redis TIME: the wall clock here), for one window.
        await asyncio.sleep(window_s - time.time() % window_s + 0.01)
        first = int(time.time()) // window_s
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=5)
        ) as session:

            async def one(replica: int) -> None:
                at = time.time()
                sent.append((at, replica))
                async with session.get(f"http://127.0.0.1:{started[replica].port}/") as response:
                    await response.read()
                statuses[response.status] += 1
                if response.status == 200 and int(at) // window_s == first:
                    admitted[replica] += 1

            async def offer(replica: int) -> None:
                # Open loop: a request every 1/rate s on the loop's clock, whatever the answers.
                begin = loop.time() + replica * 0.002
                tasks = []
                for n in range(int(rate * window_s) + 10):  # bounded: a little past the window
                    await asyncio.sleep(max(begin + n / rate - loop.time(), 0))
                    tasks.append(asyncio.create_task(one(replica)))
                await asyncio.gather(*tasks)

            await asyncio.gather(*(offer(replica) for replica in range(3)))
    in_window = sorted(item for item in sent if int(item[0]) // window_s == first)
    exact = Counter(replica for _, replica in in_window[:limit])
    with capsys.disabled():
        print(
            f"\ncold start, 3 replicas at {rate:g} req/s, {limit} per {window_s} s: admitted "
            f"{admitted} in the first window, a per-request limit {[exact[r] for r in range(3)]}"
            f" ({len(in_window)} sent in it)"
        )
    assert set(statuses) <= {200, 429}, statuses
    # Saturated (offered about 2,250): the limit, within 2 % (counted by when each request was
    # sent, a request sent just before the window's end may be decided just after it).
    assert abs(sum(admitted) - limit) <= 0.02 * limit
    for replica in range(3):
        assert abs(admitted[replica] - exact[replica]) <= 0.02 * limit, (admitted, exact)

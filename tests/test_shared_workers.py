"""``gateway run --workers N`` with in-process limits: the workers share one exact state.

Real gateway processes (the CLI's supervisor and its forked workers) in front of a real
upstream, real HTTP clients over loopback, each client its own loopback address; every
connection is new (SO_REUSEPORT spreads them over the workers). The limits do not refill
within a test (rates per minute, windows of 30 days), so the number admitted on a trace is the
same whatever the timing: the single-process gateway's, exactly.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from tests.support.filesystems import fill_to, small_tmpfs
from tests.support.held_upstream import HeldUpstream
from tests.support.metrics import scrape_until, value
from tests.support.policies import replace_file
from tests.support.processes import REPO_ROOT, connections_to, run_workers, wait_serving
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.reliability

TIMEOUT = aiohttp.ClientTimeout(total=15)

# Stacked on every request: a leaky bucket with burst and delay (the 11th request of a client
# would wait a minute, longer than max_delay: refused, charged nothing), a sliding window per
# route (30 days: a day's ends at midnight UTC, and the count carried into the next day,
# weighted a little under whole, rounds down to admit one more), a global token bucket that
# never binds.
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
    window: 720h
    key: [route]
  global:
    algorithm: token_bucket
    rate: 1r/m
    burst: 100000
    key: [global]
"""


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
        store = "shared (store.url memory)" if processes > 1 else "memory"
        assert f", store {store}; dashboard" in (tmp_path / "gateway.log").read_text()
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
    # 30 days: on the workers' real clock a day window ends at midnight UTC, which could fall
    # between the requests before the reload and those after.
    window = "limits:\n  per_ip:\n    algorithm: fixed_window\n    limit: {}\n    window: 720h\n"
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


def _run_with_shared_dir(shared: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        "upstreams:\n  backend:\n    url: http://127.0.0.1:9\n"
        "routes:\n  - name: all\n    upstream: backend\n" + STACK
    )
    return subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(policy), "--workers", "2"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GATEWAY_SHARED_DIR": str(shared)},
    )


def test_a_shared_dir_without_room_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """On a 4 MiB tmpfs the first map (8 MiB) cannot be reserved: one line naming the
    directory, what it needs and what is free, a non-zero exit, no worker started (before:
    workers died of SIGBUS and were restarted forever, never ready, nothing logged)."""
    with small_tmpfs(tmp_path / "small", "4m") as small:
        result = _run_with_shared_dir(small, tmp_path)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.fullmatch(
        rf"gateway: {small}/gateway-limits-\d+: the shared limit state needs 8\.0 MiB there, "
        r"3\.9 MiB free \(set GATEWAY_SHARED_DIR to a directory with room\)\n",
        result.stderr,
    ), result.stderr
    assert "serving" not in result.stdout


@pytest.mark.parametrize("kind", ["read-only", "a file"])
def test_a_shared_dir_that_cannot_hold_state_is_one_line(tmp_path: Path, kind: str) -> None:
    if kind == "a file":
        shared = tmp_path / "not-a-dir"
        shared.write_text("")
        expected = f"gateway: GATEWAY_SHARED_DIR {shared}: not a directory\n"
        result = _run_with_shared_dir(shared, tmp_path)
    else:
        with small_tmpfs(tmp_path / "ro", "1m") as shared:
            remount = ["mount", "-o", "remount,ro", str(shared)]
            subprocess.run(remount, check=True, capture_output=True)
            result = _run_with_shared_dir(shared, tmp_path)
        expected = (
            f"gateway: GATEWAY_SHARED_DIR {shared}: cannot keep the shared limit state there: "
            "read-only file system\n"
        )
    assert result.returncode != 0
    assert result.stderr == expected


# A window of 30 days: the known key's first request and its last three are 8,000 requests
# (tens of seconds on a slow machine) apart, and on the workers' real clock an hour window
# could end between them (it ends on the wall clock's hour) and start the key afresh.
LONG_KEYS = """\
limits:
  per_key:
    algorithm: fixed_window
    limit: 3
    window: 720h
    key: [header:X-Key]
"""


async def test_a_shared_dir_that_fills_while_serving_crashes_no_worker(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """Two workers on a 24 MiB tmpfs, filled but for 256 KiB once they serve: new keys
    (380 bytes each) until the map cannot grow past its first 8 MiB. No worker dies (before:
    both died of SIGBUS at once, a 0.6 s outage, and again at each new key), every request is
    answered, each worker logs the switch to ``fallback`` once with the directory and sizes,
    and a known key is still counted exactly."""
    with small_tmpfs(tmp_path / "small", "24m") as small:
        async with run_workers(upstream.url, tmp_path, LONG_KEYS, 2, shared_dir=small) as (
            url,
            _,
            pids,
        ):
            await wait_serving(tmp_path, 2)
            before = sorted(pids())
            fill_to(small, 256 << 10)
            statuses: Counter[int | str] = Counter()
            connector = aiohttp.TCPConnector(limit=8)
            async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:

                async def send(key: str) -> int | str:
                    try:
                        async with session.get(url + "/x", headers={"X-Key": key}) as resp:
                            await resp.read()
                            return resp.status
                    except aiohttp.ClientError as exc:
                        return type(exc).__name__

                for start in range(0, 8_000, 200):
                    batch = [f"{index:0380d}" for index in range(start, start + 200)]
                    statuses.update(await asyncio.gather(*(send(key) for key in batch)))
                known = [await send(f"{0:0380d}") for _ in range(3)]
            log = (tmp_path / "gateway.log").read_text()
            assert sorted(pids()) == before, log
    switches = [line for line in log.splitlines() if "store state ok -> fallback" in line]
    print(f"\nstatuses {dict(statuses)}; {switches[0] if switches else 'no switch'}")
    assert statuses == Counter({200: 8_000}), statuses
    assert "exited with" not in log and "Traceback" not in log, log
    assert 1 <= len(switches) <= 2, switches  # once per worker that met the full map
    assert f"{small}/gateway-limits-" in switches[0] and "256.0 KiB free" in switches[0]
    assert known == [200, 200, 429]  # counted once when the map had room for it


async def test_a_concurrency_limit_holds_across_workers_and_a_killed_workers_slots_come_back(
    held_upstream: HeldUpstream, tmp_path: Path
) -> None:
    """Eight slots per client over two workers: eight requests held in flight (spread over
    both by the kernel), the ninth refused whichever worker takes it. SIGKILL the worker
    holding most of them: the supervisor starts another in its place, which gives their slots
    back, so exactly the slots of the requests still in flight stay taken."""
    limit = "limits:\n  in_flight:\n    algorithm: concurrency\n    limit: 8\n"

    async def get(url: str) -> int | str:
        connector = aiohttp.TCPConnector(force_close=True, local_addr=("127.0.0.2", 0))
        try:
            async with (
                aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session,
                session.get(url) as resp,
            ):
                await resp.read()
                return resp.status
        except aiohttp.ClientError as exc:
            return type(exc).__name__

    async with run_workers(held_upstream.url, tmp_path, limit, 2) as (url, _, pids):
        await wait_serving(tmp_path, 2)
        held = [asyncio.create_task(get(f"{url}/hold/first")) for _ in range(8)]
        await wait_until(lambda: held_upstream.in_flight.get("first") == 8, "8 in flight")
        # Refused on either worker: new connections land on both.
        assert [await get(url + "/fast") for _ in range(6)] == [429] * 6
        workers = pids()
        holding = {pid: connections_to(pid, held_upstream.port) for pid in workers}
        victim = max(workers, key=holding.__getitem__)
        assert holding[victim] > 0, holding
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: len(pids()) == 2 and victim not in pids(), "a new worker", 60)
        await wait_until(
            lambda: (tmp_path / "gateway.log").read_text().count(" serving") >= 3,
            "the new worker serving",
            60,
        )
        lost = [task for task in held if task.done()]
        assert len(lost) == holding[victim], (holding, [task.result() for task in lost])
        survivors = 8 - len(lost)
        # The killed worker's slots are free again: exactly that many more are admitted.
        more = [asyncio.create_task(get(f"{url}/hold/second")) for _ in range(len(lost))]
        await wait_until(
            lambda: held_upstream.in_flight.get("second") == len(lost), "the freed slots taken"
        )
        assert [await get(url + "/fast") for _ in range(6)] == [429] * 6
        held_upstream.release("first")
        held_upstream.release("second")
        done = await asyncio.gather(*(task for task in held if task not in lost), *more)
        assert done == [200] * (survivors + len(lost))
        assert [await get(url + "/fast") for _ in range(4)] == [200] * 4


# Leased on the shared store: the route's window (cap 100 // (4 x 2) = 12 units a batch) and
# the global bucket; the per-client leaky bucket delays, so it is decided on every request.
LEASED_STACK = (
    """\
store:
  url: shared
  worker_lease: {units: 16, interval: 50ms}
"""
    + STACK
)


async def test_leased_workers_admit_within_the_window_and_explain_says_so(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """With ``store.worker_lease`` two workers never admit more than the window's 100, and no
    fewer than 100 less the units both may hold (2 x 12); the upstream saw exactly those;
    ``/explain`` states each leased limit's bound, and none for the leaky bucket that delays."""
    async with run_workers(upstream.url, tmp_path, LEASED_STACK, 2) as (url, admin, _pids):
        await wait_serving(tmp_path, 2)
        one, many = await run_trace(url)
        assert one == 10
        assert 100 - 2 * 12 <= one + many <= 100
        assert len(upstream.requests) == one + many
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.get(admin + "/explain?path=/x&client_ip=127.0.0.9") as resp,
        ):
            explained = {entry["name"]: entry for entry in (await resp.json())["limits"]}
        assert "never more than the limit per window" in explained["per_route"]["worker_lease"]
        assert "rate x 50 ms" in explained["global"]["worker_lease"]
        assert "worker_lease" not in explained["per_ip"]
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            # The workers' batches in the lease metrics, summed over the workers.
            await scrape_until(
                session,
                admin,
                lambda s: (
                    value(s, "gateway_limit_lease_decisions_total", limit="per_route") > 0
                    and value(s, "gateway_limit_leases_total", limit="per_route", event="granted")
                    > 0
                ),
            )

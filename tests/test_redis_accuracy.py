"""Three gateway processes share their limits through Redis: under 10 s of concurrent load from
several clients (each its own loopback address), the number admitted is within 1% of what
the limits allow. One Redis server, and a 3-master Redis Cluster.

Two loads: one where the per-client leaky bucket binds (few clients) and one where the global
token bucket binds (many clients); both limits are stacked on every request in both.

The gateways are real processes started by this module's launcher (``python -m
tests.test_redis_accuracy serve ...``) rather than the CLI: the CLI selects the Redis store
as well (``store.url`` or ``GATEWAY_STORE_URL``), but only the launcher prints the store's
counters at exit (script calls, round trips, failed calls, local decisions), which the test
reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from tests.support import redis_harness
from tests.support.processes import GatewayProcess as Process
from tests.support.processes import gateway_processes
from tests.support.redis_harness import RedisClusterHarness, RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server
redis_cluster = redis_harness.redis_cluster

REPO_ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 3
LOAD_S = 10.0
STATS_PREFIX = "STORE_STATS "

pytestmark = [pytest.mark.reliability, pytest.mark.serial]


@dataclasses.dataclass(frozen=True)
class Load:
    """A policy's two limits and the clients that press on them."""

    name: str
    ip_rate: int  # per-client leaky bucket, requests per second
    ip_burst: int
    global_rate: int  # global token bucket, requests per second
    global_burst: int
    clients: int  # distinct client addresses
    connections: int  # concurrent connections per client

    def policy(self, upstream_url: str) -> str:
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
  per_ip:
    algorithm: leaky_bucket
    rate: {self.ip_rate}r/s
    burst: {self.ip_burst}
    nodelay: true
    key: [client_ip]
  global:
    algorithm: token_bucket
    rate: {self.global_rate}r/s
    burst: {self.global_burst}
    key: [global]
headers:
  ietf: false
"""


# Rates low enough that a loaded 2-core machine still offers twice what they allow (three
# gateways, Redis and the clients share it: 212 requests a second was seen in a full suite),
# and bursts of several seconds of the rate: a client stalled behind a busy gateway loses
# nothing until its bucket has drained (at 1 s, a loaded run admitted 2.6% less than allowed).
PER_IP_BINDS = Load("per-ip binds", 10, 40, 2000, 100, clients=4, connections=4)
GLOBAL_BINDS = Load("global binds", 200, 50, 100, 300, clients=8, connections=3)


# --- the launcher: one gateway process on a RedisStore ----------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    from gateway.engine.preflight import load_and_build
    from gateway.serving.lifecycle import Gateway
    from gateway.stores import RedisStore

    store = RedisStore(
        args.store, replicas=args.replicas, timeout_s=args.timeout, key_prefix=args.key_prefix
    )
    gateway = Gateway(
        load_and_build(args.policy), listen=args.listen, admin_listen=args.admin_listen, store=store
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await gateway.start()
    try:
        await stop.wait()
    finally:
        counters = {**dataclasses.asdict(store.counters), "round_trips": store.round_trips}
        counters["circuit_transitions"] = store.breaker.transitions
        print(STATS_PREFIX + json.dumps(counters), flush=True)
        await gateway.stop()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.test_redis_accuracy")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--policy", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--admin-listen", required=True)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--timeout", type=float, default=0.05)
    parser.add_argument("--key-prefix", default="gw:")
    args = parser.parse_args(argv)
    from gateway.serving.lifecycle import run_event_loop

    run_event_loop(lambda: _serve(args))
    return 0


# --- the test ---------------------------------------------------------------------------------


def gateways(
    policy: Path, store_url: str, key_prefix: str
) -> contextlib.AbstractAsyncContextManager[list[Process]]:
    """Three gateway processes on one store, stopped (SIGTERM, then SIGKILL) at the end."""

    def argv(port: int, admin_port: int) -> list[str]:
        return [
            *("-m", "tests.test_redis_accuracy", "serve", "--policy", str(policy)),
            *("--store", store_url, "--key-prefix", key_prefix),
            *("--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"),
            # A generous timeout: this measures sharing, and a fallback would blur it
            # (asserted below: no decision was made locally).
            *("--timeout", "0.5"),
        ]

    return gateway_processes(argv, REPLICAS, policy.parent)


def store_stats(process: Process) -> dict[str, object]:
    """The counters the launcher prints when it stops."""
    lines = [line for line in process.log().splitlines() if line.startswith(STATS_PREFIX)]
    assert lines, f"no store counters from the gateway: {process.log()[-2000:]}"
    stats: dict[str, object] = json.loads(lines[-1][len(STATS_PREFIX) :])
    return stats


@dataclasses.dataclass
class ClientResult:
    admitted: int = 0
    rejected: int = 0
    other: int = 0
    first_s: float = 0.0
    last_s: float = 0.0


async def press(processes: list[Process], load: Load) -> list[ClientResult]:
    """Each client (its own 127.0.0.x address) sends as fast as its connections allow, to the
    three gateways in turn, for LOAD_S seconds (and at most 200,000 requests in all)."""
    loop = asyncio.get_running_loop()
    results = [ClientResult() for _ in range(load.clients)]
    end = loop.time() + LOAD_S
    sent = 0

    async def connection(client: int, session: aiohttp.ClientSession, start: int) -> None:
        nonlocal sent
        result = results[client]
        turn = start
        while loop.time() < end and sent < 200_000:
            process = processes[turn % len(processes)]
            turn += 1
            sent += 1
            started = loop.time()
            if not result.first_s:
                result.first_s = started
            result.last_s = max(result.last_s, started)
            async with session.get(f"http://127.0.0.1:{process.port}/") as response:
                await response.read()
            if response.status == 200:
                result.admitted += 1
            elif response.status == 429:
                result.rejected += 1
            else:
                result.other += 1

    async def client(index: int) -> None:
        connector = aiohttp.TCPConnector(
            local_addr=(f"127.0.0.{index + 10}", 0), limit=load.connections
        )
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*[connection(index, session, n) for n in range(load.connections)])

    await asyncio.gather(*[client(i) for i in range(load.clients)])
    return results


def allowed_by_limits(load: Load, results: list[ClientResult]) -> float:
    """What exact limits admit under saturating load: per client, nginx's leaky bucket lets
    burst + 1 through at once and then ``rate`` a second; the token bucket starts full
    (``burst``) and refills at ``rate`` a second. The tighter of the two totals."""
    per_ip = sum(load.ip_burst + 1 + load.ip_rate * (r.last_s - r.first_s) for r in results)
    first = min(r.first_s for r in results)
    last = max(r.last_s for r in results)
    whole = load.global_burst + load.global_rate * (last - first)
    return min(per_ip, whole)


async def run_accuracy(
    store_url: str,
    upstream: RecordingUpstream,
    tmp_path: Path,
    load: Load,
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(load.policy(upstream.url))
    key_prefix = f"acc{os.getpid()}{time.monotonic_ns()}:"
    async with gateways(policy, store_url, key_prefix) as processes:
        results = await press(processes, load)
    stats = [store_stats(process) for process in processes]
    admitted = sum(r.admitted for r in results)
    allowed = allowed_by_limits(load, results)
    error = (admitted - allowed) / allowed
    offered = sum(r.admitted + r.rejected + r.other for r in results)
    with capsys.disabled():  # the figure belongs in the test log, passed or not
        print(
            f"\n{load.name} on {store_url.partition(':')[0]}: admitted {admitted} of {offered} "
            f"offered; the limits allow {allowed:.1f}; error {error:+.2%}; "
            f"round trips {sum(int(s['round_trips']) for s in stats)}"  # type: ignore[call-overload]
            f" for {sum(int(s['calls']) for s in stats)} script calls"  # type: ignore[call-overload]
        )
    assert sum(r.other for r in results) == 0  # only 200 and 429
    assert all(s["local_decisions"] == 0 and s["failed_calls"] == 0 for s in stats), stats
    # Each gateway got its store ready before it listened: no request's call had to be sent
    # again (MOVED from the seed node, NOSCRIPT), so none was decided late.
    assert all(s["recoveries"] == 0 for s in stats), stats
    assert len(upstream.requests) == admitted
    # Saturating: far more offered than allowed, or the figure would say nothing.
    assert offered > 2 * allowed
    assert abs(error) <= 0.01


@pytest.mark.slow
@pytest.mark.parametrize("load", [PER_IP_BINDS, GLOBAL_BINDS], ids=lambda load: load.name)
async def test_three_gateways_on_one_redis_admit_what_the_limits_allow(
    redis_server: RedisServer,
    upstream: RecordingUpstream,
    tmp_path: Path,
    load: Load,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await run_accuracy(redis_server.url, upstream, tmp_path, load, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("load", [PER_IP_BINDS, GLOBAL_BINDS], ids=lambda load: load.name)
async def test_three_gateways_on_a_redis_cluster_admit_what_the_limits_allow(
    redis_cluster: RedisClusterHarness,
    upstream: RecordingUpstream,
    tmp_path: Path,
    load: Load,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await run_accuracy(redis_cluster.url, upstream, tmp_path, load, capsys)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

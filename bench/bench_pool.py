"""What a pool adds to one request's own work: pick a server, note it started, answered and
finished, for a pool of one (``url:``) and pools of two (round robin, least in flight, hash).

    python bench/bench_pool.py --requests 200000 --rounds 5

No sockets: the steps ``gateway/edge/next_upstream.py`` takes around the exchange, timed in this
thread's CPU time, so a busy machine slows each figure less than it slows a wrk run. Prints µs per
request (the median over ``--rounds``) and the difference to the pool of one; compare it with the
gateway's whole CPU per request (``bench_proxy.py``'s CPU µs/req; one worker's 18,000 req/s on
a quiet machine leave it at most 55 µs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.edge.pool.server_pool import ServerPool, ServerStatsTable
from gateway.edge.runtime import connections_factory
from gateway.policy.models import Upstream

POOLS = {
    "one server (url:)": {"url": "http://127.0.0.1:8001"},
    "two, round_robin": {"servers": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]},
    "two, least_inflight": {
        "servers": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        "balance": "least_inflight",
    },
    "two, hash": {
        "servers": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        "balance": "hash",
        "hash_key": ["client_ip"],
    },
    "two, outlier_detection": {
        "servers": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        "outlier_detection": {},
    },
}


def one_round(pool: ServerPool, requests: int) -> float:
    """µs of this thread's CPU per request."""
    keys = [f"10.0.{n // 256}.{n % 256}" for n in range(1024)]
    started = time.thread_time()
    for n in range(requests):
        member = pool.pick((), keys[n & 1023])
        assert member is not None
        at = pool.started(member)
        pool.answered(member, 200, at)
        pool.finished(member)
    return (time.thread_time() - started) * 1e6 / requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    pools = {}
    for name, spec in POOLS.items():
        config = Upstream.model_validate(spec)
        pools[name] = ServerPool("bench", config, connections_factory(config), ServerStatsTable())
    figures: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds):
        for name, pool in pools.items():  # interleaved: the same moment's noise for each
            figures[name].append(one_round(pool, args.requests))
    base = statistics.median(figures["one server (url:)"])
    print("| pool | µs per request | over one server |")
    print("|---|---:|---:|")
    for name, runs in figures.items():
        median = statistics.median(runs)
        print(f"| {name} | {median:.2f} | {median - base:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

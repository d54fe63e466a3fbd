"""One limited request's own work, outside the server: evaluate -> headers -> metrics.

    python bench/bench_request_path.py --requests 200000 --rounds 5

For each policy of ``limit_policies`` (no limits, one never-binding limit, three stacked), runs
the limit-specific steps the proxy handler takes for one request, in a loop on one event loop,
with the in-process store: the request's key facts and ``LimitEngine.evaluate_now`` (as the
handler calls it for this store), ``LimitEngine.headers`` and their encoding into the response
head, and the observer's ``finished`` (the metrics). Each step is timed in this thread's CPU
time (reading the clock costs some 0.3 µs, the same in every step and policy). Prints µs per
request for each step and in all, the median over ``--rounds``, and the difference to the
policy with no limits. ``--profile FILE`` writes a cProfile of the three-limit loop (``python
-m pstats FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiohttp.test_utils import make_mocked_request  # noqa: E402
from limit_policies import NO_LIMITS, ONE_LIMIT, THREE_LIMITS, policy_text  # noqa: E402

from gateway.edge.forwarding import response_head  # noqa: E402
from gateway.edge.request_record import RequestRecord  # noqa: E402
from gateway.edge.runtime import Runtime, build_runtime  # noqa: E402
from gateway.engine.preflight import load_and_build  # noqa: E402
from gateway.limits.keys import RequestFacts  # noqa: E402
from gateway.limits.routing import normalise_host, routing_path  # noqa: E402
from gateway.observability.worker import (  # noqa: E402
    ObservedHandler,
    WorkerMetrics,
    WorkerState,
)
from gateway.stores.memory import MemoryStore  # noqa: E402

UPSTREAM_HEADERS = ((b"Content-Type", b"text/plain"), (b"Server", b"upstream"))


class _Current:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime


class _Connections:
    open_connections = 0
    refused_connections = 0
    header_timeouts = 0


def setup(kind: str, tmp: Path) -> tuple[Runtime, ObservedHandler]:
    path = tmp / f"{kind}.yaml"
    path.write_text(policy_text(kind, "http://127.0.0.1:9"))
    store = MemoryStore()
    runtime = build_runtime(load_and_build(str(path)), store)
    current = _Current(runtime)
    state = WorkerState(0, current, store, _Connections(), store.clock)
    return runtime, ObservedHandler(current, WorkerMetrics(state))


async def one_round(runtime: Runtime, observer: ObservedHandler, requests: int) -> dict[str, float]:
    """µs per request of each step, over ``requests`` requests from 1,000 client addresses."""
    engine = runtime.engine
    peers = [f"10.0.{i // 256}.{i % 256}" for i in range(1000)]
    request = RequestRecord(
        make_mocked_request("GET", "/api/items", headers={"Host": "example.test"})
    )
    host = normalise_host(request.headers.get("Host"))
    path = routing_path(request.raw_path)
    route = runtime.routes.match(host, path, "GET")
    assert route is not None
    # CPU time of this thread: on a shared machine, time spent preempted is not counted.
    clock = time.thread_time
    spent = {"evaluate": 0.0, "headers": 0.0, "metrics": 0.0}
    via = runtime.via
    for i in range(requests):
        client_ip = peers[i % 1000]
        t0 = clock()
        request.route_name = route.name
        request.client_ip = client_ip
        outcome = None
        if engine.active:
            facts = RequestFacts.of(
                client_ip,
                engine.ipv6_prefix,
                route.name,
                "GET",
                request.headers,
                request.query,
            )
            if engine.decides_now:
                outcome = engine.evaluate_now(facts, route, host, path, client_ip)
            else:
                outcome = await engine.evaluate(facts, route, host, path, client_ip)
        t1 = clock()
        extra = engine.header_block(outcome) if outcome is not None else b""
        response_head(200, b"OK", UPSTREAM_HEADERS, via, extra, 100, True, b"now")
        t2 = clock()
        observer.finished(request, 200, 0.001, outcome)
        t3 = clock()
        spent["evaluate"] += t1 - t0
        spent["headers"] += t2 - t1
        spent["metrics"] += t3 - t2
    per = {step: s * 1e6 / requests for step, s in spent.items()}
    per["total"] = sum(per.values())
    return per


def run(coro: Coroutine[Any, Any, dict[str, float]]) -> dict[str, float]:
    return asyncio.run(coro)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=Path, help="cProfile of the three-limit loop here")
    args = parser.parse_args()
    kinds = (NO_LIMITS, ONE_LIMIT, THREE_LIMITS)
    with tempfile.TemporaryDirectory() as tmp:
        setups = {kind: setup(kind, Path(tmp)) for kind in kinds}
        results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind in kinds:  # interleaved: a burst of foreign load hits all alike
                results[kind].append(run(one_round(*setups[kind], args.requests)))
        if args.profile:
            runtime, observer = setups[THREE_LIMITS]
            profiler = cProfile.Profile()
            step: Callable[[], dict[str, float]] = lambda: run(  # noqa: E731
                one_round(runtime, observer, args.requests)
            )
            profiler.runcall(step)
            profiler.dump_stats(args.profile)
    steps = ("evaluate", "headers", "metrics", "total")
    print("| policy | " + " | ".join(f"{s} µs" for s in steps) + " | total - no limits µs |")
    print("|---|" + "---:|" * (len(steps) + 1))
    base = statistics.median(r["total"] for r in results[NO_LIMITS])
    for kind in kinds:
        medians = [statistics.median(r[s] for r in results[kind]) for s in steps]
        cells = " | ".join(f"{m:.2f}" for m in medians)
        print(f"| {kind} | {cells} | {medians[-1] - base:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

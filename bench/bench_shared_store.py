"""The shared store alone: the cost of one request's decision with three stacked limits, beside
the in-process store and a bare LMDB write transaction (one get and one put) on the same run.

    python bench/bench_shared_store.py --requests 100000 --repeats 5

Each round decides ``--requests`` requests through each store in turn (interleaved, the
median round reported) with the bench's three never-binding limits (leaky bucket per client,
sliding window per client, global token bucket) over ``--keys`` client keys, on the real
monotonic clock. ``shared`` is the ``SharedStore`` on ``/dev/shm`` (a temporary directory
when there is none), as a lone process uses it (one write transaction per request);
``shared, worker of 2`` the same store as a worker of ``--workers 2`` uses it (decided on a
snapshot, then written), here without a second worker, so what it adds when nothing races;
``memory`` the in-process store; ``lmdb get+put`` one write transaction of one get and one
put in the same kind of environment: the floor an LMDB store pays. Each store is called as
the engine calls it on the request path, ``decide_now`` (no coroutine); ``the loop alone``
is the same loop calling a function that returns at once: what the bench itself adds to
every figure.

Wall time by default; ``--cpu`` times each round in this thread's CPU time instead, which
other processes on the machine disturb far less (the figure to compare two trees by).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
sys.path.insert(0, str(REPO_ROOT))

from gateway.algorithms.base import Algorithm  # noqa: E402
from gateway.algorithms.combine import CombinedDecision  # noqa: E402
from gateway.algorithms.leaky_bucket import LeakyBucket  # noqa: E402
from gateway.algorithms.sliding_window import SlidingWindow  # noqa: E402
from gateway.algorithms.token_bucket import TokenBucket  # noqa: E402
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters  # noqa: E402
from gateway.limits.keys import KeyBuilder  # noqa: E402
from gateway.policy.models import LeakyBucketLimit  # noqa: E402
from gateway.stores import MemoryStore, SharedStore  # noqa: E402


def limits() -> list[CompiledLimit]:
    spec = LeakyBucketLimit(algorithm="leaky_bucket", rate="1r/s", key=("client_ip",))
    algorithms: list[tuple[str, Algorithm[Any]]] = [
        ("per_ip", LeakyBucket(1_000_000, 1, 1_000_000, None)),
        ("api", SlidingWindow(1_000_000, 1.0)),
        ("global", TokenBucket(1_000_000, 1, 1_000_000)),
    ]
    return [
        CompiledLimit(name, spec, algorithm, KeyBuilder(("client_ip",)), None, None, 1.0,
                      LimitCounters())
        for name, algorithm in algorithms
    ]  # fmt: skip


class _Nothing:
    """A store that decides nothing: the bench loop's own cost."""

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        pass

    def decide_now(self, checks: Sequence[Check]) -> CombinedDecision:
        return _ADMITTED


_ADMITTED = CombinedDecision(True, 0.0, 0.0, (), None, (), ())


def store_round(
    store: MemoryStore | SharedStore | _Nothing,
    requests: int,
    keys: int,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[[], Awaitable[float]]:
    stack = limits()
    store.configure(stack, ())
    checks = [[Check(limit, f"10.0.{i // 256}.{i % 256}") for limit in stack] for i in range(keys)]
    checks[0][2] = Check(stack[2], "global")

    async def run() -> float:
        decide_now = store.decide_now
        started = clock()
        for index in range(requests):
            request = checks[index % keys]
            request[2] = checks[0][2]
            if not decide_now(request)[0]:  # allowed
                raise SystemExit("a never-binding limit rejected a request")
        return (clock() - started) / requests * 1e6

    return run


def lmdb_round(
    path: Path, requests: int, keys: int, clock: Callable[[], float] = time.perf_counter
) -> Callable[[], Awaitable[float]]:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=4, sync=False, metasync=False,
                    writemap=True, readahead=False, meminit=False)  # fmt: skip
    db = env.open_db(b"state")
    names = [f"10.0.{i // 256}.{i % 256}".encode() for i in range(keys)]

    async def run() -> float:
        started = clock()
        for index in range(requests):
            key = names[index % keys]
            with env.begin(write=True) as txn:
                txn.get(key, db=db)
                txn.put(key, b"\x00" * 17, db=db)
        return (clock() - started) / requests * 1e6

    return run


async def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--cpu", action="store_true", help="thread CPU time, not wall time")
    args = parser.parse_args(argv)
    clock = time.thread_time if args.cpu else time.perf_counter
    base = SHM
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        shared = SharedStore(Path(tmp) / "shared")
        worker = SharedStore(Path(tmp) / "worker", workers=2)
        rounds = {
            "memory": store_round(MemoryStore(), args.requests, args.keys, clock),
            "shared": store_round(shared, args.requests, args.keys, clock),
            "shared, worker of 2": store_round(worker, args.requests, args.keys, clock),
            "the loop alone": store_round(_Nothing(), args.requests, args.keys, clock),
            "lmdb get+put": lmdb_round(Path(tmp) / "raw", args.requests, args.keys, clock),
        }
        times: dict[str, list[float]] = {name: [] for name in rounds}
        for _ in range(args.repeats):
            for name, run in rounds.items():
                times[name].append(await run())
        await shared.close()
        await worker.close()
    timed = "CPU" if args.cpu else "wall"
    print(f"| store ({args.requests:,} requests x {args.repeats}, {args.keys} keys) "
          f"| us per request ({timed}, median) | min | max |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for name, measured in times.items():
        print(f"| {name} | {statistics.median(measured):.2f} | {min(measured):.2f} "
              f"| {max(measured):.2f} |")  # fmt: skip
    memory = statistics.median(times["memory"])
    print(f"\nshared - memory: {statistics.median(times['shared']) - memory:.2f} us per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

"""The store's own CPU per request, outside the server: ``store.decide`` for the three example
limits (bench_store.py's policy), in process, per request on Redis, and with the global limit
leased.

    python bench/bench_store_decide.py --decides 30000 --rounds 5

64 callers await ``store.decide`` together on one uvloop (so the Redis client pipelines as it
does under load), each for its share of ``--decides``; the figure is this thread's CPU time over
the decisions made, in µs per decision, the median over rounds run in turn; then Redis's own
side (``INFO commandstats``): script calls per decision and Redis's µs per script call and per
decision, which depend little on the gateway's machine. A ``redis-server``
of its own on a free port (``--redis URL`` for another). The in-process store's figure is the
floor: the difference is what a Redis call, or a lease, costs the gateway per request.

commandstats counts only the time inside the script: Redis also reads, parses and answers each
pipeline, work that grows with the round trips. So the second table also gives Redis's whole
CPU per decision (``INFO``'s ``used_cpu_user`` + ``used_cpu_sys`` over the decisions, a Redis
of its own: other clients' work counts too) and the round trips per decision; ``--callers 1,64``
measures each kind with one caller (a round trip per decision) and with 64.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from gateway.algorithms.registry import build_algorithm
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import Policy
from gateway.stores import LimitStore, MemoryStore, RedisStore
from gateway.stores.redis.clients import ThinClient

CALLERS = 64
# redis-evalsha: the same decisions as redis, sent as EVALSHA of the whole script (a Redis
# before 7, or one that refuses functions) instead of FCALL of the loaded library.
# redis-leased leases the global bucket; redis-leased-all all three limits.
KINDS = ("memory", "redis", "redis-evalsha", "redis-leased", "redis-leased-all")
_prefixes = itertools.count()


def example_limits(leased: bool, all_leased: bool = False) -> list[CompiledLimit]:
    specs = {
        "per_ip": {
            "algorithm": "leaky_bucket",
            "rate": "1000000r/s",
            "burst": 1000000,
            "nodelay": True,
            "key": ["client_ip"],
            **({"lease": {}} if all_leased else {}),
        },
        "api": {
            "algorithm": "sliding_window",
            "limit": 1000000,
            "window": "1s",
            "key": ["client_ip"],
            **({"lease": {}} if all_leased else {}),
        },
        "global": {
            "algorithm": "token_bucket",
            "rate": "1000000r/s",
            "burst": 1000000,
            "key": ["global"],
            **({"lease": {}} if leased or all_leased else {}),
        },
    }
    policy = Policy.model_validate({"limits": specs})
    return [
        CompiledLimit(
            name,
            spec,
            build_algorithm(spec),
            KeyBuilder(spec.key),
            None,
            None,
            1.0,
            LimitCounters(),
        )
        for name, spec in policy.limits.items()
    ]


SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
CPU_FIELDS = ("used_cpu_user", "used_cpu_sys")


def script_stats(url: str) -> tuple[int, float, float]:
    """Script calls Redis has run and the microseconds it spent in them (``INFO
    commandstats``: EVALSHA, EVAL, FCALL): Redis's own CPU, apart from the gateway's; and the
    whole process's CPU in µs (``INFO cpu``), network work included."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2.0) as sock:
        sock.sendall(b"INFO everything\r\n")
        data = b""
        while not data.endswith(b"\r\n\r\n") and len(data) < 1 << 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    calls, usec, cpu_us = 0, 0.0, 0.0
    for line in data.decode(errors="replace").splitlines():
        name, _, fields = line.partition(":")
        if name in SCRIPT_COMMANDS:
            values = dict(field.split("=", 1) for field in fields.split(","))
            calls += int(values["calls"])
            usec += float(values["usec"])
        elif name in CPU_FIELDS:
            cpu_us += float(fields) * 1e6
    return calls, usec, cpu_us


@dataclass(frozen=True, slots=True)
class RedisSide:
    """One round's Redis figures, per decision unless said."""

    calls: float  # script calls
    usec_per_call: float  # commandstats: inside the script
    cpu_us: float  # the whole redis-server process (network included)
    round_trips: float  # pipelines the store sent


# Per kind and round: what Redis did.
REDIS_FIGURES: dict[str, list[RedisSide]] = {}


async def cpu_per_decide(kind: str, url: str, decides: int, callers: int = CALLERS) -> float:
    limits = example_limits(kind == "redis-leased", kind == "redis-leased-all")
    store: LimitStore
    if kind == "memory":
        store = MemoryStore()
    else:
        store = RedisStore(url, key_prefix=f"decide{next(_prefixes)}:{time.time()}:", timeout_s=0.5)
        if kind == "redis-evalsha":
            client = store.client
            assert isinstance(client, ThinClient)
            client.use_script("compared in bench_store_decide.py")
    store.configure(limits, ())
    checks = [
        Check(limits[0], "203.0.113.7"),
        Check(limits[1], "203.0.113.7"),
        Check(limits[2], ""),
    ]

    async def caller(count: int) -> None:
        for _ in range(count):
            if not (await store.decide(checks)).allowed:
                raise RuntimeError("a decision was a rejection: the limits are set never to bind")

    try:
        await asyncio.gather(*(caller(200) for _ in range(callers)))  # connect, first leases
        each = decides // callers
        made = each * callers
        before = script_stats(url) if kind != "memory" else (0, 0.0, 0.0)
        trips_before = store.round_trips if isinstance(store, RedisStore) else 0
        started = time.thread_time()
        await asyncio.gather(*(caller(each) for _ in range(callers)))
        cpu_us = (time.thread_time() - started) / made * 1e6
        if isinstance(store, RedisStore):
            after = script_stats(url)
            calls = after[0] - before[0]
            side = RedisSide(
                calls / made,
                (after[1] - before[1]) / max(calls, 1),
                (after[2] - before[2]) / made,
                (store.round_trips - trips_before) / made,
            )
            REDIS_FIGURES.setdefault(f"{kind}, {callers} callers", []).append(side)
        return cpu_us
    finally:
        await store.close()


async def measure(
    url: str, decides: int, rounds: int, kinds: Sequence[str], callers: Sequence[int]
) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        for kind in kinds:
            for count in callers:
                name = kind if count == CALLERS else f"{kind}, {count} callers"
                figures.setdefault(name, []).append(await cpu_per_decide(kind, url, decides, count))
    return figures


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decides", type=int, default=30000, help="decisions per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis", help="a Redis URL (default: start redis-server)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    parser.add_argument(
        "--callers", default=str(CALLERS), help="comma-separated callers in flight (e.g. 1,64)"
    )
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {', '.join(sorted(unknown))}: pick of {', '.join(KINDS)}")
    callers = [int(count) for count in args.callers.split(",")]
    server: subprocess.Popen[bytes] | None = None
    url = args.redis
    with tempfile.TemporaryDirectory(prefix="bench-decide-") as tmp:
        if url is None:
            binary = shutil.which("redis-server")
            if binary is None:
                print("bench_store_decide.py: redis-server not found", file=sys.stderr)
                return 2
            port = free_port()
            argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
            argv += ["--appendonly", "no", "--dir", tmp]
            server = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
            )
            url = f"redis://127.0.0.1:{port}"
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        try:
            figures = uvloop.run(measure(url, args.decides, args.rounds, kinds, callers))
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)
    floor = statistics.median(figures["memory"]) if "memory" in figures else 0.0
    print("| store | CPU µs / decide (median) | rounds | over memory |")
    print("|---|---:|---|---:|")
    for kind, values in figures.items():
        median = statistics.median(values)
        rounded = ", ".join(f"{value:.1f}" for value in values)
        print(f"| {kind} | {median:.2f} | {rounded} | {median - floor:+.2f} |")
    print()
    print(
        "| store | script calls / decide | Redis µs / script call | Redis µs / decide "
        "| Redis CPU µs / decide (whole process) | round trips / decide |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind, sides in REDIS_FIGURES.items():
        per_decide = statistics.median(side.calls for side in sides)
        per_call = statistics.median(side.usec_per_call for side in sides)
        redis_us = statistics.median(side.calls * side.usec_per_call for side in sides)
        cpu_us = statistics.median(side.cpu_us for side in sides)
        trips = statistics.median(side.round_trips for side in sides)
        print(
            f"| {kind} | {per_decide:.3f} | {per_call:.2f} | {redis_us:.2f} | {cpu_us:.2f} "
            f"| {trips:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

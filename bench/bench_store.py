"""In-process store vs Redis store, same run: requests/s and p99 through the gateway with the
three example limits stacked (per-client leaky bucket, per-client sliding window, global token
bucket), and the Redis round trips each request cost.

    python bench/bench_store.py --duration 10 --repeats 3 --connections 64

Every target is one gateway worker with the same policy in front of the same upstream, loaded
by ``wrk`` in interleaved rounds (see bench/README.md for the method and the CPU plan): the
gateway on a core of its own, wrk, the upstream and Redis on the other. The limits are set
high enough that every request is admitted, so each target does the full work of a request:
decide all three limits, forward, answer. The Redis call timeout here is 0.5 s (the store's
default is 50 ms) so that a stall of the shared machine does not turn Redis decisions into
local ones; the table counts the decisions made locally anyway. Besides req/s and p99, the
gateway's own CPU time per request (from /proc) is the steadier figure on a busy machine.
Targets:

* ``memory``: the in-process store;
* ``redis``: ``RedisStore`` on one ``redis-server``, with its own pipelined hiredis client;
* ``redis-py``: the same with redis-py's asyncio pipelines instead (to compare);
* ``redis-cluster``: ``RedisStore`` on a 3-master Redis Cluster (with ``--cluster``);
* ``redis-leased``, ``redis-cluster-leased``: the same three limits with the global one leased
  (``lease: {}``): the two per-client limits still make one script call per request, the
  global one takes batches of its quota now and then. On the cluster the per-client calls
  then carry the client's address as their hash tag (no longer the fixed tag a global limit
  forces), and the table below the main one gives each master's script calls per request.
* ``memory-global``, ``redis-global``, ``redis-leased-global``: the global limit alone, in
  process, per request on Redis, and leased (their "vs memory" is against ``memory-global``):
  what leasing costs once no other limit makes a call per request.
* ``memory-1w``: ``gateway run --workers 1`` with the in-process store (``memory`` through the
  CLI, to compare with the CLI targets below);
* ``shared-1w``, ``shared-2w``: ``gateway run --workers 1`` / ``2`` with ``store.url: shared``
  (the workers share one LMDB state on ``/dev/shm``), on one core / on both;
* ``redis-2w``: ``gateway run --workers 2`` on the Redis server;
* ``bare-1w``, ``bare-2w``: ``gateway run --workers 1`` / ``2`` with no limits, the ceiling
  of the targets above.

Beside each target's CPU, the load generators' (wrk's and the upstream's CPU per request)
and the machine's idle share during its runs. A 2-worker target shares both cores with
them, so on 2 cores its req/s can reach at most 2 s of CPU per second over the CPU a
request costs the gateway and the load generators together: the line under the table
gives that ceiling as a multiple of the 1-worker peer (which has a core of its own).

``--upstream nginx`` puts nginx (one worker, ``return 200`` with the same 100-byte body and
Content-Type; nginx adds its Server, Date and Connection headers) in place of the default
Python upstream (``bench/upstream.py``, httptools on uvloop). It is there to tell the upstream's
own cost from the kernel's: the load generators' CPU per request bounds that ceiling, and the
table gives in brackets the upstream's part of it (nginx's master and worker, its process
group, counted as the Python upstream's is). ``--threads`` is wrk's thread count. What both
showed is in bench/README.md.

The multi-worker targets run the CLI (its supervisor and forked workers); their CPU time is
the whole process group's.

``serve`` is the launcher the harness runs for each target. The CLI selects a store too
(``store.url`` or ``GATEWAY_STORE_URL``), but not the client nor ``max_in_flight``, and it
does not print the store's counters (round trips, local decisions) at exit; ``serve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import resource
import shlex
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_proxy as bp  # noqa: E402  (the shared harness: processes, wrk, readiness)

MEMORY = "memory"
REDIS = "redis"
REDIS_PY = "redis-py"
REDIS_CLUSTER = "redis-cluster"
MEMORY_1W = "memory-1w"
SHARED_1W = "shared-1w"
SHARED_2W = "shared-2w"
REDIS_2W = "redis-2w"
BARE_2W = "bare-2w"
BARE_1W = "bare-1w"
CLI_TARGETS = (MEMORY_1W, SHARED_1W, SHARED_2W, REDIS_2W, BARE_1W, BARE_2W)
# A 2-worker target and its 1-worker peer: the scaling line under the table.
SCALING = ((SHARED_2W, SHARED_1W), (BARE_2W, BARE_1W))
REDIS_LEASED = "redis-leased"
REDIS_CLUSTER_LEASED = "redis-cluster-leased"
MEMORY_GLOBAL = "memory-global"
REDIS_GLOBAL = "redis-global"
REDIS_LEASED_GLOBAL = "redis-leased-global"
# --upstream: the harness's upstream implementation for each choice.
PYTHON_UPSTREAM = "python"
UPSTREAMS = {PYTHON_UPSTREAM: "httptools", bp.NGINX_UPSTREAM: bp.NGINX_UPSTREAM}
STATS_RE = re.compile(r"^STORE_STATS (.*)$", re.MULTILINE)

POLICY = """\
version: 1
server:
  listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
upstreams:
  backend:
    url: http://127.0.0.1:{upstream_port}
routes:
  - name: api
    upstream: backend
limits:
  # The layered example's three limits (policies/layered.yaml), rates raised so that the
  # benchmark's single client is never limited: every request pays for all three decisions.
  per_ip:
    algorithm: leaky_bucket
    rate: 1000000r/s
    burst: 1000000
    nodelay: true
    key: [client_ip]
  api:
    algorithm: sliding_window
    limit: 1000000
    window: 1s
    key: [client_ip]
  global:
    algorithm: token_bucket
    rate: 1000000r/s
    burst: 1000000
    key: [global]
"""
LEASE = "    lease: {}\n"
# The global limit alone (the last of the three).
GLOBAL_ONLY = POLICY.split("  per_ip:")[0] + "  global:" + POLICY.split("  global:")[1]


# --- the launcher -------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    from gateway.engine.preflight import load_and_build
    from gateway.serving.lifecycle import Gateway
    from gateway.stores import LimitStore, MemoryStore, RedisStore

    loaded = load_and_build(args.policy)
    store: LimitStore
    if args.store == "memory":
        store = MemoryStore()
    else:
        store = RedisStore(
            args.store,
            key_prefix=args.key_prefix,
            max_in_flight=args.in_flight,
            client=args.client,
            timeout_s=args.timeout,
        )
    gateway = Gateway(loaded, listen=args.listen, admin_listen=args.admin_listen, store=store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await gateway.start()
    try:
        await stop.wait()
    finally:
        if isinstance(store, RedisStore):
            lease_calls = sum(c.calls for c in store.leases.counters.values())
            counters = {
                **dataclasses.asdict(store.counters),
                "lease_calls": lease_calls,
                "round_trips": store.round_trips,
                # Per node (a cluster's masters; "" a single server).
                "circuit_transitions": {
                    node: breaker.transitions
                    for node, breaker in store.circuits.breakers().items()
                    if breaker.transitions
                },
            }
            print("STORE_STATS " + json.dumps(counters), flush=True)
        await gateway.stop()


def serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_store.py serve")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--store", required=True, help="memory or a redis URL")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--admin-listen", required=True)
    parser.add_argument("--key-prefix", default="bench:")
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--client", choices=("thin", "redis-py"), default="thin")
    parser.add_argument("--timeout", type=float, default=0.05)
    args = parser.parse_args(argv)
    from gateway.serving.lifecycle import run_event_loop

    profile_to = os.environ.get("BENCH_STORE_PROFILE")
    if not profile_to:
        run_event_loop(lambda: serve(args))
        return 0
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run_event_loop(lambda: serve(args))
    finally:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{args.store.partition(':')[0]}")
    return 0


# --- the harness --------------------------------------------------------------------------------


def start_redis(procs: bp.Processes, work_dir: Path, cpus: str) -> tuple[bp.Started, int]:
    port = bp.free_port()
    argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(work_dir)]
    started = procs.start(f"redis-{port}", bp.pinned(cpus, argv))
    return started, port


def start_cluster(procs: bp.Processes, work_dir: Path, cpus: str) -> list[int]:
    """Three cluster-enabled redis-servers joined by ``redis-cli --cluster create``."""
    import subprocess
    import time

    ports = []
    for index in range(3):
        node_dir = work_dir / f"cluster-node{index}"
        node_dir.mkdir()
        port, bus_port = bp.free_port(), bp.free_port()
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes"]
        argv += ["--cluster-port", str(bus_port), "--cluster-config-file", "nodes.conf"]
        procs.start(f"cluster-node{index}", bp.pinned(cpus, argv))
        ports.append(port)
    deadline = time.monotonic() + 10
    while not all(_redis_ping(port) for port in ports):
        if time.monotonic() > deadline:
            raise bp.StartError("cluster nodes did not answer PING within 10 s")
        time.sleep(0.05)
    create = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports]]
    create += ["--cluster-replicas", "0", "--cluster-yes"]
    subprocess.run(create, capture_output=True, check=True, timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        infos = [
            subprocess.run(
                ["redis-cli", "-p", str(p), "CLUSTER", "INFO"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
            for p in ports
        ]
        if all("cluster_state:ok" in info for info in infos):
            return ports
        time.sleep(0.1)
    raise bp.StartError("cluster did not reach cluster_state:ok within 30 s")


def script_calls(port: int) -> int:
    """Script calls (FCALL, EVALSHA, EVAL) a Redis server has answered."""
    import subprocess

    out = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "commandstats"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout
    found = re.findall(r"^cmdstat_(?:fcall|evalsha|eval):calls=(\d+)", out, re.MULTILINE)
    return sum(int(n) for n in found)


def _redis_ping(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_gateway(
    procs: bp.Processes,
    name: str,
    policy: Path,
    store_url: str,
    cpus: str,
    in_flight: int,
    client: str = "thin",
    timeout_s: float = 0.5,
) -> bp.RunningTarget:
    port, admin_port = bp.free_port(), bp.free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "serve", "--policy", str(policy)]
    argv += ["--store", store_url, "--listen", f"127.0.0.1:{port}"]
    argv += ["--admin-listen", f"127.0.0.1:{admin_port}", "--in-flight", str(in_flight)]
    argv += ["--client", client, "--timeout", str(timeout_s)]
    started = procs.start(name, bp.pinned(cpus, argv), cwd=REPO_ROOT)
    try:
        bp.wait_ready(started, [bp.healthz(admin_port), bp.serves_body(port)], bp.READY_TIMEOUT_S)
    except BaseException:
        procs.stop(started)
        raise
    return bp.RunningTarget(name, f"http://127.0.0.1:{port}/", started, shlex.join(argv[2:]))


def start_cli_gateway(
    procs: bp.Processes,
    name: str,
    policy: Path,
    workers: int,
    cpus: str,
    env: dict[str, str],
) -> bp.RunningTarget:
    """``gateway run --workers N`` (the supervisor and its workers in one process group)."""
    port, admin_port = bp.free_port(), bp.free_port()
    argv = [sys.executable, "-m", "gateway", "run", "--config", str(policy)]
    argv += ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"]
    argv += ["--workers", str(workers)]
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        started = procs.start(name, bp.pinned(cpus, argv), cwd=REPO_ROOT)
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        bp.wait_ready(started, [bp.healthz(admin_port), bp.serves_body(port)], bp.READY_TIMEOUT_S)
    except BaseException:
        procs.stop(started)
        raise
    note = " ".join(f"{k}=..." for k in env) + " " + shlex.join(argv[2:])
    return bp.RunningTarget(name, f"http://127.0.0.1:{port}/", started, note)


def target_cpu_seconds(target: bp.RunningTarget) -> float:
    """The CPU time of a target's whole process group (a supervisor and its workers)."""
    return bp.process_group_cpu(target.started.proc.pid)[0]


def load_generators_cpu_seconds(upstream: bp.RunningTarget) -> tuple[float, float]:
    """CPU seconds of every wrk run so far (the children this process has waited for: wrk,
    through ``taskset``'s exec) and of the upstream's process group (bench/upstream.py's
    process, or nginx's master and worker)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    upstream_s = bp.process_group_cpu(upstream.started.proc.pid)[0]
    return children.ru_utime + children.ru_stime, upstream_s


def machine_idle() -> tuple[int, int]:
    """The machine's idle and total jiffies so far (``/proc/stat``, all CPUs)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def machine_idle_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0


def scaling_lines(
    summaries: Sequence[Summary],
    cpu_per_request: dict[tuple[str, int], list[float]],
    loaders_per_request: dict[tuple[str, int], list[float]],
) -> list[str]:
    """For each 2-worker target beside its 1-worker peer: the scaling measured, and the most
    two cores could give it with the load generators on them too."""
    rates = {(s.target, s.connections): s.requests_per_s for s in summaries}
    cores = min(2, len(os.sched_getaffinity(0)))
    lines = []
    for (two, one), conns in itertools.product(SCALING, sorted({s.connections for s in summaries})):
        if (two, conns) not in rates or (one, conns) not in rates:
            continue
        per_request_us = statistics.median(cpu_per_request[(two, conns)]) + statistics.median(
            loaders_per_request[(two, conns)]
        )
        ceiling = cores * 1e6 / per_request_us
        lines.append(
            f"\n{two} (c={conns}): {rates[(two, conns)] / rates[(one, conns)]:.2f}x {one}; "
            f"{cores} cores at {per_request_us:.0f} us of CPU per request (the gateway's and "
            f"the load generators') allow at most {ceiling:,.0f} req/s, "
            f"{ceiling / rates[(one, conns)]:.2f}x {one}"
        )
    return lines


def store_stats(target: bp.RunningTarget) -> dict[str, Any] | None:
    """The store counters the launcher prints when it is stopped."""
    found = STATS_RE.findall(target.started.log_path.read_text(errors="replace"))
    return json.loads(found[-1]) if found else None


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    target: str
    connections: int
    requests_per_s: float  # medians over the rounds
    requests_per_s_min: float
    requests_per_s_max: float
    p50_ms: float
    p99_ms: float
    failed_requests: int  # non-2xx, timeouts, connect and write errors, over all rounds


def summarise(target: str, connections: int, results: Sequence[bp.WrkResult]) -> Summary:
    rates = [r.requests_per_s for r in results]
    return Summary(
        target,
        connections,
        statistics.median(rates),
        min(rates),
        max(rates),
        statistics.median(r.p50_ms for r in results),
        statistics.median(r.p99_ms for r in results),
        sum(r.non_2xx + r.timeouts + r.connect_errors + r.write_errors for r in results),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--connections", default="64", help="comma list of wrk -c values")
    parser.add_argument("--threads", type=int, default=2, help="wrk -t")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load")
    parser.add_argument("--cluster", action="store_true", help="also a 3-master Redis Cluster")
    parser.add_argument("--in-flight", type=int, default=4, help="RedisStore max_in_flight")
    parser.add_argument(
        "--targets",
        default=f"{MEMORY},{REDIS},{REDIS_PY}",
        help=f"comma list from {MEMORY},{REDIS},{REDIS_PY},{REDIS_LEASED},{MEMORY_GLOBAL},"
        f"{REDIS_GLOBAL},{REDIS_LEASED_GLOBAL},{','.join(CLI_TARGETS)} "
        f"(--cluster adds {REDIS_CLUSTER})",
    )
    parser.add_argument("--pin", choices=("split", "none"), default="split")
    parser.add_argument(
        "--upstream",
        choices=tuple(UPSTREAMS),
        default=PYTHON_UPSTREAM,
        help="python: bench/upstream.py (httptools, uvloop); nginx: one nginx worker answering"
        " the same body (see bench/README.md)",
    )
    parser.add_argument("--json", type=Path, help="write all runs and the summary here")
    args = parser.parse_args(argv)
    args.connections = [int(c) for c in args.connections.split(",") if c]
    args.targets = [t for t in args.targets.split(",") if t]
    if args.repeats < 1 or args.duration <= 0 or not args.connections:
        parser.error("--repeats >= 1, --duration > 0 and at least one connection count")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    args = parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, bp._raise_keyboard_interrupt)
    # The gateway under test gets a core of its own; wrk, the upstream and Redis share the other.
    plan = bp.CpuPlan.for_mode(args.pin)
    loadavg_before = os.getloadavg()
    results: dict[tuple[str, int], list[bp.WrkResult]] = {}
    cpu_per_request: dict[tuple[str, int], list[float]] = {}
    loaders_per_request: dict[tuple[str, int], list[float]] = {}
    upstream_per_request: dict[tuple[str, int], list[float]] = {}  # the upstream's part of it
    idle_shares: dict[tuple[str, int], list[float]] = {}
    stats: dict[str, dict[str, Any] | None] = {}
    requests: dict[str, int] = {}
    # The shared store's state where a gateway keeps it by default: memory (``/dev/shm``), not
    # the disk the work directory is on.
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-store-") as tmp,
        tempfile.TemporaryDirectory(prefix="bench-store-", dir=shm) as shared_tmp,
    ):
        work_dir = Path(tmp)
        procs = bp.Processes(work_dir)
        try:
            harness = bp.Harness(procs, work_dir, plan, UPSTREAMS[args.upstream])
            upstream = bp.start_with_retries(harness.start_upstream)
            policy = work_dir / "policy.yaml"
            policy.write_text(POLICY.format(upstream_port=harness.upstream_port))
            leased = work_dir / "leased.yaml"
            leased.write_text(POLICY.format(upstream_port=harness.upstream_port) + LEASE)
            global_only = work_dir / "global.yaml"
            global_only.write_text(GLOBAL_ONLY.format(upstream_port=harness.upstream_port))
            global_leased = work_dir / "global-leased.yaml"
            global_leased.write_text(
                GLOBAL_ONLY.format(upstream_port=harness.upstream_port) + LEASE
            )
            _, redis_port = start_redis(procs, work_dir, plan.upstream)
            starters: dict[str, Callable[[], bp.RunningTarget]] = {
                MEMORY: lambda: start_gateway(
                    procs, MEMORY, policy, "memory", plan.single_proxy, args.in_flight
                ),
                REDIS: lambda: start_gateway(
                    procs,
                    REDIS,
                    policy,
                    f"redis://127.0.0.1:{redis_port}",
                    plan.single_proxy,
                    args.in_flight,
                ),
                REDIS_PY: lambda: start_gateway(
                    procs,
                    REDIS_PY,
                    policy,
                    f"redis://127.0.0.1:{redis_port}",
                    plan.single_proxy,
                    args.in_flight,
                    client="redis-py",
                ),
                REDIS_LEASED: lambda: start_gateway(
                    procs,
                    REDIS_LEASED,
                    leased,
                    f"redis://127.0.0.1:{redis_port}",
                    plan.single_proxy,
                    args.in_flight,
                ),
            }
            redis_url = f"redis://127.0.0.1:{redis_port}"
            for name, policy_file, store_url in (
                (MEMORY_GLOBAL, global_only, "memory"),
                (REDIS_GLOBAL, global_only, redis_url),
                (REDIS_LEASED_GLOBAL, global_leased, redis_url),
            ):
                starters[name] = functools.partial(
                    start_gateway,
                    procs,
                    name,
                    policy_file,
                    store_url,
                    plan.single_proxy,
                    args.in_flight,
                )
            bare = work_dir / "bare.yaml"
            bare.write_text(POLICY.split("limits:")[0].format(upstream_port=harness.upstream_port))
            shared_env = {"GATEWAY_SHARED_DIR": shared_tmp, "GATEWAY_STORE_URL": "shared"}
            redis_env = {"GATEWAY_STORE_URL": f"redis://127.0.0.1:{redis_port}"}
            cli: tuple[tuple[str, Path, int, str, dict[str, str]], ...] = (
                (MEMORY_1W, policy, 1, plan.single_proxy, {"GATEWAY_STORE_URL": "memory"}),
                (SHARED_1W, policy, 1, plan.single_proxy, shared_env),
                (SHARED_2W, policy, 2, plan.multi_proxy, shared_env),
                (REDIS_2W, policy, 2, plan.multi_proxy, redis_env),
                (BARE_1W, bare, 1, plan.single_proxy, {}),
                (BARE_2W, bare, 2, plan.multi_proxy, {}),
            )
            for name, policy_file, workers, cpus, env in cli:
                starters[name] = functools.partial(
                    start_cli_gateway, procs, name, policy_file, workers, cpus, env
                )
            starters = {name: start for name, start in starters.items() if name in args.targets}
            cluster_ports: list[int] = []
            if args.cluster:
                cluster_ports = start_cluster(procs, work_dir, plan.upstream)
                cluster_url = f"redis+cluster://127.0.0.1:{cluster_ports[0]}"
                starters[REDIS_CLUSTER] = lambda: start_gateway(
                    procs, REDIS_CLUSTER, policy, cluster_url, plan.single_proxy, args.in_flight
                )
                if REDIS_LEASED in args.targets:
                    starters[REDIS_CLUSTER_LEASED] = lambda: start_gateway(
                        procs,
                        REDIS_CLUSTER_LEASED,
                        leased,
                        cluster_url,
                        plan.single_proxy,
                        args.in_flight,
                    )
            # Script calls each cluster master answered during each target's measured runs.
            node_calls: dict[str, list[int]] = {}
            running = [bp.start_with_retries(start) for start in starters.values()]
            if args.warmup > 0:
                for target in running:
                    bp.log(f"bench: warm-up {target.name}")
                    warm = bp.run_wrk(
                        target.url, max(args.connections), args.warmup, args.threads, plan.wrk
                    )
                    requests[target.name] = warm.requests
            for round_no in range(1, args.repeats + 1):
                for connections in args.connections:
                    for target in running:
                        # redis-cli (script_calls) is a waited child too: before the loaders.
                        nodes_before = [script_calls(port) for port in cluster_ports]
                        cpu_before = target_cpu_seconds(target)
                        loaders_before = load_generators_cpu_seconds(upstream)
                        idle_before = machine_idle()
                        result = bp.run_wrk(
                            target.url, connections, args.duration, args.threads, plan.wrk
                        )
                        cpu_us = (target_cpu_seconds(target) - cpu_before) * 1e6
                        wrk_after, upstream_after = load_generators_cpu_seconds(upstream)
                        wrk_us = (wrk_after - loaders_before[0]) * 1e6
                        upstream_us = (upstream_after - loaders_before[1]) * 1e6
                        loaders_us = wrk_us + upstream_us
                        idle = machine_idle_share(idle_before, machine_idle())
                        loaders_per_request.setdefault((target.name, connections), []).append(
                            loaders_us / max(result.requests, 1)
                        )
                        upstream_per_request.setdefault((target.name, connections), []).append(
                            upstream_us / max(result.requests, 1)
                        )
                        idle_shares.setdefault((target.name, connections), []).append(idle)
                        if "cluster" in target.name:
                            calls_now = [script_calls(port) for port in cluster_ports]
                            sums = node_calls.setdefault(target.name, [0] * len(cluster_ports))
                            for index, (after, before) in enumerate(
                                zip(calls_now, nodes_before, strict=True)
                            ):
                                sums[index] += after - before
                            node_calls[target.name + " requests"] = [
                                node_calls.get(target.name + " requests", [0])[0] + result.requests
                            ]
                        cpu_per_request.setdefault((target.name, connections), []).append(
                            cpu_us / max(result.requests, 1)
                        )
                        bp.log(
                            f"bench: round {round_no} {target.name:<13} c={connections:<4} "
                            f"{result.requests_per_s:>9,.0f} req/s  p99 {result.p99_ms:.2f} ms"
                            f"  CPU {cpu_per_request[(target.name, connections)][-1]:.0f} us/req"
                            f" (wrk {wrk_us / max(result.requests, 1):.0f}"
                            f" + upstream {upstream_us / max(result.requests, 1):.0f})"
                            f"  idle {idle:.0%}"
                            f"  non-2xx {result.non_2xx}"
                        )
                        results.setdefault((target.name, connections), []).append(result)
                        requests[target.name] = requests.get(target.name, 0) + result.requests
            for target in running:
                procs.stop(target.started)
                stats[target.name] = store_stats(target)
        except KeyboardInterrupt:
            bp.log("bench: interrupted; stopping everything")
            return 130
        finally:
            procs.stop_all()
    summaries = [summarise(name, conns, runs) for (name, conns), runs in results.items()]
    lines = [
        "| store | conns | req/s (median) | req/s min-max | p50 ms | p99 ms | vs memory "
        "| gateway CPU us / request | wrk+upstream CPU us / request (upstream) | machine idle "
        "| script calls / request | round trips / request | decided locally | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory_rps = {
        (s.target, s.connections): s.requests_per_s
        for s in summaries
        if s.target in (MEMORY, MEMORY_GLOBAL)
    }
    document: dict[str, Any] = {
        "summary": [],
        "command": shlex.join([sys.executable, *sys.argv]),
        "upstream": args.upstream,
        "threads": args.threads,
    }
    for s in summaries:
        baseline = memory_rps.get(
            (MEMORY_GLOBAL if s.target.endswith("-global") else MEMORY, s.connections)
        )
        ratio = s.requests_per_s / baseline if baseline else 0
        cpu_us = statistics.median(cpu_per_request[(s.target, s.connections)])
        counters = stats.get(s.target)
        # Counters cover warm-up too (and a few readiness probes): divide by all wrk served.
        served = requests.get(s.target, 0)
        calls = rts = local = "-"
        if counters and served:
            calls = f"{(counters['calls'] + counters.get('lease_calls', 0)) / served:.4f}"
            rts = f"{counters['round_trips'] / served:.3f}"
            local = str(counters["local_decisions"])
        lines.append(
            f"| {s.target} | {s.connections} | {s.requests_per_s:,.0f} "
            f"| {s.requests_per_s_min:,.0f}-{s.requests_per_s_max:,.0f} | {s.p50_ms:.2f} "
            f"| {s.p99_ms:.2f} | {ratio:.2f} | {cpu_us:.0f} "
            f"| {statistics.median(loaders_per_request[(s.target, s.connections)]):.0f} "
            f"({statistics.median(upstream_per_request[(s.target, s.connections)]):.0f}) "
            f"| {statistics.median(idle_shares[(s.target, s.connections)]):.0%} "
            f"| {calls} | {rts} | {local} "
            f"| {s.failed_requests} |"
        )
        document["summary"].append(
            {
                **dataclasses.asdict(s),
                "vs_memory": ratio,
                "cpu_us_per_request": cpu_us,
                "loaders_us_per_request": statistics.median(
                    loaders_per_request[(s.target, s.connections)]
                ),
                "upstream_us_per_request": statistics.median(
                    upstream_per_request[(s.target, s.connections)]
                ),
                "machine_idle": statistics.median(idle_shares[(s.target, s.connections)]),
            }
        )
    lines += scaling_lines(summaries, cpu_per_request, loaders_per_request)
    for name in (REDIS_CLUSTER, REDIS_CLUSTER_LEASED):
        if name in node_calls:
            measured = node_calls[name + " requests"][0]
            per_node = ", ".join(f"{calls / max(measured, 1):.3f}" for calls in node_calls[name])
            lines.append(f"\n{name}: script calls per request on each master: {per_node}")
    document["node_calls"] = node_calls
    document["store_stats"] = stats
    document["wrk_requests"] = requests
    document["loadavg"] = {"before": loadavg_before, "after": os.getloadavg()}
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    with contextlib.suppress(Exception):
        bp.log(f"bench: load average before {loadavg_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

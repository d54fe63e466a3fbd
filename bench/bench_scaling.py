"""How the gateway's limits scale with its workers (issue 35): the gateway at 1, 2, 4, 8 workers
without limits and with the three never-binding limits of ``limit_policies.py`` in each store,
beside nginx's ``limit_req`` with as many workers, every role on cores of its own; and the
shared store alone, N processes deciding the same three hot keys (no HTTP).

    python bench/bench_scaling.py --out scaling.json

Roles on a 16-core machine: the gateway on cores 0..N-1, the upstream (nginx, 3 workers) on
8-10, Redis on 11, wrk (``-t4 -c256``) on 12-15. With fewer cores the roles are scaled down
(the gateway gets the first half, the rest share the others) and the bench says the figures
mean nothing for scaling; it still runs (a smoke test with ``--duration 1 --rounds 1``).

Every target is started first, then loaded in interleaved rounds (each round visits every
target once), so that a machine's drift hits all alike. Per run: wrk's req/s, p50 and p99, the
CPU of the target's process group per request (``/proc``, as ``bench_proxy.py``), and for the
Redis targets Redis's own CPU per request. The store-only part runs first: N processes, each
pinned to a gateway core, call ``SharedStore.decide_now`` on three hot keys (one client, one
route, the global key) for ``--store-seconds``; decisions per second, CPU per decision, and how
often a decision was made again under the writers' lock (``redecided``), exact and with
``store.worker_lease``.

Modes: ``none`` (no limits), ``memory`` (the three limits in process, one worker only),
``shared`` (the three limits in the shared store, exact), ``lease`` (the same with
``store.worker_lease: {}``), ``redis`` (in one Redis), ``redis-lease`` (in Redis, all three
with ``lease: {}``: the nodelay leaky bucket is leased as a token bucket), and nginx
``limit_req`` (one zone per client) at the smallest and largest worker counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_proxy as bp  # noqa: E402
from limit_policies import NO_LIMITS, THREE_LIMITS, policy_text  # noqa: E402

MODES = ("none", "memory", "shared", "lease", "redis", "redis-lease")
# In process: one worker only (with several, ``memory`` is the shared store).
ONE_WORKER_MODES = ("memory",)
# The store alone: as a worker of N decides (a snapshot, then a short write), all under the
# writers' lock, and with worker leases.
STORE_VARIANTS = ("exact", "locked", "lease")
NGINX_MODE = "nginx-limit"
BIG_MACHINE_CORES = 16
FORK = multiprocessing.get_context("fork")


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Which cores each role gets (``taskset -c`` lists)."""

    gateway: list[int]
    upstream: str
    redis: str
    wrk: str
    full: bool  # the 16-core layout; else scaled down and not meaningful for scaling

    @classmethod
    def of(cls, cores: Sequence[int]) -> Layout:
        cores = sorted(cores)
        if len(cores) >= BIG_MACHINE_CORES:
            return cls(
                gateway=cores[:8],
                upstream=_cpus(cores[8:11]),
                redis=_cpus(cores[11:12]),
                wrk=_cpus(cores[12:16]),
                full=True,
            )
        half = max(len(cores) // 2, 1)
        rest = cores[half:] or cores[-1:]
        return cls(
            gateway=cores[:half],
            upstream=_cpus(rest),
            redis=_cpus(rest[-1:]),
            wrk=_cpus(rest),
            full=False,
        )

    def gateway_cpus(self, workers: int) -> str:
        cores = self.gateway
        return _cpus(cores[:workers] if workers <= len(cores) else cores)


def pinned_by_python(cpus: str, argv: Sequence[str]) -> list[str]:
    """``taskset -c cpus argv`` without taskset."""
    if not cpus:
        return list(argv)
    shim = "import os, sys; os.sched_setaffinity(0, {%s}); os.execvp(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", shim % cpus, *argv]


def _cpus(cores: Sequence[int]) -> str:
    return ",".join(str(core) for core in cores)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the shared store alone ----------------------------------------------------------------


def _store_worker(
    path: str,
    workers: int,
    worker_id: int,
    cpu: int | None,
    variant: str,
    seconds: float,
    ready: Any,
    go: Any,
    results: Any,
    profile: str | None = None,
) -> None:
    """One process deciding the three hot keys until ``seconds`` pass."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from bench_shared_store import limits

    from gateway.limits.compiled import Check
    from gateway.stores import SharedStore

    store = SharedStore(
        Path(path),
        workers=workers,
        worker_id=worker_id,
        lease_units=64 if variant == "lease" else 0,
        lease_interval_s=0.01,
        reports_counts=worker_id == 0,
    )
    if variant == "locked":
        # Read, decide and write in one write transaction, as a lone process does: no snapshot
        # (what the exact store would do if deciding under the lock were cheaper).
        store._optimistic = False
    stack = limits()
    store.configure(stack, ())
    checks = [Check(stack[0], "10.0.0.1"), Check(stack[1], "api"), Check(stack[2], "global")]
    decide_now = store.decide_now
    ready.put(worker_id)
    go.wait()
    count = rejected = 0
    profiler = None
    if profile is not None and worker_id == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu_started = time.thread_time()
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        for _ in range(200):
            if not decide_now(checks).allowed:
                rejected += 1
        count += 200
    elapsed = time.perf_counter() - started
    cpu_s = time.thread_time() - cpu_started
    if profiler is not None and profile is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    leases = store.leases
    results.put(
        {
            "decisions": count,
            "rejected": rejected,
            "elapsed_s": elapsed,
            "cpu_s": cpu_s,
            "redecided": store.redecided,
            "from_lease": leases.decided if leases is not None else 0,
            "batches": leases.granted if leases is not None else 0,
        }
    )


def store_only(
    workers: int, variant: str, seconds: float, layout: Layout, profile: Path | None = None
) -> dict[str, Any]:
    """N processes on one shared store, three hot keys each request."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        ready, results, go = FORK.Queue(), FORK.Queue(), FORK.Event()
        procs = []
        # The gateway's cores; on a small machine every core (nothing else runs meanwhile).
        cores = layout.gateway if layout.full else sorted(os.sched_getaffinity(0))
        for worker_id in range(workers):
            cpu = cores[worker_id % len(cores)]
            procs.append(
                FORK.Process(
                    target=_store_worker,
                    args=(
                        d + "/s",
                        workers,
                        worker_id,
                        cpu,
                        variant,
                        seconds,
                        ready,
                        go,
                        results,
                        None if profile is None else str(profile),
                    ),
                )
            )
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=60)
        go.set()
        runs: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds + 60
        while len(runs) < workers:
            try:
                runs.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError(
                        f"store-only processes failed (exit codes {failed})"
                    ) from None
        for proc in procs:
            proc.join(30)
    decisions = sum(run["decisions"] for run in runs)
    elapsed = max(run["elapsed_s"] for run in runs)
    cpu_s = sum(run["cpu_s"] for run in runs)
    return {
        "workers": workers,
        "variant": variant,
        "decisions_per_s": decisions / elapsed,
        "cpu_us_per_decision": cpu_s * 1e6 / decisions,
        "redecided_share": sum(run["redecided"] for run in runs) / decisions,
        # The share of the processes' time on a core: the rest waited (for the writers' lock).
        "busy_share": cpu_s / (elapsed * workers),
        "from_lease_share": sum(run["from_lease"] for run in runs) / decisions,
        "batches": sum(run["batches"] for run in runs),
        "rejected": sum(run["rejected"] for run in runs),
        "runs": runs,
    }


# --- through HTTP ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    name: str
    mode: str
    workers: int
    running: bp.RunningTarget


class Scaling:
    """Starts the upstream, Redis, the gateways and nginx, each pinned per ``Layout``."""

    def __init__(self, procs: bp.Processes, work_dir: Path, layout: Layout) -> None:
        self.procs = procs
        self.work_dir = work_dir
        self.layout = layout
        plan = bp.CpuPlan(upstream=layout.upstream, wrk=layout.wrk)
        self.harness = bp.Harness(procs, work_dir, plan, bp.NGINX_UPSTREAM)
        self.redis: bp.Started | None = None

    def start_upstream(self) -> None:
        """nginx answering the bench body, a worker per upstream core."""
        workers = len(self.layout.upstream.split(","))
        port = bp.free_port()
        prefix = self.work_dir / f"nginx-upstream-{port}"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        text = bp.upstream_nginx_config(prefix, port)
        conf.write_text(text.replace("worker_processes 1;", f"worker_processes {workers};"))
        argv = [bp.NGINX, "-p", f"{prefix}/", "-c", str(conf), "-e", str(prefix / "error.log")]
        started = self.procs.start(bp.UPSTREAM, bp.pinned(self.layout.upstream, argv))
        bp.wait_ready(started, [bp.serves_body(port)], bp.READY_TIMEOUT_S)
        self.harness.upstream_port = port

    def start_redis(self) -> str:
        if self.harness.redis_url is None:
            self.harness.plan = dataclasses.replace(self.harness.plan, upstream=self.layout.redis)
            self.harness.start_redis()
            self.harness.plan = dataclasses.replace(
                self.harness.plan, upstream=self.layout.upstream
            )
        assert self.harness.redis_url is not None
        return self.harness.redis_url

    def redis_group(self) -> int | None:
        for proc, _ in self.procs._running:
            if proc.args and "redis-server" in " ".join(map(str, proc.args)):
                return proc.pid
        return None

    def policy(self, mode: str) -> str:
        upstream = f"http://{bp.HOST}:{self.harness.upstream_port}"
        if mode == "none":
            return policy_text(NO_LIMITS, upstream)
        if mode == "memory":
            return policy_text(THREE_LIMITS, upstream)
        if mode in ("shared", "lease"):
            text = policy_text(THREE_LIMITS, upstream, "shared")
            if mode == "lease":
                text = text.replace(
                    "  on_failure: local\n", "  on_failure: local\n  worker_lease: {}\n"
                )
            return text
        text = policy_text(THREE_LIMITS, upstream, self.start_redis())
        if mode == "redis-lease":
            text = text.replace("    window: 1s\n", "    window: 1s\n    lease: {}\n")
            text = text.replace("    burst: 1000000\n", "    burst: 1000000\n    lease: {}\n")
            text = text.replace("    nodelay: true\n", "    nodelay: true\n    lease: {}\n")
        return text

    def start_gateway(self, mode: str, workers: int) -> Target:
        name = f"gw-{mode}-{workers}w"
        port, admin_port = bp.free_port(), bp.free_port()
        policy = self.work_dir / f"policy-{name}.yaml"
        policy.write_text(self.policy(mode))
        argv = [sys.executable, "-m", "gateway", "run", "--config", str(policy)]
        argv += ["--listen", f"{bp.HOST}:{port}", "--admin-listen", f"{bp.HOST}:{admin_port}"]
        argv += ["--workers", str(workers)]
        env = {"PYTHONPATH": str(REPO_ROOT)}
        cpus = self.layout.gateway_cpus(workers)
        started = self.procs.start(name, bp.pinned(cpus, argv), cwd=REPO_ROOT, env=env)
        try:
            bp.wait_ready(
                started, [bp.healthz(admin_port), bp.serves_body(port)], bp.READY_TIMEOUT_S
            )
        except BaseException:
            self.procs.stop(started)
            raise
        note = f"gateway --workers {workers} on cores {cpus}: {mode}"
        return Target(
            name, mode, workers, bp.RunningTarget(name, f"http://{bp.HOST}:{port}/", started, note)
        )

    def start_nginx(self, workers: int) -> Target:
        name = f"{NGINX_MODE}-{workers}w"
        port = bp.free_port()
        prefix = self.work_dir / f"nginx-{port}"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        text = bp.nginx_config(prefix, port, self.harness.upstream_port, limit=True)
        conf.write_text(text.replace("worker_processes 1;", f"worker_processes {workers};"))
        argv = [bp.NGINX, "-p", f"{prefix}/", "-c", str(conf), "-e", str(prefix / "error.log")]
        cpus = self.layout.gateway_cpus(workers)
        started = self.procs.start(name, bp.pinned(cpus, argv))
        bp.wait_ready(started, [bp.serves_body(port)], bp.READY_TIMEOUT_S)
        note = f"nginx worker_processes {workers} on cores {cpus}, limit_req per client"
        return Target(
            name,
            NGINX_MODE,
            workers,
            bp.RunningTarget(name, f"http://{bp.HOST}:{port}/", started, note),
        )


def script_calls(redis_url: str | None) -> int:
    """Script calls Redis has run (``INFO commandstats``: EVALSHA, EVAL, FCALL); 0 when it
    cannot say."""
    if redis_url is None:
        return 0
    host, port = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2.0) as sock:
            sock.sendall(b"INFO commandstats\r\n")
            data = b""
            while not data.endswith(b"\r\n\r\n") and len(data) < 1 << 20:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return 0
    calls = 0
    for line in data.decode(errors="replace").splitlines():
        name, _, fields = line.partition(":")
        if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall"):
            calls += int(fields.split(",")[0].removeprefix("calls="))
    return calls


def measure(
    scaling: Scaling, target: Target, connections: int, seconds: float, threads: int
) -> dict[str, Any]:
    redis_pgid = scaling.redis_group() if target.mode.startswith("redis") else None
    redis_url = scaling.harness.redis_url if redis_pgid else None
    redis_before = bp.process_group_cpu(redis_pgid)[0] if redis_pgid else 0.0
    calls_before = script_calls(redis_url)
    run = bp.measure(target.running, connections, seconds, threads, scaling.layout.wrk)
    redis_after = bp.process_group_cpu(redis_pgid)[0] if redis_pgid else 0.0
    calls_after = script_calls(redis_url)
    requests = max(run.wrk.requests, 1)
    return {
        "target": target.name,
        "mode": target.mode,
        "workers": target.workers,
        **dataclasses.asdict(run.wrk),
        "cpu_us_per_request": run.cpu_us_per_request,
        "redis_cpu_us_per_request": (redis_after - redis_before) * 1e6 / requests
        if redis_pgid
        else None,
        # Script calls per request; Redis's CPU per call is its CPU over these.
        "redis_calls_per_request": (calls_after - calls_before) / requests if redis_pgid else None,
    }


def summarise(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float]]:
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault((run["mode"], run["workers"]), []).append(run)
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for key, group in grouped.items():
        redis = [r["redis_cpu_us_per_request"] for r in group if r["redis_cpu_us_per_request"]]
        calls = [r["redis_calls_per_request"] for r in group if r["redis_calls_per_request"]]
        summary[key] = {
            "rounds": len(group),
            "req_s": statistics.median(r["requests_per_s"] for r in group),
            "req_s_min": min(r["requests_per_s"] for r in group),
            "req_s_max": max(r["requests_per_s"] for r in group),
            "p50_ms": statistics.median(r["p50_ms"] for r in group),
            "p99_ms": statistics.median(r["p99_ms"] for r in group),
            "cpu_us": statistics.median(r["cpu_us_per_request"] for r in group),
            "redis_cpu_us": statistics.median(redis) if redis else 0.0,
            "redis_calls": statistics.median(calls) if calls else 0.0,
            "failed": sum(r["non_2xx"] + r["timeouts"] + r["connect_errors"] for r in group),
        }
    return summary


def table(summary: dict[tuple[str, int], dict[str, float]], workers: Sequence[int]) -> str:
    lines = [
        "| workers | mode | req/s (min-max) | p50 ms | p99 ms | CPU µs/req "
        "| Redis µs/req (script calls/req) | / none | / 1 worker | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for count in workers:
        for mode in (*MODES, NGINX_MODE):
            row = summary.get((mode, count))
            if row is None:
                continue
            none = summary.get(("none", count))
            one = summary.get((mode, min(w for m, w in summary if m == mode)))
            ratio = f"{row['req_s'] / none['req_s']:.2f}x" if none and mode != "none" else ""
            scale = f"{row['req_s'] / one['req_s']:.2f}x" if one else ""
            redis = ""
            if row["redis_cpu_us"]:
                redis = f"{row['redis_cpu_us']:.1f} ({row['redis_calls']:.2f} calls)"
            lines.append(
                f"| {count} | {mode} | {row['req_s']:,.0f} ({row['req_s_min']:,.0f}-"
                f"{row['req_s_max']:,.0f}) | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} "
                f"| {row['cpu_us']:.1f} | {redis} | {ratio} | {scale} | {int(row['failed'])} |"
            )
    return "\n".join(lines)


def store_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| processes | store | decisions/s | CPU µs/decision | on CPU | redecided | from lease |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row['workers']} | {row['variant']} "
            f"| {row['decisions_per_s']:,.0f} | {row['cpu_us_per_decision']:.2f} "
            f"| {row['busy_share']:.0%} "
            f"| {row['redecided_share']:.1%} | {row['from_lease_share']:.1%} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write every run and the summary here (JSON)")
    parser.add_argument("--workers", default="1,2,4,8", help="comma list of worker counts")
    parser.add_argument("--modes", default=",".join(MODES), help=f"from {','.join(MODES)}")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx limit_req out")
    parser.add_argument("--duration", type=int, default=3, help="seconds per wrk run (whole)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of load, unmeasured (whole)")
    parser.add_argument("--connections", type=int, default=256, help="wrk -c")
    parser.add_argument("--threads", type=int, default=4, help="wrk -t")
    parser.add_argument(
        "--store-seconds", type=float, default=2.0, help="seconds per store-only run (0: skip them)"
    )
    parser.add_argument("--store-only", action="store_true", help="the store-only runs alone")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log")
    parser.add_argument(
        "--profile",
        type=Path,
        help="a folder: the first process of each store-only run under cProfile, its stats "
        "written there (store-VARIANT-Np.prof) and its top functions printed",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=400.0,
        help="seconds: no new round starts past this (what ran is reported)",
    )
    args = parser.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = time.monotonic()
    cores = sorted(os.sched_getaffinity(0))
    layout = Layout.of(cores)
    if shutil.which("taskset") is None:
        # Every role is still pinned: by a Python shim (affinity survives exec and fork).
        bp.pinned = pinned_by_python
        log("bench: taskset not found: roles pinned with os.sched_setaffinity")
    if not layout.full:
        log(
            f"bench: WARNING: {len(cores)} cores (fewer than {BIG_MACHINE_CORES}): roles scaled "
            "down and sharing cores; the figures say nothing about scaling"
        )
    meta: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": len(cores),
        "layout": dataclasses.asdict(layout),
        "meaningful_for_scaling": layout.full,
        "loadavg_before": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "python": sys.version.split()[0],
    }
    document: dict[str, Any] = {"meta": meta, "store_only": [], "runs": [], "skipped": {}}

    def write() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(document, indent=2, default=str) + "\n")

    if args.store_seconds > 0:
        for workers in args.workers:
            for variant in STORE_VARIANTS:
                profile = None
                if args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    name = f"store-{variant}-{workers}p.prof"
                    profile = args.profile / name
                try:
                    result = store_only(workers, variant, args.store_seconds, layout, profile)
                except Exception as exc:  # the HTTP part still runs
                    document["skipped"][f"store-{variant}-{workers}p"] = str(exc)
                    log(f"bench: store-only {workers} processes FAILED: {exc}")
                    continue
                if profile is not None:
                    import pstats

                    pstats.Stats(str(profile)).sort_stats("tottime").print_stats(12)
                log(
                    f"bench: store-only {workers} processes, {variant}: "
                    f"{result['decisions_per_s']:,.0f}/s, {result['cpu_us_per_decision']:.2f} "
                    f"µs/decision, redecided {result['redecided_share']:.1%}"
                )
                document["store_only"].append(result)
        write()
        print("Store alone, three hot keys per decision:\n")
        print(store_table(document["store_only"]))
        print()
    if args.store_only:
        return 0
    for tool in (bp.NGINX, bp.WRK):
        if shutil.which(tool) is None:
            log(f"bench: {tool} not found")
            return 2

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    procs = bp.Processes(work_dir)
    try:
        scaling = Scaling(procs, work_dir, layout)
        scaling.start_upstream()
        starters: list[tuple[str, Callable[[], Target]]] = []
        for workers in args.workers:
            for mode in args.modes:
                if mode in ONE_WORKER_MODES and workers != 1:
                    continue
                starters.append(
                    (f"{mode}-{workers}w", lambda m=mode, w=workers: scaling.start_gateway(m, w))
                )
            if not args.no_nginx and workers in (min(args.workers), max(args.workers)):
                starters.append((f"nginx-{workers}w", lambda w=workers: scaling.start_nginx(w)))
        targets: list[Target] = []
        for name, start in starters:
            try:
                targets.append(start())
                log(f"bench: started {name}")
            except bp.StartError as exc:
                document["skipped"][name] = str(exc)
                log(f"bench: SKIPPING {name}: {str(exc).splitlines()[0]}")
        if args.warmup > 0:
            for target in targets:
                try:
                    bp.run_wrk(
                        target.running.url, args.connections, args.warmup, args.threads, layout.wrk
                    )
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    log(f"bench: warm-up of {target.name} failed: {str(exc).splitlines()[0]}")
        for round_no in range(1, args.rounds + 1):
            if round_no > 1 and time.monotonic() - started_at > args.budget:
                log(f"bench: over the budget of {args.budget:g} s: no round {round_no}")
                break
            for target in list(targets):
                try:
                    if target.running.started.proc.poll() is not None:
                        raise RuntimeError(f"died:\n{target.running.started.log_tail()}")
                    run = measure(scaling, target, args.connections, args.duration, args.threads)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    # One target's failure leaves the others' figures: it is dropped.
                    document["skipped"][target.name] = str(exc)
                    log(f"bench: DROPPING {target.name}: {str(exc).splitlines()[0]}")
                    targets.remove(target)
                    continue
                run["round"] = round_no
                document["runs"].append(run)
                log(
                    f"bench: round {round_no} {target.name:<20} {run['requests_per_s']:>10,.0f} "
                    f"req/s p50 {run['p50_ms']:.2f} p99 {run['p99_ms']:.2f} ms "
                    f"CPU {run['cpu_us_per_request']:.1f} µs/req"
                )
            write()
    except KeyboardInterrupt:
        log("bench: interrupted; stopping everything")
        return 130
    finally:
        procs.stop_all()
        if args.keep_logs:
            log(f"bench: logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    meta["loadavg_after"] = os.getloadavg()
    meta["elapsed_s"] = time.monotonic() - started_at
    summary = summarise(document["runs"])
    document["summary"] = [{"mode": m, "workers": w, **row} for (m, w), row in summary.items()]
    write()
    caveat = "" if layout.full else ", NOT meaningful for scaling"
    print(
        f"Through HTTP, wrk -t{args.threads} -c{args.connections}, {args.rounds} rounds of "
        f"{args.duration:g} s ({len(cores)} cores{caveat}):\n"
    )
    print(table(summary, args.workers))
    for name, reason in document["skipped"].items():
        print(f"\n{name} skipped: {reason.splitlines()[0]}")
    log(f"bench: done in {meta['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

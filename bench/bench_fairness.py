"""The tail of one gateway worker at many connections, beside nginx: p50, p99, max and p99/p50.

Each wrk run opens its connections at once (256 by default), as a burst of clients does: a
listener that takes the waiting connections slowly shows it in the first requests' latency
(bench/README.md, "Fairness at 256 connections"). Targets: nginx as a proxy (one worker), and
one gateway worker with no limits and with the limits of bench/limit_policies.py; with
``--baseline-root`` each gateway target of that checkout runs beside ours in the same rounds.
The harness (upstream, nginx, gateways, pinning) is bench/bench_proxy.py's.

    python bench/bench_fairness.py --duration 5 --repeats 3 --connections 256
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import bench_proxy as bp

TARGETS = (bp.NGINX_TARGET, bp.GW_NONE, bp.GW_ONE, bp.GW_THREE)
_MAX_RE = re.compile(r"^\s+Latency\s+\S+\s+\S+\s+([\d.]+)(us|ms|s|m|h)", re.MULTILINE)


def run_wrk(
    url: str, connections: int, duration_s: float, threads: int, cpus: str
) -> dict[str, float]:
    """One wrk run: p50, p99, max (ms), requests per second, and wrk's timeouts."""
    argv = [bp.WRK, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", url]
    completed = subprocess.run(
        bp.pinned(cpus, argv),
        capture_output=True,
        text=True,
        timeout=duration_s + bp.WRK_GRACE_S,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"wrk failed ({completed.returncode}): {completed.stderr.strip()}")
    result = bp.parse_wrk(completed.stdout)
    found = _MAX_RE.search(completed.stdout)
    if found is None:
        raise RuntimeError(f"no maximum latency in wrk's output:\n{completed.stdout}")
    return {
        "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms,
        "max_ms": float(found.group(1)) * bp._UNIT_MS[found.group(2)],
        "requests_per_s": result.requests_per_s,
        "timeouts": result.timeouts,
    }


def table(results: dict[str, list[dict[str, float]]], connections: int) -> str:
    lines = [
        f"| target (c={connections}) | req/s | p50 ms | p99 ms | max ms | p99/p50 | "
        "p99/p50 per round | wrk timeouts |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, runs in results.items():
        ratios = [run["p99_ms"] / run["p50_ms"] for run in runs if run["p50_ms"] > 0]

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[key] for run in runs)

        lines.append(
            f"| {name} | {median('requests_per_s'):,.0f} | {median('p50_ms'):.1f} | "
            f"{median('p99_ms'):.1f} | {median('max_ms'):.0f} | "
            f"{statistics.median(ratios):.1f}x | {', '.join(f'{r:.1f}' for r in ratios)} | "
            f"{sum(int(run['timeouts']) for run in runs)} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--connections", type=int, default=256, help="wrk -c")
    parser.add_argument("--threads", type=int, default=2, help="wrk -t")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}"
    )
    parser.add_argument(
        "--baseline-root", type=Path, help="another checkout: its gateway targets run too (@base)"
    )
    parser.add_argument("--pin", choices=("split", "none"), default="split")
    parser.add_argument("--upstream-impl", choices=bp.UPSTREAM_IMPLS, default="httptools")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if args.baseline_root is not None:
        args.baseline_root = args.baseline_root.resolve()
        targets = [
            t
            for name in targets
            for t in ((name + bp.BASE_SUFFIX, name) if name in bp.LIMIT_TARGETS else (name,))
        ]
    args.targets = targets
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in (bp.NGINX, bp.WRK, "taskset"):
        if shutil.which(tool) is None:
            bp.log(f"bench: {tool} not found (apt-get install nginx wrk util-linux)")
            return 2
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, bp._raise_keyboard_interrupt)
    plan = bp.CpuPlan.for_mode(args.pin)
    results: dict[str, list[dict[str, float]]] = {}
    with bp.harness_dirs(False) as work_dir:
        procs = bp.Processes(work_dir)
        try:
            harness = bp.Harness(procs, work_dir, plan, args.upstream_impl, args.baseline_root)
            bp.start_with_retries(harness.start_upstream)
            running: list[bp.RunningTarget] = []
            for name in args.targets:
                starter: Callable[[], bp.RunningTarget] = harness.start_nginx
                if name != bp.NGINX_TARGET:
                    starter = lambda name=name: harness.start_limited_gateway(name)  # noqa: E731
                running.append(bp.start_with_retries(starter))
            for round_no in range(1, args.repeats + 1):
                for target in running:
                    run = run_wrk(
                        target.url, args.connections, args.duration, args.threads, plan.wrk
                    )
                    bp.log(
                        f"bench: round {round_no} {target.name:<16} p50 {run['p50_ms']:.1f} ms"
                        f"  p99 {run['p99_ms']:.1f} ms  max {run['max_ms']:.0f} ms"
                        f"  p99/p50 {run['p99_ms'] / run['p50_ms']:.1f}x"
                        f"  timeouts {run['timeouts']:.0f}"
                    )
                    results.setdefault(target.name, []).append(run)
        except KeyboardInterrupt:
            bp.log("bench: interrupted; stopping everything")
            return 130
        finally:
            procs.stop_all()
    print(table(results, args.connections))
    return 0


if __name__ == "__main__":
    sys.exit(main())

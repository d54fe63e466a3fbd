"""Replay throughput: generated access-log lines per second through ``gateway replay``.

    python bench/bench_replay.py --lines 1000000 --policy policies/layered.yaml

Writes an nginx ``combined`` log (and, with ``--format jsonl``, JSON lines) of ``--lines``
requests from ``--clients`` addresses at ``--rate`` requests per second, with bursts, into a
temporary directory, then times ``gateway replay`` on it in process (the log read from disk,
the reports built; generation not timed). Prints lines/s for each round and the median, and
the process's CPU time per million lines beside the wall time (on a shared machine the CPU
time is the steadier figure).

Each round also times the decisions alone, side by side: the same requests read into memory
first, then only ``Simulation.decide`` (routing, keys and the engine's ``evaluate``). The ratio
of the two says how much of a replay is reading the log and how much is the engine itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.engine.preflight import load_and_build  # noqa: E402
from gateway.replay import document, replay  # noqa: E402
from gateway.replay.log_formats import (  # noqa: E402
    ReadStats,
    Request,
    close_log,
    in_time_order,
    open_log,
    read_log,
)
from gateway.replay.simulate import Simulation  # noqa: E402

PATHS = ("/api/items", "/api/items/42", "/api/search?q=x", "/static/app.js", "/")
START = 1_700_000_000


def generate(path: Path, lines: int, clients: int, rate: float, fmt: str, seed: int) -> None:
    """``lines`` requests at ``rate`` per second on average: a few clients send bursts."""
    rng = random.Random(seed)
    addresses = [f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}" for i in range(clients)]
    noisy = addresses[: max(1, clients // 100)]
    t_us = START * 1_000_000
    gap_us = 1_000_000 / rate
    stamp_second = -1
    stamp = ""
    with path.open("w", encoding="utf-8") as out:
        for _ in range(lines):
            t_us += int(rng.expovariate(1.0) * gap_us)
            client = rng.choice(noisy) if rng.random() < 0.3 else rng.choice(addresses)
            if rng.random() < 0.02:
                method, target = "POST", "/api/login"
            else:
                method, target = "GET", rng.choice(PATHS)
            if fmt == "jsonl":
                record = {"ts": t_us / 1e6, "ip": client, "method": method, "path": target}
                out.write(json.dumps(record) + "\n")
                continue
            second = t_us // 1_000_000
            if second != stamp_second:
                stamp_second = second
                stamp = datetime.fromtimestamp(second, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
            out.write(
                f'{client} - - [{stamp}] "{method} {target} HTTP/1.1" 200 512 "-" '
                f'"Mozilla/5.0 (bench)"\n'
            )


def read_all(log: Path) -> list[Request]:
    stats = ReadStats()
    opened = open_log(str(log))
    try:
        return list(in_time_order(read_log(opened, "auto", stats), 30_000_000, stats))
    finally:
        close_log(opened)


async def decide_only(requests: list[Request], simulation: Simulation) -> tuple[float, float]:
    """Wall and CPU seconds of deciding ``requests``."""
    began = time.perf_counter()
    cpu_began = time.process_time()
    for request in requests:
        simulation.decide(request, simulation.client_ip(request))
    return time.perf_counter() - began, time.process_time() - cpu_began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=5_000)
    parser.add_argument("--rate", type=float, default=800.0, help="requests/s of the traffic")
    parser.add_argument("--policy", default=str(ROOT / "policies" / "layered.yaml"))
    parser.add_argument("--format", choices=("combined", "jsonl"), default="combined")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()

    loaded = load_and_build(args.policy)
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / f"access.{args.format}.log"
        began = time.perf_counter()
        generate(log, args.lines, args.clients, args.rate, args.format, args.seed)
        print(
            f"generated {args.lines:,} {args.format} lines ({log.stat().st_size / 1e6:.0f} MB) "
            f"in {time.perf_counter() - began:.1f} s",
            file=sys.stderr,
        )
        rates = []
        cpu_per_million = []
        decide_rates = []
        summary = {}
        requests = read_all(log)
        for round_ in range(args.rounds):
            decide_s, decide_cpu_s = asyncio.run(decide_only(requests, Simulation(loaded)))
            decide_rates.append(len(requests) / decide_s)
            began = time.perf_counter()
            cpu_began = time.process_time()
            run = asyncio.run(replay([str(log)], [Simulation(loaded)], show_progress=False))
            summary = document(run)
            elapsed = time.perf_counter() - began
            cpu_s = time.process_time() - cpu_began
            rates.append(args.lines / elapsed)
            cpu_per_million.append(cpu_s * 1e6 / args.lines)
            print(
                f"round {round_ + 1}: {elapsed:.2f} s, {args.lines / elapsed:,.0f} lines/s, "
                f"CPU {cpu_s:.2f} s; decisions alone {decide_s:.2f} s "
                f"(CPU {decide_cpu_s:.2f} s), {len(requests) / decide_s:,.0f}/s "
                f"(rejected {summary['policies'][0]['outcomes']['rejected']:,}, "
                f"delayed {summary['policies'][0]['outcomes']['delayed']:,})",
                file=sys.stderr,
            )
        del requests
    median = statistics.median(rates)
    ratios = [rate / alone for rate, alone in zip(rates, decide_rates, strict=True)]
    print(
        f"replay {args.lines:,} {args.format} lines on {Path(args.policy).name}: "
        f"median {median:,.0f} lines/s (min {min(rates):,.0f}, max {max(rates):,.0f}, "
        f"{args.rounds} rounds; {1e6 / median:.1f} s per million lines, CPU "
        f"{statistics.median(cpu_per_million):.1f} s per million); decisions alone "
        f"median {statistics.median(decide_rates):,.0f}/s; replay/decisions-alone "
        f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "lines": args.lines,
                    "format": args.format,
                    "policy": args.policy,
                    "lines_per_s": rates,
                    "median_lines_per_s": median,
                    "cpu_s_per_million_lines": cpu_per_million,
                    "decisions_alone_per_s": decide_rates,
                    "replay_over_decisions_alone": ratios,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

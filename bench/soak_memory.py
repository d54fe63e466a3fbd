"""Memory over time: a gateway's RSS and open descriptors under mixed traffic with key churn.

Starts a gateway (``python -m gateway run``, the in-process store, three stacked limits: per
client, per route, global) and a fast upstream (``upstream.py``), and drives a paced load from
this process: ``--clients`` clients at a time (``X-Client``), a ``--churn`` share of them
replaced by new ones every 10 s, about 40 % of the requests rejected (429). Every
``--interval`` seconds it samples the gateway's RSS and open descriptors (every process of
its group) and what the load got. At the end it writes ``soak.csv``, ``soak.png`` when
matplotlib is installed, prints an ASCII sparkline of the RSS and the RSS at 0, 5, 10, 15, 20
and 30 minutes, and whether the growth levelled off (``levelled_off``).

The dashboard keeps one history point a second for 15 minutes (``HISTORY_POINTS``), whatever
the traffic: RSS grows while it fills, then stops. ``--history-s`` shortens it for a short run
that should see the flat part (the reliability suite's test does).

Run: ``python bench/soak_memory.py`` (30 minutes) or ``--minutes 3``. Bounded: at most
``--rate`` requests a second and ``--minutes`` minutes; every request has a 10 s timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
CHURN_PERIOD_S = 10.0
MARKS_MIN = (0, 5, 10, 15, 20, 30)
SPARKS = "▁▂▃▄▅▆▇█"

POLICY = """\
server:
  listen: 127.0.0.1:{port}
  admin_listen: 127.0.0.1:{admin}
upstreams:
  backend:
    url: http://127.0.0.1:{upstream}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    upstream: backend
  - name: default
    upstream: backend
limits:
  per_client:
    algorithm: leaky_bucket
    rate: 12r/m
    burst: 1
    nodelay: true
    key: ["header:x-client"]
    max_keys: {max_keys}
  per_route:
    algorithm: sliding_window
    limit: 100000
    window: 1s
    key: [route]
  global:
    algorithm: token_bucket
    rate: 1000r/s
    burst: 200
    key: [global]
"""

# Run as the gateway's main: the dashboard history shortened (``--history-s``), nothing else.
_SHORT_HISTORY = """\
import sys
import gateway.observability.timeline as timeline
timeline.Timeline.__init__.__defaults__ = ({points},)
from gateway.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Sample:
    """One sample: the gateway's memory and descriptors, and the load since the last one."""

    elapsed_s: float
    rss_mib: float
    fds: int
    processes: int
    requests: int
    admitted: int
    rejected: int
    errors: int
    load1: float


@dataclass
class Tally:
    requests: int = 0
    admitted: int = 0
    rejected: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def group_pids(pgid: int) -> list[int]:
    """Every live process of the process group ``pgid`` (the gateway and its workers)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields_after_name = stat.rpartition(")")[2].split()
        if int(fields_after_name[2]) == pgid and fields_after_name[0] != "Z":
            pids.append(int(entry.name))
    return pids


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def memory_and_fds(pgid: int) -> tuple[float, int, int]:
    """RSS in MiB, open descriptors and processes of the group, summed."""
    rss, fds, pids = 0, 0, group_pids(pgid)
    for pid in pids:
        with contextlib.suppress(OSError):
            rss += rss_kib(pid)
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return rss / 1024, fds, len(pids)


def sparkline(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    top = len(SPARKS) - 1
    return "".join(SPARKS[min(int((v - low) / span * len(SPARKS)), top)] for v in values)


def at_minutes(samples: Sequence[Sample], minutes: float) -> Sample | None:
    """The last sample taken at or before ``minutes`` (None past the end of the run)."""
    if not samples or samples[-1].elapsed_s < minutes * 60 - 1:
        return None
    return [s for s in samples if s.elapsed_s <= minutes * 60 + 1][-1]


def levelled_off(samples: Sequence[Sample], after_s: float, tolerance_mib: float) -> bool:
    """True if RSS grew by at most ``tolerance_mib`` from ``after_s`` to the end: the growth
    stopped (a pool, a bounded history filled) rather than went on (a leak)."""
    later = [s.rss_mib for s in samples if s.elapsed_s >= after_s]
    return bool(later) and max(later) - later[0] <= tolerance_mib


def growth_per_minute(samples: Sequence[Sample], start_s: float, end_s: float) -> float:
    """RSS growth between the samples nearest ``start_s`` and ``end_s``, in MiB a minute."""
    inside = [s for s in samples if start_s <= s.elapsed_s <= end_s]
    if len(inside) < 2:
        return 0.0
    first, last = inside[0], inside[-1]
    return (last.rss_mib - first.rss_mib) / max((last.elapsed_s - first.elapsed_s) / 60, 1e-9)


@contextlib.contextmanager
def running(
    workdir: Path, workers: int, history_s: int | None, max_keys: int
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The upstream and the gateway (a process group of its own); yields the gateway and its
    port, stops both at the end."""
    upstream_port, port, admin = free_port(), free_port(), free_port()
    policy = workdir / "policy.yaml"
    policy.write_text(
        POLICY.format(port=port, admin=admin, upstream=upstream_port, max_keys=max_keys)
    )
    upstream = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "upstream.py"), "--port", str(upstream_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    if history_s is None:
        main = ["-m", "gateway"]
    else:
        main = ["-c", _SHORT_HISTORY.format(points=history_s)]
    argv = [sys.executable, *main, "--log-level", "WARNING", "run", "--config", str(policy)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    log = (workdir / "gateway.log").open("wb")
    gateway = subprocess.Popen(
        argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the gateway did not start: {(workdir / 'gateway.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        yield gateway, port
    finally:
        for process in (gateway, upstream):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in (gateway, upstream):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        log.close()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"GET /api/ready HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            return sock.recv(12).startswith(b"HTTP/1.1")
    except OSError:
        return False


async def drive(
    port: int,
    gateway_pid: int,
    *,
    seconds: float,
    interval_s: float,
    rate: float,
    clients: int,
    churn: float,
    report: bool = True,
) -> list[Sample]:
    """Paced load for ``seconds`` (at most ``rate`` requests a second, at most 64 in flight),
    sampled every ``interval_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + seconds
    tally = Tally()
    samples: list[Sample] = []
    rng = random.Random(1)
    tasks: set[asyncio.Task[None]] = set()
    in_flight = asyncio.Semaphore(64)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64), timeout=timeout
    ) as session:

        async def one(path: str, client: int) -> None:
            try:
                async with session.get(
                    f"http://127.0.0.1:{port}{path}", headers={"X-Client": f"c{client}"}
                ) as response:
                    await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError):
                tally.errors += 1
                return
            finally:
                in_flight.release()
            tally.statuses[status] = tally.statuses.get(status, 0) + 1
            if status == 200:
                tally.admitted += 1
            elif status == 429:
                tally.rejected += 1
            else:
                tally.errors += 1

        async def sample_every() -> None:
            last = Tally()
            while True:
                now = loop.time()
                rss, fds, processes = memory_and_fds(gateway_pid)
                sample = Sample(
                    elapsed_s=round(now - start, 1),
                    rss_mib=round(rss, 2),
                    fds=fds,
                    processes=processes,
                    requests=tally.requests - last.requests,
                    admitted=tally.admitted - last.admitted,
                    rejected=tally.rejected - last.rejected,
                    errors=tally.errors - last.errors,
                    load1=os.getloadavg()[0],
                )
                samples.append(sample)
                last = Tally(tally.requests, tally.admitted, tally.rejected, tally.errors)
                if report:
                    answered = sample.admitted + sample.rejected
                    share = 100 * sample.rejected / answered if answered else 0.0
                    print(
                        f"{sample.elapsed_s / 60:6.1f} min  RSS {sample.rss_mib:7.2f} MiB  "
                        f"fds {sample.fds:4d}  {sample.requests:5d} requests  "
                        f"{share:4.1f} % rejected  {sample.errors} errors  "
                        f"load {sample.load1:.2f}",
                        flush=True,
                    )
                if now >= end:
                    return
                await asyncio.sleep(min(interval_s, max(end - loop.time(), 0.0)))

        sampler = asyncio.create_task(sample_every())
        tick_s = 0.02
        next_at = start
        budget = 0.0
        while (now := loop.time()) < end:
            # The client population slides: every CHURN_PERIOD_S, a ``churn`` share leaves.
            base = int((now - start) / CHURN_PERIOD_S) * max(int(clients * churn), 1)
            budget += rate * tick_s
            while budget >= 1.0:
                budget -= 1.0
                if in_flight.locked():  # the gateway is behind: paced, not queued up
                    continue
                await in_flight.acquire()
                path = "/api/items" if rng.random() < 0.67 else "/static/page"
                task = loop.create_task(one(path, base + rng.randrange(clients)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                tally.requests += 1
            next_at += tick_s
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
        await asyncio.gather(*tasks)
        await sampler
    return samples


def write_csv(samples: Sequence[Sample], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        names = [f.name for f in fields(Sample)]
        writer.writerow(names)
        for sample in samples:
            writer.writerow([getattr(sample, name) for name in names])


def write_png(samples: Sequence[Sample], path: Path, title: str) -> bool:
    """A plot of RSS and descriptors over time, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    minutes = [s.elapsed_s / 60 for s in samples]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.plot(minutes, [s.rss_mib for s in samples])
    top.set_ylabel("RSS (MiB)")
    top.set_title(title)
    bottom.plot(minutes, [s.fds for s in samples], color="tab:orange")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def summary(samples: Sequence[Sample]) -> str:
    lines = []
    marks = [(m, at_minutes(samples, m)) for m in MARKS_MIN]
    lines.append(
        "RSS (MiB) at " + ", ".join(f"{m} min {s.rss_mib:.1f}" for m, s in marks if s is not None)
    )
    spans = list(itertools.pairwise(MARKS_MIN))
    growth = [
        f"{a}-{b} min {growth_per_minute(samples, a * 60, b * 60):+.3f}"
        for a, b in spans
        if at_minutes(samples, b) is not None
    ]
    if growth:
        lines.append("growth (MiB a minute): " + ", ".join(growth))
    fds = [s.fds for s in samples]
    lines.append(f"open fds: min {min(fds)}, max {max(fds)}, last {fds[-1]}")
    requests = sum(s.requests for s in samples)
    rejected = sum(s.rejected for s in samples)
    answered = rejected + sum(s.admitted for s in samples)
    errors = sum(s.errors for s in samples)
    lines.append(
        f"{requests} requests, {100 * rejected / max(answered, 1):.1f} % rejected, "
        f"{errors} errors; load average {min(s.load1 for s in samples):.2f}-"
        f"{max(s.load1 for s in samples):.2f}"
    )
    lines.append("RSS " + sparkline([s.rss_mib for s in samples]))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long (default 30)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--rate", type=float, default=300.0, help="requests a second at most")
    parser.add_argument("--clients", type=int, default=1000, help="clients at a time")
    parser.add_argument(
        "--churn", type=float, default=0.1, help="share of the clients replaced every 10 s"
    )
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument(
        "--max-keys",
        type=int,
        default=5000,
        help="the per-client limit's max_keys (default 5000: reached within the run)",
    )
    parser.add_argument(
        "--history-s", type=int, help="the dashboard's history, seconds (default: 15 minutes)"
    )
    parser.add_argument("--out", type=Path, help="where soak.csv and soak.png go (a temp dir)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="soak-run-") as workdir,
        running(Path(workdir), args.workers, args.history_s, args.max_keys) as (gateway, port),
    ):
        samples = asyncio.run(
            drive(
                port,
                gateway.pid,
                seconds=args.minutes * 60,
                interval_s=args.interval,
                rate=args.rate,
                clients=args.clients,
                churn=args.churn,
            )
        )
    write_csv(samples, out / "soak.csv")
    title = (
        f"gateway RSS and fds, {args.clients} clients ({args.churn:.0%} replaced every 10 s), "
        f"{args.rate:g} req/s"
    )
    plotted = write_png(samples, out / "soak.png", title)
    print(summary(samples))
    print(f"written: {out / 'soak.csv'}" + (f", {out / 'soak.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

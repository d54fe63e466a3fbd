"""Draw the adaptive limit over time beside the upstream's latency and goodput, as a PNG.

The upstream is the capacity-C one (bench/capacity_upstream.py: C = 8, 20 ms each, queueing
beyond), offered four times its capacity; at ``--change-at`` its capacity drops to
``--changed-capacity`` (the upstream slows down). Without the adaptive limit the same traffic's
latency grows with the queue; that curve is drawn too.

    python bench/adaptive_curves.py --simulate --out bench/adaptive_curves_sim.png

``--simulate`` runs the controller on a virtual clock (bench/capacity_sim.py): deterministic,
a second of traffic in a few milliseconds. Without it, a real run: the capacity upstream
(``--capacity``, ``--service-ms``), a gateway process with ``adaptive: {}`` in front of it
offered an open-loop Poisson load of ``--load`` times its capacity (bench/offered_load.py), the
limit read from its ``/metrics`` every half second (after 15 requests one at a time, so that
its first measurement of the minimum latency is of the upstream unloaded); then the same load
through a gateway without it. Latencies are the clients' (through the gateway). Needs matplotlib
(``pip install .[bench]``).

    python bench/adaptive_curves.py --out bench/adaptive_curves.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from capacity_sim import Trace, Upstream, simulate  # noqa: E402
from offered_load import Offered, offer  # noqa: E402

from gateway.algorithms.registry import gradient_params  # noqa: E402
from gateway.policy.models import AdaptiveSettings  # noqa: E402


@dataclass
class Curves:
    """What the figure shows, per ``step_s`` of the run."""

    title: str
    step_s: float
    times_s: list[float] = field(default_factory=list)
    limit: list[float] = field(default_factory=list)
    capacity: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    goodput: list[float] = field(default_factory=list)  # admitted and served, per second
    unlimited_p99_ms: list[float] = field(default_factory=list)
    unloaded_ms: float = 0.0
    service_ms: float = 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def from_traces(title: str, adaptive: Trace, unlimited: Trace, upstream: Upstream) -> Curves:
    step_s = 0.5
    curves = Curves(title, step_s, unloaded_ms=upstream.unloaded_ms, service_ms=upstream.service_ms)
    at = 0.0
    while at < upstream.duration_s - 1e-9:
        end = at + step_s
        curves.times_s.append(end)
        limits = adaptive.limits_between(at, end, probes=True)
        curves.limit.append(sum(limits) / len(limits) if limits else math.nan)
        curves.capacity.append(upstream.capacity_at(at))
        served = adaptive.served_between(at, end)
        curves.p50_ms.append(_quantile(served, 0.5))
        curves.p99_ms.append(_quantile(served, 0.99))
        curves.goodput.append(len(served) / step_s)
        curves.unlimited_p99_ms.append(_quantile(unlimited.served_between(at, end), 0.99))
        at = end
    return curves


def simulated(duration_s: float, change_at_s: float, changed_capacity: int) -> Curves:
    upstream = Upstream(
        capacity=8,
        service_ms=20.0,
        capacity_changes=((change_at_s, changed_capacity),),
        duration_s=duration_s,
    )
    params = gradient_params(AdaptiveSettings())
    return from_traces(
        f"Simulated: C = 8 -> {changed_capacity} at {change_at_s:g} s, 20 ms each, "
        "offered 4x capacity (bench/capacity_sim.py)",
        simulate(params, upstream),
        simulate(None, upstream),
        upstream,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _process(argv: list[str], ready: re.Pattern[str] | None = None) -> Iterator[str]:
    """A child process while the block runs (its first stdout line matched by ``ready``)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=BENCH_DIR.parent)
    try:
        line = ""
        if ready is not None:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not ready.search(line):
                raise RuntimeError(f"{argv[1]} did not start: {line!r}")
        yield line
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _gateway(upstream: str, adaptive: bool, work: Path) -> Iterator[tuple[str, str]]:
    port, admin = _free_port(), _free_port()
    policy = work / f"policy-{'adaptive' if adaptive else 'plain'}.yaml"
    policy.write_text(
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin}\n"
        f"upstreams:\n  backend:\n    url: {upstream}\n    max_connections: 2000\n"
        + ("    adaptive: {}\n" if adaptive else "")
        + "routes:\n  - name: all\n    upstream: backend\n"
    )
    with _process([sys.executable, "-m", "gateway", "run", "--config", str(policy)]):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", admin), 1):
                break
            time.sleep(0.1)
        time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{admin}/metrics"


async def _real_run(
    gateway: str, metrics: str | None, upstream: str, rate: float, duration_s: float,
    change_at_s: float, changed_capacity: int,
) -> tuple[Offered, list[tuple[float, float]]]:  # fmt: skip
    """The load through ``gateway``; C changed at ``change_at_s``; the limit read meanwhile."""
    import aiohttp

    limits: list[tuple[float, float]] = []
    async with aiohttp.ClientSession() as session:
        # Unloaded first, as tests/test_adaptive_e2e.py: the limit's first measurement of the
        # minimum latency then sees the upstream unloaded, not a gateway just started under
        # a flood of requests it sheds.
        for _ in range(15):
            async with session.get(gateway) as resp:
                await resp.read()
    began = time.monotonic()
    load = asyncio.ensure_future(offer(gateway, rate, duration_s, seed=28))
    changed = False
    async with aiohttp.ClientSession() as session:
        while not load.done():
            now = time.monotonic() - began
            if not changed and now >= change_at_s:
                changed = True
                async with session.put(f"{upstream}/_capacity?c={changed_capacity}") as resp:
                    resp.raise_for_status()
            if metrics is not None:
                async with session.get(metrics) as resp:
                    found = re.search(r'^gateway_adaptive_limit\{upstream="backend"\} (\S+)$',
                                      await resp.text(), re.MULTILINE)  # fmt: skip
                if found:
                    limits.append((now, float(found.group(1))))
            await asyncio.sleep(0.5)
    return await load, limits


def real(
    capacity: int, service_ms: float, load: float, duration_s: float, change_at_s: float,
    changed_capacity: int,
) -> Curves:  # fmt: skip
    """The curves of a real run (module docstring)."""
    rate = load * capacity / (service_ms / 1000)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for adaptive in (True, False):
            argv = [sys.executable, str(BENCH_DIR / "capacity_upstream.py"), "--port", "0",
                    "--capacity", str(capacity), "--service-ms", str(service_ms)]  # fmt: skip
            with _process(argv, re.compile(r":\d+$")) as line:
                upstream = "http://127.0.0.1:" + line.strip().rsplit(":", 1)[1]
                with _gateway(upstream, adaptive, Path(tmp)) as (url, metrics):
                    runs[adaptive] = asyncio.run(
                        _real_run(url, metrics if adaptive else None, upstream, rate,
                                  duration_s, change_at_s, changed_capacity)
                    )  # fmt: skip
    (offered, limits), (unlimited, _) = runs[True], runs[False]
    ok = [s for s in offered.sent if s.status == 200 and s.at_s < 2.0]
    unloaded_ms = min((s.latency_s * 1000 for s in ok), default=service_ms)
    curves = Curves(
        f"Real run: C = {capacity} -> {changed_capacity} at {change_at_s:g} s, {service_ms:g} ms "
        f"each, offered {load:g}x capacity (bench/capacity_upstream.py, a gateway process)",
        0.5,
        unloaded_ms=unloaded_ms,
        service_ms=service_ms,
    )
    at = 0.0
    while at < duration_s - 1e-9:
        end = at + curves.step_s
        curves.times_s.append(end)
        seen = [limit for t, limit in limits if at <= t < end]
        curves.limit.append(sum(seen) / len(seen) if seen else math.nan)
        curves.capacity.append(capacity if at < change_at_s else changed_capacity)
        served = [s.latency_s * 1000 for s in offered.between(at, end, 200)]
        curves.p50_ms.append(_quantile(served, 0.5))
        curves.p99_ms.append(_quantile(served, 0.99))
        curves.goodput.append(len(served) / curves.step_s)
        plain = [s.latency_s * 1000 for s in unlimited.between(at, end, 200)]
        curves.unlimited_p99_ms.append(_quantile(plain, 0.99))
        at = end
    return curves


def draw(curves: Curves, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (limits, latency, goodput) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    figure.suptitle(curves.title, fontsize=10)
    t = curves.times_s
    low = [0.75 * c for c in curves.capacity]
    high = [1.5 * c for c in curves.capacity]
    limits.fill_between(t, low, high, step="pre", alpha=0.15, label="0.75 C .. 1.5 C")
    limits.step(t, curves.capacity, where="pre", color="gray", label="capacity C")
    limits.step(t, curves.limit, where="pre", color="C0", label="adaptive limit (mean)")
    limits.set_ylabel("requests in flight")
    # The cold start's descent from max_limit (1000) goes off the top: the band is what counts.
    limits.set_ylim(0, 2 * max(curves.capacity))
    limits.legend(loc="upper right", fontsize=8)

    latency.step(t, curves.p50_ms, where="pre", label="admitted p50")
    latency.step(t, curves.p99_ms, where="pre", label="admitted p99")
    latency.step(t, curves.unlimited_p99_ms, where="pre", color="C3", label="p99 without adaptive")
    latency.axhline(curves.unloaded_ms, color="gray", linestyle=":", label="unloaded")
    latency.axhline(2.5 * curves.unloaded_ms, color="gray", linestyle="--", label="2.5x unloaded")
    latency.set_yscale("log")
    latency.set_ylabel("upstream latency (ms)")
    latency.legend(loc="upper left", fontsize=8)

    capacity_per_s = [c / (curves.service_ms / 1000) for c in curves.capacity]
    goodput.step(t, capacity_per_s, where="pre", color="gray", label="C / latency")
    goodput.step(
        t, [0.85 * c for c in capacity_per_s], where="pre", color="gray", linestyle="--",
        label="85% of it",
    )  # fmt: skip
    goodput.step(t, curves.goodput, where="pre", color="C2", label="goodput (admitted, served)")
    goodput.set_ylabel("requests / s")
    goodput.set_xlabel("seconds")
    goodput.set_ylim(bottom=0)
    goodput.legend(loc="lower left", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="on a virtual clock")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of traffic")
    parser.add_argument("--change-at", type=float, default=15.0, help="when C changes (s)")
    parser.add_argument("--changed-capacity", type=int, default=4, help="C after the change")
    parser.add_argument("--capacity", type=int, default=10, help="C at the start (real run)")
    parser.add_argument("--service-ms", type=float, default=100.0, help="real run")
    parser.add_argument("--load", type=float, default=1.8, help="offered, times C (real run)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "adaptive_curves.png")
    args = parser.parse_args()
    if args.simulate:
        curves = simulated(args.duration, args.change_at, args.changed_capacity)
    else:
        curves = real(
            args.capacity, args.service_ms, args.load, args.duration, args.change_at,
            args.changed_capacity,
        )  # fmt: skip
    draw(curves, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Draw the adaptive limit over time beside the upstream's latency and goodput, as a PNG.

The upstream is the capacity-C one (bench/capacity_upstream.py: C = 8, 20 ms each, queueing
beyond), offered four times its capacity; at ``--change-at`` its capacity drops to
``--changed-capacity`` (the upstream slows down). Without the adaptive limit the same traffic's
latency grows with the queue; that curve is drawn too.

    python bench/adaptive_curves.py --simulate --out bench/adaptive_curves_sim.png

``--simulate`` runs the controller on a virtual clock (bench/capacity_sim.py): deterministic,
a second of traffic in a few milliseconds. Needs matplotlib (``pip install .[bench]``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from capacity_sim import Trace, Upstream, simulate  # noqa: E402

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
    limits.set_ylim(bottom=0)
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
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "adaptive_curves.png")
    args = parser.parse_args()
    if not args.simulate:
        parser.error("only --simulate for now")
    curves = simulated(args.duration, args.change_at, args.changed_capacity)
    draw(curves, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

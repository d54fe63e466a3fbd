"""The dashboard's history: one point a second for the last 15 minutes, kept server-side so a page
opened now shows the past quarter hour at once. Each point holds per-second rates computed from
two consecutive whole-gateway snapshots, and the queue-wait quantiles of the last minute.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gateway.observability.snapshot import (
    DECISION_RESULTS,
    GatewaySnapshot,
    HistogramData,
)
from gateway.observability.stats import QUEUE_WAIT_BUCKETS

HISTORY_POINTS = 15 * 60
WAIT_QUANTILE_WINDOW = 60  # points (seconds) the p50/p99 queue wait is taken over
# The shortest interval a point's rates are taken over (ticks are a second apart).
MIN_POINT_S = 0.5


def rejection_ratio(limit_rates: dict[str, float], dry_run: bool) -> float | None:
    """Rejected (would-reject for a dry-run limit) over all decisions; ``None`` with no traffic.

    The same arithmetic as the Grafana panel's PromQL (``contrib/grafana``).
    """
    if dry_run:
        refused = limit_rates["dry_run_rejected"]
        total = limit_rates["allowed"] + limit_rates["dry_run_delayed"] + refused
    else:
        refused = limit_rates["rejected"]
        total = limit_rates["allowed"] + limit_rates["delayed"] + refused
    return refused / total if total > 0 else None


class Timeline:
    __slots__ = ("_previous", "_waits", "points")

    def __init__(self, max_points: int = HISTORY_POINTS) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self._previous: GatewaySnapshot | None = None
        # each point's wait histograms, for the quantiles over the last minute
        self._waits: deque[dict[str, HistogramData]] = deque(maxlen=WAIT_QUANTILE_WINDOW + 1)

    def add(self, snapshot: GatewaySnapshot) -> dict[str, Any] | None:
        """Add the point between the previous snapshot and this one; the first only primes.

        A point over less than ``MIN_POINT_S`` is not made: the first tick after start-up may
        come a few milliseconds after the figures that primed the timeline, and rates over
        those milliseconds read 0.0 whatever the traffic. The next tick's point covers them.
        """
        previous = self._previous
        elapsed = snapshot.at - previous.at if previous is not None else 0.0
        if previous is not None and 0 < elapsed < MIN_POINT_S:
            return None
        self._previous = snapshot
        self._waits.append({name: limit.wait for name, limit in snapshot.limits.items()})
        if previous is None or elapsed <= 0:  # primed, or the wall clock stepped back
            return None
        oldest_waits = self._waits[0]
        limits: dict[str, Any] = {}
        for name, limit in snapshot.limits.items():
            before = previous.limits.get(name)
            rates = {
                result: max(0, getattr(limit, result) - (getattr(before, result) if before else 0))
                / elapsed
                for result in DECISION_RESULTS
            }
            recent = limit.wait
            old_wait = oldest_waits.get(name)
            if old_wait is not None:
                recent = recent.minus(old_wait)
            limits[name] = {
                **{result: round(rate, 3) for result, rate in rates.items()},
                "ratio": rejection_ratio(rates, limit.dry_run),
                "waiting": limit.waiting,
                "wait_p50": recent.quantile(0.5, QUEUE_WAIT_BUCKETS),
                "wait_p99": recent.quantile(0.99, QUEUE_WAIT_BUCKETS),
            }
            if limit.cost_from:  # the units (tokens) its responses were charged, per second
                charged = limit.charged_units - (before.charged_units if before else 0)
                limits[name]["charged_units"] = round(max(0, charged) / elapsed, 3)
        # Each adaptive upstream's limit beside its latency (the workers' sum, the slowest's).
        adaptive: dict[str, Any] = {}
        for name, gate in snapshot.adaptive.items():
            before_gate = previous.adaptive.get(name)
            shed = gate.shed - (before_gate.shed if before_gate is not None else 0)
            adaptive[name] = {
                "limit": gate.limit,
                "in_flight": gate.in_flight,
                "waiting": gate.waiting,
                "latency_s": gate.latency_s,
                "min_latency_s": gate.min_latency_s,
                "shed": round(max(0, shed) / elapsed, 3),
            }
        requests_now = sum(n for *_, n in snapshot.requests)
        requests_before = sum(n for *_, n in previous.requests)
        limited = max(0, snapshot.limited_requests - previous.limited_requests)
        delayed = max(0, snapshot.delayed_requests - previous.delayed_requests)
        point = {
            "t": round(snapshot.at, 3),
            "dt": round(elapsed, 3),  # the rates are over the ``dt`` seconds before ``t``
            "requests": round(max(0, requests_now - requests_before) / elapsed, 3),
            # Requests refused, and delayed, by the limits (each once, however many limits).
            "rejected": round(limited / elapsed, 3),
            "delayed": round(delayed / elapsed, 3),
            "limits": limits,
            "adaptive": adaptive,
        }
        self.points.append(point)
        return point

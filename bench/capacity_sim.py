"""The adaptive limit in front of a capacity-C upstream, simulated on a virtual clock.

A discrete-event simulation of what tests/test_adaptive_* and bench/adaptive_curves.py run for
real: open-loop Poisson arrivals at ``load`` times the upstream's capacity, the gradient
controller (``gateway/algorithms/gradient_limit.py``) admitting or shedding each, and the
upstream of bench/capacity_upstream.py (its ``CapacityQueue``: ``C`` served at once for about
``service_ms``, the rest in line). Seconds of traffic take a fraction of a second to run, so
the property tests (tests/test_gradient_limit.py) try many upstreams, and the same code draws
the curves the real run is compared with.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from capacity_upstream import CapacityQueue

from gateway.algorithms.gradient_limit import GradientLimit, GradientParams

US = 1_000_000


@dataclass(frozen=True)
class Upstream:
    """The simulated upstream and the traffic offered to it."""

    capacity: int = 8
    service_ms: float = 20.0
    # Offered load as a multiple of the capacity (C / service time).
    load: float = 4.0
    # Each service time drawn uniformly within +-noise of service_ms.
    noise: float = 0.1
    # Latency outside the upstream's queue (network, event loops): exponential, this mean.
    jitter_ms: float = 0.5
    duration_s: float = 20.0
    # (at_s, C): the upstream's capacity changes at run time.
    capacity_changes: tuple[tuple[float, int], ...] = ()
    # (at_s, service_ms): its service time changes at run time.
    service_changes: tuple[tuple[float, float], ...] = ()
    seed: int = 0

    @property
    def unloaded_ms(self) -> float:
        return self.service_ms + self.jitter_ms

    def capacity_at(self, at_s: float) -> int:
        capacity = self.capacity
        for change_s, changed in self.capacity_changes:
            if change_s <= at_s:
                capacity = changed
        return capacity


@dataclass
class Trace:
    """What the run did: the controller every ``observe_s``, and every request's fate."""

    times_s: list[float] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    probing: list[bool] = field(default_factory=list)
    min_latency_ms: list[float] = field(default_factory=list)
    sample_latency_ms: list[float] = field(default_factory=list)
    # (finished_s, latency_ms) of each admitted request.
    served: list[tuple[float, float]] = field(default_factory=list)
    shed_s: list[float] = field(default_factory=list)

    def served_between(self, start_s: float, end_s: float) -> list[float]:
        return [latency for at, latency in self.served if start_s <= at < end_s]

    def limits_between(self, start_s: float, end_s: float, *, probes: bool = False) -> list[int]:
        """The limit as observed in ``[start_s, end_s)``, while not probing unless ``probes``."""
        return [
            limit
            for at, limit, probing in zip(self.times_s, self.limits, self.probing, strict=True)
            if start_s <= at < end_s and (probes or not probing)
        ]

    def probing_share(self, start_s: float, end_s: float) -> float:
        seen = [
            p for at, p in zip(self.times_s, self.probing, strict=True) if start_s <= at < end_s
        ]
        return sum(seen) / len(seen) if seen else 0.0


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


_ARRIVE, _FREE, _RESPOND, _CHANGE, _SLOW, _OBSERVE = range(6)


def simulate(params: GradientParams | None, upstream: Upstream, observe_s: float = 0.05) -> Trace:
    """Run ``upstream.duration_s`` of traffic; ``params`` None sends every request through
    (no adaptive limit)."""
    rng = random.Random(upstream.seed)
    controller = GradientLimit(params, 0, rng.random) if params is not None else None
    queue: CapacityQueue[int] = CapacityQueue(upstream.capacity)
    trace = Trace()
    end_us = int(upstream.duration_s * US)
    service_us = upstream.service_ms * 1000
    # The offered load stays what it was at the start, whatever the upstream does later.
    rate_per_us = upstream.load * upstream.capacity / service_us
    events: list[tuple[int, int, int, int]] = []  # (at_us, seq, kind, started_us)
    seq = itertools.count()

    def push(at_us: int, kind: int, started_us: int = 0) -> None:
        heapq.heappush(events, (at_us, next(seq), kind, started_us))

    def start_service(now_us: int, started_us: int) -> None:
        spread = 1.0 + upstream.noise * (2.0 * rng.random() - 1.0)
        push(now_us + max(int(service_us * spread), 1), _FREE, started_us)

    push(int(rng.expovariate(1.0) / rate_per_us), _ARRIVE)
    for at_s, capacity in upstream.capacity_changes:
        push(int(at_s * US), _CHANGE, capacity)
    for at_s, service_ms in upstream.service_changes:
        push(int(at_s * US), _SLOW, int(service_ms * 1000))
    push(0, _OBSERVE)
    while events:
        now_us, _, kind, started_us = heapq.heappop(events)
        if now_us >= end_us:
            break
        if kind == _ARRIVE:
            push(now_us + max(int(rng.expovariate(1.0) / rate_per_us), 1), _ARRIVE)
            if controller is not None and not controller.try_acquire():
                trace.shed_s.append(now_us / US)
                continue
            if controller is not None:
                controller.started(now_us)
            if queue.arrive(now_us):
                start_service(now_us, now_us)
        elif kind == _FREE:
            jitter_us = int(rng.expovariate(1.0) * upstream.jitter_ms * 1000)
            push(now_us + jitter_us, _RESPOND, started_us)
            for waiting_since in queue.finish():
                start_service(now_us, waiting_since)
        elif kind == _RESPOND:
            if controller is not None:
                controller.release(started_us, now_us)
            trace.served.append((now_us / US, (now_us - started_us) / 1000))
        elif kind == _CHANGE:
            for waiting_since in queue.set_capacity(started_us):
                start_service(now_us, waiting_since)
        elif kind == _SLOW:
            service_us = started_us
        else:
            push(now_us + int(observe_s * US), _OBSERVE)
            trace.times_s.append(now_us / US)
            if controller is None:
                trace.limits.append(0)
                trace.in_flight.append(queue.in_service + queue.queued)
                trace.probing.append(False)
                trace.min_latency_ms.append(0.0)
                trace.sample_latency_ms.append(0.0)
                continue
            trace.limits.append(controller.limit)
            trace.in_flight.append(controller.in_flight)
            trace.probing.append(controller.probing)
            trace.min_latency_ms.append(controller.min_latency_us / 1000)
            trace.sample_latency_ms.append(controller.sample_latency_us / 1000)
    return trace

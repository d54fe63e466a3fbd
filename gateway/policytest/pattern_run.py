"""An arrival pattern run against a policy: what came of each request, over time, with each
limit's level, through replay's ``Simulation`` (the live engine on a virtual clock).

The timeline is binned after the run (the span is known then) into at most ``MAX_BINS``
steps of a round width; a limit's level in a step is the least quota left (``remaining``)
among the keys it decided there: where a burst takes it, and how it refills; its queue in a
step is the most requests waiting out a delay there (the engine's own count).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.replay.log_formats import Request
from gateway.replay.simulate import (
    ALLOWED,
    DELAYED,
    DENIED,
    REJECTED,
    UNLIMITED,
    UNROUTED,
    Simulation,
)

US: Final = 1_000_000
MAX_BINS: Final = 300
# Round step widths, in milliseconds.
_STEPS_MS: Final = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 15_000, 30_000, 60_000,
    120_000, 300_000, 600_000, 900_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000,
)  # fmt: skip
# What came of a request, as the charts group it.
_GROUP: Final = {
    ALLOWED: 0,  # admitted at once
    UNLIMITED: 0,
    DELAYED: 1,
    REJECTED: 2,
    DENIED: 3,  # refused otherwise (an address denied, a method or target refused)
    UNROUTED: 3,
}
GROUPS: Final = ("admitted", "delayed", "rejected", "other")
NO_LEVEL: Final = -1


@dataclass
class PatternRun:
    """Per request: its instant, its group and each limit's remaining quota after it."""

    simulation: Simulation
    instants: array[int] = field(default_factory=lambda: array("q"))
    groups: array[int] = field(default_factory=lambda: array("b"))
    levels: dict[str, array[int]] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)
    # Per limit: when each request it delayed waited in its queue (from, until), and the most
    # that waited at once, as the engine counts them (``counters.waiting``).
    waits: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    peak_queue: dict[str, int] = field(default_factory=dict)


def run_pattern(simulation: Simulation, requests: Iterable[Request]) -> PatternRun:
    """Decide every request in order on the simulation's clock."""
    run = PatternRun(simulation)
    enforced = [limit for limit in simulation.engine.limits if not limit.dry_run]
    names = [limit.name for limit in enforced]
    for name in names:
        run.levels[name] = array("q")
        run.waits[name] = []
        run.peak_queue[name] = 0
    for request in requests:
        what = simulation.decide(request, simulation.client_ip(request))
        run.instants.append(request.t_us)
        run.groups.append(_GROUP[what])
        seen: dict[str, int] = {}
        outcome = simulation.last
        if outcome is not None and outcome.verdict is not None:
            until_us = request.t_us + round(outcome.delay_s * US)
            for check, decision in zip(outcome.checks, outcome.verdict.decisions, strict=True):
                name = check.limit.name
                seen[name] = max(0, decision.remaining)
                run.quotas[name] = max(run.quotas.get(name, 0), decision.limit)
                if what == DELAYED and decision.delay_s > 0.0:
                    run.waits[name].append((request.t_us, until_us))
        for limit in enforced:
            run.levels[limit.name].append(seen.get(limit.name, NO_LEVEL))
            run.peak_queue[limit.name] = max(run.peak_queue[limit.name], limit.counters.waiting)
    simulation.finish()
    return run


def _step_ms(span_ms: int) -> int:
    for step in _STEPS_MS:
        if span_ms // step + 1 <= MAX_BINS:
            return step
    return _STEPS_MS[-1]


def _queue_series(
    waits: list[tuple[int, int]], first_us: int, step_us: int, bins: int
) -> list[int]:
    """The most requests waiting at once in each step: a sweep over the waits' ends and
    starts (an end first at one instant, as the simulation frees places before deciding)."""
    events = sorted([(start, 1) for start, _ in waits] + [(end, -1) for _, end in waits])
    series = [0] * bins
    current = 0
    index = 0
    for step in range(bins):
        end = first_us + (step + 1) * step_us
        peak = current
        while index < len(events) and events[index][0] < end:
            current += events[index][1]
            peak = max(peak, current)
            index += 1
        series[step] = peak
    return series


def timeline(run: PatternRun) -> dict[str, Any]:
    """The run as one JSON-ready document: totals (the engine's counters beside the groups
    counted here), and the binned series the charts draw."""
    simulation = run.simulation
    first_us = run.instants[0] if run.instants else 0
    last_us = run.instants[-1] if run.instants else 0
    step = _step_ms((last_us - first_us) // 1000)
    bins = (last_us - first_us) // 1000 // step + 1 if run.instants else 0
    counts = [[0] * bins for _ in GROUPS]
    levels: dict[str, list[int | None]] = {name: [None] * bins for name in run.levels}
    queues = {
        name: _queue_series(waits, first_us, step * 1000, bins)
        for name, waits in run.waits.items()
        if waits
    }
    for i, t_us in enumerate(run.instants):
        index = (t_us - first_us) // 1000 // step
        counts[run.groups[i]][index] += 1
        for name, values in run.levels.items():
            level = values[i]
            if level != NO_LEVEL:
                shown = levels[name][index]
                levels[name][index] = level if shown is None else min(shown, level)
    outcomes = simulation.tally.outcomes
    return {
        "policy": simulation.loaded.source,
        "requests": len(run.instants),
        "first_ms": first_us / 1000,
        "span_ms": (last_us - first_us) / 1000,
        "step_ms": step,
        "totals": {name: sum(column) for name, column in zip(GROUPS, counts, strict=True)},
        "outcomes": {what: outcomes.get(what, 0) for what in _GROUP},
        "limits": [
            {
                "name": name,
                "algorithm": next(
                    lim.spec.algorithm for lim in simulation.engine.limits if lim.name == name
                ),
                "quota": run.quotas.get(name, 0),
                "counters": figures,
                "level": levels.get(name),
                "queue": queues.get(name),
                "peak_queue": run.peak_queue.get(name, 0),
            }
            for name, figures in simulation.counters().items()
        ],
        "series": {name: column for name, column in zip(GROUPS, counts, strict=True)},
    }

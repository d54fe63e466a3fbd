"""The proposal's proof: the written policy replayed on the same logs through the live
engine (replay's ``Simulation``): how many requests it refuses, and who, and when."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.limits.keys import shown_key
from gateway.policy.loader import LoadedPolicy
from gateway.replay.log_formats import ReadStats
from gateway.replay.simulate import REJECTED, Simulation
from gateway.suggest.traffic import read_requests


@dataclass
class Refusals:
    """One key's refused requests under one limit."""

    requests: int = 0
    first_us: int = 0
    last_us: int = 0


@dataclass
class Proof:
    requests: int = 0
    rejected: int = 0
    delayed: int = 0
    # limit -> shown key -> its refusals
    refused: dict[str, dict[str, Refusals]] = field(default_factory=dict)
    unix_offset_us: int = 0

    def refused_keys(self, limit: str) -> set[str]:
        return set(self.refused.get(limit, {}))


def prove(loaded: LoadedPolicy, paths: Sequence[str], fmt: str) -> Proof:
    simulation = Simulation(loaded)
    specs = {limit.name: limit.spec.key for limit in simulation.engine.limits}
    proof = Proof()
    stats = ReadStats()
    for request in read_requests(paths, fmt, stats):
        what = simulation.decide(request, simulation.client_ip(request))
        proof.requests += 1
        if what != REJECTED:
            continue
        proof.rejected += 1
        outcome = simulation.last
        if outcome is None or outcome.verdict is None:
            continue
        checks = outcome.checks
        for index in outcome.verdict.rejected_by or range(len(checks)):
            check = checks[index]
            if outcome.verdict.rejected_by or check.limit.name == outcome.rejected_by:
                name = check.limit.name
                key = shown_key(specs[name], check.key) or "(all clients)"
                record = proof.refused.setdefault(name, {}).setdefault(key, Refusals())
                if not record.requests:
                    record.first_us = request.t_us
                record.requests += 1
                record.last_us = request.t_us
    simulation.finish()
    proof.delayed = simulation.tally.outcomes.get("delayed", 0)
    proof.unix_offset_us = stats.unix_offset_us or 0
    return proof

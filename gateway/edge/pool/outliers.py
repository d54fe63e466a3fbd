"""Outlier ejection as Envoy's: servers compared with their peers over each interval, pure.

Each interval, a server with at least ``min_requests`` answers is an outlier when its share of
failed answers (5xx, connect errors, timeouts) is ``error_share`` above the median of its peers'
shares, or its mean latency is ``latency_factor`` times its peers' median (and at least
``min_latency``). Peers are the other servers judged in that interval, so a backend-wide
problem, which every server shares, ejects nobody. An outlier is ejected for
``base_ejection_time`` times the number of its ejections in a row (at most
``max_ejection_time``); an interval without ejection takes one off that count. At most
``max_ejection_percent`` of the pool (at least one server, as Envoy) is ejected at once: the
worst outliers first.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gateway.policy.models import OutlierDetection


@dataclass(slots=True)
class _Window:
    answers: int = 0
    failures: int = 0
    latency_total_s: float = 0.0
    timed: int = 0


@dataclass(frozen=True, slots=True)
class Ejection:
    index: int
    why: str  # "errors" or "latency"
    until: float
    share: float  # its failure share or latency over its peers' median


class OutlierDetector:
    __slots__ = ("_ejected_until", "_ejections", "_settings", "_windows", "next_at")

    def __init__(self, settings: OutlierDetection, size: int, now: float) -> None:
        self._settings = settings
        self._windows = [_Window() for _ in range(size)]
        self._ejected_until = [0.0] * size
        self._ejections = [0] * size  # in a row
        self.next_at = now + settings.interval

    def record(self, index: int, failed: bool, latency_s: float | None) -> None:
        """One answer (or failed attempt) of server ``index``; ``latency_s`` to its head."""
        window = self._windows[index]
        window.answers += 1
        if failed:
            window.failures += 1
        if latency_s is not None:
            window.latency_total_s += latency_s
            window.timed += 1

    def ejected(self, index: int, now: float) -> bool:
        return now < self._ejected_until[index]

    def ejected_until(self, index: int) -> float:
        return self._ejected_until[index]

    def evaluate(self, now: float) -> list[Ejection]:
        """Close the interval: the servers ejected now (call when ``now >= next_at``)."""
        settings = self._settings
        size = len(self._windows)
        judged = [
            i
            for i, window in enumerate(self._windows)
            if window.answers >= settings.min_requests and not self.ejected(i, now)
        ]
        found: list[Ejection] = []
        for index in judged:
            peers = [i for i in judged if i != index]
            if not peers:
                break
            ejection = self._judge(index, peers, now)
            if ejection is not None:
                found.append(ejection)
        out = sum(1 for i in range(size) if self.ejected(i, now))
        percent = settings.max_ejection_percent
        allowed = 0 if percent == 0 else max(1, size * percent // 100)
        ejected: list[Ejection] = []
        for ejection in sorted(found, key=lambda e: -e.share):
            if out >= allowed:
                break
            out += 1
            ejected.append(ejection)
        newly = {e.index for e in ejected}
        for i in range(size):
            if i in newly:
                self._ejections[i] += 1
                length = min(
                    settings.base_ejection_time * self._ejections[i], settings.max_ejection_time
                )
                self._ejected_until[i] = now + length
            elif not self.ejected(i, now) and self._ejections[i] > 0:
                self._ejections[i] -= 1
        self._windows = [_Window() for _ in range(size)]
        self.next_at = now + settings.interval
        return [Ejection(e.index, e.why, self._ejected_until[e.index], e.share) for e in ejected]

    def _judge(self, index: int, peers: list[int], now: float) -> Ejection | None:
        settings = self._settings
        window = self._windows[index]
        if settings.error_share is not None:
            share = window.failures / window.answers
            peers_share = statistics.median(
                self._windows[i].failures / self._windows[i].answers for i in peers
            )
            if share - peers_share >= settings.error_share:
                return Ejection(index, "errors", 0.0, 1.0 + share - peers_share)
        if settings.latency_factor is not None and window.timed:
            latency = window.latency_total_s / window.timed
            peer_latencies = [
                self._windows[i].latency_total_s / self._windows[i].timed
                for i in peers
                if self._windows[i].timed
            ]
            if peer_latencies and latency >= settings.min_latency:
                peers_latency = statistics.median(peer_latencies)
                if latency > settings.latency_factor * peers_latency:
                    ratio = latency / peers_latency if peers_latency > 0 else float("inf")
                    return Ejection(index, "latency", 0.0, ratio)
        return None

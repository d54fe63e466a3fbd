"""A fixed-bucket histogram the hot path observes into: bucket counts and a sum, no lock."""

from __future__ import annotations

from bisect import bisect_left


class Histogram:
    """Bucket counts (not cumulative) and a sum; the last count is the +Inf bucket."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

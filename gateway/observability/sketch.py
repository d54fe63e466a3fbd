"""The most limited keys per limit, in fixed memory: the space-saving sketch.

Metwally, Agrawal and El Abbadi, "Efficient Computation of Frequent and Top-k Elements in Data
Streams" (2005). At most ``capacity`` keys are counted; a new key takes the place of the key with
the smallest count and inherits that count as its possible overestimate (``error``). Any key seen
more than ``n / capacity`` times out of ``n`` is guaranteed to be in the table, so a flood of
one-off addresses cannot push a real heavy hitter out, and memory stays fixed under it.

Counts move by one, so the smallest count only ever rises by one: keys are grouped by count and
every operation is O(1) (no scan for the minimum).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeavyHitter:
    key: str
    count: int  # an upper bound; ``count - error`` is a lower bound
    error: int


class SpaceSaving:
    __slots__ = ("_by_count", "_counts", "_errors", "_min_count", "capacity", "total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.total = 0  # every offer, counted or not
        self._counts: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        # count -> keys with that count, oldest first (dicts as ordered sets)
        self._by_count: dict[int, dict[str, None]] = {}
        self._min_count = 0

    def __len__(self) -> int:
        return len(self._counts)

    def offer(self, key: str) -> None:
        self.total += 1
        counts = self._counts
        count = counts.get(key)
        if count is not None:
            self._move(key, count, count + 1)
            return
        if len(counts) < self.capacity:
            counts[key] = 1
            self._errors[key] = 0
            self._by_count.setdefault(1, {})[key] = None
            self._min_count = 1
            return
        # Replace the oldest key among those with the smallest count.
        floor = self._min_count
        smallest = self._by_count[floor]
        victim = next(iter(smallest))
        del smallest[victim]
        del counts[victim]
        del self._errors[victim]
        if not smallest:
            del self._by_count[floor]
        counts[key] = floor + 1
        self._errors[key] = floor
        self._by_count.setdefault(floor + 1, {})[key] = None
        if floor not in self._by_count:
            self._min_count = floor + 1

    def _move(self, key: str, old: int, new: int) -> None:
        group = self._by_count[old]
        del group[key]
        if not group:
            del self._by_count[old]
            if self._min_count == old:
                self._min_count = new
        self._counts[key] = new
        self._by_count.setdefault(new, {})[key] = None

    def top(self, n: int) -> list[HeavyHitter]:
        """The ``n`` keys with the highest counts, highest first (ties: key order)."""
        ranked = sorted(self._counts.items(), key=lambda item: (-item[1], item[0]))[:n]
        return [HeavyHitter(key, count, self._errors[key]) for key, count in ranked]


class RecentTopKeys:
    """Top keys over the last one to two ``period_s``: two sketches, the older dropped in turn.

    ``rotate`` is called by the once-a-second tick with the time; the hot path only offers.
    """

    __slots__ = ("_current", "_previous", "_started_at", "capacity", "period_s")

    def __init__(self, capacity: int = 64, period_s: float = 60.0) -> None:
        self.capacity = capacity
        self.period_s = period_s
        self._current = SpaceSaving(capacity)
        self._previous: SpaceSaving | None = None
        self._started_at: float | None = None

    def offer(self, key: str) -> None:
        self._current.offer(key)

    def rotate(self, now_s: float) -> None:
        if self._started_at is None:
            self._started_at = now_s
        elif now_s - self._started_at >= self.period_s:
            self._previous = self._current
            self._current = SpaceSaving(self.capacity)
            self._started_at = now_s

    def top(self, n: int) -> list[HeavyHitter]:
        """Counts from both generations added up (a key's error too)."""
        merged: dict[str, list[int]] = {}
        for sketch in (self._previous, self._current):
            if sketch is None:
                continue
            for hitter in sketch.top(sketch.capacity):
                entry = merged.setdefault(hitter.key, [0, 0])
                entry[0] += hitter.count
                entry[1] += hitter.error
        ranked = sorted(merged.items(), key=lambda item: (-item[1][0], item[0]))[:n]
        return [HeavyHitter(key, count, error) for key, (count, error) in ranked]

"""Sliding log: exact, never more than ``limit`` units in any span of ``window_s``.

How the three window algorithms trade accuracy, memory and edge bursts: the table in
``gateway/algorithms/fixed_window.py``.

The log holds the admission time of every unit admitted in the last window, oldest first, one
int64 per unit (a request of cost 3 is three entries at the same time), as an immutable
``bytes``: 33 bytes plus 8 per entry, never more than ``limit`` entries. A unit counts during
``[t, t + window)``. A request of ``cost`` at ``now`` is admitted when at most ``limit - cost``
entries are newer than ``now - window``, which is one look at the ``(limit - cost + 1)``-th
newest entry; entries that have left the window are dropped when a request is admitted.

Admitting copies the log (O(limit) bytes, a memcpy); rejecting copies nothing. A clock step
backwards records the newest time already in the log instead, so the log stays sorted and an
entry never expires earlier than the request it stands for.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from typing import Final

from gateway.algorithms.base import Algorithm, Decides, Decision
from gateway.algorithms.fixed_window import check_limit, window_us_from_s

_INF: Final = float("inf")
_ENTRY: Final = struct.Struct("=q")
_ENTRY_SIZE: Final = _ENTRY.size
_EMPTY: Final = b""


def pack_log(times_us: list[int]) -> bytes:
    """A log state from admission times (one per unit, oldest first)."""
    return struct.pack(f"={len(times_us)}q", *times_us)


def unpack_log(state: bytes) -> list[int]:
    """The admission times in a log state, oldest first."""
    return memoryview(state).cast("q").tolist()


class SlidingLog(Decides):
    """Never more than ``limit`` units in any span of ``window_s`` seconds."""

    __slots__ = ("limit", "window_us")

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = check_limit(limit)
        self.window_us = window_us_from_s(window_s)

    @property
    def name(self) -> str:
        return "sliding_log"

    def share(self, replicas: int) -> SlidingLog:
        if replicas == 1:
            return self
        return SlidingLog(max(self.limit // replicas, 1), self.window_us / 1e6)

    def __repr__(self) -> str:
        return f"SlidingLog(limit={self.limit}, window_s={self.window_us / 1e6:g})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlidingLog):
            return NotImplemented
        return (self.limit, self.window_us) == (other.limit, other.window_us)

    def __hash__(self) -> int:
        return hash((SlidingLog, self.limit, self.window_us))

    def __reduce__(self) -> tuple[type[SlidingLog], tuple[int, float]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return SlidingLog, (self.limit, self.window_us / 1e6)

    def decide(
        self, state: bytes | None, now_us: int, cost: int = 1
    ) -> tuple[Decision, bytes | None]:
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        limit = self.limit
        window_us = self.window_us
        horizon_us = now_us - window_us  # entries at or before this have left the window
        if not state:
            if cost > limit:
                return Decision(False, 0.0, _INF, limit, limit, 0.0), state
            return (
                Decision(True, 0.0, 0.0, limit, limit - cost, window_us / 1e6),
                _ENTRY.pack(now_us) * cost,
            )
        times = memoryview(state).cast("q")
        count = len(times)
        newest_us = times[count - 1]
        # The entry that must have left the window for `cost` more units to fit.
        blocking = count - (limit - cost) - 1
        if cost > limit or (blocking >= 0 and times[blocking] > horizon_us):
            in_window = count - bisect_right(times, horizon_us)
            retry_after_s = _INF if cost > limit else (times[blocking] - horizon_us) / 1e6
            reset_s = max(newest_us + window_us - now_us, 0) / 1e6
            return Decision(False, 0.0, retry_after_s, limit, limit - in_window, reset_s), state
        # Keep at most limit - cost entries, and none that has left the window (searched for
        # only when the oldest kept one has).
        keep_from = blocking + 1 if blocking >= 0 else 0
        if keep_from < count and times[keep_from] <= horizon_us:
            keep_from = bisect_right(times, horizon_us, keep_from)
        stamp_us = now_us if now_us > newest_us else newest_us
        kept = count - keep_from
        return (
            Decision(
                True, 0.0, 0.0, limit, limit - kept - cost, (stamp_us + window_us - now_us) / 1e6
            ),
            state[keep_from * _ENTRY_SIZE :] + _ENTRY.pack(stamp_us) * cost,
        )

    def is_idle(self, state: bytes, now_us: int) -> bool:
        if not state:
            return True
        newest_us: int = _ENTRY.unpack_from(state, len(state) - _ENTRY_SIZE)[0]
        return newest_us <= now_us - self.window_us

    def refund(
        self, state: bytes, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> bytes:
        """Exact when ``charged_us`` (the ``now_us`` of the decision that charged the request) is
        given: ``cost`` entries stamped at that time are removed. Without it the log is returned
        unchanged: which entries belong to the request is unknown, and forgetting newer ones
        in its place would let a later span hold more than the limit."""
        if charged_us is None or not state:
            return state
        times = memoryview(state).cast("q")
        # Its entries were stamped charged_us, unless the clock had stepped back (then they were
        # stamped later and are left alone). If they have been dropped as expired, so has every
        # entry of that time, and there is nothing to give back.
        first = bisect_right(times, charged_us - 1)
        last = min(first + cost, bisect_right(times, charged_us))
        if first == last:
            return state
        return state[: first * _ENTRY_SIZE] + state[last * _ENTRY_SIZE :]

    def rescale(self, state: bytes, previous: Algorithm[bytes], now_us: int) -> bytes | None:
        """Keep the same share of the limit used: the entries in the window are resampled to
        ``ceil(n * new_limit / old_limit)`` entries, keeping the newest (never more lenient)."""
        if not isinstance(previous, SlidingLog) or not state:
            return None
        times = unpack_log(state)
        in_window = times[bisect_right(times, now_us - previous.window_us) :]
        count = len(in_window)
        if count == 0:
            return None
        count_new = min(-(-count * self.limit // previous.limit), self.limit)
        # Entry j of the new log stands for entry ceil((j+1)*count/count_new) - 1 of the old one:
        # spread evenly and always ending at the newest.
        resampled = [in_window[-(-(j + 1) * count // count_new) - 1] for j in range(count_new)]
        return pack_log(resampled)

"""Sliding window counter: two fixed windows, the previous one weighted by the part of it still
inside the sliding window ending now (Cloudflare's and Envoy's approximation of a sliding log).

How the three window algorithms trade accuracy, memory and edge bursts: the table in
``gateway/algorithms/fixed_window.py``. The two windows are aligned as fixed windows are (on the
wall clock).

A request of ``cost`` at ``elapsed`` microseconds into the current window is admitted when::

    floor(previous * (window - elapsed) / window) + current + cost <= limit

in integers. The weighted previous count is rounded down, as the ``limits`` library does:
counting a fraction of a request as a whole one starves small limits (with ``limit`` 1 the
exact comparison admits one request every *two* windows under saturation, with 2 about one
in 1.95), while rounding down admits the configured rate and still never more than ``limit``
in an aligned window or in an instant. The worst case needs ``limit`` requests bunched at
the very end of one window and a steady stream through the next; with the arrival patterns of
real clients the estimate is close (Cloudflare measured 0.003% of decisions wrong), for the
memory of two counters.

State is one int, ``window_index << 2*count_bits | previous << count_bits | current``.
"""

from __future__ import annotations

from typing import Final

from gateway.algorithms.base import Algorithm, Decides, Decision
from gateway.algorithms.fixed_window import check_limit, window_us_from_s

_INF: Final = float("inf")


class SlidingWindow(Decides):
    """About ``limit`` units per sliding window of ``window_s``, from two window counters."""

    __slots__ = ("_count_bits", "_count_mask", "_counts_mask", "_index_shift", "limit", "window_us")

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = check_limit(limit)
        self.window_us = window_us_from_s(window_s)
        self._count_bits = limit.bit_length()
        self._count_mask = (1 << self._count_bits) - 1
        self._index_shift = 2 * self._count_bits
        # Both counts, below the window number.
        self._counts_mask = (1 << self._index_shift) - 1

    @property
    def name(self) -> str:
        return "sliding_window"

    def share(self, replicas: int) -> SlidingWindow:
        if replicas == 1:
            return self
        return SlidingWindow(max(self.limit // replicas, 1), self.window_us / 1e6)

    def __repr__(self) -> str:
        return f"SlidingWindow(limit={self.limit}, window_s={self.window_us / 1e6:g})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlidingWindow):
            return NotImplemented
        return (self.limit, self.window_us) == (other.limit, other.window_us)

    def __hash__(self) -> int:
        return hash((SlidingWindow, self.limit, self.window_us))

    def __reduce__(self) -> tuple[type[SlidingWindow], tuple[int, float]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return SlidingWindow, (self.limit, self.window_us / 1e6)

    def pack_state(self, window_index: int, previous: int, current: int) -> int:
        """The state for ``current`` units in window ``window_index`` and ``previous`` in the one
        before it."""
        return (window_index << self._index_shift) | (previous << self._count_bits) | current

    def unpack_state(self, state: int) -> tuple[int, int, int]:
        """``(window_index, previous, current)``."""
        bits = self._count_bits
        return (
            state >> self._index_shift,
            (state >> bits) & self._count_mask,
            state & self._count_mask,
        )

    def _counts_at(self, state: int | None, index: int) -> tuple[int, int, int]:
        """``(window_index, previous, current)`` as seen from window ``index``."""
        if state is None:
            return index, 0, 0
        state_index = state >> self._index_shift
        if state_index >= index:  # this window, or a newer one the clock stepped back from
            return (
                state_index,
                (state >> self._count_bits) & self._count_mask,
                state & self._count_mask,
            )
        if state_index == index - 1:
            return index, state & self._count_mask, 0
        return index, 0, 0

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[Decision, int | None]:
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        window_us = self.window_us
        index = now_us // window_us
        # The window's start as ``index * window_us`` when ``index`` is now's: compiled, that
        # product of two machine words goes through Python ints (about 800 instructions).
        now_index = index
        now_start_us = now_us - now_us % window_us
        # ``_counts_at``, inlined (the request path).
        in_state_window = False  # counting on in the window the state holds
        if state is None:
            previous = current = 0
        else:
            state_index = state >> self._index_shift
            if state_index >= index:  # this window, or a newer one the clock stepped back from
                index = state_index
                in_state_window = True
                # The state is wider than a machine word (the window number above the two
                # counts): one operation on it takes both counts, split as a small int.
                counts = state & self._counts_mask
                previous = counts >> self._count_bits
                current = counts & self._count_mask
            elif state_index == index - 1:
                previous = state & self._count_mask
                current = 0
            else:
                previous = current = 0
        start_us = now_start_us if index == now_index else index * window_us
        elapsed_us = now_us - start_us
        if elapsed_us < 0:
            elapsed_us = 0
        # The previous window's count, weighted by the share of it still inside the sliding
        # window, rounded down.
        weighted = previous * (window_us - elapsed_us) // window_us
        used = weighted + current + cost
        if used > self.limit:
            return self._rejection(now_us, start_us, weighted, previous, current, cost), state
        if in_state_window and state is not None:
            # The same window: ``cost`` added to the current count, the lowest field (it stays
            # within its bits: current + cost <= limit). Compiled, the state is wider than a
            # machine word, and one addition costs less than the shifts and ors below.
            new_state = state + cost
        else:
            new_state = (index << self._index_shift) | (
                (previous << self._count_bits) | current + cost
            )
        # Fully recovered once the current count has slid out: two windows after this one began.
        return (
            Decision(
                True,
                0.0,
                0.0,
                self.limit,
                self.limit - used,
                (start_us + 2 * window_us - now_us) / 1e6,
            ),
            new_state,
        )

    def _rejection(
        self, now_us: int, start_us: int, weighted: int, previous: int, current: int, cost: int
    ) -> Decision:
        window_us = self.window_us
        limit = self.limit
        remaining = max(limit - weighted - current, 0)
        recovered_us = start_us + (2 if current else 1) * window_us
        reset_s = max(recovered_us - now_us, 0) / 1e6
        if cost > limit:
            return Decision(False, 0.0, _INF, limit, remaining, reset_s)
        room = limit - cost - current
        if room >= 0:
            # Later in this window, once previous * weight_us // window_us <= room.
            weight_max_us = ((room + 1) * window_us - 1) // previous
            admit_us = start_us + window_us - weight_max_us
        else:
            # Next window, where the current count becomes the previous one.
            weight_max_us = min(((limit - cost + 1) * window_us - 1) // current, window_us)
            admit_us = start_us + 2 * window_us - weight_max_us
        return Decision(False, 0.0, max(admit_us - now_us, 1) / 1e6, limit, remaining, reset_s)

    def is_idle(self, state: int, now_us: int) -> bool:
        _, previous, current = self._counts_at(state, now_us // self.window_us)
        return previous == 0 and current == 0

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Exact when ``charged_us`` (the ``now_us`` of the decision that charged the request) is
        given: the cost comes off the window it was counted in. Without it the state is returned
        unchanged: taking it off the current window could forgive a request counted in the
        previous one at full weight, which is more than the limit allows."""
        if charged_us is None:
            return state
        index, previous, current = self.unpack_state(state)
        charged_index = charged_us // self.window_us
        if charged_index == index:
            current = current - cost if current > cost else 0
        elif charged_index == index - 1:
            previous = previous - cost if previous > cost else 0
        else:
            return state
        return (index << self._index_shift) | (previous << self._count_bits) | current

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Same window length: both counters scaled to the new limit, rounded up. New window
        length: the weighted count now becomes the same share of the new limit in the new
        current window."""
        if not isinstance(previous, SlidingWindow):
            return None
        index, count_previous, count_current = previous._counts_at(
            state, now_us // previous.window_us
        )
        if count_previous == 0 and count_current == 0:
            return None
        limit = self.limit
        if self.window_us == previous.window_us:
            scaled_previous = min(-(-count_previous * limit // previous.limit), limit)
            scaled_current = min(-(-count_current * limit // previous.limit), limit)
            return self.pack_state(index, scaled_previous, scaled_current)
        window_us = previous.window_us
        elapsed_us = max(now_us - index * window_us, 0)
        used_scaled = count_previous * (window_us - elapsed_us) + count_current * window_us
        count_new = min(-(-used_scaled * limit // (previous.limit * window_us)), limit)
        if count_new == 0:
            return None
        return self.pack_state(now_us // self.window_us, 0, count_new)

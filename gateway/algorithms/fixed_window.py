"""Fixed window counter: at most ``limit`` units in each window of ``window_s``, windows aligned
to multiples of the window length on the clock that supplies ``now_us``: the gateway's clock
reads the wall clock's epoch (``gateway/clock.py``), Redis ``TIME`` too, so a 15-minute window
ends at :00, :15, :30 and :45 UTC.

The three window algorithms trade accuracy against memory:

================  ===============================  ===================  ======================
algorithm         accuracy                         memory per key       burst at window edges
================  ===============================  ===================  ======================
fixed_window      exact per aligned window only;   one small int        yes: ``limit`` at the
                  up to ``2 * limit`` in a span                         end of one window and
                  of ``window`` straddling a                            ``limit`` again at the
                  boundary                                              start of the next
sliding_window    approximate: assumes the         one small int        damped: never more than
                  previous window's requests                            ``limit`` in an
                  were spread evenly; never more                        instant, but up to
                  than ``limit`` per aligned                            about ``2 * limit`` in
                  window, up to about                                   a span of ``window``
                  ``2 * limit`` in the worst span                       in the worst case
sliding_log       exact: never more than           8 bytes per unit     none
                  ``limit`` in any span of         admitted in the
                  ``window``                       last ``window``
================  ===============================  ===================  ======================

Operators know the fixed window from quotas ("1000 per hour"); it is the cheapest and the
easiest to explain, and its edge burst is the price.

State is one int, ``window_index << count_bits | count`` with ``count_bits`` wide enough for
``limit``: a window number and a count fit in one machine-sized int (about 32 bytes) for a
million keys. A clock step backwards into an older window keeps counting in the newer window
(stricter, never lenient).
"""

from __future__ import annotations

from typing import Final

from gateway.algorithms.base import Algorithm, Decides, Decision, require_int, require_number

_INF: Final = float("inf")


def window_us_from_s(window_s: float) -> int:
    """Window length in whole microseconds; at least 1."""
    require_number("window", window_s)
    if not window_s > 0:
        raise ValueError(f"window must be a positive number of seconds, got {window_s!r}")
    window_us = round(window_s * 1_000_000)
    if window_us < 1:
        raise ValueError(f"window must be at least 1 microsecond, got {window_s!r} s")
    return window_us


def check_limit(limit: int) -> int:
    require_int("limit", limit)
    if limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    return limit


class FixedWindow(Decides):
    """At most ``limit`` units per aligned window of ``window_s`` seconds."""

    __slots__ = ("_count_bits", "_count_mask", "limit", "window_us")

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = check_limit(limit)
        self.window_us = window_us_from_s(window_s)
        self._count_bits = limit.bit_length()
        self._count_mask = (1 << self._count_bits) - 1

    @property
    def name(self) -> str:
        return "fixed_window"

    def share(self, replicas: int) -> FixedWindow:
        if replicas == 1:
            return self
        return FixedWindow(max(self.limit // replicas, 1), self.window_us / 1e6)

    def __repr__(self) -> str:
        return f"FixedWindow(limit={self.limit}, window_s={self.window_us / 1e6:g})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FixedWindow):
            return NotImplemented
        return (self.limit, self.window_us) == (other.limit, other.window_us)

    def __hash__(self) -> int:
        return hash((FixedWindow, self.limit, self.window_us))

    def __reduce__(self) -> tuple[type[FixedWindow], tuple[int, float]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return FixedWindow, (self.limit, self.window_us / 1e6)

    def pack_state(self, window_index: int, count: int) -> int:
        """The state for ``count`` units charged in window number ``window_index``."""
        return (window_index << self._count_bits) | count

    def unpack_state(self, state: int) -> tuple[int, int]:
        """``(window_index, count)``."""
        return state >> self._count_bits, state & self._count_mask

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[Decision, int | None]:
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        window_us = self.window_us
        index = now_us // window_us
        count = 0
        if state is not None:
            state_index = state >> self._count_bits
            if state_index >= index:  # this window, or a newer one the clock stepped back from
                index = state_index
                count = state & self._count_mask
        limit = self.limit
        reset_s = ((index + 1) * window_us - now_us) / 1e6
        count += cost
        if count > limit:
            retry_after_s = reset_s if cost <= limit else _INF
            remaining = limit - count + cost
            return Decision(False, 0.0, retry_after_s, limit, remaining, reset_s), state
        return (
            Decision(True, 0.0, 0.0, limit, limit - count, reset_s),
            (index << self._count_bits) | count,
        )

    def is_idle(self, state: int, now_us: int) -> bool:
        return (state >> self._count_bits) < now_us // self.window_us

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Exact when ``charged_us`` (the ``now_us`` of the decision that charged the request) is
        given; without it the state is returned unchanged, because a request charged to an
        earlier window would otherwise be taken off the current one (more than the limit)."""
        if charged_us is None:
            return state
        index, count = state >> self._count_bits, state & self._count_mask
        if charged_us // self.window_us != index:
            return state  # charged to a window that is over: nothing left to give back
        count = count - cost if count > cost else 0
        return (index << self._count_bits) | count

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """Keep the same fraction of the window's quota used, rounded up (never more lenient).

        With a new window length the count moves to the new window containing ``now_us``.
        """
        if not isinstance(previous, FixedWindow) or previous.is_idle(state, now_us):
            return None
        index, count = previous.unpack_state(state)
        count_new = min(-(-count * self.limit // previous.limit), self.limit)
        if count_new == 0:
            return None
        if self.window_us != previous.window_us:
            index = now_us // self.window_us
        return (index << self._count_bits) | count_new

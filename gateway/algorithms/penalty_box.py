"""A penalty box (fastify-rate-limit's ``ban``, rate-limiter-flexible's ``blockDuration``): a
key a limit rejects ``after`` times within ``within`` is refused outright for ``block``.

Pure: the state is ``(first_strike_us, strikes, blocked_until_us)``, and every function takes
``now_us``. Strikes are counted in a window that opens at the first one; the strike that makes
``after`` blocks the key and starts the count afresh.
"""

from __future__ import annotations

from typing import Final

PenaltyState = tuple[int, int, int]
CLEAR: Final[PenaltyState] = (0, 0, 0)


class PenaltyBox:
    """One limit's ``penalty:``: how many rejections within how long block a key how long."""

    __slots__ = ("after", "block_us", "within_us")

    def __init__(self, after: int, within_s: float, block_s: float) -> None:
        if after < 1 or within_s <= 0 or block_s <= 0:
            raise ValueError("a penalty needs after >= 1, and within and block above 0")
        self.after = after
        self.within_us = round(within_s * 1_000_000)
        self.block_us = round(block_s * 1_000_000)

    @staticmethod
    def blocked_until(state: PenaltyState, now_us: int) -> int:
        """When the key's block ends; 0 when it is not blocked at ``now_us``."""
        until = state[2]
        return until if until > now_us else 0

    def strike(self, state: PenaltyState, now_us: int) -> PenaltyState:
        """The state after one more rejection at ``now_us``."""
        first, strikes, until = state
        if strikes == 0 or now_us - first >= self.within_us:
            first, strikes = now_us, 0
        strikes += 1
        if strikes >= self.after:
            return (now_us, 0, now_us + self.block_us)
        return (first, strikes, until)

    def idle(self, state: PenaltyState, now_us: int) -> bool:
        """Whether the state says nothing any more (no block, its strikes' window over)."""
        return state[2] <= now_us and (state[1] == 0 or now_us - state[0] >= self.within_us)


class PenaltyRefusal:
    """A store's word, in a refused verdict's ``states`` at the refusing limit's index, that
    the key was in that limit's penalty box until ``until_us`` (the Redis store looks the box
    up in the call that decides): the limits were not asked."""

    __slots__ = ("until_us",)

    def __init__(self, until_us: int) -> None:
        self.until_us = until_us

"""Penalties in process: one limit's penalty boxes by key, bounded like its state table
(``max_keys``; the entries that say nothing any more go first, then the oldest)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from gateway.algorithms.penalty_box import CLEAR, PenaltyBox, PenaltyState


class PenaltyBoxes(Protocol):
    """One limit's penalty boxes by key: in process (``PenaltyTable``), or shared by the
    workers (``stores.shared.penalties.SharedPenaltyTable``)."""

    box: PenaltyBox
    max_keys: int

    def __len__(self) -> int: ...

    def blocked_until(self, key: str, now_us: int) -> int: ...

    def strike(self, key: str, now_us: int) -> int: ...

    def block(self, key: str, until_us: int) -> None: ...

    def clear(self, key: str) -> bool: ...

    def blocked(self, now_us: int) -> Iterator[tuple[str, int]]: ...


class PenaltyTable:
    __slots__ = ("_states", "box", "max_keys")

    def __init__(self, box: PenaltyBox, max_keys: int) -> None:
        self.box = box
        self.max_keys = max_keys
        self._states: dict[str, PenaltyState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def blocked_until(self, key: str, now_us: int) -> int:
        """When ``key``'s block ends (0: not blocked): one dict probe."""
        state = self._states.get(key)
        return 0 if state is None else self.box.blocked_until(state, now_us)

    def strike(self, key: str, now_us: int) -> int:
        """Count a rejection of ``key``; when its block ends if this one blocks it, else 0."""
        states = self._states
        state = self.box.strike(states.get(key, CLEAR), now_us)
        if key not in states and len(states) >= self.max_keys:
            self._make_room(now_us)
        states[key] = state
        return state[2] if state[2] > now_us and state[1] == 0 else 0

    def block(self, key: str, until_us: int) -> None:
        """Block ``key`` until ``until_us`` (an operator's word: the keys' API)."""
        states = self._states
        if key not in states and len(states) >= self.max_keys:
            self._make_room(until_us)
        states[key] = (0, 0, until_us)

    def clear(self, key: str) -> bool:
        """Forget ``key``'s strikes and block; whether there were any."""
        return self._states.pop(key, None) is not None

    def blocked(self, now_us: int) -> Iterator[tuple[str, int]]:
        """The keys blocked at ``now_us``, with when each block ends."""
        for key, state in self._states.items():
            if state[2] > now_us:
                yield key, state[2]

    def _make_room(self, now_us: int) -> None:
        states = self._states
        idle = [key for key, state in states.items() if self.box.idle(state, now_us)]
        for key in idle:
            del states[key]
        if len(states) >= self.max_keys:
            # Still full of live entries: the oldest eighth goes at once, so a full table
            # is scanned once per max_keys / 8 new keys, not on each.
            for key in list(states)[: max(1, len(states) // 8)]:
                del states[key]

"""In-process state of one concurrency limit: slots held per key, and who waits for them.

Unlike a rate limit's table, nothing here may be evicted to make room: a key holding slots that
was forgotten would let its client past the limit until its requests finished. A key is tracked
exactly while it holds a slot or has a request waiting, and removed the moment it has neither,
so the table holds no more keys than there are requests in flight or waiting. When ``max_keys``
keys are tracked, a request under a new key is refused, as nginx's ``limit_conn`` refuses one
when its zone is full.

Waiting is first come, first served per key: a request that finds others waiting under its key
waits behind them even if its own cost would fit, and a release grants slots from the front of
the line for as long as the front fits. A ticket is whatever the caller wakes (a future); the
table only keeps them in order, so it stays a pure structure that a test drives by hand.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from gateway.algorithms.base import Decision
from gateway.algorithms.concurrency import Concurrency

T = TypeVar("T")


class _KeySlots(Generic[T]):
    """One key: the slots its requests hold and the line of those waiting (oldest first)."""

    __slots__ = ("held", "line")

    def __init__(self) -> None:
        self.held = 0
        self.line: deque[tuple[T, int]] = deque()


class SlotTable(Generic[T]):
    """``key -> slots held`` for one concurrency limit, and each key's line of waiters."""

    __slots__ = ("_keys", "algorithm", "max_keys", "refusals", "slots_in_use", "waiters")

    def __init__(self, max_keys: int, algorithm: Concurrency) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        self.max_keys = max_keys
        self.algorithm = algorithm
        self._keys: dict[str, _KeySlots[T]] = {}
        # Over every key: slots held and requests waiting (the gauges the metrics read).
        self.slots_in_use = 0
        self.waiters = 0
        # Requests refused because ``max_keys`` keys were tracked already.
        self.refusals = 0

    def __len__(self) -> int:
        """Keys tracked: each holds a slot or has a request waiting for one."""
        return len(self._keys)

    def held(self, key: str) -> int:
        slots = self._keys.get(key)
        return 0 if slots is None else slots.held

    def state(self, key: str) -> int | None:
        """The key's state as the algorithm takes it (``None``: no slot held)."""
        slots = self._keys.get(key)
        return None if slots is None or slots.held == 0 else slots.held

    def waiting(self, key: str) -> int:
        slots = self._keys.get(key)
        return 0 if slots is None else len(slots.line)

    def has_room(self, key: str) -> bool:
        """Whether ``key`` is tracked or may be (False: the table is full)."""
        return key in self._keys or len(self._keys) < self.max_keys

    def take(self, key: str, cost: int, now_us: int) -> Decision:
        """Take ``cost`` slots now if they fit, nobody waits ahead under this key and the
        table has room for the key."""
        slots = self._keys.get(key)
        held = 0 if slots is None else slots.held
        decision, new_state = self.algorithm.decide(held or None, now_us, cost)
        if not decision.allowed:
            return decision
        if slots is not None and slots.line:
            return self._refusal(held)  # first come, first served
        if slots is None and len(self._keys) >= self.max_keys:
            self.refusals += 1
            return self._refusal(held)
        assert new_state is not None
        self.put(key, new_state)
        return decision

    def _refusal(self, held: int) -> Decision:
        limit = self.algorithm.limit
        return Decision(False, 0.0, self.algorithm.retry_after_s, limit, limit - held, 0.0)

    def put(self, key: str, held: int) -> None:
        """Commit a decided state: ``held`` slots for ``key``. The caller decided it (a store
        deciding several limits at once) and checked ``has_room`` for a new key."""
        slots = self._keys.get(key)
        if slots is None:
            if held <= 0:
                return
            slots = self._keys[key] = _KeySlots()
        self.slots_in_use += held - slots.held
        slots.held = held
        if held <= 0 and not slots.line:
            del self._keys[key]

    def release(self, key: str, cost: int) -> list[T]:
        """Give back ``cost`` slots; the waiters now granted theirs, in order (their slots
        are taken for them: each must ``release`` in turn)."""
        slots = self._keys.get(key)
        if slots is None:
            return []  # nothing held: a reload started the limit afresh since the take
        self.put(key, self.algorithm.refund(slots.held, 0, cost))
        return self._grant(key)

    def wait(self, key: str, ticket: T, cost: int) -> bool:
        """Put ``ticket`` at the back of ``key``'s line; False when the table is full or
        ``cost`` can never fit (a request wanting more slots than the limit has)."""
        if cost > self.algorithm.limit:
            return False
        slots = self._keys.get(key)
        if slots is None:
            if len(self._keys) >= self.max_keys:
                self.refusals += 1
                return False
            slots = self._keys[key] = _KeySlots()
        slots.line.append((ticket, cost))
        self.waiters += 1
        return True

    def leave(self, key: str, ticket: T) -> list[T]:
        """Take ``ticket`` out of the line (its client went away or waited too long); the
        waiters granted because it no longer blocks the front."""
        slots = self._keys.get(key)
        if slots is None:
            return []
        line = slots.line
        for index, (waiter, _) in enumerate(line):
            if waiter is ticket:
                del line[index]
                self.waiters -= 1
                break
        else:
            return []
        return self._grant(key)

    def _grant(self, key: str) -> list[T]:
        slots = self._keys.get(key)
        if slots is None:
            return []
        line = slots.line
        granted: list[T] = []
        held = slots.held
        fits = self.algorithm.fits
        while line and fits(held, line[0][1]):
            ticket, cost = line.popleft()
            held += cost
            granted.append(ticket)
        self.waiters -= len(granted)
        self.slots_in_use += held - slots.held
        slots.held = held
        if held <= 0 and not line:
            del self._keys[key]
        return granted

    def keys(self) -> list[str]:
        """Keys tracked (for ``/explain`` and the dashboard)."""
        return list(self._keys)

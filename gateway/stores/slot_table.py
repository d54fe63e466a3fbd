"""In-process state of one concurrency limit: the slots each key's requests hold.

Unlike a rate limit's table, nothing here may be evicted to make room: a key holding slots that
was forgotten would let its client past the limit until its requests finished. A key is tracked
exactly while it holds a slot, and removed the moment it holds none, so the table holds no more
keys than there are requests in flight. When ``max_keys`` keys are tracked, a request under a
new key is refused, as nginx's ``limit_conn`` refuses one when its zone is full: the new key
reads as a key whose slots are all held (``get``), so the algorithm itself refuses it.

Who waits for a slot is not kept here: every store's requests wait in the engine's lines
(``engine/slot_lines.py``), in process whichever store holds the slots.
"""

from __future__ import annotations

from gateway.algorithms.concurrency import Concurrency


class SlotTable:
    """``key -> slots held`` for one concurrency limit; at most ``max_keys`` keys."""

    __slots__ = ("_held", "algorithm", "max_keys", "refusals", "slots_in_use")

    def __init__(self, max_keys: int, algorithm: Concurrency) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        self.max_keys = max_keys
        self.algorithm = algorithm
        self._held: dict[str, int] = {}
        self.slots_in_use = 0  # over every key (what the metrics and the leak checks read)
        self.refusals = 0  # requests under a new key refused because the table was full

    def __len__(self) -> int:
        """Keys tracked: each holds a slot."""
        return len(self._held)

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def get(self, key: str) -> int | None:
        """The key's state as the algorithm takes it: ``None`` for no slot held, and for a new
        key in a full table every slot held (counted as a refusal)."""
        held = self._held.get(key)
        if held is None and len(self._held) >= self.max_keys:
            self.refusals += 1
            return self.algorithm.limit
        return held

    def peek(self, key: str) -> int | None:
        """``get`` without counting a refusal (``/explain``)."""
        held = self._held.get(key)
        if held is None and len(self._held) >= self.max_keys:
            return self.algorithm.limit
        return held

    def put(self, key: str, held: int | None) -> None:
        """Commit a decided state: ``held`` slots for ``key`` (none: the key is forgotten)."""
        before = self._held.get(key, 0)
        if held is None or held <= 0:
            if before:
                del self._held[key]
            self.slots_in_use -= before
            return
        self._held[key] = held
        self.slots_in_use += held - before

    def release(self, key: str, cost: int) -> None:
        """Give back ``cost`` slots (none below zero: a reload may have started the limit
        afresh since they were taken)."""
        held = self._held.get(key)
        if held is not None:
            self.put(key, held - cost)

    def resize(self, max_keys: int) -> None:
        """A reload's bound: keys already holding slots keep them; only new keys are refused
        until the table is below it."""
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        self.max_keys = max_keys

    def held_keys(self) -> list[str]:
        """Keys holding slots (for the dashboard and tests)."""
        return list(self._held)

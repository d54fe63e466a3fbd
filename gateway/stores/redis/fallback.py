"""What the local fallback admitted while Redis could not answer, owed to Redis.

Redis never sees the requests the fallback admits: when it answers again, its windows and
buckets would admit a full quota on top of them. The store keeps a count per limit and key
(bounded) and charges it to Redis, one script call per limit and key, before its next decision
there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from gateway.limits.compiled import Check, CompiledLimit

MAX_OWED_KEYS: Final = 10_000
# Charges of owed admissions in flight together.
CARRY_BACK_BATCH: Final = 32


class CarryBackFailedError(Exception):
    """Charging the fallback's admissions failed while a request waited for it."""


class Owed:
    """Admissions per ``(limit, key)`` not yet charged to Redis; at most ``max_keys`` pairs
    (admissions for further pairs are only counted in ``dropped``)."""

    __slots__ = ("_entries", "dropped", "max_keys")

    def __init__(self, max_keys: int = MAX_OWED_KEYS) -> None:
        self.max_keys = max_keys
        self.dropped = 0
        self._entries: dict[tuple[str, str], tuple[CompiledLimit, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, checks: Sequence[Check], cost: int = 1) -> None:
        entries = self._entries
        for check in checks:
            pair = (check.limit.name, check.key)
            entry = entries.get(pair)
            charge = cost * check.cost  # a weighted request owes its cost
            if entry is None and len(entries) >= self.max_keys:
                self.dropped += charge
                continue
            # The newest limit object: a reload in between charges under its parameters.
            entries[pair] = (check.limit, charge + (entry[1] if entry is not None else 0))

    def take(self) -> list[tuple[Check, int]]:
        """Everything owed, forgotten here: the caller charges it or ``add``s it back."""
        taken = [(Check(limit, key), cost) for (_, key), (limit, cost) in self._entries.items()]
        self._entries = {}
        return taken


async def carry_back(owed: Owed, charge: Callable[[Check, int], Awaitable[object]]) -> None:
    """Charge everything ``owed`` holds, ``charge(check, units)`` per limit and key, a batch of
    calls in flight at a time. A failed call's units, and all not yet charged, go back into
    ``owed`` and the first failure is raised; cancelled, all not known to be charged go back
    (some maybe twice: never under)."""
    taken = owed.take()
    for start in range(0, len(taken), CARRY_BACK_BATCH):
        batch = taken[start : start + CARRY_BACK_BATCH]
        try:
            results = await asyncio.gather(
                *(charge(check, units) for check, units in batch), return_exceptions=True
            )
        except asyncio.CancelledError:
            for check, units in taken[start:]:
                owed.add((check,), units)
            raise
        failure: BaseException | None = None
        for (check, units), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                owed.add((check,), units)
                failure = failure or result
        if failure is not None:
            for check, units in taken[start + len(batch) :]:
                owed.add((check,), units)
            raise failure

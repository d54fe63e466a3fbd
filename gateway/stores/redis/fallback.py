"""What the local fallback admitted while Redis could not answer, owed to Redis.

Redis never sees the requests the fallback admits: when it answers again, its windows and
buckets would admit a full quota on top of them. The store keeps a count per limit and key
(bounded) and charges it to Redis, one script call per limit and key, before its next decision
there. In a cluster the counts are kept per node (``OwedToNodes``): a master that answers again
is charged its own before it decides again, while another may still be down.
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


class OwedToNodes:
    """``Owed`` per Redis node (``node_of`` a check: the master serving its key, ``""`` for a
    single server), each charged by ``settle`` before that node decides again. Filed by the
    node serving the key when the fallback admitted it, and again when the client reads a new
    slot map (``topology``: a failover moved the keys of a dead master to its replica)."""

    __slots__ = (
        "_charge",
        "_dropped",
        "_failures",
        "_locks",
        "_node_of",
        "_nodes",
        "_settling",
        "_topology",
        "_topology_now",
        "max_keys",
    )

    def __init__(
        self,
        charge: Callable[[Check, int], Awaitable[object]],
        node_of: Callable[[Check], str],
        topology: Callable[[], int],
        max_keys: int = MAX_OWED_KEYS,
    ) -> None:
        self._charge = charge
        self._node_of = node_of
        self._topology_now = topology
        self._topology = topology()
        self.max_keys = max_keys  # per node
        self._nodes: dict[str, Owed] = {}
        self._settling: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._failures: dict[str, int] = {}
        self._dropped = 0  # of the per-node counts no longer kept

    def __bool__(self) -> bool:
        return bool(self._nodes)

    def __len__(self) -> int:
        return sum(len(owed) for owed in self._nodes.values())

    def add(self, checks: Sequence[Check], cost: int = 1) -> None:
        for check in checks:
            node = self._node_of(check)
            owed = self._nodes.get(node)
            if owed is None:
                owed = self._nodes[node] = Owed(self.max_keys)
            owed.add((check,), cost)

    def due(self, node: str) -> bool:
        """Is something owed to ``node``, or being charged to it, that a decision there must
        wait for? (Cheap when nothing is owed anywhere: the request path asks.)"""
        if not self._nodes and not self._settling:
            return False
        return (
            node in self._nodes or node in self._settling or self._topology != self._topology_now()
        )

    async def settle(self, node: str) -> None:
        """Charge what is owed to ``node`` (``carry_back``); raises, keeping what was not
        charged, if Redis fails. Calls for the node meanwhile wait for it, and one that waited
        for a charge that failed raises at once (the node is not answering: no second wait)."""
        self._refile()
        lock = self._locks.get(node)
        if lock is None:
            lock = self._locks[node] = asyncio.Lock()
        failures = self._failures.get(node, 0)
        async with lock:
            if self._failures.get(node, 0) != failures:
                raise CarryBackFailedError("charging the fallback's admissions to Redis failed")
            owed = self._nodes.pop(node, None)
            if owed is None:
                return
            self._dropped += owed.dropped
            self._settling.add(node)
            try:
                await carry_back(owed, self._charge)
            except Exception:
                self._failures[node] = self._failures.get(node, 0) + 1
                raise
            finally:
                self._settling.discard(node)
                for check, units in owed.take():  # not charged: owed again, wherever it is now
                    self.add((check,), units)

    def _refile(self) -> None:
        """After a new slot map, each count under the node now serving its key."""
        topology = self._topology_now()
        if topology == self._topology:
            return
        self._topology = topology
        taken = [entry for owed in self._nodes.values() for entry in owed.take()]
        self._dropped += sum(owed.dropped for owed in self._nodes.values())
        self._nodes.clear()
        for check, units in taken:
            self.add((check,), units)

    @property
    def dropped(self) -> int:
        """Units owed past ``max_keys`` keys of a node, not carried back."""
        return self._dropped + sum(owed.dropped for owed in self._nodes.values())

"""Who waits for a concurrency limit's slot in this process: one first-come-first-served line
per limit and key.

A request over a concurrency limit whose ``max_delay`` lets it wait joins its key's line; a
request that finds anyone in that line joins it too, behind them, without taking a slot even
if one is free (first come, first served). Only the front of a line decides again: when a
request of this process gives a slot of that key back, the front is woken; a store whose slots
other processes hold too (shared, Redis) gives no word of their releases, so there the front
also looks again every ``POLL_S``. A woken front that gets its slot wakes the one behind it
(another slot may be free); one that leaves without a slot (it waited too long, its client
went away) wakes the new front.

The line holds tickets, not requests: the engine's waiting loop (``LimitEngine.wait_for_slot``)
is the request's side.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

# How often the front of a line looks again when other processes hold slots of the same keys.
POLL_S: Final = 0.01


class Ticket:
    """One waiting request's place: a future the line completes to wake it."""

    __slots__ = ("_woken", "key", "table")

    def __init__(self, table: str, key: str) -> None:
        self.table = table
        self.key = key
        self._woken: asyncio.Future[None] | None = None

    def armed(self) -> asyncio.Future[None]:
        """The future to wait on: the one a wake completed already (so a wake that came while
        the request was deciding is not lost), else a new one."""
        woken = self._woken
        if woken is None or (woken.done() and woken.cancelled()):
            woken = self._woken = asyncio.get_running_loop().create_future()
        return woken

    def consume(self) -> None:
        """The wake was seen: the next ``armed`` waits for another."""
        self._woken = None

    def wake(self) -> None:
        woken = self._woken
        if woken is None:
            woken = self._woken = asyncio.get_running_loop().create_future()
        if not woken.done():
            woken.set_result(None)


class SlotLines:
    """Every line of this process, by (limit table, key); a line exists while someone waits."""

    __slots__ = ("_lines", "closing_at", "waiting")

    def __init__(self) -> None:
        self._lines: dict[tuple[str, str], deque[Ticket]] = {}
        self.waiting = 0  # over every line: 0 lets the request path skip looking
        # The loop time the gateway stops at (shutdown): a waiter whose wait would end later
        # leaves the line with ``ShuttingDown`` (``close``).
        self.closing_at = float("inf")

    def ahead(self, table: str, key: str) -> bool:
        """Someone waits in this line (a newcomer must go behind them)."""
        return (table, key) in self._lines

    def join(self, table: str, key: str) -> Ticket:
        ticket = Ticket(table, key)
        line = self._lines.get((table, key))
        if line is None:
            line = self._lines[table, key] = deque()
        line.append(ticket)
        self.waiting += 1
        return ticket

    def is_front(self, ticket: Ticket) -> bool:
        line = self._lines.get((ticket.table, ticket.key))
        return line is not None and line[0] is ticket

    def leave(self, ticket: Ticket) -> None:
        """Take ``ticket`` out of its line and wake whoever is at the front then: a slot this
        one got, or did not use, may be free for them."""
        where = (ticket.table, ticket.key)
        line = self._lines.get(where)
        if line is None:
            return
        try:
            line.remove(ticket)
        except ValueError:
            return
        self.waiting -= 1
        if line:
            line[0].wake()
        else:
            del self._lines[where]

    def wake(self, table: str, key: str) -> None:
        """A slot of this key was given back: the front looks again."""
        line = self._lines.get((table, key))
        if line is not None:
            line[0].wake()

    def close(self, deadline: float) -> None:
        """The gateway stops at loop time ``deadline``: every waiter looks at once, and those
        that would wait past it leave the line (``ShuttingDown``)."""
        self.closing_at = deadline
        for line in self._lines.values():
            for ticket in line:
                ticket.wake()

"""Where delayed (shaped) requests wait: one heap and one loop timer for all of them.

A waiting request costs a heap entry and a future, not a timer handle of its own, which matters
when tens of thousands wait at once. On shutdown, requests that could not be served before the
deadline are released with ``ShuttingDown`` instead of being cut off.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class ShuttingDown(Exception):
    """The gateway stops before this request's delay would end."""


class DelayQueue:
    __slots__ = ("_heap", "_live", "_seq", "_timer", "_timer_due")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._live = 0  # waiters still waiting; the heap may also hold ones that left

    def __len__(self) -> int:
        return self._live

    def enter(self, delay_s: float) -> asyncio.Future[None]:
        """A future that completes after ``delay_s`` (or fails with ``ShuttingDown``).

        The caller awaits it and then calls ``leave()``, whatever happened: no coroutine of
        the queue's own sits on each waiting request's stack.
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        due = loop.time() + delay_s
        heapq.heappush(self._heap, (due, next(self._seq), waiter))
        if self._timer is None or due < self._timer_due:
            self._schedule(loop, due)
        self._live += 1
        return waiter

    def leave(self) -> None:
        self._live -= 1
        # Waiters that left early stay in the heap until due; drop them in bulk.
        if len(self._heap) > 2 * self._live + 64:
            self._compact()

    async def wait(self, delay_s: float) -> None:
        """Wait ``delay_s``; raises ``ShuttingDown`` if released early by ``release_after``."""
        try:
            await self.enter(delay_s)
        finally:
            self.leave()

    def release_after(self, deadline: float) -> int:
        """Release with ``ShuttingDown`` every waiter due after loop time ``deadline``."""
        released = 0
        for due, _, waiter in self._heap:
            if due > deadline and not waiter.done():
                waiter.set_exception(ShuttingDown())
                released += 1
        return released

    def _schedule(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = loop.call_at(due, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        heap = self._heap
        # Loop timers may fire a hair early (libuv counts whole milliseconds).
        now = loop.time() + 0.001
        while heap and heap[0][0] <= now:
            _, _, waiter = heapq.heappop(heap)
            if not waiter.done():
                waiter.set_result(None)
        if heap:
            self._schedule(loop, heap[0][0])

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].done()]
        heapq.heapify(self._heap)

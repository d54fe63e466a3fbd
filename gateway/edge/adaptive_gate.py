"""One upstream's adaptive limit in this worker: the controller, and who waits for a place.

Per worker: each worker of ``--workers N`` runs its own controller on the latencies it measures
itself. All of them see the same upstream slow down, so together they settle where one would
(each step is a fraction of its own limit, driven by the same latency); none has to ask the
others before a request goes out. A worker's probe for the minimum latency runs while the others
still send, so it reads a little high: the tolerance is then a little wider, never narrower.

A request beyond the limit waits first come, first served for ``max_delay`` at most (and only
while fewer than ``max_queue`` wait), or is shed at once; whoever holds a place gives it back
with ``release`` once the upstream has answered (or failed), and the front of the line gets it.

Waiting is cheap because it is common: in front of an upstream whose latency rises with load,
the limit settles below the clients' concurrency and the rest wait their turn. A waiter costs a
future and a place in the line, not a timer of its own: the line is first come, first served
and ``max_delay`` is the same for all, so deadlines come in the line's order and one loop timer,
set for the front's deadline, sheds whoever is at the front when theirs has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Final

from gateway.algorithms.gradient_limit import GradientLimit, GradientParams
from gateway.clock import Clock

# Loop timers may fire a little early (uvloop counts in milliseconds); closer than this is due.
_TIMER_SLACK_S: Final = 0.001


class AdaptiveGate:
    """``enter`` before a request goes to the upstream (False: shed it), ``release`` after."""

    __slots__ = (
        "_clock",
        "_timer",
        "_waiting",
        "controller",
        "max_delay_s",
        "max_queue",
        "retry_after_s",
        "shed",
        "status",
    )

    def __init__(
        self,
        params: GradientParams,
        clock: Clock,
        random: Callable[[], float],
        *,
        max_delay_s: float,
        max_queue: int,
        status: int = 503,
        retry_after_s: float = 1.0,
    ) -> None:
        self._clock = clock
        self.controller = GradientLimit(params, clock.now_us(), random)
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.status = status  # of a request shed, with ``Retry-After: retry_after_s``
        self.retry_after_s = retry_after_s
        # The line: each waiter's deadline (loop time) and its future (True: granted a place,
        # False: shed). Deadlines rise along it: arrival order plus the same ``max_delay_s``.
        self._waiting: deque[tuple[float, asyncio.Future[bool]]] = deque()
        # Set for a deadline no later than the front's while anyone waits (it may be a
        # deadline of someone granted since: it then sets itself again for the new front).
        self._timer: asyncio.TimerHandle | None = None
        self.shed = 0  # requests refused a place (at once or after waiting max_delay)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def try_enter(self) -> bool:
        """A place now, if one is free and nobody waits ahead."""
        return not self._waiting and self.controller.try_acquire()

    async def enter(self) -> bool:
        """A place, now or after waiting; False when shed. A caller cancelled while waiting
        holds nothing."""
        if self.try_enter():
            return True
        if self.max_delay_s <= 0 or len(self._waiting) >= self.max_queue:
            self.shed += 1
            return False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        deadline = loop.time() + self.max_delay_s
        place = (deadline, waiter)
        self._waiting.append(place)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire, loop)
        try:
            return await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):  # skipped by a grant or the timer
                    self._waiting.remove(place)
            elif waiter.result():
                self.release(0, measured=False)  # granted as it left: pass the place on
            raise

    def started(self) -> int:
        """A request that holds a place goes out now: its start, for ``release``."""
        now_us = self._clock.now_us()
        self.controller.started(now_us)
        return now_us

    def release(self, started_us: int, *, measured: bool = True) -> None:
        """Give a place back; ``started_us`` is when its request went to the upstream (its
        latency is measured to now, when ``measured``)."""
        self.controller.release(started_us, self._clock.now_us(), measured=measured)
        self._grant()

    def _grant(self) -> None:
        waiting = self._waiting
        controller = self.controller
        while waiting and controller.in_flight < controller.limit:
            _, waiter = waiting.popleft()
            if waiter.done():
                continue  # cancelled: already leaving
            controller.try_acquire()
            waiter.set_result(True)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Shed those at the front whose deadline has passed; set the timer for the next."""
        self._timer = None
        waiting = self._waiting
        due = loop.time() + _TIMER_SLACK_S
        while waiting:
            deadline, waiter = waiting[0]
            if deadline > due:
                self._timer = loop.call_at(deadline, self._expire, loop)
                return
            waiting.popleft()
            if not waiter.done():  # else cancelled: already leaving
                waiter.set_result(False)
                self.shed += 1

"""One upstream's adaptive limit in this worker: the controller, and who waits for a place.

Per worker: each worker of ``--workers N`` runs its own controller on the latencies it measures
itself. All of them see the same upstream slow down, so together they settle where one would
(each step is a fraction of its own limit, driven by the same latency); none has to ask the
others before a request goes out. A worker's probe for the minimum latency runs while the others
still send, so it reads a little high: the tolerance is then a little wider, never narrower.

A request beyond the limit waits first come, first served for ``max_delay`` at most (and only
while fewer than ``max_queue`` wait), or is shed at once; whoever holds a place gives it back
with ``release`` once the upstream has answered (or failed), and the front of the line gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from gateway.algorithms.gradient_limit import GradientLimit, GradientParams
from gateway.clock import Clock


class AdaptiveGate:
    """``enter`` before a request goes to the upstream (False: shed it), ``release`` after."""

    __slots__ = (
        "_clock",
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
        self._waiting: deque[asyncio.Future[None]] = deque()
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
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await asyncio.wait_for(waiter, self.max_delay_s)
        except TimeoutError:
            self._forget(waiter)
            self.shed += 1
            return False
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(0, measured=False)  # granted as it left: pass the place on
            else:
                self._forget(waiter)
            raise
        return True

    def now_us(self) -> int:
        """The gate's clock: a request's start, for ``release``."""
        return self._clock.now_us()

    def release(self, started_us: int, *, measured: bool = True) -> None:
        """Give a place back; ``started_us`` is when its request went to the upstream (its
        latency is measured to now, when ``measured``)."""
        self.controller.release(started_us, self._clock.now_us(), measured=measured)
        self._grant()

    def _grant(self) -> None:
        waiting = self._waiting
        controller = self.controller
        while waiting and controller.in_flight < controller.limit:
            waiter = waiting.popleft()
            if waiter.done():
                continue  # timed out or cancelled: already left
            controller.try_acquire()
            waiter.set_result(None)

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):  # granted and popped already
            self._waiting.remove(waiter)

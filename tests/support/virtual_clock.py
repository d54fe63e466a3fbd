"""An event loop on a virtual clock: when nothing is ready and the next timer is due in
``t`` seconds, the clock jumps ``t`` instead of the loop sleeping. Code that reads
``loop.time()`` and schedules with ``call_at`` (the shaping queue) is then tested exactly and
at once: a timer fires at its due instant, neither early nor late, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only I/O can wake the loop
            return super().select(None)
        ready = super().select(0)
        if not ready and timeout > 0:
            self._loop.advance(timeout)
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual, starting at 0; it moves only when the loop would wait."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_on_virtual_clock(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion on a fresh ``VirtualClockLoop``."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

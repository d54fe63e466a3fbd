"""Log lines rate-limited per cause, so an outage or an attack cannot flood the log.

The first line of a cause is written at once; while the same cause recurs within ``interval_s``,
its lines are only counted, and when the interval ends one line says how many there were (with
the facts of the last line written). A caller on the request path asks ``due`` first: when the
line is not due that costs a dict lookup, a clock read and a compare, and the message is never
formatted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Final

# One line per cause at most this often (nginx writes every one; a storm of 10,000 a second
# is then one line every ten seconds per cause, with its count).
LOG_INTERVAL_S: Final = 10.0
# Causes remembered at most; past this, those whose interval is over are forgotten.
MAX_CAUSES: Final = 4096


class _Cause:
    __slots__ = ("level", "message", "next_at", "suppressed", "timer")

    def __init__(self, next_at: float, level: int, message: str) -> None:
        self.next_at = next_at
        self.suppressed = 0
        self.level = level
        self.message = message
        self.timer: asyncio.TimerHandle | None = None


class LogThrottle:
    """One logger's lines, at most one per cause per ``interval_s`` (with the count of the
    others)."""

    __slots__ = ("_causes", "_clock", "interval_s", "logger")

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._causes: dict[Hashable, _Cause] = {}

    def due(self, cause: Hashable) -> bool:
        """Whether a line of ``cause`` should be written now; if not, it is counted."""
        entry = self._causes.get(cause)
        if entry is None:
            return True
        if self._clock() < entry.next_at:
            entry.suppressed += 1
            if entry.timer is None and entry.suppressed == 1:
                self._summary_later(cause, entry)
            return False
        return True

    def log(self, level: int, cause: Hashable, message: str) -> None:
        """Write ``message`` (call when ``due``), with the count held back since the last line
        of this cause, and start its interval."""
        now = self._clock()
        causes = self._causes
        entry = causes.get(cause)
        suppressed = 0
        if entry is None:
            if len(causes) >= MAX_CAUSES:
                self._forget(now)
            entry = causes[cause] = _Cause(now + self.interval_s, level, message)
        else:
            suppressed = entry.suppressed
            entry.next_at = now + self.interval_s
            entry.suppressed = 0
            entry.level = level
            entry.message = message
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
        if suppressed:
            message += f" (and {suppressed} more like this since the last such line)"
        self.logger.log(level, "%s", message)

    def flush(self) -> None:
        """Write the counts of the causes whose interval is over (the loop's timers do this on
        their own; tests on a fake clock call it)."""
        now = self._clock()
        for cause, entry in list(self._causes.items()):
            if entry.suppressed and now >= entry.next_at:
                self._summary(cause, entry)

    def _summary_later(self, cause: Hashable, entry: _Cause) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a test, a tool): ``flush`` writes it
        delay = max(0.0, entry.next_at - self._clock())
        entry.timer = loop.call_later(delay, self._summary, cause, entry)

    def _summary(self, cause: Hashable, entry: _Cause) -> None:
        """The end of an interval with lines held back: their count, and a new interval."""
        entry.timer = None
        if self._causes.get(cause) is not entry or not entry.suppressed:
            return
        count, entry.suppressed = entry.suppressed, 0
        entry.next_at = self._clock() + self.interval_s
        self.logger.log(
            entry.level,
            "%s (and %d more like this in the last %s)",
            entry.message,
            count,
            self._span(),
        )

    def _forget(self, now: float) -> None:
        for cause, entry in list(self._causes.items()):
            if now >= entry.next_at and not entry.suppressed:
                del self._causes[cause]
        if len(self._causes) >= MAX_CAUSES:  # all busy: the oldest go
            for cause in list(self._causes)[: MAX_CAUSES // 4]:
                entry = self._causes.pop(cause)
                if entry.timer is not None:
                    entry.timer.cancel()

    def _span(self) -> str:
        return f"{self.interval_s:g}s"

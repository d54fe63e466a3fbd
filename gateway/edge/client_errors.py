"""A client's malformed request logged as one line, not as the gateway's fault.

aiohttp logs every request its parser refuses (a bad header, a line too long, a broken chunk)
as ``ERROR Error handling request`` with a traceback of 9-11 lines, the client's bytes
quoted in it: one client sending junk floods the log and fires the alerts kept for ERROR.
Those errors are the client's (nginx logs them at ``info``). Both listeners hand aiohttp this
logger (the ``logger`` argument of its request handler): a client's protocol error becomes
one line at ``server.client_error_log_level``, with the listener, the peer, the status and
the reason (the parser's words, without the client's bytes), at most one line per cause every
``INTERVAL_S`` with the count of those suppressed meanwhile. Everything else, our own faults
among it, passes through to aiohttp's logger unchanged: ERROR with its traceback.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Final

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger

from gateway.clock import Clock, MonotonicClock

log = logging.getLogger("gateway.client")

INTERVAL_S: Final = 10.0
# Causes remembered at once; past this many (reasons differ with the bytes a client sends)
# the one seen least recently is forgotten.
MAX_CAUSES: Final = 256


# Where a parser's message starts quoting what the client sent: a quote, b'...', bytearray(,
# not inside a word (the parser's own "can't").
_QUOTED = re.compile(r"""[:\s]*(?<![A-Za-z0-9])(?:b?['"]|bytearray\().*""")


def reason_of(exc: HttpProcessingError) -> str:
    """The parser's first line, without the client's bytes it quotes (a log line must not
    carry what a client chose to write into it)."""
    lines = [line.strip() for line in str(exc.message).splitlines() if line.strip()]
    first = _QUOTED.sub("", lines[0] if lines else "").rstrip(": ")[:120]
    return "".join(c if c.isprintable() else "?" for c in first) or type(exc).__name__


class ClientErrorLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger for one listener, with clients' protocol errors made one line,
    rate-limited per cause (see the module)."""

    def __init__(self, listener: str, level: int = logging.INFO, clock: Clock | None = None):
        super().__init__(server_logger, {})
        self.listener = listener
        self.client_level = level  # changed by a reload
        self._clock: Clock = clock or MonotonicClock()
        # cause -> (when its last line was written, in us; lines suppressed since)
        self._causes: dict[tuple[str, int, str], tuple[int, int]] = {}

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            peer = args[0] if args and str(msg).startswith("Error handling request") else None
            self.client_error(exc, str(peer) if peer is not None else "-")
            return
        super().log(level, msg, *args, **kwargs)

    def client_error(self, exc: HttpProcessingError, peer: str) -> None:
        reason = reason_of(exc)
        cause = (type(exc).__name__, exc.code, reason)
        now_us = self._clock.now_us()
        last = self._causes.pop(cause, None)
        if last is not None and now_us - last[0] < INTERVAL_S * 1_000_000:
            self._causes[cause] = (last[0], last[1] + 1)
            return
        suppressed = last[1] if last is not None else 0
        self._causes[cause] = (now_us, 0)
        if len(self._causes) > MAX_CAUSES:
            del self._causes[next(iter(self._causes))]
        log.log(
            self.client_level,
            "client protocol error on the %s listener from %s: %d %s%s",
            self.listener,
            peer,
            exc.code,
            reason,
            f" ({suppressed} more like it since the last line)" if suppressed else "",
        )

"""Upstream failures, said where an operator looks: one error line per cause (rate-limited, with
how many were held back) naming the upstream, the server, its address and what went wrong, and
each upstream's recent failures for ``/status`` and the dashboard.

An upstream's pool (``pool.server_pool``) calls ``record`` for each failed exchange with one of its
servers; the upstream's name is the record's own.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gateway.edge.upstream_client import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.log_throttle import LOG_INTERVAL_S, LogThrottle

log = logging.getLogger("gateway.upstream")

# What went wrong, as ``/status`` and the log name it.
CAUSES: Final = ("refused", "timeout", "tls", "reset", "protocol", "dns", "unreachable", "other")
RECENT_KEPT: Final = 10

# OpenSSL's verify results that mean "a CA this gateway does not trust signed it".
_UNTRUSTED = frozenset({2, 18, 19, 20, 21})  # no issuer, self-signed (in chain), unverifiable


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed exchange with a server of an upstream."""

    at: float  # wall-clock seconds
    server: str  # the server's URL, as configured
    address: str  # host:port connected to
    cause: str  # one of CAUSES
    detail: str


def failure_cause(exc: BaseException) -> tuple[str, str]:
    """``(cause, detail)``: the kind of an upstream failure, and the facts to act on."""
    root = exc.__cause__
    if isinstance(root, ssl.SSLCertVerificationError):
        return "tls", _verify_detail(root)
    if isinstance(root, ssl.SSLError):
        return "tls", f"TLS failed: {root.reason or root}"
    if isinstance(exc, UpstreamTimeout):
        return "timeout", str(exc)
    if isinstance(exc, UpstreamConnectError):
        if isinstance(root, ConnectionRefusedError):
            return "refused", "connection refused"
        if isinstance(root, socket.gaierror):
            return "dns", f"cannot resolve the host: {root.strerror or root}"
        if isinstance(root, OSError) and root.errno is not None:
            return "unreachable", str(root.strerror or root).lower()
        return "other", str(exc)
    if isinstance(exc, UpstreamClosed):
        return "reset", str(exc)
    if isinstance(exc, UpstreamProtocolError):
        return "protocol", str(exc)
    return "other", str(exc) or exc.__class__.__name__


def _verify_detail(error: ssl.SSLCertVerificationError) -> str:
    message = error.verify_message or str(error)
    detail = f"TLS certificate verification failed: {message}"
    if error.verify_code in _UNTRUSTED:
        detail += " (set the upstream's ca_file to the CA that signed its certificate)"
    return detail


class UpstreamFailures:
    """One upstream's failures: logged once per cause per interval, the recent ones kept."""

    __slots__ = ("_throttle", "_wall_clock", "by_cause", "name", "recent")

    def __init__(
        self,
        name: str,
        *,
        interval_s: float = LOG_INTERVAL_S,
        wall_clock: Callable[[], float] = time.time,
        throttle: LogThrottle | None = None,
    ) -> None:
        self.name = name
        self.by_cause: dict[str, int] = {}
        self.recent: deque[Failure] = deque(maxlen=RECENT_KEPT)
        self._wall_clock = wall_clock
        self._throttle = throttle or LogThrottle(log, interval_s)

    def record(self, server: str, address: str, exc: BaseException) -> str:
        """Count and (when due) log a failure of ``server`` (its URL) at ``address``
        (``host:port`` connected to); its cause."""
        cause, detail = failure_cause(exc)
        if cause == "reset" and server.startswith("https://") and "before answering" in detail:
            detail += (
                " (an https server that requires a client certificate does this: see client_cert)"
            )
        self.by_cause[cause] = self.by_cause.get(cause, 0) + 1
        self.recent.append(Failure(self._wall_clock(), server, address, cause, detail))
        throttle = self._throttle
        key = (server, cause)
        if throttle.due(key):
            throttle.log(
                logging.ERROR,
                key,
                f"upstream {self.name} failed: {detail} (cause {cause}, server {server}, "
                f"address {address})",
            )
        return cause

"""How the observer names an upstream's failure.

What the proxy learns about a request on the way (its route, its client, an upstream's
failure, the costs reported, an answer of the gateway's own) is written on the request's own
record (``request_record.RequestRecord``), which the observer reads when the request is done.
This module imports nothing from the proxy, so the proxy can import it.
"""

from __future__ import annotations

from typing import Final

from gateway.edge.upstream_client import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

# The bounded set of reasons the ``reason`` label of upstream errors takes.
UPSTREAM_ERROR_REASONS: Final = ("connect", "timeout", "reset", "protocol", "other")


def upstream_error_reason(exc: UpstreamError) -> str:
    """The metric label for an upstream failure (a ``_StaleConnection`` is a reset too)."""
    if isinstance(exc, UpstreamConnectError):
        return "connect"
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, UpstreamClosed):
        return "reset"
    if isinstance(exc, UpstreamProtocolError):
        return "protocol"
    return "other"

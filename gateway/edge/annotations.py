"""What the proxy handler leaves on a request for the observer to read once it is answered.

The proxy learns a request's route, client and upstream errors at different points; rather than
thread a record through every return path, it writes each fact into the request's own storage
(one dict write each, typed ``RequestKey``\\ s) and the observer wrapped around the handler reads
them when the handler returns. The limits' outcome, present on every limited request, is handed
to the observer as an argument instead. This module imports nothing from the proxy, so the proxy
can import it.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from gateway.edge.upstream_client import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

ROUTE_NAME: Final = web.RequestKey("route", str)
CLIENT_IP: Final = web.RequestKey("client_ip", str)
UPSTREAM_ERROR: Final = web.RequestKey("upstream_error", str)
# The cost headers the upstream's response held (limits charged after the response), by
# lower-case name: the access log records them, so a replay can charge what was charged.
REPORTED_COSTS: Final = web.RequestKey("reported_costs", dict[str, str])
# Set on the few answers of the gateway's own that the facts above do not already tell apart
# from an upstream's answer (413, 408, 400 on a routed request; 503 while shutting down).
LOCAL_ANSWER: Final = web.RequestKey("local_answer", bool)

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

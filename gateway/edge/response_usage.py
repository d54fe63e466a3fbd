"""The usage a response's body reports (``cost_from``), between the relay and the charge: a
meter for the body as it passes, and what it read, filed beside the cost headers for the
limits and the access log. A body that reports none is logged, once per cause and route."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gateway.edge.request_record import RequestRecord
from gateway.limits.usage import CUT, MODEL, UsageMeter, UsageSource, is_event_stream
from gateway.log_throttle import LogThrottle

log = logging.getLogger("gateway.limits")


def usage_meter(
    sources: Sequence[UsageSource], headers: Iterable[tuple[bytes, bytes]]
) -> UsageMeter:
    """A meter for a response with ``headers``: an event stream's, or a JSON body's."""
    content_type = None
    for name, value in headers:
        if name.lower() == b"content-type":
            content_type = value.decode("latin-1")
            break
    return UsageMeter(sources, is_event_stream(content_type))


def usage_reported(
    request: RequestRecord,
    meter: UsageMeter,
    headers: dict[bytes, bytes] | None,
    throttle: LogThrottle,
) -> dict[bytes, bytes]:
    """What the response reported its cost to be: the cost ``headers``, the body's usage and
    the model it named (``MODEL``; recorded for the access log too); a body without a usable
    usage is logged, once per cause (``throttle``, the policy's)."""
    reported = dict(headers) if headers else {}
    complete = meter.complete
    if not complete:
        # Cut short (the client left, the upstream failed): a limit charges at least what
        # the request holds (``CUT``), or the usage reported so far if that is more.
        reported[CUT] = b"1"
    for source, reading, problem in meter.readings():
        if reading is None:
            if complete:
                _missing(request, source, problem, throttle)
            continue
        reported[source.key] = b"%d" % reading
    if meter.model is not None:
        reported[MODEL] = meter.model.encode("ascii")
    if reported:
        logged = dict(request.reported_costs or {})
        for name, value in reported.items():
            logged[name.decode("latin-1")] = value.decode("latin-1")
        request.reported_costs = logged
    return reported


def _missing(
    request: RequestRecord, source: UsageSource, problem: str, throttle: LogThrottle
) -> None:
    route = request.route_name or ""
    cause = (source.text, route, problem)
    if throttle.due(cause):
        throttle.log(
            logging.WARNING,
            cause,
            f"cost_from {source.text!r}: a response on route {route!r} reported no usable "
            f"usage ({problem}); its limits charge the request's reserve (or cost)",
        )


def usage_log() -> LogThrottle:
    """The log of bodies without a usable usage, one line per cause at most every 10 s."""
    return LogThrottle(log)

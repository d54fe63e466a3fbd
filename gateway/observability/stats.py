"""Per-worker counters the hot path increments: plain ints in dicts and lists, no locks.

prometheus-client's own metric objects take a lock and a ``labels()`` lookup per update; these
take a dict increment. They are read, never reset, once per second (snapshot) and per scrape.
"""

from __future__ import annotations

from typing import Final

from gateway.histogram import Histogram

# (Typed in full: mypyc 2.4 leaves a ``Final`` tuple of floats with an inferred type unset.)
# Upper bounds (seconds, Prometheus ``le``) of the histogram buckets; +Inf is implied.
REQUEST_DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
QUEUE_WAIT_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# The ``method`` label: these, anything else is ``OTHER`` (a client picks the method).
KNOWN_METHODS: Final = {
    m: m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH")
}
OTHER_METHOD: Final = "OTHER"
# The ``route`` label of requests no route took (a route name must start with a letter/digit).
UNMATCHED_ROUTE: Final = "_unmatched"


class RequestStats:
    """Requests by (route, method, status class), durations by route, upstream errors."""

    __slots__ = ("delayed", "durations", "limited", "local", "requests", "upstream_errors")

    def __init__(self) -> None:
        # Requests a limit refused, and requests a limit delayed (each once, however many
        # limits took part).
        self.limited = 0
        self.delayed = 0
        # (route, method, status // 100) -> count
        self.requests: dict[tuple[str, str, int], int] = {}
        self.durations: dict[str, Histogram] = {}
        # (route, reason) -> count
        self.upstream_errors: dict[tuple[str, str], int] = {}
        # (route, exact status) -> count, of the answers the gateway gave itself
        self.local: dict[tuple[str, int], int] = {}

    def record(self, route: str, method: str, status: int, duration_s: float) -> None:
        key = (route, KNOWN_METHODS.get(method, OTHER_METHOD), status // 100)
        requests = self.requests
        requests[key] = requests.get(key, 0) + 1
        histogram = self.durations.get(route)
        if histogram is None:
            histogram = self.durations[route] = Histogram(REQUEST_DURATION_BUCKETS)
        histogram.observe(duration_s)

    def upstream_error(self, route: str, reason: str) -> None:
        key = (route, reason)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def local_answer(self, route: str, status: int) -> None:
        key = (route, status)
        self.local[key] = self.local.get(key, 0) + 1


class QueueWaits:
    """How long delayed requests waited, per limit."""

    __slots__ = ("by_limit",)

    def __init__(self) -> None:
        self.by_limit: dict[str, Histogram] = {}

    def observe(self, limit: str, wait_s: float) -> None:
        histogram = self.by_limit.get(limit)
        if histogram is None:
            histogram = self.by_limit[limit] = Histogram(QUEUE_WAIT_BUCKETS)
        histogram.observe(wait_s)

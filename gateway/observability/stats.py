"""Per-worker counters the hot path increments: plain ints in dicts and lists, no locks.

prometheus-client's own metric objects take a lock and a ``labels()`` lookup per update; these
take a dict increment. They are read, never reset, once per second (snapshot) and per scrape.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from typing import Final

log = logging.getLogger("gateway.store")

# Upper bounds (seconds, Prometheus ``le``) of the histogram buckets; +Inf is implied.
REQUEST_DURATION_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
QUEUE_WAIT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
STORE_LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip

# The ``method`` label: these, anything else is ``OTHER`` (a client picks the method).
KNOWN_METHODS: Final = {
    m: m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH")
}
OTHER_METHOD: Final = "OTHER"
# The ``route`` label of requests no route took (a route name must start with a letter/digit).
UNMATCHED_ROUTE: Final = "_unmatched"


class Histogram:
    """Bucket counts (not cumulative) and a sum; the last count is the +Inf bucket."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class RequestStats:
    """Requests by (route, method, status class), durations by route, upstream errors."""

    __slots__ = ("durations", "local", "requests", "upstream_errors")

    def __init__(self) -> None:
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


class UpgradeStats:
    """Upgraded (WebSocket) connections: open now, opened in all, bytes relayed each way, and
    how many the idle timeout closed. The relay adds to these as bytes pass (one int add)."""

    __slots__ = ("bytes_from_client", "bytes_from_upstream", "idle_timeouts", "open", "total")

    def __init__(self) -> None:
        self.open = 0
        self.total = 0
        self.bytes_from_client = 0
        self.bytes_from_upstream = 0
        self.idle_timeouts = 0


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


# Values of ``StoreStats.state``, what answers the limit decisions: ``ok`` the store itself;
# ``fallback`` the Redis store's ``on_failure`` after a failed call, its circuit still closed;
# ``open`` / ``half_open`` its circuit's states, ``on_failure`` answering meanwhile.
STORE_STATES: Final = ("ok", "fallback", "open", "half_open")


class StoreStats:
    """What a limit store reports about itself; a store holds one as ``store.stats``.

    The memory store needs only ``calls``; a remote store also times its calls, counts its
    errors and reports its state with ``set_state`` (which logs each change, not each call).
    """

    __slots__ = ("calls", "errors", "latency", "state", "transitions")

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.latency = Histogram(STORE_LATENCY_BUCKETS)
        self.state = "ok"
        # How often each change of state happened, keyed "from>to": a gauge sampled once a
        # second misses a circuit that opened and closed in between; this does not.
        self.transitions: dict[str, int] = {}

    def observe(self, seconds: float) -> None:
        """One call that took ``seconds``."""
        self.calls += 1
        self.latency.observe(seconds)

    def error(self) -> None:
        self.errors += 1

    def set_state(self, state: str, reason: str = "") -> None:
        """Move to ``state`` (one of ``STORE_STATES``), logging the transition if it is one."""
        if state not in STORE_STATES:
            raise ValueError(f"unknown store state {state!r}; expected one of {STORE_STATES}")
        if state != self.state:
            level = logging.INFO if state == "ok" else logging.WARNING
            log.log(
                level, "store state %s -> %s%s", self.state, state, f": {reason}" if reason else ""
            )
            change = f"{self.state}>{state}"
            self.transitions[change] = self.transitions.get(change, 0) + 1
            self.state = state

"""What a limit store reports about itself: calls, errors, latency and its state.

The store counts as it works (an int add, a histogram bucket); observability reads these once a
second and per scrape, so it imports this module, never the other way round.
"""

from __future__ import annotations

import logging
from typing import Final

from gateway.histogram import Histogram

log = logging.getLogger("gateway.store")

# (Typed in full: mypyc 2.4 leaves a ``Final`` tuple of floats with an inferred type unset.)
# Upper bounds (seconds, Prometheus ``le``) of the store latency buckets; +Inf is implied.
STORE_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip

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
            self.moved(state)

    def moved(self, state: str) -> None:
        """Move to ``state`` and count the transition, without a log line: for a change its
        cause has logged already (the circuit breaker logs its own)."""
        if state != self.state:
            change = f"{self.state}>{state}"
            self.transitions[change] = self.transitions.get(change, 0) + 1
            self.state = state

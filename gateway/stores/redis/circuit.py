"""A circuit breaker, so a dead Redis does not add its timeout to every request.

Closed: calls go through; ``failure_threshold`` failures in a row open the circuit. Open: calls
are refused at once (the caller falls back) until ``reset_timeout_s`` has passed. Then one call
is let through as a probe (half-open) while the others keep falling back: success closes the
circuit; failure opens it again for twice as long, up to ``max_reset_timeout_s``. A probe that
is cancelled before it can tell (its client hung up) puts the circuit back to open with the
next call probing, so a half-open circuit always has a probe out. Every transition is logged
and counted; ``state`` and the counters are plain attributes for metrics.

``NodeCircuits`` keeps one breaker per Redis node: in a cluster, a dead master opens the
circuit of the keys it serves only, and the others' keys go on being decided in Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, Literal

from gateway.clock import Clock, MonotonicClock

log = logging.getLogger("gateway.circuit")

State = Literal["closed", "open", "half_open"]
CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


class CircuitBreaker:
    """Closed / open / half-open with one probe at a time and exponential back-off."""

    __slots__ = (
        "_clock",
        "_consecutive_failures",
        "_open_for_us",
        "_retry_at_us",
        "failure_threshold",
        "failures",
        "max_reset_timeout_s",
        "name",
        "on_transition",
        "opened",
        "probes",
        "reset_timeout_s",
        "short_circuited",
        "state",
        "transitions",
    )

    def __init__(
        self,
        name: str,
        *,
        failure_threshold: int = 3,
        reset_timeout_s: float = 0.5,
        max_reset_timeout_s: float = 4.0,
        clock: Clock | None = None,
        on_transition: Callable[[State], None] | None = None,
    ) -> None:
        """``on_transition`` is told each new state (after it is logged)."""
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold!r}")
        if not 0 < reset_timeout_s <= max_reset_timeout_s:
            raise ValueError(
                "need 0 < reset_timeout_s <= max_reset_timeout_s, got "
                f"{reset_timeout_s!r} and {max_reset_timeout_s!r}"
            )
        self.name = name
        self.on_transition = on_transition
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.max_reset_timeout_s = max_reset_timeout_s
        self._clock: Clock = clock or MonotonicClock()
        self.state: State = CLOSED
        self._consecutive_failures = 0
        self._open_for_us = round(reset_timeout_s * 1e6)
        self._retry_at_us = 0
        self.failures = 0  # calls that failed, in any state
        self.opened = 0  # closed or half-open -> open, on failures
        self.probes = 0  # calls let through while half-open
        self.short_circuited = 0  # calls refused while open or while a probe was out
        self.transitions: dict[str, int] = {}  # "closed->open": count

    def like(self, name: str) -> CircuitBreaker:
        """A new breaker, closed, with this one's parameters and clock."""
        return CircuitBreaker(
            name,
            failure_threshold=self.failure_threshold,
            reset_timeout_s=self.reset_timeout_s,
            max_reset_timeout_s=self.max_reset_timeout_s,
            clock=self._clock,
        )

    def allow(self) -> bool:
        """True if the caller may try the protected call now (and must report how it went)."""
        state = self.state
        if state == CLOSED:
            return True
        if state == OPEN and self._clock.now_us() >= self._retry_at_us:
            self._move(HALF_OPEN, "probing")
            self.probes += 1
            return True
        self.short_circuited += 1
        return False

    @property
    def probe_out(self) -> int:
        """Read right after ``allow()`` said yes: the number of the probe this call is, or 0
        (the circuit is closed). A call that is cancelled hands it to ``cancelled``."""
        return self.probes if self.state == HALF_OPEN else 0

    def cancelled(self, probe: int) -> None:
        """A call ``allow()`` let through was cancelled before it could report. If it was the
        probe still out, nobody would ever close or reopen the circuit: it goes back to open
        with the next call probing (the cancellation says nothing about the protected side)."""
        if probe and self.state == HALF_OPEN and self.probes == probe:
            self._retry_at_us = self._clock.now_us()
            self._move(OPEN, "probe cancelled; the next call probes")

    def success(self) -> None:
        self._consecutive_failures = 0
        if self.state != CLOSED:
            self._open_for_us = round(self.reset_timeout_s * 1e6)
            self._move(CLOSED, "probe succeeded")

    def failure(self, reason: str) -> None:
        self.failures += 1
        self._consecutive_failures += 1
        if self.state == HALF_OPEN:
            self._open_for_us = min(self._open_for_us * 2, round(self.max_reset_timeout_s * 1e6))
            self._open(f"probe failed: {reason}")
        elif self.state == CLOSED and self._consecutive_failures >= self.failure_threshold:
            self._open(f"{self._consecutive_failures} failures in a row, last: {reason}")

    @property
    def retry_in_s(self) -> float:
        """How long until the next probe (0 unless open)."""
        if self.state != OPEN:
            return 0.0
        return max(self._retry_at_us - self._clock.now_us(), 0) / 1e6

    def _open(self, reason: str) -> None:
        self._retry_at_us = self._clock.now_us() + self._open_for_us
        self.opened += 1
        self._move(OPEN, f"{reason}; next probe in {self._open_for_us / 1e6:g} s")

    def _move(self, state: State, reason: str) -> None:
        transition = f"{self.state}->{state}"
        self.transitions[transition] = self.transitions.get(transition, 0) + 1
        level = logging.INFO if state != OPEN else logging.WARNING
        log.log(level, "%s circuit %s (%s)", self.name, transition, reason)
        self.state = state
        if self.on_transition is not None:
            self.on_transition(state)


class NodeCircuits:
    """One circuit breaker per Redis node, by address (a cluster's masters; a single server is
    the one node ``""``, whose breaker is ``default``). Each is made on first use like
    ``default``, and logs its own transitions with the node's address. ``on_change`` is told
    the circuits' worst state (open, then half_open, then closed) after any of them moves;
    ``on_open`` the node whose circuit opened (to probe it when its probe is due)."""

    __slots__ = ("_breakers", "default", "name", "on_change", "on_open")

    def __init__(
        self,
        default: CircuitBreaker,
        on_change: Callable[[State], None] | None = None,
        on_open: Callable[[str, CircuitBreaker], None] | None = None,
    ) -> None:
        self.default = default
        self.name = default.name
        self.on_change = on_change
        self.on_open = on_open
        default.on_transition = self._mover("", default)
        self._breakers: dict[str, CircuitBreaker] = {"": default}

    def of(self, node: str) -> CircuitBreaker:
        breaker = self._breakers.get(node)
        if breaker is None:
            breaker = self._breakers[node] = self.default.like(f"{self.name} {node}")
            breaker.on_transition = self._mover(node, breaker)
        return breaker

    def _mover(self, node: str, breaker: CircuitBreaker) -> Callable[[State], None]:
        def moved(state: State) -> None:
            if state == OPEN and self.on_open is not None:
                self.on_open(node, breaker)
            self._moved(state)

        return moved

    def breakers(self) -> dict[str, CircuitBreaker]:
        """Every node's breaker met so far, by address."""
        return dict(self._breakers)

    @property
    def open_nodes(self) -> int:
        """Nodes whose circuit is open or half-open (on_failure answers for their keys)."""
        return sum(breaker.state != CLOSED for breaker in self._breakers.values())

    def worst(self) -> State:
        states = {breaker.state for breaker in self._breakers.values()}
        if OPEN in states:
            return OPEN
        if HALF_OPEN in states:
            return HALF_OPEN
        return CLOSED

    def _moved(self, state: State) -> None:
        del state  # the breaker's own: what the store reports is the worst of them
        if self.on_change is not None:
            self.on_change(self.worst())

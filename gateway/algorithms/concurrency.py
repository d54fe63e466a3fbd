"""Requests in flight per key (nginx ``limit_conn``): at most ``limit`` slots held at once.

The state is the number of slots the key's requests hold (``None`` for none). ``decide`` takes
``cost`` slots when they fit and leaves the state alone when they do not, like every algorithm
here, so a store decides a concurrency limit in the same check-all-then-commit pass as its rate
limits and a request rejected by any limit holds no slot. ``refund`` gives slots back: the
store calls it when the response has been sent, the client went away or the upstream failed.

Nothing decays with time: a slot is held until it is given back. A waiting request is not a
delay either (when a slot frees cannot be known in advance), so ``delay_s`` is always 0; the
bounded first-come-first-served wait for a slot is the store's (``stores/slot_table.py``).
"""

from __future__ import annotations

from typing import Final

from gateway.algorithms.base import Algorithm, Decides, Decision
from gateway.algorithms.fixed_window import check_limit

_INF: Final = float("inf")


class Concurrency(Decides):
    """At most ``limit`` slots held at once; a rejection advises a retry after
    ``retry_after_s`` (when a slot frees is not known)."""

    __slots__ = ("limit", "retry_after_s")

    def __init__(self, limit: int, retry_after_s: float = 1.0) -> None:
        self.limit = check_limit(limit)
        if not retry_after_s >= 0:
            raise ValueError(f"retry_after must be 0 or more seconds, got {retry_after_s!r}")
        self.retry_after_s = float(retry_after_s)

    @property
    def name(self) -> str:
        return "concurrency"

    def __repr__(self) -> str:
        return f"Concurrency(limit={self.limit}, retry_after_s={self.retry_after_s:g})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Concurrency):
            return NotImplemented
        return (self.limit, self.retry_after_s) == (other.limit, other.retry_after_s)

    def __hash__(self) -> int:
        return hash((Concurrency, self.limit, self.retry_after_s))

    def __reduce__(self) -> tuple[type[Concurrency], tuple[int, float]]:
        # Pickled by its parameters (the shared store records a limit's algorithm): a compiled
        # class cannot be made without its constructor's arguments.
        return Concurrency, (self.limit, self.retry_after_s)

    def share(self, replicas: int) -> Concurrency:
        if replicas == 1:
            return self
        return Concurrency(max(self.limit // replicas, 1), self.retry_after_s)

    def fits(self, held: int, cost: int) -> bool:
        """The one rule: ``cost`` more slots fit beside ``held``."""
        return held + cost <= self.limit

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[Decision, int | None]:
        if cost < 1:
            raise ValueError(f"cost must be at least 1, got {cost!r}")
        held = 0 if state is None else state
        limit = self.limit
        if not self.fits(held, cost):
            # A request that needs more slots than the limit has can never be admitted.
            retry_after_s = self.retry_after_s if cost <= limit else _INF
            return Decision(False, 0.0, retry_after_s, limit, limit - held, 0.0), state
        held += cost
        return Decision(True, 0.0, 0.0, limit, limit - held, 0.0), held

    def is_idle(self, state: int, now_us: int) -> bool:
        return state <= 0

    def refund(
        self, state: int, now_us: int, cost: int = 1, *, charged_us: int | None = None
    ) -> int:
        """Give ``cost`` slots back (never below none held)."""
        return state - cost if state > cost else 0

    def rescale(self, state: int, previous: Algorithm[int], now_us: int) -> int | None:
        """The requests in flight are still in flight under the new limit: the count stays
        (above a lowered limit, new requests wait until enough have finished)."""
        if not isinstance(previous, Concurrency) or state <= 0:
            return None
        return state

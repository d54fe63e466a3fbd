"""One protocol in front of the in-process store and the Redis store.

A store decides a request's checks atomically: every check's state is read, the algorithms
decide at one instant, and either every new state is written (allowed) or none (rejected).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gateway.algorithms.combine import CombinedDecision
from gateway.clock import Clock
from gateway.limits.compiled import Check, CompiledLimit
from gateway.stores.store_stats import StoreStats


class StoreUnavailableError(Exception):
    """The store cannot decide and the policy says ``on_failure: deny``: the engine answers 503."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class LimitStore(Protocol):
    name: str
    # What the metrics read: calls, errors, call latency and what answers.
    stats: StoreStats
    # The clock the store decides (or falls back) by, and whether a verdict's ``now_us`` is an
    # instant on it (in process) or on another (Redis ``TIME``): the access log's ``t_us``.
    clock: Clock
    verdicts_on_clock: bool
    # Whether other processes take and give back slots of the same concurrency limits (the
    # shared and Redis stores): a request waiting for a slot then looks again now and then,
    # as their releases send no word to this process.
    slots_shared: bool
    # Whether the store keeps limits' penalty boxes itself, looked up and struck in the call
    # that decides (Redis); else the engine keeps them (``stores.penalty_table``).
    decides_penalties: bool

    async def decide(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        """Decide all checks at one instant; with ``commit``, store the new states if allowed
        (but for a limit charged after the response that admits free, ``admits_free``:
        ``charge`` charges it). A calendar window
        decides at calendar time (``Clock.unix_us``, or Redis ``TIME``).

        A check whose delay would exceed its ``max_delay_s`` turns the verdict into a rejection
        (``combine.refuse_long_delays``) before anything is stored.
        """
        ...

    def try_decide_now(self, checks: Sequence[Check]) -> CombinedDecision | None:
        """The verdict, committed, without a wait where one is at hand (the Redis store's leased
        limit with a unit left; every decision of a store that ``DecidesNow``); None when
        ``decide`` must be awaited. Nothing is taken or counted for a None."""
        ...

    async def decide_each(self, checks: Sequence[Check]) -> list[CombinedDecision]:
        """Decide and commit each check on its own (dry-run limits do not stack)."""
        ...

    def release(self, checks: Sequence[Check]) -> asyncio.Future[None] | None:
        """Give back the slots an admitted request's concurrency checks hold (each ``cost``);
        never raises. None when they are back already; else a future done once the store
        has them back (Redis: a call in flight)."""

    async def charge(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        """Charge each check (of a limit charged after the response) ``units``, as much as
        its key has room for: what each took. Never raises: a charge the store cannot make
        is counted (``charge_failures``) and follows ``on_failure``."""
        ...

    async def refund(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """Give back one request's charge on each check (a queued client left); ``charged_us``
        is the verdict's ``now_us``, when the store gave one."""
        ...

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        """Adopt a new policy's limits: keep, rescale or free each limit's state."""
        ...

    def tracked_keys(self, limit_name: str) -> int:
        """Keys of this limit whose state this process holds."""
        ...

    def evictions(self, limit_name: str) -> int:
        """Keys of this limit this process dropped to make room while their state still
        mattered, since the store was made: it never goes down, a reload notwithstanding."""
        ...

    async def prepare(self) -> None:
        """Get ready before the first request (connections, scripts); never raises."""
        ...

    async def close(self) -> None: ...


class LeaseFigures(Protocol):
    """What one limit's leases did on this replica (``stores.redis.lease.LeaseCounters``)."""

    granted: int
    units_granted: int
    returned: int
    units_returned: int
    expired: int
    last_size: int
    calls: int
    decided: int


@runtime_checkable
class LeasingStore(Protocol):
    """A store that leases some limits (the Redis store): the metrics read their counters."""

    def lease_counters(self, limit_name: str) -> LeaseFigures | None: ...

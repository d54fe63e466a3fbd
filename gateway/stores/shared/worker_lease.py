"""Worker leases on the shared store (``store.worker_lease``): a worker takes a batch of a hot
key's quota in one shared write and decides the key's next requests from it alone.

Every admitted request writes each of its limits' states, and a hot key (a global limit, a
route's window, a busy client) is written by every worker on every request: the workers queue
on the store's one writers' lock. With ``worker_lease`` a worker that meets a key again within
``interval`` charges it a batch (``size`` units, doubling while the worker spends them before
they expire, down to what it spent when they expired unused, at most ``units`` and at most a
quarter of the quota over the workers) and admits the key's next requests from the batch
without touching the shared state. A batch is charged to the shared state when granted, by
the same algorithm as a request of that cost, so the shared state never shows less than the
workers took.

Bounds, per algorithm (``bound_text`` says the same for ``/explain``):

* ``fixed_window``, ``sliding_window``: a batch is used by the end of the window it was charged
  in, so every unit is admitted in the window that counted it: never more than the limit per
  window (a sliding window's weighted count, likewise). Units a worker holds and does not use
  (no more of that key's requests reach it in the window) are lost to the others until the
  window ends: at most ``workers x size`` fewer than the limit in a window.
* ``token_bucket`` (reject mode), ``leaky_bucket`` with ``nodelay``: a batch expires
  ``interval`` after it was charged, so an admission is charged at most ``interval`` before
  it happens. Over any span T the workers admit at most what the bucket admits over T +
  ``interval`` (``burst + rate x (T + interval)``): at most ``rate x interval`` (and at most
  ``workers x units``) beyond the exact bucket. Units a batch still holds when it expires are
  lost (at most ``workers x size`` per ``interval``).

A key is leased once a worker meets it again within ``interval``; a batch the shared state
refuses (the key near its limit) is not asked again until ``interval`` passes: the key's
requests are then decided exactly, one by one. A window that does not refill, whose workers
keep receiving the key's requests, admits exactly its limit (the units held are spent by them
before the window ends); a bucket's batch may expire first, lost.

A key reset through the keys' API (any worker) raises a count of resets in the store; each
worker reads it every ``RESET_CHECK_US`` of its requests and, when it moved, drops its batches
(of every key: under-admitting, never over), as a reload does. Until then a worker may admit
at most the units left in its batch of the reset key beyond the key's fresh state.

Not leased (decided in the shared state on every request, exactly): other algorithms and
modes, calendar windows, limits counted by their responses, concurrency, requests of a cost
above one, dry runs (``explain``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gateway.algorithms.base import Decision
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.limits.compiled import Check, CompiledLimit

# Leases are swept of expired entries at most this often (a worker's leases are the keys it
# met twice within ``interval``: few, but a busy gateway meets many keys).
SWEEP_US: Final = 1_000_000
# The batch is at most the quota over this many times the workers: the units stranded in the
# workers' batches stay a fraction of a binding limit.
QUOTA_SHARE: Final = 4

# Keys of one limit a worker keeps leases for at once: beyond, new keys are decided exactly.
MAX_LEASES: Final = 65_536

# How often a worker looks whether a key was reset (the keys' API, any worker) since it last
# looked: its batches are then dropped, and the keys decided on their fresh state.
RESET_CHECK_US: Final = 100_000

WINDOW: Final = 1  # the batch ends with the window it was charged in
BUCKET: Final = 2  # the batch ends ``interval`` after it was charged


class LeaseTally:
    """What one limit's batches did in this worker, as the metrics read a lease's figures
    (``gateway_limit_lease*``, summed over workers); outlives a reload while the name stays.
    A batch rides on the request's own shared write: no call of its own (``calls`` stays 0),
    and unused units are not given back (``returned`` stays 0): they expire."""

    __slots__ = (
        "calls",
        "decided",
        "expired",
        "granted",
        "last_size",
        "returned",
        "units_granted",
        "units_returned",
    )

    def __init__(self) -> None:
        self.granted = 0  # batches charged to the shared state
        self.units_granted = 0
        self.returned = 0
        self.units_returned = 0
        self.expired = 0  # batches whose time ran out with units unused
        self.last_size = 0
        self.calls = 0
        self.decided = 0  # requests this limit decided from a batch


class Lease:
    """A worker's batch of one key's quota."""

    __slots__ = (
        "expires_us",
        "granted_us",
        "limit_value",
        "remaining",
        "reset_s",
        "size",
        "tally",
        "units",
    )

    def __init__(self, now_us: int, tally: LeaseTally) -> None:
        self.tally = tally
        self.units = 0  # left in the batch
        self.size = 1  # the next batch asked
        self.expires_us = 0
        self.granted_us = now_us
        # What the grant's decision said, for the headers of the requests decided from it.
        self.limit_value = 0
        self.remaining = 0
        self.reset_s = 0.0


class LeaseKind:
    """How one limit is leased: its kind and the largest batch, or not at all (``kind`` 0)."""

    __slots__ = ("cap", "kind", "window_us")

    def __init__(self, kind: int, cap: int, window_us: int) -> None:
        self.kind = kind
        self.cap = cap
        self.window_us = window_us


NOT_LEASED: Final = LeaseKind(0, 0, 0)


def lease_kind(limit: CompiledLimit, units: int, workers: int) -> LeaseKind:
    """How ``limit`` is leased with batches of at most ``units`` among ``workers``."""
    if limit.calendar or limit.response_charge is not None or limit.holds_slots:
        return NOT_LEASED
    if limit.spec.dry_run:
        return NOT_LEASED
    algorithm = limit.algorithm
    share = QUOTA_SHARE * max(workers, 1)
    if isinstance(algorithm, FixedWindow | SlidingWindow):
        cap = min(units, algorithm.limit // share)
        return LeaseKind(WINDOW, cap, algorithm.window_us) if cap > 1 else NOT_LEASED
    if type(algorithm) is TokenBucket and algorithm.mode == "reject":
        cap = min(units, algorithm.capacity // share)
        return LeaseKind(BUCKET, cap, 0) if cap > 1 else NOT_LEASED
    if isinstance(algorithm, LeakyBucket) and algorithm.delay is None:
        cap = min(units, (algorithm.burst + 1) // share)
        return LeaseKind(BUCKET, cap, 0) if cap > 1 else NOT_LEASED
    return NOT_LEASED


def bound_text(limit: CompiledLimit, units: int, interval_s: float, workers: int) -> str | None:
    """What a lease allows ``limit`` beyond its exact decisions, for ``/explain``; None when
    it is not leased."""
    kind = lease_kind(limit, units, workers)
    if kind.kind == WINDOW:
        return (
            f"worker lease: batches of up to {kind.cap} units, used by the end of their window: "
            f"never more than the limit per window; up to {workers} x {kind.cap} fewer when "
            "workers hold units no more requests of the key reach"
        )
    if kind.kind == BUCKET:
        return (
            f"worker lease of up to {kind.cap} units for {interval_s * 1000:g} ms: over any "
            f"span T at most what the bucket admits over T + {interval_s * 1000:g} ms "
            f"(rate x {interval_s * 1000:g} ms, at most {workers} x {kind.cap}, beyond exact)"
        )
    return None


class WorkerLeases:
    """This worker's leases, by limit table and key."""

    def __init__(self, units: int, interval_us: int, workers: int) -> None:
        self.units = units
        self.interval_us = interval_us
        self.workers = workers
        self._kinds: dict[str, tuple[CompiledLimit, LeaseKind]] = {}
        self._leases: dict[str, dict[str, Lease]] = {}
        self._swept_us = 0
        # Requests decided from batches alone, batches granted, and grants refused (the key
        # near its limit: decided exactly until its lease expires).
        self.decided = 0
        self.granted = 0
        self.refused = 0
        self._tallies: dict[str, LeaseTally] = {}

    def tally(self, limit_name: str) -> LeaseTally | None:
        """A limit's figures, once one of its keys was met twice within ``interval``."""
        return self._tallies.get(limit_name)

    def clear(self) -> None:
        """A reload: the batches held are dropped (under-admitted, never over)."""
        self._kinds = {}
        self._leases = {}

    def kind_of(self, limit: CompiledLimit) -> LeaseKind:
        entry = self._kinds.get(limit.table)
        if entry is not None and entry[0] is limit:
            return entry[1]
        kind = lease_kind(limit, self.units, self.workers)
        self._kinds[limit.table] = (limit, kind)
        return kind

    def take_all(self, checks: Sequence[Check], now_us: int) -> list[Decision] | None:
        """Each check's unit from its batch, all or none: the decisions, or None when some
        check has no batch at hand (nothing taken then)."""
        leases = self._leases
        found: list[Lease] = []
        for check in checks:
            if check.cost != 1:
                return None
            by_key = leases.get(check.limit.table)
            if by_key is None:
                return None
            lease = by_key.get(check.key)
            if lease is None or lease.units < 1 or now_us >= lease.expires_us:
                return None
            found.append(lease)
        self.decided += 1
        return [self.take(lease) for lease in found]

    def at_hand(self, check: Check, now_us: int) -> Lease | None:
        """``check``'s batch when it has a unit for it now."""
        if check.cost != 1:
            return None
        by_key = self._leases.get(check.limit.table)
        if by_key is None:
            return None
        lease = by_key.get(check.key)
        if lease is None or lease.units < 1 or now_us >= lease.expires_us:
            return None
        return lease

    def take(self, lease: Lease) -> Decision:
        """A unit of ``lease`` for a request: its decision."""
        lease.units -= 1
        lease.tally.decided += 1
        return self.peek(lease)

    def peek(self, lease: Lease) -> Decision:
        """What ``lease`` says of a request, as the headers show it: the shared state's
        remaining at the grant, plus the units left in the batch."""
        return Decision(
            True, 0.0, 0.0, lease.limit_value, lease.remaining + lease.units, lease.reset_s
        )

    def batch_for(self, check: Check, now_us: int) -> int:
        """The units to charge ``check`` in the shared state: a batch (more than its cost)
        when its key is leased and was met within ``interval``, else its cost."""
        if check.cost != 1:
            return check.cost
        kind = self.kind_of(check.limit)
        if kind.kind == 0:
            return check.cost
        by_key = self._leases.get(check.limit.table)
        if by_key is None:
            by_key = self._leases[check.limit.table] = {}
        lease = by_key.get(check.key)
        if lease is None:
            self._sweep(now_us)
            if len(by_key) >= MAX_LEASES:
                return check.cost  # a limit met by that many keys at once: exact
            tally = self._tallies.get(check.limit.name)
            if tally is None:
                tally = self._tallies[check.limit.name] = LeaseTally()
            by_key[check.key] = lease = Lease(now_us, tally)
            lease.expires_us = now_us + self.interval_us  # met again before this: leased
            return 1
        if now_us < lease.expires_us:
            if lease.units >= 1 or lease.size == 0:
                # A batch at hand (another check of the request had none: this one is
                # charged its cost), or a batch refused lately (the key near its limit).
                return 1
            lease.size = min(max(lease.size * 2, 2), kind.cap)  # spent before it expired
        elif now_us - lease.expires_us <= self.interval_us and lease.size > 0:
            if lease.units > 0:
                lease.tally.expired += 1
            lease.size = min(max(lease.size - lease.units, 2), kind.cap)  # what was spent
            lease.units = 0
        else:  # met again long after, or refused last: not hot (yet)
            if lease.units > 0:
                lease.tally.expired += 1
            lease.size = 1
            lease.units = 0
            lease.expires_us = now_us + self.interval_us
            return 1
        return lease.size

    def granted_batch(self, check: Check, batch: int, decision: Decision, now_us: int) -> None:
        """The shared state admitted ``batch`` units for ``check`` (one for the request):
        keep the rest, until the window ends or ``interval`` passes."""
        by_key = self._leases.get(check.limit.table)
        lease = None if by_key is None else by_key.get(check.key)
        if lease is None or batch < 2:
            return
        kind = self.kind_of(check.limit)
        lease.units = batch - 1
        lease.granted_us = now_us
        if kind.kind == WINDOW:  # used in the window that counted it, by the end of it
            lease.expires_us = (now_us // kind.window_us + 1) * kind.window_us
        else:
            lease.expires_us = now_us + self.interval_us
        lease.limit_value = decision.limit
        lease.remaining = decision.remaining
        lease.reset_s = decision.reset_s
        self.granted += 1
        tally = lease.tally
        tally.granted += 1
        tally.units_granted += batch
        tally.last_size = batch

    def refused_batch(self, check: Check, now_us: int) -> None:
        """A batch was refused (the key near its limit): decide it exactly until ``interval``
        passes."""
        by_key = self._leases.get(check.limit.table)
        lease = None if by_key is None else by_key.get(check.key)
        if lease is None:
            return
        lease.size = 0  # no batch asked until it expires
        lease.units = 0
        lease.expires_us = now_us + self.interval_us
        self.refused += 1

    def held(self) -> int:
        """Leases held (keys met twice within ``interval`` and not swept yet)."""
        return sum(len(by_key) for by_key in self._leases.values())

    def _sweep(self, now_us: int) -> None:
        """Drop expired leases, at most once per ``SWEEP_US``: the table stays the keys met
        lately."""
        if now_us - self._swept_us < SWEEP_US:
            return
        self._swept_us = now_us
        horizon = now_us - self.interval_us
        for table, by_key in list(self._leases.items()):
            stale = [key for key, lease in by_key.items() if lease.expires_us < horizon]
            for key in stale:
                del by_key[key]
            if not by_key:
                del self._leases[table]

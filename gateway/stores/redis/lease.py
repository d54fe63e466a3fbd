"""Quota leasing: a replica takes batches of a limit's quota from Redis and decides locally.

A limit with ``lease:`` in the policy is not decided by one script call per request. The
replica holds a lease per key: a number of units of the quota, good until the window ends
(``fixed_window``, ``sliding_window``) or for the lease interval (``token_bucket``). A request
takes a unit from the lease with no Redis call at all; a replica whose lease runs out asks for
another in one atomic call of ``lua/lease.lua``, sized by what it spent lately
(``lease_grant.py``). A grant of nothing tells the replica when to ask again: until then it
rejects locally, so an exhausted window costs no Redis call either.

Bounds:

* Never more than the limit: the script hands out at most what remains of the quota, so the
  leases of all replicas together never exceed it. A lease is used only before it expires on
  this replica's clock, counted from when the ask was sent (so before the window ends in
  Redis, whatever the call's latency), but for the unit of the request that asked: Redis
  counted it in its window, as it counts an exact decision's, however late the reply.
* A replica that dies strands its current lease: those units are neither admitted nor given
  back, so the others admit less, never more. One grant is at most ``share`` of what remained
  when it was made (half, by default), so a dead replica strands at most ``share`` of the
  quota, for the rest of that window (or, for a token bucket, until the bucket refills).
* Leases are returned, unused part and all, when they expire (with the replica's next ask,
  or by the sweep every lease interval), when the store closes (graceful shutdown), and when a
  reload changes their limit's parameters or removes its ``lease:``.
* When Redis fails the replica spends what it holds, then ``on_failure`` decides. With
  ``local``, the fallback's state is first charged with what this replica admitted from its
  leases (so its share starts from there, not empty), and what the fallback admits is owed
  to Redis: charged to the lease state before this replica's next ask, as much as remains.

Stacked limits keep nginx's rule: a request takes a unit from each leased limit, then the
others are decided in one script call as usual; a request rejected anywhere gives its units
back to the leases, so it is charged to none (a request delayed by another limit whose client
then leaves keeps its unit: lost, never over). Dry-run limits are decided per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.combine import CombinedDecision, combine
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import Clock
from gateway.exceptions import caused_by
from gateway.limits.compiled import Check, CompiledLimit
from gateway.policy.models import LeaseSettings
from gateway.stores.redis.circuit import NodeCircuits
from gateway.stores.redis.clients import ScriptClient, submit_recovering
from gateway.stores.redis.fallback import OwedToNodes
from gateway.stores.redis.lease_grant import permille
from gateway.stores.redis.library import LuaProgram, lua_program
from gateway.stores.store_stats import StoreStats

log = logging.getLogger("gateway.store")

_INF: Final = float("inf")
# A grant of nothing without a time to ask again still waits this long (never a busy loop).
_MIN_RETRY_US: Final = 1000


def lease_lua_program() -> LuaProgram:
    """The lease program: the shared prelude (helpers, once per library load), then
    ``lease.lua`` (per call)."""
    return lua_program("lease", ("prelude.lua",), ("lease.lua",))


def load_lease_script() -> str:
    """The lease script, as ``EVALSHA`` runs it."""
    return lease_lua_program().script


@dataclass(slots=True)
class LeaseCounters:
    """What one limit's leases did on this replica; outlives a reload while the name stays."""

    granted: int = 0  # leases granted (grants of at least one unit)
    units_granted: int = 0
    returned: int = 0  # leases given back with units unused (expiry swept, shutdown)
    units_returned: int = 0
    expired: int = 0  # leases whose time ran out with units unused
    last_size: int = 0  # units of the latest grant
    calls: int = 0  # lease script calls (grants and returns)
    decided: int = 0  # requests decided from a lease, without a Redis call


@dataclass(frozen=True, slots=True)
class LeasePlan:
    """A leased limit ready for the lease script."""

    name: str
    limit: CompiledLimit
    algorithm: Algorithm[Any]
    kind: bytes  # F, S or T
    quota: int
    span: bytes  # window in us, or us per token
    share_pm: bytes
    low_water_pm: bytes
    interval_us: int  # what a replica asks for is what it spent over this long
    recent_us: bytes  # how long an ask counts as recent; a token bucket's lease lifetime
    window_s: float
    key_head: str


@dataclass(slots=True)
class Lease:
    """This replica's lease on one key of one limit."""

    units: int = 0
    size: int = 0
    index: int = 0  # the window it was granted in (windows)
    granted_us: int = 0
    expires_us: int = 0
    blocked_until_us: int = 0  # nothing to grant until then: reject locally
    # Requests that wanted a unit, counted per lease interval (this one and the one before):
    # what this replica asks for is what they would have spent over the last interval.
    period_start_us: int = 0
    period_demand: int = 0
    previous_demand: int = 0
    generation: int = 0
    fetching: asyncio.Future[None] | None = None
    unused_back: int = 0  # units of an expired lease to give back with the next call
    back_index: int = 0
    # Units taken from this lease not yet charged to the local fallback's state (``seed``):
    # charged at the next ask, or when the fallback decides this key.
    unseeded: int = 0
    # How fast this replica spends a lease: units taken from the current one since it arrived
    # (and when the last was), and the rate of the last lease that showed one (units per us;
    # 0: not known yet).
    arrived_us: int = 0
    taken: int = 0
    last_take_us: int = 0
    spend_per_us: float = 0.0


# A limit not asked yet, in the decisions being gathered.
_NOT_ASKED: Final = Decision(True, 0.0, 0.0, 0, 0, 0.0)


class LeaseUnavailableError(Exception):
    """Redis did not answer an ask, and the lease is spent: ``on_failure`` decides."""


def plan_for(limit: CompiledLimit, settings: LeaseSettings, key_prefix: str) -> LeasePlan | None:
    """The lease plan of a leasable limit; None for an algorithm the policy refuses anyway."""
    algorithm = limit.algorithm
    window_us: float
    if isinstance(algorithm, FixedWindow | SlidingWindow):
        kind = b"F" if isinstance(algorithm, FixedWindow) else b"S"
        quota = algorithm.limit
        span = b"%d" % algorithm.window_us
        window_us = float(algorithm.window_us)
    elif type(algorithm) is TokenBucket and algorithm.mode == "reject":
        kind = b"T"
        quota = algorithm.capacity
        per_token_us = algorithm.interval_ticks / algorithm.ticks_per_us
        span = repr(per_token_us).encode()
        window_us = quota * per_token_us
    elif isinstance(algorithm, LeakyBucket) and algorithm.delay is None:
        # nodelay: it never delays, and admits burst + 1 at once then one per 1/rate, as a
        # token bucket of burst + 1 does; leased as one (the bucket's bound, not nginx's
        # millisecond arithmetic).
        kind = b"T"
        quota = algorithm.burst + 1
        per_token_us = algorithm.period_s * 1e6 / algorithm.rate
        span = repr(per_token_us).encode()
        window_us = quota * per_token_us
    else:
        return None
    interval_us = (
        round(settings.interval * 1e6) if settings.interval else max(round(window_us / 5), 1)
    )
    # Windows: an ask is recent within the window. A token bucket's lease lasts an interval,
    # and a replica asking once per lease counts as asking lately.
    recent_us = round(window_us) if kind != b"T" else interval_us
    return LeasePlan(
        name=limit.name,
        limit=limit,
        algorithm=algorithm,
        kind=kind,
        quota=quota,
        span=span,
        share_pm=b"%d" % max(permille(settings.share), 1),
        low_water_pm=b"%d" % permille(settings.low_water),
        interval_us=interval_us,
        recent_us=b"%d" % max(recent_us, 1),
        window_s=window_us / 1e6,
        key_head=f"{key_prefix}{{{limit.name}:lease:{kind.decode()}:",
    )


class LeaseBook:
    """Every lease this replica holds, and the asks and returns that keep them."""

    def __init__(
        self,
        client: ScriptClient,
        *,
        key_prefix: str,
        clock: Clock,
        circuits: NodeCircuits,
        stats: StoreStats,
        time_source: Clock | None = None,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.clock = clock
        self.circuits = circuits  # the store's: one per node, shared with its calls
        self.stats = stats
        self.time_source = time_source
        # Not secret: tells replicas apart in the set of those that asked lately.
        self.replica = os.urandom(6).hex().encode()
        self.plans: dict[str, LeasePlan] = {}
        self.leases: dict[str, dict[str, Lease]] = {}
        self.counters: dict[str, LeaseCounters] = {}
        self.max_keys: dict[str, int] = {}
        self._calls = 0
        self._sweeper: asyncio.Task[None] | None = None
        # on_failure local: charges the fallback's state with units admitted from a lease
        # (limit, key, units); None otherwise.
        self.seed: Callable[[CompiledLimit, str, int], None] | None = None
        # What the fallback admitted on leased limits, owed to their lease states (per node).
        self.owed = OwedToNodes(self._charge, self._node_of_check, self._topology)
        self.carried_back = 0  # units of it charged to Redis
        # Returns of the leases a reload dropped, in flight.
        self._returning: set[asyncio.Task[None]] = set()

    # -- configuration --

    def configure(self, limits: Sequence[CompiledLimit]) -> None:
        """The leased limits of a new policy; the leases of a limit whose parameters changed,
        or that is no longer leased, are given back to Redis (as at shutdown), not left to
        expire there."""
        plans: dict[str, LeasePlan] = {}
        for limit in limits:
            settings = limit.spec.lease
            if settings is None or limit.spec.dry_run:
                continue
            plan = plan_for(limit, settings, self.key_prefix)
            if plan is None:
                continue
            plans[limit.name] = plan
            self.max_keys[limit.name] = limit.spec.max_keys
            self.counters.setdefault(limit.name, LeaseCounters())
        for name in list(self.leases):
            old, new = self.plans.get(name), plans.get(name)
            if new is None or old is None or old.algorithm != new.algorithm:
                table = self.leases.pop(name)
                if old is not None:
                    self._give_all_back(old, table, b"q" if new is None else b"r")
        self.plans = plans

    def _give_all_back(self, plan: LeasePlan, table: dict[str, Lease], mode: bytes) -> None:
        """The unused units of a reload's dropped leases go back under the plan they were
        granted by, in the background. A request in flight that gives its unit back to one of
        them later loses it (never over)."""
        now_us = self.clock.now_us()
        unused: list[Coroutine[Any, Any, None]] = []
        for key, lease in table.items():
            _unspent(lease, now_us)
            lease.generation += 1
            if lease.unused_back:
                unused.append(self._return(plan, key, lease, mode))
        if not unused:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # configured outside the loop: no lease was ever taken
            for call in unused:
                call.close()
            return
        task = loop.create_task(_gather(unused))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def returns_done(self) -> None:
        """Wait for the returns of the leases the last reloads dropped."""
        while self._returning:
            await asyncio.gather(*self._returning, return_exceptions=True)

    def redis_key(self, check: Check) -> str:
        """Where the lease state of a leased limit's key lives in Redis."""
        return _lease_key(self.plans[check.limit.name], check.key)

    def leased(self, limit: CompiledLimit) -> bool:
        plan = self.plans.get(limit.name)
        return plan is not None and plan.algorithm is limit.algorithm

    # -- deciding --

    async def decide(
        self,
        checks: Sequence[Check],
        commit: bool,
        exact: Callable[[Sequence[Check], bool], Awaitable[CombinedDecision]],
        unavailable: Callable[[Sequence[Check], bool, str], Awaitable[CombinedDecision]],
        nominal: Callable[[Check], int],
    ) -> CombinedDecision:
        """Leased checks from their leases, the others by ``exact`` (one script call); the
        whole request by ``unavailable`` when a lease is spent and Redis cannot grant more.
        ``nominal`` is a limit's quota, shown for a limit not asked (a lease rejected)."""
        plans = self.plans
        # One pass: the others' places, and the leased checks' units (a live lease's without
        # a wait, the common case, else after an ask).
        places: list[int] = []
        decisions: list[Decision] = []
        taken: list[tuple[Lease, int]] = []
        rejected = False
        try:
            for index, check in enumerate(checks):
                limit = check.limit
                plan = plans.get(limit.name)
                if plan is None or plan.algorithm is not limit.algorithm:
                    places.append(index)
                    decisions.append(_NOT_ASKED)  # replaced by its verdict below
                    continue
                took = self._take_now(plan, check, commit)
                decision, unit = took if took is not None else await self._take(check, commit)
                decisions.append(decision)
                if unit is not None:
                    taken.append(unit)
                rejected = rejected or not decision.allowed
        except LeaseUnavailableError as exc:
            self._give_back(taken)
            if self.seed is not None:
                self._seed_checks(checks)
            return await unavailable(checks, commit, str(exc))
        except BaseException:
            self._give_back(taken)
            raise
        if len(places) == len(checks):  # none leased
            return await exact(checks, commit)
        if rejected or not commit:
            self._give_back(taken)
        if rejected or not places:
            # Rejected by a lease, the others are not asked: charged to none, as ever; they
            # show their quota.
            for index in places:
                quota = nominal(checks[index])
                decisions[index] = Decision(True, 0.0, 0.0, quota, quota, 0.0)
            states = (None,) * len(decisions)
            return combine(decisions, states, states)
        others = [checks[index] for index in places]
        try:
            verdict = await exact(others, commit)
        except BaseException:
            self._give_back(taken)
            raise
        for place, decision in zip(places, verdict.decisions, strict=True):
            decisions[place] = decision
        if not verdict.allowed:
            # As the script decided (a delay over its bound included): charged to none.
            self._give_back(taken)
        # Leases never delay: the delays are the script's, combined by the one rule again over
        # every limit (so the indices are the request's); a delayed request's refund needs the
        # script's instant.
        states = (None,) * len(decisions)
        return combine(
            decisions, states, states, verdict.now_us, [check.max_delay_s for check in checks]
        )

    def decide_now(self, check: Check) -> CombinedDecision | None:
        """``decide`` for a request whose one enforced check is leased, when its lease has a
        unit now (the common case): no call and no wait. None when it has not (``decide``
        then asks): nothing is taken or counted."""
        plan = self.plans.get(check.limit.name)
        if plan is None or plan.algorithm is not check.limit.algorithm:
            return None
        took = self._take_now(plan, check, True)
        if took is None:
            return None
        return CombinedDecision(True, 0.0, 0.0, (), None, (took[0],), (None,), None)

    def _take_now(
        self, plan: LeasePlan, check: Check, commit: bool
    ) -> tuple[Decision, tuple[Lease, int]] | None:
        """A unit from a live lease, with no wait; None when there is none to take."""
        if not commit:
            return None
        table = self.leases.get(plan.name)
        lease = table.get(check.key) if table is not None else None
        if lease is None:
            return None
        now_us = self.clock.now_us()
        _demand(lease, plan.interval_us, now_us)
        if lease.units <= 0 or now_us >= lease.expires_us:
            lease.period_demand -= 1  # counted again on the way that waits
            return None
        lease.units -= 1
        lease.unseeded += 1
        lease.taken += 1
        lease.last_take_us = now_us
        self.counters[plan.name].decided += 1
        reset_s = (lease.expires_us - now_us) / 1e6
        decision = Decision(True, 0.0, 0.0, plan.quota, lease.units, reset_s)
        return decision, (lease, lease.generation)

    async def _take(self, check: Check, commit: bool) -> tuple[Decision, tuple[Lease, int] | None]:
        plan = self.plans[check.limit.name]
        lease = self._lease(plan, check.key)
        counters = self.counters[plan.name]
        # Asks this request made: one, or two when a lease it waited for came back already
        # over (its window ended while the call was on its way).
        fetches = 0
        # A grant this request asked for is spent on it even when it arrives after its window
        # ended on this clock: Redis counted the unit in that window, as an exact decision's.
        own_grant = False
        if commit:
            _demand(lease, plan.interval_us, self.clock.now_us())
        while True:
            now_us = self.clock.now_us()
            if lease.units > 0 and (now_us < lease.expires_us or own_grant):
                lease.units -= 1
                lease.unseeded += 1
                lease.taken += 1
                lease.last_take_us = now_us
                counters.decided += commit
                remaining = lease.units
                reset_s = max(lease.expires_us - now_us, 0) / 1e6
                decision = Decision(True, 0.0, 0.0, plan.quota, remaining, reset_s)
                return decision, (lease, lease.generation)
            spent = fetches >= 2 or (fetches == 1 and lease.units == 0)
            if now_us < lease.blocked_until_us or spent or not commit:
                counters.decided += commit
                retry_s = max(lease.blocked_until_us - now_us, _MIN_RETRY_US) / 1e6
                if not commit and now_us >= lease.blocked_until_us:
                    # A look (explain): the next request would ask for a lease.
                    return Decision(True, 0.0, 0.0, plan.quota, 0, 0.0), None
                return Decision(False, 0.0, retry_s, plan.quota, 0, retry_s), None
            if lease.fetching is not None:
                await asyncio.shield(lease.fetching)
                continue
            if lease.units > 0:  # expired unused: give it back with the ask
                self._expired(plan, lease)
            fetching = lease.fetching = asyncio.get_running_loop().create_future()
            try:
                await self._ask(plan, check.key, lease, now_us)
                fetching.set_result(None)
            except BaseException as exc:
                # Waiters see the failure; they fall back with this request.
                fetching.set_result(None)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise caused_by(LeaseUnavailableError(str(exc)), exc) from exc
            finally:
                lease.fetching = None
            fetches += 1
            own_grant = True

    def _lease(self, plan: LeasePlan, key: str) -> Lease:
        table = self.leases.get(plan.name)
        if table is None:
            table = self.leases[plan.name] = {}
        lease = table.get(key)
        if lease is None:
            if len(table) >= self.max_keys.get(plan.name, 100_000):
                # Full: the oldest key's lease is dropped (its units left to expire in Redis).
                del table[next(iter(table))]
            lease = table[key] = Lease()
        return lease

    def _expired(self, plan: LeasePlan, lease: Lease) -> None:
        counters = self.counters[plan.name]
        counters.expired += 1
        lease.unused_back += lease.units
        lease.back_index = lease.index
        lease.units = 0
        lease.generation += 1

    def _give_back(self, taken: list[tuple[Lease, int]]) -> None:
        """Units taken for a request that is not going ahead: back to their leases, unless a
        lease has been replaced since (then the unit is lost to this window: never over)."""
        for lease, generation in taken:
            if lease.generation == generation:
                lease.units += 1
                lease.unseeded -= 1
                lease.taken -= 1
        taken.clear()

    def _seed_checks(self, checks: Sequence[Check]) -> None:
        """The fallback is about to decide these checks: their leases' admissions first."""
        for check in checks:
            if self.leased(check.limit):
                table = self.leases.get(check.limit.name)
                lease = table.get(check.key) if table is not None else None
                if lease is not None:
                    self._seed(self.plans[check.limit.name], check.key, lease)

    def _seed(self, plan: LeasePlan, key: str, lease: Lease) -> None:
        if lease.unseeded > 0 and self.seed is not None:
            self.seed(plan.limit, key, lease.unseeded)
        lease.unseeded = 0

    def refund(self, checks: Sequence[Check]) -> None:
        """A queued request (delayed by another limit) that did not go on keeps its leased
        unit: the lease it came from may have been replaced since, and a unit put into another
        lease would be one Redis never handed out. Lost to this lease, never over the limit."""
        del checks

    # -- Redis --

    async def _ask(self, plan: LeasePlan, key: str, lease: Lease, now_us: int) -> None:
        """One grant call; the lease replaced by its answer. Raises when Redis cannot answer
        (the breaker told), and at once while the circuit of its node is open."""
        node = self._node_of(plan, key)
        breaker = self.circuits.of(node)
        if not breaker.allow():
            raise LeaseUnavailableError("circuit open")
        probe = breaker.probe_out
        # The requests before this one: none yet (a new key) asks as a first ask (lease_grant).
        want = max(_recent_demand(lease, plan.interval_us, now_us) - 1, 0)
        # No more than this replica spends in an interval: its requests count rejections too,
        # which in a closed loop come back far faster than admissions, and a grant larger than
        # the replica can spend before its window ends is stranded there.
        if lease.taken >= 2 and lease.last_take_us > lease.arrived_us:
            lease.spend_per_us = lease.taken / (lease.last_take_us - lease.arrived_us)
        if want > 0 and lease.spend_per_us > 0.0:
            want = min(want, max(math.ceil(lease.spend_per_us * plan.interval_us), 1))
        back, back_index = lease.unused_back, lease.back_index
        try:
            if self.owed.due(node):
                await self.owed.settle(node)
            reply = await self._call(b"g", plan, key, want, back, back_index)
        except asyncio.CancelledError:
            breaker.cancelled(probe)
            raise
        except Exception as exc:
            self.stats.error()
            breaker.failure(_describe(exc))
            raise
        breaker.success()
        if self._sweeper is None:
            self.start()
        counters = self.counters[plan.name]
        if back:
            counters.returned += 1
            counters.units_returned += back
            lease.unused_back = 0
        granted, index, lasts_us, _remaining, retry_us = reply
        if plan.kind == b"F" and now_us >= lease.expires_us:
            lease.unseeded = 0  # admitted in a window that has ended
        self._seed(plan, key, lease)
        lease.generation += 1
        lease.granted_us = now_us
        lease.arrived_us = self.clock.now_us()
        lease.taken = 0
        lease.index = index
        if granted > 0:
            lease.units = lease.size = granted
            # A window's lease ends with its window: counted from the ask, so never later than
            # in Redis. A bucket's tokens are this replica's once taken: from their arrival.
            start_us = now_us if plan.kind != b"T" else self.clock.now_us()
            lease.expires_us = start_us + lasts_us
            lease.blocked_until_us = 0
            counters.granted += 1
            counters.units_granted += granted
            counters.last_size = granted
        else:
            lease.units = lease.size = 0
            lease.blocked_until_us = now_us + max(retry_us, _MIN_RETRY_US)

    def _node_of(self, plan: LeasePlan, key: str) -> str:
        """The node serving a lease key (``""``: a single server)."""
        return self.client.node_of(_lease_key(plan, key).encode())

    def _node_of_check(self, check: Check) -> str:
        plan = self.plans.get(check.limit.name)
        return self._node_of(plan, check.key) if plan is not None else ""

    def _topology(self) -> int:
        return self.client.topology

    async def _call(
        self, mode: bytes, plan: LeasePlan, key: str, want: int, back: int, back_index: int
    ) -> list[int]:
        redis_key = _lease_key(plan, key)
        keys = [redis_key.encode(), (redis_key + ":askers").encode()]
        time_source = self.time_source
        self._calls += 1
        call_id = self._calls
        argv = [
            b"%s%d" % (mode, call_id),
            b"" if time_source is None else b"%d" % time_source.now_us(),
            plan.kind,
            b"%d" % plan.quota,
            plan.span,
            self.replica,
            b"%d" % want,
            b"%d" % back,
            b"%d" % back_index if back else b"",
            plan.share_pm,
            plan.low_water_pm,
            plan.recent_us,
            b"%d" % plan.interval_us,
        ]
        self.counters[plan.name].calls += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply, _ = await submit_recovering(self.client, keys, argv)
        if isinstance(reply, Exception):
            raise reply
        if (
            not isinstance(reply, list)
            or len(reply) != 6
            or not all(type(value) is int for value in reply)
            or reply[-1] != call_id
        ):
            raise LeaseUnavailableError(f"unexpected reply to lease call {call_id}")
        self.stats.observe(loop.time() - started)
        return reply[:5]

    async def _charge(self, check: Check, units: int) -> None:
        """Charge a lease state with ``units`` the fallback admitted (``OwedToNodes.settle``,
        before this replica asks that node again; asks meanwhile wait for it)."""
        plan = self.plans.get(check.limit.name)
        if plan is None:  # no longer leased: its lease state is left to expire
            return
        reply = await self._call(b"c", plan, check.key, units, 0, 0)
        self.carried_back += reply[0]

    # -- returns --

    async def sweep(self) -> None:
        """Give back the unused part of leases expired an interval ago and not followed by an
        ask (which gives them back itself), one call each; a fixed window's are only counted."""
        now_us = self.clock.now_us()
        for name, table in list(self.leases.items()):
            plan = self.plans.get(name)
            if plan is None:
                continue
            for key, lease in list(table.items()):
                if lease.fetching is not None or now_us < lease.expires_us + plan.interval_us:
                    continue
                if lease.units > 0:
                    self._expired(plan, lease)
                if plan.kind == b"F":
                    lease.unused_back = 0  # its window is over: nothing to give back to
                elif (
                    lease.unused_back
                    and self.circuits.of(self._node_of(plan, key)).state == "closed"
                ):
                    await self._return(plan, key, lease, b"r")

    async def _return(self, plan: LeasePlan, key: str, lease: Lease, mode: bytes) -> None:
        back = lease.unused_back
        try:
            await self._call(mode, plan, key, 0, back, lease.back_index)
        except Exception as exc:  # best effort: the units expire in Redis anyway
            log.debug("lease of %s not returned: %s", plan.name, _describe(exc))
            return
        lease.unused_back = 0
        counters = self.counters[plan.name]
        counters.returned += 1
        counters.units_returned += back

    def start(self) -> None:
        """The sweep, every shortest lease interval, while leases are configured."""
        if self._sweeper is None and self.plans:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while True:
            intervals = [plan.interval_us for plan in self.plans.values()]
            await asyncio.sleep(max(min(intervals, default=1_000_000), 50_000) / 1e6)
            with contextlib.suppress(Exception):
                await self.sweep()

    async def close(self) -> None:
        """Graceful shutdown: every lease with units left goes back, and this replica leaves
        the set of those asking."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        now_us = self.clock.now_us()
        returns = []
        for name, table in self.leases.items():
            plan = self.plans.get(name)
            if plan is None:
                continue
            for key, lease in table.items():
                _unspent(lease, now_us)
                if lease.unused_back:
                    returns.append(self._return(plan, key, lease, b"q"))
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await asyncio.gather(*returns)
                await self.returns_done()
        self.leases.clear()


def _lease_key(plan: LeasePlan, key: str) -> str:
    """A lease state's Redis key (its hash tag: the limit and the key)."""
    return plan.key_head + key.replace("}", "%7D") + "}"


def _unspent(lease: Lease, now_us: int) -> None:
    """A live lease's units, set aside to be given back."""
    if lease.units > 0 and now_us < lease.expires_us:
        lease.unused_back += lease.units
        lease.back_index = lease.index
        lease.units = 0


async def _gather(calls: Sequence[Awaitable[None]]) -> None:
    await asyncio.gather(*calls)


def _demand(lease: Lease, interval_us: int, now_us: int) -> None:
    """Count a request that wants a unit of this lease, in the interval it falls in."""
    elapsed_us = now_us - lease.period_start_us
    if elapsed_us >= interval_us:
        lease.previous_demand = lease.period_demand if elapsed_us < 2 * interval_us else 0
        lease.period_demand = 0
        lease.period_start_us = now_us - elapsed_us % interval_us
    lease.period_demand += 1


def _recent_demand(lease: Lease, interval_us: int, now_us: int) -> int:
    """Requests over the last interval: this interval's, and the one before's weighted by its
    overlap (a sliding window's estimate); 0 for none (then a first ask: lease_grant.py)."""
    elapsed_us = now_us - lease.period_start_us
    if elapsed_us >= 2 * interval_us:
        return 0
    if elapsed_us >= interval_us:
        current, previous, elapsed_us = 0, lease.period_demand, elapsed_us - interval_us
    else:
        current, previous = lease.period_demand, lease.previous_demand
    return current + math.ceil(previous * (interval_us - elapsed_us) / interval_us)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}"


__all__ = [
    "Lease",
    "LeaseBook",
    "LeaseCounters",
    "LeasePlan",
    "LeaseUnavailableError",
    "lease_lua_program",
    "load_lease_script",
    "plan_for",
]

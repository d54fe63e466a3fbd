"""The Redis store: one script call per request, and ``on_failure`` when Redis cannot answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.combine import CombinedDecision, combine
from gateway.algorithms.penalty_box import PenaltyBox, PenaltyRefusal
from gateway.clock import Clock, MonotonicClock
from gateway.limits.compiled import Check, CompiledLimit, with_variants
from gateway.stores.memory import MemoryStore
from gateway.stores.protocol import StoreUnavailableError
from gateway.stores.redis.block_watch import BlockWatch
from gateway.stores.redis.circuit import CircuitBreaker, NodeCircuits, State
from gateway.stores.redis.clients import (
    PipelineClient,
    ScriptClient,
    ThinClient,
    recovered,
)
from gateway.stores.redis.codecs import CalendarCodec, codec_for
from gateway.stores.redis.fallback import OwedToNodes
from gateway.stores.redis.fallback_penalties import FallbackPenalties
from gateway.stores.redis.key_layout import FIXED_TAG, WHOLE_KEY, LimitPlan, fingerprint, tag_scheme
from gateway.stores.redis.lease import LeaseBook, LeaseCounters, lease_lua_program
from gateway.stores.redis.library import LuaProgram, lua_program
from gateway.stores.redis.shadow import FOLD_INTERVAL_S, PendingCharges
from gateway.stores.redis.slot_keeper import SlotKeeper
from gateway.stores.store_stats import StoreStats

FailureMode = Literal["local", "allow", "deny"]
FAILURE_MODES: Final = ("local", "allow", "deny")
log = logging.getLogger("gateway.store")

_INF: Final = float("inf")
# An overridden clock (tests) has nothing to do with the clock Redis expires keys by.
_OVERRIDE_MIN_TTL_MS: Final = 600_000
# How long a replica's concurrency slots live in Redis unless it renews them (every third of it).
SLOT_TTL_S: Final = 10.0
# Getting ready at start (several round trips, every master) may take longer than one call.
_PREPARE_TIMEOUT_S: Final = 2.0
_ALGORITHM_FILES: Final = (
    "prelude.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window.lua",
    "sliding_log.lua",
    "token_bucket.lua",
    "calendar_window.lua",
    "concurrency.lua",
)


def decision_program() -> LuaProgram:
    """The decision program: the prelude and every algorithm's mirror (once per library load),
    then ``decide.lua`` (per call)."""
    return lua_program("decide", _ALGORITHM_FILES, ("decide.lua",))


def load_script() -> str:
    """The decision script, as ``EVALSHA`` runs it: every file on every call."""
    return decision_program().script


@dataclass(slots=True)
class RedisStoreCounters:
    """What the store did, beyond ``stats``; round trips per script call are
    ``store.round_trips / counters.calls``."""

    calls: int = 0  # script calls (one per request, one per dry-run limit, refunds)
    failed_calls: int = 0  # calls that timed out or failed
    local_decisions: int = 0  # decided in process (on_failure: local, or a refund)
    allowed_open: int = 0  # admitted without a decision (on_failure: allow)
    denied_closed: int = 0  # refused without a decision (on_failure: deny)
    recoveries: int = 0  # calls sent again after NOSCRIPT (a new Redis) or MOVED
    carried_back: int = 0  # fallback admissions charged to Redis once it answered again


def parse_store_url(url: str) -> tuple[str, bool]:
    """``(redis url, cluster?)`` for ``redis://``, ``rediss://``, ``redis+cluster://`` and
    ``rediss+cluster://``."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if sep and scheme in ("redis+cluster", "rediss+cluster"):
        return f"{scheme.partition('+')[0]}://{rest}", True
    if sep and scheme in ("redis", "rediss"):
        return url, False
    raise ValueError(
        f"invalid store url {url!r}: expected redis://, rediss://, redis+cluster:// or "
        "rediss+cluster://"
    )


ClientKind = Literal["thin", "redis-py"]


def _check_settings(
    on_failure: str,
    replicas: int,
    timeout_s: float,
    max_in_flight: int,
    slot_ttl_s: float,
    key_prefix: str,
) -> None:
    """Refuse a store configured out of range (``ValueError``, saying what is accepted)."""
    if on_failure not in FAILURE_MODES:
        raise ValueError(f"on_failure must be local, allow or deny, got {on_failure!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout must be positive, got {timeout_s!r}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight!r}")
    if not slot_ttl_s > 0:
        raise ValueError(f"slot_ttl must be positive, got {slot_ttl_s!r}")
    if "{" in key_prefix or "}" in key_prefix:
        raise ValueError(f"key_prefix must not contain braces (hash tags), got {key_prefix!r}")


def _script_client(
    kind: ClientKind,
    redis_url: str,
    cluster: bool,
    program: LuaProgram,
    max_in_flight: int,
    timeout_s: float,
) -> ScriptClient:
    """A client of ``kind`` that calls ``program`` (our own thin one, or redis-py's)."""
    if kind == "thin":
        return ThinClient(
            redis_url,
            program.script,
            program.sha,
            max_in_flight,
            timeout_s,
            cluster=cluster,
            library=program.library,
            function=program.function,
        )
    if kind == "redis-py":
        return PipelineClient(
            _redis_py(redis_url, cluster, max_in_flight, timeout_s),
            program.script,
            program.sha,
            max_in_flight,
            timeout_s,
        )
    raise ValueError(f"client must be 'thin' or 'redis-py', got {kind!r}")


class RedisStore:
    """The ``LimitStore`` for several replicas: state in Redis or a Redis Cluster."""

    name = "redis"
    verdicts_on_clock = False  # decided on Redis TIME
    slots_shared = True  # other replicas hold slots of the same keys
    decides_penalties = True  # in the decision script, beside the limits' states

    def __init__(
        self,
        url: str,
        *,
        on_failure: FailureMode = "local",
        replicas: int = 1,
        timeout_s: float = 0.05,
        key_prefix: str = "gw:",
        max_in_flight: int = 4,
        client: ClientKind = "thin",
        clock: Clock | None = None,
        time_source: Clock | None = None,
        breaker: CircuitBreaker | None = None,
        slot_ttl_s: float = SLOT_TTL_S,
    ) -> None:
        """``clock`` drives the local fallback and the breakers; ``time_source`` (tests only)
        replaces Redis ``TIME`` as the scripts' clock. ``breaker`` is the single server's
        circuit breaker, and the model of each cluster node's."""
        _check_settings(on_failure, replicas, timeout_s, max_in_flight, slot_ttl_s, key_prefix)
        redis_url, cluster = parse_store_url(url)
        self.url = url
        self.cluster = cluster
        self.on_failure: FailureMode = on_failure
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.key_prefix = key_prefix
        self.time_source = time_source
        # Concurrency slots this replica holds in Redis, under its own id, renewed while it
        # runs (``slot_keeper.py``).
        self.slot_ttl_s = slot_ttl_s
        self.owner = uuid.uuid4().hex[:16].encode()
        self.slots = SlotKeeper(self._renew_slots, slot_ttl_s / 3)
        self.clock: Clock = clock or MonotonicClock()
        # What a calendar window's periods are read off (the script then picks by Redis TIME):
        # this replica's clock; a test that only replaces Redis TIME reads that instead.
        self._calendar_clock: Clock = clock or time_source or self.clock
        self.breaker = breaker or CircuitBreaker("redis store", clock=self.clock)
        # One breaker per node: a cluster's dead master opens the circuit of its own keys.
        self.circuits = NodeCircuits(self.breaker, self._circuit_moved, self._probe_later)
        # An open circuit's probe, on a loop timer when it is due (not when a request comes:
        # an idle gateway would show Redis away long after it is back), by node.
        self._probe_timers: dict[str, asyncio.TimerHandle] = {}
        self._probes: set[asyncio.Task[None]] = set()
        self._closing = False
        # For the metrics: calls, errors, call latency, and the circuit's state.
        self.stats = StoreStats()
        self.counters = RedisStoreCounters()
        # on_failure local: the fallback's state, kept charged with what this replica admits
        # through Redis too, so it starts from this replica's recent admissions, not empty;
        # charged from ``pending`` (shadow.py), at most ``FOLD_INTERVAL_S`` late.
        self.local = MemoryStore(self.clock)
        # ... and its penalty boxes, as the in-process store's (fallback_penalties.py).
        self.local_penalties = FallbackPenalties(self.clock)
        self.pending = PendingCharges()
        self.fold_interval_s = FOLD_INTERVAL_S
        self._fold_timer: asyncio.TimerHandle | None = None
        self._min_ttl = b"%d" % _OVERRIDE_MIN_TTL_MS if time_source is not None else b"0"
        program = decision_program()
        self.script = program.script
        self.sha = program.sha
        self.client: ScriptClient = _script_client(
            client, redis_url, cluster, program, max_in_flight, timeout_s
        )
        self.owed = OwedToNodes(self._charge_owed, self._node_of_check, self._topology)
        self.leases = self._lease_book(client, redis_url, cluster)
        if on_failure == "local":
            self.leases.seed = self._seed_local
        # What the lease book calls back, bound once rather than on every request.
        self._lease_callbacks = (self._decide_exact, self._unavailable, self._nominal)
        # The limits whose keys an operator blocked: their calls read their boxes too.
        self.blocks = BlockWatch(self._marker_client, key_prefix)
        self._plans: dict[str, LimitPlan] = {}
        self._stale_plans: dict[tuple[str, Algorithm[Any]], LimitPlan] = {}
        self._tag_part: str | None = None

    def _lease_book(self, client: ClientKind, redis_url: str, cluster: bool) -> LeaseBook:
        """Leased limits (``lease:``): their own script, on a client of their own (one call in
        flight: asks are rare), of the kind configured."""
        return LeaseBook(
            _script_client(client, redis_url, cluster, lease_lua_program(), 1, self.timeout_s),
            key_prefix=self.key_prefix,
            clock=self.clock,
            circuits=self.circuits,
            stats=self.stats,
            time_source=self.time_source,
        )

    def admin_client(self, timeout_s: float = 1.0) -> Redis | RedisCluster:
        """A redis-py client for what is not a script call on the request path (which limits
        have blocks; the keys' API), on connections of its own."""
        url, cluster = parse_store_url(self.url)
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
        }
        if cluster:
            return RedisCluster.from_url(url, **options)
        return Redis.from_url(url, **options)

    def _marker_client(self, key: str) -> Redis:
        """A plain client of the one server holding ``key`` (a cluster's node by the slot map
        the calls keep): not a cluster client, which keeps a dead node's connections open."""
        url, _ = parse_store_url(self.url)
        node = self.client.node_of(key.encode()) if self.cluster else ""
        if node:
            parts = urlsplit(url)
            auth, _, _ = parts.netloc.rpartition("@")
            url = urlunsplit(parts._replace(netloc=f"{auth}@{node}" if auth else node))
        return Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    @property
    def round_trips(self) -> int:
        """Pipelines sent to Redis; per script call, ``round_trips / counters.calls``."""
        return self.client.round_trips

    # -- configuration --

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        """New plans for a new policy (ValueError, before any change, if a limit cannot run in
        Redis); the local fallback keeps or rescales its state as the memory store does."""
        # Leased limits make no per-request call: the tag comes from the others' keys.
        tag_part = tag_scheme([limit for limit in limits if limit.spec.lease is None])
        plans = {limit.table: self._build_plan(limit, tag_part) for limit in with_variants(limits)}
        self._fold_pending()  # under the plans they were admitted by
        self.leases.configure(limits)
        old_local = [self.plan(limit).local for limit in with_variants(previous)]
        self.local.configure([plan.local for plan in plans.values()], old_local)
        self.local_penalties.configure(limits)
        self._tag_part = tag_part
        self._plans = plans
        self._stale_plans.clear()

    def _build_plan(self, limit: CompiledLimit, tag_part: str | None) -> LimitPlan:
        codec = codec_for(limit.algorithm, self.owner, self.slot_ttl_s)
        if limit.spec.lease is not None and _penalty_argument(limit):
            raise ValueError(
                "a leased limit decides most requests in this replica, where Redis cannot "
                "count them against a penalty: remove lease or penalty"
            )
        if limit.holds_slots and limit.max_delay > 0 and _penalty_argument(limit):
            raise ValueError(
                "a concurrency limit's refused requests wait for a slot and ask Redis again, "
                "and each ask would count against the penalty: give it max_delay: 0, or "
                "remove penalty"
            )
        parts = limit.spec.key
        if tag_part is None or tag_part not in parts:
            tag_index = FIXED_TAG
        elif len(parts) == 1:
            tag_index = WHOLE_KEY
        else:
            tag_index = parts.index(tag_part)
        return LimitPlan(
            algorithm=limit.algorithm,
            codec=codec,
            key_head=self.key_prefix + "{",
            key_tail=f"}}{limit.name}:{fingerprint(limit, codec)}:",
            tag_index=tag_index,
            penalty=_penalty_argument(limit),
            penalty_tail=f"}}{limit.name}:penalty:",
            # Without the tiering: the variants have plans (and local tables) of their own.
            local=dataclasses.replace(
                limit, algorithm=limit.algorithm.share(self.replicas), tiering=None
            ),
        )

    def plan(self, limit: CompiledLimit) -> LimitPlan:
        """The plan for a limit of the current policy, or of the one before (requests in
        flight across a reload)."""
        plan = self._plans.get(limit.table)
        if plan is not None and plan.algorithm is limit.algorithm:
            return plan
        stale_key = (limit.table, limit.algorithm)
        plan = self._stale_plans.get(stale_key)
        if plan is None:
            plan = self._stale_plans[stale_key] = self._build_plan(limit, self._tag_part)
        return plan

    def redis_key(self, check: Check) -> str:
        return self.plan(check.limit).redis_key(check.key)

    # -- the LimitStore protocol --

    def try_decide_now(self, checks: Sequence[Check]) -> CombinedDecision | None:
        """A verdict without a wait where one is at hand (a request whose one check is a leased
        limit with a unit left in its lease); None otherwise, and ``decide`` decides."""
        if len(checks) == 1 and self.leases.plans:
            return self.leases.decide_now(checks[0])
        return None

    def decide(
        self, checks: Sequence[Check], *, commit: bool = True
    ) -> Coroutine[Any, Any, CombinedDecision]:
        """The coroutine that decides (not a coroutine around it: one fewer per request)."""
        if self.leases.plans:  # some limit is leased: the lease book sorts the checks
            return self.leases.decide(checks, commit, *self._lease_callbacks)
        return self._decide_exact(checks, commit)

    def _nominal(self, check: Check) -> int:
        return self.plan(check.limit).codec.nominal_limit

    async def _decide_exact(self, checks: Sequence[Check], commit: bool) -> CombinedDecision:
        """One script call for all ``checks`` (none of them leased)."""
        if not checks:
            return CombinedDecision(True, 0.0, 0.0, (), None, (), ())
        plans = [self.plan(check.limit) for check in checks]
        # All of a request's keys share a hash tag: one slot, one node.
        node = self._node_of(checks[0], plans[0]) if self.cluster else ""
        breaker = self.circuits.of(node)
        if not breaker.allow():
            return await self._unavailable(checks, commit, "circuit open")
        probe = breaker.probe_out
        try:
            if self.owed.due(node):
                await self.owed.settle(node)
            reply = await self._eval(b"d" if commit else b"p", checks, plans)
        except asyncio.CancelledError:  # the client hung up: a probe must not stay out
            breaker.cancelled(probe)
            raise
        except Exception as exc:
            self._failed(exc, breaker)
            return await self._unavailable(checks, commit, _describe(exc))
        self._answered(breaker)
        verdict = _verdict(checks, plans, reply)
        if not verdict.allowed and self.on_failure == "local":
            self._keep_block(checks, verdict)
        if commit and verdict.allowed:
            self.slots.took(checks, plans)
        if commit and verdict.allowed and self.on_failure == "local":
            # Counted now, charged to the fallback at most FOLD_INTERVAL_S later (a limit
            # charged after the response when its charge is made).
            if self.pending.add(_charged_now(checks)):
                self._fold_pending()
            elif self._fold_timer is None:
                self._fold_timer = asyncio.get_running_loop().call_later(
                    self.fold_interval_s, self._fold_pending
                )
        return verdict

    async def decide_each(self, checks: Sequence[Check]) -> list[CombinedDecision]:
        """Dry-run limits, one script call each, all in flight together. They are never
        enforced, so when Redis fails they are decided locally whatever ``on_failure`` says."""
        plans = [self.plan(check.limit) for check in checks]
        # Each limit's key is on its own node: each call asks that node's circuit.
        breakers = [
            self.circuits.of(self._node_of(check, plan) if self.cluster else "")
            for check, plan in zip(checks, plans, strict=True)
        ]
        allowed: list[bool] = []
        probes: list[int] = []  # each read right after its allow()
        for breaker in breakers:
            allowed.append(breaker.allow())
            probes.append(breaker.probe_out if allowed[-1] else 0)
        calls = [
            self._eval(b"d", (check,), (plan,))
            for check, plan, ok in zip(checks, plans, allowed, strict=True)
            if ok
        ]
        try:
            answers = iter(await asyncio.gather(*calls, return_exceptions=True))
        except asyncio.CancelledError:
            for breaker, probe in zip(breakers, probes, strict=True):
                breaker.cancelled(probe)
            raise
        verdicts = []
        for check, plan, breaker, ok, probe in zip(
            checks, plans, breakers, allowed, probes, strict=True
        ):
            if not ok:
                verdicts.append(await self._local_decide((check,), True))
                continue
            reply = next(answers)
            if isinstance(reply, BaseException):
                if isinstance(reply, asyncio.CancelledError):
                    breaker.cancelled(probe)
                    raise reply
                self._failed(reply, breaker)
                verdicts.append(await self._local_decide((check,), True))
            else:
                self._answered(breaker)
                verdict = _verdict((check,), (plan,), reply)
                if verdict.allowed:
                    self.slots.took((check,), (plan,))
                verdicts.append(verdict)
        return verdicts

    def release(self, checks: Sequence[Check]) -> asyncio.Future[None] | None:
        """Give back slots taken in Redis there (one call, in flight: the future), and those
        the local fallback gave in process at once. Never raises: a slot Redis does not hear
        is back stays counted until the replica holds no more of its key, then expires."""
        in_redis: list[Check] = []
        plans: list[LimitPlan] = []
        for check in checks:
            plan = self.plan(check.limit)
            if self.slots.give_back(check, plan):
                in_redis.append(check)
                plans.append(plan)
            else:
                self.local.release((self._local_check(check),))
        if not in_redis:
            return None
        return asyncio.ensure_future(self._release_in_redis(in_redis, plans))

    async def _release_in_redis(self, checks: Sequence[Check], plans: Sequence[LimitPlan]) -> None:
        node = self._node_of(checks[0], plans[0]) if self.cluster else ""
        breaker = self.circuits.of(node)
        if not breaker.allow():
            return  # Redis keeps the slots until they expire (slot_keeper.py)
        probe = breaker.probe_out
        try:
            await self._eval(b"r", checks, plans)
        except asyncio.CancelledError:
            breaker.cancelled(probe)
            raise
        except Exception as exc:
            self._failed(exc, breaker)
        else:
            self._answered(breaker)

    async def _renew_slots(self, held: Sequence[tuple[Check, LimitPlan, int]]) -> None:
        """Keep this replica's slots of each key alive (``slot_keeper.py``): one call per key
        (each in its own hash slot), all in flight together."""
        calls = []
        for check, plan, units in held:
            node = self._node_of(check, plan) if self.cluster else ""
            if self.circuits.of(node).state == "open":
                continue
            calls.append(self._eval(b"k", (check,), (plan,), units=(units,)))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, Exception):
                self.stats.error()

    async def charge(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        """One script call (mode 'c', pipelined with the others in flight) charging each check
        what its response cost, as much as its key has room for; what each took. Never
        raises: a charge Redis cannot make is counted per limit, then given to the local
        fallback and owed to Redis (``on_failure: local``) or dropped (allow, deny)."""
        if not checks:
            return []
        plans = [self.plan(check.limit) for check in checks]
        # All of a request's keys share a hash tag: one slot, one node.
        node = self._node_of(checks[0], plans[0]) if self.cluster else ""
        breaker = self.circuits.of(node)
        if breaker.allow():
            probe = breaker.probe_out
            try:
                if self.owed.due(node):
                    await self.owed.settle(node)
                taken = await self._eval(b"c", checks, plans, units=units)
            except asyncio.CancelledError:
                breaker.cancelled(probe)
                raise
            except Exception as exc:
                self._failed(exc, breaker)
            else:
                self._answered(breaker)
                del taken[0]  # the instant charged at
                if self.on_failure == "local":
                    self._pend(checks, taken)
                return taken
        for check in checks:
            check.limit.counters.charge_failures += 1
        if self.on_failure != "local":
            return [0] * len(checks)
        self.counters.local_decisions += 1
        self._fold_pending()
        taken = self.local.charge_now([self._local_check(check) for check in checks], units)
        self.owed.add(
            [Check(check.limit, check.key, cost=n) for check, n in zip(checks, units, strict=True)]
        )
        return taken

    def _pend(self, checks: Sequence[Check], units: Sequence[int]) -> None:
        """Count units charged in Redis for the fallback, as an admission's are."""
        charged = [
            Check(check.limit, check.key, cost=n)
            for check, n in zip(checks, units, strict=True)
            if n > 0
        ]
        if self.pending.add(charged):
            self._fold_pending()
        elif charged and self._fold_timer is None:
            self._fold_timer = asyncio.get_running_loop().call_later(
                self.fold_interval_s, self._fold_pending
            )

    async def refund(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """Best effort, never raises: a refund that cannot reach Redis is given locally.
        ``charged_us`` is the verdict's ``now_us`` (the Redis ``TIME`` the script decided at),
        with which windows give back exactly what that decision charged; without it they keep
        the charge. Buckets give it back either way."""
        if self.leases.plans and any(self.leases.leased(check.limit) for check in checks):
            self.leases.refund([c for c in checks if self.leases.leased(c.limit)])
            checks = [c for c in checks if not self.leases.leased(c.limit)]
        if any(check.limit.holds_slots for check in checks):
            done = self.release([c for c in checks if c.limit.holds_slots])
            if done is not None:
                await done
            checks = [c for c in checks if not c.limit.holds_slots]
        if not checks:
            return
        plans = [self.plan(check.limit) for check in checks]
        breaker = self.circuits.of(self._node_of(checks[0], plans[0]) if self.cluster else "")
        if breaker.allow():
            probe = breaker.probe_out
            charged = b"" if charged_us is None else b"%d" % charged_us
            try:
                await self._eval(b"r", checks, plans, charged)
            except asyncio.CancelledError:
                breaker.cancelled(probe)
                raise
            except Exception as exc:
                self._failed(exc, breaker)
            else:
                self._answered(breaker)
                return
        self.counters.local_decisions += 1
        self._fold_pending()
        # Without the instant: it may be Redis TIME, which the local clock's windows must not
        # take for one of theirs.
        await self.local.refund([self._local_check(check) for check in checks])

    def tracked_keys(self, limit_name: str) -> int:
        """Keys held in this process (the local fallback's); keys in Redis expire by TTL."""
        self._fold_pending()
        return self.local.tracked_keys(limit_name)

    def lease_counters(self, limit_name: str) -> LeaseCounters | None:
        """What this replica's leases of a leased limit did; None for a limit not leased."""
        if limit_name not in self.leases.plans:
            return None
        return self.leases.counters.get(limit_name)

    def evictions(self, limit_name: str) -> int:
        """The local fallback's: Redis expires its keys by TTL and evicts none."""
        self._fold_pending()
        return self.local.evictions(limit_name)

    async def prepare(self) -> None:
        """Before the first request: connect, read a cluster's slot map and load the script
        on every master. Otherwise a new process's first calls pay for it themselves (MOVED,
        CLUSTER SLOTS, NOSCRIPT, SCRIPT LOAD, each then sent again), so Redis TIME decides
        them late, after calls that arrived later; and a bucket kept busy keeps that shift
        for as long as it stays busy. A failure here is logged and changes nothing else:
        calls repair what they meet, as they always do."""
        try:
            self.blocks.start()  # read at once, then every second
            async with asyncio.timeout(_PREPARE_TIMEOUT_S):
                await self.client.prepare()
                if self.leases.plans:
                    await self.leases.client.prepare()
        except Exception as exc:
            log.warning(
                "redis store not prepared (%s): calls will connect on demand", _describe(exc)
            )

    async def close(self) -> None:
        self._closing = True
        for timer in self._probe_timers.values():
            timer.cancel()
        self._probe_timers.clear()
        for task in list(self._probes):
            task.cancel()
        await self.blocks.close()
        self.slots.close()  # the slots still held expire with the replica's renewals
        await self.leases.close()  # graceful shutdown: unused leases go back
        await self.leases.client.close()
        self._fold_pending()  # and no timer left behind
        await self.local.close()
        await self.client.close()

    # -- Redis --

    async def _eval(
        self,
        mode: bytes,
        checks: Sequence[Check],
        plans: Sequence[LimitPlan],
        charged_us: bytes = b"",
        *,
        cost: int = 1,
        units: Sequence[int] | None = None,
    ) -> list[int]:
        """One script call for all ``checks``; raises if Redis does not answer. ``units``,
        one per check, are what mode 'c' charges (else each check's cost times ``cost``)."""
        keys = [
            plan.redis_key(check.key).encode() for check, plan in zip(checks, plans, strict=True)
        ]
        # A decision or a look at limits with a penalty, or with keys an operator blocked
        # (block_watch.py): their boxes in the same call.
        boxes = (mode == b"d" or mode == b"p") and (
            any([plan.penalty for plan in plans]) or self._blocks_in(checks)
        )
        if boxes:
            mode = mode.upper()
            keys += [
                plan.penalty_key(check.key).encode()
                for check, plan in zip(checks, plans, strict=True)
            ]
        time_source = self.time_source
        now_us = time_source.now_us() if time_source is not None else None
        now = b"" if now_us is None else b"%d" % now_us
        self.counters.calls += 1
        call_id = self.counters.calls
        # One cost for every limit, or one per limit when limits weigh the request differently.
        if units is not None:
            costs = b" ".join([b"%d" % n for n in units])
        else:
            weights = [check.cost for check in checks]
            if weights.count(1) != len(weights):
                costs = b" ".join([b"%d" % (cost * weight) for weight in weights])
            else:
                costs = b"%d" % cost
        argv = [b"%s%d" % (mode, call_id), now, costs, self._min_ttl]
        argv += [plan.codec.params for plan in plans]
        calendar = False
        for check in checks:
            limit = check.limit
            # Charged after the response and admitted free (``hold: none``): 'd' decides it
            # and writes nothing (it never delays).
            argv.append(b"a" if limit.admits_free else _bound(check.max_delay_s))
            calendar = calendar or limit.calendar
        if mode == b"r" or calendar or boxes:
            argv.append(charged_us)
        if calendar:
            # The gateway reads the calendar at its own time (Redis TIME picks the period).
            unix_us = self._calendar_clock.unix_us()
            for plan in plans:
                codec = plan.codec
                argv.append(codec.periods(unix_us) if isinstance(codec, CalendarCodec) else b"")
        elif boxes:
            argv += [b""] * len(plans)
        if boxes:
            argv += [plan.penalty for plan in plans]
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await self.client.submit(keys, argv)
        if isinstance(reply, Exception):  # MOVED, ASK, NOSCRIPT: sent again where it belongs
            reply, recoveries = await recovered(self.client, keys, argv, reply)
            self.counters.recoveries += recoveries
            if isinstance(reply, Exception):
                raise reply
        if mode in (b"r", b"k"):
            length = 1
        elif mode == b"c":
            length = 1 + len(checks)
        else:
            length = 1 + 5 * len(checks) + (2 if boxes else 0)
        result = _checked(reply, call_id, length)
        self.stats.observe(loop.time() - started)
        return result

    def _blocks_in(self, checks: Sequence[Check]) -> bool:
        """Whether an operator blocked keys of one of the checks' limits (block_watch.py)."""
        names = self.blocks.names
        return bool(names) and any([check.limit.name in names for check in checks])

    async def _charge_owed(self, check: Check, units: int) -> None:
        """Charge Redis with ``units`` the fallback admitted (``OwedToNodes.settle``, before
        the node decides again; concurrent requests for it wait, so none is decided first)."""
        await self._eval(b"c", (check,), (self.plan(check.limit),), cost=units)
        self.counters.carried_back += units

    def _node_of(self, check: Check, plan: LimitPlan) -> str:
        """The cluster node serving ``check``'s key (the client's slot map)."""
        return self.client.node_of(plan.redis_key(check.key).encode())

    def _node_of_check(self, check: Check) -> str:
        return self._node_of(check, self.plan(check.limit)) if self.cluster else ""

    def _topology(self) -> int:
        return self.client.topology

    def _answered(self, breaker: CircuitBreaker) -> None:
        """Redis answered a call."""
        breaker.success()
        if self.stats.state == "fallback":  # the circuit was closed all along
            self.stats.set_state("ok", "Redis answered")

    def _failed(self, exc: BaseException, breaker: CircuitBreaker) -> None:
        self.counters.failed_calls += 1
        self.stats.error()
        reason = _describe(exc)
        breaker.failure(reason)
        if breaker.state == "closed" and self.stats.state == "ok":
            # Below the threshold: on_failure answers this one. (Another node's open circuit
            # is the worse state, and stays what the store reports.)
            self.stats.set_state("fallback", f"{reason} (on_failure: {self.on_failure})")

    def _probe_later(self, node: str, breaker: CircuitBreaker) -> None:
        """A node's circuit opened: probe it when its next probe is due, whether or not a
        request comes then."""
        if self._closing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a tool, a test of the breaker alone): requests probe
        timer = self._probe_timers.pop(node, None)
        if timer is not None:
            timer.cancel()
        self._probe_timers[node] = loop.call_later(breaker.retry_in_s, self._probe_due, node)

    def _probe_due(self, node: str) -> None:
        self._probe_timers.pop(node, None)
        breaker = self.circuits.of(node)
        if self._closing or breaker.state != "open":
            return  # a request probed first
        if breaker.retry_in_s > 0.0:  # the breaker's clock is not the loop's
            self._probe_later(node, breaker)
            return
        if not breaker.allow():
            return
        task = asyncio.get_running_loop().create_task(self._probe(node, breaker, breaker.probe_out))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, node: str, breaker: CircuitBreaker, probe: int) -> None:
        """The probe a request would make, without one: what the fallback owes first (as a
        request's call settles it), else a ``PING``."""
        try:
            if self.owed.due(node):
                await self.owed.settle(node)
            else:
                await self.client.ping(node)
        except asyncio.CancelledError:
            breaker.cancelled(probe)
            raise
        except Exception as exc:
            self._failed(exc, breaker)  # open again, for longer: the next timer is set
        else:
            self._answered(breaker)

    def _circuit_moved(self, worst: State) -> None:
        # The breaker has logged the transition: counted, not logged again here. The metrics'
        # names for the worst of the nodes' states (a closed circuit means Redis answered).
        self.stats.moved("ok" if worst == "closed" else worst)

    # -- when Redis cannot decide --

    def _local_check(self, check: Check) -> Check:
        # Not dataclasses.replace, ten times as long on the request path (bench/README.md).
        local = self.plan(check.limit).local
        return Check(local, check.key, check.max_delay_s, check.reserved, check.cost)

    async def _local_decide(self, checks: Sequence[Check], commit: bool) -> CombinedDecision:
        self.counters.local_decisions += 1
        self._fold_pending()  # what Redis admitted first
        local = [self._local_check(check) for check in checks]
        penalties = self.local_penalties
        if not penalties.tables:
            return await self.local.decide(local, commit=commit)
        now_us = self.clock.now_us()
        blocked = penalties.blocked(checks, now_us)
        if blocked is not None:
            # Refused by the box, the limits looked at and charged nothing (as Redis's 'D').
            index, until_us = blocked
            looked = await self.local.decide(local, commit=False)
            states = list(looked.states)
            states[index] = PenaltyRefusal(until_us)
            retry_after_s = (until_us - now_us) / 1_000_000
            return CombinedDecision(
                False, 0.0, retry_after_s, (index,), None, looked.decisions, tuple(states), now_us
            )
        verdict = await self.local.decide(local, commit=commit)
        if commit and not verdict.allowed:
            penalties.strike(checks, verdict.rejected_by, now_us)
        return verdict

    def _keep_block(self, checks: Sequence[Check], verdict: CombinedDecision) -> None:
        """A refusal by a box in Redis: the fallback keeps the block too, for an outage."""
        index = verdict.rejected_by[0] if verdict.rejected_by else -1
        if index >= 0 and isinstance(verdict.states[index], PenaltyRefusal):
            self.local_penalties.met_block(checks[index], verdict.retry_after_s)

    def _seed_local(self, limit: CompiledLimit, key: str, units: int) -> None:
        """Charge the fallback's state with ``units`` a lease admitted, as many as it has
        room for (as the carry-back charges Redis)."""
        self._charge_local(self._local_check(Check(limit, key)), units)

    def _charge_local(self, check: Check, units: int) -> None:
        """Charge ``units`` to a fallback check's state, as many as it has room for."""
        self.local.charge_now((check,), (units,))

    def _fold_pending(self) -> None:
        """Charge the fallback with what Redis admitted since the last fold (shadow.py)."""
        timer = self._fold_timer
        if timer is not None:
            timer.cancel()
            self._fold_timer = None
        if not self.pending:
            return
        plans = self._plans
        for table, units_by_key in self.pending.take().items():
            plan = plans.get(table)
            if plan is None:  # a limit a reload removed: its fallback state is gone too
                continue
            for key, units in units_by_key.items():
                self._charge_local(Check(plan.local, key), units)

    async def _unavailable(
        self, checks: Sequence[Check], commit: bool, reason: str
    ) -> CombinedDecision:
        mode = self.on_failure
        if mode == "local":
            verdict = await self._local_decide(checks, commit)
            if commit and verdict.allowed:
                # A leased limit's quota is counted in its lease state: owed there.
                leases = self.leases
                if leases.plans:
                    leases.owed.add([c for c in checks if leases.leased(c.limit)])
                    checks = [c for c in checks if not leases.leased(c.limit)]
                self.owed.add(_charged_now(checks))
            return verdict
        if mode == "allow":
            self.counters.allowed_open += 1
            decisions = tuple(
                Decision(True, 0.0, 0.0, limit, limit, 0.0)
                for limit in (self.plan(check.limit).codec.nominal_limit for check in checks)
            )
            return CombinedDecision(True, 0.0, 0.0, (), None, decisions, (None,) * len(checks))
        self.counters.denied_closed += 1
        breaker = self.circuits.of(self._node_of_check(checks[0]) if checks else "")
        retry_after_s = max(breaker.retry_in_s, self.timeout_s)
        raise StoreUnavailableError(f"rate-limit store unavailable: {reason}", retry_after_s)


def _redis_py(
    url: str, cluster: bool, max_in_flight: int, timeout_s: float
) -> Redis | RedisCluster:
    """A redis-py client with its timeouts and pool set for the hot path: redis-py 8's pool
    raises rather than waits once its connections are busy, and its defaults (5 s, retries)
    could hold a request for seconds."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # No retry: a script call sent again after a lost connection or a timeout may have
        # run already, and would be charged twice. A dropped connection costs one failed call.
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        # One connection per pipeline in flight, and one for SCRIPT LOAD.
        "max_connections": max_in_flight + 1,
    }
    if cluster:
        return RedisCluster.from_url(url, **options)
    return Redis.from_url(url, **options)


def _charged_now(checks: Sequence[Check]) -> Sequence[Check]:
    """The checks an admission charges: not those of limits charged after the response that
    admit free (``hold: none``), nor concurrency limits (a slot is not a charge: the fallback
    holds its own, released in process, and none is owed to Redis)."""
    for check in checks:
        limit = check.limit
        if limit.admits_free or limit.holds_slots:
            return [c for c in checks if not c.limit.admits_free and not c.limit.holds_slots]
    return checks


def _penalty_argument(limit: CompiledLimit) -> bytes:
    """The limit's ``penalty:`` as the script reads it (b"": none, or a dry run's)."""
    penalty = limit.spec.penalty
    if penalty is None or limit.spec.dry_run:
        return b""
    box = PenaltyBox(penalty.after, penalty.within, penalty.block)
    return b"%d %d %d" % (box.after, box.within_us, box.block_us)


def _bound(max_delay_s: float) -> bytes:
    """A delay bound for the script: shortest exact decimal, or '' for none."""
    return b"" if max_delay_s == _INF else repr(float(max_delay_s)).encode()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}"


class StoreReplyError(RedisError):
    """A reply that is not the script's answer to this call: never read as a verdict."""


def _checked(reply: Any, call_id: int, length: int) -> list[int]:
    """The script's integers for call ``call_id``; ``StoreReplyError`` for anything else (a
    reply of another call, of another command, or of an older script)."""
    if (
        not isinstance(reply, list)
        or len(reply) != length + 1
        or {*map(type, reply)} != {int}  # every value an int (a bool is not)
    ):
        raise StoreReplyError(f"unexpected reply to script call {call_id}: {_sketch(reply)}")
    if reply[-1] != call_id:
        raise StoreReplyError(f"the reply to script call {reply[-1]} came for call {call_id}")
    del reply[-1]
    return reply


def _sketch(reply: Any) -> str:
    """A reply's shape for a log line (no values: they may be anything)."""
    if isinstance(reply, list):
        return f"a list of {len(reply)}"
    return type(reply).__name__


def _verdict(
    checks: Sequence[Check], plans: Sequence[LimitPlan], reply: Sequence[int]
) -> CombinedDecision:
    """The verdict the script reached, by the rule every store's verdict follows (``combine``):
    a delay over its check's bound refused (the script did not commit it either). It keeps
    the script's instant: a refund (a queued client left, a hold settled after the response)
    gives windows back exactly that charge."""
    decisions = [
        plan.codec.decision(*reply[base : base + 5])
        for plan, base in zip(plans, range(1, 5 * len(plans), 5), strict=True)
    ]
    if len(reply) > 1 + 5 * len(plans) and reply[1 + 5 * len(plans)]:
        return _penalized(decisions, reply[0], reply[1 + 5 * len(plans)] - 1, reply[-1])
    states = (None,) * len(decisions)  # the script committed them: nothing to store here
    return combine(decisions, states, states, reply[0], [check.max_delay_s for check in checks])


def _penalized(
    decisions: Sequence[Decision], now_us: int, index: int, until_us: int
) -> CombinedDecision:
    """The script refused the request: the key is in limit ``index``'s penalty box."""
    states: list[Any] = [None] * len(decisions)
    states[index] = PenaltyRefusal(until_us)
    retry_after_s = max(0.0, (until_us - now_us) / 1_000_000)
    return CombinedDecision(
        False, 0.0, retry_after_s, (index,), None, tuple(decisions), tuple(states), now_us
    )

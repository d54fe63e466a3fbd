"""The policy engine: which limits apply to a request, under which keys, and what to do about it.

Every applicable enforced limit is decided in one atomic store call (check all, then commit all or
nothing: nginx's multi-zone rule); dry-run limits are decided in calls of their own, sent at the
same time (one pipeline, no extra round trip), whose verdicts are only counted. A delayed request
waits in a bounded queue per limit; one that would wait too long, or find the queue full, is
rejected at once and its charge given back.

A concurrency limit's admitted request holds its slots (``Outcome.held``) until the proxy gives
them back (``release``). A request over a concurrency limit that lets requests wait joins the
key's line (``slot_lines.py``) charged to nothing, and is decided again, all its limits at
once, when it reaches the front and a slot frees (``wait_for_slot``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.combine import CombinedDecision
from gateway.algorithms.concurrency import Concurrency
from gateway.algorithms.penalty_box import PenaltyBox, PenaltyRefusal
from gateway.clock import MonotonicClock
from gateway.engine.delay_queue import DelayQueue, ShuttingDown
from gateway.engine.slot_lines import POLL_S, SlotLines, Ticket
from gateway.limits.compiled import NO_MODEL, Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder, RequestFacts
from gateway.limits.response_charge import ResponseCharge, settle
from gateway.limits.routing import CompiledMatch, compile_match
from gateway.limits.token_verifier import TokenRefused, TokenVerifier
from gateway.limits.usage import CUT, MAX_MODEL_CHARS, MODEL, UsageSource
from gateway.policy.models import (
    CUSTOM_PLAN,
    UNLISTED_PLAN,
    Access,
    LimitMatch,
    Policy,
    RateLimitHeaders,
    ReserveFrom,
    Route,
)
from gateway.policy.overrides import UnlistedKey, compile_tiering
from gateway.policy.rejections import RejectionTemplate
from gateway.redact import hashed
from gateway.stores import LimitStore, StoreUnavailableError
from gateway.stores.immediate import DecidesNow
from gateway.stores.penalty_table import PenaltyBoxes, PenaltyTable
from gateway.stores.shared.lmdb_store import SharedStore
from gateway.stores.shared.penalties import SharedPenaltyTable

AlgorithmFactory = Callable[[Any], Algorithm[Any]]
_ADVERTISED_MAX = 1024
_UNCAPPED = 1 << 62


class Outcome:
    """What the engine says about one request; the proxy turns it into a response.

    A plain class, not a dataclass: one is built for every limited request, and compiled, a
    dataclass's ``__init__`` is the one ``dataclasses`` writes at run time, interpreted."""

    __slots__ = (
        "charge_after",
        "charged_at",
        "checks",
        "delay_s",
        "held",
        "holds_places",
        "line_limit",
        "line_wait_s",
        "reason",
        "rejected_by",
        "retry_after_s",
        "status",
        "verdict",
        "waits_on",
        "would_reject",
    )

    def __init__(
        self,
        status: int = 0,
        delay_s: float = 0.0,
        retry_after_s: float = 0.0,
        rejected_by: str | None = None,
        reason: str = "",
        checks: Sequence[Check] = (),
        verdict: CombinedDecision | None = None,
        holds_places: bool = False,
        would_reject: Sequence[Check] = (),
        charge_after: Sequence[Check] = (),
        held: Sequence[Check] = (),
        charged_at: Sequence[int | None] = (),
        waits_on: Check | None = None,
    ) -> None:
        self.status = status  # 0: go ahead (after ``delay_s``); otherwise reject with this
        self.delay_s = delay_s
        self.retry_after_s = retry_after_s
        self.rejected_by = rejected_by
        self.reason = reason
        self.checks = checks
        self.verdict = verdict
        # True while ``checks`` hold their places against ``max_queue`` (until
        # ``enter_queue``).
        self.holds_places = holds_places
        # Dry-run checks that would have rejected this request: the keys a candidate limit
        # hits.
        self.would_reject = would_reject
        # Checks of limits charged after the response (``count:``, ``cost_header:``) that
        # admitted the request: ``charge_after`` charges them what the response says.
        self.charge_after = charge_after
        # The instant each of them was decided at (its verdict's ``now_us``): where the budget
        # a request in flight holds (``hold: in_flight``) is given back from.
        self.charged_at = charged_at
        # Concurrency checks whose slots this request holds until ``LimitEngine.release``.
        self.held = held
        # Over this concurrency check's limit, the request may wait in its line for a slot
        # (``LimitEngine.wait_for_slot``): neither admitted nor rejected yet.
        self.waits_on = waits_on
        # The concurrency limit whose line it waited in for a slot ("" if none), and how long:
        # the queue-wait metrics count it as they count a delay.
        self.line_limit = ""
        self.line_wait_s = 0.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _OUTCOME_FIELDS)
        return f"Outcome({fields})"


_OUTCOME_FIELDS: Final = (
    "status",
    "delay_s",
    "retry_after_s",
    "rejected_by",
    "reason",
    "checks",
    "verdict",
    "holds_places",
    "would_reject",
    "charge_after",
    "charged_at",
    "held",
    "waits_on",
    "line_limit",
    "line_wait_s",
)


ALLOW: Final = Outcome()
# What a key ``unlisted: reject`` refuses is answered with (an unknown client, not a busy one).
UNLISTED_STATUS: Final = 403


@dataclass(frozen=True, slots=True)
class LimitLook:
    """One limit as ``/explain`` shows it: whether it applies, under which key, and what it alone
    would say of the next request (``decision``), or why the store could not say (``unavailable``).
    """

    limit: CompiledLimit
    applies: bool
    key: str | None = None
    decision: Decision | None = None
    unavailable: str | None = None
    # The limit's ``exempt`` / ``exempt_headers`` / ``exempt_listed`` let this request through.
    exempt: bool = False
    # ``unlisted: reject`` refuses this request's key, or ``jwt`` its token.
    refused: str | None = None
    refused_status: int = 403
    # What this request would take from the quota (``cost``).
    cost: int = 1
    # Seconds until this key's block by the limit's ``penalty`` ends (``None``: not blocked).
    blocked_s: float | None = None


@dataclass(frozen=True, slots=True)
class Explanation:
    """What the engine would answer the next request (``outcome``, from ``evaluate`` itself),
    the access list that decided it (``"allow"``, ``"deny"`` or ``None``), and every limit."""

    outcome: Outcome
    access: str | None
    limits: tuple[LimitLook, ...]


def _compile_limit_match(match: LimitMatch) -> CompiledMatch | None:
    if (
        match.host is None
        and match.path is None
        and match.path_prefix is None
        and match.path_regex is None
        and match.methods is None
    ):
        return None
    return compile_match(match)


class Networks:
    """A CIDR list with a fast membership test for the common 'no list' case."""

    __slots__ = ("_networks",)

    def __init__(self, cidrs: Sequence[str]) -> None:
        self._networks = tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def contains(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(address in network for network in self._networks)


class LimitEngine:
    """All limits of one policy snapshot, bound to the store that holds their state."""

    def __init__(
        self,
        policy: Policy,
        store: LimitStore,
        build_algorithm: AlgorithmFactory,
        previous: LimitEngine | None = None,
    ) -> None:
        self.store = store
        # A store that decides every request without waiting (in process, shared) is called
        # directly, no coroutine per request: the proxy calls ``evaluate_now`` then.
        self._immediate: DecidesNow | None = store if isinstance(store, DecidesNow) else None
        self.decides_now = self._immediate is not None
        self.headers_config: RateLimitHeaders = policy.headers
        # Its three switches, read on every limited response: compiled, a field read each,
        # where the pydantic model's attribute is a generic lookup.
        self._ietf_headers = policy.headers.ietf
        self._x_ratelimit_headers = policy.headers.x_ratelimit
        self._retry_after_header = policy.headers.retry_after
        self._openai_headers = policy.headers.openai
        # The models a limit with ``cost_from`` labels its unit metrics with, at most.
        self._max_models = policy.server.metrics_max_models
        # ``headers.rejected_by``: the header naming the rejecting limit, encoded to its colon.
        named = policy.headers.rejected_by
        self._rejected_by_start: bytes | None = (
            named.encode("latin-1") + b": " if named is not None else None
        )
        # Each limit's header parts (``_Advertised``), the same on every response: by limit
        # name at the quota last advertised, and by (name, quota) for quotas that vary per key.
        self._advertised: dict[str, _Advertised] = {}
        self._advertised_by_quota: dict[tuple[str, int], _Advertised] = {}
        # The last several limits' block, for the two line objects it was made of.
        self._block_policy: bytes | None = None
        self._block_state: bytes | None = None
        self._block = b""
        access: Access = policy.access
        self.allow = Networks(access.allow)
        self.deny = Networks(access.deny)
        # Whether either access list has entries: one attribute read on the request path.
        self._screens = bool(self.allow) or bool(self.deny)
        # The request's token, verified once per token (``jwt:CLAIM`` parts, ``plan_from``).
        self.identity: TokenVerifier | None = _token_verifier(policy, store, previous)
        limits = _compiled_limits(policy, build_algorithm, previous, self.identity)
        self.limits: tuple[CompiledLimit, ...] = tuple(limits.values())
        # ``penalty:``: each limit's penalty boxes by key, kept over a reload while the
        # limit keeps its name and penalty: in process, or shared by the workers beside the
        # shared store's state. The Redis store keeps them itself, beside the limits' states,
        # looked up and struck in the script call that decides (``decides_penalties``).
        self.penalties_supported = not store.decides_penalties
        self.penalties, self._penalty_status = _penalty_tables(policy, store, previous)
        self._has_penalties = bool(self.penalties)
        # ``rejection:``: the limits whose rejections are answered the operator's way.
        self._rejections: dict[str, RejectionTemplate] = _rejection_templates(policy)
        # Limits charged after the response: whether any (the request path asks once), the
        # response headers their upstreams report costs in, and those removed before the
        # client sees them (unless ``keep_cost_header``).
        rules = [limit.response_charge for limit in self.limits]
        charged = [rule for rule in rules if rule is not None]
        self.counts_responses = bool(charged)
        self.cost_headers, self.hidden_headers, self.body_costs = _response_costs(charged)
        # Charges in flight to a store that is awaited (Redis): kept until done.
        self._charging: set[asyncio.Future[None]] = set()
        self.queue = DelayQueue()
        # Whether any limit holds slots: the request path skips everything about them if not.
        self.has_slots = any(limit.holds_slots for limit in self.limits)
        # Whether any limit's requests hold budget while in flight (``hold: in_flight``).
        self.holds_budget = any(limit.holds_budget for limit in self.limits)
        # Lines outlive a reload: a request of the old policy gives back a slot someone
        # waiting under the new one wants.
        self.slot_lines: SlotLines = previous.slot_lines if previous else SlotLines()
        self.ipv6_prefix = policy.ipv6_prefix
        # Whether a limit's key reads the request body (``body:FIELD``): the proxy then reads
        # a JSON body of at most ``body_key_max_size`` before the limits decide (larger:
        # refused with 413, or its parts absent, as ``body_key_too_large`` says).
        self.reads_body = any(
            part.startswith("body:") for limit in self.limits for part in limit.spec.key
        ) or any(isinstance(limit.spec.reserve, ReserveFrom) for limit in self.limits)
        self.body_key_max_size = policy.server.body_key_max_size
        self.body_key_rejects = policy.server.body_key_too_large == "reject"
        # False when there is nothing to evaluate, so the proxy skips the engine entirely.
        self.active = bool(limits) or bool(self.allow) or bool(self.deny)

    def checks_for(
        self, facts: RequestFacts, route: Route, host: str, path: str, *, reserve: bool = True
    ) -> tuple[list[Check], list[Check]]:
        """The (enforced, dry-run) checks that apply to a request; with ``reserve``, each enforced
        check with room in its queue holds a place there until ``_release``. ``route`` is the
        route ``facts.route`` names; the limits read the name from the facts."""
        enforced: list[Check] = []
        dry: list[Check] = []
        method = facts.method
        route_name = facts.route  # ``route``'s name
        for limit in self.limits:
            if not limit.applies(route_name, host, path, method):
                continue
            try:
                key = limit.keys.build(facts)
            except TokenRefused:
                if limit.dry_run:
                    continue  # a dry-run limit counts what it can, refuses nothing
                _release(enforced)
                raise
            if key is None:
                continue
            cost = 1
            tiering = limit.tiering
            if tiering is not None:
                try:
                    resolved = tiering.resolve(limit, key, facts)
                except TokenRefused:
                    if limit.dry_run:
                        continue
                    _release(enforced)
                    raise
                except UnlistedKey:
                    if limit.dry_run:
                        if reserve:  # counted only when the request is decided for real
                            limit.counters.dry_run_rejected += 1
                        continue
                    _release(enforced)
                    raise UnlistedKey(limit) from None
                if resolved is None:
                    continue  # exempt from this limit
                limit, key, cost = resolved
            if limit.dry_run:
                dry.append(Check(limit, key, cost=cost))
            else:
                if limit.queue_full():
                    enforced.append(Check(limit, key, 0.0, cost=cost))
                elif not reserve:
                    enforced.append(Check(limit, key, limit.max_delay, cost=cost))
                else:
                    limit.counters.deciding += 1
                    enforced.append(limit.reserved_check(key, cost))
        return enforced, dry

    def _checks_or_answer(
        self,
        facts: RequestFacts,
        route: Route,
        host: str,
        path: str,
        client_ip: str,
        commit: bool,
    ) -> Outcome | tuple[list[Check], list[Check]]:
        """The first half of ``evaluate`` and ``evaluate_now``, alike for both and never
        waiting: the request's checks (enforced, dry run), or the answer found before any limit
        is asked (an address screen, a key not listed, a refused token, a penalty)."""
        if self._screens:
            screened = self._screen(client_ip)
            if screened is not None:
                return screened
        try:
            checks = self.checks_for(facts, route, host, path, reserve=commit)
        # One name per type: compiled, a name several clauses bind takes the first's type.
        except UnlistedKey as unlisted:
            return _refuse_unlisted(unlisted.limit, commit)
        except TokenRefused as token_refused:
            return _refuse_token(token_refused)
        enforced = checks[0]
        if self._has_penalties and enforced:
            blocked = self._penalized(enforced, commit)
            if blocked is not None:
                _release(enforced)
                return blocked
        return checks

    async def evaluate(
        self,
        facts: RequestFacts,
        route: Route,
        host: str,
        path: str,
        client_ip: str,
        *,
        commit: bool = True,
    ) -> Outcome:
        """What to do with a request. ``commit=False`` is a look (``explain``): the same verdict,
        with nothing charged, counted or held, and no key moved in the store's LRU order."""
        if commit and self.decides_now:
            return self.evaluate_now(facts, route, host, path, client_ip)
        checks = self._checks_or_answer(facts, route, host, path, client_ip, commit)
        if isinstance(checks, Outcome):
            return checks
        enforced, dry = checks
        if not commit:
            return await self._enforce(enforced, commit=False) if enforced else ALLOW
        if not enforced:
            if dry:
                verdicts = await self.store.decide_each(dry)
                outcome = self._with_dry_run(ALLOW, dry, verdicts)
                if self.counts_responses:
                    outcome = _with_charge_after(outcome, (), dry, verdicts)
                return outcome
            return ALLOW
        try:
            behind = self._line_ahead(enforced) if self.slot_lines.waiting else None
            if behind is not None:
                outcome = self._join_line(behind, enforced)
                if dry:
                    outcome = self._with_dry_run(outcome, dry, await self.store.decide_each(dry))
            elif dry:
                # Both at once: with the Redis store their script calls go out in one
                # pipeline, so a dry-run limit adds no round trip to the request's wait.
                # Gathered from a list: ``gather`` returns a list where its stubs say a tuple
                # of two, which the compiled build checks and refuses.
                calls: list[Awaitable[object]] = [
                    self.store.decide_each(dry),
                    self._enforce(enforced),
                ]
                both = await asyncio.gather(*calls)
                verdicts = cast(list[CombinedDecision], both[0])
                outcome = cast(Outcome, both[1])
                outcome = self._with_dry_run(outcome, dry, verdicts)
                if self.counts_responses:
                    outcome = _with_charge_after(outcome, enforced, dry, verdicts)
            else:
                # Some requests are decided without a wait (a leased limit's unit at hand).
                verdict = self.store.try_decide_now(enforced)
                if verdict is not None:
                    outcome = self._settle(enforced, verdict, True)
                else:
                    outcome = await self._enforce(enforced)
                if self.counts_responses:
                    outcome = _with_charge_after(outcome, enforced, (), ())
        except BaseException:
            _release(enforced)
            raise
        return _hold_or_release(outcome, enforced)

    def evaluate_now(
        self, facts: RequestFacts, route: Route, host: str, path: str, client_ip: str
    ) -> Outcome:
        """``evaluate`` where the store decides without waiting (``decides_now``: in process,
        or the shared store): no coroutine per request, and nothing between the checks' places
        and the verdict. Compiled, 5,457 instructions a request under one limit, 13,879 under
        three (bench/README.md, "Fifth round")."""
        store = self._immediate
        assert store is not None
        checks = self._checks_or_answer(facts, route, host, path, client_ip, True)
        if isinstance(checks, Outcome):
            return checks
        enforced, dry = checks
        verdicts: list[CombinedDecision] | None = None
        try:
            # The dry-run limits first: a store error there comes before anything enforced
            # is charged.
            if dry:
                verdicts = [store.decide_now((check,)) for check in dry]
            if not enforced:
                outcome = ALLOW
            # Only a concurrency limit has a line: without one, ``SlotLines`` (interpreted)
            # is not asked.
            elif (
                self.has_slots
                and self.slot_lines.waiting
                and (behind := self._line_ahead(enforced)) is not None
            ):
                outcome = self._join_line(behind, enforced)
            else:
                outcome = self._settle(enforced, store.decide_now(enforced), True)
        except BaseException:
            _release(enforced)  # a store error: the places held for the queue go back
            if verdicts is not None and self.has_slots:  # and the dry-run slots taken
                store.release(
                    [
                        c
                        for c, v in zip(dry, verdicts, strict=True)
                        if v.allowed and c.limit.holds_slots
                    ]
                )
            raise
        if verdicts is not None:
            outcome = self._with_dry_run(outcome, dry, verdicts)
        if self.counts_responses:
            outcome = _with_charge_after(outcome, enforced, dry, verdicts or ())
        return _hold_or_release(outcome, enforced)

    def keys_pending(self, facts: RequestFacts) -> bool:
        """Whether the request's token names a key the JWKS lacks and a fetch may bring it:
        the proxy then awaits ``await_keys`` (bounded by ``jwt.jwks_timeout``) first."""
        identity = self.identity
        return identity is not None and identity.pending(facts) is not None

    async def await_keys(self, facts: RequestFacts) -> None:
        identity = self.identity
        if identity is None:
            return
        fetch = identity.pending(facts)
        if fetch is not None:
            await identity.wait_for_keys(facts, fetch)

    # -- penalties: keys a limit rejected too often, refused outright for a while --

    def _penalized(self, enforced: list[Check], commit: bool) -> Outcome | None:
        """A request one of whose keys is in its limit's penalty box: refused at once, the
        limits not asked (counted as the limit's ``penalized`` when ``commit``)."""
        penalties = self.penalties
        now_us = self.store.clock.now_us()
        for check in enforced:
            table = penalties.get(check.limit.name)
            if table is None:
                continue
            until_us = table.blocked_until(check.key, now_us)
            if until_us:
                return self._penalty_outcome(check, until_us, now_us, commit)
        return None

    def _penalty_outcome(self, check: Check, until_us: int, now_us: int, commit: bool) -> Outcome:
        """The refusal of a request whose key is in ``check``'s limit's penalty box."""
        name = check.limit.name
        if commit:
            check.limit.counters.penalized += 1
        return Outcome(
            status=self._penalty_status.get(name, check.limit.status),
            retry_after_s=max(0.0, (until_us - now_us) / 1_000_000),
            rejected_by=name,
            reason=f"the key is blocked by limit {name!r}'s penalty",
            checks=[check],
        )

    def _strike(self, enforced: list[Check], rejected_by: Sequence[int]) -> None:
        """Count a rejection against each rejecting limit's penalty box."""
        penalties = self.penalties
        now_us = 0
        for index in rejected_by:
            check = enforced[index]
            table = penalties.get(check.limit.name)
            if table is not None:
                now_us = now_us or self.store.clock.now_us()
                table.strike(check.key, now_us)

    def enable_penalties(self, name: str, status: int) -> None:
        """Look ``name``'s penalty table up on each request from now on (a block an operator
        put on a limit without ``penalty``), refusing with ``status``."""
        self._penalty_status.setdefault(name, status)
        self._has_penalties = True

    def penalty_until(self, limit: CompiledLimit, key: str) -> float | None:
        """Seconds until ``key``'s block by ``limit``'s penalty ends; ``None`` if not blocked."""
        table = self.penalties.get(limit.name)
        if table is None:
            return None
        now_us = self.store.clock.now_us()
        until_us = table.blocked_until(key, now_us)
        return (until_us - now_us) / 1_000_000 if until_us else None

    def _screen(self, client_ip: str) -> Outcome | None:
        """The access lists' word on a client, if they have one."""
        if self.deny and self.deny.contains(client_ip):
            return Outcome(status=403, reason="client address is denied")
        if self.allow and self.allow.contains(client_ip):
            return ALLOW
        return None

    async def explain(
        self, facts: RequestFacts, route: Route, host: str, path: str, client_ip: str
    ) -> Explanation:
        """What ``evaluate`` would answer now, and what each limit alone would say; commits
        nothing."""
        await self.await_keys(facts)
        outcome = await self.evaluate(facts, route, host, path, client_ip, commit=False)
        access = None
        if self.deny and self.deny.contains(client_ip):
            access = "deny"
        elif self.allow and self.allow.contains(client_ip):
            access = "allow"
        looks = []
        for limit in self.limits:
            if not limit.applies(facts.route, host, path, facts.method):
                looks.append(LimitLook(limit, applies=False))
                continue
            try:
                key = limit.keys.build(facts)
            except TokenRefused as refusal:
                looks.append(
                    LimitLook(
                        limit,
                        applies=True,
                        refused=refusal.reason,
                        refused_status=refusal.status,
                    )
                )
                continue
            if key is None:
                looks.append(LimitLook(limit, applies=True))
                continue
            cost = 1
            if limit.tiering is not None:
                try:
                    resolved = limit.tiering.resolve(limit, key, facts)
                except TokenRefused as refusal:
                    looks.append(
                        LimitLook(
                            limit,
                            applies=True,
                            key=key,
                            refused=refusal.reason,
                            refused_status=refusal.status,
                        )
                    )
                    continue
                except UnlistedKey:
                    refused = _refuse_unlisted(limit, False).reason
                    looks.append(LimitLook(limit, applies=True, key=key, refused=refused))
                    continue
                if resolved is None:
                    looks.append(LimitLook(limit, applies=True, key=key, exempt=True))
                    continue
                limit, key, cost = resolved
            try:
                verdict = await self.store.decide((Check(limit, key, cost=cost),), commit=False)
            except StoreUnavailableError as exc:  # on_failure: deny, and the store is down
                looks.append(LimitLook(limit, True, key, unavailable=str(exc), cost=cost))
                continue
            blocked_s = self.penalty_until(limit, key) if self._has_penalties else None
            blocked_by = verdict.states[0] if verdict.states else None
            if isinstance(blocked_by, PenaltyRefusal):  # the store's box (Redis)
                blocked_s = (blocked_by.until_us - (verdict.now_us or 0)) / 1_000_000
            looks.append(
                LimitLook(limit, True, key, verdict.decisions[0], cost=cost, blocked_s=blocked_s)
            )
        return Explanation(outcome, access, tuple(looks))

    async def _enforce(self, enforced: list[Check], *, commit: bool = True) -> Outcome:
        """Decide the enforced limits in one atomic store call (nginx's multi-zone rule)."""
        try:
            if commit and self.holds_budget:
                verdict = await self._decide_holding(enforced)
            else:
                verdict = await self.store.decide(enforced, commit=commit)
        except StoreUnavailableError as exc:
            # The operator chose to fail closed (on_failure: deny) and the store is down.
            return Outcome(
                status=503,
                retry_after_s=exc.retry_after_s,
                reason="rate-limit store unavailable",
            )
        return self._settle(enforced, verdict, commit)

    async def _decide_holding(self, enforced: list[Check]) -> CombinedDecision:
        """The store's verdict on a request whose limits hold budget while in flight. A
        client that leaves while the store decides (a Redis call in flight) leaves no hold
        behind: once the store answers, the holds it took are given back, and the slots."""
        deciding = asyncio.ensure_future(self.store.decide(enforced))
        try:
            return await asyncio.shield(deciding)
        except asyncio.CancelledError:
            deciding.add_done_callback(lambda done: self._abandoned(enforced, done))
            raise

    def _abandoned(self, enforced: list[Check], done: asyncio.Future[CombinedDecision]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        verdict = done.result()
        if not verdict.allowed:
            return
        slots = [check for check in enforced if check.limit.holds_slots]
        if slots:
            self.store.release(slots)
        holds = [check for check in enforced if check.limit.holds_budget]
        if holds and verdict.now_us is not None:
            task = asyncio.ensure_future(self.store.refund(holds, verdict.now_us))
            self._charging.add(task)
            task.add_done_callback(self._charging.discard)

    def _settle(
        self,
        enforced: list[Check],
        verdict: CombinedDecision,
        commit: bool,
        *,
        may_wait: bool = True,
    ) -> Outcome:
        """The outcome of the store's verdict, counted per limit when ``commit``; with
        ``may_wait``, a request only concurrency limits refuse may wait for a slot."""
        if not verdict.allowed:
            refusal = verdict.states[verdict.rejected_by[0]] if verdict.states else None
            if isinstance(refusal, PenaltyRefusal):  # the store looked the box up (Redis)
                now_us = verdict.now_us if verdict.now_us is not None else 0
                return self._penalty_outcome(
                    enforced[verdict.rejected_by[0]], refusal.until_us, now_us, commit
                )
            if may_wait and self.has_slots:
                waits_on = _slot_wait(enforced, verdict)
                if waits_on is not None:
                    return Outcome(
                        checks=enforced,
                        verdict=verdict,
                        waits_on=waits_on,
                        reason=f"waits for a slot of concurrency limit {waits_on.limit.name!r}",
                    )
            first = enforced[verdict.rejected_by[0]]
            if commit:
                for index in verdict.rejected_by:
                    rejecting = enforced[index].limit
                    rejecting.counters.reject(rejecting.status)
                if self._has_penalties:
                    self._strike(enforced, verdict.rejected_by)
            # Admitted by the algorithm but refused by its queue's bounds, or over the limit.
            queued = verdict.decisions[verdict.rejected_by[0]].allowed
            kind = "concurrency limit" if first.limit.holds_slots else "rate limit"
            return Outcome(
                status=first.limit.status,
                retry_after_s=verdict.retry_after_s,
                rejected_by=first.limit.name,
                reason=(
                    f"{kind} {first.limit.name!r} queue is full"
                    if queued
                    else f"{kind} {first.limit.name!r} exceeded"
                ),
                checks=enforced,
                verdict=verdict,
            )
        if commit:
            # By index, not ``zip(..., strict=True)``: compiled, a ``zip`` given a keyword is
            # a call into the interpreter's ``zip`` and its iterator (``enforced`` and the
            # decisions are one per check).
            decisions = verdict.decisions
            for index, check in enumerate(enforced):
                if decisions[index].delay_s > 0.0:
                    check.limit.counters.delayed += 1
                else:
                    check.limit.counters.allowed += 1
            if self.has_slots:
                held = _take_slots(enforced)
                if held:
                    return Outcome(
                        delay_s=verdict.delay_s, checks=enforced, verdict=verdict, held=held
                    )
        return Outcome(
            delay_s=verdict.delay_s,
            checks=enforced,
            verdict=verdict,
        )

    def _with_dry_run(
        self, outcome: Outcome, dry: list[Check], verdicts: Sequence[CombinedDecision]
    ) -> Outcome:
        """Count the dry-run verdicts into ``outcome``: the checks that would have rejected
        it, and the slots its dry-run concurrency limits took (given back at once if the
        request goes no further)."""
        would_reject = self._count_dry_run(dry, verdicts)
        held: list[Check] = []
        if self.has_slots:
            held = _take_slots(
                [c for c, v in zip(dry, verdicts, strict=True) if v.allowed and c.limit.holds_slots]
            )
        if not would_reject and not held:
            return outcome
        if outcome is ALLOW:
            outcome = Outcome()
        if would_reject:
            outcome.would_reject = would_reject
        if held:
            if outcome.status:
                self._give_slots_back(held)
            else:
                outcome.held = [*outcome.held, *held]
        return outcome

    # -- concurrency limits: slots held, and the lines that wait for them --

    def _line_ahead(self, enforced: list[Check]) -> Check | None:
        """A concurrency check of this request whose key has a line already: first come,
        first served, so the request goes behind it without taking a slot."""
        lines = self.slot_lines
        for check in enforced:
            if check.limit.holds_slots and lines.ahead(check.limit.table, check.key):
                return check
        return None

    def _join_line(self, check: Check, enforced: list[Check]) -> Outcome:
        """A newcomer behind a line: it waits (decided when it reaches the front), or, with no
        place left in the line, is rejected at once (charged to nothing)."""
        if check.max_delay_s > 0.0:
            return Outcome(
                checks=enforced,
                waits_on=check,
                reason=f"waits for a slot of concurrency limit {check.limit.name!r}",
            )
        reason = f"concurrency limit {check.limit.name!r} queue is full"
        return _slot_refused(check, enforced, reason, None)

    async def wait_for_slot(self, outcome: Outcome) -> Outcome:
        """Wait in line for the slot ``outcome.waits_on`` needs, then decide all the request's
        limits again: the outcome it ends with, admitted (holding its slots) or rejected (it
        waited ``max_delay``, or another limit refuses it now). A request cancelled while it
        waits (its client went away) leaves the line holding nothing; one the gateway's
        shutdown would cut off gets ``ShuttingDown``."""
        check = outcome.waits_on
        assert check is not None
        enforced = list(outcome.checks)
        loop = asyncio.get_running_loop()
        lines = self.slot_lines
        poll = self.store.slots_shared
        deadline = loop.time() + check.limit.spec.max_delay
        check.limit.counters.waiting += 1
        if outcome.holds_places:  # the places held while deciding: now one in the line
            outcome.holds_places = False
            _release(enforced)
        # Slots and holds its dry-run limits took go back now: the outcome it ends with is a
        # new one.
        self.release(outcome)
        self.give_back_holds(outcome)
        ticket = lines.join(check.limit.table, check.key)
        verdict = outcome.verdict
        joined_at = loop.time()
        try:
            while True:
                now = loop.time()
                if deadline > lines.closing_at:
                    raise ShuttingDown
                if now >= deadline:
                    refused = self._waited_too_long(check, enforced, verdict)
                    return _waited_in_line(refused, check, now - joined_at)
                woken = ticket.armed()
                if not woken.done():
                    timeout = deadline - now
                    if poll and timeout > POLL_S and lines.is_front(ticket):
                        timeout = POLL_S
                    await asyncio.wait((woken,), timeout=timeout)
                ticket.consume()
                if not lines.is_front(ticket) or deadline > lines.closing_at:
                    continue
                verdict = await self._decide_again(enforced)
                if verdict.allowed:
                    admitted = self._settle(enforced, verdict, True)
                    if self.counts_responses:
                        admitted = _with_charge_after(admitted, enforced, (), ())
                    return _waited_in_line(admitted, check, loop.time() - joined_at)
                blocking = _slot_wait(enforced, verdict)
                if blocking is None:  # another limit refuses it now: rejected, counted
                    refused = self._settle(enforced, verdict, True, may_wait=False)
                    return _waited_in_line(refused, check, loop.time() - joined_at)
                if blocking.limit.table != ticket.table or blocking.key != ticket.key:
                    # Another concurrency limit of the request is full now: its line.
                    ticket, check = self._move(ticket, check, blocking)
        finally:
            lines.leave(ticket)
            check.limit.counters.waiting -= 1

    def _move(self, ticket: Ticket, check: Check, to: Check) -> tuple[Ticket, Check]:
        lines = self.slot_lines
        lines.leave(ticket)
        check.limit.counters.waiting -= 1
        to.limit.counters.waiting += 1
        return lines.join(to.limit.table, to.key), to

    async def _decide_again(self, enforced: list[Check]) -> CombinedDecision:
        store = self._immediate
        if store is not None:
            return store.decide_now(enforced)
        return await self.store.decide(enforced)

    def _waited_too_long(
        self, check: Check, enforced: list[Check], verdict: CombinedDecision | None
    ) -> Outcome:
        reason = f"concurrency limit {check.limit.name!r}: no slot within max_delay"
        return _slot_refused(check, enforced, reason, verdict)

    def without_waiting(self, outcome: Outcome) -> Outcome:
        """``gateway replay``: a request that would wait in line for a slot, rejected as one
        that waited ``max_delay`` in vain (the replay does not follow the lines)."""
        check = outcome.waits_on
        assert check is not None
        if outcome.holds_places:
            outcome.holds_places = False
            _release(outcome.checks)
        self.give_back_holds(outcome)
        return self._waited_too_long(check, list(outcome.checks), outcome.verdict)

    def release(self, outcome: Outcome) -> None:
        """Give back the slots ``outcome`` holds (the response was sent, the client went away,
        the upstream failed, a WebSocket closed); once, however often called. The front of
        each key's line is woken once the store has them back."""
        held = outcome.held
        if not held:
            return
        outcome.held = ()
        self._give_slots_back(held)

    def _give_slots_back(self, held: Sequence[Check]) -> None:
        for check in held:
            check.limit.counters.slots_held -= check.cost
        done = self.store.release(held)
        if not self.slot_lines.waiting:
            return
        if done is None:
            self._wake(held)
        else:
            done.add_done_callback(lambda _: self._wake(held))

    def _wake(self, held: Sequence[Check]) -> None:
        lines = self.slot_lines
        for check in held:
            lines.wake(check.limit.table, check.key)

    def enter_queue(self, outcome: Outcome) -> asyncio.Future[None]:
        """Queue a delayed request: a future done when its delay is over, or failed with
        ``ShuttingDown`` if the gateway stops first.

        The caller awaits it in its own frame (a coroutine of ours in between would add some
        300 bytes to each waiting request), then calls ``leave_queue`` whatever happened, after
        ``give_back`` if the request does not go on.
        """
        self.take_places(outcome)
        return self.queue.enter(outcome.delay_s)

    def leave_queue(self, outcome: Outcome) -> None:
        self.queue.leave()
        self.free_places(outcome)

    def take_places(self, outcome: Outcome) -> None:
        """Count a delayed request as waiting in each queue it is delayed by (the places
        ``max_queue`` bounds), giving back the places held while it was decided.

        Apart from the loop's timer: ``gateway replay`` calls it, and ``free_places`` when the
        simulated delay ends, so its queues fill and drain by the live gateway's rules.
        """
        for check in _delaying(outcome):
            check.limit.counters.waiting += 1
        if outcome.holds_places:
            outcome.holds_places = False
            _release(outcome.checks)

    def free_places(self, outcome: Outcome) -> None:
        for check in _delaying(outcome):
            check.limit.counters.waiting -= 1

    def charge_after(
        self, outcome: Outcome, status: int, reported: dict[bytes, bytes] | None
    ) -> None:
        """Charge the limits counted by their responses what the response with ``status``
        (and the upstream's cost headers, ``reported``, by lower-case name) says, as much as
        each key has room for. A limit whose requests hold their cost while in flight
        (``hold: in_flight``) is settled instead: what it held beyond the charge is given
        back, what the charge is beyond the hold is taken (as much as there is room for).
        In process at once; otherwise in the background: the response never waits for it,
        and a charge the store cannot make follows ``on_failure`` there. A limit with
        ``cost_from`` counts its units by the model the answer named too (the metrics)."""
        checks: list[Check] = []
        units: list[int] = []
        kept: list[int] = []  # per charged check, the units its hold already took
        # per charged check, the model label its units count under (None: no cost_from)
        labels: list[str | None] = []
        refunds: list[tuple[Check, int]] = []
        instants = outcome.charged_at
        model = _model_named(reported)
        for index, check in enumerate(outcome.charge_after):
            limit = check.limit
            rule = limit.response_charge
            if rule is None:
                continue
            value = None
            if rule.source is not None and reported:
                raw = reported.get(rule.source)
                value = raw.decode("latin-1") if raw is not None else None
            cost = rule.charge(status, value, check.cost)
            counters = limit.counters
            label: str | None = None
            if rule.cost_from is not None:
                label = counters.model_label(model, self._max_models)
                if cost and reported and CUT in reported:
                    # The body was cut short: at least what the request holds (its reservation).
                    cost = max(cost, check.cost)
            if not limit.holds_budget:
                if cost > 0:
                    checks.append(check)
                    units.append(cost)
                    kept.append(0)
                    labels.append(label)
                continue
            top_up, give_back = settle(check.cost, cost)
            # A hold decided without an instant took nothing (Redis away, ``on_failure:
            # allow``): nothing to give back.
            at_us = instants[index] if index < len(instants) else None
            counters.held_units += check.cost
            if label is not None:
                _add(counters.held_by_model, label, check.cost)
            if give_back and at_us is not None:
                refunds.append((Check(limit, check.key, cost=give_back), at_us))
                counters.returned_units += give_back
                if label is not None:
                    _add(counters.returned_by_model, label, give_back)
            if top_up:
                checks.append(check)
                units.append(top_up)
                kept.append(check.cost)
                labels.append(label)
            elif cost > 0:  # what it held covers the charge
                counters.charged_responses += 1
                counters.charged_units += cost
                if label is not None:
                    _add(counters.charged_by_model, label, cost)
        if checks or refunds:
            self._send_charges(checks, units, kept, labels, refunds)

    def _send_charges(
        self,
        checks: list[Check],
        units: list[int],
        kept: list[int],
        labels: list[str | None],
        refunds: list[tuple[Check, int]],
    ) -> None:
        """Refunds, then charges, to the store: in process at once; otherwise in the
        background (the response never waits for them)."""
        store = self._immediate
        if store is not None:
            for group, at_us in _by_instant(refunds):
                store.refund_now(group, at_us)
            if checks:
                _count_charges(checks, store.charge_now(checks, units), kept, labels)
            return
        task = asyncio.ensure_future(self._charge(checks, units, kept, labels, refunds))
        self._charging.add(task)
        task.add_done_callback(self._charging.discard)

    def give_back_holds(self, outcome: Outcome) -> None:
        """A request that never reaches the upstream (refused by another limit, or gone from
        the shaping queue) gives back whole what its dry-run limits held for it: an enforced
        limit would have taken nothing (a refusal charges none, ``give_back`` refunds a
        queued request's enforced checks). Its charges after the response are dropped."""
        after = outcome.charge_after
        if not after:
            return
        outcome.charge_after = ()
        instants = outcome.charged_at
        enforced = outcome.checks
        refunds: list[tuple[Check, int]] = []
        for index, check in enumerate(after):
            limit = check.limit
            at_us = instants[index] if index < len(instants) else None
            if not limit.holds_budget or not check.cost or at_us is None:
                continue
            if any(check is taken for taken in enforced):
                continue
            refunds.append((check, at_us))
            counters = limit.counters
            counters.held_units += check.cost
            counters.returned_units += check.cost
            if limit.response_charge is not None and limit.response_charge.cost_from is not None:
                label = counters.model_label("", self._max_models)
                _add(counters.held_by_model, label, check.cost)
                _add(counters.returned_by_model, label, check.cost)
        if refunds:
            self._send_charges([], [], [], [], refunds)

    async def _charge(
        self,
        checks: list[Check],
        units: list[int],
        kept: list[int],
        labels: list[str | None],
        refunds: list[tuple[Check, int]],
    ) -> None:
        for group, at_us in _by_instant(refunds):
            await self.store.refund(group, at_us)
        if checks:
            _count_charges(checks, await self.store.charge(checks, units), kept, labels)

    async def charges_done(self) -> None:
        """Wait for the charges in flight (shutdown: before the store closes)."""
        while self._charging:
            await asyncio.gather(*self._charging, return_exceptions=True)

    async def give_back(self, outcome: Outcome) -> None:
        """Refund a queued request that will not go on (its client left, or shutdown), and
        give back the slots it holds."""
        self.release(outcome)
        charged_us = outcome.verdict.now_us if outcome.verdict is not None else None
        # A limit charged after the response that admits free took nothing: nothing to give.
        checks = [c for c in outcome.checks if not c.limit.holds_slots and not c.limit.admits_free]
        if checks:
            await asyncio.shield(self.store.refund(checks, charged_us))

    @staticmethod
    def _count_dry_run(dry: list[Check], verdicts: Sequence[CombinedDecision]) -> list[Check]:
        """Count what each dry-run limit would have done; the checks that would reject."""
        would_reject = []
        for check, verdict in zip(dry, verdicts, strict=True):
            decision = verdict.decisions[0]
            counters = check.limit.counters
            if not decision.allowed:
                counters.dry_run_rejected += 1
                would_reject.append(check)
            elif decision.delay_s > 0.0:
                counters.dry_run_delayed += 1
            else:
                counters.allowed += 1
        return would_reject

    def custom_rejection(self, outcome: Outcome) -> tuple[int, str, bytes] | None:
        """A rejection answered as its limit's (or the policy's) ``rejection:`` says: status,
        content type and body; ``None`` for the default problem+json."""
        rejections = self._rejections
        name = outcome.rejected_by
        if not rejections or name is None:
            return None
        template = rejections.get(name)
        if template is None:
            return None
        status = template.status or outcome.status
        retry_s = outcome.retry_after_s if math.isfinite(outcome.retry_after_s) else 0.0
        key = _rejecting_key(outcome)
        values = {
            "limit": name,
            "status": str(status),
            "retry_after": str(max(1, math.ceil(retry_s)) if retry_s > 0.0 else 0),
            "retry_after_ms": str(math.ceil(retry_s * 1000)),
            "key_hash": hashed(key) if key is not None else "-",
        }
        return status, template.content_type, template.render(values)

    def headers(self, outcome: Outcome) -> list[tuple[str, str]]:
        """``header_block`` as (name, value) pairs, for aiohttp's response objects (refusals,
        streamed answers)."""
        pairs: list[tuple[str, str]] = []
        for line in self.header_block(outcome).decode("latin-1").split("\r\n"):
            if line:
                name, _, value = line.partition(": ")
                pairs.append((name, value))
        return pairs

    def header_block(self, outcome: Outcome) -> bytes:
        """The rate-limit response headers for an outcome, as whole header lines (CRLF each):
        what a response copies into its head as it is; with ``headers.openai``, OpenAI's
        ``x-ratelimit-*-tokens`` and ``-requests`` after them."""
        block = self._limit_lines(outcome)
        if self._openai_headers and outcome.verdict is not None:
            return block + _openai_lines(outcome)
        return block

    def _limit_lines(self, outcome: Outcome) -> bytes:
        """The IETF, X-RateLimit and Retry-After lines of ``header_block``.

        Each limit's ``RateLimit-Policy`` item and the start of its ``RateLimit`` item are
        encoded once per limit and quota (``_Advertised``); a request formats only its own
        numbers, and a request under one limit joins its header lines in one step. Built on
        demand, not with the outcome: a request waiting in the queue should not hold its
        header bytes while it waits.
        """
        verdict = outcome.verdict
        retry_after = b""
        if outcome.status and self._retry_after_header:
            retry_after_s = outcome.retry_after_s
            if retry_after_s > 0.0:
                retry_after = b"Retry-After: %s\r\n" % _ascii(max(1, math.ceil(retry_after_s)))
        if outcome.status and self._rejected_by_start is not None:
            rejected_by = outcome.rejected_by
            if rejected_by is not None:  # a limit's name: ASCII, as the policy checked
                retry_after += b"%s%s\r\n" % (self._rejected_by_start, rejected_by.encode())
        ietf = self._ietf_headers
        x_ratelimit = self._x_ratelimit_headers
        if verdict is None or not (ietf or x_ratelimit):
            return retry_after
        checks = outcome.checks
        decisions = verdict.decisions
        rejecting = verdict.rejected_by if outcome.status else ()
        if len(checks) == 1:
            # The common case, one limit: its two lines by one bytes format, from the parts
            # encoded once (kept while its numbers repeat). Measured on the compiled build
            # (bench_instructions.py --requests 2000, callgrind, header_block inclusive per
            # request): 1,686 instructions, where the several limits' path below took 2,350
            # for one limit; 636 with the lines kept (bench/README.md, "Fifth round").
            limit = checks[0].limit
            if limit.holds_slots:  # a concurrency limit advertises no quota
                return retry_after
            decision = decisions[0]
            parts = self._advertised_parts(limit, decision.limit)
            if rejecting and 0 in rejecting:
                reset = _reset_header(decision, parts.window, True)
            else:
                reset = min(math.ceil(decision.reset_s), parts.window)
            remaining = decision.remaining
            if remaining < 0:
                remaining = 0
            if not x_ratelimit:
                if not retry_after:  # admitted: the two lines, the same as the last request's
                    return parts.lines(remaining, reset)  # when its numbers are
                return b"%s%s%s%s;t=%s\r\n" % (
                    retry_after,
                    parts.policy_line,
                    parts.state_line_start,
                    _ascii(remaining),
                    _ascii(reset),
                )
            x_lines = _x_ratelimit_lines(decision.limit, remaining, reset)
            if not ietf:
                return retry_after + x_lines
            return b"%s%s%s%s;t=%s\r\n%s" % (
                retry_after,
                parts.policy_line,
                parts.state_line_start,
                _ascii(remaining),
                _ascii(reset),
                x_lines,
            )
        return self._several_limits_lines(
            checks, decisions, rejecting, retry_after, ietf, x_ratelimit
        )

    def _several_limits_lines(
        self,
        checks: Sequence[Check],
        decisions: tuple[Decision, ...],
        rejecting: tuple[int, ...],
        retry_after: bytes,
        ietf: bool,
        x_ratelimit: bool,
    ) -> bytes:
        """``_limit_lines`` for a request under several limits."""
        # Several limits: each item joined on as it comes, and the X-RateLimit trio's limit
        # (the tightest: the first with the fewest remaining) found on the way.
        policy_line = state_line = b""
        tightest: Decision | None = None
        tightest_reset = 0
        for index, check in enumerate(checks):
            decision = decisions[index]
            limit = check.limit
            if limit.holds_slots:  # a concurrency limit advertises no quota
                continue
            parts = self._advertised_parts(limit, decision.limit)
            if rejecting and index in rejecting:
                reset = _reset_header(decision, parts.window, True)
            else:
                reset = min(math.ceil(decision.reset_s), parts.window)
            remaining = decision.remaining
            item = parts.state_item(remaining if remaining > 0 else 0, reset)
            if tightest is None:
                policy_line = parts.policy_item
                state_line = item
            else:
                policy_line = parts.policy_after(policy_line)
                state_line = parts.state_after(state_line, item)
            if tightest is None or remaining < tightest.remaining:
                tightest = decision
                tightest_reset = reset
        if tightest is None:
            return retry_after
        x_lines = b""
        if x_ratelimit:
            x_lines = _x_ratelimit_lines(tightest.limit, max(0, tightest.remaining), tightest_reset)
        if not ietf:
            return retry_after + x_lines
        if not retry_after and not x_lines:
            if policy_line is not self._block_policy or state_line is not self._block_state:
                self._block = b"RateLimit-Policy: %s\r\nRateLimit: %s\r\n" % (
                    policy_line,
                    state_line,
                )
                self._block_policy = policy_line
                self._block_state = state_line
            return self._block
        return b"%sRateLimit-Policy: %s\r\nRateLimit: %s\r\n%s" % (
            retry_after,
            policy_line,
            state_line,
            x_lines,
        )

    def _advertised_parts(self, limit: CompiledLimit, quota: int) -> _Advertised:
        """``limit``'s header parts at ``quota``, encoded on first use."""
        parts = self._advertised.get(limit.name)
        if parts is not None and parts.quota == quota:
            return parts
        by_quota = self._advertised_by_quota
        parts = by_quota.get((limit.name, quota))
        if parts is None:
            if len(by_quota) >= _ADVERTISED_MAX:  # quotas that vary per key: stay bounded
                by_quota.clear()
            parts = by_quota[limit.name, quota] = _Advertised(limit, quota)
        self._advertised[limit.name] = parts
        return parts


class _Advertised:
    """What one limit's rate-limit headers say at one quota on every response, encoded once:
    its ``RateLimit-Policy`` item (and the whole line, for a request under this limit alone),
    the start of its ``RateLimit`` item (and of the whole line), and its window in whole
    seconds."""

    __slots__ = (
        "_item",
        "_lines",
        "_policy_after",
        "_policy_joined",
        "_remaining",
        "_reset",
        "_state_after",
        "_state_item",
        "_state_joined",
        "policy_item",
        "policy_line",
        "quota",
        "state_line_start",
        "state_start",
        "window",
    )

    def __init__(self, limit: CompiledLimit, quota: int) -> None:
        window = max(1, math.ceil(limit.window_s))
        name = limit.name.encode("latin-1")
        self.quota = quota
        self.policy_item = b'"%s";q=%d;w=%d' % (name, quota, window)
        self.policy_line = b"RateLimit-Policy: " + self.policy_item + b"\r\n"
        self.state_start = b'"%s";r=' % name
        self.state_line_start = b"RateLimit: " + self.state_start
        # ``t`` counts to a calendar period's real end (a 31-day month, a 25-hour day), past
        # the nominal window it advertises.
        self.window = _UNCAPPED if limit.calendar else window
        # The last ``RateLimit`` item made (and the two lines of a request under this limit
        # alone), for the numbers it says: a key far from its limit, or many keys of a limit
        # that never binds, say the same numbers request after request (bench/README.md,
        # "Fifth round").
        self._remaining = -1
        self._reset = -1
        self._item = b""
        self._lines = b""
        # The several limits' lines joined up to this limit's item, for the line before it
        # (and this limit's item): each the same object while the numbers repeat, so a
        # request under several limits that do not bind joins nothing anew.
        self._policy_after: bytes | None = None
        self._policy_joined = b""
        self._state_after: bytes | None = None
        self._state_item = b""
        self._state_joined = b""

    def state_item(self, remaining: int, reset: int) -> bytes:
        """This limit's ``RateLimit`` item, ``"name";r=REMAINING;t=RESET``."""
        if remaining != self._remaining or reset != self._reset:
            self._item = b"%s%s;t=%s" % (self.state_start, _ascii(remaining), _ascii(reset))
            self._lines = b""
            self._remaining = remaining
            self._reset = reset
        return self._item

    def policy_after(self, line: bytes) -> bytes:
        """``line`` (the items of the limits before this one) and this limit's policy item."""
        if line is not self._policy_after:
            self._policy_joined = b"%s, %s" % (line, self.policy_item)
            self._policy_after = line
        return self._policy_joined

    def state_after(self, line: bytes, item: bytes) -> bytes:
        """``line`` (the ``RateLimit`` items before this one) and ``item``, this limit's."""
        if line is not self._state_after or item is not self._state_item:
            self._state_joined = b"%s, %s" % (line, item)
            self._state_after = line
            self._state_item = item
        return self._state_joined

    def lines(self, remaining: int, reset: int) -> bytes:
        """The ``RateLimit-Policy`` and ``RateLimit`` lines of a request under this limit alone."""
        item = self.state_item(remaining, reset)
        lines = self._lines
        if not lines:
            lines = self._lines = b"%sRateLimit: %s\r\n" % (self.policy_line, item)
        return lines


# The numbers a header says most often (remaining requests, seconds to reset), encoded once.
_SMALL_INTS: Final = tuple([b"%d" % number for number in range(1024)])


def _ascii(number: int) -> bytes:
    """``b"%d" % number``, from ``_SMALL_INTS`` when there."""
    if 0 <= number < 1024:
        return _SMALL_INTS[number]
    return b"%d" % number


def _openai_lines(outcome: Outcome) -> bytes:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-tokens`` (the limits that read their
    cost from the response body, ``cost_from``) and ``-requests`` (the other rate limits):
    each the figures of the limit of its kind with the fewest left; the reset as OpenAI
    writes it (``6m0s``, ``20ms``)."""
    verdict = outcome.verdict
    assert verdict is not None
    decisions = verdict.decisions
    rejecting = verdict.rejected_by if outcome.status else ()
    tightest: dict[bytes, tuple[Decision, float]] = {}
    for index, check in enumerate(outcome.checks):
        limit = check.limit
        if limit.holds_slots:
            continue
        rule = limit.response_charge
        kind = b"tokens" if rule is not None and rule.cost_from is not None else b"requests"
        decision = decisions[index]
        reset_s = decision.reset_s
        if index in rejecting:
            retry_s = decision.delay_s if decision.allowed else decision.retry_after_s
            reset_s = retry_s if math.isfinite(retry_s) else reset_s
        known = tightest.get(kind)
        if known is None or decision.remaining < known[0].remaining:
            tightest[kind] = (decision, reset_s)
    lines = []
    for kind, (decision, reset_s) in sorted(tightest.items(), reverse=True):
        lines.append(
            b"x-ratelimit-limit-%s: %d\r\nx-ratelimit-remaining-%s: %d\r\n"
            b"x-ratelimit-reset-%s: %s\r\n"
            % (
                kind,
                decision.limit,
                kind,
                max(0, decision.remaining),
                kind,
                _openai_duration(reset_s),
            )
        )
    return b"".join(lines)


def _openai_duration(seconds: float) -> bytes:
    """A duration as OpenAI's headers write it: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1.0:
        return b"%dms" % max(0, math.ceil(seconds * 1000.0))
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return b"%dh%dm%ds" % (hours, minutes, secs)
    if minutes:
        return b"%dm%ds" % (minutes, secs)
    return b"%ds" % secs


def _x_ratelimit_lines(limit: int, remaining: int, reset: int) -> bytes:
    return b"X-RateLimit-Limit: %d\r\nX-RateLimit-Remaining: %d\r\nX-RateLimit-Reset: %d\r\n" % (
        limit,
        remaining,
        reset,
    )


def _waited_in_line(outcome: Outcome, check: Check, waited_s: float) -> Outcome:
    """``outcome`` noted as having waited ``waited_s`` in ``check``'s line for a slot."""
    outcome.line_limit = check.limit.name
    outcome.line_wait_s = waited_s
    return outcome


def _slot_refused(
    check: Check, enforced: list[Check], reason: str, verdict: CombinedDecision | None
) -> Outcome:
    """A request refused by a concurrency limit's line (full, or waited ``max_delay`` in
    vain): rejected by that limit, counted there, charged to nothing."""
    limit = check.limit
    limit.counters.reject(limit.status)
    algorithm = limit.algorithm
    assert isinstance(algorithm, Concurrency)
    return Outcome(
        status=limit.status,
        retry_after_s=algorithm.retry_after_s,
        rejected_by=limit.name,
        reason=reason,
        checks=enforced,
        verdict=verdict,
    )


def _rejection_templates(policy: Policy) -> dict[str, RejectionTemplate]:
    """``rejection:``: the template each limit answers its rejections with, by limit name (a
    limit's own, else the policy's); a limit absent answers with the default problem+json."""
    default = RejectionTemplate(policy.rejection) if policy.rejection is not None else None
    templates: dict[str, RejectionTemplate] = {}
    for name, spec in policy.limits.items():
        own = RejectionTemplate(spec.rejection) if spec.rejection is not None else default
        if own is not None:
            templates[name] = own
    return templates


def _with_charge_after(
    outcome: Outcome,
    enforced: Sequence[Check],
    dry: Sequence[Check],
    dry_verdicts: Sequence[CombinedDecision],
) -> Outcome:
    """``outcome`` with the checks of limits charged after the response (``charge_after``,
    and the instant each was decided at): an admitted request's enforced ones, and the
    dry-run ones that would have admitted it (as an enforced limit would be charged)."""
    after: list[Check] = []
    instants: list[int | None] = []
    if not outcome.status:
        verdict = outcome.verdict
        at_us = verdict.now_us if verdict is not None else None
        for check in enforced:
            if check.limit.response_charge is not None:
                after.append(check)
                instants.append(at_us)
    for index, check in enumerate(dry):
        dry_verdict = dry_verdicts[index]
        if check.limit.response_charge is not None and dry_verdict.allowed:
            after.append(check)
            instants.append(dry_verdict.now_us)
    if not after:
        return outcome
    if outcome is ALLOW:
        outcome = Outcome()
    outcome.charge_after = after
    outcome.charged_at = instants
    return outcome


def _count_charges(
    checks: Sequence[Check],
    taken: Sequence[int],
    kept: Sequence[int],
    labels: Sequence[str | None],
) -> None:
    """Count each limit's charged responses and the units they took (``kept``: what a hold
    had taken already), by model for a limit with ``cost_from`` (``labels``)."""
    for index, check in enumerate(checks):
        counters = check.limit.counters
        counters.charged_responses += 1
        units = taken[index] + kept[index]
        counters.charged_units += units
        label = labels[index]
        if label is not None:
            _add(counters.charged_by_model, label, units)


def _add(counts: dict[str, int], label: str, units: int) -> None:
    counts[label] = counts.get(label, 0) + units


def _model_named(reported: dict[bytes, bytes] | None) -> str:
    """The model the response's body named (``MODEL``, filed by the relay or read from the
    access log's ``costs`` by a replay), or ``NO_MODEL``."""
    raw = reported.get(MODEL) if reported else None
    if raw is None:
        return NO_MODEL
    try:
        model = raw.decode("ascii")
    except UnicodeDecodeError:
        return NO_MODEL
    if len(model) > MAX_MODEL_CHARS or not model.isprintable():
        return NO_MODEL
    return model


def _by_instant(
    refunds: Sequence[tuple[Check, int]],
) -> list[tuple[list[Check], int]]:
    """Refunds grouped by the instant their holds were charged at (one store call each: a
    request's enforced limits share one, a dry-run limit has its own)."""
    groups: dict[int, list[Check]] = {}
    for check, at_us in refunds:
        group = groups.get(at_us)
        if group is None:
            groups[at_us] = [check]
        else:
            group.append(check)
    return [(group, at_us) for at_us, group in groups.items()]


def _token_verifier(
    policy: Policy, store: LimitStore, previous: LimitEngine | None
) -> TokenVerifier | None:
    """The policy's ``jwt:`` verifier (its key set kept from ``previous``), if it has one."""
    if policy.jwt is None:
        return None
    clock = store.clock
    return TokenVerifier(
        policy.jwt,
        wall_clock=(
            time.time if isinstance(clock, MonotonicClock) else lambda: clock.unix_us() / 1e6
        ),
        previous=previous.identity if previous is not None else None,
    )


def _compiled_limits(
    policy: Policy,
    build_algorithm: AlgorithmFactory,
    previous: LimitEngine | None,
    identity: TokenVerifier | None,
) -> dict[str, CompiledLimit]:
    """The policy's limits by name, ready to decide: each keeps its counters over a reload."""
    old = {limit.name: limit for limit in previous.limits} if previous else {}
    limits: dict[str, CompiledLimit] = {}
    jwt_of = identity.part if identity is not None else None

    def plan_part(name: str) -> Callable[[RequestFacts], str | None]:
        # Looked up per request: the limit named may come later in the file.
        return lambda facts: _plan_of(limits[name], facts)

    for name, spec in policy.limits.items():
        kept = old.get(name)
        limits[name] = CompiledLimit(
            name=name,
            spec=spec,
            algorithm=build_algorithm(spec),
            keys=KeyBuilder(spec.key, spec.on_missing_key, plan_part, jwt_of),
            match=_compile_limit_match(spec.match),
            routes=frozenset(spec.match.routes) if spec.match.routes is not None else None,
            window_s=spec.window_s,
            counters=kept.counters if kept is not None else LimitCounters(),
        )
    for limit in limits.values():
        listed_in = limit.spec.exempt_listed
        plan_from = limit.spec.plan_from
        limit.tiering = compile_tiering(
            limit,
            build_algorithm,
            _listed_in(limits[listed_in]) if listed_in else None,
            jwt_of(plan_from.jwt) if plan_from is not None and jwt_of is not None else None,
        )
    return limits


def _penalty_tables(
    policy: Policy, store: LimitStore, previous: LimitEngine | None
) -> tuple[dict[str, PenaltyBoxes], dict[str, int]]:
    """Each limit's penalty boxes by key (``penalty:``), and the status each refuses with:
    kept over a reload while the limit keeps its name and penalty, in process or shared by the
    workers beside the shared store's state (none where the store keeps them itself: Redis)."""
    shared_dir = store.path if isinstance(store, SharedStore) else None
    old_penalties = previous.penalties if previous is not None else {}
    penalties: dict[str, PenaltyBoxes] = {}
    for name, spec in policy.limits.items():
        penalty = spec.penalty
        if penalty is None or spec.dry_run or store.decides_penalties:
            continue
        box = PenaltyBox(penalty.after, penalty.within, penalty.block)
        kept_table = old_penalties.get(name)
        if kept_table is not None and (
            kept_table.box.after,
            kept_table.box.within_us,
            kept_table.box.block_us,
        ) == (box.after, box.within_us, box.block_us):
            kept_table.max_keys = spec.max_keys
            penalties[name] = kept_table
        elif shared_dir is not None:
            penalties[name] = SharedPenaltyTable(box, spec.max_keys, shared_dir, name)
        else:
            penalties[name] = PenaltyTable(box, spec.max_keys)
    penalty_status: dict[str, int] = {
        name: spec.penalty.status
        for name, spec in policy.limits.items()
        if spec.penalty is not None
    }
    # Keys an operator blocked (the keys' API) stay blocked while their limit exists.
    for name, table in old_penalties.items():
        still = policy.limits.get(name)
        if name in penalties or still is None or still.dry_run:
            continue
        if any(True for _ in table.blocked(store.clock.now_us())):
            penalties[name] = table
            penalty_status.setdefault(name, still.status)
    return penalties, penalty_status


def _response_costs(
    charged: list[ResponseCharge],
) -> tuple[frozenset[bytes], frozenset[bytes], tuple[UsageSource, ...]]:
    """For the limits charged after the response: the response headers their upstreams report
    costs in, those removed before the client sees them (unless ``keep_cost_header``), and the
    distinct ``cost_from`` sources their bodies are read for (none: the proxy reads no body)."""
    cost_headers = frozenset(
        rule.cost_header.encode() for rule in charged if rule.cost_header is not None
    )
    hidden_headers = frozenset(
        rule.cost_header.encode()
        for rule in charged
        if rule.cost_header is not None and not rule.keep_cost_header
    )
    sources: dict[str, UsageSource] = {}
    for rule in charged:
        if rule.cost_from is not None and rule.cost_from not in sources:
            sources[rule.cost_from] = UsageSource(rule.cost_from)
    return cost_headers, hidden_headers, tuple(sources.values())


def _plan_of(limit: CompiledLimit, facts: RequestFacts) -> str:
    """The plan ``limit``'s overrides give a request's key (``plan:LIMIT``): the plan's name,
    ``custom`` for a key with numbers of its own, ``unlisted`` for any other key or none."""
    tiering = limit.tiering
    if tiering is not None and tiering.plan_from is not None:
        plan = tiering.plan_from(facts)
        listed = (
            plan is not None
            and tiering.overrides is not None
            and (tiering.overrides.resolve(plan) is not None)
        )
        return plan if listed and plan is not None else UNLISTED_PLAN
    key = limit.keys.build(facts)
    if key is None or tiering is None or tiering.overrides is None:
        return UNLISTED_PLAN
    variant = tiering.overrides.resolve(key)
    if variant is None:
        return UNLISTED_PLAN
    tier = variant.table.partition("~")[2]
    return CUSTOM_PLAN if tier.startswith("=") else tier


def _listed_in(other: CompiledLimit) -> Callable[[RequestFacts], bool]:
    """Whether ``other``'s overrides list a request's key (``exempt_listed``)."""
    return lambda facts: _plan_of(other, facts) != UNLISTED_PLAN


def _refuse_unlisted(limit: CompiledLimit, commit: bool) -> Outcome:
    """A key ``unlisted: reject`` refuses: 403 naming the limit, counted as its rejection."""
    if commit:
        limit.counters.reject(UNLISTED_STATUS)
    return Outcome(
        status=UNLISTED_STATUS,
        rejected_by=limit.name,
        reason=f"the key is not listed by limit {limit.name!r} (unlisted: reject)",
    )


def _rejecting_key(outcome: Outcome) -> str | None:
    """The key of the check that rejected ``outcome`` (its limit's first)."""
    verdict = outcome.verdict
    checks = outcome.checks
    if verdict is not None and verdict.rejected_by:
        return checks[verdict.rejected_by[0]].key
    for check in checks:
        if check.limit.name == outcome.rejected_by:
            return check.key
    return None


def _refuse_token(refused: TokenRefused) -> Outcome:
    """A request whose token the policy refuses (``jwt.on_missing``/``on_invalid``: 401 or
    reject), before any limit is charged; ``reason`` names the cause, never the token."""
    return Outcome(status=refused.status, reason=refused.reason)


def _reset_header(decision: Decision, window_s: int, rejecting: bool) -> int:
    """``t`` of the RateLimit header, in whole seconds.

    For a limit that rejected the request it is that limit's own retry-after, so it agrees with
    ``Retry-After`` (the longest of the rejecting limits'). Otherwise it is the time until the
    quota is full again, at most the advertised window ``w``: a sliding window's weighted count
    takes up to two windows to decay to nothing, longer than the window it advertises.
    """
    if rejecting:
        # Admitted by the algorithm but refused by its queue's bounds: its delay is the wait.
        retry_s = decision.delay_s if decision.allowed else decision.retry_after_s
        if math.isfinite(retry_s):
            return max(1, math.ceil(retry_s))
    return min(math.ceil(decision.reset_s), window_s)


def _delaying(outcome: Outcome) -> Iterator[Check]:
    """The checks whose limit delays this request: the queues it counts as waiting in."""
    if outcome.verdict is None:
        return iter(())
    decisions = outcome.verdict.decisions
    return (c for c, d in zip(outcome.checks, decisions, strict=True) if d.delay_s > 0.0)


def _hold_or_release(outcome: Outcome, enforced: list[Check]) -> Outcome:
    """A delayed request keeps its checks' places until ``enter_queue`` turns them into places
    in the queue (the proxy calls it next, with no await in between); any other gives them
    back now."""
    if outcome.waits_on is None and (outcome.status or outcome.delay_s <= 0.0):
        # A list's loop, not ``_release``'s over a ``Sequence``: compiled, that one is Python's
        # iterator protocol (some 400 instructions a request).
        for check in enforced:
            if check.reserved:
                check.limit.counters.deciding -= 1
    else:
        outcome.holds_places = True
    return outcome


def _slot_wait(enforced: list[Check], verdict: CombinedDecision) -> Check | None:
    """The concurrency check whose line a rejected request may wait in: only concurrency
    limits refused it, the first of them lets requests wait (``max_delay``, with a place left
    in its line), and a slot could ever be enough (its cost is within the limit)."""
    rejected_by = verdict.rejected_by
    for index in rejected_by:
        if not enforced[index].limit.holds_slots:
            return None
    first = enforced[rejected_by[0]]
    if first.max_delay_s <= 0.0:
        return None
    if not math.isfinite(verdict.decisions[rejected_by[0]].retry_after_s):
        return None  # more slots than the limit has: no wait is long enough
    return first


def _take_slots(checks: Sequence[Check]) -> list[Check]:
    """The concurrency checks among an admitted request's: the slots it now holds."""
    held = [check for check in checks if check.limit.holds_slots]
    for check in held:
        check.limit.counters.slots_held += check.cost
    return held


def _release(checks: Sequence[Check]) -> None:
    """Give back the places ``checks_for`` held against each limit's ``max_queue``."""
    for check in checks:
        if check.reserved:
            check.limit.counters.deciding -= 1

"""The policy engine: which limits apply to a request, under which keys, and what to do about it.

Every applicable enforced limit is decided in one atomic store call (check all, then commit all or
nothing: nginx's multi-zone rule); dry-run limits are decided in calls of their own, sent at the
same time (one pipeline, no extra round trip), whose verdicts are only counted. A delayed request
waits in a bounded queue per limit; one that would wait too long, or find the queue full, is
rejected at once and its charge given back.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.algorithms.base import Algorithm, Decision
from gateway.algorithms.combine import CombinedDecision
from gateway.engine.delay_queue import DelayQueue
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder, RequestFacts
from gateway.limits.routing import CompiledMatch, compile_match
from gateway.policy.models import (
    Access,
    ConcurrencyLimit,
    LeakyBucketLimit,
    Limit,
    LimitMatch,
    Policy,
    RateLimitHeaders,
    Route,
    WindowLimit,
)
from gateway.policy.overrides import compile_tiering
from gateway.stores import LimitStore, StoreUnavailableError

AlgorithmFactory = Callable[[Any], Algorithm[Any]]
_ADVERTISED_MAX = 1024


@dataclass(slots=True)
class Outcome:
    """What the engine says about one request; the proxy turns it into a response."""

    status: int = 0  # 0: go ahead (after ``delay_s``); otherwise reject with this status
    delay_s: float = 0.0
    retry_after_s: float = 0.0
    rejected_by: str | None = None
    reason: str = ""
    checks: Sequence[Check] = ()
    verdict: CombinedDecision | None = None
    # True while ``checks`` hold their places against ``max_queue`` (until ``enter_queue``).
    holds_places: bool = False
    # Dry-run checks that would have rejected this request: the keys a candidate limit hits.
    would_reject: Sequence[Check] = ()


ALLOW = Outcome()


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
    # The limit's ``exempt`` / ``exempt_headers`` let this request through.
    exempt: bool = False
    # What this request would take from the quota (``cost``).
    cost: int = 1


@dataclass(frozen=True, slots=True)
class Explanation:
    """What the engine would answer the next request (``outcome``, from ``evaluate`` itself),
    the access list that decided it (``"allow"``, ``"deny"`` or ``None``), and every limit."""

    outcome: Outcome
    access: str | None
    limits: tuple[LimitLook, ...]


def _window_s(spec: Limit) -> float:
    """The window advertised in ``RateLimit-Policy`` (``w``): how long the quota takes to refill."""
    if isinstance(spec, WindowLimit):
        return float(spec.window)
    if isinstance(spec, ConcurrencyLimit):
        return 0.0  # slots are given back, not refilled: no quota is advertised for them
    quota = spec.burst + 1 if isinstance(spec, LeakyBucketLimit) else spec.burst
    return quota / spec.rate.per_second


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
        # The in-process store decides without waiting: called directly, no coroutine per request.
        self._decide_now: Callable[[Sequence[Check]], CombinedDecision] | None = getattr(
            store, "decide_now", None
        )
        # The proxy calls ``evaluate_now`` then, not ``evaluate``.
        self.decides_now = self._decide_now is not None
        # A store that decides some requests without a wait (leased limits) and the others
        # by a call: tried first on ``evaluate``'s path.
        self._try_decide_now: Callable[[Sequence[Check]], CombinedDecision | None] | None = getattr(
            store, "try_decide_now", None
        )
        self.headers_config: RateLimitHeaders = policy.headers
        # (limit name, advertised quota) -> the limit's RateLimit-Policy item, the start of its
        # RateLimit item, and its window in whole seconds: the same on every response.
        self._advertised: dict[tuple[str, int], tuple[str, str, int]] = {}
        access: Access = policy.access
        self.allow = Networks(access.allow)
        self.deny = Networks(access.deny)
        # Whether either access list has entries: one attribute read on the request path.
        self._screens = bool(self.allow) or bool(self.deny)
        old = {limit.name: limit for limit in previous.limits} if previous else {}
        limits = []
        for name, spec in policy.limits.items():
            kept = old.get(name)
            limit = CompiledLimit(
                name=name,
                spec=spec,
                algorithm=build_algorithm(spec),
                keys=KeyBuilder(spec.key, spec.on_missing_key),
                match=_compile_limit_match(spec.match),
                routes=frozenset(spec.match.routes) if spec.match.routes is not None else None,
                window_s=_window_s(spec),
                counters=kept.counters if kept is not None else LimitCounters(),
            )
            limit.tiering = compile_tiering(limit, build_algorithm)
            limits.append(limit)
        self.limits: tuple[CompiledLimit, ...] = tuple(limits)
        self.queue = DelayQueue()
        self.ipv6_prefix = policy.ipv6_prefix
        # False when there is nothing to evaluate, so the proxy skips the engine entirely.
        self.active = bool(limits) or bool(self.allow) or bool(self.deny)

    def checks_for(
        self, facts: RequestFacts, route: Route, host: str, path: str, *, reserve: bool = True
    ) -> tuple[list[Check], list[Check]]:
        """The (enforced, dry-run) checks that apply to a request; with ``reserve``, each enforced
        check with room in its queue holds a place there until ``_release``."""
        enforced: list[Check] = []
        dry: list[Check] = []
        method = facts.method
        for limit in self.limits:
            if not limit.applies(route, host, path, method):
                continue
            key = limit.keys.build(facts)
            if key is None:
                continue
            cost = 1
            tiering = limit.tiering
            if tiering is not None:
                resolved = tiering.resolve(limit, key, facts)
                if resolved is None:
                    continue  # exempt from this limit
                limit, cost = resolved
            spec = limit.spec
            if spec.dry_run:
                dry.append(Check(limit, key, cost=cost))
            else:
                if limit.queue_full():
                    enforced.append(Check(limit, key, 0.0, cost=cost))
                elif not reserve:
                    enforced.append(Check(limit, key, spec.max_delay, cost=cost))
                else:
                    limit.counters.deciding += 1
                    enforced.append(Check(limit, key, spec.max_delay, True, cost))
        return enforced, dry

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
        if self._screens:
            screened = self._screen(client_ip)
            if screened is not None:
                return screened
        enforced, dry = self.checks_for(facts, route, host, path, reserve=commit)
        if not commit:
            return await self._enforce(enforced, commit=False) if enforced else ALLOW
        if not enforced:
            if dry:
                would_reject = self._count_dry_run(dry, await self.store.decide_each(dry))
                if would_reject:
                    return Outcome(would_reject=would_reject)
            return ALLOW
        try:
            if dry:
                # Both at once: with the Redis store their script calls go out in one
                # pipeline, so a dry-run limit adds no round trip to the request's wait.
                verdicts, outcome = await asyncio.gather(
                    self.store.decide_each(dry), self._enforce(enforced)
                )
                would_reject = self._count_dry_run(dry, verdicts)
                if would_reject:
                    outcome.would_reject = would_reject
            else:
                at_hand = self._try_decide_now
                verdict = at_hand(enforced) if at_hand is not None else None
                if verdict is not None:
                    outcome = self._settle(enforced, verdict, True)
                else:
                    outcome = await self._enforce(enforced)
        except BaseException:
            _release(enforced)
            raise
        return _hold_or_release(outcome, enforced)

    def evaluate_now(
        self, facts: RequestFacts, route: Route, host: str, path: str, client_ip: str
    ) -> Outcome:
        """``evaluate`` where the store decides without waiting (``decides_now``: in process,
        or the shared store): no coroutine per request, and nothing between the checks' places
        and the verdict."""
        decide_now = self._decide_now
        assert decide_now is not None
        if self._screens:
            screened = self._screen(client_ip)
            if screened is not None:
                return screened
        enforced, dry = self.checks_for(facts, route, host, path)
        try:
            would_reject: list[Check] = []
            if dry:
                would_reject = self._count_dry_run(dry, [decide_now((check,)) for check in dry])
            if not enforced:
                return Outcome(would_reject=would_reject) if would_reject else ALLOW
            outcome = self._settle(enforced, decide_now(enforced), True)
        except BaseException:
            _release(enforced)  # a store error: the places held for the queue go back
            raise
        if would_reject:
            outcome.would_reject = would_reject
        return _hold_or_release(outcome, enforced)

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
        outcome = await self.evaluate(facts, route, host, path, client_ip, commit=False)
        access = None
        if self.deny and self.deny.contains(client_ip):
            access = "deny"
        elif self.allow and self.allow.contains(client_ip):
            access = "allow"
        looks = []
        for limit in self.limits:
            if not limit.applies(route, host, path, facts.method):
                looks.append(LimitLook(limit, applies=False))
                continue
            key = limit.keys.build(facts)
            if key is None:
                looks.append(LimitLook(limit, applies=True))
                continue
            cost = 1
            if limit.tiering is not None:
                resolved = limit.tiering.resolve(limit, key, facts)
                if resolved is None:
                    looks.append(LimitLook(limit, applies=True, key=key, exempt=True))
                    continue
                limit, cost = resolved
            try:
                verdict = await self.store.decide((Check(limit, key, cost=cost),), commit=False)
            except StoreUnavailableError as exc:  # on_failure: deny, and the store is down
                looks.append(LimitLook(limit, True, key, unavailable=str(exc), cost=cost))
                continue
            looks.append(LimitLook(limit, True, key, verdict.decisions[0], cost=cost))
        return Explanation(outcome, access, tuple(looks))

    async def _enforce(self, enforced: list[Check], *, commit: bool = True) -> Outcome:
        """Decide the enforced limits in one atomic store call (nginx's multi-zone rule)."""
        try:
            verdict = await self.store.decide(enforced, commit=commit)
        except StoreUnavailableError as exc:
            # The operator chose to fail closed (on_failure: deny) and the store is down.
            return Outcome(
                status=503,
                retry_after_s=exc.retry_after_s,
                reason="rate-limit store unavailable",
            )
        return self._settle(enforced, verdict, commit)

    def _settle(self, enforced: list[Check], verdict: CombinedDecision, commit: bool) -> Outcome:
        """The outcome of the store's verdict, counted per limit when ``commit``."""
        if not verdict.allowed:
            first = enforced[verdict.rejected_by[0]]
            if commit:
                for index in verdict.rejected_by:
                    enforced[index].limit.counters.rejected += 1
            # Admitted by the algorithm but refused by its queue's bounds, or over the limit.
            queued = verdict.decisions[verdict.rejected_by[0]].allowed
            return Outcome(
                status=first.limit.spec.status,
                retry_after_s=verdict.retry_after_s,
                rejected_by=first.limit.name,
                reason=(
                    f"rate limit {first.limit.name!r} queue is full"
                    if queued
                    else f"rate limit {first.limit.name!r} exceeded"
                ),
                checks=enforced,
                verdict=verdict,
            )
        if commit:
            for check, decision in zip(enforced, verdict.decisions, strict=True):
                if decision.delay_s > 0.0:
                    check.limit.counters.delayed += 1
                else:
                    check.limit.counters.allowed += 1
        return Outcome(
            delay_s=verdict.delay_s,
            checks=enforced,
            verdict=verdict,
        )

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

    async def give_back(self, outcome: Outcome) -> None:
        """Refund a queued request that will not go on (its client left, or shutdown)."""
        charged_us = outcome.verdict.now_us if outcome.verdict is not None else None
        await asyncio.shield(self.store.refund(outcome.checks, charged_us))

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

    def headers(self, outcome: Outcome) -> list[tuple[str, str]]:
        """The rate-limit response headers for an outcome.

        Built on demand, not with the outcome: a request waiting in the queue should not hold
        its header strings while it waits.
        """
        if outcome.verdict is None:
            return []
        checks = outcome.checks
        decisions = outcome.verdict.decisions
        retry_after_s = outcome.retry_after_s if outcome.status else 0.0
        config = self.headers_config
        headers: list[tuple[str, str]] = []
        if retry_after_s > 0.0 and config.retry_after:
            headers.append(("Retry-After", str(max(1, math.ceil(retry_after_s)))))
        if not (config.ietf or config.x_ratelimit):
            return headers
        rejecting = outcome.verdict.rejected_by if outcome.status else ()
        advertised = self._advertised
        policy_items: list[str] = []
        state_items: list[str] = []
        resets: list[int] = []
        for index, (check, decision) in enumerate(zip(checks, decisions, strict=True)):
            name = check.limit.name
            parts = advertised.get((name, decision.limit))
            if parts is None:
                if len(advertised) >= _ADVERTISED_MAX:  # quotas that vary per key: stay bounded
                    advertised.clear()
                window = max(1, math.ceil(check.limit.window_s))
                parts = advertised[name, decision.limit] = (
                    f'"{name}";q={decision.limit};w={window}',
                    f'"{name}";r=',
                    window,
                )
            policy_item, state_start, window = parts
            if rejecting and index in rejecting:
                reset = _reset_header(decision, window, True)
            else:
                reset = min(math.ceil(decision.reset_s), window)
            resets.append(reset)
            policy_items.append(policy_item)
            remaining = decision.remaining
            state_items.append(f"{state_start}{remaining if remaining > 0 else 0};t={reset}")
        if config.ietf:
            headers.append(("RateLimit-Policy", ", ".join(policy_items)))
            headers.append(("RateLimit", ", ".join(state_items)))
        if config.x_ratelimit:
            tightest = min(range(len(decisions)), key=lambda index: decisions[index].remaining)
            headers.append(("X-RateLimit-Limit", str(decisions[tightest].limit)))
            headers.append(("X-RateLimit-Remaining", str(max(0, decisions[tightest].remaining))))
            headers.append(("X-RateLimit-Reset", str(resets[tightest])))
        return headers


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
    if outcome.status or outcome.delay_s <= 0.0:
        _release(enforced)
    else:
        outcome.holds_places = True
    return outcome


def _release(checks: Sequence[Check]) -> None:
    """Give back the places ``checks_for`` held against each limit's ``max_queue``."""
    for check in checks:
        if check.reserved:
            check.limit.counters.deciding -= 1

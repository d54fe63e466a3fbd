"""A policy run over logged requests on a simulated clock: the live gateway's own decision path.

``Simulation`` holds what ``build_runtime`` builds for limits (a ``LimitEngine`` over a
``MemoryStore`` driven by a ``FakeClock``, the ``RouteTable``, the ``ClientIPResolver``) and
takes each request through the steps the proxy's ``_admit`` takes: route, resolve the client,
build the request's facts, ``LimitEngine.evaluate``. A delayed request takes its queue places
with ``LimitEngine.take_places`` and frees them with ``free_places`` when its simulated delay
ends; nothing sleeps. ``Tally`` counts what came of each request for the reports.
"""

from __future__ import annotations

import heapq
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy, MultiMapping
from yarl import URL

from gateway.algorithms.combine import CombinedDecision
from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.edge.client_ip import ClientIPResolver
from gateway.engine.limit_engine import LimitEngine, Outcome
from gateway.limits.keys import SEP, RequestFacts
from gateway.limits.routing import (
    RefusedTarget,
    RouteTable,
    normalise_host,
    origin_form,
    routing_path,
)
from gateway.policy.loader import LoadedPolicy
from gateway.policy.models import Policy, Route
from gateway.redact import hashed
from gateway.replay.log_formats import US, Request
from gateway.stores import MemoryStore, store_url

# What came of one request, beside the engine's own counters.
# Final: compiled, each is then a constant, not a lookup in the module's globals per request.
ALLOWED: Final = "allowed"  # every limit that applies admitted it at once
DELAYED: Final = "delayed"
REJECTED: Final = "rejected"
DENIED: Final = "denied"  # access.deny, or a method or target the proxy refuses
UNLIMITED: Final = "unlimited"  # routed, but no enforced limit applies (or access.allow)
UNROUTED: Final = "unrouted"  # no route: the proxy's 404

_EMPTY_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
# Resolved addresses kept by ``Simulation.client_ip`` before it starts afresh.
_PEERS_KEPT = 1 << 16
# Likewise routed request lines kept by ``Simulation.decide``.
_ROUTED_KEPT = 1 << 16
# Likewise what the engine is handed for each (client, request line, host) seen.
_FACTS_KEPT = 1 << 16
# ``Simulation._second_at`` before the first request, and ``_last_us`` likewise: no request's
# instant is this far back.
_NO_SECOND: Final = -(1 << 60)
_NO_INSTANT: Final = -(1 << 61)
# A request's route, host, routing path and facts; no route and no facts when none matches.
_Found = tuple[Route | None, str, str, RequestFacts | None]


@dataclass
class LimitTally:
    """One limit's figures over the replay."""

    name: str
    algorithm: str
    dry_run: bool
    delays_ms: array[float] = field(default_factory=lambda: array("d"))
    peak_queue: int = 0
    rejected_keys: Counter[str] = field(default_factory=Counter)
    # Per second of traffic: (allowed, delayed, rejected, dry_run_delayed, dry_run_rejected).
    series: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)


@dataclass
class Tally:
    """Counts over all requests, and per limit."""

    outcomes: Counter[str] = field(default_factory=Counter)
    rejected_by: Counter[str] = field(default_factory=Counter)
    delayed_by: Counter[str] = field(default_factory=Counter)
    delays_ms: array[float] = field(default_factory=lambda: array("d"))
    limits: dict[str, LimitTally] = field(default_factory=dict)
    first_us: int | None = None
    last_us: int | None = None
    # Per second of traffic: (requests, delayed, rejected).
    series: dict[int, list[int]] = field(default_factory=dict)
    # Concurrency limits: admitted requests whose log line had no duration (their slots were
    # given back at once), and requests that would have waited for a slot (counted rejected).
    slots_without_duration: int = 0
    slot_waits: int = 0


class Simulation:
    """One policy over one stream of requests, decided in the order given."""

    def __init__(self, loaded: LoadedPolicy, *, forwarded_for: bool = False) -> None:
        policy = with_hashed_aliases(loaded.policy)
        self.loaded = loaded
        self.clock = FakeClock(0)
        self.store = MemoryStore(self.clock)
        self.engine = LimitEngine(policy, self.store, build_algorithm)
        self.store.configure(self.engine.limits, ())
        self.routes = RouteTable(policy.routes)
        self.resolver = ClientIPResolver(
            policy.server.trusted_proxies, header=policy.server.client_ip_header
        )
        self.forwarded_for = forwarded_for
        # The shared store decides as one process does: only Redis is another story.
        self.live_store = store_url(policy.store) not in ("memory", "shared")
        self.matches_host = any(r.match.host is not None for r in policy.routes) or any(
            spec.match.host is not None for spec in policy.limits.values()
        )
        self.reads_query = any(
            part.startswith("query:") for spec in policy.limits.values() for part in spec.key
        )
        # Limits charged after the response: by the logged status, and those charging what
        # the upstream reported (cost_header), which only the gateway's own log records.
        self.counted_by_response = sorted(
            name for name, spec in policy.limits.items() if spec.charged_after
        )
        # (and cost_from: the usage a body reported, which the gateway's log records too)
        self.cost_header_limits = sorted(
            name
            for name, spec in policy.limits.items()
            if spec.cost_header is not None or spec.cost_from is not None
        )
        self.header_parts = sorted(
            {
                part
                for spec in policy.limits.values()
                for part in spec.key
                if ":" in part and part.split(":", 1)[0] in ("header", "query")
            }
        )
        # Each logged address as the resolver reads it (a pure function of the address when
        # no forwarding header is read), so a client seen again costs one dict lookup.
        self._peers: dict[str, str] = {}
        # What ``_route`` found for each (method, target, host) seen, likewise.
        self._routed: dict[tuple[str, str, str | None], tuple[str, str, str, Route | None]] = {}
        # What ``_facts_of`` found for each client and target seen, with the method and host
        # it was found for, likewise; ``_facts_kept`` counts them.
        self._facts: dict[str, dict[str, tuple[str, str | None, _Found]]] = {}
        self._facts_kept = 0
        # The engine's outcome for the request decided last (None: no limit was asked).
        self.last: Outcome | None = None
        self._waiting: list[tuple[int, int, Outcome]] = []
        # Admitted requests holding concurrency slots: (when their response ended, seq, outcome).
        self._holding: list[tuple[int, int, Outcome]] = []
        self.has_slots = self.engine.has_slots
        self._seq = 0
        self._second: int | None = None
        # The same second as a plain number (``_NO_SECOND`` when none): compared on every
        # request, where ``_second`` would box the request's second to compare it.
        self._second_at = _NO_SECOND
        self._per_second: list[int] = [0, 0, 0]  # (requests, delayed, rejected) this second
        # Requests of this second not yet added to ``_per_second[0]``, and what came of each
        # request not yet added to the tally's ``outcomes``: counted as plain numbers per
        # request, where a ``Counter`` (or a list) of boxed numbers is a lookup, an addition
        # and a store. ``tally`` adds them in before anyone reads it.
        self._second_requests = 0
        self._allowed = 0
        self._delayed = 0
        self._rejected = 0
        self._denied = 0
        self._unlimited = 0
        self._unrouted = 0
        self._last_us = _NO_INSTANT
        self._counted: dict[str, tuple[int, int, int, int, int]] = {}
        self._tally = Tally()
        for limit in self.engine.limits:
            self._tally.limits[limit.name] = LimitTally(
                limit.name, limit.spec.algorithm, limit.spec.dry_run
            )
            self._counted[limit.name] = (0, 0, 0, 0, 0)

    @property
    def tally(self) -> Tally:
        """The counts so far, the requests counted since last asked added in."""
        self._add_counts()
        return self._tally

    def _add_counts(self) -> None:
        """Add the requests counted as plain numbers into the tally (its outcomes hold
        what came of each request so far; a ``Counter`` keeps only what happened)."""
        tally = self._tally
        outcomes = tally.outcomes
        for what, count in (
            (ALLOWED, self._allowed),
            (DELAYED, self._delayed),
            (REJECTED, self._rejected),
            (DENIED, self._denied),
            (UNLIMITED, self._unlimited),
            (UNROUTED, self._unrouted),
        ):
            if count:
                outcomes[what] = count
        if self._last_us != _NO_INSTANT:
            tally.last_us = self._last_us
        if self._second_requests:
            self._per_second[0] += self._second_requests
            self._second_requests = 0

    def client_ip(self, request: Request) -> str:
        """The logged address as the gateway resolves a peer; with ``forwarded_for``, the
        forwarded-for field walked from the right past the policy's trusted proxies (the
        right-most entry in the place of a trusted peer)."""
        if self.forwarded_for and request.forwarded_for:
            hops = [hop.strip() for hop in request.forwarded_for.split(",")]
            return self.resolver.resolve(hops[-1], [", ".join(hops[:-1])] if len(hops) > 1 else [])
        address = request.address
        resolved = self._peers.get(address)
        if resolved is None:
            if len(self._peers) >= _PEERS_KEPT:
                self._peers.clear()
            resolved = self._peers[address] = self.resolver.resolve(address, ())
        return resolved

    def decide(self, request: Request, client_ip: str) -> str:
        """Decide one request at its instant; returns what came of it. Not a coroutine: the
        store is in process, so the engine decides at once (``evaluate_now``, what
        ``evaluate`` calls for such a store), with no coroutine object per request."""
        now_us = request.t_us
        waiting = self._waiting
        engine = self.engine
        while waiting and waiting[0][0] <= now_us:
            engine.free_places(heapq.heappop(waiting)[2])
        holding = self._holding
        while holding and holding[0][0] <= now_us:
            engine.release(heapq.heappop(holding)[2])
        if now_us // US != self._second_at:
            self._start_second(now_us)
        self.clock.set(now_us)
        self._last_us = now_us
        self._second_requests += 1

        self.last = None
        method = request.method
        if method == "CONNECT":
            self._denied += 1
            return DENIED
        route, host, path, facts = self._found(request, client_ip)
        if route is None or facts is None:
            if not path:  # a target refused (400) before routing, as the proxy refuses it
                self._denied += 1
                return DENIED
            self._unrouted += 1
            return UNROUTED
        if not engine.active:
            self._unlimited += 1
            return UNLIMITED
        outcome = self.last = engine.evaluate_now(facts, route, host, path, client_ip)
        if outcome.waits_on is not None:
            self._tally.slot_waits += 1
            outcome = self.last = engine.without_waiting(outcome)
        if outcome.held:
            self._hold_slots(outcome, now_us, request.duration_us)
        if outcome.status:
            engine.give_back_holds(outcome)  # it never reached the upstream
            if outcome.rejected_by is None:
                self._denied += 1
                return DENIED
            self._per_second[2] += 1
            self._count_rejection(outcome, outcome.rejected_by)
            self._rejected += 1
            return REJECTED
        if outcome.charge_after:
            # Charged what the logged response says, at once (the log has no response instant).
            engine.charge_after(outcome, request.status or 200, _reported(request.costs))
        verdict = outcome.verdict
        if verdict is None:
            self._unlimited += 1
            return UNLIMITED
        if outcome.delay_s > 0.0:
            self._per_second[1] += 1
            self._count_delay(outcome, verdict)
            self._seq += 1
            heapq.heappush(waiting, (now_us + round(outcome.delay_s * US), self._seq, outcome))
            self._delayed += 1
            return DELAYED
        self._allowed += 1
        return ALLOWED

    def _found(self, request: Request, client_ip: str) -> _Found:
        """What ``_facts_of`` finds for the request, found again for a client's request line
        and host seen before when the request has no headers: what the engine is handed is
        then a pure function of these. Kept by client, then by target: two lookups of
        strings whose hashes are kept, where one key of the four is a tuple made, hashed and
        freed per request."""
        if request.headers:
            return self._facts_of(request, client_ip)
        method = request.method
        target = request.target
        request_host = request.host
        by_target = self._facts.get(client_ip)
        if by_target is None:
            by_target = self._facts[client_ip] = {}
        kept = by_target.get(target)
        if (
            kept is not None
            and kept[0] == method
            and (kept[1] is request_host or kept[1] == request_host)
        ):
            return kept[2]
        found = self._facts_of(request, client_ip)
        if kept is None:
            if self._facts_kept >= _FACTS_KEPT:
                self._facts.clear()
                self._facts_kept = 0
                by_target = self._facts[client_ip] = {}
            self._facts_kept += 1
        by_target[target] = (method, request_host, found)
        return found

    def _count_rejection(self, outcome: Outcome, rejected_by: str) -> None:
        """Tally a request a limit rejected: by the limit, and by each rejecting key."""
        tally = self._tally
        tally.rejected_by[rejected_by] += 1
        verdict = outcome.verdict
        if verdict is not None:
            checks = outcome.checks
            indices = verdict.rejected_by or tuple(
                i for i, c in enumerate(checks) if c.limit.name == rejected_by
            )
            for index in indices:
                check = checks[index]
                tally.limits[check.limit.name].rejected_keys[check.key] += 1

    def _count_delay(self, outcome: Outcome, verdict: CombinedDecision) -> None:
        """Tally a delayed request (its wait, by limit, the queues' peaks) and take its places
        in the limits' queues."""
        tally = self._tally
        tally.delays_ms.append(outcome.delay_s * 1000.0)
        if verdict.delayed_by is not None:
            tally.delayed_by[outcome.checks[verdict.delayed_by].limit.name] += 1
        self.engine.take_places(outcome)
        for check, decision in zip(outcome.checks, verdict.decisions, strict=True):
            if decision.delay_s > 0.0:
                limit_tally = tally.limits[check.limit.name]
                limit_tally.delays_ms.append(decision.delay_s * 1000.0)
                limit_tally.peak_queue = max(limit_tally.peak_queue, check.limit.counters.waiting)

    def _hold_slots(self, outcome: Outcome, now_us: int, duration_us: int) -> None:
        """An admitted request holds its concurrency slots from its start, through its delay,
        for as long as the log says it took; without a duration, for no time at all."""
        if duration_us < 0:
            self._tally.slots_without_duration += 1
            self.engine.release(outcome)
            return
        self._seq += 1
        ends_us = now_us + round(outcome.delay_s * US) + duration_us
        heapq.heappush(self._holding, (ends_us, self._seq, outcome))

    def _start_second(self, now_us: int) -> None:
        """Close the second just ended; count from here in the one ``now_us`` falls in."""
        self._close_second()
        if self._second_requests:
            self._per_second[0] += self._second_requests
            self._second_requests = 0
        second = self._second = self._second_at = now_us // US
        tally = self._tally
        if tally.first_us is None:
            tally.first_us = now_us
        per_second = tally.series.get(second)
        if per_second is None:
            per_second = tally.series[second] = [0, 0, 0]
        self._per_second = per_second

    def _facts_of(self, request: Request, client_ip: str) -> _Found:
        """The route, host, routing path and facts the proxy's ``_admit`` hands the engine
        for this request."""
        method = request.method
        where = (method, request.target, request.host)
        routed = self._routed.get(where)
        if routed is None:
            if len(self._routed) >= _ROUTED_KEPT:
                self._routed.clear()
            routed = self._routed[where] = self._route(*where)
        host, path, target, route = routed
        if route is None:
            return None, host, path, None
        headers = (
            CIMultiDictProxy(CIMultiDict(request.headers)) if request.headers else _EMPTY_HEADERS
        )
        facts = RequestFacts.of(
            client_ip,
            self.engine.ipv6_prefix,
            route.name,
            method,
            headers,
            _query_of(target) if self.reads_query else _no_query,
        )
        return route, host, path, facts

    def _route(
        self, method: str, target: str, host_header: str | None
    ) -> tuple[str, str, str, Route | None]:
        """The request's host, routing path, target (origin form) and route, as the proxy
        finds them: a pure function of the request line and its host, so kept per line."""
        host = normalise_host(host_header)
        try:
            target = origin_form(target, method, host_header)
        except RefusedTarget:
            return host, "", target, None  # no routing path: answered 400 before routing
        path = routing_path(target)
        return host, path, target, self.routes.match(host, path, method)

    def _close_second(self) -> None:
        """Note each limit's counters' growth over the second just ended (the engine's own
        counters, dry-run verdicts included)."""
        if self._second is None:
            return
        for limit in self.engine.limits:
            c = limit.counters
            now = (c.allowed, c.delayed, c.rejected, c.dry_run_delayed, c.dry_run_rejected)
            before = self._counted[limit.name]
            if now != before:
                self._tally.limits[limit.name].series[self._second] = (
                    now[0] - before[0],
                    now[1] - before[1],
                    now[2] - before[2],
                    now[3] - before[3],
                    now[4] - before[4],
                )
                self._counted[limit.name] = now

    def finish(self) -> None:
        """Close the last second; requests still queued leave at the end of their delay."""
        self._close_second()
        self._add_counts()
        self._second = None
        self._second_at = _NO_SECOND
        while self._waiting:
            self.engine.free_places(heapq.heappop(self._waiting)[2])

    def counters(self) -> dict[str, dict[str, int]]:
        return {
            limit.name: {
                "allowed": limit.counters.allowed,
                "delayed": limit.counters.delayed,
                "rejected": limit.counters.rejected,
                "dry_run_delayed": limit.counters.dry_run_delayed,
                "dry_run_rejected": limit.counters.dry_run_rejected,
            }
            for limit in self.engine.limits
        }


# Key parts whose values the access log writes hashed (unless its ``raw`` names them).
_HASHED_PARTS: Final = ("header:", "query:")


def with_hashed_aliases(policy: Policy) -> Policy:
    """The policy with each value a limit looks a request header or query parameter up by
    (the overrides of a limit keyed on one, its ``exempt_headers``) listed by its hash too, as
    the gateway's access log writes such values (``sha256:`` and 12 hex digits): a replay of
    that log finds a key's plan, and an exempt client, by the hash, as the gateway did by the
    value."""
    limits: dict[str, Any] = {}
    for name, spec in policy.limits.items():
        update: dict[str, Any] = {}
        if spec.overrides and any(part.startswith(_HASHED_PARTS) for part in spec.key):
            overrides = dict(spec.overrides)
            for value, target in spec.overrides.items():
                overrides.setdefault(_hashed_key(spec.key, value), target)
            update["overrides"] = overrides
        if spec.exempt_headers:
            update["exempt_headers"] = {
                header: values + tuple(hashed(value) for value in values)
                for header, values in spec.exempt_headers.items()
            }
        if update:
            limits[name] = spec.model_copy(update=update)
    if not limits:
        return policy
    return policy.model_copy(update={"limits": {**policy.limits, **limits}})


def _hashed_key(parts: tuple[str, ...], value: str) -> str:
    """A key value as it is built from a log whose header values are hashed."""
    values = value.split(SEP) if len(parts) > 1 else [value]
    if len(values) != len(parts):
        return value
    return SEP.join(
        hashed(v) if part.startswith(_HASHED_PARTS) else v
        for part, v in zip(parts, values, strict=True)
    )


def _reported(costs: tuple[tuple[str, str], ...]) -> dict[bytes, bytes] | None:
    """A logged request's cost headers as the engine takes the upstream's."""
    if not costs:
        return None
    return {name.encode("latin-1"): value.encode("latin-1") for name, value in costs}


def _no_query() -> MultiMapping[str]:
    return _EMPTY_QUERY


_EMPTY_QUERY: MultiDictProxy[str] = MultiDictProxy(MultiDict())


def _query_of(target: str) -> Callable[[], MultiMapping[str]]:
    """The query a ``query:NAME`` key part reads, parsed only if one asks (as aiohttp does)."""

    def query() -> MultiMapping[str]:
        if "?" not in target:
            return MultiDictProxy(MultiDict())
        parsed: Any = URL(target, encoded=True).query
        return parsed  # type: ignore[no-any-return]

    return query

"""This worker's figures: the hot-path counters, and a snapshot of everything countable.

``ObservedHandler`` wraps the proxy handler: per request it reads what the proxy left on the
request (``hooks``), increments a few dict entries, and, only when the access log is on, has
it write the request's line (``access_log.py``). Everything else (limit decisions, queue depth,
tracked keys, connection counts, reload status) is already counted by the objects that own it
and is read only when a snapshot is taken, once a second and per scrape.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

from gateway.clock import Clock
from gateway.edge.annotations import UPSTREAM_ERROR_REASONS
from gateway.edge.pool.server_pool import FAILURE_REASONS
from gateway.edge.request_record import RequestRecord
from gateway.edge.upgrade_stats import UpgradeStats
from gateway.limits.compiled import ChargeCounts, Check, DecisionCounts
from gateway.limits.keys import shown_key
from gateway.observability.access_log import AccessLog
from gateway.observability.leases import lease_data
from gateway.observability.limit_log import LimitLog
from gateway.observability.process import read_process
from gateway.observability.sketch import RecentTopKeys
from gateway.observability.snapshot import (
    AdaptiveData,
    FailureData,
    HistogramData,
    HitterData,
    LimitData,
    ServerData,
    StoreData,
    UpgradeData,
    UpstreamData,
    WorkerSnapshot,
)
from gateway.observability.stats import (
    QUEUE_WAIT_BUCKETS,
    UNMATCHED_ROUTE,
    QueueWaits,
    RequestStats,
)
from gateway.policy.overrides import UNLISTED_KEY
from gateway.stores.store_stats import StoreStats

if TYPE_CHECKING:
    from gateway.edge.adaptive_gate import AdaptiveGate
    from gateway.edge.pool.server_pool import MemberState
    from gateway.edge.runtime import Runtime
    from gateway.engine.limit_engine import Outcome
    from gateway.policy.reload_status import ReloadStatus


# Keys kept per limit by the heavy-hitters sketch, and how many the dashboard shows.
TOP_KEYS_CAPACITY = 64
TOP_KEYS_SHOWN = 20
TOP_KEYS_PERIOD_S = 60.0


# Between a key and its tier in the top-keys sketch (a key shown never holds it).
TIER_SEP: Final = "\x1d"


def tier_of(check: Check) -> str:
    """The tier a check was decided under: a plan's name, ``custom`` for a key with numbers
    of its own, ``unlisted`` for the key ``unlisted: shared`` gives the others, or "" (the
    limit's own numbers)."""
    if check.key == UNLISTED_KEY:
        return "unlisted"
    tier = check.limit.table.partition("~")[2]
    return "custom" if tier.startswith("=") else tier


Counts = TypeVar("Counts", DecisionCounts, ChargeCounts)


def _blocked_now(runtime: Runtime, name: str) -> int | None:
    """The keys limit ``name``'s boxes block now (a penalty's or an operator's); None where
    the store keeps the boxes itself (Redis: nothing here counts them)."""
    engine = runtime.engine
    table = engine.penalties.get(name)
    if table is None:
        return None if engine.store.decides_penalties else 0
    return sum(1 for _ in table.blocked(engine.store.clock.now_us()))


class _RunningTotals(Generic[Counts]):
    """Totals of a limit's counts that can start again from zero (a limit a reload
    re-created), kept growing by adding each source's increase since it was last read."""

    __slots__ = ("_last", "_totals", "_zero")

    def __init__(self, zero: Counts) -> None:
        self._zero: Counts = zero
        self._last: dict[str, tuple[object, Counts]] = {}
        self._totals: dict[str, Counts] = {}

    def read(self, name: str, source: object, values: Counts) -> Counts:
        last = self._last.get(name)
        previous = last[1] if last is not None and last[0] is source else self._zero
        totals: Counts = type(self._zero)._make(
            total + max(0, value - before)
            for total, value, before in zip(
                self._totals.get(name, self._zero), values, previous, strict=True
            )
        )
        self._totals[name] = totals
        self._last[name] = (source, values)
        return totals


Label = TypeVar("Label", int, str)


class _KeyedTotals(Generic[Label]):
    """``_RunningTotals`` of a limit's counts by a label: its rejections by the status
    answered, its units by model."""

    __slots__ = ("_last", "_totals")

    def __init__(self) -> None:
        self._last: dict[str, tuple[object, dict[Label, int]]] = {}
        self._totals: dict[str, dict[Label, int]] = {}

    def read(self, name: str, source: object, values: dict[Label, int]) -> dict[Label, int]:
        last = self._last.get(name)
        previous: dict[Label, int] = last[1] if last is not None and last[0] is source else {}
        totals = dict(self._totals.get(name, {}))
        for label, value in values.items():
            totals[label] = totals.get(label, 0) + max(0, value - previous.get(label, 0))
        self._totals[name] = totals
        self._last[name] = (source, dict(values))
        return totals


class CurrentRuntime(Protocol):
    """Holds the runtime in force (the proxy handler does; a reload swaps it)."""

    @property
    def runtime(self) -> Runtime: ...


class ObservedProxy(CurrentRuntime, Protocol):
    """The proxy handler as the observer sees it: told about every finished request."""

    observer: Callable[[RequestRecord, int, float, Outcome | None], None] | None


class StoreFigures(Protocol):
    """What the metrics read from the limit store (``stores.LimitStore`` has it all)."""

    @property
    def name(self) -> str: ...
    @property
    def stats(self) -> StoreStats: ...
    def tracked_keys(self, limit_name: str) -> int: ...
    def evictions(self, limit_name: str) -> int: ...
    @property
    def verdicts_on_clock(self) -> bool: ...


class ConnectionCounts(Protocol):
    """The client listener's connection figures (``GatewayServer`` keeps them)."""

    @property
    def open_connections(self) -> int: ...
    @property
    def refused_connections(self) -> int: ...
    @property
    def header_timeouts(self) -> int: ...
    @property
    def upgrades(self) -> UpgradeStats: ...


class TlsFigures(Protocol):
    """The listener's TLS (``edge.tls.ListenerTls``): its certificate's expiry, its reloads."""

    @property
    def not_after(self) -> float: ...
    @property
    def reloads(self) -> dict[str, int]: ...


class ReloadSource(Protocol):
    """Whatever reloads the policy file and keeps the status of its attempts."""

    @property
    def status(self) -> ReloadStatus: ...


@dataclass(frozen=True, slots=True)
class WorkerState:
    """What a worker's figures are read from at snapshot time, as uvicorn hands its protocols a
    ``ServerState``: each part counts for itself, and the metrics read them, never the gateway."""

    worker_id: int
    current: CurrentRuntime
    store: StoreFigures
    connections: ConnectionCounts
    limiter_clock: Clock
    reloader: ReloadSource | None = None
    tls: TlsFigures | None = None


class WorkerMetrics:
    """What this worker counted, and what it reads from its parts at snapshot time."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.started_at = time.time()
        self.requests = RequestStats()
        self.queue_waits = QueueWaits()
        self.top_keys: dict[str, RecentTopKeys] = {}
        self._decisions = _RunningTotals(DecisionCounts())
        self._rejected_statuses: _KeyedTotals[int] = _KeyedTotals()
        self._charges = _RunningTotals(ChargeCounts())
        # Per limit with cost_from, its units by model: charged, held, returned.
        self._by_model: tuple[_KeyedTotals[str], _KeyedTotals[str], _KeyedTotals[str]] = (
            _KeyedTotals(),
            _KeyedTotals(),
            _KeyedTotals(),
        )

    def note_limited(self, outcome: Outcome) -> None:
        """Count the keys a rejected request was refused under, for the top-keys view."""
        verdict = outcome.verdict
        checks = outcome.checks
        if verdict is not None and not verdict.allowed:
            refused = [checks[index] for index in verdict.rejected_by]
        else:  # refused by a full queue: the verdict allowed it
            refused = [c for c in checks if c.limit.name == outcome.rejected_by]
        self.note_keys(refused)

    def note_keys(self, checks: Iterable[Check]) -> None:
        """Count the keys of checks that refused a request (or, dry-run, would have)."""
        for check in checks:
            sketch = self.top_keys.get(check.limit.name)
            if sketch is None:
                sketch = self.top_keys[check.limit.name] = RecentTopKeys(
                    TOP_KEYS_CAPACITY, TOP_KEYS_PERIOD_S
                )
            spec = check.limit.spec
            shown = shown_key(spec.key, check.key, plain=spec.top_keys == "plain")
            sketch.offer(shown + TIER_SEP + tier_of(check))

    def note_waited(self, outcome: Outcome, waited_s: float) -> None:
        verdict = outcome.verdict
        if verdict is None:
            return
        for check, decision in zip(outcome.checks, verdict.decisions, strict=False):
            if decision.delay_s > 0.0:
                self.queue_waits.observe(check.limit.name, waited_s)

    def rotate(self, now: float) -> None:
        for sketch in self.top_keys.values():
            sketch.rotate(now)

    def _limit_data(
        self, runtime: Runtime, store: StoreFigures
    ) -> tuple[dict[str, LimitData], dict[str, tuple[HitterData, ...]]]:
        """Each limit's figures, and its heaviest keys where they are tracked."""
        limits: dict[str, LimitData] = {}
        top_keys: dict[str, tuple[HitterData, ...]] = {}
        for limit in runtime.engine.limits:
            name = limit.name
            counters = limit.counters
            decided = self._decisions.read(name, counters, counters.decisions())
            charged = self._charges.read(name, counters, counters.charges())
            wait = self.queue_waits.by_limit.get(name)
            statuses = self._rejected_statuses.read(name, counters, counters.rejected_statuses)
            cost_from = limit.spec.cost_from is not None
            charged_by: dict[str, int] = {}
            held_by: dict[str, int] = {}
            returned_by: dict[str, int] = {}
            if cost_from:
                charged_totals, held_totals, returned_totals = self._by_model
                charged_by = charged_totals.read(name, counters, counters.charged_by_model)
                held_by = held_totals.read(name, counters, counters.held_by_model)
                returned_by = returned_totals.read(name, counters, counters.returned_by_model)
            limits[name] = LimitData(
                algorithm=limit.spec.algorithm,
                dry_run=limit.spec.dry_run,
                status=limit.status,
                rejected_statuses=statuses,
                **decided._asdict(),
                **charged._asdict(),
                cost_from=cost_from,
                charged_units_by_model=charged_by,
                held_units_by_model=held_by,
                returned_units_by_model=returned_by,
                evictions=store.evictions(name),
                waiting=counters.waiting,
                tracked_keys=store.tracked_keys(name),
                penalty=limit.spec.penalty is not None and not limit.spec.dry_run,
                blocked_keys=_blocked_now(runtime, name),
                slots_in_use=counters.slots_held,
                holds_budget=limit.holds_budget,
                units_in_flight=counters.units_in_flight,
                lease=lease_data(store, name),
                wait=HistogramData.of(wait)
                if wait is not None
                else HistogramData.empty(QUEUE_WAIT_BUCKETS),
            )
            sketch = self.top_keys.get(name)
            if sketch is not None:
                top_keys[name] = tuple(
                    HitterData(key=key, tier=tier, count=h.count, error=h.error)
                    for h in sketch.top(TOP_KEYS_SHOWN)
                    for key, _, tier in (h.key.partition(TIER_SEP),)
                )
        return limits, top_keys

    def snapshot(self, now: float) -> WorkerSnapshot:
        state = self.state
        runtime = state.current.runtime
        store = state.store
        # Every (route, reason) pair from the start, so a dashboard query finds the series.
        upstream_errors = dict.fromkeys(
            (
                (route.name, reason)
                for route in runtime.loaded.policy.routes
                for reason in UPSTREAM_ERROR_REASONS
            ),
            0,
        )
        upstream_errors.update(self.requests.upstream_errors)
        limits, top_keys = self._limit_data(runtime, store)
        stats = store.stats
        store_data = StoreData(
            name=store.name,
            state=stats.state,
            calls=stats.calls,
            errors=stats.errors,
            latency=HistogramData.of(stats.latency),
            transitions=dict(stats.transitions),
        )
        reload = state.reloader.status if state.reloader is not None else None
        tls = state.tls
        connections = state.connections
        upgrades = connections.upgrades
        return WorkerSnapshot(
            worker=state.worker_id,
            pid=os.getpid(),
            at=now,
            started_at=self.started_at,
            policy_sha256=runtime.loaded.sha256,
            policy_source=runtime.loaded.source,
            requests=tuple(
                (route, method, status_class, count)
                for (route, method, status_class), count in self.requests.requests.items()
            ),
            durations={route: HistogramData.of(h) for route, h in self.requests.durations.items()},
            upstream_errors=tuple(
                (route, reason, count) for (route, reason), count in upstream_errors.items()
            ),
            local_responses=tuple(
                (route, code, count) for (route, code), count in self.requests.local.items()
            ),
            policy_loaded_at=runtime.loaded_at,
            limited_requests=self.requests.limited,
            delayed_requests=self.requests.delayed,
            limits=limits,
            top_keys=top_keys,
            store=store_data,
            reload=reload,
            connections_open=connections.open_connections,
            connections_refused=connections.refused_connections,
            header_timeouts=connections.header_timeouts,
            websockets=UpgradeData(
                open=upgrades.open,
                total=upgrades.total,
                bytes_from_client=upgrades.bytes_from_client,
                bytes_from_upstream=upgrades.bytes_from_upstream,
                idle_timeouts=upgrades.idle_timeouts,
            ),
            process=read_process(),
            upstreams=_upstream_data(runtime),
            servers=server_data(runtime),
            retries=retry_counts(runtime),
            tls_not_after=tls.not_after if tls is not None else None,
            tls_reloads=dict(tls.reloads) if tls is not None else {},
            adaptive={
                name: adaptive_data(target.gate)
                for name, target in runtime.upstreams.items()
                if target.gate is not None
            },
        )


def adaptive_data(gate: AdaptiveGate) -> AdaptiveData:
    controller = gate.controller
    return AdaptiveData(
        limit=controller.limit,
        in_flight=controller.in_flight,
        waiting=gate.waiting,
        min_latency_s=controller.min_latency_us / 1e6,
        latency_s=controller.sample_latency_us / 1e6,
        shed=gate.shed,
        probes=controller.probes,
    )


def retry_counts(runtime: Runtime) -> tuple[tuple[str, str, int], ...]:
    """Retries by (upstream, reason), every pair from the start: a query finds the series."""
    counts = dict.fromkeys(
        ((name, reason) for name in runtime.upstreams for reason in FAILURE_REASONS), 0
    )
    counts.update(runtime.server_stats.retries)
    return tuple((u, r, n) for (u, r), n in counts.items())


def server_data(runtime: Runtime) -> tuple[ServerData, ...]:
    """Every server's counters this worker kept; state and in-flight of the pools in force."""
    live: dict[tuple[str, str], MemberState] = {}
    for name, target in runtime.upstreams.items():
        for member_state in target.pool.states():
            live[(name, member_state.server)] = member_state
    out = []
    for (upstream, server), stats in runtime.server_stats.servers.items():
        member = live.get((upstream, server))
        out.append(
            ServerData(
                upstream=upstream,
                server=server,
                state=member.state if member is not None else "",
                weight=member.weight if member is not None else 1,
                backup=member.backup if member is not None else False,
                inflight=member.inflight if member is not None else 0,
                requests=stats.requests,
                failures={reason: stats.failures.get(reason, 0) for reason in FAILURE_REASONS},
                ejections=stats.ejections,
                latency=HistogramData.of(stats.latency),
            )
        )
    return tuple(out)


def _upstream_data(runtime: Runtime) -> dict[str, UpstreamData]:
    """Each upstream's failures, by cause and the latest."""
    return {
        name: UpstreamData(
            url=target.config.url
            or ", ".join(server.url for server in target.config.server_list()),
            failures=dict(target.pool.failures.by_cause),
            recent=tuple(
                FailureData(
                    at=f.at,
                    server=f.server,
                    address=f.address,
                    cause=f.cause,
                    detail=f.detail,
                )
                for f in reversed(target.pool.failures.recent)
            ),
        )
        for name, target in runtime.upstreams.items()
    }


class ObservedHandler:
    """Counts each request the proxy handler finished; the handler calls ``finished``.

    The handler times the request itself (no wrapper coroutine: a request waiting in a shaping
    queue should not carry an extra frame), then hands over status, duration and the limits'
    outcome here.
    """

    __slots__ = ("_access_log", "_limit_log", "_metrics", "_proxy")

    def __init__(
        self,
        proxy: CurrentRuntime,
        metrics: WorkerMetrics,
        limit_log: LimitLog | None = None,
        access_log: AccessLog | None = None,
    ) -> None:
        self._proxy = proxy
        self._metrics = metrics
        self._limit_log = limit_log or LimitLog()
        self._access_log = access_log or AccessLog()

    def finished(
        self, request: RequestRecord, status: int, duration_s: float, outcome: Outcome | None
    ) -> None:
        metrics = self._metrics
        runtime = self._proxy.runtime
        route_name = request.route_name
        route = route_name if route_name is not None else UNMATCHED_ROUTE
        metrics.requests.record(route, request.method, status, duration_s)
        if outcome is not None:
            limit_log = self._limit_log
            if outcome.would_reject:
                metrics.note_keys(outcome.would_reject)
                for check in outcome.would_reject:
                    limit_log.would_reject(runtime, check, request, route)
            if outcome.rejected_by is not None:
                metrics.requests.limited += 1
                metrics.note_limited(outcome)
                limit_log.rejected(runtime, outcome, request, route)
            elif outcome.delay_s > 0.0 and not outcome.status:
                metrics.requests.delayed += 1
                metrics.note_waited(outcome, min(outcome.delay_s, duration_s))
                limit_log.delayed(runtime, outcome, request, route)
            if outcome.line_limit:  # in a concurrency limit's line for a slot
                metrics.queue_waits.observe(outcome.line_limit, outcome.line_wait_s)
        upstream_error = request.upstream_error if status >= 500 else None
        if upstream_error is not None:
            metrics.requests.upstream_error(route, upstream_error)
        if status >= 400 and (
            upstream_error is not None
            or route == UNMATCHED_ROUTE
            or (outcome is not None and outcome.status)
            or status == 499
            or request.local_answer
        ):
            metrics.requests.local_answer(route, status)
        access_log = self._access_log
        if access_log.on:
            state = metrics.state
            t_us = None
            if outcome is not None and state.store.verdicts_on_clock:
                verdict = outcome.verdict
                t_us = verdict.now_us if verdict is not None else None
            if t_us is None:  # not decided in process: when it arrived, on the same clock
                t_us = state.limiter_clock.now_us() - round(duration_s * 1_000_000)
            access_log.write(request, status, duration_s, route, outcome, upstream_error, t_us)

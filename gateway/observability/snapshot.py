"""One worker's figures at one instant, and their sum over all workers.

A snapshot is what a worker publishes for the others once a second (as JSON, through a shared
directory) and what ``/metrics`` and the dashboard are built from. Counters only grow (a worker
that restarts picks up its predecessor's totals), so their sum over workers is a Prometheus
counter; gauges (queue depth, tracked keys, open connections) are summed over live workers only.
"""

from __future__ import annotations

from collections import Counter
from typing import Self

from pydantic import BaseModel, ConfigDict

from gateway.edge.pool.server_pool import SERVER_LATENCY_BUCKETS
from gateway.histogram import Histogram
from gateway.limits.compiled import ChargeCounts, DecisionCounts
from gateway.observability.leases import LeaseData, plus
from gateway.observability.stats import QUEUE_WAIT_BUCKETS, REQUEST_DURATION_BUCKETS
from gateway.policy.reload_status import ReloadStatus
from gateway.stores.store_stats import STORE_LATENCY_BUCKETS

# Results of the ``gateway_limit_decisions_total`` counter: ``LimitData`` has a field of each name.
DECISION_RESULTS: tuple[str, ...] = DecisionCounts._fields
# What a limit charged after the response counts: ``LimitData`` has a field of each name.
CHARGE_COUNTS: tuple[str, ...] = ChargeCounts._fields
# ``LimitData``'s unit counts by model (gateway_limit_{charged,held,returned}_units_total).
UNITS_BY_MODEL: tuple[str, ...] = (
    "charged_units_by_model",
    "held_units_by_model",
    "returned_units_by_model",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HistogramData(_Model):
    """Non-cumulative bucket counts (the last is +Inf) and the sum of observations."""

    counts: tuple[int, ...]
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Self:
        return cls(counts=(0,) * (len(bounds) + 1))

    @classmethod
    def of(cls, histogram: Histogram) -> Self:
        return cls(counts=tuple(histogram.counts), total=histogram.total)

    def plus(self, other: HistogramData) -> HistogramData:
        if len(other.counts) != len(self.counts):
            return self  # another build's buckets: not addable, keep ours
        return HistogramData(
            counts=tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            total=self.total + other.total,
        )

    def minus(self, other: HistogramData) -> HistogramData:
        if len(other.counts) != len(self.counts):
            return self
        return HistogramData(
            counts=tuple(max(0, a - b) for a, b in zip(self.counts, other.counts, strict=True)),
            total=max(0.0, self.total - other.total),
        )

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float, bounds: tuple[float, ...]) -> float | None:
        """Prometheus ``histogram_quantile``: linear within the bucket; ``None`` if empty.

        A quantile in the +Inf bucket answers the highest finite bound, as Prometheus does.
        """
        total = self.count
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.counts):
            if seen + count >= rank and count > 0:
                if index == len(bounds):
                    return bounds[-1]
                lower = bounds[index - 1] if index > 0 else 0.0
                return lower + (bounds[index] - lower) * (rank - seen) / count
            seen += count
        return bounds[-1]


class LimitData(_Model):
    algorithm: str
    dry_run: bool
    status: int = 429  # what the limit answers a rejection with (unlisted: reject: 403)
    # ``rejected`` by the status answered (gateway_limit_rejections_total's status label).
    rejected_statuses: dict[int, int] = {}
    allowed: int = 0
    delayed: int = 0
    rejected: int = 0
    dry_run_delayed: int = 0
    dry_run_rejected: int = 0
    penalized: int = 0  # refused by the limit's penalty (a blocked key)
    # A limit charged after the response (count:, cost_header:).
    charged_responses: int = 0
    charged_units: int = 0
    charge_failures: int = 0
    # hold: in_flight: units held by requests in flight, and those given back at settling.
    held_units: int = 0
    returned_units: int = 0
    # A limit with cost_from: the three unit counts by the model label (summing to them).
    cost_from: bool = False
    charged_units_by_model: dict[str, int] = {}
    held_units_by_model: dict[str, int] = {}
    returned_units_by_model: dict[str, int] = {}
    evictions: int = 0
    waiting: int = 0  # gauge
    tracked_keys: int = 0  # gauge
    penalty: bool = False  # the limit has a penalty (enforced)
    # gauge: keys its boxes block now (the workers share theirs: the most any worker read);
    # None where the store keeps the boxes (Redis)
    blocked_keys: int | None = None
    slots_in_use: int = 0  # gauge: a concurrency limit's slots held by this process's requests
    # hold: in_flight (a limit charged after the response): the units its requests in flight
    # hold now (gauge)
    holds_budget: bool = False
    units_in_flight: int = 0
    wait: HistogramData = HistogramData.empty(QUEUE_WAIT_BUCKETS)
    lease: LeaseData | None = None  # a leased limit's leases (lease: on the Redis store)

    def decisions(self) -> DecisionCounts:
        return DecisionCounts(**{result: getattr(self, result) for result in DECISION_RESULTS})

    def by_model(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Units charged, held and returned, by model (a limit with cost_from)."""
        return (self.charged_units_by_model, self.held_units_by_model, self.returned_units_by_model)


class StoreData(_Model):
    name: str
    state: str = "ok"
    calls: int = 0
    errors: int = 0
    latency: HistogramData = HistogramData.empty(STORE_LATENCY_BUCKETS)
    # State changes, keyed "from>to" (see StoreStats.transitions).
    transitions: dict[str, int] = {}

    def plus(self, other: StoreData) -> StoreData:
        """The counters of both added up (``self``'s name and state kept)."""
        transitions = Counter(self.transitions)
        transitions.update(other.transitions)
        return self.model_copy(
            update={
                "calls": self.calls + other.calls,
                "errors": self.errors + other.errors,
                "latency": self.latency.plus(other.latency),
                "transitions": dict(transitions),
            }
        )


class UpgradeData(_Model):
    """Upgraded (WebSocket) connections: ``open`` a gauge, the rest counters."""

    open: int = 0
    total: int = 0
    bytes_from_client: int = 0
    bytes_from_upstream: int = 0
    idle_timeouts: int = 0

    def plus(self, other: UpgradeData, *, gauge: bool = True) -> UpgradeData:
        return UpgradeData(
            open=self.open + (other.open if gauge else 0),
            total=self.total + other.total,
            bytes_from_client=self.bytes_from_client + other.bytes_from_client,
            bytes_from_upstream=self.bytes_from_upstream + other.bytes_from_upstream,
            idle_timeouts=self.idle_timeouts + other.idle_timeouts,
        )


class ServerData(_Model):
    """One server of an upstream's pool, as one worker sees it: ``state``, ``inflight`` gauges
    (``state`` empty once the server left the pool), the rest counters."""

    upstream: str
    server: str
    state: str = ""
    weight: int = 1
    backup: bool = False
    inflight: int = 0
    requests: int = 0
    failures: dict[str, int] = {}
    ejections: int = 0
    latency: HistogramData = HistogramData.empty(SERVER_LATENCY_BUCKETS)

    @property
    def key(self) -> tuple[str, str]:
        return (self.upstream, self.server)

    def plus(self, other: ServerData) -> ServerData:
        """Counters of both added up (``self``'s gauges kept)."""
        failures = Counter(self.failures)
        failures.update(other.failures)
        return self.model_copy(
            update={
                "requests": self.requests + other.requests,
                "failures": dict(failures),
                "ejections": self.ejections + other.ejections,
                "latency": self.latency.plus(other.latency),
            }
        )


def _add_servers(
    into: dict[tuple[str, str], ServerData], servers: tuple[ServerData, ...], gauges: bool
) -> None:
    for server in servers:
        if not gauges:
            server = server.model_copy(update={"state": "", "inflight": 0})
        old = into.get(server.key)
        if old is None:
            into[server.key] = server
        else:
            summed = old.plus(server)
            if gauges and server.state:
                summed = summed.model_copy(
                    update={"state": server.state, "inflight": old.inflight + server.inflight}
                )
            into[server.key] = summed


class ProcessData(_Model):
    """One worker process's own figures (``process.PROCESS_FIGURES``), read from /proc."""

    worker: int
    pid: int
    figures: dict[str, float] = {}


class HitterData(_Model):
    key: str
    count: int
    error: int
    tier: str = ""  # the plan it was decided under ("" the limit's own numbers)


class FailureData(_Model):
    """One failed exchange with an upstream's server (``edge.upstream_failures.Failure``)."""

    at: float
    server: str
    address: str
    cause: str
    detail: str


class UpstreamData(_Model):
    """An upstream's failures since its settings last changed: counts by cause, the latest."""

    url: str  # its url, or its servers' URLs
    failures: dict[str, int] = {}
    recent: tuple[FailureData, ...] = ()  # newest first

    def plus(self, other: UpstreamData) -> UpstreamData:
        failures = Counter(self.failures)
        failures.update(other.failures)
        recent = sorted((*self.recent, *other.recent), key=lambda f: -f.at)[:RECENT_FAILURES]
        return self.model_copy(update={"failures": dict(failures), "recent": tuple(recent)})


class AdaptiveData(_Model):
    """An upstream's adaptive limit in one worker (each worker runs its own): ``limit``,
    ``in_flight``, ``waiting`` and the latencies are gauges (seconds; 0 before the first
    measurement), ``shed`` and ``probes`` counters."""

    limit: int = 0
    in_flight: int = 0
    waiting: int = 0
    min_latency_s: float = 0.0  # the latency measured with min_limit in flight
    latency_s: float = 0.0  # the last sample interval's (trimmed mean)
    shed: int = 0  # requests answered at once or after max_delay without a place
    probes: int = 0  # measurements of the minimum latency started

    def plus(self, other: AdaptiveData, *, gauges: bool = True) -> AdaptiveData:
        """Both added up: limits and requests summed (the whole gateway's), latencies the
        highest of the two (the worker that sees the upstream slowest); ``gauges`` False
        adds ``other``'s counters only."""
        if not gauges:
            return self.model_copy(
                update={"shed": self.shed + other.shed, "probes": self.probes + other.probes}
            )
        return AdaptiveData(
            limit=self.limit + other.limit,
            in_flight=self.in_flight + other.in_flight,
            waiting=self.waiting + other.waiting,
            min_latency_s=max(self.min_latency_s, other.min_latency_s),
            latency_s=max(self.latency_s, other.latency_s),
            shed=self.shed + other.shed,
            probes=self.probes + other.probes,
        )


# The recent failures kept per upstream (each worker keeps as many: the sum shows the newest).
RECENT_FAILURES = 10


class WorkerSnapshot(_Model):
    worker: int
    pid: int
    at: float  # wall-clock time the figures were read
    started_at: float
    policy_sha256: str
    policy_source: str
    policy_loaded_at: float = 0.0  # when the running policy was built (start-up or reload)
    # (route, method, status class, count)
    requests: tuple[tuple[str, str, int, int], ...] = ()
    limited_requests: int = 0  # refused by a limit
    delayed_requests: int = 0  # delayed by a limit
    durations: dict[str, HistogramData] = {}
    # (route, reason, count)
    upstream_errors: tuple[tuple[str, str, int], ...] = ()
    # (route, exact status, count) of the answers the gateway gave itself
    local_responses: tuple[tuple[str, int, int], ...] = ()
    limits: dict[str, LimitData] = {}
    top_keys: dict[str, tuple[HitterData, ...]] = {}
    store: StoreData
    websockets: UpgradeData = UpgradeData()
    process: dict[str, float] = {}  # gauges of this worker's process, read at ``at``
    reload: ReloadStatus | None = None
    connections_open: int = 0  # gauge
    connections_refused: int = 0
    header_timeouts: int = 0
    upstreams: dict[str, UpstreamData] = {}
    servers: tuple[ServerData, ...] = ()
    # (upstream, reason, count): requests sent on to another server of the pool
    retries: tuple[tuple[str, str, int], ...] = ()
    tls_not_after: float | None = None  # gauge: the listener certificate's expiry, Unix time
    tls_reloads: dict[str, int] = {}
    adaptive: dict[str, AdaptiveData] = {}  # per upstream with adaptive:

    def with_base(self, base: WorkerSnapshot) -> WorkerSnapshot:
        """These figures plus a previous incarnation's counters (gauges are ours alone)."""
        requests = Counter({(r, m, s): n for r, m, s, n in base.requests})
        requests.update({(r, m, s): n for r, m, s, n in self.requests})
        errors = Counter({(r, reason): n for r, reason, n in base.upstream_errors})
        errors.update({(r, reason): n for r, reason, n in self.upstream_errors})
        local = Counter({(r, code): n for r, code, n in base.local_responses})
        local.update({(r, code): n for r, code, n in self.local_responses})
        durations = dict(base.durations)
        for route, histogram in self.durations.items():
            old = durations.get(route)
            durations[route] = old.plus(histogram) if old is not None else histogram
        limits = {}
        for name, limit in self.limits.items():
            old_limit = base.limits.get(name)
            limits[name] = _add_limit_counters(limit, old_limit) if old_limit else limit
        store = self.store
        if base.store.name == store.name:
            store = store.plus(base.store)
        servers: dict[tuple[str, str], ServerData] = {}
        _add_servers(servers, self.servers, gauges=True)
        for old_server in base.servers:
            mine = servers.get(old_server.key)
            servers[old_server.key] = (
                mine.plus(old_server)
                if mine is not None
                else old_server.model_copy(update={"state": "", "inflight": 0})
            )
        retries = Counter({(u, r): n for u, r, n in base.retries})
        retries.update({(u, r): n for u, r, n in self.retries})
        tls_reloads = Counter(base.tls_reloads)
        tls_reloads.update(self.tls_reloads)
        adaptive = {
            name: (gate.plus(base.adaptive[name], gauges=False) if name in base.adaptive else gate)
            for name, gate in self.adaptive.items()
        }
        return self.model_copy(
            update={
                "servers": tuple(servers.values()),
                "retries": tuple((u, r, n) for (u, r), n in sorted(retries.items())),
                "tls_reloads": dict(tls_reloads),
                "adaptive": adaptive,
                "requests": tuple((r, m, s, n) for (r, m, s), n in sorted(requests.items())),
                "upstream_errors": tuple((r, x, n) for (r, x), n in sorted(errors.items())),
                "local_responses": tuple((r, c, n) for (r, c), n in sorted(local.items())),
                "durations": durations,
                "limits": limits,
                "store": store,
                "websockets": self.websockets.plus(base.websockets, gauge=False),
                "connections_refused": self.connections_refused + base.connections_refused,
                "header_timeouts": self.header_timeouts + base.header_timeouts,
                "limited_requests": self.limited_requests + base.limited_requests,
                "delayed_requests": self.delayed_requests + base.delayed_requests,
            }
        )


def _add_limit_counters(limit: LimitData, base: LimitData) -> LimitData:
    update: dict[str, object] = {
        result: getattr(limit, result) + getattr(base, result) for result in DECISION_RESULTS
    }
    for charged in CHARGE_COUNTS:
        update[charged] = getattr(limit, charged) + getattr(base, charged)
    statuses = dict(base.rejected_statuses)
    for status, count in limit.rejected_statuses.items():
        statuses[status] = statuses.get(status, 0) + count
    update["rejected_statuses"] = statuses
    for by_model in UNITS_BY_MODEL:
        units = Counter(getattr(base, by_model))
        units.update(getattr(limit, by_model))
        update[by_model] = dict(units)
    update["evictions"] = limit.evictions + base.evictions
    update["wait"] = limit.wait.plus(base.wait)
    update["lease"] = plus(limit.lease, base.lease)
    return limit.model_copy(update=update)


class GatewaySnapshot(_Model):
    """The whole gateway: every worker's snapshot added up."""

    at: float
    workers: int  # workers whose snapshot is fresh
    worker_ids: tuple[int, ...]
    policy_sha256: tuple[str, ...]  # more than one only while a reload is spreading
    policy_source: str
    policy_loaded_at: float
    requests: tuple[tuple[str, str, int, int], ...]
    durations: dict[str, HistogramData]
    upstream_errors: tuple[tuple[str, str, int], ...]
    local_responses: tuple[tuple[str, int, int], ...] = ()
    limited_requests: int = 0
    delayed_requests: int = 0
    limits: dict[str, LimitData]
    top_keys: dict[str, tuple[HitterData, ...]]
    store_name: str
    # state -> workers in it
    store_states: dict[str, int]
    store: StoreData
    reload: ReloadStatus | None
    connections_open: int
    connections_refused: int
    header_timeouts: int
    websockets: UpgradeData = UpgradeData()
    processes: tuple[ProcessData, ...] = ()  # of live workers
    upstreams: dict[str, UpstreamData] = {}  # those of the newest policy
    # every server's counters (summed) and inflight (live workers'), state of the newest worker
    servers: tuple[ServerData, ...] = ()
    # (upstream, server, state, live workers that see it so)
    server_states: tuple[tuple[str, str, str, int], ...] = ()
    retries: tuple[tuple[str, str, int], ...] = ()
    tls_not_after: float | None = None  # the soonest of the live workers'
    tls_reloads: dict[str, int] = {}
    # per upstream with adaptive: (those of the newest policy), summed over live workers
    adaptive: dict[str, AdaptiveData] = {}


def merge(snapshots: list[WorkerSnapshot], now: float, fresh_s: float = 5.0) -> GatewaySnapshot:
    """Add up counters of every snapshot, gauges of those read in the last ``fresh_s``.

    A worker that died keeps its counters in the sum (as prometheus-client's multiprocess mode
    keeps a dead process's counters), so the gateway's counters never go down.
    """
    if not snapshots:
        raise ValueError("no snapshot to merge")
    newest = max(snapshots, key=lambda s: s.at)
    live = [s for s in snapshots if now - s.at <= fresh_s] or [newest]
    live_ids = {id(s) for s in live}
    requests: Counter[tuple[str, str, int]] = Counter()
    errors: Counter[tuple[str, str]] = Counter()
    local: Counter[tuple[str, int]] = Counter()
    websockets = UpgradeData()
    durations: dict[str, HistogramData] = {}
    limits: dict[str, LimitData] = {}
    hitters: dict[str, Counter[str]] = {}
    hitter_errors: dict[str, Counter[str]] = {}
    hitter_tiers: dict[str, dict[str, str]] = {}
    store = StoreData(name=newest.store.name)
    servers: dict[tuple[str, str], ServerData] = {}
    server_states: Counter[tuple[str, str, str]] = Counter()
    retries: Counter[tuple[str, str]] = Counter()
    tls_reloads: Counter[str] = Counter()
    for snap in sorted(snapshots, key=lambda s: s.at):  # the newest's gauges kept last
        live_one = id(snap) in live_ids
        _add_servers(servers, snap.servers, gauges=live_one)
        if live_one:
            server_states.update((s.upstream, s.server, s.state) for s in snap.servers if s.state)
        retries.update({(u, r): n for u, r, n in snap.retries})
        tls_reloads.update(snap.tls_reloads)
    current = {s.key for s in newest.servers if s.state}
    tls_expiries = [s.tls_not_after for s in live if s.tls_not_after is not None]
    for snap in snapshots:
        requests.update({(r, m, s): n for r, m, s, n in snap.requests})
        errors.update({(r, reason): n for r, reason, n in snap.upstream_errors})
        local.update({(r, code): n for r, code, n in snap.local_responses})
        websockets = websockets.plus(snap.websockets, gauge=id(snap) in live_ids)
        for route, histogram in snap.durations.items():
            old = durations.get(route)
            durations[route] = old.plus(histogram) if old is not None else histogram
        for name, limit in snap.limits.items():
            gauges: dict[str, int | None]
            if id(snap) in live_ids:
                gauges = {
                    "waiting": limit.waiting,
                    "tracked_keys": limit.tracked_keys,
                    "slots_in_use": limit.slots_in_use,
                    "units_in_flight": limit.units_in_flight,
                }
            else:  # a worker gone: its gauges count no more
                gauges = {
                    "waiting": 0,
                    "tracked_keys": 0,
                    "slots_in_use": 0,
                    "units_in_flight": 0,
                    "blocked_keys": None,
                }
            counted = limit.model_copy(update=gauges)
            old_limit = limits.get(name)
            if old_limit is None:
                limits[name] = counted
            else:
                summed = _add_limit_counters(counted, old_limit)
                limits[name] = summed.model_copy(
                    update={
                        "waiting": old_limit.waiting + counted.waiting,
                        "tracked_keys": old_limit.tracked_keys + counted.tracked_keys,
                        "slots_in_use": old_limit.slots_in_use + counted.slots_in_use,
                        "units_in_flight": old_limit.units_in_flight + counted.units_in_flight,
                        "blocked_keys": _most(old_limit.blocked_keys, counted.blocked_keys),
                        "penalty": old_limit.penalty or counted.penalty,
                    }
                )
        for name, top in snap.top_keys.items():
            if id(snap) not in live_ids:
                continue
            counts = hitters.setdefault(name, Counter())
            errs = hitter_errors.setdefault(name, Counter())
            tiers = hitter_tiers.setdefault(name, {})
            for hitter in top:
                counts[hitter.key] += hitter.count
                errs[hitter.key] += hitter.error
                tiers[hitter.key] = hitter.tier
        if snap.store.name == store.name:
            store = store.plus(snap.store)
    # Limits a reload removed linger in older snapshots: show those the newest policy has.
    limits = {name: limits[name] for name in newest.limits if name in limits}
    top_keys = {
        name: tuple(
            HitterData(
                key=key, count=count, error=hitter_errors[name][key], tier=hitter_tiers[name][key]
            )
            for key, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:20]
        )
        for name, counts in hitters.items()
        if name in limits
    }
    upstreams: dict[str, UpstreamData] = {}
    for snap in snapshots:
        for name, upstream in snap.upstreams.items():
            if name in newest.upstreams and upstream.url == newest.upstreams[name].url:
                old_upstream = upstreams.get(name)
                upstreams[name] = old_upstream.plus(upstream) if old_upstream else upstream
    adaptive: dict[str, AdaptiveData] = {}
    for snap in snapshots:
        for name, gate in snap.adaptive.items():
            if name not in newest.adaptive:
                continue
            old_gate = adaptive.get(name)
            live_one = id(snap) in live_ids
            if old_gate is None:
                adaptive[name] = gate if live_one else AdaptiveData().plus(gate, gauges=False)
            else:
                adaptive[name] = old_gate.plus(gate, gauges=live_one)
    states = Counter(s.store.state for s in live)
    reloads = [s.reload for s in live if s.reload is not None]
    return GatewaySnapshot(
        at=now,
        workers=len(live),
        worker_ids=tuple(sorted(s.worker for s in live)),
        policy_sha256=tuple(sorted({s.policy_sha256 for s in live})),
        policy_source=newest.policy_source,
        policy_loaded_at=max(s.policy_loaded_at for s in live),
        requests=tuple((r, m, s, n) for (r, m, s), n in sorted(requests.items())),
        durations=durations,
        upstream_errors=tuple((r, x, n) for (r, x), n in sorted(errors.items())),
        local_responses=tuple((r, c, n) for (r, c), n in sorted(local.items())),
        limited_requests=sum(s.limited_requests for s in snapshots),
        delayed_requests=sum(s.delayed_requests for s in snapshots),
        limits=limits,
        top_keys=top_keys,
        store_name=store.name,
        store_states=dict(states),
        store=store.model_copy(update={"state": _worst_state(states)}),
        reload=_merge_reloads(reloads),
        connections_open=sum(s.connections_open for s in live),
        connections_refused=sum(s.connections_refused for s in snapshots),
        header_timeouts=sum(s.header_timeouts for s in snapshots),
        websockets=websockets,
        processes=tuple(
            ProcessData(worker=s.worker, pid=s.pid, figures=s.process)
            for s in sorted(live, key=lambda s: s.worker)
            if s.process
        ),
        upstreams={name: upstreams[name] for name in newest.upstreams if name in upstreams},
        servers=tuple(
            server if server.key in current else server.model_copy(update={"state": ""})
            for _, server in sorted(servers.items())
        ),
        server_states=tuple((u, s, state, n) for (u, s, state), n in sorted(server_states.items())),
        retries=tuple((u, r, n) for (u, r), n in sorted(retries.items())),
        tls_not_after=min(tls_expiries) if tls_expiries else None,
        tls_reloads=dict(tls_reloads),
        adaptive=adaptive,
    )


def _worst_state(states: Counter[str]) -> str:
    for state in ("open", "half_open", "fallback"):
        if states.get(state):
            return state
    return "ok"


def _merge_reloads(reloads: list[ReloadStatus]) -> ReloadStatus | None:
    """Every worker watches the same file: the gateway reloaded as often as its busiest
    worker did, and its last result is the latest attempt's."""
    if not reloads:
        return None
    latest = max(reloads, key=lambda r: r.last_attempt_at or 0.0)
    successes = [r.last_success_at for r in reloads if r.last_success_at is not None]
    return latest.model_copy(
        update={
            "succeeded": max(r.succeeded for r in reloads),
            "failed": max(r.failed for r in reloads),
            "unchanged": max(r.unchanged for r in reloads),
            "last_success_at": max(successes) if successes else None,
        }
    )


__all__ = [
    "DECISION_RESULTS",
    "REQUEST_DURATION_BUCKETS",
    "GatewaySnapshot",
    "HistogramData",
    "LimitData",
    "WorkerSnapshot",
    "merge",
]


def _most(one: int | None, other: int | None) -> int | None:
    """The larger gauge of two workers sharing what they count; None when neither counts."""
    if one is None:
        return other
    return one if other is None else max(one, other)

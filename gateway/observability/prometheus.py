"""``/metrics``: a prometheus-client collector that turns the whole-gateway snapshot into metric
families at scrape time, in a registry of the app's own (not the process-global one).

Labels come from configuration names (route, limit, store) and bounded sets (method folded to a
known list or ``OTHER``, status class, decision result, error reason); never client addresses,
paths or keys: the top-keys view lives on the dashboard only.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from gateway import __version__
from gateway.edge.annotations import UPSTREAM_ERROR_REASONS
from gateway.edge.pool.server_pool import SERVER_LATENCY_BUCKETS, SERVER_STATES
from gateway.limits.compiled import NO_MODEL
from gateway.observability.leases import lease_metrics
from gateway.observability.snapshot import DECISION_RESULTS, GatewaySnapshot, HistogramData
from gateway.observability.stats import QUEUE_WAIT_BUCKETS, REQUEST_DURATION_BUCKETS
from gateway.stores.store_stats import STORE_LATENCY_BUCKETS, STORE_STATES

RELOAD_RESULTS = ("ok", "failed", "unchanged")
# (name, help, type) of the process metrics, as prometheus-client's ProcessCollector names them.
_PROCESS_METRICS = (
    ("process_cpu_seconds", "Total user and system CPU time spent in seconds.", "counter"),
    ("process_resident_memory_bytes", "Resident memory size in bytes.", "gauge"),
    ("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge"),
    ("process_open_fds", "Number of open file descriptors.", "gauge"),
    ("process_max_fds", "Maximum number of open file descriptors.", "gauge"),
    (
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        "gauge",
    ),
)


def _buckets(histogram: HistogramData, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    cumulative = 0
    out: list[tuple[str, float]] = []
    for bound, count in zip((*bounds, float("inf")), histogram.counts, strict=True):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return out


class GatewayCollector(Collector):
    """Reads a fresh whole-gateway snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], GatewaySnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names are dynamic only in labels; no need to collect at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        info = GaugeMetricFamily(
            "gateway_build_info",
            "Gateway version and Python it runs on; always 1.",
            labels=["version", "python"],
        )
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        workers = GaugeMetricFamily(
            "gateway_workers", "Worker processes whose figures are in this scrape."
        )
        workers.add_metric([], snap.workers)
        yield workers

        requests = CounterMetricFamily(
            "gateway_requests",
            "Requests answered, by route, method and status class.",
            labels=["route", "method", "status"],
        )
        for route, method, status_class, count in snap.requests:
            requests.add_metric([route, method, f"{status_class}xx"], count)
        yield requests
        duration = HistogramMetricFamily(
            "gateway_request_duration_seconds",
            "Time from a request's headers to its response, queueing included, by route.",
            labels=["route"],
        )
        for route, histogram in sorted(snap.durations.items()):
            duration.add_metric(
                [route], _buckets(histogram, REQUEST_DURATION_BUCKETS), histogram.total
            )
        yield duration
        upstream_errors = CounterMetricFamily(
            "gateway_upstream_errors",
            f"Failed upstream exchanges by route and reason ({', '.join(UPSTREAM_ERROR_REASONS)}).",
            labels=["route", "reason"],
        )
        for route, reason, count in snap.upstream_errors:
            upstream_errors.add_metric([route, reason], count)
        yield upstream_errors
        local = CounterMetricFamily(
            "gateway_local_responses",
            "Answers the gateway gave itself rather than relaying the upstream's, by route and "
            "exact status code: 429 a limit, 403 the access list, 404 no route, 502/504 the "
            "upstream failed, 503 store down or shutting down, 400/408/413/417 the request, "
            "499 the client left first. Also counted by class in gateway_requests_total.",
            labels=["route", "code"],
        )
        for route, code, count in snap.local_responses:
            local.add_metric([route, str(code)], count)
        yield local

        yield from self._limits(snap)
        yield from self._store(snap)
        yield from self._policy(snap)

        open_connections = GaugeMetricFamily(
            "gateway_open_connections", "Client connections open now."
        )
        open_connections.add_metric([], snap.connections_open)
        yield open_connections
        refused = CounterMetricFamily(
            "gateway_refused_connections",
            "Client connections refused because a worker had max_connections open.",
        )
        refused.add_metric([], snap.connections_refused)
        yield refused
        header_timeouts = CounterMetricFamily(
            "gateway_header_timeouts", "Client connections closed for sending headers too slowly."
        )
        header_timeouts.add_metric([], snap.header_timeouts)
        yield header_timeouts
        yield from self._websockets(snap)
        yield from self._servers(snap)
        yield from self._adaptive(snap)
        yield from self._tls(snap)
        yield from self._processes(snap)

    def _servers(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        labels = ["upstream", "server"]
        requests = CounterMetricFamily(
            "gateway_upstream_server_requests",
            "Attempts sent to each server of an upstream's pool (retries included).",
            labels=labels,
        )
        failures = CounterMetricFamily(
            "gateway_upstream_server_failures",
            "Failed attempts by server and reason (connect, timeout, reset, protocol, other; "
            "status: a status listed in retry.when that counts as a failure).",
            labels=[*labels, "reason"],
        )
        ejections = CounterMetricFamily(
            "gateway_upstream_server_ejections",
            "Times a server was ejected as an outlier (outlier_detection).",
            labels=labels,
        )
        latency = HistogramMetricFamily(
            "gateway_upstream_server_response_seconds",
            "Time from sending a request to a server to its response head.",
            labels=labels,
        )
        inflight = GaugeMetricFamily(
            "gateway_upstream_server_inflight", "Requests in flight to a server now.", labels=labels
        )
        state = GaugeMetricFamily(
            "gateway_upstream_server_state",
            "Workers that see a server in each state: up, down (max_fails or active checks), "
            "ejected (outlier), backup (a backup server, available).",
            labels=[*labels, "state"],
        )
        states = {(u, s, st): n for u, s, st, n in snap.server_states}
        for server in snap.servers:
            key = [server.upstream, server.server]
            requests.add_metric(key, server.requests)
            for reason, count in sorted(server.failures.items()):
                failures.add_metric([*key, reason], count)
            ejections.add_metric(key, server.ejections)
            latency.add_metric(
                key, _buckets(server.latency, SERVER_LATENCY_BUCKETS), server.latency.total
            )
            if server.state:  # still in its pool
                inflight.add_metric(key, server.inflight)
                for name in SERVER_STATES:
                    state.add_metric([*key, name], states.get((*key, name), 0))  # type: ignore[arg-type]
        retries = CounterMetricFamily(
            "gateway_upstream_retries",
            "Requests sent on to another server of the pool, by upstream and the reason the "
            "previous attempt failed.",
            labels=["upstream", "reason"],
        )
        for upstream, reason, count in snap.retries:
            retries.add_metric([upstream, reason], count)
        yield from (requests, failures, ejections, latency, inflight, state, retries)

    def _adaptive(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        """Each adaptive upstream's limit (per worker; these sum the live workers')."""
        if not snap.adaptive:
            return
        labels = ["upstream"]
        limit = GaugeMetricFamily(
            "gateway_adaptive_limit",
            "An upstream's adaptive in-flight limit now, summed over workers (each finds its own).",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "gateway_adaptive_in_flight",
            "Requests holding a place under an upstream's adaptive limit now.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "gateway_adaptive_waiting",
            "Requests waiting for a place under an upstream's adaptive limit now.",
            labels=labels,
        )
        minimum = GaugeMetricFamily(
            "gateway_adaptive_min_latency_seconds",
            "An upstream's latency measured with min_limit in flight (the highest of the "
            "workers'; 0 before the first measurement).",
            labels=labels,
        )
        latency = GaugeMetricFamily(
            "gateway_adaptive_latency_seconds",
            "An upstream's latency over the last sample interval, the trimmed mean the "
            "adaptive limit moves by (the highest of the workers').",
            labels=labels,
        )
        shed = CounterMetricFamily(
            "gateway_adaptive_shed",
            "Requests answered with the adaptive block's status (503) without reaching the "
            "upstream: no place at once, or none within max_delay.",
            labels=labels,
        )
        probes = CounterMetricFamily(
            "gateway_adaptive_probes",
            "Measurements of an upstream's minimum latency started (the limit held at "
            "min_limit meanwhile).",
            labels=labels,
        )
        for name, gate in sorted(snap.adaptive.items()):
            limit.add_metric([name], gate.limit)
            in_flight.add_metric([name], gate.in_flight)
            waiting.add_metric([name], gate.waiting)
            minimum.add_metric([name], gate.min_latency_s)
            latency.add_metric([name], gate.latency_s)
            shed.add_metric([name], gate.shed)
            probes.add_metric([name], gate.probes)
        yield from (limit, in_flight, waiting, minimum, latency, shed, probes)

    def _tls(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        if snap.tls_not_after is None:
            return
        expiry = GaugeMetricFamily(
            "gateway_tls_certificate_expiry_timestamp_seconds",
            "When the listener's TLS certificate in use expires, Unix time.",
        )
        expiry.add_metric([], snap.tls_not_after)
        reloads = CounterMetricFamily(
            "gateway_tls_certificate_reloads",
            "Reloads of the listener's certificate and key by result (failed: the old pair "
            "stayed).",
            labels=["result"],
        )
        for result in ("ok", "failed"):
            reloads.add_metric([result], snap.tls_reloads.get(result, 0))
        yield from (expiry, reloads)

    def _websockets(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        ws = snap.websockets
        open_ws = GaugeMetricFamily(
            "gateway_websocket_connections_open", "Proxied WebSocket connections open now."
        )
        open_ws.add_metric([], ws.open)
        total = CounterMetricFamily(
            "gateway_websocket_connections",
            "WebSocket connections proxied (handshakes the upstream answered with 101).",
        )
        total.add_metric([], ws.total)
        relayed = CounterMetricFamily(
            "gateway_websocket_bytes",
            "Bytes relayed on WebSocket connections, by direction.",
            labels=["direction"],
        )
        relayed.add_metric(["client_to_upstream"], ws.bytes_from_client)
        relayed.add_metric(["upstream_to_client"], ws.bytes_from_upstream)
        idle = CounterMetricFamily(
            "gateway_websocket_idle_timeouts",
            "WebSocket connections closed after server.websocket_idle_timeout without a byte.",
        )
        idle.add_metric([], ws.idle_timeouts)
        yield from (open_ws, total, relayed, idle)

    def _processes(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        """prometheus-client's process metrics, one series per worker (label ``worker``)."""
        for name, help_text, kind in _PROCESS_METRICS:
            family: Metric = (
                CounterMetricFamily(name, help_text, labels=["worker"])
                if kind == "counter"
                else GaugeMetricFamily(name, help_text, labels=["worker"])
            )
            for process in snap.processes:
                figure = process.figures.get(name)
                if figure is not None:
                    family.add_metric([str(process.worker)], figure)  # type: ignore[attr-defined]
            yield family

    def _limits(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "gateway_limit_decisions",
            "Limiter decisions by limit and result; dry-run limits count would-be outcomes.",
            labels=["limit", "result"],
        )
        wait = HistogramMetricFamily(
            "gateway_limit_queue_wait_seconds",
            "How long delayed requests waited in a limit's queue (a concurrency limit's: "
            "in its line for a slot, admitted or not).",
            labels=["limit"],
        )
        depth = GaugeMetricFamily(
            "gateway_limit_queue_depth",
            "Requests waiting in a limit's queue now (a concurrency limit's: in its line "
            "for a slot).",
            labels=["limit"],
        )
        tracked = GaugeMetricFamily(
            "gateway_limit_tracked_keys", "Keys a limit holds state for.", labels=["limit"]
        )
        blocked = GaugeMetricFamily(
            "gateway_limit_blocked_keys",
            "Keys a limit's penalty boxes block now (its penalty's, or an operator's); not "
            "with the Redis store, which keeps the boxes in Redis.",
            labels=["limit"],
        )
        evictions = CounterMetricFamily(
            "gateway_limit_evictions",
            "Keys dropped from a full limit table while their state still mattered.",
            labels=["limit"],
        )
        dry_run = GaugeMetricFamily(
            "gateway_limit_dry_run", "1 for a dry-run (never enforced) limit.", labels=["limit"]
        )
        slots = GaugeMetricFamily(
            "gateway_limit_slots_in_use",
            "Slots a concurrency limit's requests hold now (requests in flight, by cost).",
            labels=["limit"],
        )
        # Limits charged after the response (count:, cost_header:).
        charged = CounterMetricFamily(
            "gateway_limit_charged_responses",
            "Responses a limit counted by its responses charged (their status matched and "
            "their cost was above 0).",
            labels=["limit"],
        )
        charged_units = CounterMetricFamily(
            "gateway_limit_charged_units",
            "Units responses took from a limit's quota (each what its key had left, up to "
            "its cost: the limit's cost, or the upstream's cost header), by the model the "
            'responses named (cost_from; bounded, further models "other"; none: "").',
            labels=["limit", "model"],
        )
        charge_failures = CounterMetricFamily(
            "gateway_limit_charge_failures",
            "Charges after the response the store could not make (they followed on_failure).",
            labels=["limit"],
        )
        held_units = CounterMetricFamily(
            "gateway_limit_held_units",
            "Units requests held while in flight (hold: in_flight: their reserve or cost), "
            "counted when their response settled them, by model as charged units are.",
            labels=["limit", "model"],
        )
        returned_units = CounterMetricFamily(
            "gateway_limit_returned_units",
            "Held units given back when the response settled them (a response that did not "
            "match, or cost less than the hold), by model as charged units are.",
            labels=["limit", "model"],
        )
        in_flight_units = GaugeMetricFamily(
            "gateway_limit_units_in_flight",
            "Units requests in flight hold now (hold: in_flight: their reserve or cost, from "
            "admission until their response is settled).",
            labels=["limit"],
        )
        # Aggregates of the top-keys view (never the keys: labels are config names only), for
        # enforced limits and for dry-run ones, whose view holds the keys they would limit.
        limited_keys = GaugeMetricFamily(
            "gateway_limit_top_keys",
            "Keys in a limit's recent top limited keys (dry-run: keys it would have limited).",
            labels=["limit"],
        )
        top_key_hits = GaugeMetricFamily(
            "gateway_limit_top_key_rejections",
            "Recent rejections (dry-run: would-be rejections) of a limit's most limited key.",
            labels=["limit"],
        )
        rejections = CounterMetricFamily(
            "gateway_limit_rejections",
            "Enforced rejections by limit and the status answered: the limit's own (429) apart "
            "from the 403 of unlisted: reject.",
            labels=["limit", "status"],
        )
        for name, limit in sorted(snap.limits.items()):
            by_status = {limit.status: 0, **limit.rejected_statuses}
            for status, count in sorted(by_status.items()):
                rejections.add_metric([name, str(status)], count)
            top = snap.top_keys.get(name, ())
            limited_keys.add_metric([name], len(top))
            top_key_hits.add_metric([name], max((h.count for h in top), default=0))
            for result in DECISION_RESULTS:
                decisions.add_metric([name, result], getattr(limit, result))
            wait.add_metric([name], _buckets(limit.wait, QUEUE_WAIT_BUCKETS), limit.wait.total)
            depth.add_metric([name], limit.waiting)
            tracked.add_metric([name], limit.tracked_keys)
            if limit.blocked_keys is not None:
                blocked.add_metric([name], limit.blocked_keys)
            evictions.add_metric([name], limit.evictions)
            dry_run.add_metric([name], 1 if limit.dry_run else 0)
            if limit.algorithm == "concurrency":
                slots.add_metric([name], limit.slots_in_use)
            charged.add_metric([name], limit.charged_responses)
            charge_failures.add_metric([name], limit.charge_failures)
            if limit.holds_budget:
                in_flight_units.add_metric([name], limit.units_in_flight)
            by_model = limit.by_model() if limit.cost_from else None
            for family, total, units in zip(
                (charged_units, held_units, returned_units),
                (limit.charged_units, limit.held_units, limit.returned_units),
                by_model or (None, None, None),
                strict=True,
            ):
                _add_by_model(family, name, units, total)
        yield from (decisions, rejections, wait, depth, tracked, blocked, evictions, dry_run, slots)
        yield from (limited_keys, top_key_hits, charged, charged_units, charge_failures)
        yield from (held_units, returned_units, in_flight_units)
        yield from lease_metrics((name, limit.lease) for name, limit in sorted(snap.limits.items()))

    def _store(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        store = snap.store
        labels = [store.name]
        calls = CounterMetricFamily(
            "gateway_store_calls", "Calls to the limit store.", labels=["store"]
        )
        calls.add_metric(labels, store.calls)
        errors = CounterMetricFamily(
            "gateway_store_errors", "Failed calls to the limit store.", labels=["store"]
        )
        errors.add_metric(labels, store.errors)
        latency = HistogramMetricFamily(
            "gateway_store_call_duration_seconds",
            "Latency of calls to the limit store.",
            labels=["store"],
        )
        latency.add_metric(
            labels, _buckets(store.latency, STORE_LATENCY_BUCKETS), store.latency.total
        )
        state = GaugeMetricFamily(
            "gateway_store_state",
            "Workers in each store state: ok, fallback (a store call failed; on_failure "
            "answers), circuit open or half_open (on_failure answers).",
            labels=["store", "state"],
        )
        for name in STORE_STATES:
            state.add_metric([store.name, name], snap.store_states.get(name, 0))
        transitions = CounterMetricFamily(
            "gateway_store_state_transitions",
            "Changes of store state (circuit opening, probing, closing; fallback and back).",
            labels=["store", "from_state", "to_state"],
        )
        for change, count in sorted(store.transitions.items()):
            from_state, _, to_state = change.partition(">")
            transitions.add_metric([store.name, from_state, to_state], count)
        yield from (calls, errors, latency, state, transitions)

    def _policy(self, snap: GatewaySnapshot) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gateway_policy_info",
            "The active policy's sha256 (12 hex digits); always 1.",
            labels=["sha256"],
        )
        for sha in snap.policy_sha256:
            info.add_metric([sha[:12]], 1)
        yield info
        reloads = CounterMetricFamily(
            "gateway_policy_reloads", "Policy reload attempts by result.", labels=["result"]
        )
        last_success = GaugeMetricFamily(
            "gateway_policy_last_reload_success_timestamp_seconds",
            "When the policy was last loaded successfully (start-up counts), Unix time.",
        )
        reload = snap.reload
        counts = (reload.succeeded, reload.failed, reload.unchanged) if reload else (0, 0, 0)
        for result, count in zip(RELOAD_RESULTS, counts, strict=True):
            reloads.add_metric([result], count)
        if reload is not None and reload.last_success_at is not None:
            last_success.add_metric([], reload.last_success_at)
        else:  # no policy file to reload: the policy was loaded when the gateway started
            last_success.add_metric([], snap.policy_loaded_at)
        successful = GaugeMetricFamily(
            "gateway_policy_last_reload_successful",
            "0 while the latest reload attempt failed (the previous policy still runs), else 1.",
        )
        successful.add_metric([], 0 if reload is not None and reload.last_result == "failed" else 1)
        yield from (reloads, last_success, successful)


def make_registry(snapshot: Callable[[], GatewaySnapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(snapshot))
    return registry


def _add_by_model(
    family: CounterMetricFamily, limit: str, by_model: dict[str, int] | None, total: int
) -> None:
    """A limit's units: a limit with cost_from by model (``by_model``; the label of no model
    always there, so a query finds the series from the start), any other under no model."""
    if by_model is None:
        family.add_metric([limit, NO_MODEL], total)
        return
    family.add_metric([limit, NO_MODEL], by_model.get(NO_MODEL, 0))
    for model, units in sorted(by_model.items()):
        if model != NO_MODEL:
            family.add_metric([limit, model], units)

"""One worker's observability: the handler wrapper, the once-a-second tick, the admin routes.

The tick, on every whole second of wall time, publishes this worker's snapshot for the others;
a quarter second later (when every worker has published) it adds them all up, appends a point to
the dashboard's history and sends it to open dashboards. Scrapes add up afresh.

Whatever is served (a scrape, the dashboard) is a sum of published snapshots only: a worker
publishes its own figures before adding up. Each file only grows, so two scrapes in a row, even
answered by different workers, never see a counter go down (Prometheus would read a reset).
Adding this worker's live figures to the others' files (up to a second old) would not do: the
next scrape, answered by another worker, would count this one's older file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from gateway.clock import rfc3339
from gateway.observability.access_log import AccessLog
from gateway.observability.loop_lag import LoopLagProbe, probe_from_environment
from gateway.observability.prometheus import make_registry
from gateway.observability.snapshot import GatewaySnapshot, LimitData, WorkerSnapshot, merge
from gateway.observability.snapshot_files import SnapshotDirectory
from gateway.observability.timeline import Timeline
from gateway.observability.worker import ObservedHandler, ObservedProxy, WorkerMetrics, WorkerState

log = logging.getLogger("gateway.observability")

TICK_S = 1.0
GATHER_DELAY_S = 0.25  # after the second boundary: every worker has published by then
# The models a limit with cost_from lists on the dashboard, those charged the most first.
TOP_MODELS_SHOWN = 10
SUBSCRIBER_BACKLOG = 30  # messages kept for a dashboard that reads slowly; older ones dropped


class Observability:
    """Everything a worker adds for ``/metrics`` and ``/dashboard``.

    ``shared_dir``: where workers exchange snapshots (``shared.default_shared_dir``), or none for a
    lone worker.
    """

    def __init__(
        self,
        state: WorkerState,
        *,
        shared_dir: Path | None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker_id = state.worker_id
        self.metrics = WorkerMetrics(state)
        # Off until the gateway configures it from its policy (start, each reload).
        self.access_log = AccessLog()
        self.wall_clock = wall_clock
        self.directory = (
            SnapshotDirectory(shared_dir, state.worker_id) if shared_dir is not None else None
        )
        self._base: WorkerSnapshot | None = (
            self.directory.previous() if self.directory is not None else None
        )
        self.registry: CollectorRegistry = make_registry(self.gateway_snapshot)
        self.timeline = Timeline()
        self.latest: GatewaySnapshot | None = None
        self._subscribers: set[asyncio.Queue[bytes | None]] = set()
        self._probe: LoopLagProbe | None = None
        self._publishing: asyncio.Future[None] | None = None
        self._taken = itertools.count(1)  # numbers the snapshots published, in order
        self._last_taken = 0  # the tick's last

    # -- hooks for the gateway ---------------------------------------------------------------

    def wrap(self, handler: ObservedProxy) -> None:
        """Make the proxy handler report each request it finishes."""
        handler.observer = ObservedHandler(
            handler, self.metrics, access_log=self.access_log
        ).finished

    def run_with(self, admin_app: web.Application) -> None:
        """Run the tick while the admin app runs (``dashboard.install`` adds the routes)."""
        admin_app.cleanup_ctx.append(self._lifetime)
        admin_app.on_shutdown.append(self._close_streams)

    # -- figures -----------------------------------------------------------------------------

    def worker_snapshot(self) -> WorkerSnapshot:
        """This worker's figures now, counting those of the worker it replaced (if any)."""
        snapshot = self.metrics.snapshot(self.wall_clock())
        return snapshot.with_base(self._base) if self._base is not None else snapshot

    def gateway_snapshot(self) -> GatewaySnapshot:
        """Every worker's figures added up, this worker's read now and published first.

        If publishing fails the error propagates: a failed scrape is a gap, while a sum with
        unpublished figures in it could go back on the next scrape.
        """
        own = self.worker_snapshot()
        if self.directory is None:
            return merge([own], own.at)
        self.directory.publish(own, next(self._taken))
        return merge([own, *self.directory.others()], own.at)

    # -- the tick ----------------------------------------------------------------------------

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        # The history starts from the figures at start-up, so the first second is drawn too.
        self.timeline.add(self.gateway_snapshot())
        task = asyncio.get_running_loop().create_task(self._run())
        probe = self._probe = probe_from_environment(self.worker_id)  # benchmarks only
        if probe is not None:
            probe.start()
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if probe is not None:
            await probe.stop()
        if self.directory is not None:
            if self._publishing is not None:  # a tick's write, still running on its thread
                with contextlib.suppress(Exception):
                    await self._publishing
            # The last figures, for the totals and for a successor: written after the tick's.
            self.directory.publish(self.worker_snapshot(), next(self._taken))

    async def _run(self) -> None:
        """Once a second: this worker's figures published for the others (written from a
        thread: the loop only takes the snapshot), then, once every worker has published, all
        of them added up for the dashboard's timeline. Each part holds the loop on its own."""
        while True:
            now = self.wall_clock()
            await asyncio.sleep(TICK_S - now % TICK_S)
            try:
                started = time.perf_counter(), time.thread_time()
                self.metrics.rotate(self.wall_clock())
                directory = self.directory
                if directory is None:
                    self._gather(self.gateway_snapshot())
                    self._note_tick(started)
                    continue
                await self._publish_from_thread(directory, started)
                await asyncio.sleep(GATHER_DELAY_S)
                started = time.perf_counter(), time.thread_time()
                # Published before it is shown: a scrape another worker answers next adds up
                # these figures of this one, or later ones, never fewer than shown here.
                own = await self._publish_from_thread(directory, started)
                started = time.perf_counter(), time.thread_time()
                self._gather(self._tick_sum(directory, own))
                self._note_tick(started)
            except Exception:  # one bad tick must not stop the next
                log.exception("observability tick failed")

    async def _publish_from_thread(
        self, directory: SnapshotDirectory, started: tuple[float, float]
    ) -> WorkerSnapshot:
        """This worker's figures now, written for the others from a thread (the loop takes only
        the snapshot; ``started`` is when its part of the tick began)."""
        own = self.worker_snapshot()
        taken = self._last_taken = next(self._taken)
        self._note_tick(started)
        publishing = self._publishing = asyncio.get_running_loop().run_in_executor(
            None, directory.publish, own, taken
        )
        await asyncio.shield(publishing)  # cancelled or not, it ends before the last publish
        return own

    def _tick_sum(self, directory: SnapshotDirectory, own: WorkerSnapshot) -> GatewaySnapshot:
        """Every worker's figures added up, with ``own`` as the tick just published it; afresh
        if a scrape published newer ones meanwhile (and may have shown them: never fewer)."""
        if directory.written > self._last_taken:
            return self.gateway_snapshot()
        return merge([own, *directory.others()], own.at)

    def _note_tick(self, started: tuple[float, float]) -> None:
        if self._probe is not None:
            wall, cpu = started
            self._probe.note_tick(time.perf_counter() - wall, time.thread_time() - cpu)

    def _gather(self, snapshot: GatewaySnapshot) -> None:
        self.latest = snapshot
        point = self.timeline.add(snapshot)
        if point is None or not self._subscribers:
            return
        message = sse_message("point", {"point": point, "state": dashboard_state(snapshot)})
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(message)

    # -- dashboard streams -------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[bytes | None]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(SUBSCRIBER_BACKLOG)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[bytes | None]) -> None:
        self._subscribers.discard(queue)

    async def _close_streams(self, app: web.Application) -> None:
        """End every event stream, so shutdown need not wait out its timeout for them."""
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(None)

    def initial_data(self) -> dict[str, Any]:
        """The history and the state now: what a page draws first (in the page itself, and
        in its event stream's first message)."""
        # Added up afresh, not the last tick's sum: a page that reconnects to another worker
        # must not see its totals go back.
        snapshot = self.gateway_snapshot()
        return {"history": list(self.timeline.points), "state": dashboard_state(snapshot)}

    def initial_message(self) -> bytes:
        return sse_message("init", self.initial_data())


def sse_message(event: str, data: object) -> bytes:
    """One server-sent event (a JSON body has no newlines, so one ``data:`` line)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def upstream_servers(snapshot: GatewaySnapshot) -> dict[str, list[dict[str, Any]]]:
    """Each upstream's servers now: state (by how many workers), in flight, counts."""
    states: dict[tuple[str, str], dict[str, int]] = {}
    for upstream, name, state, workers in snapshot.server_states:
        states.setdefault((upstream, name), {})[state] = workers
    out: dict[str, list[dict[str, Any]]] = {}
    for server in snapshot.servers:
        if not server.state:
            continue  # left its pool
        seen = states.get(server.key, {})
        worst = next((name for name in ("down", "ejected") if seen.get(name)), server.state)
        out.setdefault(server.upstream, []).append(
            {
                "server": server.server,
                "state": worst,
                "states": seen,
                "weight": server.weight,
                "backup": server.backup,
                "inflight": server.inflight,
                "requests": server.requests,
                "failures": sum(server.failures.values()),
                "ejections": server.ejections,
            }
        )
    return out


def dashboard_state(snapshot: GatewaySnapshot) -> dict[str, Any]:
    """Totals and status for the dashboard's numbers and tables."""
    reload = snapshot.reload
    return {
        "at": snapshot.at,
        "workers": snapshot.workers,
        "worker_ids": list(snapshot.worker_ids),
        "policy": {"sha256": list(snapshot.policy_sha256), "source": snapshot.policy_source},
        "reload": reload.shown() if reload is not None else None,
        "store": {
            "name": snapshot.store_name,
            "state": snapshot.store.state,
            "states": snapshot.store_states,
            "calls": snapshot.store.calls,
            "errors": snapshot.store.errors,
        },
        "requests": sum(n for *_, n in snapshot.requests),
        "rejected": snapshot.limited_requests,
        "delayed": snapshot.delayed_requests,
        "upstreams": upstreams_state(snapshot),
        "limits": {
            name: {
                "algorithm": limit.algorithm,
                "dry_run": limit.dry_run,
                **limit.decisions()._asdict(),
                "waiting": limit.waiting,
                "slots_in_use": limit.slots_in_use,
                "tracked_keys": limit.tracked_keys,
                "evictions": limit.evictions,
                "penalty": limit.penalty,
                "blocked_keys": limit.blocked_keys,
                "lease": limit.lease.model_dump() if limit.lease is not None else None,
                "top_keys": [h.model_dump() for h in snapshot.top_keys.get(name, ())],
                "units": units_state(limit) if limit.cost_from else None,
            }
            for name, limit in snapshot.limits.items()
        },
        "adaptive": {name: gate.model_dump() for name, gate in snapshot.adaptive.items()},
    }


def units_state(limit: LimitData) -> dict[str, Any]:
    """A limit with cost_from: the units (tokens) charged, held while in flight and given
    back, those held by the calls in flight now, and the models that took the most
    (``TOP_MODELS_SHOWN``)."""
    charged, held, returned = limit.by_model()
    models = sorted({*charged, *held, *returned}, key=lambda m: (-charged.get(m, 0), m))
    return {
        "charged": limit.charged_units,
        "held": limit.held_units,
        "returned": limit.returned_units,
        "in_flight": limit.units_in_flight,
        "models": [
            {
                "model": model,
                "charged": charged.get(model, 0),
                "held": held.get(model, 0),
                "returned": returned.get(model, 0),
            }
            for model in models[:TOP_MODELS_SHOWN]
        ],
    }


def upstreams_state(snapshot: GatewaySnapshot) -> dict[str, dict[str, Any]]:
    """Each upstream for the dashboard and ``/status``: its servers (state, in flight, counts),
    its failures by cause and the latest (times in RFC 3339 too)."""
    servers = upstream_servers(snapshot)
    return {
        name: {
            "url": upstream.url,
            "failures_total": sum(upstream.failures.values()),
            "failures": upstream.failures,
            "recent": [
                {**failure.model_dump(), "at_rfc3339": rfc3339(failure.at)}
                for failure in upstream.recent
            ],
            "servers": servers.get(name, []),
        }
        for name, upstream in snapshot.upstreams.items()
    }

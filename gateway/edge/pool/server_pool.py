"""An upstream's servers, each with its keep-alive connections, health and counters, and the
balancer that picks among them: what the proxy asks for a server and tells how it went.

Which servers may take a request, in order: the primaries that are available (not out after
``max_fails``, not ejected as an outlier, not failing active checks); else the available backups;
else every primary regardless (Envoy's panic routing: when all look unwell, a request tried is
better than a 502 the gateway makes up). A request never goes to a server it already tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from gateway.edge.pool.active_health import ActiveHealth
from gateway.edge.pool.balancers import Balancer, ConsistentHash, LeastInflight, RoundRobin
from gateway.edge.pool.dns import ResolveError, resolve
from gateway.edge.pool.outliers import Ejection, OutlierDetector
from gateway.edge.pool.passive_health import PassiveHealth
from gateway.edge.upstream_client import UpstreamError, UpstreamPool
from gateway.edge.upstream_failures import UpstreamFailures
from gateway.histogram import Histogram
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import (
    RetryOn,
    RetrySettings,
    Upstream,
    UpstreamServer,
    split_host_port,
)

log = logging.getLogger("gateway.upstream")

# Time to a server's response head (seconds, Prometheus ``le``); +Inf implied.
SERVER_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Statuses that count as a server's failure when retried on (nginx: never 403 and 404).
FAILURE_STATUSES: Final = frozenset({500, 502, 503, 504, 429})
# The ``state`` label of a server.
SERVER_STATES: Final = ("up", "down", "ejected", "backup")
# The ``reason`` label of a server's failures: an upstream error's, or a status retried on.
FAILURE_REASONS: Final = ("connect", "timeout", "reset", "protocol", "other", "status")
DEMO_URL: Final = "builtin:demo"


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """Where one pool member connects: ``address`` (the host itself, or one it resolved to)."""

    scheme: str
    host: str  # as in the URL: the TLS server name
    address: str
    port: int
    base_path: str
    label: str  # host:port, or address:port once resolved: the ``server`` label of metrics


ConnectionsFactory = Callable[[ServerAddress], UpstreamPool]


class ServerStats:
    """One server's counters; kept per worker across reloads (``ServerStatsTable``)."""

    __slots__ = ("ejections", "failures", "latency", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.failures: dict[str, int] = {}
        self.ejections = 0
        self.latency = Histogram(SERVER_LATENCY_BUCKETS)


class ServerStatsTable:
    """Every server's counters and every upstream's retries, by name: a reload that rebuilds a
    pool hands the new one the same table, so the counters keep growing."""

    __slots__ = ("retries", "servers")

    def __init__(self) -> None:
        self.servers: dict[tuple[str, str], ServerStats] = {}
        # (upstream, reason) -> requests sent on to another server
        self.retries: dict[tuple[str, str], int] = {}

    def forget(self, upstream: str, server: str) -> None:
        """A server left its pool (its name re-resolved, a reload removed it): its series end,
        so that pods coming and going do not grow the table and the metrics without bound."""
        self.servers.pop((upstream, server), None)

    def keep_only(self, upstreams: dict[str, ServerPool]) -> None:
        """Forget every server no pool in force has, and the retries of upstreams gone."""
        present = {(name, m.label) for name, pool in upstreams.items() for m in pool.members}
        for key in [key for key in self.servers if key not in present]:
            del self.servers[key]
        for key in [key for key in self.retries if key[0] not in upstreams]:
            del self.retries[key]

    def of(self, upstream: str, server: str) -> ServerStats:
        stats = self.servers.get((upstream, server))
        if stats is None:
            stats = self.servers[(upstream, server)] = ServerStats()
        return stats


class PoolMember:
    """One server of a pool: where it is, its connections, its health, its counters."""

    __slots__ = (
        "active",
        "address",
        "backup",
        "config",
        "connections",
        "index",
        "inflight",
        "passive",
        "pending",
        "retired",
        "stats",
        "weight",
    )

    def __init__(
        self,
        config: UpstreamServer,
        address: ServerAddress,
        connections: UpstreamPool,
        passive: PassiveHealth,
        active: ActiveHealth | None,
        stats: ServerStats,
    ) -> None:
        self.config = config
        self.address = address
        self.connections = connections
        self.passive = passive
        self.active = active
        self.stats = stats
        self.weight = config.weight
        self.backup = config.backup
        self.index = 0
        self.inflight = 0  # attempts sent and not yet done with (their responses relayed)
        self.pending = 0  # attempts sent whose outcome (a response head, a failure) is unknown
        self.retired = False

    @property
    def label(self) -> str:
        return self.address.label

    @property
    def base_path(self) -> str:
        return self.address.base_path


@dataclass(frozen=True, slots=True)
class MemberState:
    """A server as ``/policy``, the metrics and the dashboard show it."""

    server: str
    url: str
    weight: int
    backup: bool
    state: str
    inflight: int
    fails: int
    ejected_for_s: float


def server_address(config: UpstreamServer, demo: tuple[str, int] | None) -> ServerAddress:
    """A server's URL taken apart (``builtin:demo``: the gateway's own demo server)."""
    if config.url == DEMO_URL:
        if demo is None:
            raise RuntimeError("the built-in demo upstream is not running")
        host, port = demo
        return ServerAddress("http", host, host, port, "", DEMO_URL)
    parts = urlsplit(config.url)
    host = parts.hostname or "127.0.0.1"
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    label = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ServerAddress(parts.scheme, host, host, port, parts.path.rstrip("/"), label)


def make_balancer(config: Upstream, members: Sequence[PoolMember]) -> Balancer:
    weights = [m.weight for m in members]
    if config.balance == "least_inflight":
        return LeastInflight(weights)
    if config.balance == "hash":
        return ConsistentHash([m.config.url + "#" + m.address.address for m in members], weights)
    return RoundRobin(weights)


class RetryRule:
    """An upstream's ``retry:`` as each request reads it, copied once: a pydantic model's
    attribute read costs some 400 instructions (``routing.RouteEntry`` says why)."""

    __slots__ = ("buffer_body", "retry_timeout", "tries", "when")

    def __init__(self, settings: RetrySettings) -> None:
        self.when: tuple[RetryOn, ...] = settings.when
        self.tries: int = settings.tries
        self.retry_timeout: float = settings.retry_timeout
        self.buffer_body: int = settings.buffer_body


class ServerPool:
    """An upstream's pool. ``pick`` a member, ``started`` it, then ``answered`` or ``failed``,
    and ``finished`` once the response is done with; ``start`` runs the pool's own tasks
    (re-resolving names, active checks), ``close`` ends them and closes the connections."""

    def __init__(
        self,
        name: str,
        config: Upstream,
        connect: ConnectionsFactory,
        stats: ServerStatsTable,
        *,
        demo: tuple[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config
        self.retry = RetryRule(config.retry)
        self._connect = connect
        self._stats = stats
        self._now = clock
        servers = config.server_list()
        self._servers = servers
        self._single = len(servers) == 1 and config.resolve_interval is None
        # A pool of one is never taken out (nginx ignores max_fails there): nowhere else to go.
        self._max_fails = config.max_fails if not self._single else 0
        self._by_inflight = config.balance == "least_inflight"
        self._failure_statuses = frozenset(s for s in config.retry.when if s in FAILURE_STATUSES)
        self._resolver = split_host_port(config.resolver) if config.resolver else None
        # balance: hash: a missing key part hashes the client IP
        self.key_builder = (
            KeyBuilder(config.hash_key, "client_ip") if config.hash_key is not None else None
        )
        # Each failed exchange with a server: logged once per cause, the latest kept (/status).
        self.failures = UpstreamFailures(name)
        self._tasks: list[asyncio.Task[None]] = []  # the pool's loops
        self._closing: set[asyncio.Task[None]] = set()  # retired members' connections closing
        self._started = False
        self._resolved = False
        self._resolve_problems: dict[str, str] = {}
        self._closed = False
        self.members: tuple[PoolMember, ...] = ()
        self._balancer: Balancer = RoundRobin(())
        self._outliers: OutlierDetector | None = None
        self._install([self._member(s, server_address(s, demo)) for s in servers])

    # -- picking -----------------------------------------------------------------------------

    def pick(self, tried: Collection[PoolMember] = (), key: str = "") -> PoolMember | None:
        """The member to send a request to, or None when every one was tried."""
        members = self.members
        if self._single:
            member = members[0]
            return None if tried else member
        now = self._now()
        outliers = self._outliers
        if outliers is not None and now >= outliers.next_at:
            self._ejected(outliers.evaluate(now), now)
        candidates: list[int] = []
        backups = False
        for m in members:
            if m.backup:
                backups = True
            elif self._available(m, now) and m not in tried:
                candidates.append(m.index)
        if not candidates and backups:
            candidates = [
                m.index for m in members if m.backup and m not in tried and self._available(m, now)
            ]
        if not candidates:
            candidates = [m.index for m in members if not m.backup and m not in tried]
        if not candidates:
            return None
        if len(candidates) == 1:
            member = members[candidates[0]]
        else:
            inflight = [m.inflight for m in members] if self._by_inflight else ()
            member = members[self._balancer.pick(candidates, inflight, key)]
        member.passive.picked(now)
        return member

    def _available(self, member: PoolMember, now: float) -> bool:
        passive = member.passive
        fails = passive.fails
        max_fails = passive.max_fails
        if fails:
            if not passive.available(now):
                return False
            if fails < max_fails and member.pending >= max_fails - fails:
                # Failing already: no more attempts in the dark than the failures it has
                # left, so the clients who see its failures are at most max_fails, however
                # many arrive at once.
                return False
        elif max_fails and member.pending >= max_fails and not member.connections.open_connections:
            return False  # the same for a server with no connection open: dead, or not yet up
        if member.active is not None and not member.active.healthy:
            return False
        outliers = self._outliers
        return outliers is None or not outliers.ejected(member.index, now)

    def now(self) -> float:
        return self._now()

    @property
    def tries(self) -> int:
        """Attempts a request may make: ``retry.tries``, or each server once."""
        return self.retry.tries or len(self.members)

    # -- how it went -------------------------------------------------------------------------

    def started(self, member: PoolMember) -> float:
        member.inflight += 1
        member.pending += 1
        member.stats.requests += 1
        return self._now()

    def unanswered(self, member: PoolMember) -> None:
        """An attempt ended with neither an answer nor a failure of the server's (the client's
        body failed, the client went away)."""
        member.pending -= 1

    def answered(self, member: PoolMember, status: int, started_at: float) -> bool:
        """The member answered with ``status``; True if that counts as its failure."""
        member.pending -= 1
        now = self._now()
        latency = now - started_at
        member.stats.latency.observe(latency)
        if self._outliers is not None:
            self._outliers.record(member.index, status >= 500, latency)
        if status in self._failure_statuses:
            self.server_failed(member, "status", f"answered {status}", now)
            return True
        if member.passive.succeeded():
            log.info(
                "upstream %s: server %s is back (a trial request succeeded)",
                self.name,
                member.label,
            )
        return False

    def failed(self, member: PoolMember, reason: str, exc: UpstreamError) -> None:
        """The exchange with the member failed (``reason``: an ``upstream_error_reason``)."""
        member.pending -= 1
        self.failures.record(member.config.url, member.label, exc)
        now = self._now()
        if self._outliers is not None:
            self._outliers.record(member.index, True, None)
        self.server_failed(member, reason, str(exc), now)

    def server_failed(self, member: PoolMember, reason: str, detail: str, now: float) -> None:
        """Every failure of a server comes through here: counted, and judged by passive health."""
        failures = member.stats.failures
        failures[reason] = failures.get(reason, 0) + 1
        if member.passive.failed(now):
            log.warning(
                "upstream %s: server %s taken out for %gs after %d failed attempts (last: %s)",
                self.name,
                member.label,
                self.config.fail_timeout,
                member.passive.fails,
                detail,
            )

    def finished(self, member: PoolMember) -> None:
        member.inflight -= 1
        if member.retired and member.inflight == 0:
            self._close_later(member)

    def retried(self, reason: str) -> None:
        retries = self._stats.retries
        key = (self.name, reason)
        retries[key] = retries.get(key, 0) + 1

    def _ejected(self, ejections: list[Ejection], now: float) -> None:
        for ejection in ejections:
            member = self.members[ejection.index]
            member.stats.ejections += 1
            log.warning(
                "upstream %s: server %s ejected for %gs: its %s stood out from its peers'",
                self.name,
                member.label,
                round(ejection.until - now, 3),
                "errors" if ejection.why == "errors" else "latency",
            )

    # -- state -------------------------------------------------------------------------------

    def state_of(self, member: PoolMember, now: float) -> str:
        if not member.passive.available(now) or (
            member.active is not None and not member.active.healthy
        ):
            return "down"
        if self._outliers is not None and self._outliers.ejected(member.index, now):
            return "ejected"
        return "backup" if member.backup else "up"

    def states(self) -> list[MemberState]:
        now = self._now()
        out = []
        for member in self.members:
            until = self._outliers.ejected_until(member.index) if self._outliers else 0.0
            out.append(
                MemberState(
                    server=member.label,
                    url=member.config.url,
                    weight=member.weight,
                    backup=member.backup,
                    state=self.state_of(member, now),
                    inflight=member.inflight,
                    fails=member.passive.fails,
                    ejected_for_s=round(max(0.0, until - now), 3),
                )
            )
        return out

    # -- members -----------------------------------------------------------------------------

    def _member(self, config: UpstreamServer, address: ServerAddress) -> PoolMember:
        check = self.config.health_check
        return PoolMember(
            config,
            address,
            self._connect(address),
            PassiveHealth(self._max_fails, self.config.fail_timeout),
            ActiveHealth(check.healthy, check.unhealthy) if check is not None else None,
            self._stats.of(self.name, address.label),
        )

    def _install(self, members: list[PoolMember]) -> None:
        old = self.members
        for index, member in enumerate(members):
            member.index = index
        self.members = tuple(members)
        self._balancer = make_balancer(self.config, members)
        detection = self.config.outlier_detection
        if detection is not None and len(members) > 1:
            self._outliers = OutlierDetector(detection, len(members), self._now())
        else:
            self._outliers = None
        labels = {m.label for m in members}
        for member in old:
            if member not in members:
                member.retired = True
                if member.label not in labels:
                    self._stats.forget(self.name, member.label)
                if member.inflight == 0:
                    self._close_later(member)

    def _close_later(self, member: PoolMember) -> None:
        with contextlib.suppress(RuntimeError):  # no loop: nothing was ever connected
            task = asyncio.get_running_loop().create_task(member.connections.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # -- the pool's own tasks ----------------------------------------------------------------

    def start(self) -> None:
        """Start re-resolving names and active checks (once; needs the running loop)."""
        if self._closed or self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        if self.config.resolve_interval is not None:
            self._tasks.append(loop.create_task(self._resolve_loop(), name=self.name))
        if self.config.health_check is not None:
            self._tasks.append(loop.create_task(self._check_loop(), name=self.name))

    async def resolve_now(self) -> None:
        """Resolve every server's host name and install a member per address."""
        interval = self.config.resolve_interval
        assert interval is not None
        self._resolved = True
        current = {(m.config.url, m.address.address): m for m in self.members}
        members: list[PoolMember] = []
        for config in self._servers:
            base = server_address(config, None)
            try:
                addresses = await resolve(base.host, base.port, self._resolver, min(interval, 5.0))
            except ResolveError as exc:
                self._resolve_failed(config.url, str(exc))
                members += [m for m in self.members if m.config.url == config.url]
                continue
            if self._resolve_problems.pop(config.url, None) is not None:
                log.info("upstream %s: %s resolves again", self.name, base.host)
            for address in addresses:
                member = current.get((config.url, address))
                if member is None:
                    label = (
                        f"[{address}]:{base.port}" if ":" in address else f"{address}:{base.port}"
                    )
                    resolved = ServerAddress(
                        base.scheme, base.host, address, base.port, base.base_path, label
                    )
                    member = self._member(config, resolved)
                members.append(member)
        if [id(m) for m in members] != [id(m) for m in self.members]:
            before = sorted(m.label for m in self.members)
            self._install(members)
            log.info(
                "upstream %s: servers now %s (were %s)",
                self.name,
                ", ".join(sorted(m.label for m in members)),
                ", ".join(before),
            )

    def _resolve_failed(self, url: str, problem: str) -> None:
        if self._resolve_problems.get(url) != problem:  # once per cause
            self._resolve_problems[url] = problem
            log.warning(
                "upstream %s: cannot resolve %s (%s); keeping its addresses",
                self.name,
                url,
                problem,
            )

    async def _resolve_loop(self) -> None:
        interval = self.config.resolve_interval
        assert interval is not None
        while True:
            if self._resolved:
                await asyncio.sleep(interval)
            try:
                await self.resolve_now()
            except Exception:  # one bad round must not end the next
                log.exception("upstream %s: resolving failed", self.name)
                self._resolved = True

    async def _check_loop(self) -> None:
        check = self.config.health_check
        assert check is not None
        while True:
            members = self.members
            await asyncio.gather(*(self._check(m) for m in members if m.active is not None))
            await asyncio.sleep(check.interval)

    async def _check(self, member: PoolMember) -> None:
        check = self.config.health_check
        active = member.active
        assert check is not None and active is not None
        host = member.address.host
        if ":" in host:
            host = f"[{host}]"
        head = (
            f"GET {member.base_path}{check.path} HTTP/1.1\r\nHost: {host}\r\n"
            "User-Agent: gateway-health-check\r\n\r\n"
        ).encode("latin-1")
        problem = ""
        try:
            async with asyncio.timeout(check.timeout):
                response = await member.connections.request(head)
                try:
                    while await response.read_chunk():
                        pass
                    response.release()
                finally:
                    response.close()
            status = response.status
            passed = status in check.expect_status if check.expect_status else 200 <= status < 400
            if not passed:
                problem = f"answered {status}"
        except TimeoutError:
            passed, problem = False, f"no answer within {check.timeout:g}s"
        except UpstreamError as exc:
            passed, problem = False, str(exc)
        if active.record(passed) and not member.retired:
            if passed:
                log.info("upstream %s: server %s passes its health checks", self.name, member.label)
            else:
                log.warning(
                    "upstream %s: server %s failed %d health checks in a row (last: %s)",
                    self.name,
                    member.label,
                    active.failed_in_row,
                    problem,
                )

    async def prepare(self) -> None:
        """Before serving: resolve the servers' names once (a pool with resolve_interval)."""
        if self.config.resolve_interval is not None and not self._resolved:
            await self.resolve_now()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for member in self.members:
            await member.connections.close()

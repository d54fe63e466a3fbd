"""A runtime snapshot: everything a request needs, built from one validated policy.

The proxy handler reads ``handler.runtime`` once per request, so a reload that assigns a new
snapshot never serves a request under a half-applied policy.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from gateway import __version__
from gateway.algorithms.registry import build_algorithm, gradient_params
from gateway.clock import MonotonicClock
from gateway.edge.adaptive_gate import AdaptiveGate
from gateway.edge.client_ip import ClientIPResolver
from gateway.edge.pool.server_pool import ServerAddress, ServerPool, ServerStatsTable
from gateway.edge.response_usage import usage_log
from gateway.edge.responses import SERVER_LINE, error_response
from gateway.edge.upstream_client import UpstreamPool
from gateway.engine.limit_engine import LimitEngine
from gateway.limits.routing import RouteTable
from gateway.log_throttle import LogThrottle
from gateway.policy.loader import LoadedPolicy
from gateway.policy.models import AdaptiveSettings, Policy, ServerSettings, Upstream
from gateway.policy.upstream_tls import client_context
from gateway.stores import LimitStore


@dataclass(slots=True)
class UpstreamTarget:
    """One configured upstream: its pool of servers (a pool of one for ``url:``), and its
    adaptive limit in this worker (``adaptive:``)."""

    name: str
    config: Upstream
    pool: ServerPool
    gate: AdaptiveGate | None = None


def make_gate(settings: AdaptiveSettings | None) -> AdaptiveGate | None:
    """An upstream's adaptive limit, starting from its floor (it probes the minimum latency
    first, then finds the level in a few samples)."""
    if settings is None:
        return None
    return AdaptiveGate(
        gradient_params(settings),
        MonotonicClock(),
        random.random,
        max_delay_s=settings.max_delay,
        max_queue=settings.max_queue,
        status=settings.status,
        retry_after_s=settings.retry_after,
    )


_SERVER: Final = frozenset({b"server"})


@dataclass(slots=True)
class Runtime:
    loaded: LoadedPolicy
    routes: RouteTable
    upstreams: dict[str, UpstreamTarget]
    client_ip: ClientIPResolver
    settings: ServerSettings
    engine: LimitEngine
    server_stats: ServerStatsTable = field(default_factory=ServerStatsTable)
    via: bytes = b"1.1 gateway"
    # Upstream response headers clients never see (cost headers, the upstream's Server unless
    # passed), and the gateway's Server line in their place (empty when the upstream's passes).
    hidden_headers: frozenset[bytes] = frozenset({b"server"})
    server_line: bytes = SERVER_LINE
    legacy_error_body: bool = False  # server.error_body: legacy
    # ``settings``' fields read on every request, copied as native fields: a pydantic model's
    # attribute read costs some 400 instructions (``routing.RouteEntry`` says why).
    underscores_in_headers: bool = False
    body_timeout: float = 60.0
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0
    _idle_waiter: asyncio.Future[None] | None = None
    # Responses whose body reported no usable usage (``cost_from``): logged once per cause.
    usage_log: LogThrottle = field(default_factory=usage_log)

    def error_response(
        self,
        status: int,
        message: str,
        *,
        close: bool = False,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        """One of the gateway's own answers, in the body ``server.error_body`` asks for."""
        return error_response(
            status, message, close=close, headers=headers, legacy=self.legacy_error_body
        )

    def request_done(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle_waiter is not None and not self._idle_waiter.done():
            self._idle_waiter.set_result(None)

    async def idle(self) -> None:
        """Wait until no request is being served under this runtime."""
        if self.inflight > 0:
            self._idle_waiter = asyncio.get_running_loop().create_future()
            await self._idle_waiter

    async def prepare(self) -> None:
        """Before the listeners open: resolve the pools' names once."""
        for target in self.upstreams.values():
            await target.pool.prepare()

    def start(self) -> None:
        """Start the pools' own tasks (re-resolving, active checks); pools already running
        (taken over from the previous runtime) are left as they are."""
        for target in self.upstreams.values():
            target.pool.start()

    async def close(self, keep: set[str] | None = None) -> None:
        """Close the upstream pools, except those a newer runtime took over (``keep``)."""
        for name, target in self.upstreams.items():
            if keep is None or name not in keep:
                await target.pool.close()


def connections_factory(config: Upstream) -> Callable[[ServerAddress], UpstreamPool]:
    """What opens one server's keep-alive connections, with the upstream's settings (for
    https:// servers the CAs of ``ca_file`` and the certificate of ``client_cert``)."""
    ssl_context: ssl.SSLContext | None = None

    def connections(server: ServerAddress) -> UpstreamPool:
        nonlocal ssl_context
        secure = server.scheme == "https"
        if secure and ssl_context is None:
            ssl_context = client_context(config)
        return UpstreamPool(
            server.address,
            server.port,
            max_connections=config.max_connections,
            max_idle=config.max_idle if config.max_idle is not None else config.max_connections,
            idle_timeout_s=config.idle_timeout,
            connect_timeout_s=config.connect_timeout,
            read_timeout_s=config.read_timeout,
            ssl=ssl_context if secure else None,
            server_hostname=server.host if secure else None,
        )

    return connections


def make_pool(
    name: str,
    config: Upstream,
    demo_address: tuple[str, int] | None,
    stats: ServerStatsTable | None = None,
) -> ServerPool:
    return ServerPool(
        name,
        config,
        connections_factory(config),
        stats if stats is not None else ServerStatsTable(),
        demo=demo_address,
    )


def build_runtime(
    loaded: LoadedPolicy,
    store: LimitStore,
    demo_address: tuple[str, int] | None = None,
    previous: Runtime | None = None,
) -> Runtime:
    """Build a snapshot; with ``previous``, unchanged upstream pools and limit state carry over.

    Raises ``ValueError`` for what validation could not see (an algorithm refusing its
    parameters), before anything is changed.
    """
    policy = loaded.policy
    engine = LimitEngine(
        policy, store, build_algorithm, previous=previous.engine if previous else None
    )
    store.configure(engine.limits, previous.engine.limits if previous else ())
    if engine.identity is not None:
        engine.identity.start()  # the JWKS fetched before the first token needs it
    server_stats = previous.server_stats if previous else ServerStatsTable()
    upstreams = {}
    for name, config in policy.upstreams.items():
        old = previous.upstreams.get(name) if previous else None
        if old is not None and old.config == config:
            upstreams[name] = old
            continue
        # A reload that leaves the adaptive block as it was keeps the limit it has found.
        gate = old.gate if old is not None and old.config.adaptive == config.adaptive else None
        upstreams[name] = UpstreamTarget(
            name,
            config,
            make_pool(name, config, demo_address, server_stats),
            gate if gate is not None else make_gate(config.adaptive),
        )
    server_stats.keep_only({name: target.pool for name, target in upstreams.items()})
    passes_server = policy.server.pass_upstream_server_header
    return Runtime(
        loaded=loaded,
        routes=RouteTable(policy.routes, policy.server.max_body_size),
        upstreams=upstreams,
        client_ip=ClientIPResolver(
            policy.server.trusted_proxies, header=policy.server.client_ip_header
        ),
        settings=policy.server,
        engine=engine,
        server_stats=server_stats,
        via=f"1.1 gateway/{__version__}".encode(),
        hidden_headers=engine.hidden_headers if passes_server else engine.hidden_headers | _SERVER,
        server_line=b"" if passes_server else SERVER_LINE,
        legacy_error_body=policy.server.error_body == "legacy",
        underscores_in_headers=policy.server.underscores_in_headers,
        body_timeout=policy.server.body_timeout,
    )


def largest_body_size(policy: Policy) -> int:
    """The listener's limit on a body: the largest any route allows (0: unlimited); each
    route's own is checked as its body is read."""
    sizes = [policy.server.max_body_size]
    sizes += [r.max_body_size for r in policy.routes if r.max_body_size is not None]
    return 0 if 0 in sizes else max(sizes)


def uses_demo(loaded: LoadedPolicy) -> bool:
    return any(u.url == "builtin:demo" for u in loaded.policy.upstreams.values())

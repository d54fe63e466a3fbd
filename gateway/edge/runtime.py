"""A runtime snapshot: everything a request needs, built from one validated policy.

The proxy handler reads ``handler.runtime`` once per request, so a reload that assigns a new
snapshot never serves a request under a half-applied policy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway import __version__
from gateway.algorithms.registry import build_algorithm
from gateway.edge.client_ip import ClientIPResolver
from gateway.edge.upstream_client import UpstreamPool
from gateway.edge.upstream_failures import UpstreamFailures
from gateway.engine.limit_engine import LimitEngine
from gateway.limits.routing import RouteTable
from gateway.policy.loader import LoadedPolicy
from gateway.policy.models import ServerSettings, Upstream
from gateway.policy.upstream_tls import client_context
from gateway.stores import LimitStore


@dataclass(slots=True)
class UpstreamTarget:
    """One configured upstream: its connection pool, the path prefix its URL carries, the
    address it connects to (``host:port``) and its failures (logged, and kept for ``/status``)."""

    name: str
    config: Upstream
    pool: UpstreamPool
    base_path: str
    address: str
    failures: UpstreamFailures

    def failed(self, exc: BaseException, status: int) -> str:
        """Count and log a failed exchange with this upstream's server; the failure's cause."""
        return self.failures.record(self.config.url, self.address, exc, status)


@dataclass(slots=True)
class Runtime:
    loaded: LoadedPolicy
    routes: RouteTable
    upstreams: dict[str, UpstreamTarget]
    client_ip: ClientIPResolver
    settings: ServerSettings
    engine: LimitEngine
    via: bytes = b"1.1 gateway"
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0
    _idle_waiter: asyncio.Future[None] | None = None

    def request_done(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle_waiter is not None and not self._idle_waiter.done():
            self._idle_waiter.set_result(None)

    async def idle(self) -> None:
        """Wait until no request is being served under this runtime."""
        if self.inflight > 0:
            self._idle_waiter = asyncio.get_running_loop().create_future()
            await self._idle_waiter

    async def close(self, keep: set[str] | None = None) -> None:
        """Close the upstream pools, except those a newer runtime took over (``keep``)."""
        for name, target in self.upstreams.items():
            if keep is None or name not in keep:
                await target.pool.close()


def make_pool(config: Upstream, demo_address: tuple[str, int] | None) -> tuple[UpstreamPool, str]:
    if config.url == "builtin:demo":
        if demo_address is None:
            raise RuntimeError("the built-in demo upstream is not running")
        host, port = demo_address
        base_path = ""
        ssl_context = None
    else:
        host, port = upstream_address(config)
        base_path = urlsplit(config.url).path.rstrip("/")
        ssl_context = client_context(config) if config.url.startswith("https://") else None
    pool = UpstreamPool(
        host,
        port,
        max_connections=config.max_connections,
        max_idle=config.max_idle if config.max_idle is not None else config.max_connections,
        idle_timeout_s=config.idle_timeout,
        connect_timeout_s=config.connect_timeout,
        read_timeout_s=config.read_timeout,
        ssl=ssl_context,
        server_hostname=host if ssl_context is not None else None,
    )
    return pool, base_path


def upstream_address(config: Upstream) -> tuple[str, int]:
    parts = urlsplit(config.url)
    secure = parts.scheme == "https"
    return parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80)


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
    upstreams = {}
    for name, config in policy.upstreams.items():
        old = previous.upstreams.get(name) if previous else None
        if old is not None and old.config == config:
            upstreams[name] = old
            continue
        pool, base_path = make_pool(config, demo_address)
        if config.url == "builtin:demo" and demo_address is not None:
            host, port = demo_address
        else:
            host, port = upstream_address(config)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        upstreams[name] = UpstreamTarget(
            name, config, pool, base_path, address, UpstreamFailures(name)
        )
    return Runtime(
        loaded=loaded,
        routes=RouteTable(policy.routes),
        upstreams=upstreams,
        client_ip=ClientIPResolver(
            policy.server.trusted_proxies, header=policy.server.client_ip_header
        ),
        settings=policy.server,
        engine=engine,
        via=f"1.1 gateway/{__version__}".encode(),
    )


def uses_demo(loaded: LoadedPolicy) -> bool:
    return any(u.url == "builtin:demo" for u in loaded.policy.upstreams.values())

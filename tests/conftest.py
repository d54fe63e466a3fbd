"""Shared fixtures: a recording upstream (a real aiohttp server) and an in-process gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import LoadedPolicy
from gateway.serving.lifecycle import Gateway
from tests.support import policy_for

__all__ = ["policy_for"]  # importers of tests.conftest find it here too


@dataclass
class RecordedRequest:
    method: str
    raw_path: str
    raw_headers: list[tuple[bytes, bytes]]
    body: bytes
    peer: str
    peer_port: int  # the upstream connection's source port: which connection it came on


Reply = Callable[[web.BaseRequest, RecordedRequest], Awaitable[web.StreamResponse]]


@dataclass
class RecordingUpstream:
    """A real upstream server that records what reaches it; tests swap ``handler`` freely."""

    runner: web.ServerRunner
    port: int
    requests: list[RecordedRequest] = field(default_factory=list)
    reply: Reply | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _default_reply(request: web.BaseRequest, recorded: RecordedRequest) -> web.StreamResponse:
    return web.Response(text=f"ok {recorded.method} {recorded.raw_path}")


async def start_recording_upstream() -> RecordingUpstream:
    """A recording upstream on a free loopback port; ``rec.runner.cleanup()`` stops it."""
    holder: dict[str, RecordingUpstream] = {}

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        rec = holder["u"]
        body = await request.read() if request.can_read_body else b""
        peername = request.transport.get_extra_info("peername") if request.transport else None
        recorded = RecordedRequest(
            request.method,
            request.raw_path,
            list(request.raw_headers),
            body,
            peername[0] if peername else "",
            int(peername[1]) if peername else 0,
        )
        rec.requests.append(recorded)
        reply = rec.reply or _default_reply
        return await reply(request, recorded)

    runner = web.ServerRunner(web.Server(handle, auto_decompress=False), shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    rec = RecordingUpstream(runner, runner.addresses[0][1])
    holder["u"] = rec
    return rec


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    rec = await start_recording_upstream()
    yield rec
    await rec.runner.cleanup()


@pytest.fixture
async def make_upstream() -> AsyncIterator[Callable[[], Awaitable[RecordingUpstream]]]:
    """For tests that need several recording upstreams at once."""
    started: list[RecordingUpstream] = []

    async def make() -> RecordingUpstream:
        rec = await start_recording_upstream()
        started.append(rec)
        return rec

    yield make
    for rec in started:
        await rec.runner.cleanup()


@dataclass
class RunningGateway:
    gateway: Gateway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.proxy_port}"

    @property
    def port(self) -> int:
        return self.gateway.proxy_port

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.admin_port}"


GatewayFactory = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def start_gateway() -> AsyncIterator[GatewayFactory]:
    started: list[Gateway] = []

    async def start(policy: str | LoadedPolicy, **kwargs: Any) -> RunningGateway:
        loaded = parse_and_build(policy, "test.yaml") if isinstance(policy, str) else policy
        gateway = Gateway(loaded, **kwargs)
        await gateway.start()
        started.append(gateway)
        return RunningGateway(gateway)

    yield start
    for gateway in reversed(started):
        await gateway.stop()

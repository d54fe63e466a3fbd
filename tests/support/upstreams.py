"""Real upstream servers for the gateway to forward to: one that records what reaches it (its
reply swappable per test), and one that answers after a delay the path names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer


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
    """A real upstream server that records what reaches it; tests swap ``reply`` freely."""

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
class SlowUpstream:
    """A real upstream that answers after ``delay_s`` (taken from the path: /delay/<seconds>)."""

    port: int = 0
    arrived: list[str] = field(default_factory=list)
    peers: list[int] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def slow_upstream() -> AsyncIterator[SlowUpstream]:
    upstream = SlowUpstream()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        upstream.arrived.append(request.raw_path)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        upstream.peers.append(int(peer[1]) if peer else 0)
        parts = request.path.split("/")
        if len(parts) >= 3 and parts[1] == "delay":
            await asyncio.sleep(float(parts[2]))
        upstream.answered.append(request.raw_path)
        return web.Response(text=f"done {request.raw_path}")

    server = RawTestServer(handle, host="127.0.0.1")
    await server.start_server()
    assert server.port is not None
    upstream.port = server.port
    yield upstream
    await server.close()

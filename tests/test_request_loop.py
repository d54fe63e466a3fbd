"""The listener's request loop (``gateway/edge/request_loop.py``): each request's handler runs in
its connection's task, not a task of its own, a client gone still cancels it, and aiohttp's idle
timer is kept across requests served at once (dropped only while a request waits).

A ``GatewayServer`` on the test's loop, real connections over loopback; the handlers call the
protocol's hooks as the proxy's handler does (``request_started``, ``request_waits``,
``request_finished``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.edge.server import GatewayProtocol, GatewayServer
from tests.support.rawhttp import status_of

_GET = b"GET /x HTTP/1.1\r\nHost: test\r\n\r\n"

TIMEOUT_S = 10.0

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[GatewayServer, int]]]]:
    """Starts a ``GatewayServer`` for a handler; closes what it started."""
    started: list[tuple[GatewayServer, asyncio.Server]] = []

    async def start(handler: Handler) -> tuple[GatewayServer, int]:
        server = GatewayServer(handler, header_timeout=30.0, max_connections=100)
        listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
        started.append((server, listener))
        return server, listener.sockets[0].getsockname()[1]

    yield start
    for server, listener in started:
        listener.close()
        await server.shutdown(1.0)


async def _ask(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes = _GET
) -> int:
    """One request on an open connection (each answer is ``ok``); its status."""
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
    assert await asyncio.wait_for(reader.readexactly(2), TIMEOUT_S) == b"ok"
    return status_of(head)


def _protocol(request: web.BaseRequest) -> GatewayProtocol:
    protocol = request.protocol
    assert isinstance(protocol, GatewayProtocol)
    return protocol


async def test_each_request_is_handled_in_its_connections_task(serve: Any) -> None:
    """No task per request: every request of a keep-alive connection runs in the one task
    aiohttp made for the connection (``request.task``)."""
    seen: list[tuple[asyncio.Task[Any] | None, asyncio.Task[None]]] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        seen.append((asyncio.current_task(), request.task))
        return web.Response(text="ok")

    _server, port = await serve(handler)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert [await _ask(reader, writer) for _ in range(3)] == [200, 200, 200]
    finally:
        writer.close()
    connection_task = seen[0][1]
    assert seen == [(connection_task, connection_task)] * 3


async def test_a_client_gone_cancels_its_handler_and_closes_the_connection(serve: Any) -> None:
    """The handler awaited in the connection's task is still cancelled when the client hangs
    up (what the proxy counts as 499), and the connection is let go."""
    entered = asyncio.Event()
    outcome: list[str] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return web.Response(text="never")

    server, port = await serve(handler)
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_GET)
    await asyncio.wait_for(entered.wait(), TIMEOUT_S)
    writer.close()
    for _ in range(int(TIMEOUT_S / 0.01)):
        if outcome and server.open_connections == 0:
            break
        await asyncio.sleep(0.01)
    assert outcome == ["cancelled"]
    assert server.open_connections == 0


async def test_the_idle_timer_is_kept_for_requests_served_at_once(serve: Any) -> None:
    """aiohttp's idle timer, armed when the connection opened, stays the same one across
    requests served at once (dropping it cost each request a new timer after its response); a
    request that waits for the limits drops it, and the next response arms one again."""
    timers: list[asyncio.TimerHandle | None] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        protocol = _protocol(request)
        protocol.request_started(request.content)
        if request.headers.get("X-Wait") == "1":
            protocol.request_waits()
        timers.append(protocol._keepalive_handle)
        protocol.request_finished()
        return web.Response(text="ok")

    _server, port = await serve(handler)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await _ask(reader, writer) == 200
        assert await _ask(reader, writer) == 200
        waits = b"GET /x HTTP/1.1\r\nHost: test\r\nX-Wait: 1\r\n\r\n"
        assert await _ask(reader, writer, waits) == 200
        assert await _ask(reader, writer) == 200
    finally:
        writer.close()
    first, second, waiting, after = timers
    assert first is not None and second is first
    assert waiting is None
    assert after is not None and after is not first

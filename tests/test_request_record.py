"""The gateway's own request record (``gateway/edge/request_record.py``) reads what aiohttp's
``BaseRequest`` properties give, for requests parsed by aiohttp's parser on a real listener:
HTTP/1.1 and 1.0, keep-alive as aiohttp decides it, a body, an upgrade, plain and TLS.

A ``GatewayServer`` on the test's loop, real connections over loopback; the request loop makes
the record from the parsed message and hands it to a handler with the proxy's entry, which
compares it with aiohttp's request made from the same message."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.edge.request_record import RequestRecord
from gateway.edge.server import GatewayProtocol, GatewayServer
from tests.support.certificates import make_tls_files
from tests.support.rawhttp import status_of

TIMEOUT_S = 10.0


def _differences(record: RequestRecord, request: web.BaseRequest) -> list[str]:
    """Where the record and aiohttp's properties disagree (nothing, when they agree)."""
    pairs: dict[str, tuple[object, object]] = {
        "method": (record.method, request.method),
        "raw_path": (record.raw_path, request.raw_path),
        "version": (record.version, request.version),
        "keep_alive": (record.keep_alive, request.keep_alive),
        "raw_headers": (record.raw_headers, request.raw_headers),
        "headers": (dict(record.headers), dict(request.headers)),
        "content": (record.content is request.content, True),
        "transport": (record.transport is request.transport, True),
        "listener": (record.listener is request.protocol, True),
        "remote": (record.remote(), request.remote),
        "peer": (record.peer, request.remote),
        "secure": (record.secure, request.secure),
        "query": (dict(record.query()), dict(request.query)),
        "upgrade": (record.upgrade, request.headers.get("Upgrade") is not None),
    }
    return [
        f"{name}: {ours!r} != {theirs!r}"
        for name, (ours, theirs) in pairs.items()
        if ours != theirs
    ]


class _RecordHandler:
    """A handler with the proxy's entry: the request loop hands it the record it made from the
    parsed message; aiohttp's request is made only when asked for, here to compare with."""

    def __init__(self, found: list[list[str]], secure: list[bool]) -> None:
        self.found = found
        self.secure = secure

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        raise AssertionError("the loop hands this handler records")

    async def serve_record(self, record: RequestRecord) -> web.StreamResponse:
        assert record.made_request() is None  # none made for it so far
        assert isinstance(record.listener, GatewayProtocol)
        request = record.aiohttp_request()
        assert record.aiohttp_request() is request  # made once
        return await _compare(record, request, self.found, self.secure)


async def _compare(
    record: RequestRecord, request: web.BaseRequest, found: list[list[str]], secure: list[bool]
) -> web.StreamResponse:
    if record.client() != request.remote:
        found.append([f"client: {record.client()!r}"])
    record.client_ip = "192.0.2.7"
    assert record.client() == "192.0.2.7"
    await request.read()
    found.append(_differences(record, request))
    secure.append(record.secure)
    return web.Response(text="ok")


@pytest.fixture
async def listener() -> AsyncIterator[Callable[[ssl.SSLContext | None], Any]]:
    """Starts a ``GatewayServer`` whose handler (with the proxy's entry: the request loop makes
    the record) records each request's differences from aiohttp's request."""
    started: list[tuple[GatewayServer, asyncio.Server]] = []

    async def start(context: ssl.SSLContext | None) -> tuple[int, list[list[str]], list[bool]]:
        found: list[list[str]] = []
        secure: list[bool] = []
        entry = _RecordHandler(found, secure)
        server = GatewayServer(entry, header_timeout=30.0, max_connections=100)
        loop = asyncio.get_running_loop()
        socket_server = await loop.create_server(server, "127.0.0.1", 0, ssl=context)
        started.append((server, socket_server))
        return socket_server.sockets[0].getsockname()[1], found, secure

    yield start
    for server, socket_server in started:
        socket_server.close()
        await server.shutdown(1.0)


REQUESTS = (
    b"GET /a%2Fb?x=1&x=2&y= HTTP/1.1\r\nHost: test\r\nX-Two: 1\r\nx-two: 2\r\n\r\n",
    b"POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /chat HTTP/1.1\r\nHost: test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"GET /old HTTP/1.0\r\nHost: test\r\nConnection: keep-alive\r\n\r\n",
    b"GET /closing HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
    b"GET /last HTTP/1.0\r\n\r\n",
)


async def _one(port: int, data: bytes, context: ssl.SSLContext | None) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(data)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
        return status_of(head)
    finally:
        writer.close()


async def test_the_record_reads_what_aiohttps_properties_give(listener: Any) -> None:
    port, found, secure = await listener(None)
    statuses = [await _one(port, data, None) for data in REQUESTS]
    assert statuses == [200] * len(REQUESTS)
    assert found == [[]] * len(REQUESTS)
    assert secure == [False] * len(REQUESTS)


async def test_over_tls_the_record_says_secure(listener: Any, tmp_path: Path) -> None:
    files = make_tls_files(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(files.server_cert, files.server_key)
    client_context = ssl.create_default_context(cafile=str(files.ca))
    port, found, secure = await listener(server_context)
    assert await _one(port, REQUESTS[0], client_context) == 200
    assert found == [[]]
    assert secure == [True]

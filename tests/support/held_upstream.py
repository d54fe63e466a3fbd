"""An upstream whose requests stay in flight until the test lets them go: for counting what a
concurrency limit lets through at once, and for ending a request every way one can end.

Paths (``NAME`` any word the test picks):

- ``/hold/NAME``: answers 200 once ``release(NAME)`` is called;
- ``/stream/NAME``: sends its head and a first chunk at once, the rest once released;
  (either with ``?status=CODE``: answers with that status instead of 200)
- ``/fail``: closes the connection without an answer (the gateway answers 502);
- ``/sleep``: answers after 30 s (past the gateway's read timeout: 504);
- ``/ws``: a WebSocket that echoes until the client closes it;
- anything else: 200 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import RawTestServer


@dataclass
class HeldUpstream:
    port: int = 0
    # Requests that arrived and have not been answered in full, by name.
    in_flight: dict[str, int] = field(default_factory=dict)
    arrived: int = 0
    _gates: dict[str, asyncio.Event] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gate(self, name: str) -> asyncio.Event:
        event = self._gates.get(name)
        if event is None:
            event = self._gates[name] = asyncio.Event()
        return event

    def release(self, name: str) -> None:
        self.gate(name).set()

    def holding(self) -> int:
        return sum(self.in_flight.values())


@pytest.fixture
async def held_upstream() -> AsyncIterator[HeldUpstream]:
    upstream = HeldUpstream()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        upstream.arrived += 1
        parts = request.path.split("/")
        kind = parts[1] if len(parts) > 1 else ""
        name = parts[2] if len(parts) > 2 else ""
        if kind == "fail":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if kind == "sleep":
            await asyncio.sleep(30)
            return web.Response(text="late")
        if kind == "ws":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await ws.send_str(msg.data)
            return ws
        if kind not in ("hold", "stream"):
            return web.Response(text="fast")
        upstream.in_flight[name] = upstream.in_flight.get(name, 0) + 1
        status = int(request.query.get("status", "200"))
        try:
            if kind == "hold":
                await upstream.gate(name).wait()
                return web.Response(status=status, text=f"done {name}")
            response = web.StreamResponse(status=status)
            response.content_length = 2 * 65536
            await response.prepare(request)
            await response.write(b"a" * 65536)
            await upstream.gate(name).wait()
            await response.write(b"b" * 65536)
            await response.write_eof()
            return response
        finally:
            upstream.in_flight[name] -= 1

    server = RawTestServer(handle, host="127.0.0.1")
    await server.start_server()
    assert server.port is not None
    upstream.port = server.port
    yield upstream
    for gate in upstream._gates.values():
        gate.set()
    await server.close()

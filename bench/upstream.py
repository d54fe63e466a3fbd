"""A fast benchmark upstream: every request gets 200 with a fixed 100-byte body.

Two implementations, so the harness can show the upstream is not the bottleneck:

- ``aiohttp``: aiohttp's low-level ``web.Server`` (the brief's starting point);
- ``httptools``: an asyncio protocol on the llhttp C parser that answers from a
  pre-built byte string. It does no routing and no header work, so it outruns
  ``web.Server`` by a wide margin and is the default.

Both run on uvloop when installed, keep connections alive, and honour
``Connection: close``. Run directly: ``python bench/upstream.py --port 8081``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import cast

import httptools
from aiohttp import web

BODY = b"x" * 99 + b"\n"
assert len(BODY) == 100

_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n"
RESPONSE_KEEPALIVE = _HEAD + b"\r\n" + BODY
RESPONSE_CLOSE = _HEAD + b"Connection: close\r\n\r\n" + BODY
# Both servers call listen() themselves, with a default backlog of 100-128: too short when a
# proxy opens connections beyond its keep-alive pool (nginx `keepalive 64` at 256 clients), where
# an overflowing accept queue drops SYNs and the kernel retries after 1 s (p99 of exactly ~1 s).
BACKLOG = 4096
RESPONSE_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _FixedResponseProtocol(asyncio.Protocol):
    """Parse with llhttp; on each complete message write the canned response."""

    __slots__ = ("_parser", "_transport")

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, don't assert.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply(RESPONSE_BAD, close=True)
        except httptools.HttpParserError:
            self._reply(RESPONSE_BAD, close=True)

    # httptools callback: a whole request (headers and any body) has arrived.
    def on_message_complete(self) -> None:
        if self._parser.should_keep_alive():
            self._reply(RESPONSE_KEEPALIVE, close=False)
        else:
            self._reply(RESPONSE_CLOSE, close=True)

    def _reply(self, response: bytes, *, close: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(response)
        if close:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


async def _aiohttp_handler(request: web.BaseRequest) -> web.Response:
    return web.Response(body=BODY, content_type="text/plain")


async def serve(impl: str, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Listen until SIGTERM/SIGINT; ``ready`` gets the bound port (useful with port 0)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    cleanup: Callable[[], Awaitable[None]]
    if impl == "httptools":
        server = await loop.create_server(_FixedResponseProtocol, sock=sock, backlog=BACKLOG)

        async def cleanup() -> None:
            server.close()
            await server.wait_closed()

    else:
        low_level = web.Server(_aiohttp_handler, access_log=None)
        runner = web.ServerRunner(low_level, handle_signals=False)
        await runner.setup()
        site = web.SockSite(runner, sock, backlog=BACKLOG)
        await site.start()
        cleanup = runner.cleanup
    ready(sock.getsockname()[1])
    try:
        await stop.wait()
    finally:
        await cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--impl", choices=("httptools", "aiohttp"), default="httptools")
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default loop")
    args = parser.parse_args()

    def ready(port: int) -> None:
        print(f"upstream ({args.impl}) listening on {args.host}:{port}", flush=True)

    run: Callable[[Coroutine[None, None, None]], None] = asyncio.run
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
    run(serve(args.impl, args.host, args.port, ready))


if __name__ == "__main__":
    main()

"""aiohttp's TCP site with a deadline on the TLS handshake: a client that opens a connection
and stalls mid-handshake (or sends nothing) is closed after ``server.header_timeout``, as one
that stalls mid-headers is, rather than after asyncio's default of a minute."""

from __future__ import annotations

import asyncio
import ssl

from aiohttp import web


class TlsSite(web.TCPSite):
    __slots__ = ("_handshake_timeout",)

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext,
        handshake_timeout: float,
        backlog: int,
        reuse_port: bool | None,
    ) -> None:
        super().__init__(
            runner, host, port, ssl_context=ssl_context, backlog=backlog, reuse_port=reuse_port
        )
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
        else:
            self._bound_port = self._port

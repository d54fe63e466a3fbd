"""The client-facing HTTP/1.1 listener: aiohttp's low-level server with the protections it lacks.

aiohttp's ``web.Server`` gives us its C request parser and response writer; this module adds a
deadline for receiving a request's headers (so a slow client cannot hold a connection by trickling
bytes), and a cap on open connections per worker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from gateway.policy import ServerSettings

_BUSY_BODY = b'{"status": 503, "error": "service_unavailable", "message": "too many connections"}'
_TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _MessageQueue(list[Any]):
    """aiohttp's per-connection queue of parsed requests, as a list: an empty ``deque`` is many
    times the size of an empty list, and this queue holds one or two entries (pipelining), on
    every connection a shaping queue holds (bench/README.md)."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)


class GatewayProtocol(RequestHandler):
    """One client connection; arms a header deadline whenever it waits for a request."""

    __slots__ = ("_awaiting_request", "_body", "_gw_server", "_header_deadline")

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        if type(self._messages) is deque and not self._messages:
            self._messages = _MessageQueue()  # type: ignore[assignment]
        self._gw_server = manager
        self._body: StreamReader | None = None
        self._awaiting_request = True
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._gw_server
        server.open_connections += 1
        super().connection_made(transport)
        if server.open_connections > server.max_connections:
            server.refused_connections += 1
            assert isinstance(transport, asyncio.Transport)
            transport.write(_TOO_MANY_CONNECTIONS)
            self.force_close()
            transport.close()
            return
        self._arm_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._gw_server.open_connections -= 1
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        if (
            self._awaiting_request
            and self._header_deadline is None
            and not self._messages
            and self.transport is not None
        ):
            # Part of a request head arrived (a whole one would be queued by now): from here
            # the rest must come within the deadline. Most requests arrive whole in one read,
            # so most never need a timer.
            self._arm_header_deadline()
        body = self._body
        if body is not None and len(self._messages) > queued and not body.is_eof():
            message = self._messages[-1][0]
            if isinstance(message, _ErrInfo):
                # aiohttp queues a parse error met inside a body as a next "request" and
                # leaves the body being read waiting forever; fail that read instead.
                body.set_exception(RequestPayloadError(message.message))

    def request_started(self, body: StreamReader | None = None) -> None:
        """Called by the proxy handler once a request's headers are in: the deadline is met."""
        self._body = body
        self._awaiting_request = False
        self._cancel_header_deadline()
        # aiohttp's idle timer has nothing to do while a request is served (it re-arms it after
        # the response); dropping it keeps each queued request to one timer-free connection.
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    def request_finished(self) -> None:
        """The next bytes on this connection begin a new request, under a new deadline."""
        self._body = None
        self._awaiting_request = True

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self._loop.call_later(
            self._gw_server.header_timeout, self._header_deadline_passed
        )

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self._awaiting_request and self.transport is not None:
            self._gw_server.header_timeouts += 1
            self.force_close()  # closes the transport too


class GatewayServer(web.Server):
    """``web.Server`` that builds ``GatewayProtocol`` connections."""

    def __init__(
        self,
        handler: Any,
        *,
        header_timeout: float,
        max_connections: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=True, **kwargs)
        self._protocol_kwargs = kwargs
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused_connections = 0
        self.header_timeouts = 0

    def reconfigure(self, settings: ServerSettings) -> None:
        """Apply a reloaded policy's connection settings; connections opened from now on get
        them (open ones keep theirs)."""
        self.header_timeout = settings.header_timeout
        self.max_connections = settings.max_connections
        self._protocol_kwargs.update(
            keepalive_timeout=settings.keepalive_timeout,
            max_line_size=settings.max_header_size,
            max_field_size=settings.max_header_size,
            max_headers=settings.max_headers,
        )

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._loop, **self._protocol_kwargs)

"""The client-facing HTTP/1.1 listener: aiohttp's low-level server with the protections it lacks.

aiohttp's ``web.Server`` gives us its C request parser and response writer; this module adds a
deadline for receiving a request's headers (so a slow client cannot hold a connection by trickling
bytes), and a cap on open connections per worker.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Coroutine
from typing import Any

# The modules defining the base classes of the non-native classes below: the compiled module
# looks them up by name, so they must be imported here by name.
import aiohttp.web_server  # noqa: F401
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from mypy_extensions import mypyc_attr

from gateway.edge.aiohttp_private import ErrInfo, MessageQueue
from gateway.edge.request_loop import serve_connection
from gateway.edge.responses import error_bytes, error_response
from gateway.edge.upgrade_stats import UpgradeStats
from gateway.policy.models import ServerSettings

_HEX_RE = re.compile(rb"[0-9A-Fa-f]+")
# No body is 2**60 bytes: a size this large is an attack on somebody's arithmetic, not a chunk.
ABSURD_CHUNK = 1 << 60


@mypyc_attr(native_class=False)
class ChunkTooLarge(RequestPayloadError):
    """A chunk announced a size that takes the body past ``max_body_size``."""


@mypyc_attr(native_class=False)
class ChunkSizeAbsurd(RequestPayloadError):
    """A chunk announced a size no body could have (llhttp takes up to 2**64 - 1)."""


class ChunkSizes:
    """Reads the chunk-size lines of one chunked body as its bytes arrive, so that a chunk
    announced larger than the body limit is refused before its bytes (or its head) go on.

    llhttp reads the body and stays the judge of its syntax: on anything this does not read as
    a well-formed size line it stops looking and leaves the request to llhttp.
    """

    __slots__ = ("_line", "_skip", "done", "largest", "payload", "total")

    def __init__(self, payload: StreamReader) -> None:
        self.payload = payload
        self._line = b""
        self._skip = 0  # bytes of chunk data (and its CRLF) still to pass over
        self.total = 0  # bytes the chunks so far announced
        self.largest = 0
        self.done = False

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end and not self.done:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            newline = data.find(b"\n", pos)
            if newline < 0:
                self._line += data[pos:]
                self.done = len(self._line) > 1024  # not a size line llhttp would take
                return
            line, self._line = self._line + data[pos:newline], b""
            pos = newline + 1
            digits = line.split(b";", 1)[0].rstrip(b"\r")
            if _HEX_RE.fullmatch(digits) is None:
                self.done = True
                return
            size = int(digits, 16)
            self.total += size
            self.largest = max(self.largest, size)
            if size == 0:
                self.done = True  # the last chunk: trailers follow
            self._skip = size + 2


# Compiled, these two stay non-native classes (they derive from aiohttp's): their methods are
# compiled, their attributes stay Python's. The private aiohttp attributes they use are named in
# ``aiohttp_private``.
@mypyc_attr(native_class=False)
class GatewayProtocol(RequestHandler):
    """One client connection; arms a header deadline whenever it waits for a request."""

    __slots__ = (
        "_awaiting_request",
        "_body",
        "_chunk_sizes",
        "_gw_server",
        "_header_deadline",
        "body_refused",
        "serve_record",
    )

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        if type(self._messages) is deque and not self._messages:
            self._messages = MessageQueue()  # type: ignore[assignment]
        self._gw_server = manager
        self._body: StreamReader | None = None
        self._awaiting_request = True
        self._header_deadline: asyncio.TimerHandle | None = None
        self._chunk_sizes: ChunkSizes | None = None
        # 413 or 400 once a chunk size refuses the body being received.
        self.body_refused = 0
        # The handler's entry taking the gateway's request record (the proxy's), if it has
        # one: the request loop then makes no aiohttp request for it (``request_record``).
        self.serve_record: Any = getattr(manager.request_handler, "serve_record", None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._gw_server
        server.open_connections += 1
        super().connection_made(transport)
        if server.stopping:
            # Accepted as the listener closed (after aiohttp closed the idle connections):
            # nothing would close it before its header deadline, holding the worker's exit.
            self.force_close()
            transport.close()
            return
        if server.open_connections > server.max_connections:
            server.refused_connections += 1
            assert isinstance(transport, asyncio.Transport)
            transport.write(error_bytes(503, "too many connections", server.legacy_error_body))
            self.force_close()
            transport.close()
            return
        self._arm_header_deadline()

    def start(self) -> Coroutine[Any, Any, None]:
        """The connection's request loop: aiohttp's, with each request's handler awaited in
        this connection's task, not a task of its own (``request_loop``)."""
        return serve_connection(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._gw_server.open_connections -= 1
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        messages = self._messages
        queued = len(messages)
        super().data_received(data)
        sizes = self._chunk_sizes
        if sizes is not None:
            sizes.feed(data)
            self._check_chunk_sizes(sizes)
        elif len(messages) == queued + 1:
            # Untyped: under aiohttp's C parser the message is not the NamedTuple its stubs say.
            parsed: Any = messages[-1][0]
            # Looked at here: compiled, a call of this class's own method is found by name.
            if not isinstance(parsed, ErrInfo) and parsed.chunked:
                self._watch_chunk_sizes(data)
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
            message: Any = self._messages[-1][0]
            if isinstance(message, ErrInfo):
                # aiohttp queues a parse error met inside a body as a next "request" and
                # leaves the body being read waiting forever; fail that read instead.
                body.set_exception(RequestPayloadError(message.message))

    @property
    def upgrades(self) -> UpgradeStats:
        """The listener's counters of upgraded connections, for the WebSocket relay."""
        return self._gw_server.upgrades

    def request_started(self, body: StreamReader | None = None) -> None:
        """Called by the proxy handler once a request's headers are in: the deadline is met."""
        self._body = body
        self._awaiting_request = False
        # ``_cancel_header_deadline``, inlined: compiled, a call of this class's own method is
        # found by name (some 600 instructions), and this runs on every request.
        deadline = self._header_deadline
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def request_waits(self) -> None:
        """Called by the proxy handler when its request waits for the limits (the shaping
        queue, a concurrency slot): aiohttp's idle timer has nothing to do until the response
        (after which it is armed again); dropping it keeps each waiting request to one
        timer-free connection. Left armed for a request served at once: its next firing finds
        the connection busy and lapses, or finds it idle again and re-arms itself, where
        cancelling it cost each request a new timer after its response."""
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    def request_finished(self) -> None:
        """The next bytes on this connection begin a new request, under a new deadline."""
        self._body = None
        self._awaiting_request = True
        self._chunk_sizes = None
        self.body_refused = 0

    def _watch_chunk_sizes(self, data: bytes) -> None:
        """If ``data`` begins with the chunked request just parsed (``data_received`` found it
        chunked), follow its chunk sizes.

        Only then is it certain where its body begins (llhttp wants CRLF line ends, so the
        head ends at the first blank line); a head that came in pieces, or a request behind
        another, keeps only the limit on the bytes actually received.
        """
        # Untyped: under aiohttp's C parser the message is not the NamedTuple its stubs say.
        entry: Any = self._messages[-1]
        message: Any = entry[0]
        payload: StreamReader = entry[1]
        if not data.startswith(f"{message.method} {message.path} ".encode("latin-1")):
            return
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return
        sizes = self._chunk_sizes = ChunkSizes(payload)
        sizes.feed(data[head_end + 4 :])
        self._check_chunk_sizes(sizes)

    def _check_chunk_sizes(self, sizes: ChunkSizes) -> None:
        limit = self._gw_server.max_body_size
        error: RequestPayloadError
        if sizes.largest >= ABSURD_CHUNK:
            self.body_refused, error = 400, ChunkSizeAbsurd("absurd chunk size")
        elif limit and sizes.total > limit:
            self.body_refused, error = 413, ChunkTooLarge("chunk past max_body_size")
        else:
            if sizes.done:
                self._chunk_sizes = None
            return
        self._chunk_sizes = None
        sizes.payload.set_exception(error)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a request aiohttp's parser refused (or a handler's failure): the
        gateway's own body, not aiohttp's text (nor its version in ``Server``); aiohttp still
        logs it, and the connection closes as aiohttp's would."""
        super().handle_error(request, status, exc, message)
        if status == 500:  # never a traceback
            detail = "internal error"
        else:  # aiohttp's message names what the parser refused
            detail = (message or "").split("\n", 1)[0] or "the request could not be read"
        legacy = self._gw_server.legacy_error_body
        return error_response(status, detail, close=True, legacy=legacy)

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


@mypyc_attr(native_class=False)
class GatewayServer(web.Server):
    """``web.Server`` that builds ``GatewayProtocol`` connections."""

    def __init__(
        self,
        handler: Any,
        *,
        header_timeout: float,
        max_connections: int,
        max_body_size: int = 0,
        legacy_error_body: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=True, **kwargs)
        self._protocol_kwargs = kwargs
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.max_body_size = max_body_size  # chunks announced past it are refused
        self.open_connections = 0
        self.refused_connections = 0
        self.header_timeouts = 0
        self.upgrades = UpgradeStats()  # WebSocket connections (gateway/websocket.py)
        self.stopping = False  # set once shutdown begins: connections made later are closed
        self.legacy_error_body = legacy_error_body  # server.error_body: legacy

    def pre_shutdown(self) -> None:
        self.stopping = True
        super().pre_shutdown()

    def reconfigure(self, settings: ServerSettings) -> None:
        """Apply a reloaded policy's connection settings; connections opened from now on get
        them (open ones keep theirs)."""
        self.header_timeout = settings.header_timeout
        self.max_connections = settings.max_connections
        self.max_body_size = settings.max_body_size
        self.legacy_error_body = settings.error_body == "legacy"
        self._protocol_kwargs.update(
            keepalive_timeout=settings.keepalive_timeout,
            max_line_size=settings.max_header_size,
            max_field_size=settings.max_header_size,
            max_headers=settings.max_headers,
        )

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._loop, **self._protocol_kwargs)

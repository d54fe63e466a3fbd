"""The upstream leg: an HTTP/1.1 keep-alive connection pool on asyncio protocols and httptools.

Forwarding through ``aiohttp.ClientSession`` costs most of a proxy's time per request (see
bench/README.md for the measured difference), so the gateway talks to its upstreams through this
small client:
one ``asyncio.Protocol`` per connection, httptools' C parser (llhttp) calling straight into the
response object, no Task per request, and a fast path where a small response that arrives in one
read is handed over whole (``body_complete``) so the gateway can answer with one write.

The caller builds the request head (already re-framed); this module frames a chunked body, reads and
checks the response framing, and never reuses a connection it cannot vouch for.
"""

from __future__ import annotations

import asyncio
import asyncio.protocols
import ssl as ssl_module
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar, cast

import httptools
from mypy_extensions import mypyc_attr

from gateway.edge.forwarding import lower_name
from gateway.exceptions import caused_by

__all__ = [
    "UpstreamClosed",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTimeout",
]

# Stop reading from the upstream while this much response body waits for a slow consumer.
_PAUSE_READING_BYTES = 256 * 1024
# Above this a bytes body is written beside the head rather than copied onto it.
_JOIN_BODY_MAX = 64 * 1024
_LAST_CHUNK = b"0\r\n\r\n"
# A parser bound to nothing: an ended connection's, so that its own parser (which holds the
# connection's callbacks, a reference cycle) goes when the connection does, not at the next
# collection (rare while serving: heap.py).
_DETACHED = httptools.HttpResponseParser(object())
_HTTP11 = (1, 1)
_HTTP10 = (1, 0)
# RFC 9110 section 9.2.2: a request with one of these methods may be sent again automatically.
_IDEMPOTENT_PREFIXES = (b"GET ", b"HEAD ", b"OPTIONS ", b"TRACE ", b"PUT ", b"DELETE ")
# Timers may fire a little early (uvloop counts in milliseconds); closer than this is "due".
_TIMER_SLACK_S = 0.001

_P = TypeVar("_P", bound=asyncio.BaseProtocol)


class UpstreamError(Exception):
    """Anything that went wrong talking to the upstream; the gateway answers 502 or 504."""


class UpstreamConnectError(UpstreamError):
    """The upstream refused or could not be reached (502)."""


class UpstreamTimeout(UpstreamError):
    """No connection within the connect timeout, or silence past the read timeout (504)."""


class UpstreamConnectTimeout(UpstreamTimeout):
    """No connection within the connect timeout: nothing of the request went out (504)."""


class UpstreamProtocolError(UpstreamError):
    """The upstream sent something that is not a well-framed HTTP/1.x response (502)."""


class UpstreamClosed(UpstreamError):
    """The upstream closed the connection before the response was complete (502)."""


class _StaleConnection(UpstreamClosed):
    """A reused connection died before any response byte: the upstream may have closed it while
    idle (the request then never reached it), or after taking the request (a crash): nothing
    here tells the two apart, so an idempotent request is sent once more on a new connection."""


class UpstreamResponse:
    """One upstream response: its head, parsed in place, and its body, whole or streamed.

    ``content_length`` is the upstream's ``Content-Length`` as sent (also for HEAD, 204 and 304,
    which carry no body). Call ``release()`` when done (the connection goes back to the pool only if
    the body was read to its end on a keep-alive connection) or ``close()`` to discard it.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_head_done",
        "_streamed",
        "chunked",
        "content_length",
        "headers",
        "keep_alive",
        "reason",
        "status",
        "version",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.reason = b""
        self.version = _HTTP11
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.chunked = False
        self.keep_alive = False
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._head_done = False
        self._complete = False
        self._streamed = False

    @property
    def body_complete(self) -> bool:
        """The whole body is buffered and none of it was read yet: ``body_bytes()`` has it all."""
        return self._complete and not self._streamed

    def body_bytes(self) -> bytes:
        """The whole body, when ``body_complete``."""
        if not self.body_complete:
            raise RuntimeError("the body is not complete yet: stream it with read_chunk()")
        self._streamed = True
        return self._take_buffered()

    async def read_chunk(self) -> bytes:
        """The next piece of body (all that is buffered), or ``b""`` at its end.

        Raises ``UpstreamClosed`` if the upstream closed before the end, so a truncated body is
        never mistaken for a whole one.
        """
        self._streamed = True
        while True:
            if self._chunks:
                return self._take_buffered()
            if self._complete:
                return b""
            conn = self._conn
            if conn is None:
                raise UpstreamClosed("the response was released before its body was read")
            if conn._exc is not None:
                raise conn._exc
            try:
                await conn._wait_upstream()
            except BaseException:
                # Cancelled (the client went away): the rest of this body is never wanted.
                conn._abandon()
                raise

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces, as ``read_chunk`` gives them, to its end."""
        return _BodyChunks(self)

    def release(self) -> None:
        """Done with the response: reuse its connection if it is clean, otherwise close it."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn._finish(self)

    def close(self) -> None:
        """Discard the response and its connection, whatever state they are in."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn._reusable = False
            conn._finish(self)

    def _take_buffered(self) -> bytes:
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn._reading_paused:
            conn._resume_reading()
        return data


class _BodyChunks:
    """``UpstreamResponse.iter_chunks``: an async iterator class (mypyc compiles no async
    generator)."""

    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> _BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.read_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk


# Compiled, a non-native class (it derives from asyncio's): its methods are compiled.
@mypyc_attr(native_class=False)
class _Connection(asyncio.Protocol):
    """One upstream connection: the parser's callback target and the request/response exchange."""

    __slots__ = (
        "_deadline",
        "_exc",
        "_expect_no_body",
        "_head_bytes",
        "_head_raw_bytes",
        "_in_idle",
        "_interim",
        "_loop",
        "_owned",
        "_parser",
        "_parser_spent",
        "_pool",
        "_read_timeout_s",
        "_reading_paused",
        "_received",
        "_resp",
        "_reusable",
        "_served",
        "_timer",
        "_timer_at",
        "_transport",
        "_waiter",
        "_writing_paused",
    )

    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        self._read_timeout_s = pool._read_timeout_s
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._parser_spent = False
        self._resp: UpstreamResponse | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._exc: UpstreamError | None = None
        self._expect_no_body = False
        self._interim = False
        self._head_bytes = 0
        self._head_raw_bytes = 0
        self._received = False
        self._reusable = True
        self._served = 0
        self._owned = False
        self._in_idle = False
        self._reading_paused = False
        self._writing_paused = False
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but quack alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        resp = self._resp
        if resp is None:
            # Bytes nobody asked for on an idle connection: nothing on it can be trusted now.
            self._abandon()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parse_failed(exc)
            return
        if not resp._head_done:
            # Still no end of head: all of these bytes were head, so a head trickled over many
            # reads (one endless header line, say) hits the limit before it is ever complete.
            self._head_raw_bytes += len(data)
            if self._head_raw_bytes > self._pool._max_head_bytes:
                self._fail(UpstreamProtocolError("response head too large"))
            return
        if resp._buffered > _PAUSE_READING_BYTES and not resp._complete:
            self._reading_paused = True
            assert self._transport is not None
            self._transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pool._connection_lost(self)
        self._parser = _DETACHED  # nothing is read after this
        resp = self._resp
        if resp is not None and not resp._complete and self._exc is None:
            if (
                resp._head_done
                and exc is None
                and resp.content_length is None
                and not resp.chunked
                and not self._expect_no_body
            ):
                resp._complete = True  # a body delimited by the close, and it closed cleanly
            elif not self._received and self._served:
                self._exc = _StaleConnection(self._lost_before_answering())
            else:
                # Before any byte of the answer on a fresh connection, over TLS, is how an
                # upstream that wants a client certificate refuses (TLS 1.3 says so after the
                # handshake): "before answering" lets the log say so.
                when = "mid-response" if self._received else "before answering"
                self._exc = UpstreamClosed(f"the upstream closed the connection {when}")
                self._exc.__cause__ = exc  # why, when the transport knows
        self._wake()

    def _lost_before_answering(self) -> str:
        """What is known of a reused connection lost before any byte of the answer: how long
        after the request went out (the read deadline was armed as it did). Not "idle": the
        upstream may have been working on it."""
        deadline = self._deadline
        if deadline is None:
            return "the upstream closed a kept-alive connection before answering"
        sent_ms = max(0.0, self._loop.time() - (deadline - self._read_timeout_s)) * 1000.0
        return (
            f"the upstream closed a kept-alive connection before answering, {sent_ms:.0f} ms "
            "after the request was sent"
        )

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake()

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self._resp
        if resp is None or resp._complete:
            raise UpstreamProtocolError("unexpected bytes after the response")

    def on_status(self, reason: bytes) -> None:
        assert self._resp is not None
        self._head_bytes += len(reason)
        self._resp.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self._resp
        assert resp is not None
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._pool._max_head_bytes:
            raise UpstreamProtocolError("response head too large")
        if resp._head_done:
            return  # a trailer field: counted against the limit, never forwarded
        resp.headers.append((name, value))
        size = len(name)
        if size == 14 and lower_name(name) == b"content-length":
            # llhttp already refuses a second Content-Length and anything but digits.
            if resp.content_length is not None:
                raise UpstreamProtocolError("duplicate Content-Length")
            try:
                resp.content_length = int(value)
            except ValueError:
                raise UpstreamProtocolError("invalid Content-Length") from None
        elif size == 17 and lower_name(name) == b"transfer-encoding":
            # The gateway drops Transfer-Encoding, so any coding but plain chunked would reach
            # the client still encoded; llhttp would also read "gzip" alone until close.
            if resp.chunked or value.strip().lower() != b"chunked":
                raise UpstreamProtocolError("unsupported Transfer-Encoding")
            resp.chunked = True

    def on_headers_complete(self) -> None:
        resp = self._resp
        assert resp is not None
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:
            # 1xx: interim, skipped. 101 would switch protocols (unsupported); llhttp knows only
            # some 1xx codes carry no body, so one with framing headers is refused outright.
            if status < 100 or status == 101 or resp.content_length is not None or resp.chunked:
                raise UpstreamProtocolError(f"unsupported interim status {status}")
            self._interim = True
            resp.headers = []
            resp.reason = b""
            return
        if status > 599:
            raise UpstreamProtocolError(f"invalid status {status}")
        version = parser.get_http_version()
        if version == "1.1":
            resp.version = _HTTP11
        elif version == "1.0":
            resp.version = _HTTP10
        else:
            raise UpstreamProtocolError(f"unsupported HTTP version {version}")
        resp.status = status
        resp.keep_alive = parser.should_keep_alive()
        resp._head_done = True
        if self._expect_no_body:
            # llhttp cannot be told a response answers HEAD: end the message here and give this
            # connection a fresh parser before its next request (the old one awaits a body).
            resp._complete = True
            self._parser_spent = True

    def on_body(self, body: bytes) -> None:
        resp = self._resp
        assert resp is not None
        if resp._complete:
            raise UpstreamProtocolError("body bytes on a response that has none")
        resp._chunks.append(body)
        resp._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        assert self._resp is not None
        self._resp._complete = True

    # -- the exchange -----------------------------------------------------------------------------

    async def exchange(
        self,
        head: bytes,
        body: AsyncIterable[bytes] | bytes | None,
        body_chunked: bool,
        expect_no_body: bool,
        read_timeout_s: float,
    ) -> UpstreamResponse:
        """Send one request and wait for its response head."""
        transport = self._transport
        if transport is None:
            raise _StaleConnection("the upstream closed an idle keep-alive connection")
        if self._parser_spent:
            self._parser = httptools.HttpResponseParser(self)
            self._parser_spent = False
        resp = UpstreamResponse(self)
        self._resp = resp
        self._read_timeout_s = read_timeout_s
        self._expect_no_body = expect_no_body
        self._head_bytes = 0
        self._head_raw_bytes = 0
        self._received = False
        try:
            if body is None:
                transport.write(head + _LAST_CHUNK if body_chunked else head)
            elif isinstance(body, bytes):
                if body_chunked:
                    if body:
                        transport.writelines((head, b"%x\r\n" % len(body), body, b"\r\n0\r\n\r\n"))
                    else:
                        transport.write(head + _LAST_CHUNK)
                elif len(body) <= _JOIN_BODY_MAX:
                    transport.write(head + body)
                else:
                    transport.writelines((head, body))
            else:
                await self._send_stream(transport, head, body, body_chunked)
            while not resp._head_done:
                if self._exc is not None:
                    raise self._exc
                await self._wait_upstream()
            return resp
        except BaseException:
            # Failed, timed out or cancelled: this connection is in an unknown state.
            resp._conn = None
            self._resp = None
            self._abandon()
            raise

    async def _send_stream(
        self,
        transport: asyncio.Transport,
        head: bytes,
        body: AsyncIterable[bytes],
        chunked: bool,
    ) -> None:
        """Write a streamed body, waiting on drain; stop early if the upstream answers first."""
        resp = self._resp
        assert resp is not None
        transport.write(head)
        async for chunk in body:
            if resp._head_done or self._exc is not None:
                break
            if not chunk:
                continue  # an empty chunk would end a chunked body
            if chunked:
                transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            else:
                transport.write(chunk)
            while self._writing_paused and not resp._head_done and self._exc is None:
                await self._wait_upstream()
        else:
            if chunked:
                transport.write(_LAST_CHUNK)
            return
        # The upstream answered (or failed) before taking the whole body: the framing on this
        # connection is off from here on.
        self._reusable = False

    async def _wait_upstream(self) -> None:
        """Wait for the upstream to send or drain something, at most the read timeout."""
        if self._transport is None:
            raise UpstreamClosed("the upstream connection is closed")
        self._arm(self._loop.time() + self._read_timeout_s)
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None
            self._deadline = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _parse_failed(self, exc: Exception) -> None:
        cause = exc.__context__
        resp = self._resp
        if resp is not None and resp._complete:
            # The response itself was whole; what followed it is discarded with the connection.
            self._abandon()
            return
        if isinstance(cause, UpstreamError):
            self._fail(cause)
        else:
            self._fail(UpstreamProtocolError(f"malformed response: {exc}"))

    def _fail(self, exc: UpstreamError) -> None:
        if self._exc is None:
            self._exc = exc
        self._abandon()
        self._wake()

    def _abandon(self) -> None:
        """Never reuse this connection; cut it now (RST) if it is still open."""
        self._reusable = False
        transport = self._transport
        if transport is not None:
            transport.abort()

    def _resume_reading(self) -> None:
        self._reading_paused = False
        if self._transport is not None:
            self._transport.resume_reading()

    def _finish(self, resp: UpstreamResponse) -> None:
        """The consumer is done with ``resp``: pool the connection or close it."""
        if self._resp is resp:
            self._resp = None
        transport = self._transport
        if transport is None:
            return
        if resp._complete and resp.keep_alive and self._reusable and self._exc is None:
            self._served += 1
            self._pool._put_idle(self)
        elif resp._complete and not transport.get_write_buffer_size():
            self._reusable = False
            transport.close()
        else:
            # Mid-body, or request bytes still queued (close() would wait to send them).
            self._abandon()

    # -- one timer per connection, for both the read and the idle timeout -------------------------

    def _arm(self, deadline: float) -> None:
        # Moving a deadline later only sets a number; the timer reschedules itself when it
        # fires early, so a request costs no timer allocation in the steady state.
        self._deadline = deadline
        timer = self._timer
        if timer is None or deadline < self._timer_at:
            if timer is not None:
                timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self._transport is None:
            return
        if self._loop.time() + _TIMER_SLACK_S < deadline:
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._on_timer)
            return
        self._deadline = None
        if self._resp is None:
            self._pool._expire_idle(self)
        elif self._waiter is not None:
            self._fail(UpstreamTimeout("the upstream sent nothing within the read timeout"))


class UpstreamPool:
    """Keep-alive connections to one upstream ``host:port``, at most ``max_connections`` of them.

    Idle connections are reused last-in first-out (the warmest first) and closed after
    ``idle_timeout_s``; when every connection is busy, requests wait in arrival order, and the
    connect timeout covers that wait as well as the connect itself. A pooled connection the
    upstream closed while idle is retried once on a fresh connection, only for requests that can
    be sent again safely: an idempotent method (RFC 9110 9.2.2) and a body held in memory.
    """

    __slots__ = (
        "_closed",
        "_connect_timeout_s",
        "_conns",
        "_host",
        "_idle",
        "_idle_timeout_s",
        "_loop",
        "_max_connections",
        "_max_head_bytes",
        "_max_idle",
        "_open",
        "_port",
        "_read_timeout_s",
        "_server_hostname",
        "_ssl",
        "_waiters",
    )

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 256,
        max_idle: int = 64,
        idle_timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_response_head_bytes: int = 64 * 1024,
        ssl: ssl_module.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if max_idle < 0:
            raise ValueError("max_idle must not be negative")
        if min(idle_timeout_s, connect_timeout_s, read_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if max_response_head_bytes < 1024:
            raise ValueError("max_response_head_bytes must be at least 1024")
        if server_hostname is not None and ssl is None:
            raise ValueError("server_hostname needs an ssl context")
        # Bound on first use, so a pool can be built before the loop runs (config checks).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._max_idle = max_idle
        self._idle_timeout_s = idle_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_head_bytes = max_response_head_bytes
        self._ssl = ssl
        self._server_hostname = server_hostname
        self._idle: list[_Connection] = []
        self._conns: set[_Connection] = set()
        # Connection slots taken: open connections plus connects in progress.
        self._open = 0
        # Each waiter receives a pooled connection, or None: a slot to connect with.
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def request(
        self,
        head: bytes,
        body: AsyncIterable[bytes] | bytes | None = None,
        *,
        body_chunked: bool = False,
        expect_no_body: bool = False,
        connect_timeout_s: float = 0.0,
        read_timeout_s: float = 0.0,
    ) -> UpstreamResponse:
        """Send ``head`` (request line, headers, blank line) and ``body``; return the response.

        ``body_chunked``: frame the body as chunked (the head says ``Transfer-Encoding: chunked``).
        ``expect_no_body``: the request is HEAD, so the response has no body whatever it says.
        ``connect_timeout_s``, ``read_timeout_s``: this request's (a route's), 0 for the pool's.
        Exceptions from a streamed ``body`` propagate unchanged (after the connection is cut).
        """
        if self._closed:
            raise UpstreamClosed("the upstream pool is closed")
        idle = self._idle
        if idle:
            conn = idle.pop()
            conn._in_idle = False
            conn._deadline = None
        else:
            conn = await self._acquire(False, connect_timeout_s)
        read_timeout_s = read_timeout_s or self._read_timeout_s
        try:
            return await conn.exchange(head, body, body_chunked, expect_no_body, read_timeout_s)
        except _StaleConnection as stale:
            if not (body is None or isinstance(body, bytes)):
                raise
            if not head.startswith(_IDEMPOTENT_PREFIXES):
                raise
            lost = str(stale)
        try:
            conn = await self._acquire(True, connect_timeout_s)
        except (UpstreamConnectError, UpstreamConnectTimeout) as not_again:
            # The request went out on the first connection: this attempt failed as that one
            # did (a reset), not as one that sent nothing, which a retry rule would send on
            # whatever its method.
            raise UpstreamClosed(f"{lost}; sent again on a new connection: {not_again}") from None
        return await conn.exchange(head, body, body_chunked, expect_no_body, read_timeout_s)

    async def connect_unpooled(
        self, protocol_factory: Callable[[], _P]
    ) -> tuple[asyncio.Transport, _P]:
        """A connection of its own to this upstream (a protocol switch: it never returns to the
        pool and takes no pool slot), within the connect timeout, failing as ``request`` does."""
        if self._closed:
            raise UpstreamClosed("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, protocol = await loop.create_connection(
                    protocol_factory,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._server_hostname,
                )
        except TimeoutError:
            raise UpstreamConnectTimeout(
                f"connecting to {self._host}:{self._port} timed out"
            ) from None
        except OSError as exc:
            raise caused_by(
                UpstreamConnectError(
                    f"cannot connect to {self._host}:{self._port}: {exc.strerror or exc}"
                ),
                exc,
            ) from exc
        return transport, protocol

    @property
    def read_timeout_s(self) -> float:
        return self._read_timeout_s

    async def close(self) -> None:
        """Close every connection (cutting any still in use) and refuse further requests."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(UpstreamClosed("the upstream pool is closed"))
        for conn in self._idle:
            if conn._transport is not None:
                conn._transport.close()
        for conn in list(self._conns):
            conn._abandon()
        # Let the transports report connection_lost, so nothing outlives the pool.
        for _ in range(100):
            if not self._conns:
                break
            await asyncio.sleep(0.01 if _ else 0)

    # -- slots and connections ------------------------------------------------------------------

    async def _acquire(self, fresh: bool, connect_timeout_s: float) -> _Connection:
        """A connection that is not idle in the pool: waits for a slot, then connects."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + (connect_timeout_s or self._connect_timeout_s)
        while self._open >= self._max_connections:
            conn = await self._wait_turn(loop, deadline)
            if conn is None:
                break  # handed a slot
            if conn._transport is None:
                continue  # died on the way; its slot went on elsewhere
            if not fresh:
                return conn
            # A retry wants a new connection: take over this one's slot and close it.
            conn._owned = False
            conn._reusable = False
            conn._transport.close()
            break
        else:
            self._open += 1
        return await self._connect(loop, deadline)

    async def _wait_turn(
        self, loop: asyncio.AbstractEventLoop, deadline: float
    ) -> _Connection | None:
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a connection or a slot just as we gave up: pass it on.
                handed = waiter.result()
                if handed is None:
                    self._release_slot()
                else:
                    self._put_idle(handed)
            else:
                waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectTimeout(
                    "no upstream connection free within the connect timeout"
                ) from None
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection:
        """Open a connection in a slot already taken; the slot is given back on failure."""
        try:
            if self._closed:
                raise UpstreamClosed("the upstream pool is closed")
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, loop),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._server_hostname,
                )
        except TimeoutError:
            self._release_slot()
            raise UpstreamConnectTimeout(
                f"connecting to {self._host}:{self._port} timed out"
            ) from None
        except OSError as exc:
            self._release_slot()
            raise caused_by(
                UpstreamConnectError(
                    f"cannot connect to {self._host}:{self._port}: {exc.strerror or exc}"
                ),
                exc,
            ) from exc
        except BaseException:
            self._release_slot()
            raise
        if conn._transport is None or self._closed:
            conn._abandon()
            self._release_slot()
            raise UpstreamClosed(f"{self._host}:{self._port}: connection closed as it opened")
        conn._owned = True
        self._conns.add(conn)
        return conn

    def _release_slot(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._open -= 1

    def _put_idle(self, conn: _Connection) -> None:
        """A clean connection is free: to the longest waiter, else onto the idle stack."""
        if conn._transport is None:
            return  # lost meanwhile; its slot went on when it closed
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if self._closed or len(self._idle) >= self._max_idle:
            conn._reusable = False
            conn._transport.close()
            return
        conn._in_idle = True
        self._idle.append(conn)
        conn._arm(conn._loop.time() + self._idle_timeout_s)

    def _expire_idle(self, conn: _Connection) -> None:
        if conn._in_idle:
            conn._in_idle = False
            self._idle.remove(conn)
            conn._reusable = False
            if conn._transport is not None:
                conn._transport.close()

    def _connection_lost(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        if conn._in_idle:
            conn._in_idle = False
            self._idle.remove(conn)
        if conn._owned:
            conn._owned = False
            self._release_slot()

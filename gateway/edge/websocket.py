"""WebSocket proxying: the ``Upgrade: websocket`` handshake (or another protocol
``server.upgrade_protocols`` lists) forwarded on an upstream connection of its own, then bytes
relayed both ways until both sides have closed.

The limits decide the handshake like any request (a refused one gets its 429 and rate-limit
headers, from the proxy handler). The upstream connection is never pooled: after a 101 it no
longer speaks HTTP. Only a 101 whose ``Upgrade`` is the protocol asked for switches the client
connection to the relay; any other answer is relayed as an ordinary response, and the client's
connection stays HTTP (aiohttp parses what follows as the next request).

Flow control is the transports' own: when the write buffer toward one side passes
``HIGH_WATER``, reading from the other side stops until it drains below ``LOW_WATER``. An end of
stream (a half-close) is passed on as one; the relay ends when both sides are closed, and closes
both when either is lost or when no byte has passed either way for ``websocket_idle_timeout``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import httptools
from aiohttp import HttpVersion11, web

from gateway.edge.annotations import upstream_error_reason
from gateway.edge.forwarding import (
    ForwardedFor,
    RequestFraming,
    build_request_head,
    response_head,
    response_headers,
)
from gateway.edge.next_upstream import hash_key
from gateway.edge.request_record import RequestRecord
from gateway.edge.responses import HttpDate, PreparedResponse
from gateway.edge.server import GatewayProtocol
from gateway.edge.upgrade_stats import UpgradeStats
from gateway.edge.upstream_client import (
    UpstreamClosed,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

if TYPE_CHECKING:
    from gateway.edge.runtime import Runtime, UpstreamTarget
    from gateway.engine.limit_engine import Outcome

# Write buffer toward one side above which the other side is no longer read, and below which
# reading resumes: at most about this much is held per direction, whatever the peers' speeds.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
# A refusal of the handshake (401, 403, 426 ...) is buffered whole, up to this.
MAX_REFUSAL_BODY = 1024 * 1024
_MAX_HEAD_BYTES = 64 * 1024
_DATE = HttpDate()


def wants_upgrade(request: RequestRecord, framing: RequestFraming, runtime: Runtime) -> bool:
    """An upgrade the gateway honours: an HTTP/1.1 ``GET`` without a body, one ``Upgrade``
    header naming a protocol of ``server.upgrade_protocols`` (``websocket``). Any other (``h2c``
    above all: a proxy that passed it on would let a client talk HTTP/2 to the upstream past
    every check) is forwarded as a plain request, its ``Upgrade`` dropped as hop-by-hop."""
    if request.method != "GET" or request.version != HttpVersion11 or framing.has_body:
        return False
    upgrade = request.headers.getall("Upgrade", ())
    return (
        len(upgrade) == 1
        and upgrade[0].strip().lower() in runtime.settings.upgrade_protocols
        and request.listener is not None
        and request.transport is not None
    )


async def forward_upgrade(
    request: RequestRecord,
    runtime: Runtime,
    upstream: UpstreamTarget,
    target: str,
    framing: RequestFraming,
    forwarded: ForwardedFor,
    outcome: Outcome | None,
) -> web.StreamResponse:
    """Forward the handshake; on a 101 relay until both sides close, else relay the answer."""
    loop = asyncio.get_running_loop()
    token = request.headers["Upgrade"].strip().lower().encode("latin-1")
    upgrade_headers = b"Connection: Upgrade\r\nUpgrade: " + token + b"\r\n\r\n"
    pool = upstream.pool
    route = request.route_name or ""
    server = pool.pick(
        (), hash_key(request, pool, route, forwarded.client_ip, runtime.engine.ipv6_prefix)
    )
    assert server is not None  # a first pick always finds one
    base_path = server.base_path
    head = build_request_head(
        "GET",
        base_path + target if base_path else target,
        request.raw_headers,
        framing,
        forwarded,
        runtime.via,
        underscores=runtime.underscores_in_headers,
    )
    # build_request_head drops Connection and Upgrade (hop-by-hop): this hop asks for them anew.
    head = head[:-2] + upgrade_headers
    limit_headers = (
        runtime.engine.header_block(outcome)
        if outcome is not None and outcome.verdict is not None
        else b""
    )
    connections = server.connections
    started_at = pool.started(server)
    failure: UpstreamError | None = None
    answered = False
    try:
        try:
            up_transport, up_side = await connections.connect_unpooled(lambda: _UpstreamSide(loop))
        except UpstreamError as exc:
            failure = exc
            return _upstream_failed(request, runtime, upstream, exc)
        try:
            up_transport.write(head)
            async with asyncio.timeout(connections.read_timeout_s):
                await up_side.head_received
                if up_side.status != 101:
                    await up_side.message_complete
        except TimeoutError:
            up_transport.abort()
            failure = UpstreamTimeout("the upstream sent nothing within the read timeout")
            return _upstream_failed(request, runtime, upstream, failure)
        except UpstreamError as exc:
            up_transport.abort()
            failure = exc
            return _upstream_failed(request, runtime, upstream, exc)
        except BaseException:
            up_transport.abort()
            raise
        answered = True
        pool.answered(server, up_side.status, started_at)
    finally:
        if failure is not None:
            pool.failed(server, upstream_error_reason(failure), failure)
        elif not answered:
            pool.unanswered(server)
        pool.finished(server)

    via = runtime.via
    if up_side.status != 101:
        up_transport.close()
        body = b"".join(up_side.body)
        keep_alive = request.keep_alive
        data = response_head(
            up_side.status,
            up_side.reason,
            up_side.headers,
            via,
            runtime.server_line + limit_headers,
            len(body),
            keep_alive,
            _DATE.now(),
            runtime.hidden_headers,
        )
        return cast(web.StreamResponse, PreparedResponse(up_side.status, data + body, keep_alive))
    if not _switches_to(token, up_side.headers):
        up_transport.abort()
        wrong = UpstreamProtocolError("101 to another protocol")
        pool.failures.record(server.config.url, server.label, wrong)
        return _upstream_failed(request, runtime, upstream, wrong)

    protocol = request.listener
    transport = request.transport
    assert isinstance(protocol, GatewayProtocol) and transport is not None
    lines = [b"HTTP/1.1 101 " + (up_side.reason or b"Switching Protocols") + b"\r\n"]
    for name, value in response_headers(up_side.headers, via, runtime.hidden_headers):
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(runtime.server_line)
    lines.append(limit_headers)
    lines.append(upgrade_headers)
    transport.write(b"".join(lines))

    relay = _Relay(
        loop,
        transport,
        up_transport,
        up_side,
        protocol.upgrades,
        runtime.settings.websocket_idle_timeout,
    )
    # Bytes the client sent after its handshake, which aiohttp kept aside for an upgrade.
    early = protocol._message_tail
    protocol._message_tail = b""
    relay.start(early)
    _release_when_done(protocol)
    # The relay needs nothing more of this runtime: a reload need not wait for the connection
    # to end before it retires it (the proxy handler counts the request done at the end).
    runtime.request_done()
    try:
        await relay.done
    except BaseException:  # cancelled: the gateway is shutting down
        relay.abort()
        raise
    finally:
        runtime.inflight += 1
    return cast(web.StreamResponse, PreparedResponse(101, b"", False))


def _upstream_failed(
    request: RequestRecord, runtime: Runtime, upstream: UpstreamTarget, exc: UpstreamError
) -> web.StreamResponse:
    """The answer to a handshake no server took (the pool logged why)."""
    request.upstream_error = upstream_error_reason(exc)
    name = upstream.name
    if isinstance(exc, UpstreamTimeout):
        return runtime.error_response(504, f"upstream {name!r}: timed out")
    if isinstance(exc, UpstreamProtocolError | UpstreamClosed):
        return runtime.error_response(502, f"upstream {name!r}: error")
    return runtime.error_response(502, f"upstream {name!r}: connection failed")


def _switches_to(token: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """The 101 switches to the protocol asked for, and says so (``Connection: upgrade``): a
    proxy that tunnelled on any 101 could be led to tunnel a connection the upstream keeps
    speaking HTTP on."""
    upgrade = [v for n, v in headers if n.lower() == b"upgrade"]
    connection = {
        t.strip().lower() for n, v in headers if n.lower() == b"connection" for t in v.split(b",")
    }
    same = len(upgrade) == 1 and upgrade[0].strip().lower() == token
    return same and b"upgrade" in connection


def _release_when_done(protocol: GatewayProtocol) -> None:
    """The client transport now reports to the relay, not to aiohttp's protocol: tell that
    protocol its connection is gone once its request loop has finished with the handshake's
    response, so the listener's bookkeeping (open connections, shutdown) closes as for any
    connection, and no cancellation reaches a handler that is ending on its own."""
    task = protocol._task_handler
    if task is None or task.done():
        asyncio.get_running_loop().call_soon(protocol.connection_lost, None)
    else:
        task.add_done_callback(lambda _task: protocol.connection_lost(None))


class _Side(asyncio.Protocol):
    """One end of the relay: what arrives here is written to the other end's transport."""

    __slots__ = ("eof", "lost", "relay", "transport")

    def __init__(self) -> None:
        self.relay: _Relay | None = None
        self.transport: asyncio.Transport | None = None
        self.eof = False
        self.lost = False

    def relay_data(self, data: bytes) -> None:
        relay = self.relay
        assert relay is not None
        relay.last_activity = relay.loop.time()
        if self is relay.client:
            relay.stats.bytes_from_client += len(data)
            relay.upstream_transport.write(data)
        else:
            relay.stats.bytes_from_upstream += len(data)
            relay.client_transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.relay_data(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self.relay is not None:
            self.relay.side_ended(self)
        return True  # keep writing toward this side: only its sending half is closed

    def pause_writing(self) -> None:
        # This side's write buffer is full: stop reading what would fill it further.
        if self.relay is not None:
            self.relay.other(self).pause()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.other(self).resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.eof = True
        if self.relay is not None:
            self.relay.side_lost(self)

    def pause(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.pause_reading()

    def resume(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()


class _UpstreamSide(_Side):
    """The upstream end; until its 101 it reads the handshake's answer with llhttp."""

    __slots__ = (
        "_head_bytes",
        "_parser",
        "body",
        "body_bytes",
        "early",
        "head_received",
        "headers",
        "message_complete",
        "reason",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head_bytes = 0
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.early = b""  # bytes after the 101's head, before the relay starts
        self.head_received: asyncio.Future[None] = loop.create_future()
        self.message_complete: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            if self.relay is None:
                self.early += data
            else:
                self.relay_data(data)
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # llhttp stops at the end of a 101's head; what follows is the new protocol.
            self._parser = None
            self.early = data[cast(int, exc.args[0]) :] if exc.args else b""
            self._settle(self.head_received)
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # raised by a callback of ours
            self._fail(
                cause
                if isinstance(cause, UpstreamError)
                else UpstreamProtocolError(f"malformed response: {exc}")
            )
            return
        if not self.head_received.done():
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError("response head too large"))

    def eof_received(self) -> bool:
        if self._parser is not None:
            return False  # before a 101: connection_lost tells the waiter
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._parser is not None:
            if self.head_received.done() and self.status != 101 and exc is None:
                self._settle(self.message_complete)  # a body delimited by the close
            self._fail(UpstreamClosed("the upstream closed the connection mid-response"))
        super().connection_lost(exc)

    def _fail(self, exc: UpstreamError) -> None:
        self._parser = None
        for waiter in (self.head_received, self.message_complete):
            if not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: only one of them is awaited
        if self.transport is not None:
            self.transport.abort()

    @staticmethod
    def _settle(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    # -- httptools callbacks --------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.headers = []  # interim (100, 103): skipped
            self.reason = b""
            return
        if status < 100 or status > 599:
            raise UpstreamProtocolError(f"invalid status {status}")
        self.status = status
        self._settle(self.head_received)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_bytes += len(body)
        if self.body_bytes > MAX_REFUSAL_BODY:
            raise UpstreamProtocolError("answer to a WebSocket handshake too large")

    def on_message_complete(self) -> None:
        if self.status:
            self._settle(self.message_complete)


class _Relay:
    """Both ends of one upgraded connection, its idle timer, and its figures."""

    __slots__ = (
        "_finished",
        "_idle_timeout_s",
        "_timer",
        "client",
        "client_transport",
        "done",
        "last_activity",
        "loop",
        "stats",
        "upstream",
        "upstream_transport",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client_transport: asyncio.Transport,
        upstream_transport: asyncio.Transport,
        upstream: _UpstreamSide,
        stats: UpgradeStats,
        idle_timeout_s: float,
    ) -> None:
        self.loop = loop
        self.client = _Side()
        self.client.transport = client_transport
        self.client_transport = client_transport
        self.upstream = upstream
        self.upstream_transport = upstream_transport
        self.stats = stats
        self._idle_timeout_s = idle_timeout_s
        self.last_activity = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        self._finished = False

    def start(self, early_from_client: bytes) -> None:
        stats = self.stats
        stats.open += 1
        stats.total += 1
        client, upstream = self.client, self.upstream
        client.relay = upstream.relay = self
        self.client_transport.set_protocol(client)
        for transport in (self.client_transport, self.upstream_transport):
            transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        # aiohttp may have paused reading to bound what it kept aside; the relay reads now.
        self.client_transport.resume_reading()
        if early_from_client:
            client.relay_data(early_from_client)
        if upstream.early:
            early, upstream.early = upstream.early, b""
            upstream.relay_data(early)
        # The upstream may have ended or closed between its 101 and now.
        if upstream.lost:
            self.side_lost(upstream)
        elif upstream.eof:
            self.side_ended(upstream)
        self._timer = self.loop.call_at(self.last_activity + self._idle_timeout_s, self._idle)

    def other(self, side: _Side) -> _Side:
        return self.upstream if side is self.client else self.client

    def side_ended(self, side: _Side) -> None:
        """``side`` sent its end of stream: pass it on, or close both if the other had too."""
        other = self.other(side)
        transport = other.transport
        if other.eof:
            self._close_both()
        elif transport is not None and not transport.is_closing():
            if transport.can_write_eof():
                transport.write_eof()  # sent once what is buffered has gone
            else:
                transport.close()  # TLS has no half-close

    def side_lost(self, side: _Side) -> None:
        other = self.other(side)
        if not other.lost:
            transport = other.transport
            if transport is not None and not transport.is_closing():
                transport.close()  # what is buffered toward it still goes
            return
        self._finish()

    def _close_both(self) -> None:
        for transport in (self.client_transport, self.upstream_transport):
            if not transport.is_closing():
                transport.close()

    def abort(self) -> None:
        for transport in (self.client_transport, self.upstream_transport):
            transport.abort()
        self._finish()

    def _idle(self) -> None:
        due = self.last_activity + self._idle_timeout_s
        if self.loop.time() < due - 0.001:
            self._timer = self.loop.call_at(due, self._idle)
            return
        self._timer = None
        self.stats.idle_timeouts += 1
        for transport in (self.client_transport, self.upstream_transport):
            # Nothing moved for the whole timeout: bytes still buffered will not go either.
            if transport.get_write_buffer_size():
                transport.abort()
            elif not transport.is_closing():
                transport.close()

    def _finish(self) -> None:
        if self._finished:  # not ``done.done()``: a cancelled wait cancels that future too
            return
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.stats.open -= 1
        if not self.done.done():
            self.done.set_result(None)

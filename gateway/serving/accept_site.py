"""The proxy listeners' accept loop: every connection waiting in the kernel's accept queue is
taken at each readiness of the listening socket, not one per turn of the event loop.

uvloop's ``create_server`` accepts one connection per turn of its loop (libuv 1.45 and later,
libuv pull request 3696: "don't accept() connections in a loop"). Idle, a turn is microseconds;
serving 200 connections, one turn is some 10 ms, so 256 clients that connect at once wait up to
2.5 s for their connection to be accepted, while their first request sits in the kernel. That
was the p99 of one worker at 256 connections (bench/README.md, "Fairness at 256 connections").
Here the listening socket is ours: a reader accepts up to ``ACCEPT_BATCH`` connections at each
readiness and hands each to the loop's ``connect_accepted_socket`` (the same transports, TLS
and handshake deadline as ``create_server``'s). Accepting is per connection, not per request:
this module stays interpreted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from gateway.log_throttle import LogThrottle

log = logging.getLogger("gateway.listener")

# Connections accepted at one readiness at most: bounds how long a flood of connects holds the
# loop (each costs some tens of µs); the rest wait for the next turn (the reader is level
# triggered).
ACCEPT_BATCH: Final = 256
# Out of file descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM): stop accepting this long, as
# asyncio's own server does, rather than spin on a listener that stays readable.
ACCEPT_RETRY_DELAY_S: Final = 1.0
_RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_throttle = LogThrottle(log)


async def listening_sockets(
    host: str | None, port: int, backlog: int, reuse_port: bool
) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for ``host:port``, one per address the name
    resolves to, as ``loop.create_server`` binds them (SO_REUSEADDR; IPv6 sockets IPv6 only);
    an error binding one closes them all and propagates (its ``errno`` says why)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class BatchAcceptor(asyncio.AbstractServer):
    """Accepts on ``sockets`` for ``protocol_factory`` (aiohttp's server); what aiohttp's site
    keeps as its server: ``close`` stops accepting, open connections stay."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        protocol_factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self._loop = loop
        self._sockets = sockets
        self._factory = protocol_factory
        self._ssl = ssl_context
        self._handshake_timeout = handshake_timeout if ssl_context is not None else None
        self._serving = False
        self._closed = False
        # Connections being set up (a TLS handshake): held so their tasks are not collected.
        self._opening: set[asyncio.Task[Any]] = set()
        self.accepted = 0  # connections accepted since start

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        self.start()

    def start(self) -> None:
        """Watch the listening sockets (idempotent; nothing after ``close``)."""
        if self._serving or self._closed:
            return
        self._serving = True
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self.accept_pending, sock)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pause()
        for sock in self._sockets:
            sock.close()

    async def wait_closed(self) -> None:
        return None

    async def serve_forever(self) -> None:
        raise NotImplementedError("the gateway's listeners are served by its own loop")

    def accept_pending(self, sock: socket.socket) -> int:
        """Accept what waits on ``sock``, up to ``ACCEPT_BATCH``; the number accepted."""
        accepted = 0
        while accepted < ACCEPT_BATCH:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRNOS:
                    self._out_of_resources(exc)
                    break
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client gave up before we took it: the next one
                cause = ("accept", exc.errno)
                if _throttle.due(cause):
                    _throttle.log(logging.ERROR, cause, f"cannot accept a connection: {exc}")
                break  # the socket stays readable: tried again next turn
            accepted += 1
            self._open(conn)
        self.accepted += accepted
        return accepted

    def _open(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        opening = self._loop.connect_accepted_socket(
            self._factory,
            conn,
            ssl=self._ssl,
            ssl_handshake_timeout=self._handshake_timeout,
        )
        task = self._loop.create_task(opening)
        self._opening.add(task)
        task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Task[Any]) -> None:
        self._opening.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        # A failed handshake or a client gone meanwhile: the transport is closed already, and
        # create_server's connections are as quiet about it.
        if exc is None or isinstance(exc, (OSError, ssl.SSLError, asyncio.TimeoutError)):
            return
        cause = ("open", type(exc).__name__)
        if _throttle.due(cause):
            _throttle.log(logging.ERROR, cause, f"opening an accepted connection: {exc!r}")

    def _out_of_resources(self, exc: OSError) -> None:
        cause = ("accept", exc.errno)
        if _throttle.due(cause):
            _throttle.log(
                logging.ERROR,
                cause,
                f"cannot accept connections ({exc.strerror}); "
                f"paused {ACCEPT_RETRY_DELAY_S:g} s (raise the open files limit)",
            )
        self._pause()
        self._loop.call_later(ACCEPT_RETRY_DELAY_S, self.start)

    def _pause(self) -> None:
        if not self._serving:
            return
        self._serving = False
        for sock in self._sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())


class AcceptSite(web.TCPSite):
    """aiohttp's TCP site on a ``BatchAcceptor``; with ``ssl_context``, a TLS listener whose
    handshake must end within ``handshake_timeout`` (``server.header_timeout``: a client that
    stalls mid-handshake is closed as one that stalls mid-headers is, not after asyncio's
    default of a minute)."""

    __slots__ = ("_handshake_timeout",)

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        backlog: int,
        reuse_port: bool | None,
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        super().__init__(
            runner, host, port, ssl_context=ssl_context, backlog=backlog, reuse_port=reuse_port
        )
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        sockets = await listening_sockets(
            self._host, self._port, self._backlog, bool(self._reuse_port)
        )
        acceptor = BatchAcceptor(
            asyncio.get_running_loop(),
            sockets,
            server,
            ssl_context=self._ssl_context,
            handshake_timeout=self._handshake_timeout,
        )
        acceptor.start()
        self._server = acceptor
        self._bound_port = sockets[0].getsockname()[1]

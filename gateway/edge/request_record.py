"""The gateway's own record of one proxied request: what the proxy, the observer and the access
log read of it, filled once from aiohttp's parsed message and the connection.

aiohttp's ``BaseRequest`` hands each of these out through a property (most of them ``reify``:
an interpreted call the first time each is read, a lookup in its cache after), and its mapping
(``request[KEY]``) through interpreted ``MutableMapping`` methods; compiled, reading the record
is a load from a native object (bench/README.md, "The gateway's own request record"). The
request loop (``request_loop``) makes the record from the parsed message; aiohttp's
``BaseRequest`` is made only where aiohttp's own code takes one (preparing an aiohttp response,
an error answer): most proxied requests are answered in the gateway's own bytes and never make
one.

What the proxy learns on the way (the route, the client, an upstream's failure, the costs the
upstream reported, an answer of the gateway's own) is written here too, for the observer and
the access log to read when the request is done.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import HttpVersion
from aiohttp.helpers import set_exception
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDictProxy, MultiMapping
from yarl import URL

from gateway.edge.upgrade_stats import UpgradeStats


class Listener(Protocol):
    """What the proxy asks of the client connection it serves (``server.GatewayProtocol``)."""

    # 413 or 400 once a chunk size refused the body being received.
    body_refused: int

    @property
    def upgrades(self) -> UpgradeStats: ...

    def request_started(self, body: StreamReader | None = None) -> None: ...

    def request_waits(self) -> None: ...

    def request_finished(self) -> None: ...


class RequestRecord:
    """One request as the gateway reads it, and what the proxy noted about it."""

    __slots__ = (
        "_message",
        "_request",
        "client_ip",
        "content",
        "headers",
        "keep_alive",
        "listener",
        "local_answer",
        "method",
        "peer",
        "peername",
        "protocol",
        "raw_headers",
        "raw_path",
        "reported_costs",
        "route_name",
        "secure",
        "transport",
        "upgrade",
        "upstream_error",
        "version",
    )

    def __init__(
        self,
        message: Any,
        payload: StreamReader,
        protocol: RequestHandler,
        listener: Listener | None,
    ) -> None:
        # ``message`` untyped: under aiohttp's C parser it is a C class, not the NamedTuple its
        # stubs say (compiled code that typed it would refuse it). What is read here is what
        # ``BaseRequest.__init__`` reads of the message and the protocol.
        self._message: Any = message
        # aiohttp's request for this one, made only when aiohttp's own code needs one.
        self._request: BaseRequest | None = None
        self.method: str = message.method
        self.raw_path: str = message.path  # as received: the target, query included
        self.version: HttpVersion = message.version
        self.keep_alive: bool = not message.should_close  # as aiohttp decides it
        self.upgrade: bool = message.upgrade
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = message.raw_headers
        self.headers: CIMultiDictProxy[str] = message.headers  # built by aiohttp's parser
        self.content = payload
        self.protocol = protocol
        self.listener = listener
        self.transport: asyncio.Transport | None = protocol.transport
        # The connection's, as aiohttp reads it once for the connection.
        connection: Any = protocol
        peername: Any = connection.peername
        self.peername: Any = peername
        self.peer: str | None = peername[0] if peername else None
        self.secure: bool = bool(connection.ssl_context)
        # Noted by the proxy as it goes, read when the request is done.
        self.route_name: str | None = None
        self.client_ip: str | None = None
        self.upstream_error: str | None = None
        self.reported_costs: dict[str, str] | None = None
        self.local_answer = False

    def aiohttp_request(self) -> BaseRequest:
        """aiohttp's ``BaseRequest`` for this request, for aiohttp's own code (preparing one of
        its responses, its error answers): made the first time it is asked for, as aiohttp's
        request loop would have made it (some 11,000 instructions with its writer, which a
        request answered in the gateway's own bytes never spends)."""
        request = self._request
        if request is None:
            protocol: Any = self.protocol
            writer = StreamWriter(protocol, protocol._loop)
            task = protocol._task_handler or asyncio.current_task()
            factory: Any = protocol._request_factory
            request = self._request = factory(self._message, self.content, protocol, writer, task)
        return request

    def made_request(self) -> BaseRequest | None:
        """aiohttp's request for this one if it was made (``aiohttp_request``), else None."""
        return self._request

    def _cancel(self, exc: BaseException) -> None:
        """As ``BaseRequest._cancel``: aiohttp's connection calls it on the request it serves
        when the client goes or the server shuts down, failing a read of the body."""
        set_exception(self.content, exc)

    def remote(self) -> str | None:
        """The connection's peer as aiohttp's ``BaseRequest.remote`` gives it."""
        peername = self.peername
        if peername is None:
            return None
        if isinstance(peername, (list, tuple)):
            return str(peername[0])
        return str(peername)

    def client(self) -> str:
        """The client as the logs name it: the resolved client address, else the peer."""
        client_ip = self.client_ip
        if client_ip is not None:
            return client_ip
        return self.remote() or "-"

    def query(self) -> MultiMapping[str]:
        """The query string's parameters, as ``BaseRequest.query``: the URL aiohttp's parser
        built, its query parsed (by yarl) when first asked for."""
        url: URL = self._message.url
        return url.query

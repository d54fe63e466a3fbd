"""The gateway's own record of one proxied request: what the proxy, the observer and the access
log read of it, filled once from aiohttp's parsed message and the connection.

aiohttp's ``BaseRequest`` hands each of these out through a property (most of them ``reify``:
an interpreted call the first time each is read, a lookup in its cache after), and its mapping
(``request[KEY]``) through interpreted ``MutableMapping`` methods; compiled, reading the record
is a load from a native object (bench/README.md, "The gateway's own request record"). The
``BaseRequest`` stays beside it for what aiohttp's own code still takes (preparing an aiohttp
response, the WebSocket handshake, the query string's parse).

What the proxy learns on the way (the route, the client, an upstream's failure, the costs the
upstream reported, an answer of the gateway's own) is written here too, for the observer and
the access log to read when the request is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import HttpVersion
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDictProxy, MultiMapping

from gateway.edge.server import GatewayProtocol


class RequestRecord:
    """One request as the gateway reads it, and what the proxy noted about it."""

    __slots__ = (
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
        "request",
        "route_name",
        "secure",
        "transport",
        "upgrade",
        "upstream_error",
        "version",
    )

    def __init__(self, request: BaseRequest) -> None:
        # Untyped: under aiohttp's C parser the message is a C class, not the NamedTuple its
        # stubs say (compiled code that typed it would refuse it). The attributes read here
        # are those ``BaseRequest.__init__`` set from the message and the protocol.
        source: Any = request
        message: Any = source._message
        protocol: RequestHandler = source._protocol
        self.request = request
        self.method: str = message.method
        self.raw_path: str = message.path  # as received: the target, query included
        self.version: HttpVersion = message.version
        self.keep_alive: bool = not message.should_close  # as aiohttp decides it
        self.upgrade: bool = message.upgrade
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = message.raw_headers
        self.headers: CIMultiDictProxy[str] = message.headers  # built by aiohttp's parser
        self.content: StreamReader = source._payload
        self.protocol = protocol
        self.listener: GatewayProtocol | None = (
            protocol if isinstance(protocol, GatewayProtocol) else None
        )
        self.transport: asyncio.Transport | None = protocol.transport
        # The connection's, as aiohttp read it once for the connection (``peername``).
        peername: Any = source._transport_peername
        self.peername: Any = peername
        self.peer: str | None = peername[0] if peername else None
        self.secure: bool = bool(source._transport_sslcontext)
        # Noted by the proxy as it goes, read when the request is done.
        self.route_name: str | None = None
        self.client_ip: str | None = None
        self.upstream_error: str | None = None
        self.reported_costs: dict[str, str] | None = None
        self.local_answer = False

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
        """The query string's parameters, parsed by aiohttp (yarl) when first asked for."""
        return self.request.query
